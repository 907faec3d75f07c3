//! The error type shared by the lycheemem crates. Each variant names what went wrong in words a
//! user can act on; lower crates wrap their own failures into these variants.

use std::path::PathBuf;

/// Result alias used across lycheemem.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in lycheemem, grouped by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (a bad value, an unknown key, an unreadable file).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A model is missing, corrupt, or cannot be loaded.
    #[error("model error: {0}")]
    Model(String),
    /// Input supplied by the caller was rejected (malformed, too large, invalid date, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// An LLM returned output that could not be used, even after repair.
    #[error("LLM output rejected: {0}")]
    LlmOutput(String),
    /// The storage layer failed.
    #[error("storage error: {0}")]
    Store(String),
    /// The request contradicts what is stored (e.g. a turn re-sent with other content).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The work was stopped because its caller went away (see [`crate::Cancel`]).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The work needs more than a budget allows (e.g. a prompt plus its completion budget
    /// exceeds the model's context).
    #[error("over budget: {0}")]
    Budget(String),
    /// The storage is held by another process (a store directory is opened by one process at
    /// a time; reach a shared memory through its server).
    #[error("locked: {0}")]
    Locked(String),
    /// Something was looked up that does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A filesystem operation failed on a named path.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
