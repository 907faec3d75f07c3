//! `lycheemem-bench segment`: how the segmentation policies cut real conversations. On LoCoMo
//! with the configured embedder, per conversation: exchanges, segments, turns per segment (mean
//! and distribution) and finalize-reason counts, for `semantic`, `fixed_window` and
//! `per_exchange` — and, with `--fit-on`, `semantic_calibrated`: semantic segmentation with a
//! calibration fitted on other, unlabeled conversations (docs/algorithm.md, "Calibration to the
//! embedder").

use anyhow::Result;
use clap::Args;
use lycheemem_core::config::{SegmentConfig, SegmentPolicy};
use lycheemem_core::{FinalizeReason, Turn};
use lycheemem_embed::Embedder;
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
    /// Fit a calibration on these conversation files (any format `lycheemem ingest` reads) and
    /// add a `semantic_calibrated` row.
    #[arg(long)]
    fit_on: Vec<PathBuf>,
    /// Conversations (by name) the fit leaves out, e.g. the ones segmented here.
    #[arg(long, value_delimiter = ',')]
    fit_skip: Vec<String>,
    /// Only these LoCoMo conversations (default: all).
    #[arg(long, value_delimiter = ',')]
    items: Vec<String>,
    /// Add a row for the `[segment]` section of this config file (TOML as `lycheemem` reads it;
    /// an empty file is the default construction), resolved with the embedder's calibration from
    /// its manifest entry as a memory resolves it; the row is named after the file. Repeatable.
    #[arg(long)]
    config: Vec<PathBuf>,
}

/// The `(row name, segmentation)` of each `--config` file, as a memory would segment with it.
fn configured_policies(
    files: &[PathBuf],
    embedder: &dyn Embedder,
) -> Result<Vec<(String, SegmentConfig)>> {
    files
        .iter()
        .map(|path| {
            let cfg = lycheemem_core::Config::from_toml_file(path)?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| path.display().to_string());
            let resolved = cfg
                .segment
                .resolved(embedder.segment_calibration().as_ref());
            Ok((format!("config:{name}"), resolved))
        })
        .collect()
}

/// Fits the calibration on `files` without the conversations named in `skip`.
fn fit_calibration(
    embedder: &dyn Embedder,
    files: &[PathBuf],
    skip: &[String],
    segment: &SegmentConfig,
) -> Result<SegmentConfig> {
    let conversations = lycheemem::calibrate::read_conversations(files, skip, None)?;
    let fit = lycheemem::calibrate::fit_segment_calibration(embedder, &conversations, segment)?;
    println!(
        "calibration fitted on {} conversations, {}\n(published: {}, {}, {})\n",
        conversations.len(),
        fit.describe(),
        segment.abs_surprise_center,
        segment.abs_surprise_scale,
        segment.cohesion_scale
    );
    let mut calibrated = segment.clone();
    calibrated.surprise_calibration = lycheemem_core::config::CalibrationSource::Embedder;
    Ok(calibrated.resolved(Some(&fit.calibration)))
}

/// `p`-th percentile (nearest rank) of sorted `v`, 0 when empty.
fn percentile(v: &[usize], p: f64) -> usize {
    lycheemem_segment::calibration::nearest_rank(v, p).unwrap_or(0)
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
    // Loaded as a memory loads it, so its manifest calibration comes along (`--config` rows).
    let mut embedder_cfg = lycheemem_core::Config::default();
    embedder_cfg.models.embedder = args.embedder.clone();
    let embedder =
        lycheemem::Components::embedder_from_config(&embedder_cfg, models_dir, &mut |_| {})?;
    let embedder = embedder.as_ref();
    // Read before any output, so a bad file fails the command before the table starts.
    let configured = configured_policies(&args.config, embedder)?;
    let base = if args.reference_code {
        lycheemem_core::Config::reference_code().segment
    } else {
        SegmentConfig::default()
    };
    let calibrated = if args.fit_on.is_empty() {
        None
    } else {
        Some(fit_calibration(
            embedder,
            &args.fit_on,
            &args.fit_skip,
            &base,
        )?)
    };
    let mut conversations = crate::locomo::conversations(&args.locomo)?;
    if !args.items.is_empty() {
        conversations.retain(|c| args.items.contains(&c.id));
    }
    println!(
        "| conversation | policy | exchanges | segments | turns/segment | p10 | p50 | p90 | max | finalize reasons |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut totals: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let mut policies: Vec<(String, SegmentConfig)> = vec![
        ("semantic".into(), base.clone()),
        (
            "fixed_window".into(),
            SegmentConfig {
                policy: SegmentPolicy::FixedWindow,
                ..base.clone()
            },
        ),
        (
            "per_exchange".into(),
            SegmentConfig {
                policy: SegmentPolicy::PerExchange,
                ..base.clone()
            },
        ),
    ];
    if let Some(c) = calibrated {
        policies.insert(1, ("semantic_calibrated".into(), c));
    }
    policies.extend(configured);
    for conv in &conversations {
        // Exchanges (each LoCoMo turn is one) and their embeddings, computed once per conversation.
        let mut per_session: Vec<Vec<ExchangeInput>> = Vec::new();
        for turns in &conv.sessions {
            per_session.push(session_exchanges(
                embedder,
                turns,
                base.embed_head_tail_chars,
            )?);
        }
        let exchanges: usize = per_session.iter().map(Vec::len).sum();
        for (name, cfg) in &policies {
            let segmenter = Segmenter::new(cfg.clone());
            let mut reasons: BTreeMap<FinalizeReason, usize> = BTreeMap::new();
            let mut segments = 0;
            let mut sizes: Vec<usize> = Vec::new();
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
                    sizes.push((s.last_turn - s.first_turn + 1) as usize);
                    *reasons.entry(s.reason).or_default() += 1;
                }
            }
            let total = totals.entry(name.as_str()).or_default();
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
            sizes.sort_unstable();
            println!(
                "| {} | {name} | {exchanges} | {segments} | {:.2} | {} | {} | {} | {} | {} |",
                conv.id,
                exchanges as f64 / segments.max(1) as f64,
                percentile(&sizes, 0.1),
                percentile(&sizes, 0.5),
                percentile(&sizes, 0.9),
                sizes.last().copied().unwrap_or(0),
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
