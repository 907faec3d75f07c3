//! LiCoMemory (CogniGraph) as a memory strategy of lycheemem (docs/licomemory.md): the second
//! seed system, built on the same embedder, LLM backends and store as LycheeMemory V2.
//!
//! Write path ([`write`]): each chunk (one exchange, or two consecutive turns of a two-speaker
//! log) costs a summary call (the session summary created or updated) and an extraction call
//! (typed entities and relations); entities are deduplicated (same type, word-set Jaccard) and
//! relations keep every session that stated them. Read path ([`read`]): one call for the
//! question's typed entities, anchor entities, a pool of triples, session relevance, CogniRank
//! (Weibull temporal decay) or SimpleRank, and the chunks of the best triples; [`answer`] builds
//! the answer prompt.
//!
//! Storage ([`graph`]): entities are entity nodes, triples are records (one per triple and
//! session), summaries are per-session state — so namespaces, durability, cascading deletes
//! and export/import are the store's.

pub mod answer;
pub mod graph;
pub mod prompts;
pub mod rank;
pub mod read;
pub mod schema;
pub mod write;

pub use answer::{answer, answer_messages};
pub use graph::{Entity, EntityType, Triple};
pub use read::{LicoRequest, LicoRetriever, QueryAnalysis, query_entities};
pub use write::{
    ChunkExtraction, ChunkWriter, SUMMARY_STATE, SessionSummary, organize_chunk, summary_state,
};
