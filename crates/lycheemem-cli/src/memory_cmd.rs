//! The memory subcommands: `ingest`, `ask`, `search`, `inspect`, `delete`, `export`, `import`, `migrate`,
//! `stats`, `rederive`. Each parses its arguments, opens the memory and calls the facade.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use lycheemem::store::*;
use lycheemem::{Memory, QueryOptions, SearchResult};
use lycheemem_core::{Namespace, SessionId};
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::settings::MemoryArgs;
use lycheemem::formats::{self, Format};

#[derive(Args)]
pub struct IngestArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Conversation file (see `--format`).
    pub file: PathBuf,
    #[arg(long, default_value = "auto", value_parser = format_parser())]
    pub format: Format,
    /// Session id for `chat` files (default: the file name).
    #[arg(long)]
    pub session: Option<String>,
    /// Session date for `chat` files.
    #[arg(long)]
    pub date: Option<String>,
    /// Ingest at most this many conversations (LoCoMo / LongMemEval files).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Leave sessions open (no flush at the end of each session).
    #[arg(long)]
    pub no_flush: bool,
}

/// `--format`: one of [`Format::ALL`] by name.
fn format_parser() -> impl clap::builder::TypedValueParser<Value = Format> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Format::ALL.map(|(name, _)| name))
        .map(|name| name.parse().unwrap_or(Format::Auto))
}

#[derive(Args)]
pub struct AskArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    pub question: String,
    /// Evidence items (at least `retrieval.min_top_k`).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// The question's date (relative dates resolve against it).
    #[arg(long)]
    pub date: Option<String>,
    /// Print the evidence and why each item was chosen.
    #[arg(long)]
    pub explain: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum InspectWhat {
    /// Sessions with dates and turn counts.
    Sessions,
    /// Segments of a session with finalize reasons and outcomes.
    Segments { session: String },
    /// Records (optionally of one session).
    Records {
        #[arg(long)]
        session: Option<String>,
    },
    /// Evidence nodes (optionally of one kind: entity, topic, entity_topic, temporal, event_frame).
    Nodes {
        #[arg(long)]
        kind: Option<String>,
    },
    /// Raw turns of a session.
    Turns { session: String },
}

#[derive(Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[command(subcommand)]
    pub what: InspectWhat,
}

#[derive(Subcommand)]
pub enum DeleteWhat {
    Record {
        id: String,
    },
    Session {
        id: String,
    },
    /// The whole namespace (needs --yes).
    Namespace {
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
pub struct DeleteArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[command(subcommand)]
    pub what: DeleteWhat,
}

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Output file (JSON Lines).
    pub out: PathBuf,
    #[arg(long)]
    pub vectors: bool,
}

#[derive(Args)]
pub struct ImportArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// A file written by `lycheemem export`.
    pub file: PathBuf,
}

#[derive(Args)]
pub struct MigrateArgs {
    /// The source store and namespace (`--store`, `-n`) and the configuration both stores use.
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// The destination store: a directory or a PostgreSQL URL (created when absent; its
    /// PostgreSQL schema is `[store] postgres_schema` of the configuration).
    #[arg(long)]
    pub to: PathBuf,
    /// The namespace's name in the destination (default: the same).
    #[arg(long)]
    pub to_namespace: Option<String>,
    /// The destination's PostgreSQL schema when it differs from the configuration's.
    #[arg(long)]
    pub to_schema: Option<String>,
    /// PostgreSQL destination: load without the HNSW indexes and build them once afterwards
    /// (faster for large namespaces; the schema's other namespaces search by exact scan
    /// meanwhile).
    #[arg(long)]
    pub rebuild_vector_index: bool,
    /// `maintenance_work_mem` for that index build, MiB (about 2.5 KB per 384-d vector).
    #[arg(long, default_value_t = 1024, requires = "rebuild_vector_index")]
    pub index_memory_mib: usize,
}

#[derive(Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RederiveArgs {
    #[command(flatten)]
    pub memory: MemoryArgs,
}

fn bar(len: u64, template: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    b
}

/// Turns are fed in small batches so the bar moves and segments finalize as they would live.
const INGEST_BATCH: usize = 8;

/// Without a terminal, a progress line is printed every this many turns.
const PROGRESS_LINE_EVERY: u64 = 1000;

