//! Core vocabulary of lycheemem: the domain types every other crate speaks, the typed
//! configuration holding every constant of the LycheeMemory V2 algorithm (see
//! `docs/algorithm.md`), the error type, and pure helpers (key normalization, date parsing,
//! token estimation).
//!
//! This crate performs no I/O beyond reading a config file on request and never touches a model.

pub mod cancel;
pub mod config;
pub mod date;
pub mod error;
pub mod evidence;
pub mod normalize;
pub mod plan;
pub mod record;
pub mod text;
pub mod tokens;
pub mod turn;
pub mod usage;
pub mod vector;

pub use cancel::Cancel;
pub use config::{ComputeDevice, Config, ForcedTokens, LlmWeights, MemoryStrategy};
pub use error::{Error, Result};
pub use evidence::{Candidate, CandidateTarget, Channel, Evidence, Provenance};
pub use normalize::normalize_key;
pub use plan::{Constraint, Plan, QuestionType, Route, TemporalFilter};
pub use record::{EvidenceNode, MemoryType, NodeKind, Record, SourceRole, TemporalScope};
pub use tokens::estimate_tokens;
pub use turn::{Exchange, FinalizeReason, Namespace, Role, Segment, SessionId, Turn, TurnRef};
pub use usage::{Purpose, TokenUsage, UsageTotals};
