//! Text embedding and cross-encoder reranking on candle.
//!
//! Two small traits are the whole public contract — [`Embedder`] (texts → unit-norm vectors)
//! and [`Reranker`] (query × passages → relevance scores) — so callers never depend on a model
//! family. Implementations:
//! - [`BertEmbedder`]: BERT-family sentence embedders (all-MiniLM-L6-v2, BGE, ...) from the
//!   upstream `config.json`, `tokenizer.json` and sentence-transformers pooling config.
//! - [`CrossEncoder`]: BERT and XLM-RoBERTa sequence-classification checkpoints (the
//!   bge-reranker-base / bge-reranker-v2-m3 architectures).
//!
//! Models run where [`ComputeDevice`] says (`auto` by default: the first CUDA GPU when the
//! `cuda` cargo feature is on and one answers, else the CPU); see [`candle_device`].

mod bert_cpu;
mod bert_embedder;
mod cross_encoder;
mod runtime;

pub use bert_embedder::{BertEmbedder, EmbedEngine, EmbedderOptions, Pooling};
pub use cross_encoder::{CrossEncoder, CrossEncoderArch, CrossEncoderOptions};
pub use lycheemem_core::ComputeDevice;
pub use runtime::{CUDA_SUPPORT, candle_device, device_label, resolve_device};

use lycheemem_core::Result;

/// Turns texts into unit-norm vectors of a fixed dimension.
///
/// Implementations are `Send + Sync`: one loaded model serves every caller; calls may run
/// concurrently (each call is independent).
pub trait Embedder: Send + Sync {
    /// Embeds a batch of texts; vector `i` belongs to `texts[i]` and has unit L2 norm.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>>;
    /// Length of every vector.
    fn dimension(&self) -> usize;
    /// A stable identifier of the model (used to key stored vectors).
    fn model_id(&self) -> &str;
    /// The segmentation calibration fitted to this model's similarity scale, if one is known
    /// (`segment.surprise_calibration = "embedder"` uses it).
    fn segment_calibration(&self) -> Option<lycheemem_core::config::SegmentCalibration> {
        None
    }
}

/// Scores passages for relevance to a query; higher is more relevant.
pub trait Reranker: Send + Sync {
    /// One score per passage, in order.
    fn score(&self, query: &str, passages: &[&str]) -> Result<Vec<f32>>;
    fn model_id(&self) -> &str;
}

/// Cosine similarity (the one implementation lives in `lycheemem_core::vector`).
pub use lycheemem_core::vector::cosine;
