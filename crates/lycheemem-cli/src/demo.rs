//! `lycheemem demo`, the main job: fetches the default models when missing (MiniLM and
//! Qwen2.5-Coder-0.5B), ingests a small dated multi-session conversation written for this
//! project into a fresh memory, asks five questions (a single fact, a temporal one, a changed
//! fact, a preference, and one whose answer is not in memory), and prints each answer with its
//! evidence and token receipt, then the construction cost against per-exchange encoding.

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lycheemem::{Memory, QueryOptions};
use lycheemem_core::{Config, Namespace, SessionId};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::memory_cmd::print_evidence;

const CONVERSATION: &str = include_str!("../data/demo_conversation.json");

const QUESTIONS: [(&str, &str); 5] = [
    ("single fact", "What is the name of my pottery teacher?"),
    (
        "temporal",
        "On what date did I sign up for the pottery class?",
    ),
    ("knowledge update", "Which company do I work for now?"),
    ("preference", "Do I have any dietary preference?"),
    ("not in memory", "What is the name of my dog?"),
];

/// The date the questions are asked on.
const QUESTION_DATE: &str = "2024-05-10";

#[derive(Args)]
pub struct DemoArgs {
    /// Where to build the demo memory (default: a fresh folder under the system temp dir).
    #[arg(long)]
    store: Option<PathBuf>,
    /// LLM for every purpose (default: the config's, local Qwen2.5-Coder-0.5B).
    #[arg(long)]
    llm: Option<String>,
    /// Embedder: a manifest model or `dir:<path>` (default: all-MiniLM-L6-v2).
    #[arg(long)]
    embedder: Option<String>,
    /// Inference threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the models run: auto, cpu, cuda or cuda:N.
    #[arg(long, env = "LYCHEEMEM_DEVICE", default_value = "auto")]
    device: lycheemem_core::ComputeDevice,
}

pub fn run(models_dir: &Path, args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    let mut cfg = Config::default();
    cfg.models.threads = args.threads;
    cfg.models.device = args.device;
    if let Some(e) = &args.embedder {
        cfg.models.embedder = e.clone();
    }
    if let Some(l) = &args.llm {
        cfg.models.encode_llm = l.clone();
        cfg.models.plan_llm = l.clone();
        cfg.models.answer_llm = l.clone();
    }
    println!(
        "models: embedder {}, LLM {} (encode, plan and answer)",
        cfg.models.embedder, cfg.models.encode_llm
    );
    let components = crate::settings::load_components(&cfg, models_dir)?;
    println!(
        "models ready in {:.1?} on {}",
        started.elapsed(),
        lycheemem::resolve_device(cfg.models.device)?
    );

    let dir = args.store.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("lycheemem-demo-{}", std::process::id()))
    });
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let memory = Memory::with_components(&dir, cfg, components)?;
    let ns = Namespace::new("demo-user")?;

    let tmp = dir.join("conversation.json");
    std::fs::write(&tmp, CONVERSATION)?;
    let sessions = crate::memory_cmd::sessions_of(&tmp)?;
    let total: usize = sessions.iter().map(|s| s.turns.len()).sum();
    println!(
        "\ningesting {} sessions, {total} turns (raw turns are stored before any LLM call)",
        sessions.len()
    );
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} turns  {msg}  {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let ingest_started = Instant::now();
    let mut summaries = Vec::new();
    for session in sessions {
        let id = session.id;
        let sid = SessionId::new(id.clone())?;
        let mut date = session.date;
        for turn in session.turns {
            bar.set_message(format!("session {id}: segmenting / encoding"));
            let r = memory.add_turns(&ns, &sid, date.take().as_deref(), vec![turn])?;
            summaries.extend(r.segments);
            bar.inc(1);
        }
        bar.set_message(format!("session {id}: encoding the last segment"));
        summaries.extend(memory.flush(&ns, &sid)?.segments);
    }
    bar.finish_and_clear();
    println!("ingested in {:.1?}; segments:", ingest_started.elapsed());
    for s in &summaries {
        println!(
            "  {} turns {}-{} ({:?}): {}",
            s.segment.session,
            s.segment.first_turn,
            s.segment.last_turn,
            s.segment.reason,
            match &s.failure {
                None => format!("{} records", s.records),
                Some(e) => format!("encoding failed, raw turns kept ({e})"),
            }
        );
    }
    println!("\nrecords:");
    for r in memory.store().all_records(&ns)? {
        println!(
            "  [{}{}] {}",
            r.memory_type.as_str(),
            r.temporal
                .t_ref
                .as_deref()
                .map(|t| format!(", {t}"))
                .unwrap_or_default(),
            r.semantic_text
        );
    }

    let opts = QueryOptions {
        top_k: 5,
        reference_date: Some(QUESTION_DATE.into()),
        ..QueryOptions::default()
    };
    let mut query_tokens = 0u64;
    for (kind, question) in QUESTIONS {
        let t = Instant::now();
        let answer = memory.answer(&ns, question, &opts)?;
        query_tokens += answer.tokens();
        println!("\nQ ({kind}, asked {QUESTION_DATE}): {question}");
        println!("A: {}", answer.text);
        println!("evidence:");
        print_evidence(&answer.search);
        let receipt: Vec<String> = answer
            .usage
            .iter()
            .map(|u| {
                format!(
                    "{:?} {}+{}",
                    u.purpose, u.prompt_tokens, u.completion_tokens
                )
                .to_lowercase()
            })
            .collect();
        println!(
            "receipt: {} tokens ({}) in {:.1?}",
            answer.tokens(),
            receipt.join(", "),
            t.elapsed()
        );
    }

    let c = memory.construction(&ns)?;
    println!(
        "\nconstruction: {} LLM calls for {} exchanges ({} segments), {} tokens; per-exchange (eager) encoding would make {} calls",
        c.encode_calls, c.exchanges, c.segments, c.encode_tokens, c.exchanges
    );
    println!(
        "queries: {query_tokens} tokens for {} questions; total time {:.1?}; memory kept in {}",
        QUESTIONS.len(),
        started.elapsed(),
        dir.display()
    );
    Ok(())
}
