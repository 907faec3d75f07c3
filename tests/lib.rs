//! Cross-crate integration tests live beside this file (`model_files.rs`, ...); this library is
//! empty on purpose.
