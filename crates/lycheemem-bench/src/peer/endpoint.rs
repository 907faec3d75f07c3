//! A loopback OpenAI-compatible endpoint over the harness's own models: `POST
//! /v1/chat/completions` answered by an [`Llm`], `POST /v1/embeddings` by an [`Embedder`],
//! `GET /v1/models`. Peer memory systems (mem0, A-Mem) take an OpenAI base URL for their LLM and
//! embedder; pointing them here gives them the very models lycheemem runs with, and meters
//! every call they make (per phase: the driver posts `/lycheemem/phase` between building and
//! searching).
//!
//! Started for a build ([`OpenAiEndpoint::start_for_build`]), it also keeps the build's
//! checkpoint file: after each unit of the build is in the peer's store, the driver posts
//! `/lycheemem/checkpoint` with its progress, and the endpoint writes that progress together with
//! the build's cumulative cost (earlier runs' cost from the file, plus this run's build-phase
//! calls). So the calls and tokens of a build stopped and resumed are those of its finished
//! units: calls made for a unit that a kill cut short are not counted, and those it makes again
//! on resuming (replayed, the same tokens) are counted once. Two limits: a kill in the moment
//! between a unit reaching the peer's store and its checkpoint loses that unit's calls (the
//! resumed driver finds the unit stored); and wall seconds count each finished unit's time in
//! the run that finished it (a unit resumed from replayed calls takes less).
//!
//! Deliberately small: HTTP/1.1 with `Content-Length` bodies, one thread per connection, one
//! request per connection (`Connection: close`), bodies up to [`MAX_BODY`]. It binds
//! 127.0.0.1 only. A malformed request gets a 4xx with an OpenAI-style error object; a model
//! error a 500; nothing a client sends can panic it.

use anyhow::{Context, Result};
use lycheemem_embed::Embedder;
use lycheemem_llm::{ChatMessage, ChatRole, Completion, FinishReason, GenerateOptions, Llm};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Largest request body accepted (a chat request carries a whole prompt; 32 MiB is far beyond
/// any context the served models have).
pub const MAX_BODY: usize = 32 << 20;
/// Largest header block accepted.
const MAX_HEADERS: usize = 64 << 10;
/// Texts per `/v1/embeddings` request at most.
const MAX_EMBED_INPUTS: usize = 4096;
/// Completion tokens a chat request that names no `max_tokens` may spend. OpenAI's limit is
/// then the context; a cap keeps a small model that loops under greedy decoding from
/// spending minutes on output its caller cannot parse anyway, and is set well above what a
/// well-formed reply of the peers' prompts needs (A-Mem's evolution reply for five neighbours
/// is a few hundred tokens).
pub const DEFAULT_MAX_TOKENS: u32 = 1024;

/// What the endpoint served in one phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseUsage {
    pub chat_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens whose prefill the local model skipped (KV-cache prefix).
    #[serde(default)]
    pub cached_prompt_tokens: u64,
    /// Sum of the chat calls' latencies.
    pub llm_seconds: f64,
    pub embed_requests: u64,
    pub embed_texts: u64,
    /// Requests answered with an error status.
    pub errors: u64,
}

impl PhaseUsage {
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    /// Adds `other` to this phase's counts.
    pub fn add(&mut self, other: &PhaseUsage) {
        self.chat_calls += other.chat_calls;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
        self.llm_seconds += other.llm_seconds;
        self.embed_requests += other.embed_requests;
        self.embed_texts += other.embed_texts;
        self.errors += other.errors;
    }
}

/// What a build has cost so far: its build-phase LLM use and the build's wall seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BuildCost {
    pub usage: PhaseUsage,
    pub seconds: f64,
}

/// A build's checkpoint file and the cost it held when this endpoint started.
struct Checkpoint {
    path: PathBuf,
    /// Earlier runs' cost.
    base: BuildCost,
    /// The cost at the latest checkpoint (`base` until one is posted).
    committed: BuildCost,
}

