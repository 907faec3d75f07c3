//! The local backend: a GGUF model on candle, with its own tokenizer and chat template, a KV
//! cache reused across calls for the longest common token prefix, and schema-constrained
//! decoding.

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use lycheemem_core::{Error, Result};
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;
use tokenizers::Tokenizer;

use crate::chat_template::ChatTemplate;
use crate::constrained::SchemaConstraints;
use crate::decoder::Decoder;
use crate::gguf_tokenizer::{SpecialTokens, tokenizer_from_gguf};
use crate::{ChatMessage, Completion, FinishReason, GenerateOptions, Llm};

/// Prompt tokens are prefilled in chunks of this many positions (bounds attention memory).
const PREFILL_CHUNK: usize = 512;

/// Load-time options of the local backend.
#[derive(Debug, Clone, Default)]
pub struct LocalOptions {
    /// Inference threads; 0 = candle's default (all cores, or `CANDLE_NUM_THREADS`).
    pub threads: usize,
    /// Identifier for usage logs; default: the file name.
    pub model_id: Option<String>,
    /// Caps the context below the model's trained length (saves KV memory).
    pub max_context: Option<usize>,
}

struct State {
    decoder: Decoder,
    /// Exactly the tokens whose keys/values are in the decoder's cache, in order.
    cached_tokens: Vec<u32>,
}

/// A GGUF chat model running locally (see the module docs).
pub struct LocalLlm {
    state: Mutex<State>,
    tokenizer: Tokenizer,
    specials: SpecialTokens,
    template: ChatTemplate,
    constraints: OnceLock<std::result::Result<SchemaConstraints, String>>,
    vocab_size: usize,
    context_length: usize,
    model_id: String,
    pool: Option<rayon::ThreadPool>,
}

