//! Ingestion throughput with a real local LLM: the first sessions of a LoCoMo conversation
//! ingested (turns + flush) into one memory by one thread, one session after another (the
//! reference), then into a fresh memory by one thread per session. Sessions encode concurrently
//! and the local LLM decodes their calls together, so the ratio shows what concurrent sessions
//! (the server's encode workers) gain on this machine.
//!
//! `cargo bench -p lycheemem-benches --bench ingest_concurrency -- --sessions 4 --batch 8`
//! (`--dataset PATH` defaults to `../shared/benchmarks/locomo/locomo_dev8.json` beside the
//! repository; `--item conv-26`; `--llm` a GGUF file, default SmolLM2-135M-Instruct from
//! `models/`.)

use lycheemem::{Components, Memory};
use lycheemem_bench::dataset;
use lycheemem_benches::arg;
use lycheemem_core::{Config, Namespace, SessionId};
use lycheemem_llm::{LocalLlm, LocalOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Outcome {
    wall: Duration,
    segments: usize,
    records: u64,
    calls: u64,
    tokens: u64,
}

fn main() -> anyhow::Result<()> {
    let sessions: usize = arg("--sessions", "4").parse()?;
    let batch: usize = arg("--batch", "8").parse()?;
    let item_id = arg("--item", "conv-26");
    let default_data =
        lycheemem_testkit::manifest_dir().join("../../shared/benchmarks/locomo/locomo_dev8.json");
    let data_path = PathBuf::from(arg("--dataset", &default_data.display().to_string()));
    let gguf = match arg("--llm", "") {
        s if s.is_empty() => {
            lycheemem_testkit::model_dir("smollm2-135m-instruct").join("model.gguf")
        }
        s => PathBuf::from(s),
    };
    let data = dataset::load(&data_path)
        .map_err(|e| anyhow::anyhow!("{}: {e} (pass --dataset)", data_path.display()))?;
    let item = data
        .items
        .iter()
        .find(|i| i.id == item_id)
        .ok_or_else(|| anyhow::anyhow!("no item {item_id} in {}", data_path.display()))?;
    let chosen: Vec<_> = item.sessions.iter().take(sessions).collect();
    let llm = Arc::new(LocalLlm::load(
        &gguf,
        LocalOptions {
            max_batch: batch,
            ..LocalOptions::default()
        },
    )?);
    let embedder = Arc::new(lycheemem_testkit::minilm());
    let ns = Namespace::new("bench")?;
    let turns: usize = chosen.iter().map(|s| s.turns.len()).sum();
    println!(
        "{} sessions of {item_id} ({turns} turns), encoder {} with up to {batch} calls decoded together",
        chosen.len(),
        gguf.file_name().unwrap_or_default().to_string_lossy()
    );

    let run = |concurrent: bool| -> anyhow::Result<Outcome> {
        let dir = tempfile::tempdir()?;
        let memory = Memory::with_components(
            dir.path(),
            Config::default(),
            Components::with_llm(embedder.clone(), llm.clone()),
        )?;
        let ingest = |s: &dataset::Session| -> lycheemem_core::Result<lycheemem::IngestReceipt> {
            let id = SessionId::new(s.id.clone())?;
            let mut r = memory.add_turns(&ns, &id, s.date.as_deref(), s.turns.clone())?;
            r.merge(memory.flush(&ns, &id)?);
            Ok(r)
        };
        let t0 = Instant::now();
        let receipts: Vec<lycheemem::IngestReceipt> = if concurrent {
            std::thread::scope(|scope| {
                let handles: Vec<_> = chosen.iter().map(|s| scope.spawn(|| ingest(s))).collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("ingest thread"))
                    .collect::<lycheemem_core::Result<_>>()
            })?
        } else {
            chosen
                .iter()
                .map(|s| ingest(s))
                .collect::<lycheemem_core::Result<_>>()?
        };
        let wall = t0.elapsed();
        Ok(Outcome {
            wall,
            segments: receipts.iter().map(|r| r.segments.len()).sum(),
            records: memory.stats(&ns)?.records,
            calls: receipts.iter().map(|r| r.encode_calls).sum(),
            tokens: receipts.iter().map(|r| r.encode_tokens).sum(),
        })
    };
    let one = run(false)?;
    let peak_alone = llm.peak_batch();
    let many = run(true)?;
    println!();
    println!(
        "| ingestion | wall s | segments | encode calls | encode tokens | records | tokens/s | wall vs reference |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, o) in [
        ("one session after another (reference)", &one),
        ("one thread per session", &many),
    ] {
        println!(
            "| {name} | {:.1} | {} | {} | {} | {} | {:.0} | {:.2}x |",
            o.wall.as_secs_f64(),
            o.segments,
            o.calls,
            o.tokens,
            o.records,
            o.tokens as f64 / o.wall.as_secs_f64(),
            o.wall.as_secs_f64() / one.wall.as_secs_f64()
        );
    }
    println!(
        "\npeak calls decoded together: {peak_alone} in the reference, {} overall",
        llm.peak_batch()
    );
    Ok(())
}