/// Reads the cost kept in a checkpoint file; nothing when there is no file yet.
fn read_checkpoint(path: &Path) -> Result<BuildCost> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BuildCost::default()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let value: Value =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if value.get("usage").is_none() {
        anyhow::bail!(
            "{} keeps this build's progress but not its cost (an older harness wrote it); \
             delete its folder to build it again (its LLM calls replay from the results folder)",
            path.display()
        );
    }
    serde_json::from_value(value).with_context(|| format!("reading the cost in {}", path.display()))
}

/// Writes `value` to `path` through a synced temporary file, so a kill leaves the old file or
/// the new one.
fn write_replacing(path: &Path, value: &Value) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(value.to_string().as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

struct Shared {
    llm: Arc<dyn Llm>,
    embedder: Arc<dyn Embedder>,
    llm_name: String,
    embed_name: String,
    phase: Mutex<String>,
    usage: Mutex<BTreeMap<String, PhaseUsage>>,
    /// Every chat call (messages, options, reply) is appended here when set.
    log: Option<PathBuf>,
    checkpoint: Option<Mutex<Checkpoint>>,
}

/// One logged chat call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoggedCall {
    pub phase: String,
    pub messages: Vec<ChatMessage>,
    pub options: GenerateOptions,
    pub completion: Completion,
}

/// A running endpoint; dropping it stops the listener (connections in flight finish).
pub struct OpenAiEndpoint {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl OpenAiEndpoint {
    /// Serves `llm` and `embedder` on a free loopback port. Usage is counted under phase
    /// `"build"` until a client posts another phase. With `log`, every chat call is appended to
    /// that JSON Lines file ([`LoggedCall`]).
    pub fn start(
        llm: Arc<dyn Llm>,
        embedder: Arc<dyn Embedder>,
        log: Option<PathBuf>,
    ) -> Result<OpenAiEndpoint> {
        Self::serve(llm, embedder, log, None)
    }

    /// [`OpenAiEndpoint::start`] for a peer's build, whose checkpoint file is `checkpoint`
    /// (the cost of earlier runs is read from it; see the module documentation).
    pub fn start_for_build(
        llm: Arc<dyn Llm>,
        embedder: Arc<dyn Embedder>,
        log: Option<PathBuf>,
        checkpoint: &Path,
    ) -> Result<OpenAiEndpoint> {
        let base = read_checkpoint(checkpoint)?;
        Self::serve(
            llm,
            embedder,
            log,
            Some(Checkpoint {
                path: checkpoint.to_path_buf(),
                committed: base.clone(),
                base,
            }),
        )
    }

    fn serve(
        llm: Arc<dyn Llm>,
        embedder: Arc<dyn Embedder>,
        log: Option<PathBuf>,
        checkpoint: Option<Checkpoint>,
    ) -> Result<OpenAiEndpoint> {
        let listener =
            TcpListener::bind("127.0.0.1:0").context("binding the peer endpoint on loopback")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            llm_name: llm.model_id().to_string(),
            embed_name: embedder.model_id().to_string(),
            llm,
            embedder,
            phase: Mutex::new("build".into()),
            usage: Mutex::new(BTreeMap::new()),
            log,
            checkpoint: checkpoint.map(Mutex::new),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("peer-endpoint".into())
                .spawn(move || {
                    for stream in listener.incoming() {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let Ok(stream) = stream else { continue };
                        let shared = shared.clone();
                        let _ = std::thread::Builder::new()
                            .name("peer-endpoint-conn".into())
                            .spawn(move || serve_connection(stream, &shared));
                    }
                })?
        };
        Ok(OpenAiEndpoint {
            addr,
            shared,
            stop,
            thread: Some(thread),
        })
    }