pub fn ingest(models_dir: &Path, args: IngestArgs) -> Result<()> {
    let mut conversations = formats::read(
        &args.file,
        args.format,
        args.session.as_deref(),
        args.date.as_deref(),
    )?
    .conversations;
    if let Some(limit) = args.limit {
        conversations.truncate(limit);
    }
    let total: u64 = conversations
        .iter()
        .flat_map(|c| &c.sessions)
        .map(|s| s.turns.len() as u64)
        .sum();
    if total == 0 {
        bail!("{} contains no turns", args.file.display());
    }
    let memory = args.memory.open(models_dir)?;
    let base = args.memory.namespace()?;
    let started = Instant::now();
    let progress = bar(
        total,
        "{spinner} [{bar:30}] {pos}/{len} turns  {msg}  eta {eta}",
    );
    let mut sum = lycheemem::IngestReceipt::default();
    let describe = |r: &lycheemem::IngestReceipt| {
        format!(
            "{} exchanges → {} segments ({} failed) → {} records; {} encode calls, {} tokens",
            r.exchanges,
            r.segments.len(),
            r.failed_segments,
            r.records,
            r.encode_calls,
            r.encode_tokens
        )
    };
    // Without a terminal the bar is hidden: progress then goes to stderr as lines.
    let say = |line: String| {
        if progress.is_hidden() {
            eprintln!("{line}");
        } else {
            progress.println(line);
        }
    };
    let mut next_note = PROGRESS_LINE_EVERY;
    for conv in conversations {
        let ns = match &conv.name {
            Some(s) => Namespace::new(format!("{base}.{}", sanitize(s)))?,
            None => base.clone(),
        };
        for session in conv.sessions {
            let sid = SessionId::new(session.id.clone())?;
            let mut this = lycheemem::IngestReceipt::default();
            // Each batch names the session index it belongs at, so turns this store already
            // holds (a rerun, or a run cut short) are recognized and not added twice.
            for (i, chunk) in session.turns.chunks(INGEST_BATCH).enumerate() {
                let first_index = u32::try_from(i * INGEST_BATCH)
                    .context("a session holds more turns than a store can index")?;
                let r = memory
                    .add_turns_at(
                        &ns,
                        &sid,
                        session.date.as_deref(),
                        first_index,
                        chunk.to_vec(),
                    )
                    .with_context(|| format!("session {} of namespace {ns}", session.id))?;
                progress.inc(chunk.len() as u64);
                this.merge(r);
                progress.set_message(describe(&sum));
                if progress.is_hidden() && progress.position() >= next_note {
                    next_note += PROGRESS_LINE_EVERY;
                    eprintln!(
                        "{}/{total} turns, {:.0?}",
                        progress.position(),
                        started.elapsed()
                    );
                }
            }
            if !args.no_flush {
                this.merge(
                    memory
                        .flush(&ns, &sid)
                        .with_context(|| format!("session {} of namespace {ns}", session.id))?,
                );
            }
            say(format!(
                "{ns}/{sid}: {} new turns, {} already stored; {} segments ({} failed) → {} records",
                this.turns_stored,
                this.turns_already_stored,
                this.segments.len(),
                this.failed_segments,
                this.records
            ));
            sum.merge(this);
        }
    }
    progress.finish_and_clear();
    println!(
        "ingested {total} turns ({} new, {} already stored) in {:.1?}: {} (per-exchange encoding would have made {} calls)",
        sum.turns_stored,
        sum.turns_already_stored,
        started.elapsed(),
        describe(&sum),
        sum.exchanges
    );
    if sum.failed_segments > 0 {
        bail!(
            "{} of {} segments failed to encode (their turns are stored and searchable as raw \
             turns; `lycheemem inspect segments <session>` shows why)",
            sum.failed_segments,
            sum.segments.len()
        );
    }
    Ok(())
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

pub fn print_evidence(result: &SearchResult) {
    for block in &result.context {
        println!("  {}:", block.title);
        for line in &block.lines {
            println!("    {line}");
        }
    }
    for (i, e) in result.evidence.iter().enumerate() {
        let date = e.session_date.as_deref().unwrap_or("?");
        match e.memory_type {
            Some(t) => {
                let time = e
                    .temporal
                    .t_ref
                    .as_deref()
                    .map(|t| format!(", time {t}"))
                    .unwrap_or_default();
                println!(
                    "  {:>2}. [{}{time}] {} (session {} {date}, turns {:?})",
                    i + 1,
                    t.as_str(),
                    e.evidence.text,
                    e.session,
                    e.turns
                );
            }
            None => {
                let first = e.evidence.text.lines().next().unwrap_or("");
                println!(
                    "  {:>2}. [dialogue] {first} (session {} {date}, turns {:?})",
                    i + 1,
                    e.session,
                    e.turns
                );
            }
        }
    }
}

/// The memory, namespace and query options of an `ask` / `search`.
fn query(models_dir: &Path, args: &AskArgs) -> Result<(Memory, Namespace, QueryOptions)> {
    let memory = args.memory.open(models_dir)?;
    let ns = args.memory.namespace()?;
    let opts = QueryOptions {
        top_k: args.top_k,
        reference_date: args.date.clone(),
        trace: args.explain,
        ..QueryOptions::default()
    };
    Ok((memory, ns, opts))
}

pub fn ask(models_dir: &Path, args: AskArgs) -> Result<()> {
    let (memory, ns, opts) = query(models_dir, &args)?;
    let answer = memory.answer(&ns, &args.question, &opts)?;
    if args.json {
        let evidence: Vec<_> = answer.evidence().iter().collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "answer": answer.text,
                "evidence": evidence,
                "usage": answer.usage,
            }))?
        );
        return Ok(());
    }
    println!("{}", answer.text);
    if args.explain {
        println!("\n{}", answer.search.explain());
    } else {
        println!("\nevidence:");
        print_evidence(&answer.search);
    }
    let (prompt, completion): (u64, u64) = answer.usage.iter().fold((0, 0), |(p, c), u| {
        (p + u.prompt_tokens, c + u.completion_tokens)
    });
    println!(
        "tokens: {prompt} prompt + {completion} completion over {} calls",
        answer.usage.len()
    );
    Ok(())
}

