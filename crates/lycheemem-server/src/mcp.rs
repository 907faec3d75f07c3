//! MCP tools over the same memory: `memory_add`, `memory_search`, `memory_answer`,
//! `memory_delete`, `memory_stats`. Over streamable HTTP (`/mcp`) the namespace comes from the
//! caller's API key and adds go through the background queue; over stdio it is configured and
//! adds are encoded before the tool returns.

use crate::api::{AppState, Caller};
use lycheemem::{Memory, NewTurn, QueryOptions};
use lycheemem_core::{Namespace, SessionId};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{
    ErrorData as McpError, RoleServer, ServerHandler, ServiceExt, tool, tool_handler, tool_router,
};
use schemars::JsonSchema;
use serde::Deserialize;
use std::sync::Arc;

#[derive(Debug, Deserialize, JsonSchema)]
pub struct TurnArg {
    /// `user` (default), `assistant` or `system`.
    #[serde(default)]
    pub role: Option<String>,
    /// Speaker name in multi-party conversations.
    #[serde(default)]
    pub speaker: Option<String>,
    pub text: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct AddArgs {
    /// Session (conversation) id.
    pub session: String,
    /// Session date, e.g. 2024-05-01.
    #[serde(default)]
    pub date: Option<String>,
    pub turns: Vec<TurnArg>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct QuestionArgs {
    pub question: String,
    /// Evidence items to return (at least 15, at most the server's `top_k` limit, 100 by
    /// default).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// The question's date, e.g. 2024-06-01.
    #[serde(default)]
    pub date: Option<String>,
}

impl QuestionArgs {
    /// The search's options, or why the arguments are refused (the HTTP API's limits).
    fn options(&self, limits: &crate::api::Limits) -> Result<QueryOptions, String> {
        let top_k = self.top_k.unwrap_or(0);
        limits.check_question(&self.question, top_k)?;
        Ok(QueryOptions {
            top_k,
            context: String::new(),
            reference_date: self.date.clone(),
            ..QueryOptions::default()
        })
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct DeleteArgs {
    /// Delete this record.
    #[serde(default)]
    pub record_id: Option<String>,
    /// Delete this session and everything derived from it.
    #[serde(default)]
    pub session: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct StatsArgs {}

/// How `memory_add` ingests.
#[derive(Clone)]
enum Ingest {
    /// Encode before returning (stdio).
    Direct,
    /// Through the server's background queue.
    Queued(AppState),
}

/// The MCP server.
#[derive(Clone)]
pub struct MemoryTools {
    memory: Arc<Memory>,
    /// The namespace when not taken from the HTTP request (stdio).
    fixed: Option<Namespace>,
    ingest: Ingest,
}

impl MemoryTools {
    /// The request limits: the server's over HTTP, the HTTP API's defaults over stdio.
    fn limits(&self) -> crate::api::Limits {
        match &self.ingest {
            Ingest::Queued(state) => state.limits.clone(),
            Ingest::Direct => crate::api::Limits::default(),
        }
    }
}

fn fail(message: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message.into())])
}

fn ok_json(v: &impl serde::Serialize) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(
        serde_json::to_string_pretty(v).unwrap_or_default(),
    )])
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> lycheemem_core::Result<T> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("worker task failed: {e}")),
    }
}

impl MemoryTools {
    /// Runs `f` on the caller's namespace off the async runtime and renders its result; a
    /// failure becomes a tool error the client can read.
    async fn with_memory<T: Send + 'static>(
        &self,
        ctx: &RequestContext<RoleServer>,
        f: impl FnOnce(&Memory, &Namespace) -> lycheemem_core::Result<T> + Send + 'static,
        render: impl FnOnce(T) -> CallToolResult,
    ) -> Result<CallToolResult, McpError> {
        let ns = self.namespace(ctx)?;
        let memory = self.memory.clone();
        Ok(match blocking(move || f(&memory, &ns)).await {
            Ok(v) => render(v),
            Err(e) => fail(e),
        })
    }

    fn namespace(&self, ctx: &RequestContext<RoleServer>) -> Result<Namespace, McpError> {
        if let Some(ns) = &self.fixed {
            return Ok(ns.clone());
        }
        ctx.extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.extensions.get::<Caller>())
            .map(|c| c.0.clone())
            .ok_or_else(|| McpError::invalid_request("unauthenticated", None))
    }
}

