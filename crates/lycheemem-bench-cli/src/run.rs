//! `lycheemem-bench run` and `lycheemem-bench report`: the LoCoMo / LongMemEval harness of
//! `lycheemem-bench` with models from the usual configuration flags.

use anyhow::{Context, Result, bail};
use clap::Args;
use lycheemem_bench::run::{self, Backends, RunSpec};
use lycheemem_bench::{RunMeta, VARIANTS, Variant, dataset, report, variant};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lycheemem_cli::settings::{ModelArgs, load_components};

#[derive(Args)]
pub struct BenchRunArgs {
    /// LoCoMo (`locomo_dev8.json`) or LongMemEval (`.json` or `.json.zst`) file.
    #[arg(long)]
    dataset: PathBuf,
    /// Comma-separated variants: full, spec_write, eager, fixed_window, semantic_calibrated,
    /// summary_records, no_cross_segment_context, record_vector_only, no_planner, no_fusion,
    /// no_rerank, no_lexical, spec_selection, naive_rag, full_context, licomemory,
    /// licomemory_simple, licomemory_no_summary, licomemory_no_decay, mem0, amem (README,
    /// "Benchmarks").
    #[arg(long, value_delimiter = ',', default_value = "full,naive_rag")]
    variants: Vec<String>,
    /// Results folder (checkpoints and reports; rerunning continues it).
    #[arg(long)]
    out: PathBuf,
    /// Built memories and cached plans, shared by runs.
    #[arg(long, env = "LYCHEEMEM_BENCH_CACHE")]
    cache: Option<PathBuf>,
    /// Build and search the memories in this PostgreSQL database (one schema per memory, named
    /// after it) instead of store directories under the cache.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// Only these items (LoCoMo sample_ids / LongMemEval question_ids), comma-separated.
    #[arg(long, value_delimiter = ',')]
    items: Vec<String>,
    /// Only these categories (names, or LoCoMo numbers 1-5). Default: LoCoMo 1-4, every
    /// LongMemEval type.
    #[arg(long, value_delimiter = ',')]
    categories: Vec<String>,
    /// At most this many questions, stratified by category.
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Retrieval and evidence recall only: no answer or judge calls.
    #[arg(long)]
    retrieval_only: bool,
    /// Evidence items per question, the same for every variant.
    #[arg(long, default_value_t = 15)]
    top_k: usize,
    /// Turns per naive_rag chunk.
    #[arg(long, default_value_t = 2)]
    naive_chunk_turns: usize,
    /// Only each item's first N sessions and the questions whose evidence lies in them.
    #[arg(long)]
    sessions: Option<usize>,
    /// Memory constructions built at the same time, and questions evaluated at the same time
    /// (both run together: up to 2N LLM calls open at once); a local LLM decodes them together,
    /// `--llm-batch` at a time, the rest waiting their turn (set it at least N). Retrieval is the
    /// same as one at a time; wall times are not comparable across different values.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Sessions of an item encoded ahead of its build at the same time, so a local LLM decodes
    /// one conversation's encoder calls several at a time (set `--llm-batch` to cover them);
    /// the memory built is the same as without (each session's calls depend on that session
    /// alone and are replayed from the encoder log when the build reaches it). `lycheemem`
    /// variants only.
    #[arg(long, default_value_t = 0)]
    session_lookahead: usize,
    /// Restricts a variant to some items: `VARIANT=ITEM[+ITEM…]`, e.g. `eager=conv-26` (the
    /// other variants still run on every selected item). Repeatable.
    #[arg(long)]
    variant_items: Vec<String>,
    /// Only make the plans the selected questions lack (logged in the results folder and the
    /// cache): no memory is built, no question evaluated.
    #[arg(long)]
    plans_only: bool,
    /// The peer venv's python for peer variants (`mem0`); default
    /// `~/.cache/lycheemem/peer-venv/bin/python`, made by `cargo xtask peer-venv`.
    #[arg(long)]
    peer_python: Option<PathBuf>,
    /// Judge LLM (default: the answer LLM).
    #[arg(long, env = "LYCHEEMEM_JUDGE_LLM")]
    judge_llm: Option<String>,
    #[command(flatten)]
    models: ModelArgs,
}

#[derive(Args)]
pub struct BenchReportArgs {
    /// A results folder written by `lycheemem-bench run`.
    out: PathBuf,
}

fn parse_variant_items(specs: &[String]) -> Result<BTreeMap<String, Vec<String>>> {
    let mut out = BTreeMap::new();
    for spec in specs {
        let (variant, items) = spec
            .split_once('=')
            .filter(|(v, items)| !v.is_empty() && !items.is_empty())
            .with_context(|| format!("--variant-items {spec:?}: expected VARIANT=ITEM[+ITEM…]"))?;
        let items: Vec<String> = items.split('+').map(str::to_string).collect();
        if items.iter().any(String::is_empty) {
            anyhow::bail!("--variant-items {spec:?}: an empty item id");
        }
        out.insert(variant.to_string(), items);
    }
    Ok(out)
}

