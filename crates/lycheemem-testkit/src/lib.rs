//! Test doubles shared by lycheemem's test suites. The product never links this crate.
//!
//! * [`ScriptedLlm`]: replies from a queue (or a function of the prompt) and records every
//!   prompt, so tests can assert exactly what a stage asked and make it fail on cue.
//! * [`HashEmbedder`]: a deterministic bag-of-words embedder (hashed, stemmed-by-prefix words),
//!   so texts sharing words are similar — enough to exercise retrieval without model weights.

use lycheemem_core::{Error, Result};
use lycheemem_embed::Embedder;
use lycheemem_llm::{ChatMessage, Completion, FinishReason, GenerateOptions, Llm};
use std::collections::VecDeque;
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
