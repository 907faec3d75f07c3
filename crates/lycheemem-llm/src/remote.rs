//! An OpenAI-compatible chat-completions client (`POST {base_url}/chat/completions`), for
//! llama.cpp server, vLLM, Ollama and OpenAI alike.
//!
//! Retries 429 and 5xx answers and transport failures with exponential backoff (honouring
//! `Retry-After`). With a JSON schema it asks for `response_format: json_schema`; a server that
//! rejects that is remembered and asked for `json_object` instead, and the reply is validated
//! against the schema with one repair round showing the error. Usage comes from the response,
//! or is estimated (and flagged) when the server sends none.

use lycheemem_core::{Error, Result, estimate_tokens};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::{ChatMessage, Completion, FinishReason, GenerateOptions, Llm, schema_check};

/// How the server is asked for structured output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StructuredOutput {
    /// `response_format: {type: json_schema}`, falling back to `json_object` if rejected.
    JsonSchema,
    /// `response_format: {type: json_object}` plus validation.
    JsonObject,
    /// No `response_format`; validation and repair only.
    PromptOnly,
}

/// Connection settings.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// e.g. `http://127.0.0.1:8080/v1` or `https://api.openai.com/v1`.
    pub base_url: String,
    pub model: String,
    /// Name of the environment variable holding the API key (never the key itself).
    pub api_key_env: Option<String>,
    pub timeout: Duration,
    pub max_retries: u32,
    /// First retry delay; doubles each retry.
    pub backoff: Duration,
    pub structured_output: StructuredOutput,
    pub context_length: Option<usize>,
}

impl RemoteOptions {
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        RemoteOptions {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: Some("OPENAI_API_KEY".into()),
            timeout: Duration::from_secs(120),
            max_retries: 4,
            backoff: Duration::from_millis(500),
            structured_output: StructuredOutput::JsonSchema,
            context_length: None,
        }
    }
}

/// The largest reply body read from a server (a chat completion is a few kilobytes; this
/// bounds what a misbehaving server can make the process hold).
pub const MAX_REPLY_BYTES: u64 = 64 << 20;

/// The remote backend.
pub struct RemoteLlm {
    client: reqwest::blocking::Client,
    options: RemoteOptions,
    api_key: Option<String>,
    schema_rejected: AtomicBool,
    url: String,
}

struct Reply {
    text: String,
    finish: FinishReason,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

impl RemoteLlm {
    pub fn new(options: RemoteOptions) -> Result<Self> {
        let client = reqwest::blocking::Client::builder()
            .timeout(options.timeout)
            .build()
            .map_err(|e| Error::Config(format!("cannot build HTTP client: {e}")))?;
        let api_key = options
            .api_key_env
            .as_ref()
            .and_then(|var| std::env::var(var).ok())
            .filter(|k| !k.is_empty());
        let url = format!(
            "{}/chat/completions",
            options.base_url.trim_end_matches('/')
        );
        Ok(RemoteLlm {
            client,
            options,
            api_key,
            schema_rejected: AtomicBool::new(false),
            url,
        })
    }

    fn body(
        &self,
        messages: &[ChatMessage],
        opts: &GenerateOptions,
        format: Option<Value>,
    ) -> Value {
        let mut body = json!({
            "model": self.options.model,
            "messages": messages,
            "max_tokens": opts.max_tokens,
            "temperature": opts.temperature,
            "seed": opts.seed,
        });
        if opts.temperature > 0.0 && opts.top_p < 1.0 {
            body["top_p"] = json!(opts.top_p);
        }
        if !opts.stop.is_empty() {
            body["stop"] = json!(opts.stop);
        }
        if let Some(format) = format {
            body["response_format"] = format;
        }
        body
    }

    /// One request with retries on 429 / 5xx / transport errors.
    /// (A reply body is read up to [`MAX_REPLY_BYTES`].)
    fn post(
        &self,
        body: &Value,
        cancel: &lycheemem_core::Cancel,
    ) -> Result<std::result::Result<Value, (u16, String)>> {
        let mut attempt = 0;
        loop {
            cancel.check("the LLM call")?;
            let mut req = self.client.post(&self.url).json(body);
            if let Some(key) = &self.api_key {
                req = req.bearer_auth(key);
            }
            let retry_delay = self.options.backoff * 2u32.saturating_pow(attempt);
            match req.send() {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let retry_after = resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    let mut raw = Vec::new();
                    // The body is read up to the limit: a server that sends more is refused
                    // rather than held in memory.
                    let read = std::io::Read::read_to_end(
                        &mut std::io::Read::take(resp, MAX_REPLY_BYTES + 1),
                        &mut raw,
                    );
                    if raw.len() as u64 > MAX_REPLY_BYTES {
                        return Err(Error::LlmOutput(format!(
                            "{} returned a body over {MAX_REPLY_BYTES} bytes",
                            self.url
                        )));
                    }
                    let text = if read.is_ok() {
                        String::from_utf8_lossy(&raw).into_owned()
                    } else {
                        String::new()
                    };
                    if status == 200 {
                        let value: Value = serde_json::from_str(&text).map_err(|e| {
                            Error::LlmOutput(format!(
                                "{} returned a body that is not JSON ({e}): {}",
                                self.url,
                                snippet(&text)
                            ))
                        })?;
                        return Ok(Ok(value));
                    }
                    let retryable = status == 429 || status >= 500;
                    if !retryable || attempt >= self.options.max_retries {
                        return Ok(Err((status, text)));
                    }
                    std::thread::sleep(
                        retry_after
                            .unwrap_or(retry_delay)
                            .min(Duration::from_secs(60)),
                    );
                }
                Err(e) => {
                    if attempt >= self.options.max_retries {
                        let kind = if e.is_timeout() {
                            "timed out"
                        } else {
                            "failed"
                        };
                        return Err(Error::LlmOutput(format!(
                            "request to {} {kind} after {} attempts: {e}",
                            self.url,
                            attempt + 1
                        )));
                    }
                    std::thread::sleep(retry_delay);
                }
            }
            attempt += 1;
        }
    }

