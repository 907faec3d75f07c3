//! Reports from a results folder's checkpoints: `summary.json`, a Markdown summary with
//! per-category tables comparing variants side by side, and two SVG plots (quality vs
//! construction tokens; per-category bars). Every report records where it came from.

use crate::jsonl::{append_line, read_lines};
use crate::run::{ConstructionLine, Prediction, StageScore, constructions, predictions};
use crate::variant::VARIANTS;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// Where a report came from.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunMeta {
    /// The command that reproduces the run (paths as typed).
    pub command: String,
    /// The commit the running binary was built from (`-dirty`: its sources had uncommitted
    /// changes), or `unknown`.
    pub commit: String,
    pub dataset: String,
    pub dataset_sha256: String,
    pub models: BTreeMap<String, String>,
    /// Config hash per variant.
    pub config_hashes: BTreeMap<String, String>,
    pub machine: String,
    pub date: String,
    pub top_k: usize,
    pub retrieval_only: bool,
    /// Parser notes (skipped or repaired dataset entries), counted.
    pub dataset_notes: usize,
}

/// Mean and count of a metric over the questions that have it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Mean {
    pub sum: f64,
    pub n: usize,
}

impl Mean {
    fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.sum += v;
            self.n += 1;
        }
    }
    pub fn value(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Scores {
    pub questions: usize,
    pub recall: Mean,
    pub session_recall: Mean,
    pub accuracy: Mean,
    pub f1: Mean,
}

impl Scores {
    fn add(&mut self, p: &Prediction) {
        self.questions += 1;
        self.recall.add(p.recall);
        self.session_recall.add(p.session_recall);
        self.accuracy
            .add(p.judge_correct.map(|c| f64::from(u8::from(c))));
        self.f1.add(p.f1);
    }
}

/// One variant's results.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VariantSummary {
    pub variant: String,
    pub overall: Scores,
    pub categories: BTreeMap<String, Scores>,
    pub items_built: usize,
    pub construction_calls: u64,
    pub construction_tokens: u64,
    pub construction_seconds: f64,
    pub query_tokens_per_question: f64,
    pub context_tokens_per_question: f64,
    pub llm_calls_per_question: f64,
    pub retrieval_ms_p50: f64,
    pub plan_fallbacks: usize,
}

fn rank(name: &str) -> usize {
    VARIANTS
        .iter()
        .position(|v| *v == name)
        .unwrap_or(usize::MAX)
}

/// Summaries per variant, in the canonical variant order.
pub fn summarize(preds: &[Prediction], builds: &[ConstructionLine]) -> Vec<VariantSummary> {
    let mut by: BTreeMap<String, VariantSummary> = BTreeMap::new();
    let mut latencies: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for p in preds {
        let s = by
            .entry(p.variant.clone())
            .or_insert_with(|| VariantSummary {
                variant: p.variant.clone(),
                ..Default::default()
            });
        s.overall.add(p);
        s.categories.entry(p.category.clone()).or_default().add(p);
        s.query_tokens_per_question += p.query_tokens() as f64;
        s.context_tokens_per_question += p.context_tokens as f64;
        s.llm_calls_per_question += f64::from(p.llm_calls);
        s.plan_fallbacks += usize::from(
            p.plan_fallback
                .as_deref()
                .is_some_and(|f| f != "planner disabled"),
        );
        latencies
            .entry(p.variant.clone())
            .or_default()
            .push(p.retrieval_ms);
    }
    for b in builds {
        if let Some(s) = by.get_mut(&b.variant) {
            s.items_built += 1;
            s.construction_calls += b.report.encode_calls;
            s.construction_tokens += b.report.tokens();
            s.construction_seconds += b.report.seconds;
        }
    }
    let mut out: Vec<VariantSummary> = by
        .into_values()
        .map(|mut s| {
            let n = s.overall.questions.max(1) as f64;
            s.query_tokens_per_question /= n;
            s.context_tokens_per_question /= n;
            s.llm_calls_per_question /= n;
            if let Some(l) = latencies.get_mut(&s.variant) {
                l.sort_by(f64::total_cmp);
                s.retrieval_ms_p50 = l[l.len() / 2];
            }
            s
        })
        .collect();
    out.sort_by_key(|s| (rank(&s.variant), s.variant.clone()));
    out
}

