//! `lycheemem serve` (HTTP API + MCP over HTTP), `lycheemem mcp` (MCP over stdio) and
//! `lycheemem keys` (API keys → namespaces).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use lycheemem_core::Namespace;
use lycheemem_server::keys::KeyStore;
use lycheemem_server::{ServerConfig, api::Limits};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::settings::MemoryArgs;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    memory: MemoryArgs,
    /// Address to listen on (loopback unless --allow-remote).
    #[arg(long, env = "LYCHEEMEM_BIND", default_value = "127.0.0.1:7411")]
    bind: SocketAddr,
    /// Allow a non-loopback --bind.
    #[arg(long)]
    allow_remote: bool,
    /// API key file (`lycheemem keys add` writes it; default <store>/keys.json).
    #[arg(long, env = "LYCHEEMEM_KEYS")]
    keys: Option<PathBuf>,
    /// Largest accepted request body, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Per-request time limit, seconds.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Encoding jobs queued before new turns get 429.
    #[arg(long, default_value_t = 256)]
    queue: usize,
    /// Sessions encoded at the same time (a local LLM decodes their calls together; set
    /// `--llm-batch` at least as large).
    #[arg(long, default_value_t = 4)]
    encode_workers: usize,
    /// How long shutdown waits for queued encoding, seconds (the rest resumes at next start).
    #[arg(long, default_value_t = 600)]
    drain_secs: u64,
    /// Every this many seconds, queue the sessions holding stored but unprocessed turns (work
    /// another replica sharing the store left when it died); 0 = only at start.
    #[arg(long, default_value_t = 30)]
    sweep_secs: u64,
    /// Searches and answers running at once; more get 429 `busy` (each keeps its slot until
    /// its LLM work has stopped, also when its client went away).
    #[arg(long, default_value_t = 16)]
    max_queries: usize,
}

#[derive(Args)]
pub struct McpArgs {
    #[command(flatten)]
    memory: MemoryArgs,
}

#[derive(Subcommand)]
pub enum KeysAction {
    /// Create a key for a namespace (printed once; only its hash is stored).
    Add {
        #[arg(long, short = 'n')]
        namespace: String,
        #[arg(long)]
        label: Option<String>,
    },
    /// List keys (ids and namespaces; never the keys).
    List,
    /// Revoke a key by id.
    Revoke { id: String },
}

#[derive(Args)]
pub struct KeysArgs {
    /// API key file.
    #[arg(long, env = "LYCHEEMEM_KEYS", global = true)]
    keys: Option<PathBuf>,
    /// Store directory (the key file defaults to <store>/keys.json), or a PostgreSQL store's
    /// URL (its keys live in the store, shared by every replica, unless --keys names a file).
    #[arg(
        long,
        env = "LYCHEEMEM_STORE",
        default_value = "lycheemem-data",
        global = true
    )]
    store: PathBuf,
    /// TOML configuration file (for a PostgreSQL store: `[store] postgres_schema`).
    #[arg(long, env = "LYCHEEMEM_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    action: KeysAction,
}

/// The keys a command works on: `--keys FILE`, else a PostgreSQL store's own keys, else
/// `<store>/keys.json`. A PostgreSQL store must exist (`serve` or `ingest` creates it).
fn open_keys(
    keys: Option<&Path>,
    store: &Path,
    config: &lycheemem::core::Config,
) -> Result<KeyStore> {
    if let Some(path) = keys {
        return KeyStore::load(path);
    }
    if lycheemem::is_postgres_location(store) {
        let shared = lycheemem::Memory::open_store(store, config)
            .context("opening the PostgreSQL store for its API keys")?;
        return KeyStore::in_store(std::sync::Arc::from(shared));
    }
    KeyStore::load(&store.join("keys.json"))
}

pub fn serve(models_dir: &Path, args: ServeArgs) -> Result<()> {
    if !args.bind.ip().is_loopback() && !args.allow_remote {
        bail!(
            "{} is not a loopback address; pass --allow-remote to expose the server",
            args.bind
        );
    }
    let cfg = ServerConfig {
        bind: args.bind,
        allow_remote: args.allow_remote,
        max_body_bytes: args.max_body_bytes,
        request_timeout: Duration::from_secs(args.timeout_secs),
        queue_capacity: args.queue,
        encode_workers: args.encode_workers,
        drain_timeout: Duration::from_secs(args.drain_secs),
        sweep_interval: Duration::from_secs(args.sweep_secs),
        limits: Limits {
            max_queries_in_flight: args.max_queries,
            ..Limits::default()
        },
    };
    // Before the models load: a setting the server cannot start with fails at once.
    cfg.check()?;
    let memory = Arc::new(args.memory.open(models_dir)?);
    let keys = open_keys(
        args.keys.as_deref(),
        &args.memory.store,
        &args.memory.config()?,
    )?;
    if keys.is_empty() {
        eprintln!(
            "warning: no API keys in {}; create one with `lycheemem keys add --namespace NAME`",
            keys.location()
        );
    }
    lycheemem_server::run(memory, keys, cfg)
}

pub fn mcp(models_dir: &Path, args: McpArgs) -> Result<()> {
    let ns = args.memory.namespace()?;
    let memory = Arc::new(args.memory.open(models_dir)?);
    lycheemem_server::mcp::run_stdio(memory, ns)
}

pub fn keys(args: KeysArgs) -> Result<()> {
    let config = match &args.config {
        Some(path) => lycheemem::core::Config::from_toml_file(path)
            .with_context(|| format!("configuration {}", path.display()))?,
        None => lycheemem::core::Config::default(),
    };
    let mut store = open_keys(args.keys.as_deref(), &args.store, &config)?;
    let path = store.location();
    match args.action {
        KeysAction::Add { namespace, label } => {
            let ns = Namespace::new(namespace)?;
            let (entry, key) = store.add(&ns, label)?;
            eprintln!(
                "created {} for namespace {} in {} (the key is shown only now):",
                entry.id, entry.namespace, path
            );
            println!("{key}");
        }
        KeysAction::List => {
            for e in store.entries() {
                println!(
                    "{}\t{}\t{}\t{}",
                    e.id,
                    e.namespace,
                    e.created,
                    e.label.as_deref().unwrap_or("")
                );
            }
        }
        KeysAction::Revoke { id } => {
            if !store.revoke(&id)? {
                bail!("no key {id} in {path}");
            }
            println!("revoked {id}");
        }
    }
    Ok(())
}