    /// The base URL clients are given (`http://127.0.0.1:PORT/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The model names the endpoint reports (the served models' ids).
    pub fn model_names(&self) -> (String, String) {
        (self.shared.llm_name.clone(), self.shared.embed_name.clone())
    }

    /// Usage so far, by phase.
    pub fn usage(&self) -> BTreeMap<String, PhaseUsage> {
        lock(&self.shared.usage).clone()
    }

    /// The build's cost at its latest checkpoint (earlier runs' included); `None` for an
    /// endpoint not started for a build.
    pub fn build_cost(&self) -> Option<BuildCost> {
        let checkpoint = self.shared.checkpoint.as_ref()?;
        Some(lock(checkpoint).committed.clone())
    }
}

impl Drop for OpenAiEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An HTTP error: status and message.
struct Failure(u16, String);

fn bad(msg: impl Into<String>) -> Failure {
    Failure(400, msg.into())
}

struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

fn read_request(stream: &mut BufReader<TcpStream>) -> Result<Request, Failure> {
    let mut head = Vec::new();
    loop {
        let mut line = Vec::new();
        let n = stream
            .by_ref()
            .take((MAX_HEADERS + 1 - head.len().min(MAX_HEADERS)) as u64)
            .read_until(b'\n', &mut line)
            .map_err(|e| bad(format!("reading the request: {e}")))?;
        if n == 0 {
            return Err(bad("the connection closed before the request ended"));
        }
        head.extend_from_slice(&line);
        if head.len() > MAX_HEADERS {
            return Err(Failure(431, "request headers too large".into()));
        }
        if line == b"\r\n" || line == b"\n" {
            break;
        }
    }
    let head = String::from_utf8(head).map_err(|_| bad("request headers are not UTF-8"))?;
    let mut lines = head.lines();
    let start = lines.next().unwrap_or_default();
    let mut parts = start.split_whitespace();
    let (method, path) = match (parts.next(), parts.next()) {
        (Some(m), Some(p)) => (m.to_string(), p.to_string()),
        _ => return Err(bad(format!("malformed request line {start:?}"))),
    };
    let mut length = 0usize;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "content-length" {
            length = value
                .parse()
                .map_err(|_| bad(format!("bad Content-Length {value:?}")))?;
        } else if name == "transfer-encoding" && !value.eq_ignore_ascii_case("identity") {
            return Err(Failure(411, "send a Content-Length body".into()));
        }
    }
    if length > MAX_BODY {
        return Err(Failure(
            413,
            format!("request body of {length} bytes is over {MAX_BODY}"),
        ));
    }
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .map_err(|e| bad(format!("reading the request body: {e}")))?;
    Ok(Request { method, path, body })
}

fn write_response(stream: &mut TcpStream, status: u16, body: &Value) {
    let text = body.to_string();
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        text.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(text.as_bytes());
    let _ = stream.flush();
}

fn serve_connection(stream: TcpStream, shared: &Shared) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let outcome = read_request(&mut reader).and_then(|req| route(shared, &req));
    match outcome {
        Ok(body) => write_response(&mut writer, 200, &body),
        Err(Failure(status, message)) => {
            let phase = lock(&shared.phase).clone();
            lock(&shared.usage).entry(phase).or_default().errors += 1;
            let kind = if status >= 500 {
                "server_error"
            } else {
                "invalid_request_error"
            };
            write_response(
                &mut writer,
                status,
                &json!({"error": {"message": message, "type": kind}}),
            );
        }
    }
}

