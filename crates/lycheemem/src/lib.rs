//! lycheemem: long-term memory for LLM agents that runs offline on one machine.
//!
//! [`Memory`] composes the layers: raw turns are stored (durably) and embedded on arrival,
//! grouped online into semantic segments, and each finalized segment costs one LLM call that
//! turns it into typed, self-contained records indexed by entity, topic, time and event. A
//! question costs one planning call and one answering call around deterministic multi-route
//! recall. Backends — embedder, reranker, and an LLM per purpose (encode, plan, answer), local
//! GGUF or any OpenAI-compatible server — are chosen by config ([`Components::from_config`]) or
//! passed in ([`Memory::with_components`]).
//!
//! ```no_run
//! use lycheemem::{Memory, NewTurn, QueryOptions};
//! use lycheemem_core::{Config, Namespace, SessionId};
//! # fn main() -> lycheemem_core::Result<()> {
//! let memory = Memory::open("my-memory", Config::default(), "models".as_ref())?;
//! let ns = Namespace::new("alice")?;
//! let session = SessionId::new("2024-03-02-chat")?;
//! memory.add_turns(&ns, &session, Some("2024-03-02"), vec![
//!     NewTurn::user("I adopted a beagle called Rex yesterday!"),
//!     NewTurn::assistant("Congratulations! How is Rex settling in?"),
//! ])?;
//! memory.flush(&ns, &session)?;
//! let answer = memory.answer(&ns, "When did I adopt my dog?", &QueryOptions::default())?;
//! println!("{} ({} tokens)", answer.text, answer.tokens());
//! # Ok(()) }
//! ```

pub mod calibrate;
mod components;
pub mod formats;
mod memory;
mod migrate;

pub use components::Components;
/// Whether this build can run models on CUDA GPUs (the `cuda` feature).
pub use lycheemem_embed::CUDA_SUPPORT;
/// The embedder trait [`Components::embedder`] implements.
pub use lycheemem_embed::Embedder;
/// Where the models run, with `auto` decided (the GPU, or the CPU).
pub use lycheemem_embed::resolve_device;
pub use memory::{
    Answer, AppendReceipt, Construction, INGEST_STATE, IngestReceipt, MAX_LABEL_CHARS,
    MAX_TURN_CHARS, Memory, NewTurn, QueryOptions, RederiveReport, SegmentSummary,
    is_postgres_location, mark_sessions_processed,
};
pub use migrate::{MigrateOptions, MigrateReport, migrate_namespace};

pub use lycheemem_core as core;
pub use lycheemem_retrieve::{EvidenceItem, MAX_TOP_K, SearchResult};
pub use lycheemem_store::{DeleteReceipt, ImportReceipt, NamespaceStats};

/// The storage traits [`Memory::store`] answers through, and the types they return: what a
/// caller needs to read a memory's sessions, segments and records directly.
pub mod store {
    pub use lycheemem_store::prelude::*;
    pub use lycheemem_store::{ExportOptions, SegmentOutcome, SegmentRow, SessionInfo};
}