pub fn search(models_dir: &Path, args: AskArgs) -> Result<()> {
    let (memory, ns, opts) = query(models_dir, &args)?;
    let result = memory.search(&ns, &args.question, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result.evidence)?);
    } else if args.explain {
        println!("{}", result.explain());
    } else {
        print_evidence(&result);
    }
    Ok(())
}

/// The store and namespace of a models-free command; the namespace must hold memory.
fn store_and_namespace(args: &MemoryArgs) -> Result<(Box<dyn MemoryStore>, Namespace)> {
    let store = Memory::open_store(&args.store, &args.config()?)?;
    let ns = args.namespace()?;
    if !store.has_namespace(&ns)? {
        return Err(lycheemem::core::Error::NotFound(format!(
            "namespace {ns} has no memory in {}",
            args.store.display()
        ))
        .into());
    }
    Ok((store, ns))
}

pub fn inspect(args: InspectArgs) -> Result<()> {
    use std::io::Write as _;
    let (store, ns) = store_and_namespace(&args.memory)?;
    // Written through a handle, not `println!`, so a closed pipe (`| head`) is an error that
    // `main` treats as a normal end rather than a panic.
    let mut out = std::io::stdout().lock();
    let known_session = |session: String| -> Result<SessionId> {
        let id = SessionId::new(session)?;
        if store.session(&ns, &id)?.is_none() {
            bail!("no session \"{id}\" in namespace {ns} (see `lycheemem inspect sessions`)");
        }
        Ok(id)
    };
    match args.what {
        InspectWhat::Sessions => {
            for s in store.sessions(&ns)? {
                writeln!(
                    out,
                    "{}\t{}\t{} turns",
                    s.id,
                    s.date.as_deref().unwrap_or("-"),
                    s.turn_count
                )?;
            }
        }
        InspectWhat::Segments { session } => {
            for row in store.segments(&ns, &known_session(session)?)? {
                let outcome = match &row.outcome {
                    lycheemem::store::SegmentOutcome::Encoded => "encoded".to_string(),
                    lycheemem::store::SegmentOutcome::Failed { error } => {
                        format!("FAILED: {error}")
                    }
                };
                writeln!(
                    out,
                    "turns {}-{}\t{:?}\t{} exchanges, {} tokens\t{} records\t{outcome}",
                    row.segment.first_turn,
                    row.segment.last_turn,
                    row.segment.reason,
                    row.segment.exchanges,
                    row.segment.tokens,
                    row.record_ids.len()
                )?;
            }
        }
        InspectWhat::Records { session } => {
            for r in store.all_records(&ns)? {
                if session
                    .as_deref()
                    .is_some_and(|s| s != r.source_session.as_str())
                {
                    continue;
                }
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}#{:?}\t{}",
                    r.record_id,
                    r.memory_type.as_str(),
                    r.temporal.t_ref.as_deref().unwrap_or("-"),
                    r.source_session,
                    r.evidence_turns,
                    r.semantic_text
                )?;
            }
        }
        InspectWhat::Nodes { kind } => {
            for n in store.all_nodes(&ns)? {
                if kind.as_deref().is_some_and(|k| k != n.kind.as_str()) {
                    continue;
                }
                writeln!(
                    out,
                    "{}\t{} records\t{}",
                    n.node_id,
                    n.record_ids.len(),
                    n.label
                )?;
            }
        }
        InspectWhat::Turns { session } => {
            for t in store.turns(&ns, &known_session(session)?)? {
                writeln!(out, "{}\t{}\t{}", t.index, t.author(), t.text)?;
            }
        }
    }
    Ok(())
}

