//! Test support for `tests/server.rs`: the stdio MCP server over a memory in the folder given
//! as the first argument, with test doubles for the models (scripted LLM, bag-of-words
//! embedder). `lycheemem mcp` is the real command.

use lycheemem::{Components, Memory};
use lycheemem_core::{Config, Namespace};
use lycheemem_testkit::{HashEmbedder, ScriptedLlm};
use std::sync::Arc;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).expect("a store folder");
    let llm = Arc::new(ScriptedLlm::pipeline("scripted answer"));
    let components = Components::with_llm(Arc::new(HashEmbedder::new(64)), llm);
    let memory = Arc::new(Memory::with_components(dir, Config::default(), components)?);
    lycheemem_server::mcp::run_stdio(memory, Namespace::new("stdio")?)
}
