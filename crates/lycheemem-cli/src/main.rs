//! `lycheemem`: the command-line front end. It only parses arguments and wires the library
//! crates together; every behaviour lives in a library.

mod demo;
mod memory_cmd;
mod models_cmd;
mod server_cmd;

use clap::{Parser, Subcommand};
use lycheemem_cli::{fetch_progress, settings};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "lycheemem",
    version,
    about = "Long-term memory for LLM agents, fully offline"
)]
struct Cli {
    #[command(flatten)]
    models_dir: settings::ModelsDir,
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
    /// Copy a namespace to another store: a directory or PostgreSQL, either way, vectors
    /// included (nothing re-embedded); the destination's counts are checked.
    Migrate(memory_cmd::MigrateArgs),
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let models_dir = cli.models_dir.resolve();
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
        Command::Migrate(args) => memory_cmd::migrate(args),
        Command::Stats(args) => memory_cmd::stats(args),
        Command::Rederive(args) => memory_cmd::rederive(&models_dir, args),
        Command::Serve(args) => server_cmd::serve(&models_dir, *args),
        Command::Mcp(args) => server_cmd::mcp(&models_dir, args),
        Command::Keys(args) => server_cmd::keys(args),
    };
    lycheemem_cli::exit::exit_code(result)
}