pub fn delete(models_dir: &Path, args: DeleteArgs) -> Result<()> {
    let memory: Memory = args.memory.open(models_dir)?;
    let ns = args.memory.namespace()?;
    let receipt = match args.what {
        DeleteWhat::Record { id } => memory.delete_record(&ns, &id)?,
        DeleteWhat::Session { id } => memory.delete_session(&ns, &SessionId::new(id)?)?,
        DeleteWhat::Namespace { yes } => {
            if !yes {
                bail!("deleting namespace {ns} removes all of its memory; add --yes to confirm");
            }
            memory.delete_namespace(&ns)?
        }
    };
    println!("{}", serde_json::to_string_pretty(&receipt)?);
    Ok(())
}

pub fn export(args: ExportArgs) -> Result<()> {
    let (store, ns) = store_and_namespace(&args.memory)?;
    let tmp = args.out.with_extension("partial");
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    let lines = store.export(
        &ns,
        &mut file,
        lycheemem::store::ExportOptions {
            include_vectors: args.vectors,
        },
    )?;
    file.flush()?;
    drop(file);
    std::fs::rename(&tmp, &args.out)?;
    println!("wrote {lines} lines to {}", args.out.display());
    Ok(())
}

pub fn import(models_dir: &Path, args: ImportArgs) -> Result<()> {
    let file = std::fs::File::open(&args.file)
        .with_context(|| format!("opening {}", args.file.display()))?;
    let memory = args.memory.open(models_dir)?;
    let ns = args.memory.namespace()?;
    let receipt = memory.import(&ns, &mut BufReader::new(file))?;
    println!("{}", serde_json::to_string_pretty(&receipt)?);
    Ok(())
}

pub fn migrate(args: MigrateArgs) -> Result<()> {
    let ns = args.memory.namespace()?;
    let options = lycheemem::MigrateOptions {
        to_namespace: args.to_namespace.map(Namespace::new).transpose()?,
        to_postgres_schema: args.to_schema,
        rebuild_vector_indexes: args.rebuild_vector_index.then_some(args.index_memory_mib),
    };
    let t = Instant::now();
    let report = lycheemem::migrate_namespace(
        &args.memory.store,
        &args.to,
        &ns,
        &args.memory.config()?,
        &options,
    )?;
    let r = &report.imported;
    println!(
        "copied namespace {ns} to {} in {:.1}s: {} sessions, {} turns, {} segments, {} records, \
         {} nodes, {} vectors ({} left to embed)",
        options.to_namespace.as_ref().unwrap_or(&ns),
        t.elapsed().as_secs_f64(),
        r.sessions,
        r.turns,
        r.segments,
        r.records,
        r.nodes,
        r.vectors_imported,
        r.vectors_pending
    );
    for (target, secs) in &report.index_build_seconds {
        println!("  built the {target} vector index in {secs:.1}s");
    }
    Ok(())
}

pub fn stats(args: StatsArgs) -> Result<()> {
    let (store, ns) = store_and_namespace(&args.memory)?;
    let stats = store.stats(&ns)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(());
    }
    println!("namespace {ns}");
    println!(
        "  sessions {}, turns {}, segments {} ({} failed), records {}",
        stats.sessions, stats.turns, stats.segments, stats.failed_segments, stats.records
    );
    println!("  nodes {:?}", stats.nodes);
    println!("  vectors stored {:?}", stats.vectors);
    for (purpose, t) in &stats.usage.by_purpose {
        println!(
            "  {purpose:?}: {} calls, {} prompt + {} completion tokens",
            t.calls, t.prompt_tokens, t.completion_tokens
        );
    }
    Ok(())
}

pub fn rederive(models_dir: &Path, args: RederiveArgs) -> Result<()> {
    let memory = args.memory.open(models_dir)?;
    let ns = args.memory.namespace()?;
    let report = memory.rederive(&ns)?;
    println!(
        "re-derived {} sessions: {} segments, records {} → {} ({} added, {} removed)",
        report.sessions,
        report.segments,
        report.records_before,
        report.records_after,
        report.added.len(),
        report.removed.len()
    );
    for t in &report.added {
        println!("  + {t}");
    }
    for t in &report.removed {
        println!("  - {t}");
    }
    Ok(())
}

/// Reads the sessions of a file for the demo (same formats as ingest).
pub fn sessions_of(path: &Path) -> Result<Vec<formats::Session>> {
    Ok(formats::read(path, Format::Auto, None, None)?
        .conversations
        .into_iter()
        .flat_map(|c| c.sessions)
        .collect())
}