#[tool_router]
impl MemoryTools {
    #[tool(
        description = "Store conversation turns in long-term memory. Turns are grouped into topic segments and turned into memory records."
    )]
    async fn memory_add(
        &self,
        Parameters(a): Parameters<AddArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let ns = self.namespace(&ctx)?;
        if let Err(e) = self.limits().check_turns(a.turns.len()) {
            return Ok(fail(e));
        }
        let sid = match SessionId::new(a.session) {
            Ok(s) => s,
            Err(e) => return Ok(fail(e.to_string())),
        };
        let mut turns = Vec::new();
        for t in a.turns {
            let role = match crate::api::parse_role(t.role.as_deref()) {
                Ok(r) => r,
                Err(e) => return Ok(fail(e.message)),
            };
            turns.push(NewTurn {
                role,
                speaker: t.speaker,
                text: t.text,
                time: None,
            });
        }
        let memory = self.memory.clone();
        match &self.ingest {
            Ingest::Direct => {
                let r =
                    blocking(move || memory.add_turns(&ns, &sid, a.date.as_deref(), turns)).await;
                Ok(match r {
                    Ok(r) => ok_json(&serde_json::json!({
                        "stored": r.turns_stored, "segments_encoded": r.segments.len(), "records": r.records
                    })),
                    Err(e) => fail(e),
                })
            }
            Ingest::Queued(state) => Ok(
                match crate::api::store_and_queue(state, ns, sid, a.date, None, turns).await {
                    Ok(r) => ok_json(&serde_json::json!({
                        "stored": r.count, "first_index": r.first_index, "queued": true
                    })),
                    Err(e) => fail(format!("{} ({})", e.message, e.code)),
                },
            ),
        }
    }

    /// A question's work: over HTTP under the server's admission bound and cancelled with the
    /// request (see `api::run_query`); over stdio directly.
    async fn with_question<T: Send + 'static>(
        &self,
        ctx: &RequestContext<RoleServer>,
        opts: QueryOptions,
        work: impl FnOnce(&Memory, &Namespace, &QueryOptions) -> lycheemem_core::Result<T>
        + Send
        + 'static,
        usage: fn(&T) -> &[lycheemem_core::TokenUsage],
        render: impl FnOnce(T) -> CallToolResult,
    ) -> Result<CallToolResult, McpError> {
        let ns = self.namespace(ctx)?;
        let result = match &self.ingest {
            Ingest::Queued(state) => {
                crate::api::run_query(state, opts, move |m, o| work(m, &ns, o), usage)
                    .await
                    .map_err(|e| e.message)
            }
            Ingest::Direct => {
                let memory = self.memory.clone();
                blocking(move || work(&memory, &ns, &opts)).await
            }
        };
        Ok(match result {
            Ok(v) => render(v),
            Err(e) => fail(e),
        })
    }

    #[tool(
        description = "Find the memory evidence for a question: records and dialogue snippets with dates and scores."
    )]
    async fn memory_search(
        &self,
        Parameters(a): Parameters<QuestionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let opts = match a.options(&self.limits()) {
            Ok(opts) => opts,
            Err(e) => return Ok(fail(e)),
        };
        self.with_question(
            &ctx,
            opts,
            move |m, ns, opts| m.search(ns, &a.question, opts),
            |r| &r.usage,
            |r| {
                ok_json(
                    &r.evidence
                        .iter()
                        .map(|e| {
                            serde_json::json!({
                                "text": e.evidence.text,
                                "session": e.session,
                                "session_date": e.session_date,
                                "memory_type": e.memory_type,
                                "turns": e.turns,
                                "score": e.evidence.final_score,
                            })
                        })
                        .collect::<Vec<_>>(),
                )
            },
        )
        .await
    }

    #[tool(
        description = "Answer a question from long-term memory (grounded in the stored evidence)."
    )]
    async fn memory_answer(
        &self,
        Parameters(a): Parameters<QuestionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let opts = match a.options(&self.limits()) {
            Ok(opts) => opts,
            Err(e) => return Ok(fail(e)),
        };
        self.with_question(
            &ctx,
            opts,
            move |m, ns, opts| m.answer(ns, &a.question, opts),
            |a| &a.usage,
            |a| CallToolResult::success(vec![ContentBlock::text(a.text)]),
        )
        .await
    }

    #[tool(description = "Delete a memory record (record_id) or a whole session (session).")]
    async fn memory_delete(
        &self,
        Parameters(a): Parameters<DeleteArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let ns = self.namespace(&ctx)?;
        let memory = self.memory.clone();
        let r = match (a.record_id, a.session) {
            (Some(id), None) => blocking(move || memory.delete_record(&ns, &id)).await,
            (None, Some(s)) => match SessionId::new(s) {
                Ok(sid) => blocking(move || memory.delete_session(&ns, &sid)).await,
                Err(e) => Err(e.to_string()),
            },
            _ => Err("give exactly one of record_id or session".into()),
        };
        Ok(match r {
            Ok(r) => ok_json(&r),
            Err(e) => fail(e),
        })
    }

    #[tool(description = "Counts of the memory: sessions, turns, segments, records, nodes.")]
    async fn memory_stats(
        &self,
        Parameters(_): Parameters<StatsArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        self.with_memory(&ctx, |m, ns| m.stats(ns), |s| ok_json(&s))
            .await
    }
}