    fn call(&self, messages: &[ChatMessage], opts: &GenerateOptions) -> Result<Reply> {
        let schema_format = |schema: &Value| json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}});
        let mut format = match (&opts.json_schema, self.options.structured_output) {
            (None, _) | (Some(_), StructuredOutput::PromptOnly) => None,
            (Some(_), StructuredOutput::JsonObject) => Some(json!({"type": "json_object"})),
            (Some(s), StructuredOutput::JsonSchema)
                if !self.schema_rejected.load(Ordering::Relaxed) =>
            {
                Some(schema_format(s))
            }
            (Some(_), StructuredOutput::JsonSchema) => Some(json!({"type": "json_object"})),
        };
        loop {
            let uses_schema = format.as_ref().is_some_and(|f| f["type"] == "json_schema");
            opts.cancel.check("the LLM call")?;
            match self.post(&self.body(messages, opts, format.clone()), &opts.cancel)? {
                Ok(value) => return parse_reply(&value, &self.url),
                Err((400, text)) if uses_schema && mentions_format(&text) => {
                    // The server does not do json_schema; remember and use JSON mode.
                    self.schema_rejected.store(true, Ordering::Relaxed);
                    format = Some(json!({"type": "json_object"}));
                }
                Err((status, text)) => {
                    return Err(Error::LlmOutput(format!(
                        "{} answered HTTP {status}: {}",
                        self.url,
                        snippet(&text)
                    )));
                }
            }
        }
    }
}

fn mentions_format(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("response_format") || t.contains("json_schema")
}

fn snippet(text: &str) -> String {
    let s: String = text.chars().take(300).collect();
    if s.len() < text.len() {
        format!("{s}…")
    } else {
        s
    }
}

fn parse_reply(value: &Value, url: &str) -> Result<Reply> {
    let choice = value["choices"].get(0).ok_or_else(|| {
        Error::LlmOutput(format!(
            "{url} returned no choices: {}",
            snippet(&value.to_string())
        ))
    })?;
    let text = choice["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let finish = match choice["finish_reason"].as_str() {
        Some("length") => FinishReason::Length,
        _ => FinishReason::Stop,
    };
    let usage = &value["usage"];
    Ok(Reply {
        text,
        finish,
        prompt_tokens: usage["prompt_tokens"].as_u64(),
        completion_tokens: usage["completion_tokens"].as_u64(),
    })
}

/// The JSON inside a reply: the whole text, or the content of a ```json fence.
pub(crate) fn extract_json(text: &str) -> std::result::Result<Value, String> {
    let trimmed = text.trim();
    let body = match trimmed.strip_prefix("```") {
        Some(rest) => {
            let rest = rest.trim_start_matches(|c: char| c.is_ascii_alphabetic());
            rest.rsplit_once("```")
                .map_or(rest, |(inner, _)| inner)
                .trim()
        }
        None => trimmed,
    };
    serde_json::from_str(body).map_err(|e| format!("not valid JSON: {e}"))
}

impl Llm for RemoteLlm {
    fn complete(&self, messages: &[ChatMessage], opts: &GenerateOptions) -> Result<Completion> {
        let started = Instant::now();
        let mut convo = messages.to_vec();
        let mut estimated = false;
        let (mut prompt_tokens, mut completion_tokens) = (0u64, 0u64);
        let mut account = |reply: &Reply, convo: &[ChatMessage]| {
            let p = reply.prompt_tokens.unwrap_or_else(|| {
                estimated = true;
                convo
                    .iter()
                    .map(|m| estimate_tokens(&m.content) as u64 + 4)
                    .sum()
            });
            let c = reply.completion_tokens.unwrap_or_else(|| {
                estimated = true;
                estimate_tokens(&reply.text) as u64
            });
            // Counts a server reports are not trusted to be sane.
            prompt_tokens = prompt_tokens.saturating_add(p);
            completion_tokens = completion_tokens.saturating_add(c);
        };
        let mut reply = self.call(&convo, opts)?;
        account(&reply, &convo);
        if let Some(schema) = &opts.json_schema {
            let verdict = extract_json(&reply.text)
                .and_then(|v| schema_check::validate(&v, schema).map(|_| v));
            match verdict {
                Ok(value) => reply.text = value.to_string(),
                Err(problem) => {
                    // One repair round that shows the model its error.
                    convo.push(ChatMessage::assistant(reply.text.clone()));
                    convo.push(ChatMessage::user(format!(
                        "That reply is invalid ({problem}). Reply again with only a JSON value that satisfies this JSON Schema:\n{schema}"
                    )));
                    reply = self.call(&convo, opts)?;
                    account(&reply, &convo);
                    let value = extract_json(&reply.text)
                        .and_then(|v| schema_check::validate(&v, schema).map(|_| v))
                        .map_err(|p| {
                            Error::LlmOutput(format!(
                                "{} gave invalid structured output twice: {p}",
                                self.options.model
                            ))
                        })?;
                    reply.text = value.to_string();
                }
            }
        }
        Ok(Completion {
            text: reply.text,
            finish_reason: reply.finish,
            prompt_tokens,
            completion_tokens,
            cached_prompt_tokens: 0,
            latency_ms: started.elapsed().as_millis() as u64,
            usage_estimated: estimated,
            model: self.options.model.clone(),
        })
    }

    fn model_id(&self) -> &str {
        &self.options.model
    }

    fn context_length(&self) -> Option<usize> {
        self.options.context_length
    }
}
