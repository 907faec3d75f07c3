//! Where a memory command's settings come from, lowest precedence first: built-in defaults, the
//! TOML file (`--config` / `LYCHEEMEM_CONFIG`), environment (`LYCHEEMEM_STORE`,
//! `LYCHEEMEM_NAMESPACE`, `LYCHEEMEM_LLM`, …), then flags.

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lycheemem::{Components, Memory};
use lycheemem_core::{Config, Namespace};
use lycheemem_models::FetchEvent;
use std::path::{Path, PathBuf};

/// `--models-dir`, shared by every command of both binaries.
#[derive(Args, Clone, Debug)]
pub struct ModelsDir {
    /// Models folder (default: ./models of the enclosing checkout, or $LYCHEEMEM_MODELS).
    #[arg(long = "models-dir", global = true, env = "LYCHEEMEM_MODELS")]
    dir: Option<PathBuf>,
}

impl ModelsDir {
    /// The folder given, or the default one.
    pub fn resolve(self) -> PathBuf {
        self.dir
            .unwrap_or_else(lycheemem_models::default_models_dir)
    }
}

#[derive(Args, Clone, Debug)]
pub struct MemoryArgs {
    /// Store directory.
    #[arg(long, env = "LYCHEEMEM_STORE", default_value = "lycheemem-data")]
    pub store: PathBuf,
    /// Namespace (user / tenant).
    #[arg(
        long,
        short = 'n',
        env = "LYCHEEMEM_NAMESPACE",
        default_value = "default"
    )]
    pub namespace: String,
    #[command(flatten)]
    pub models: ModelArgs,
}

/// The configuration file and the model choices (shared by memory commands and benchmarks).
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// TOML configuration file (every field optional; see the README).
    #[arg(long, env = "LYCHEEMEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// LLM for every purpose: `local:<manifest model or .gguf path>` or `openai:<model>@<url>`.
    #[arg(long, env = "LYCHEEMEM_LLM")]
    pub llm: Option<String>,
    /// LLM for segment encoding (overrides --llm).
    #[arg(long, env = "LYCHEEMEM_ENCODE_LLM")]
    pub encode_llm: Option<String>,
    /// LLM for query planning (overrides --llm).
    #[arg(long, env = "LYCHEEMEM_PLAN_LLM")]
    pub plan_llm: Option<String>,
    /// LLM for answering (overrides --llm).
    #[arg(long, env = "LYCHEEMEM_ANSWER_LLM")]
    pub answer_llm: Option<String>,
    /// Embedder: a manifest model or `dir:<path>`.
    #[arg(long, env = "LYCHEEMEM_EMBEDDER")]
    pub embedder: Option<String>,
    /// Inference threads (0 = all cores).
    #[arg(long, env = "LYCHEEMEM_THREADS")]
    pub threads: Option<usize>,
    /// Local LLMs: most concurrent calls decoded together (0 = default 8, 1 = one at a time).
    #[arg(long, env = "LYCHEEMEM_LLM_BATCH")]
    pub llm_batch: Option<usize>,
    /// Where the embedder, reranker and local LLMs run: auto (a CUDA GPU when this binary has
    /// CUDA support and one is present, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, env = "LYCHEEMEM_DEVICE")]
    pub device: Option<lycheemem_core::ComputeDevice>,
}

impl MemoryArgs {
    pub fn namespace(&self) -> Result<Namespace> {
        Ok(Namespace::new(self.namespace.clone())?)
    }

    /// The effective configuration.
    pub fn config(&self) -> Result<Config> {
        self.models.config()
    }

    /// Loads the models (fetching missing ones with a progress bar) and opens the memory.
    pub fn open(&self, models_dir: &Path) -> Result<Memory> {
        let cfg = self.config()?;
        let components = load_components(&cfg, models_dir)?;
        Memory::with_components(&self.store, cfg, components)
            .with_context(|| format!("opening the store {}", self.store.display()))
    }
}

impl ModelArgs {
    /// The effective configuration.
    pub fn config(&self) -> Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => Config::from_toml_file(path)
                .with_context(|| format!("configuration {}", path.display()))?,
            None => Config::default(),
        };
        if let Some(l) = &self.llm {
            cfg.models.encode_llm = l.clone();
            cfg.models.plan_llm = l.clone();
            cfg.models.answer_llm = l.clone();
        }
        if let Some(l) = &self.encode_llm {
            cfg.models.encode_llm = l.clone();
        }
        if let Some(l) = &self.plan_llm {
            cfg.models.plan_llm = l.clone();
        }
        if let Some(l) = &self.answer_llm {
            cfg.models.answer_llm = l.clone();
        }
        if let Some(e) = &self.embedder {
            cfg.models.embedder = e.clone();
        }
        if let Some(b) = self.llm_batch {
            cfg.models.llm_batch = b;
        }
        if let Some(t) = self.threads {
            cfg.models.threads = t;
        }
        if let Some(d) = self.device {
            cfg.models.device = d;
        }
        Ok(cfg)
    }
}

/// Loads the configured models, showing download progress for any that must be fetched.
pub fn load_components(cfg: &Config, models_dir: &Path) -> Result<Components> {
    let bar = ProgressBar::hidden();
    bar.set_style(
        ProgressStyle::with_template("{msg} {bytes}/{total_bytes} [{bar:30}] {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut on_fetch = |event: FetchEvent| {
        if bar.is_hidden() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        crate::fetch_progress::show_fetch_event(&bar, event);
    };
    let components = Components::from_config(cfg, models_dir, &mut on_fetch)?;
    bar.finish_and_clear();
    Ok(components)
}