/// The predictions of the questions every variant in `preds` answered (by item and question
/// id), or `None` when the variants already cover the same questions. Variants run on
/// different subsets (an item added for some variants only, a run stopped part way) are
/// compared on equal terms only over these.
pub fn common_questions(preds: &[Prediction]) -> Option<Vec<Prediction>> {
    let mut by_variant: BTreeMap<&str, BTreeSet<(&str, &str)>> = BTreeMap::new();
    for p in preds {
        by_variant
            .entry(p.variant.as_str())
            .or_default()
            .insert((p.item.as_str(), p.question_id.as_str()));
    }
    let mut sets = by_variant.values();
    let first = sets.next()?;
    let common: BTreeSet<(&str, &str)> = sets.fold(first.clone(), |acc, s| {
        acc.intersection(s).copied().collect()
    });
    if by_variant.values().all(|s| s.len() == common.len()) {
        return None;
    }
    Some(
        preds
            .iter()
            .filter(|p| common.contains(&(p.item.as_str(), p.question_id.as_str())))
            .cloned()
            .collect(),
    )
}

fn pct(m: &Mean) -> String {
    m.value()
        .map_or_else(|| "—".into(), |v| format!("{:.1}", 100.0 * v))
}

fn category_order(sums: &[VariantSummary]) -> Vec<String> {
    const LOCOMO: [&str; 5] = [
        "multi_hop",
        "temporal",
        "open_domain",
        "single_hop",
        "adversarial",
    ];
    let mut cats: Vec<String> = sums
        .iter()
        .flat_map(|s| s.categories.keys().cloned())
        .collect();
    cats.sort_by_key(|c| {
        (
            LOCOMO.iter().position(|l| l == c).unwrap_or(usize::MAX),
            c.clone(),
        )
    });
    cats.dedup();
    cats
}

fn category_table(
    out: &mut String,
    title: &str,
    sums: &[VariantSummary],
    metric: fn(&Scores) -> &Mean,
) {
    let cats = category_order(sums);
    // A category's question count goes in its header when every variant has the same, and
    // next to each value otherwise.
    let shared_n: Vec<Option<usize>> = cats
        .iter()
        .map(|c| {
            let mut ns = sums
                .iter()
                .map(|s| s.categories.get(c).map_or(0, |x| metric(x).n));
            let first = ns.next()?;
            ns.all(|n| n == first).then_some(first)
        })
        .collect();
    let _ = writeln!(out, "\n### {title}\n");
    let _ = writeln!(
        out,
        "| variant | {} | overall |",
        cats.iter()
            .zip(&shared_n)
            .map(|(c, n)| match n {
                Some(n) => format!("{c} (n={n})"),
                None => format!("{c} (n per value)"),
            })
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(out, "|---|{}---:|", "---:|".repeat(cats.len()));
    for s in sums {
        let cells: Vec<String> = cats
            .iter()
            .zip(&shared_n)
            .map(|(c, shared)| match (s.categories.get(c), shared) {
                (None, _) => "—".into(),
                (Some(x), Some(_)) => pct(metric(x)),
                (Some(x), None) => format!("{} (n={})", pct(metric(x)), metric(x).n),
            })
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} |",
            s.variant,
            cells.join(" | "),
            pct(metric(&s.overall))
        );
    }
    let _ = writeln!(
        out,
        "\nn: the questions the metric applies to (evidence recall: those with gold evidence)."
    );
}

/// The folder's run log: one line per `bench run` into it, oldest first.
const RUN_LOG: &str = "runs.jsonl";

/// Adds `meta` to `out`'s run log, creating `out` if needed; called when a run starts, so a
/// stopped run is listed too. A report folder collects the predictions of every run into it
/// (subsets, resumed runs, variants added later), so the latest run's header alone cannot say
/// how the whole report was made: the log can.
pub fn record_run(out: &Path, meta: &RunMeta) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    append_line(&out.join(RUN_LOG), meta)
}

/// The runs recorded in `out`'s run log, oldest first.
pub fn runs(out: &Path) -> Result<Vec<RunMeta>> {
    read_lines(&out.join(RUN_LOG))
}