fn route(shared: &Shared, req: &Request) -> Result<Value, Failure> {
    let path = req.path.split('?').next().unwrap_or_default();
    match (req.method.as_str(), path) {
        ("POST", "/v1/chat/completions") => chat(shared, &json_body(req)?),
        ("POST", "/v1/embeddings") => embeddings(shared, &json_body(req)?),
        ("GET", "/v1/models") => Ok(json!({
            "object": "list",
            "data": [
                {"id": shared.llm_name, "object": "model", "owned_by": "lycheemem"},
                {"id": shared.embed_name, "object": "model", "owned_by": "lycheemem"},
            ]
        })),
        ("POST", "/lycheemem/phase") => {
            let body = json_body(req)?;
            let phase = body
                .get("phase")
                .and_then(Value::as_str)
                .filter(|p| !p.is_empty() && p.len() <= 64)
                .ok_or_else(|| bad("expected {\"phase\": \"<name>\"}"))?;
            *lock(&shared.phase) = phase.to_string();
            Ok(json!({"phase": phase}))
        }
        ("POST", "/lycheemem/checkpoint") => checkpoint(shared, &json_body(req)?),
        (
            _,
            "/v1/chat/completions"
            | "/v1/embeddings"
            | "/v1/models"
            | "/lycheemem/phase"
            | "/lycheemem/checkpoint",
        ) => Err(Failure(
            405,
            format!("{} is not allowed on {path}", req.method),
        )),
        _ => Err(Failure(404, format!("no route {path}"))),
    }
}

/// `{"progress": {...}, "seconds": S}`: the client's progress (any object without the keys
/// `usage` and `seconds`) and the seconds this run's build has taken. Writes the progress, the
/// cost of earlier runs plus this run's build-phase calls, and the seconds of both to the
/// checkpoint file, and answers with that cost.
fn checkpoint(shared: &Shared, body: &Value) -> Result<Value, Failure> {
    let Some(checkpoint) = &shared.checkpoint else {
        return Err(Failure(
            404,
            "this endpoint keeps no build checkpoint".into(),
        ));
    };
    let expected = "expected {\"progress\": {...}, \"seconds\": <this run's build seconds>}";
    let mut file = body
        .get("progress")
        .and_then(Value::as_object)
        .cloned()
        .ok_or_else(|| bad(expected))?;
    if file.contains_key("usage") || file.contains_key("seconds") {
        return Err(bad("the progress may not name \"usage\" or \"seconds\""));
    }
    let seconds = body
        .get("seconds")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s >= 0.0)
        .ok_or_else(|| bad(expected))?;
    let build = lock(&shared.usage)
        .get("build")
        .cloned()
        .unwrap_or_default();
    let mut checkpoint = lock(checkpoint);
    let mut cost = checkpoint.base.clone();
    cost.usage.add(&build);
    cost.seconds += seconds;
    let cost_json = json!({"usage": cost.usage, "seconds": cost.seconds});
    file.insert("usage".into(), cost_json["usage"].clone());
    file.insert("seconds".into(), cost_json["seconds"].clone());
    write_replacing(&checkpoint.path, &Value::Object(file))
        .map_err(|e| Failure(500, format!("writing {}: {e}", checkpoint.path.display())))?;
    checkpoint.committed = cost;
    Ok(cost_json)
}

fn json_body(req: &Request) -> Result<Value, Failure> {
    let text = std::str::from_utf8(&req.body).map_err(|_| bad("the body is not UTF-8"))?;
    serde_json::from_str(text).map_err(|e| bad(format!("the body is not JSON: {e}")))
}

fn message_text(content: Option<&Value>) -> Result<String, Failure> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => return Err(bad("only text content parts are supported")),
                }
            }
            Ok(text)
        }
        Some(_) => Err(bad("message content must be a string or text parts")),
    }
}

