//! `lycheemem-bench serve-openai`: the peer endpoint on its own — the configured encoder LLM and
//! embedder behind a loopback OpenAI-compatible API, metered, until interrupted. For trying a
//! peer system by hand against the exact models the harness gives it.

use anyhow::Result;
use clap::Args;
use lycheemem_bench::peer::OpenAiEndpoint;
use lycheemem_cli::settings::{ModelArgs, load_components};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ServeOpenAiArgs {
    /// Append every chat call (messages, options, reply, usage) to this JSON Lines file.
    #[arg(long)]
    log: Option<PathBuf>,
    #[command(flatten)]
    models: ModelArgs,
}

pub fn run(models_dir: &Path, args: ServeOpenAiArgs) -> Result<()> {
    let base = args.models.config()?;
    let comps = load_components(&base, models_dir)?;
    let endpoint = OpenAiEndpoint::start(comps.encode_llm, comps.embedder, args.log)?;
    let (llm, embedder) = endpoint.model_names();
    println!("{}", endpoint.base_url());
    eprintln!("serving chat model {llm:?} and embedding model {embedder:?}; Ctrl-C stops");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