/// The latest run into `out`: the last run in its run log (every run is logged when it starts,
/// so this is right also after later runs were killed before writing their reports).
pub fn latest_run(out: &Path) -> Result<RunMeta> {
    runs(out)?
        .pop()
        .with_context(|| format!("{} has no run recorded in {RUN_LOG}", out.display()))
}

/// The variants whose recorded runs used more than one config hash: `(variant, hashes)`.
fn config_changes(runs: &[RunMeta]) -> Vec<(String, Vec<String>)> {
    let mut seen: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for r in runs {
        for (variant, hash) in &r.config_hashes {
            let hashes = seen.entry(variant).or_default();
            if !hashes.contains(hash) {
                hashes.push(hash.clone());
            }
        }
    }
    seen.into_iter()
        .filter(|(_, h)| h.len() > 1)
        .map(|(v, h)| (v.to_string(), h))
        .collect()
}

fn runs_table(out: &mut String, runs: &[RunMeta]) {
    let _ = writeln!(out, "\n## Runs recorded in this folder\n");
    let _ = writeln!(
        out,
        "Oldest first, stopped runs included; each run skips what the folder already holds (finished predictions, built memories).\n"
    );
    let _ = writeln!(out, "| date | commit | variants (config hash) | command |");
    let _ = writeln!(out, "|---|---|---|---|");
    for r in runs {
        let variants: Vec<String> = r
            .config_hashes
            .iter()
            .map(|(v, h)| format!("{v} ({h})"))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | `{}` |",
            r.date,
            r.commit,
            variants.join(", "),
            r.command.replace('|', "\\|")
        );
    }
    for (variant, hashes) in config_changes(runs) {
        let _ = writeln!(
            out,
            "\n**Note:** `{variant}` ran under {} config hashes ({}), so its predictions may mix configurations. The hash covers every setting, speed-only ones (`--llm-batch`, `--threads`) included: compare the commands above.",
            hashes.len(),
            hashes.join(", ")
        );
    }
}

