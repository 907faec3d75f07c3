//! The write path after segmentation:
//! - [`encoder`]: one LLM call turns a finalized segment into typed, self-contained records
//!   (docs/algorithm.md, "Encoding"), with the bounded reference context ρ ([`reference`]), the
//!   record JSON Schema ([`schema`]), lenient parsing and validation ([`parse`]) and one repair
//!   round.
//! - [`organize`]: records → evidence-node upserts (entity, topic, entity×topic, temporal,
//!   event frame; docs/algorithm.md, "Evidence nodes"). Pure functions, no model.
//! - [`segment_write`]: a finalized segment → the store write that records it (turns and ρ
//!   read from the store, encode, organize and merge nodes, embed, advance ρ).

pub mod encoder;
pub mod organize;
pub mod parse;
pub mod reference;
pub mod schema;
pub mod segment_write;

pub use encoder::{EncodeOutcome, SegmentEncoder, SegmentInput};
pub use organize::{NodeUpsert, organize};
pub use reference::ReferenceContext;
pub use segment_write::{
    BuiltSegment, EncodedSegment, REFERENCE_STATE, build_segment_write, encode_segment,
    organize_segment,
};
