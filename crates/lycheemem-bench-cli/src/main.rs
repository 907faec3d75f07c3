//! `lycheemem-bench`: the benchmark commands, kept out of the shipped `lycheemem` binary. Each
//! compares a lycheemem component with a reference measured in the same run, or runs the
//! LoCoMo / LongMemEval harness of [`lycheemem_bench`].

mod device_check;
mod embed;
mod encode;
mod llm;
mod locomo;
mod reference_run;
mod retrieve;
mod run;
mod segment;
mod serve_openai;
mod store;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "lycheemem-bench",
    version,
    about = "Benchmarks of lycheemem: components against reference implementations, and the LoCoMo / LongMemEval harness"
)]
struct Cli {
    #[command(flatten)]
    models_dir: lycheemem_cli::settings::ModelsDir,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Embedding throughput: candle vs sentence-transformers (torch) on the same texts.
    Embed(embed::BenchEmbedArgs),
    /// LLM prefill/decode speed: candle vs llama.cpp (llama-cpp-python) on the same GGUF files.
    Llm(llm::BenchLlmArgs),
    /// Segmentation on LoCoMo: segments and finalize reasons per policy.
    Segment(segment::BenchSegmentArgs),
    /// Construction cost on LoCoMo: encode the first sessions of one conversation.
    Encode(encode::BenchEncodeArgs),
    /// Store: insert throughput, vector search latency and recall vs exact search, BM25, reopen.
    Store(store::BenchStoreArgs),
    /// Retrieval latency without the planner on synthetic 10k–100k record stores, per stage.
    Retrieve(retrieve::BenchRetrieveArgs),
    /// LoCoMo / LongMemEval: every variant and baseline, evidence recall, judged accuracy,
    /// token cost; resumable, with JSON, Markdown and SVG reports.
    Run(Box<run::BenchRunArgs>),
    /// Rewrite the reports of a results folder from its checkpoints.
    Report(run::BenchReportArgs),
    /// GPU against CPU on one machine: parity and speed of the embedder, the cross-encoder
    /// fixtures and the local LLMs (needs a build with `--features cuda`).
    DeviceCheck(Box<device_check::DeviceCheckArgs>),
    /// The encoder LLM and embedder behind a loopback OpenAI-compatible API (what peer variants
    /// such as `mem0` are given), until interrupted; prints the base URL.
    ServeOpenai(serve_openai::ServeOpenAiArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let models_dir = cli.models_dir.resolve();
    let result = match cli.command {
        Command::Embed(args) => embed::run(&models_dir, args),
        Command::Llm(args) => llm::run(&models_dir, args),
        Command::Segment(args) => segment::run(&models_dir, args),
        Command::Encode(args) => encode::run(&models_dir, args),
        Command::Store(args) => store::run(&models_dir, args),
        Command::Retrieve(args) => retrieve::run(&models_dir, args),
        Command::Run(args) => run::run(&models_dir, *args),
        Command::Report(args) => run::report(args),
        Command::DeviceCheck(args) => device_check::run(&models_dir, *args),
        Command::ServeOpenai(args) => serve_openai::run(&models_dir, args),
    };
    lycheemem_cli::exit::exit_code(result)
}