/// The Markdown summary. `runs` is the folder's run log (see [`record_run`]); the header
/// describes the latest run, `meta`.
pub fn markdown(
    meta: &RunMeta,
    runs: &[RunMeta],
    sums: &[VariantSummary],
    common: Option<&[VariantSummary]>,
    builds: &[ConstructionLine],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Benchmark report: {}\n", meta.dataset);
    let _ = writeln!(out, "- latest command: `{}`", meta.command);
    let _ = writeln!(
        out,
        "- commit {}, {}, {}",
        meta.commit, meta.date, meta.machine
    );
    let _ = writeln!(
        out,
        "- dataset {} (sha256 {}…), {} parser notes",
        meta.dataset,
        &meta.dataset_sha256[..meta.dataset_sha256.len().min(12)],
        meta.dataset_notes
    );
    for (purpose, model) in &meta.models {
        let _ = writeln!(out, "- {purpose}: {model}");
    }
    let _ = writeln!(
        out,
        "- k = {}; {}",
        meta.top_k,
        if meta.retrieval_only {
            "retrieval only (no answer or judge calls)"
        } else {
            "answers judged by the judge model (its tokens are not counted as cost)"
        }
    );
    let _ = writeln!(out, "\n## Overall\n");
    let _ = writeln!(
        out,
        "| variant | questions | evidence recall@k | session recall | judge accuracy | F1 | built items | construction LLM calls | construction tokens | query tokens / question | evidence tokens / question | LLM calls / question | retrieval p50 ms | plan fallbacks |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for s in sums {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.2} | {:.1} | {} |",
            s.variant,
            s.overall.questions,
            pct(&s.overall.recall),
            pct(&s.overall.session_recall),
            pct(&s.overall.accuracy),
            pct(&s.overall.f1),
            s.items_built,
            s.construction_calls,
            s.construction_tokens,
            s.query_tokens_per_question,
            s.context_tokens_per_question,
            s.llm_calls_per_question,
            s.retrieval_ms_p50,
            s.plan_fallbacks
        );
    }
    let _ = writeln!(
        out,
        "\nretrieval p50 ms: the search alone, without LLM calls (a planning variant's planning call, made before, is in its query tokens and LLM calls per question; a peer's search is timed by its driver). Evidence recall counts the gold turns the k evidence items cover: an item covers one turn (A-Mem), an exchange (mem0, naive RAG chunks of that size) or a segment (lycheemem), so on short conversations k items may cover all of them (see evidence tokens)."
    );
    category_table(&mut out, "Evidence recall@k by category (%)", sums, |s| {
        &s.recall
    });
    if sums.iter().any(|s| s.overall.accuracy.n > 0) {
        category_table(&mut out, "Judge accuracy by category (%)", sums, |s| {
            &s.accuracy
        });
    }
    if sums.iter().any(|s| s.overall.f1.n > 0) {
        category_table(&mut out, "Token F1 by category (%)", sums, |s| &s.f1);
    }
    if let Some(common) = common {
        common_section(&mut out, common);
    }
    if !builds.is_empty() {
        let _ = writeln!(out, "\n## Construction per item\n");
        let _ = writeln!(
            out,
            "| variant | item | turns | exchanges | segments | failed | records | LLM calls | prompt tokens | completion tokens | LLM seconds | seconds | replayed calls |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let mut rows: Vec<&ConstructionLine> = builds.iter().collect();
        rows.sort_by_key(|b| (rank(&b.variant), b.report.item.clone()));
        for b in rows {
            let r = &b.report;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {} |",
                b.variant,
                r.item,
                r.turns,
                r.exchanges,
                r.segments,
                r.failed_segments,
                r.records,
                r.encode_calls,
                r.prompt_tokens,
                r.completion_tokens,
                r.llm_seconds,
                r.seconds,
                r.replayed_calls
                    .map_or_else(|| "–".to_string(), |n| n.to_string())
            );
        }
        let _ = writeln!(
            out,
            "\nseconds: wall time of the build, summed over the runs on the machine that finished it (a build continued on another machine from the folder's call logs, `encoder-calls.jsonl` or `peer-calls.jsonl`, counts only that machine's runs, and time in a session a kill cut short is not counted; memories built together share the LLM). replayed calls: the last run's calls answered from those logs instead of the model (mem0 and A-Mem make no LLM calls when searching, so these are construction calls; the seconds of a build with replayed calls are not the time its calls took; – where not counted per item: lycheemem's builds share one log). LLM seconds: the latencies of the build's calls as made, replayed or not, which grow with the calls sharing the model at the time (`--llm-batch`). Tokens and LLM calls are complete."
        );
    }
    if !runs.is_empty() {
        runs_table(&mut out, runs);
    }
    let _ = writeln!(
        out,
        "\nPlots: `quality_vs_construction_tokens.svg`, `categories.svg`. Every prediction with its evidence ids, verdict and tokens: `predictions/<variant>.jsonl`."
    );
    out
}

