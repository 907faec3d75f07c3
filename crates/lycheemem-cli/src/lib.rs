//! What the `lycheemem` command and the `lycheemem-bench` harness command share: where settings
//! come from (flags, environment, the TOML file), model-download progress on the terminal, and how
//! a command ends (exit status, error line, hint).

pub mod exit;
pub mod fetch_progress;
pub mod settings;
