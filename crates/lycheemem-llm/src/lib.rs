//! Every LLM call of lycheemem goes through the [`Llm`] trait: chat messages and options in,
//! text with token usage out. Backends:
//! - [`LocalLlm`]: GGUF models (llama, qwen2) on candle, tokenizer and chat template read from
//!   the GGUF itself, KV-cache prefix reuse across calls, and JSON-Schema-constrained decoding
//!   (llguidance) so structured output always parses.
//! - [`RemoteLlm`]: any OpenAI-compatible `/v1/chat/completions` server (llama.cpp server, vLLM,
//!   Ollama, OpenAI), with retries, `response_format` JSON schema and a JSON-mode fallback.
//! - [`Metered`]: a wrapper recording every call's purpose, tokens and latency into a
//!   [`UsageSink`].
//!
//! Concurrency model: calls are blocking and `Llm` is `Send + Sync`. A local model decodes
//! concurrent calls together (continuous batching on one worker thread, up to
//! `LocalOptions::max_batch` at once), so callers with independent work (the benchmark's
//! questions, the server's requests) should call from several threads; async callers (the
//! server) run calls on a blocking thread pool.

mod attention;
mod chat_template;
mod constrained;
mod decoder;
mod gguf_tokenizer;
#[cfg(target_arch = "x86_64")]
mod packed_quants_avx2;
/// Off x86-64 nothing is packed: candle's kernels run.
#[cfg(not(target_arch = "x86_64"))]
mod packed_quants_avx2 {
    use candle_core::quantized::QTensor;
    use candle_core::{Result, Tensor};

    pub(crate) enum PackedQuant {}

    impl PackedQuant {
        pub(crate) fn for_cpu(_: &QTensor) -> Result<Option<Self>> {
            Ok(None)
        }

        pub(crate) fn forward(&self, _: &Tensor) -> Result<Tensor> {
            match *self {}
        }
    }
}
mod local;
mod metering;
mod remote;
mod schema_check;
mod spec;

pub use chat_template::ChatTemplate;
pub use gguf_tokenizer::{SpecialTokens, tokenizer_from_gguf};
pub use local::{DEFAULT_MAX_BATCH, LocalLlm, LocalOptions};
pub use lycheemem_core::{ComputeDevice, ForcedTokens, LlmWeights};
pub use metering::{MemorySink, Metered, UsageSink};
pub use remote::{MAX_REPLY_BYTES, RemoteLlm, RemoteOptions, StructuredOutput};
pub use schema_check::validate as validate_against_schema;
pub use spec::{LlmSpec, open_llm};

use lycheemem_core::Result;
use serde::{Deserialize, Serialize};

/// Author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    System,
    User,
    Assistant,
}

impl ChatRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        ChatMessage {
            role: ChatRole::System,
            content: content.into(),
        }
    }
    pub fn user(content: impl Into<String>) -> Self {
        ChatMessage {
            role: ChatRole::User,
            content: content.into(),
        }
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        ChatMessage {
            role: ChatRole::Assistant,
            content: content.into(),
        }
    }
}

/// Generation options. `Default` is greedy decoding of up to 512 tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateOptions {
    pub max_tokens: u32,
    /// 0 = greedy (deterministic).
    pub temperature: f32,
    /// Nucleus sampling threshold (used when temperature > 0).
    pub top_p: f32,
    pub seed: u64,
    /// Divides (positive) or multiplies (negative) the logits of tokens generated within the
    /// last `repeat_last_n` tokens; 1.0 = off. Local backend only.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    /// Generation stops before any of these strings; they are not part of the returned text.
    pub stop: Vec<String>,
    /// When set, the output is a JSON value valid under this schema: enforced by masking logits
    /// (local) or requested via `response_format` and validated (remote).
    pub json_schema: Option<serde_json::Value>,
    /// Raised when the caller no longer wants the reply: the call stops (local: between
    /// decoding steps; remote: before each attempt) with `Error::Cancelled`.
    #[serde(skip)]
    pub cancel: lycheemem_core::Cancel,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 512,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            stop: Vec::new(),
            json_schema: None,
            cancel: lycheemem_core::Cancel::default(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token, a stop string, or a completed schema.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// The result of one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens whose prefill was skipped thanks to the KV-cache prefix (local only).
    pub cached_prompt_tokens: u64,
    pub latency_ms: u64,
    /// True when the backend did not report usage and the counts were estimated.
    pub usage_estimated: bool,
    pub model: String,
}

/// A chat LLM.
pub trait Llm: Send + Sync {
    /// Generates the assistant's reply to `messages`.
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion>;
    /// The model's identifier (for usage logs).
    fn model_id(&self) -> &str;
    /// Maximum prompt + completion tokens, when known.
    fn context_length(&self) -> Option<usize>;
}