/// The chat request as generation options and messages.
fn parse_chat(body: &Value) -> Result<(Vec<ChatMessage>, GenerateOptions), Failure> {
    let raw = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty array"))?;
    let mut messages = Vec::with_capacity(raw.len());
    for m in raw {
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => ChatRole::System,
            Some("user") => ChatRole::User,
            Some("assistant") => ChatRole::Assistant,
            other => return Err(bad(format!("unsupported message role {other:?}"))),
        };
        messages.push(ChatMessage {
            role,
            content: message_text(m.get("content"))?,
        });
    }
    if body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return Err(bad("tools are not supported by this endpoint"));
    }
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(bad("only n = 1 is supported"));
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err(bad("streaming is not supported by this endpoint"));
    }
    let number = |name: &str| body.get(name).and_then(Value::as_f64);
    let mut options = GenerateOptions {
        // OpenAI's defaults where the request is silent.
        temperature: 1.0,
        max_tokens: DEFAULT_MAX_TOKENS,
        ..Default::default()
    };
    if let Some(t) = number("temperature") {
        if !(0.0..=2.0).contains(&t) {
            return Err(bad(format!("temperature {t} is outside 0..2")));
        }
        options.temperature = t as f32;
    }
    if let Some(p) = number("top_p") {
        if !(p > 0.0 && p <= 1.0) {
            return Err(bad(format!("top_p {p} is outside (0, 1]")));
        }
        options.top_p = p as f32;
    }
    if let Some(seed) = body.get("seed").and_then(Value::as_u64) {
        options.seed = seed;
    }
    let max = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .filter(|v| !v.is_null());
    if let Some(max) = max {
        let n = max
            .as_u64()
            .filter(|&n| n >= 1)
            .ok_or_else(|| bad("max_tokens must be a positive integer"))?;
        options.max_tokens = n.min(u64::from(u32::MAX)) as u32;
    }
    options.stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        other => string_or_strings(other)
            .ok_or_else(|| bad("stop must be a string or an array of strings"))?,
    };
    options.json_schema = match body.get("response_format") {
        None | Some(Value::Null) => None,
        Some(format) => match format.get("type").and_then(Value::as_str) {
            Some("text") => None,
            // Any JSON object: the model's output is constrained to one.
            Some("json_object") => Some(free_whitespace(json!({"type": "object"}))),
            Some("json_schema") => Some(free_whitespace(
                format
                    .pointer("/json_schema/schema")
                    .cloned()
                    .ok_or_else(|| bad("response_format json_schema lacks json_schema.schema"))?,
            )),
            other => return Err(bad(format!("unsupported response_format type {other:?}"))),
        },
    };
    Ok((messages, options))
}

/// JSON mode as OpenAI and llama.cpp's server define it: any whitespace between tokens. (The
/// local decoder otherwise forces compact JSON, which is right for lycheemem's own prompts but
/// changes what a model writes for a prompt that expects pretty-printed output: measured on
/// mem0's extraction prompt, Qwen2.5-Coder-1.5B wrote `{"memory": []}` under compact JSON and
/// the two facts of the exchange with free whitespace.)
fn free_whitespace(mut schema: Value) -> Value {
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": true}));
    }
    schema
}

/// A string or an array of strings (OpenAI's `stop` and `input`); `None` for anything else.
fn string_or_strings(value: Option<&Value>) -> Option<Vec<String>> {
    match value? {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(a) => a.iter().map(|v| v.as_str().map(str::to_string)).collect(),
        _ => None,
    }
}

fn chat(shared: &Shared, body: &Value) -> Result<Value, Failure> {
    let (messages, options) = parse_chat(body)?;
    let reply = shared
        .llm
        .complete(&messages, &options)
        .map_err(|e| Failure(500, format!("the model failed: {e}")))?;
    let phase = lock(&shared.phase).clone();
    if let Some(log) = &shared.log {
        let call = LoggedCall {
            phase: phase.clone(),
            messages,
            options,
            completion: reply.clone(),
        };
        crate::jsonl::append_line(log, &call)
            .map_err(|e| Failure(500, format!("logging the call: {e}")))?;
    }
    {
        let mut usage = lock(&shared.usage);
        let u = usage.entry(phase).or_default();
        u.chat_calls += 1;
        u.prompt_tokens += reply.prompt_tokens;
        u.completion_tokens += reply.completion_tokens;
        u.cached_prompt_tokens += reply.cached_prompt_tokens;
        u.llm_seconds += reply.latency_ms as f64 / 1e3;
    }
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(json!({
        "id": format!("chatcmpl-{created}"),
        "object": "chat.completion",
        "created": created,
        "model": shared.llm_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": reply.text},
            "finish_reason": match reply.finish_reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            },
        }],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_prompt_tokens},
        },
    }))
}