#[tool_handler]
impl ServerHandler for MemoryTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("lycheemem", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Long-term memory: memory_add stores conversation turns; memory_search and memory_answer recall them.",
            )
    }
}

/// The streamable-HTTP MCP service for the server's router (namespace from the API key).
pub fn http_service(
    state: AppState,
    cfg: &crate::ServerConfig,
) -> StreamableHttpService<MemoryTools, LocalSessionManager> {
    let tools = MemoryTools {
        memory: state.memory.clone(),
        fixed: None,
        ingest: Ingest::Queued(state),
    };
    let mut config = StreamableHttpServerConfig::default();
    if cfg.allow_remote {
        config = config.disable_allowed_hosts();
    }
    StreamableHttpService::new(
        move || Ok(tools.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// Serves MCP over stdin/stdout for one namespace until the client disconnects (blocking).
pub fn run_stdio(memory: Arc<Memory>, namespace: Namespace) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let tools = MemoryTools {
            memory,
            fixed: Some(namespace),
            ingest: Ingest::Direct,
        };
        let (transport, relay) = parse_error_relay();
        let service = tools.serve(transport).await?;
        service.waiting().await?;
        // The service's output closes with it; the relay then copies what is left and ends.
        match tokio::time::timeout(std::time::Duration::from_secs(5), relay).await {
            Ok(done) => done??,
            Err(_) => tracing::warn!("the stdio relay did not finish after the session closed"),
        }
        Ok(())
    })
}

/// The longest line the stdio transport reads, its newline apart (a message; the HTTP API's
/// default body limit is 4 MiB).
const MAX_STDIO_LINE: usize = 16 << 20;

/// Puts a relay between stdin/stdout and the MCP service: a line that is not JSON is answered
/// with the JSON-RPC parse error (-32700, id null) as the JSON-RPC 2.0 specification asks,
/// instead of being dropped silently (the SDK's choice); every other line passes through
/// unchanged (the SDK answers well-formed JSON of the wrong shape with -32600 itself). The
/// reply is valid JSON, so a peer that echoes it cannot start an error loop. Returns the
/// service's side of the relay and the task that ends when the service's output closes.
fn parse_error_relay() -> (
    (tokio::io::DuplexStream, tokio::io::DuplexStream),
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    const BUFFER: usize = 1 << 16;
    let (service_in, mut feed) = tokio::io::duplex(BUFFER);
    let (service_out, output) = tokio::io::duplex(BUFFER);
    let (errors_tx, mut errors) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut stdin = BufReader::new(tokio::io::stdin());
        let mut line = Vec::new();
        'lines: loop {
            line.clear();
            match (&mut stdin)
                .take(MAX_STDIO_LINE as u64 + 1)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.len() > MAX_STDIO_LINE && line.last() != Some(&b'\n') {
                // Too long to hold: answered like any other line that is not a message, and
                // the rest of it read and dropped.
                let reply = serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": null,
                    "error": {"code": -32700, "message": format!("Parse error: a line is limited to {MAX_STDIO_LINE} bytes")}
                });
                let _ = errors_tx.send(reply.to_string().into_bytes());
                let mut rest = Vec::new();
                loop {
                    rest.clear();
                    match (&mut stdin)
                        .take(1 << 16)
                        .read_until(b'\n', &mut rest)
                        .await
                    {
                        Ok(0) | Err(_) => break 'lines,
                        Ok(_) if rest.last() == Some(&b'\n') => break,
                        Ok(_) => {}
                    }
                }
                continue;
            }
            let text = line.trim_ascii();
            if text.is_empty() {
                continue;
            }
            match serde_json::from_slice::<serde_json::Value>(text) {
                Ok(_) => {
                    if feed.write_all(text).await.is_err() || feed.write_all(b"\n").await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let reply = serde_json::json!({
                        "jsonrpc": "2.0",
                        "id": null,
                        "error": {"code": -32700, "message": format!("Parse error: {e}")}
                    });
                    let _ = errors_tx.send(reply.to_string().into_bytes());
                }
            }
        }
        // Dropping `feed` ends the service's input: the session closes as on a plain EOF.
    });
    let relay = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        let mut output = BufReader::new(output);
        let mut line = Vec::new();
        loop {
            tokio::select! {
                // `read_until` keeps what it read in `line` if the other branch wins.
                read = output.read_until(b'\n', &mut line) => {
                    if read? == 0 {
                        break;
                    }
                    stdout.write_all(&line).await?;
                    stdout.flush().await?;
                    line.clear();
                }
                Some(mut reply) = errors.recv() => {
                    reply.push(b'\n');
                    stdout.write_all(&reply).await?;
                    stdout.flush().await?;
                }
            }
        }
        Ok(())
    });
    ((service_in, service_out), relay)
}