/// Scores over the questions every variant answered (see [`common_questions`]).
fn common_section(out: &mut String, common: &[VariantSummary]) {
    let n = common.first().map_or(0, |s| s.overall.questions);
    let _ = writeln!(out, "\n## On the questions every variant answered\n");
    let _ = writeln!(
        out,
        "The variants above were evaluated on different questions (some on more items than \
         others, or a run stopped part way); over the {n} questions that every variant \
         answered they compare on equal terms:\n"
    );
    let _ = writeln!(
        out,
        "| variant | questions | evidence recall@k | session recall | judge accuracy | F1 |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
    for s in common {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            s.variant,
            s.overall.questions,
            pct(&s.overall.recall),
            pct(&s.overall.session_recall),
            pct(&s.overall.accuracy),
            pct(&s.overall.f1)
        );
    }
    if n == 0 {
        return;
    }
    if common.iter().any(|s| s.overall.recall.n > 0) {
        category_table(
            out,
            "Evidence recall@k by category, common questions (%)",
            common,
            |s| &s.recall,
        );
    }
    if common.iter().any(|s| s.overall.accuracy.n > 0) {
        category_table(
            out,
            "Judge accuracy by category, common questions (%)",
            common,
            |s| &s.accuracy,
        );
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Scatter of quality (judge accuracy when judged, else evidence recall) against construction
/// tokens per built item.
pub fn svg_quality_vs_tokens(sums: &[VariantSummary]) -> String {
    let judged = sums.iter().any(|s| s.overall.accuracy.n > 0);
    let quality = |s: &VariantSummary| {
        if judged {
            s.overall.accuracy.value()
        } else {
            s.overall.recall.value()
        }
    };
    let points: Vec<(&str, f64, f64)> = sums
        .iter()
        .filter_map(|s| {
            let per_item = s.construction_tokens as f64 / s.items_built.max(1) as f64;
            quality(s).map(|q| (s.variant.as_str(), per_item, q))
        })
        .collect();
    let (w, h, m) = (720.0, 420.0, 60.0);
    let max_x = points.iter().map(|p| p.1).fold(1.0f64, f64::max) * 1.1;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>"#
    );
    let _ = write!(
        svg,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m,
        h - m
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">construction tokens per item (max {:.0})</text><text x="15" y="{}" transform="rotate(-90 15 {})" text-anchor="middle">{} (%)</text>"#,
        w / 2.0,
        h - 20.0,
        max_x / 1.1,
        h / 2.0,
        h / 2.0,
        if judged {
            "judge accuracy"
        } else {
            "evidence recall@k"
        }
    );
    for tick in 0..=4 {
        let v = tick as f64 * 25.0;
        let y = h - m - (h - 2.0 * m) * v / 100.0;
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="end">{v:.0}</text><line x1="{m}" y1="{y}" x2="{}" y2="{y}" stroke="lightgray"/>"#,
            m - 6.0,
            y + 4.0,
            w - m
        );
    }
    for (name, x, q) in points {
        let px = m + (w - 2.0 * m) * x / max_x;
        let py = h - m - (h - 2.0 * m) * q;
        let _ = write!(
            svg,
            r#"<circle cx="{px:.1}" cy="{py:.1}" r="5" fill="steelblue"/><text x="{:.1}" y="{:.1}">{} ({:.1}%, {x:.0})</text>"#,
            px + 8.0,
            py - 6.0,
            esc(name),
            100.0 * q
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Grouped bars per category (judge accuracy when judged, else evidence recall).
pub fn svg_categories(sums: &[VariantSummary]) -> String {
    let judged = sums.iter().any(|s| s.overall.accuracy.n > 0);
    let cats = category_order(sums);
    let (w, h, m) = (
        (140 + cats.len() * (sums.len() * 18 + 30)).max(400) as f64,
        420.0,
        60.0,
    );
    const COLORS: [&str; 8] = [
        "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
    ];
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>"#
    );
    let _ = write!(
        svg,
        r#"<text x="{m}" y="20">{} by category (%)</text><line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        if judged {
            "judge accuracy"
        } else {
            "evidence recall@k"
        },
        h - m,
        w - 10.0,
        h - m
    );
    for (ci, c) in cats.iter().enumerate() {
        let x0 = m + 10.0 + ci as f64 * (sums.len() as f64 * 18.0 + 30.0);
        for (vi, s) in sums.iter().enumerate() {
            let Some(v) = s.categories.get(c).and_then(|x| {
                if judged {
                    x.accuracy.value()
                } else {
                    x.recall.value()
                }
            }) else {
                continue;
            };
            let bh = (h - 2.0 * m) * v;
            let _ = write!(
                svg,
                r#"<rect x="{:.1}" y="{:.1}" width="16" height="{bh:.1}" fill="{}"><title>{} {}: {:.1}%</title></rect>"#,
                x0 + vi as f64 * 18.0,
                h - m - bh,
                COLORS[vi % COLORS.len()],
                esc(&s.variant),
                esc(c),
                100.0 * v
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{x0:.1}" y="{}">{}</text>"#,
            h - m + 16.0,
            esc(c)
        );
    }
    for (vi, s) in sums.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            m + vi as f64 * 120.0,
            h - 25.0,
            COLORS[vi % COLORS.len()],
            m + 14.0 + vi as f64 * 120.0,
            h - 16.0,
            esc(&s.variant)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Scores over the questions every variant answered (written when the variants' questions
/// differ; see [`common_questions`]).
pub const COMMON_SUMMARY: &str = "summary_common_questions.json";

/// Writes `run.json`, `summary.json` (and `summary_common_questions.json`), `summary.md` and
/// the plots into `out`; returns the Markdown.
pub fn write_reports(out: &Path, meta: &RunMeta) -> Result<String> {
    let preds = predictions(out)?;
    let builds = constructions(out)?;
    let sums = summarize(&preds, &builds);
    let common = common_questions(&preds).map(|c| {
        // Construction figures over the common questions' items only.
        let items: BTreeSet<&str> = c.iter().map(|p| p.item.as_str()).collect();
        let builds: Vec<ConstructionLine> = builds
            .iter()
            .filter(|b| items.contains(b.report.item.as_str()))
            .cloned()
            .collect();
        summarize(&c, &builds)
    });
    let mut md = markdown(meta, &runs(out)?, &sums, common.as_deref(), &builds);
    md.push_str(&waterfall_markdown(&preds));
    md.push_str(&question_types_markdown(&preds));
    let write = |name: &str, body: &[u8]| -> Result<()> {
        std::fs::write(out.join(name), body).with_context(|| format!("writing {name}"))
    };
    write("run.json", &serde_json::to_vec_pretty(meta)?)?;
    write("summary.json", &serde_json::to_vec_pretty(&sums)?)?;
    // Scores over the questions every variant answered, when the variants' questions differ.
    let common_file = out.join(COMMON_SUMMARY);
    match &common {
        Some(c) => write(COMMON_SUMMARY, &serde_json::to_vec_pretty(c)?)?,
        None if common_file.exists() => std::fs::remove_file(&common_file)
            .with_context(|| format!("removing {}", common_file.display()))?,
        None => {}
    }
    write("summary.md", md.as_bytes())?;
    write(
        "quality_vs_construction_tokens.svg",
        svg_quality_vs_tokens(&sums).as_bytes(),
    )?;
    write("categories.svg", svg_categories(&sums).as_bytes())?;
    Ok(md)
}

/// The variants with a prediction that `keep` accepts, in report order.
fn variants_where(preds: &[Prediction], keep: impl Fn(&Prediction) -> bool) -> Vec<&str> {
    let mut variants: Vec<&str> = preds
        .iter()
        .filter(|p| keep(p))
        .map(|p| p.variant.as_str())
        .collect();
    variants.sort_by_key(|v| (rank(v), v.to_string()));
    variants.dedup();
    variants
}

/// The stage accounting of memory variants: per variant, each retrieval stage's mean item
/// count, mean tokens and gold-evidence recall, overall and per category (empty when no
/// prediction carries stages).
pub fn waterfall_markdown(preds: &[Prediction]) -> String {
    let mut out = String::new();
    let variants = variants_where(preds, |p| !p.stages.is_empty());
    if variants.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\n## Where the evidence goes: recall after each retrieval stage\n"
    );
    let _ = writeln!(
        out,
        "Per question, the gold turns covered by the items alive after a stage, and those items' \
estimated tokens. `channel:*`: every candidate a channel hit (all routes); `union`: all routes' \
candidates with source windows; `pool`: what selection chose from; `final`: the k chosen."
    );
    for v in variants {
        let mine: Vec<&Prediction> = preds.iter().filter(|p| p.variant == v).collect();
        let mut categories: Vec<String> = mine.iter().map(|p| p.category.clone()).collect();
        categories.sort();
        categories.dedup();
        let mut stage_names: Vec<String> = Vec::new();
        for p in &mine {
            for st in &p.stages {
                if !stage_names.contains(&st.stage) {
                    stage_names.push(st.stage.clone());
                }
            }
        }
        let _ = writeln!(out, "\n### {v}\n");
        let _ = writeln!(
            out,
            "| stage | items / q | tokens / q | recall | {} |",
            categories.join(" | ")
        );
        let _ = writeln!(
            out,
            "|---|---:|---:|---:|{}",
            "---:|".repeat(categories.len())
        );
        for name in &stage_names {
            let scores: Vec<(&Prediction, &StageScore)> = mine
                .iter()
                .filter_map(|p| p.stages.iter().find(|s| &s.stage == name).map(|s| (*p, s)))
                .collect();
            let n = scores.len().max(1) as f64;
            let items = scores.iter().map(|(_, s)| s.items as f64).sum::<f64>() / n;
            let tokens = scores.iter().map(|(_, s)| s.tokens as f64).sum::<f64>() / n;
            let recall = |cat: Option<&str>| -> String {
                let r: Vec<f64> = scores
                    .iter()
                    .filter(|(p, _)| cat.is_none_or(|c| p.category == c))
                    .filter_map(|(_, s)| s.recall)
                    .collect();
                if r.is_empty() {
                    "–".into()
                } else {
                    format!("{:.1}", 100.0 * r.iter().sum::<f64>() / r.len() as f64)
                }
            };
            let per_cat: Vec<String> = categories.iter().map(|c| recall(Some(c))).collect();
            let _ = writeln!(
                out,
                "| {name} | {items:.1} | {tokens:.0} | {} | {} |",
                recall(None),
                per_cat.join(" | ")
            );
        }
    }
    out
}

/// The planner's question types per benchmark category, per planning variant (a diagnostic:
/// whether the types reflect the questions; empty when no prediction carries a type).
pub fn question_types_markdown(preds: &[Prediction]) -> String {
    let mut out = String::new();
    let variants = variants_where(preds, |p| p.question_type.is_some());
    if variants.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\n## Question types the planner gave, per category\n");
    let types: Vec<&str> = lycheemem_core::QuestionType::ALL
        .iter()
        .map(|t| t.as_str())
        .collect();
    for v in variants {
        let mine: Vec<&Prediction> = preds
            .iter()
            .filter(|p| p.variant == v && p.question_type.is_some())
            .collect();
        let mut categories: Vec<&str> = mine.iter().map(|p| p.category.as_str()).collect();
        categories.sort();
        categories.dedup();
        let _ = writeln!(out, "\n### {v}\n");
        let _ = writeln!(out, "| category | {} |", types.join(" | "));
        let _ = writeln!(out, "|---|{}", "---:|".repeat(types.len()));
        for c in categories {
            let counts: Vec<String> = types
                .iter()
                .map(|t| {
                    mine.iter()
                        .filter(|p| p.category == c && p.question_type.as_deref() == Some(t))
                        .count()
                        .to_string()
                })
                .collect();
            let _ = writeln!(out, "| {c} | {} |", counts.join(" | "));
        }
    }
    out
}

/// CPU model, core count and memory of this machine.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or_else(String::new, |kb| {
            format!(", {:.0} GiB", kb / 1024.0 / 1024.0)
        });
    format!("{cpu}, {cores} cores{mem}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prediction(variant: &str, item: &str, q: &str, recall: f64) -> Prediction {
        Prediction {
            variant: variant.into(),
            item: item.into(),
            question_id: q.into(),
            category: "single_hop".into(),
            recall: Some(recall),
            ..Default::default()
        }
    }

    #[test]
    fn variants_on_different_questions_are_also_compared_on_the_common_ones() {
        // `full` answered two items' questions, `naive_rag` three items'.
        let mut preds = vec![
            prediction("full", "a", "a-q1", 1.0),
            prediction("full", "b", "b-q1", 0.0),
        ];
        for (item, recall) in [("a", 0.0), ("b", 1.0), ("c", 1.0)] {
            preds.push(prediction("naive_rag", item, &format!("{item}-q1"), recall));
        }
        let common = common_questions(&preds).unwrap();
        assert_eq!(common.len(), 4);
        assert!(common.iter().all(|p| p.item != "c"));
        let sums = summarize(&preds, &[]);
        let common_sums = summarize(&common, &[]);
        let md = markdown(&RunMeta::default(), &[], &sums, Some(&common_sums), &[]);
        // Over everything naive RAG scores 66.7 on 3 questions; on the 2 common ones, 50.0.
        assert!(md.contains("single_hop (n per value)"), "{md}");
        assert!(md.contains("| naive_rag | 66.7 (n=3) | 66.7 |"), "{md}");
        assert!(
            md.contains("## On the questions every variant answered"),
            "{md}"
        );
        assert!(md.contains("| naive_rag | 2 | 50.0 |"), "{md}");
        assert!(md.contains("| full | 2 | 50.0 |"), "{md}");
        // Variants on the same questions need no second table.
        preds.pop();
        assert!(common_questions(&preds).is_none());
        let md = markdown(&RunMeta::default(), &[], &summarize(&preds, &[]), None, &[]);
        assert!(md.contains("single_hop (n=2)"), "{md}");
        assert!(!md.contains("every variant answered"), "{md}");
    }
}