impl LocalLlm {
    /// Loads a GGUF file: weights, tokenizer and chat template all come from the file.
    pub fn load(path: &Path, options: LocalOptions) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| {
            Error::Model(format!(
                "{} is not a readable GGUF file: {e}",
                path.display()
            ))
        })?;
        let (tokenizer, specials) = tokenizer_from_gguf(&content)?;
        let template_src = content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| {
                Error::Model(format!("{} has no tokenizer.chat_template", path.display()))
            })?;
        let template = ChatTemplate::new(&template_src, &specials.bos_text, &specials.eos_text)?;
        let decoder = Decoder::from_gguf(&content, &mut file, &Device::Cpu)
            .map_err(|e| Error::Model(format!("cannot load {}: {e}", path.display())))?;
        let context_length = options
            .max_context
            .map_or(decoder.config().context_length, |m| {
                m.min(decoder.config().context_length)
            });
        let vocab_size = match content.metadata.get("tokenizer.ggml.tokens") {
            Some(gguf_file::Value::Array(t)) => t.len(),
            _ => tokenizer.get_vocab_size(true),
        };
        let pool = match options.threads {
            0 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| Error::Model(e.to_string()))?,
            ),
        };
        let model_id = options.model_id.unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "local".into())
        });
        Ok(LocalLlm {
            state: Mutex::new(State {
                decoder,
                cached_tokens: Vec::new(),
            }),
            tokenizer,
            specials,
            template,
            constraints: OnceLock::new(),
            vocab_size,
            context_length,
            model_id,
            pool,
        })
    }

    /// The tokenizer built from the GGUF metadata.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Forgets the cached prefix (the next call prefills its whole prompt).
    pub fn clear_cache(&self) -> Result<()> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::Model("model state poisoned by an earlier panic".into()))?;
        state
            .decoder
            .truncate_cache(0)
            .map_err(|e| Error::Model(e.to_string()))?;
        state.cached_tokens.clear();
        Ok(())
    }

    /// Measures raw speed: prefill of `prompt` from an empty cache, then `decode` greedy tokens
    /// (end-of-sequence ignored). Returns `(prefill, decode)` wall times. Leaves the cache empty.
    pub fn measure_speed(
        &self,
        prompt: &[u32],
        decode: usize,
    ) -> Result<(std::time::Duration, std::time::Duration)> {
        let run = || -> Result<(std::time::Duration, std::time::Duration)> {
            let model_err = |e: candle_core::Error| Error::Model(e.to_string());
            self.clear_cache()?;
            let mut state = self
                .state
                .lock()
                .map_err(|_| Error::Model("model state poisoned".into()))?;
            let started = Instant::now();
            let mut logits = None;
            for chunk in prompt.chunks(PREFILL_CHUNK) {
                logits = Some(state.decoder.forward(chunk).map_err(model_err)?);
            }
            let prefill = started.elapsed();
            let mut logits = logits.ok_or_else(|| Error::InvalidInput("empty prompt".into()))?;
            let started = Instant::now();
            for _ in 0..decode {
                let token = logits
                    .argmax(0)
                    .and_then(|t| t.to_scalar::<u32>())
                    .map_err(model_err)?;
                logits = state.decoder.forward(&[token]).map_err(model_err)?;
            }
            let decode_time = started.elapsed();
            state.decoder.truncate_cache(0).map_err(model_err)?;
            Ok((prefill, decode_time))
        };
        match &self.pool {
            Some(pool) => pool.install(run),
            None => run(),
        }
    }

    /// The GGUF architecture (`llama`, `qwen2`).
    pub fn architecture(&self) -> String {
        self.state
            .lock()
            .map(|s| s.decoder.config().arch.clone())
            .unwrap_or_default()
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.specials
    }

    /// The rendered chat prompt and its token ids (BOS added when the model asks for it).
    pub fn prompt_tokens(&self, messages: &[ChatMessage]) -> Result<(String, Vec<u32>)> {
        let prompt = self.template.render(messages)?;
        let enc = self
            .tokenizer
            .encode(prompt.as_str(), false)
            .map_err(|e| Error::Model(format!("tokenization failed: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(bos) = self.specials.bos.filter(|_| self.specials.add_bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok((prompt, ids))
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| Error::Model(format!("detokenization failed: {e}")))
    }

    fn constraints(&self) -> Result<&SchemaConstraints> {
        self.constraints
            .get_or_init(|| {
                SchemaConstraints::new(&self.tokenizer, &self.specials.stop, self.vocab_size)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Model(format!("cannot set up constrained decoding: {e}")))
    }

    fn generate(&self, messages: &[ChatMessage], opts: &GenerateOptions) -> Result<Completion> {
        let started = Instant::now();
        let (_, prompt) = self.prompt_tokens(messages)?;
        if prompt.len() + opts.max_tokens as usize > self.context_length {
            return Err(Error::InvalidInput(format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context of {} tokens of {}",
                prompt.len(),
                opts.max_tokens,
                self.context_length,
                self.model_id
            )));
        }
        let mut constraint = match &opts.json_schema {
            Some(schema) => Some(self.constraints()?.start(schema)?),
            None => None,
        };
        let mut sampler = LogitsProcessor::from_sampling(
            opts.seed,
            if opts.temperature <= 0.0 {
                Sampling::ArgMax
            } else if opts.top_p < 1.0 {
                Sampling::TopP {
                    p: opts.top_p as f64,
                    temperature: opts.temperature as f64,
                }
            } else {
                Sampling::All {
                    temperature: opts.temperature as f64,
                }
            },
        );
        let model_err = |e: candle_core::Error| {
            Error::Model(format!("{} inference failed: {e}", self.model_id))
        };

        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::Model("model state poisoned by an earlier panic".into()))?;
        let state = &mut *state;
        // Reuse the cached prefix; at least one prompt token must run to produce logits.
        let common = state
            .cached_tokens
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let reuse = common.min(prompt.len() - 1);
        state.decoder.truncate_cache(reuse).map_err(model_err)?;
        state.cached_tokens.truncate(reuse);
        let mut logits: Option<Tensor> = None;
        for chunk in prompt[reuse..].chunks(PREFILL_CHUNK) {
            match state.decoder.forward(chunk) {
                Ok(l) => logits = Some(l),
                Err(e) => {
                    state.decoder.truncate_cache(0).map_err(model_err)?;
                    state.cached_tokens.clear();
                    return Err(model_err(e));
                }
            }
            state.cached_tokens.extend_from_slice(chunk);
        }
        let mut logits = logits.expect("the prompt has at least one uncached token");

        let mut generated: Vec<u32> = Vec::new();
        let mut finish = FinishReason::Length;
        let mut text = String::new();
        for _ in 0..opts.max_tokens {
            if opts.repeat_penalty != 1.0 && !generated.is_empty() {
                let recent = &generated[generated.len().saturating_sub(opts.repeat_last_n)..];
                logits = candle_transformers::utils::apply_repeat_penalty(
                    &logits,
                    opts.repeat_penalty,
                    recent,
                )
                .map_err(model_err)?;
            }
            let masked;
            let scores = match constraint.as_mut() {
                Some(c) => {
                    masked = c.mask_logits(&logits)?;
                    &masked
                }
                None => &logits,
            };
            let token = sampler.sample(scores).map_err(model_err)?;
            let is_stop_token = self.specials.stop.contains(&token);
            if is_stop_token && constraint.as_mut().is_none_or(|c| c.is_accepting()) {
                finish = FinishReason::Stop;
                break;
            }
            if let Some(c) = constraint.as_mut() {
                c.commit(token)?;
            }
            generated.push(token);
            // Detokenizing every step is only needed to look for stop strings.
            if !opts.stop.is_empty() {
                text = self.detokenize(&generated)?;
                if let Some(cut) = opts.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
                    text.truncate(cut);
                    finish = FinishReason::Stop;
                    break;
                }
            }
            if constraint.as_ref().is_some_and(|c| c.is_stopped()) {
                finish = FinishReason::Stop;
                break;
            }
            logits = state.decoder.forward(&[token]).map_err(model_err)?;
            state.cached_tokens.push(token);
        }
        if opts.stop.is_empty() {
            text = self.detokenize(&generated)?;
        }
        Ok(Completion {
            text,
            finish_reason: finish,
            prompt_tokens: prompt.len() as u64,
            completion_tokens: generated.len() as u64,
            cached_prompt_tokens: reuse as u64,
            latency_ms: started.elapsed().as_millis() as u64,
            usage_estimated: false,
            model: self.model_id.clone(),
        })
    }
}

impl Llm for LocalLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        match &self.pool {
            Some(pool) => pool.install(|| self.generate(messages, options)),
            None => self.generate(messages, options),
        }
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn context_length(&self) -> Option<usize> {
        Some(self.context_length)
    }
}