fn embeddings(shared: &Shared, body: &Value) -> Result<Value, Failure> {
    let texts = string_or_strings(body.get("input"))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| bad("input must be a string or a non-empty array of strings"))?;
    if texts.len() > MAX_EMBED_INPUTS {
        return Err(bad(format!(
            "{} inputs in one request; at most {MAX_EMBED_INPUTS}",
            texts.len()
        )));
    }
    let dims = shared.embedder.dimension();
    if let Some(asked) = body.get("dimensions").filter(|v| !v.is_null())
        && asked.as_u64() != Some(dims as u64)
    {
        return Err(bad(format!(
            "this embedder makes {dims}-dimensional vectors; {asked} were asked for"
        )));
    }
    // The openai SDK asks for base64 unless told otherwise.
    let base64 = match body.get("encoding_format").filter(|v| !v.is_null()) {
        None => false,
        Some(f) if f == "float" => false,
        Some(f) if f == "base64" => true,
        Some(other) => {
            return Err(bad(format!(
                "encoding_format {other} is not one of \"float\", \"base64\""
            )));
        }
    };
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let vectors = shared
        .embedder
        .embed(&refs)
        .map_err(|e| Failure(500, format!("the embedder failed: {e}")))?;
    let tokens: u64 = refs
        .iter()
        .map(|t| u64::from(lycheemem_core::estimate_tokens(t)))
        .sum();
    {
        let phase = lock(&shared.phase).clone();
        let mut usage = lock(&shared.usage);
        let u = usage.entry(phase).or_default();
        u.embed_requests += 1;
        u.embed_texts += refs.len() as u64;
    }
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, embedding)| {
            let embedding = if base64 {
                json!(base64_f32(&embedding))
            } else {
                json!(embedding)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": shared.embed_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

/// A vector as OpenAI's `encoding_format: "base64"` sends it: the little-endian f32 bytes,
/// standard base64 with padding.
fn base64_f32(vector: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_testkit::{HashEmbedder, ScriptedLlm};

    /// One request over a fresh connection; returns (status, JSON body).
    fn call(url: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
        let addr = url.trim_start_matches("http://").trim_end_matches("/v1");
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, serde_json::from_str(body).unwrap())
    }

    fn endpoint(replies: &[&str]) -> (OpenAiEndpoint, Arc<ScriptedLlm>) {
        let llm = Arc::new(ScriptedLlm::new(replies));
        let e = OpenAiEndpoint::start(llm.clone(), Arc::new(HashEmbedder::new(16)), None).unwrap();
        (e, llm)
    }

    #[test]
    fn a_build_checkpoint_keeps_the_progress_and_the_cost_of_finished_work_across_runs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("progress.json");
        let llm = Arc::new(ScriptedLlm::new(&["one", "two", "three"]));
        let start = || {
            OpenAiEndpoint::start_for_build(
                llm.clone(),
                Arc::new(HashEmbedder::new(16)),
                None,
                &file,
            )
        };
        let chat = r#"{"messages":[{"role":"user","content":"hello there"}]}"#;
        let e = start().unwrap();
        let url = e.base_url();
        assert_eq!(e.build_cost(), Some(BuildCost::default()), "no file yet");
        assert_eq!(call(&url, "POST", "/v1/chat/completions", chat).0, 200);
        for (body, says) in [
            (r#"{"seconds":1}"#, "expected"),
            (r#"{"progress":[],"seconds":1}"#, "expected"),
            (r#"{"progress":{"a":1},"seconds":-1}"#, "expected"),
            (r#"{"progress":{"a":1}}"#, "expected"),
            (r#"{"progress":{"usage":1},"seconds":1}"#, "may not name"),
        ] {
            let (status, reply) = call(&url, "POST", "/lycheemem/checkpoint", body);
            assert_eq!(status, 400, "{body}: {reply}");
            assert!(reply["error"]["message"].as_str().unwrap().contains(says));
        }
        assert!(!file.exists(), "a refused checkpoint writes nothing");
        let (status, cost) = call(
            &url,
            "POST",
            "/lycheemem/checkpoint",
            r#"{"progress":{"added":["u1"]},"seconds":2.5}"#,
        );
        assert_eq!(status, 200, "{cost}");
        let one_call = e.usage()["build"].clone();
        assert_eq!(one_call.chat_calls, 1);
        // A call after the checkpoint (a unit cut short) is not part of the build's cost.
        assert_eq!(call(&url, "POST", "/v1/chat/completions", chat).0, 200);
        let committed = e.build_cost().unwrap();
        assert_eq!(
            (committed.usage.clone(), committed.seconds),
            (one_call.clone(), 2.5)
        );
        drop(e);
        let kept: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(kept["added"], json!(["u1"]));
        assert_eq!(kept["seconds"], json!(2.5));
        // The next run starts from that cost and adds its own calls and seconds to it.
        let e = start().unwrap();
        let url = e.base_url();
        assert_eq!(e.build_cost().unwrap(), committed);
        assert_eq!(call(&url, "POST", "/v1/chat/completions", chat).0, 200);
        let (status, cost) = call(
            &url,
            "POST",
            "/lycheemem/checkpoint",
            r#"{"progress":{"added":["u1","u2"]},"seconds":1}"#,
        );
        assert_eq!(status, 200, "{cost}");
        let both = e.build_cost().unwrap();
        assert_eq!((both.usage.chat_calls, both.seconds), (2, 3.5));
        assert_eq!(
            both.usage.prompt_tokens,
            2 * one_call.prompt_tokens,
            "the same prompt twice"
        );
        assert_eq!(cost["usage"]["chat_calls"], 2);
        drop(e);
        // A progress file that keeps no cost (an older harness's) is refused, not read as free.
        std::fs::write(&file, r#"{"added":["u1"],"failed":[]}"#).unwrap();
        let err = start().err().unwrap();
        assert!(format!("{err:#}").contains("not its cost"), "{err:#}");
    }

    #[test]
    fn chat_and_embeddings_are_served_and_metered_by_phase() {
        let (e, llm) = endpoint(&["{\"memory\": []}", "again"]);
        let url = e.base_url();
        let (status, reply) = call(
            &url,
            "POST",
            "/v1/chat/completions",
            r#"{"model":"x","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0,"max_tokens":64,"response_format":{"type":"json_object"}}"#,
        );
        assert_eq!(status, 200, "{reply}");
        assert_eq!(
            reply["choices"][0]["message"]["content"],
            "{\"memory\": []}"
        );
        assert_eq!(reply["choices"][0]["finish_reason"], "stop");
        assert!(reply["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        assert_eq!(llm.calls(), 1);
        // JSON mode reaches the model as a JSON-object constraint with free whitespace, the
        // request's sampling settings as sent.
        let options = &llm.options()[0];
        assert_eq!(
            options.json_schema,
            Some(json!({"type": "object", "x-guidance": {"whitespace_flexible": true}}))
        );
        assert_eq!((options.temperature, options.max_tokens), (0.0, 64));
        // A request silent on sampling gets OpenAI's temperature and the endpoint's cap.
        let (status, _) = call(
            &url,
            "POST",
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"again"}]}"#,
        );
        assert_eq!(status, 200);
        let options = &llm.options()[1];
        assert_eq!(
            (options.temperature, options.max_tokens),
            (1.0, DEFAULT_MAX_TOKENS)
        );
        let (status, phase) = call(&url, "POST", "/lycheemem/phase", r#"{"phase":"search"}"#);
        assert_eq!((status, &phase["phase"]), (200, &json!("search")));
        let (status, emb) = call(
            &url,
            "POST",
            "/v1/embeddings",
            r#"{"model":"m","input":["a cat","a dog"],"dimensions":16,"encoding_format":"float"}"#,
        );
        assert_eq!(status, 200, "{emb}");
        assert_eq!(emb["data"].as_array().unwrap().len(), 2);
        assert_eq!(emb["data"][1]["index"], 1);
        assert_eq!(emb["data"][0]["embedding"].as_array().unwrap().len(), 16);
        // The openai SDK's default format carries the same numbers.
        let (status, packed) = call(
            &url,
            "POST",
            "/v1/embeddings",
            r#"{"model":"m","input":["a cat","a dog"],"encoding_format":"base64"}"#,
        );
        assert_eq!(status, 200, "{packed}");
        let floats: Vec<f32> = emb["data"][1]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(packed["data"][1]["embedding"], json!(base64_f32(&floats)));
        let usage = e.usage();
        assert_eq!(usage["build"].chat_calls, 2);
        assert_eq!(usage["build"].embed_requests, 0);
        assert_eq!(usage["search"].embed_texts, 4);
        assert_eq!(usage["search"].chat_calls, 0);
    }

    #[test]
    fn base64_vectors_are_little_endian_f32_bytes() {
        // Checked against Python's base64.b64encode(struct.pack("<...f", ...)).
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[1.0, -2.5, 0.1]), "AACAPwAAIMDNzMw9");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn bad_requests_get_clear_errors_and_are_counted() {
        let (e, llm) = endpoint(&[]);
        let url = e.base_url();
        let cases = [
            ("POST", "/v1/chat/completions", "not json", 400, "not JSON"),
            (
                "POST",
                "/v1/embeddings",
                r#"{"input":"x","encoding_format":"int8"}"#,
                400,
                "encoding_format",
            ),
            (
                "POST",
                "/v1/chat/completions",
                r#"{"messages":[]}"#,
                400,
                "non-empty",
            ),
            (
                "POST",
                "/v1/chat/completions",
                r#"{"messages":[{"role":"tool","content":"x"}]}"#,
                400,
                "role",
            ),
            (
                "POST",
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
                400,
                "tools",
            ),
            (
                "POST",
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":9}"#,
                400,
                "temperature",
            ),
            (
                "POST",
                "/v1/embeddings",
                r#"{"input":"x","dimensions":3}"#,
                400,
                "16-dimensional",
            ),
            (
                "POST",
                "/v1/embeddings",
                r#"{"input":[1,2]}"#,
                400,
                "strings",
            ),
            ("GET", "/v1/embeddings", "", 405, "not allowed"),
            ("POST", "/nowhere", "{}", 404, "no route"),
            (
                "POST",
                "/lycheemem/checkpoint",
                r#"{"progress":{},"seconds":1}"#,
                404,
                "no build checkpoint",
            ),
        ];
        for (method, path, body, want, says) in cases {
            let (status, reply) = call(&url, method, path, body);
            assert_eq!(status, want, "{method} {path} {body}: {reply}");
            let message = reply["error"]["message"].as_str().unwrap();
            assert!(message.contains(says), "{message:?} should say {says:?}");
        }
        assert_eq!(llm.calls(), 0, "no bad request reaches the model");
        assert_eq!(e.usage()["build"].errors, cases.len() as u64);
        // The model failing (the script is empty) is the server's error, not the client's.
        let (status, reply) = call(
            &url,
            "POST",
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(status, 500, "{reply}");
        // A body larger than the limit is refused from its header alone.
        let addr = url.trim_start_matches("http://").trim_end_matches("/v1");
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/embeddings HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    }
}
