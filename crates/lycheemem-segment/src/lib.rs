//! Online segmentation of a conversation into semantic segments (docs/algorithm.md,
//! "Segmentation"), driven only by the unit embeddings of its exchanges — no LLM, no model at
//! all: this crate takes `&[f32]`.
//!
//! - [`exchanges`]: turns → exchanges, incrementally (chat logs group a user message with the
//!   assistant replies that follow; two-speaker logs make every turn an exchange).
//! - [`signals`]: the boundary signals (surprise, cohesion drop, robust z, length and turn
//!   pressure) as pure functions.
//! - [`calibration`]: fits the similarity-scaled constants to an embedder from unlabeled
//!   conversations.
//! - [`segmenter`]: the policies (`semantic`, `per_exchange`, `fixed_window`) over one
//!   serializable per-session state, with a decision log of every feature of every decision.

pub mod calibration;
pub mod exchanges;
pub mod segmenter;
pub mod signals;

pub use exchanges::{ExchangeBuilder, ExchangeMode, PendingExchange};
pub use segmenter::{Action, Decision, ExchangeInput, Segmenter, SegmenterState};