fn default_cache() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache/lycheemem/bench")
}

pub fn run(models_dir: &Path, args: BenchRunArgs) -> Result<()> {
    // Checked before anything is built: a k retrieval refuses would fail at the first question.
    if !(1..=lycheemem_retrieve::MAX_TOP_K).contains(&args.top_k) {
        bail!(
            "--top-k must be 1 to {}, not {}",
            lycheemem_retrieve::MAX_TOP_K,
            args.top_k
        );
    }
    let base = args.models.config()?;
    for v in &args.variants {
        Variant::new(v, &base).with_context(|| format!("variants: {}", VARIANTS.join(", ")))?;
    }
    let data = dataset::load(&args.dataset)?;
    eprintln!(
        "{}: {} items, {} questions, {} parser notes{}",
        args.dataset.display(),
        data.items.len(),
        data.items.iter().map(|i| i.questions.len()).sum::<usize>(),
        data.skipped.len(),
        data.skipped
            .first()
            .map(|s| format!(" (e.g. {s})"))
            .unwrap_or_default()
    );
    let components = load_components(&base, models_dir)?;
    let judge_spec = args
        .judge_llm
        .clone()
        .unwrap_or_else(|| base.models.answer_llm.clone());
    // A plans-only run answers nothing: no judge model to load.
    let judge = if args.retrieval_only || args.plans_only {
        None
    } else if judge_spec == base.models.answer_llm {
        Some(components.answer_llm.clone())
    } else {
        let mut cfg = base.clone();
        cfg.models.answer_llm = judge_spec.clone();
        Some(load_components(&cfg, models_dir)?.answer_llm)
    };
    let spec = RunSpec {
        dataset: args.dataset.clone(),
        variants: args.variants.clone(),
        out: args.out.clone(),
        cache: args.cache.clone().unwrap_or_else(default_cache),
        postgres: args.postgres.clone(),
        items: args.items.clone(),
        categories: args.categories.clone(),
        limit: args.limit,
        seed: args.seed,
        retrieval_only: args.retrieval_only,
        top_k: args.top_k,
        naive_chunk_turns: args.naive_chunk_turns,
        full_context_reserve: 1024,
        max_sessions: args.sessions,
        jobs: args.jobs,
        session_lookahead: args.session_lookahead,
        variant_items: parse_variant_items(&args.variant_items)?,
        plans_only: args.plans_only,
        peer_python: args.peer_python.clone(),
    };
    let mut models = BTreeMap::new();
    models.insert("embedder".to_string(), base.models.embedder.clone());
    models.insert("encode LLM".to_string(), base.models.encode_llm.clone());
    models.insert("plan LLM".to_string(), base.models.plan_llm.clone());
    if !args.retrieval_only {
        models.insert("answer LLM".to_string(), base.models.answer_llm.clone());
        models.insert("judge LLM".to_string(), judge_spec);
    }
    models.insert(
        "reranker".to_string(),
        if base.models.reranker.is_empty() {
            "none".to_string()
        } else {
            base.models.reranker.clone()
        },
    );
    let meta = RunMeta {
        command: format!(
            "lycheemem {}",
            std::env::args().skip(1).collect::<Vec<_>>().join(" ")
        ),
        commit: env!("LYCHEEMEM_BUILD_COMMIT").into(),
        dataset: args
            .dataset
            .file_name()
            .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        dataset_sha256: data.sha256.clone(),
        models,
        config_hashes: args
            .variants
            .iter()
            .filter_map(|v| Variant::new(v, &base).ok())
            .map(|v| (v.name.clone(), variant::config_hash(&v.config)))
            .collect(),
        machine: report::machine(),
        date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
        top_k: args.top_k,
        retrieval_only: args.retrieval_only,
        dataset_notes: data.skipped.len(),
    };
    report::record_run(&args.out, &meta)?;
    let backends = Backends { components, judge };
    let result = run::run(&data, &spec, &base, &backends, &mut |line| {
        eprintln!("{line}")
    });
    // Reports cover whatever is checkpointed, also after a failure.
    let md = lycheemem_bench::write_reports(&args.out, &meta)?;
    result?;
    println!("{md}");
    Ok(())
}

pub fn report(args: BenchReportArgs) -> Result<()> {
    let meta = report::latest_run(&args.out)?;
    println!("{}", lycheemem_bench::write_reports(&args.out, &meta)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The commit a report records is the one this binary was built from: in a git checkout,
    /// its HEAD (the test binary is built from the same tree), with `-dirty` for changed sources.
    #[test]
    fn reports_record_the_commit_the_binary_was_built_from() {
        let recorded = env!("LYCHEEMEM_BUILD_COMMIT");
        let head = std::process::Command::new("git")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        match head {
            Some(head) => assert!(
                recorded == head || recorded == format!("{head}-dirty"),
                "recorded {recorded}, HEAD {head}"
            ),
            None => assert_eq!(recorded, "unknown"),
        }
    }
}
