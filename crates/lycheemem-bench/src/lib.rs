//! lycheemem's benchmark harness. LoCoMo and LongMemEval are loaded defensively
//! ([`dataset`]); every system under test is a named configuration ([`variant`]): the method,
//! its construction and retrieval ablations, and the `naive_rag` / `full_context` baselines
//! ([`baseline`]). A run ([`run`]) builds each item's memory once per construction config
//! (cached by its hash, resumable — [`construct`]), evaluates every variant on the selected
//! questions with one checkpoint line per prediction, and scores evidence recall, official
//! LoCoMo F1 and LLM-judge accuracy ([`metrics`]). [`report`] turns the checkpoints into JSON,
//! Markdown tables and SVG plots.

pub mod baseline;
pub mod construct;
pub mod dataset;
pub mod jsonl;
pub mod metrics;
pub mod peer;
pub mod replay;
pub mod report;
pub mod run;
pub mod synthetic;
pub mod variant;

pub use dataset::{Dataset, DatasetKind, Item, Question, TurnAt};
pub use replay::ReplayLlm;
pub use report::{RunMeta, write_reports};
pub use run::{Backends, Prediction, RunSpec};
pub use variant::{VARIANTS, Variant, VariantKind};
