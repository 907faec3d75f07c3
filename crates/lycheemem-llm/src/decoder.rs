//! Decoder-only transformers from GGUF files (the `llama` and `qwen2` architectures), quantized
//! weights on candle, with a KV cache that can be truncated to a prefix so calls sharing a prompt
//! prefix (the same system prompt for every segment) skip its prefill.
//!
//! Follows candle-transformers' `quantized_llama` / `quantized_qwen2`; differs in the cache,
//! which here is a separate [`KvState`] per sequence (so one set of weights serves several
//! sequences, and [`Decoder::forward_batch`] advances several in a single pass over the
//! weights), and in reading both architectures through one configuration.

use crate::attention;
use crate::packed_quants_avx2::PackedQuant;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor, gguf_file};
use candle_core::{D, DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::Embedding;
use lycheemem_core::LlmWeights;
use std::sync::Arc;

/// Architecture-level settings read from the GGUF metadata (`<arch>.*` keys).
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub head_dim: usize,
    pub context_length: usize,
    pub rms_eps: f64,
    pub rope_base: f32,
    /// NeoX-style (split halves) rotary embedding (qwen2) vs interleaved pairs (GGUF llama).
    pub rope_neox: bool,
}

impl DecoderConfig {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let rope_neox = match arch.as_str() {
            "llama" => false,
            "qwen2" => true,
            other => candle_core::bail!(
                "unsupported GGUF architecture {other:?} (supported: llama, qwen2)"
            ),
        };
        let get = |key: &str| {
            ct.metadata
                .get(&format!("{arch}.{key}"))
                .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata lacks {arch}.{key}")))
        };
        let n_head = get("attention.head_count")?.to_u32()? as usize;
        let n_embd = get("embedding_length")?.to_u32()? as usize;
        let head_dim = match get("rope.dimension_count") {
            Ok(v) => v.to_u32()? as usize,
            Err(_) => n_embd.checked_div(n_head).unwrap_or(0),
        };
        let cfg = DecoderConfig {
            n_layer: get("block_count")?.to_u32()? as usize,
            n_head,
            n_kv_head: get("attention.head_count_kv")?.to_u32()? as usize,
            n_embd,
            head_dim,
            // A longer context than the rotary tables are built for is used up to that length
            // (the calls here are far shorter; a call past it is refused by the context guard).
            context_length: (get("context_length")?.to_u32()? as usize).min(MAX_CONTEXT),
            rms_eps: get("attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
            rope_base: get("rope.freq_base")
                .and_then(|v| v.to_f32())
                .unwrap_or(10_000.0),
            rope_neox,
            arch,
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Refuses a header no model of these architectures has, before anything is sized by it
    /// (layers, rotary tables, the attention's head groups): a damaged or hostile file gets an
    /// error, never a division by zero or a failed assertion (`from_gguf` caps the context at
    /// [`MAX_CONTEXT`] before this check).
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| {
            candle_core::Error::Msg(format!("GGUF metadata of {:?}: {what}", self.arch))
        };
        if self.n_head == 0 || self.n_kv_head == 0 || !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(bad(format!(
                "{} attention heads cannot share {} key/value heads",
                self.n_head, self.n_kv_head
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > MAX_HEAD_DIM {
            return Err(bad(format!(
                "head dimension {} (even, 2 to {MAX_HEAD_DIM})",
                self.head_dim
            )));
        }
        if self.n_embd == 0 {
            return Err(bad("embedding length 0".into()));
        }
        if self.n_layer == 0 || self.n_layer > MAX_LAYERS {
            return Err(bad(format!("{} layers (1 to {MAX_LAYERS})", self.n_layer)));
        }
        if self.context_length == 0 || self.context_length > MAX_CONTEXT {
            return Err(bad(format!(
                "context length {} (1 to {MAX_CONTEXT})",
                self.context_length
            )));
        }
        Ok(())
    }
}

/// The most layers a GGUF header may name (the largest open models have about 130).
const MAX_LAYERS: usize = 1_024;
/// The longest context used: the rotary tables are built for all of it (a header naming more,
/// e.g. a 2M- or 4M-token finetune, is used up to this many positions).
const MAX_CONTEXT: usize = 1 << 20;
/// The largest head dimension a GGUF header may name.
const MAX_HEAD_DIM: usize = 1_024;

/// Inputs with at least this many rows (prompt chunks) run through a dense f32 copy of the
/// weight made for the call, for weights that candle can only multiply with its generic
/// quantized kernels (see [`dense_prefill_is_faster`]); fewer rows (decode steps) always multiply
/// in the quantized domain. One dequantization costs about as much as ~40 rows of generic
/// quantized multiplication, hence the threshold.
const DENSE_MIN_ROWS: usize = 64;

/// A quantized weight matrix `(out, in)` applied as `x · Wᵀ` (see [`DENSE_MIN_ROWS`]).
struct Linear {
    product: Product,
    /// The quantized weight, kept where prompt chunks multiply a dense copy of it.
    dense_prefill: Option<Arc<QTensor>>,
}

/// What multiplies a [`Linear`]'s weight.
enum Product {
    /// candle's kernels (quantized, or a dense copy for [`LlmWeights::F32`] / `F16`).
    Candle(QMatMul),
    /// A Q4_K, Q6_K, Q4_1, Q5_0 or Q8_0 weight repacked for AVX2 CPUs without VNNI (see
    /// [`PackedQuant`]); the file's blocks are not kept beside it.
    Packed(PackedQuant),
}

impl Linear {
    /// The product for a weight as the file stores it: quantized weights keep the file's blocks
    /// where this CPU packs them, and otherwise take candle's fastest kernel; dense copies hold
    /// the file's own values.
    fn new(weight: QTensor, format: LlmWeights) -> Result<Self> {
        let device = weight.device();
        Ok(match format {
            LlmWeights::Quantized => {
                // Packed weights multiply prompt chunks faster than a dense copy (measured).
                let packed = |packed| Linear {
                    product: Product::Packed(packed),
                    dense_prefill: None,
                };
                if let Some(tiles) = PackedQuant::for_cpu(&weight)? {
                    return Ok(packed(tiles));
                }
                // The re-quantized weight (Q5_1 → Q8_0) may be packed in turn.
                let weight = with_fast_kernel(weight, &device)?;
                if let Some(tiles) = PackedQuant::for_cpu(&weight)? {
                    return Ok(packed(tiles));
                }
                let (n, k) = weight.shape().dims2()?;
                // The dense path is a CPU measurement; candle's CUDA kernels choose their own
                // path.
                let dense_prefill =
                    device.is_cpu() && dense_prefill_is_faster(weight.dtype(), n, k);
                let weight = Arc::new(weight);
                Linear {
                    product: Product::Candle(QMatMul::from_arc(weight.clone())?),
                    dense_prefill: dense_prefill.then_some(weight),
                }
            }
            LlmWeights::F32 => Linear {
                product: Product::Candle(QMatMul::Tensor(weight.dequantize(&device)?)),
                dense_prefill: None,
            },
            LlmWeights::F16 => Linear {
                product: Product::Candle(QMatMul::TensorF16(weight.dequantize_f16(&device)?)),
                dense_prefill: None,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.elem_count() / x.dim(D::Minus1)?.max(1);
        match &self.dense_prefill {
            Some(weight) if rows >= DENSE_MIN_ROWS => {
                QMatMul::Tensor(weight.dequantize(x.device())?).forward(x)
            }
            _ => match &self.product {
                Product::Packed(packed) => packed.forward(x),
                Product::Candle(matmul) => matmul.forward(x),
            },
        }
    }
}

/// Whether a dense f32 copy multiplies prompt chunks faster than candle's kernels for this
/// weight. candle 0.11 multiplies Q4_K, Q6_K and Q8_0 weights with `in % 256 == 0` and
/// `out % 16 == 0` with repacked VNNI kernels, which beat the dense path; everything else goes
/// through its generic quantized kernels, which the dense path beats. Measured with `lycheemem
/// bench llm` on the 2-core dev machine (AVX-512-VNNI), prefill tok/s quantized → dense:
/// Qwen2.5-0.5B (896-wide rows) 65 → 212; SmolLM2-135M (576-wide) 160 → 405; Qwen2.5-1.5B
/// (1536-wide, repacked kernels) 78 → 56. On x86-64 with AVX2 and FMA but no VNNI, Q4_K, Q6_K,
/// Q4_1, Q5_0 and Q8_0 weights are packed by [`PackedQuant`] instead (the caller keeps those
/// quantized: their tiles beat the dense copy, SmolLM2-135M 290 → 392–472 tok/s and
/// Qwen2.5-0.5B 135–140 → 160–222 on an AMD EPYC, 1,000-token prompts) and every other weight
/// goes through candle's generic kernels; measured there before the 32-value formats were
/// packed, quantized → dense: SmolLM2-135M 77.7 → 350.5 tok/s, Qwen2.5-0.5B 43.3 → 119.9. Only
/// used where measured: AVX-512-VNNI, and AVX2 without any VNNI.
fn dense_prefill_is_faster(dtype: GgmlDType, n: usize, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512vnni") {
            let repacked = matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0)
                && k.is_multiple_of(256)
                && n.is_multiple_of(16);
            return !repacked;
        }
        crate::packed_quants_avx2::preferred_here()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, n, k);
        false
    }
}

struct Layer {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    wo: Linear,
    attn_norm: Tensor,
    ffn_norm: Tensor,
    w_gate: Linear,
    w_up: Linear,
    w_down: Linear,
}

/// One layer's cached keys and values of one sequence; positions `0..len` are valid. Appending
/// writes in place (capacity doubles when full), and truncating to a prefix only moves `len`: no
/// per-token copy of the whole cache.
struct KvCache {
    store: KvStore,
    len: usize,
}

enum KvStore {
    /// Nothing appended yet.
    Empty,
    /// On the CPU: `f16` buffers laid out for [`attention::causal_attention`] (a long context's
    /// decode step is bound by reading the cache: half the bytes of `f32`, and llama.cpp's
    /// default cache type too).
    Cpu(attention::KvBuffers),
    /// Elsewhere: preallocated tensors `(1, n_kv_head, capacity, head_dim)` in the projections'
    /// dtype, read by the generic attention path.
    Tensors { keys: Tensor, values: Tensor },
}

impl KvCache {
    fn new() -> Self {
        KvCache {
            store: KvStore::Empty,
            len: 0,
        }
    }

    /// Appends `k`, `v` `(1, n_kv, seq, hd)` after the `len` cached positions.
    fn append(&mut self, k: &Tensor, v: &Tensor, max: usize) -> Result<()> {
        let (_, heads, seq, hd) = k.dims4()?;
        if k.device().is_cpu() {
            if matches!(self.store, KvStore::Empty) {
                self.store = KvStore::Cpu(attention::KvBuffers::new(heads, hd));
            }
            let KvStore::Cpu(buffers) = &mut self.store else {
                candle_core::bail!("a CPU cache holds CPU buffers");
            };
            if buffers.shape() != (heads, hd) {
                candle_core::bail!(
                    "keys {:?} for a cache of {:?}",
                    (heads, hd),
                    buffers.shape()
                );
            }
            let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            buffers.write(self.len, &flat(k)?, &flat(v)?, seq, max);
            self.len += seq;
            return Ok(());
        }
        let needed = self.len + seq;
        let capacity = match &self.store {
            KvStore::Tensors { keys, .. } => keys.dim(2)?,
            _ => 0,
        };
        if needed > capacity {
            let capacity = needed
                .next_power_of_two()
                .clamp(256, max.max(needed).max(256));
            let grow = |old: Option<&Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((1, heads, capacity, hd), k.dtype(), k.device())?;
                if let Some(old) = old.filter(|_| self.len > 0) {
                    buf.slice_set(&old.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                }
                Ok(buf)
            };
            let (keys, values) = match &self.store {
                KvStore::Tensors { keys, values } => (grow(Some(keys))?, grow(Some(values))?),
                _ => (grow(None)?, grow(None)?),
            };
            self.store = KvStore::Tensors { keys, values };
        }
        let KvStore::Tensors { keys, values } = &self.store else {
            candle_core::bail!("the cache tensors were just made");
        };
        keys.slice_set(&k.contiguous()?, 2, self.len)?;
        values.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok(())
    }
}

/// The cached keys and values of one sequence (every layer) and how many positions they hold.
pub struct KvState {
    layers: Vec<KvCache>,
    len: usize,
}

impl KvState {
    /// Drops cached positions beyond `len` (keeps the first `len`; buffers stay allocated).
    /// Every layer is clamped, also one left longer by an interrupted write.
    pub fn truncate(&mut self, len: usize) {
        for cache in &mut self.layers {
            cache.len = cache.len.min(len);
        }
        self.len = self.len.min(len);
    }
}

/// A loaded decoder (weights only; each sequence's cache is a [`KvState`]).
pub struct Decoder {
    cfg: DecoderConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    output: Linear,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

impl Decoder {
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        weights: LlmWeights,
    ) -> Result<Self> {
        let cfg = DecoderConfig::from_gguf(ct)?;
        let qt = |reader: &mut R, name: &str| ct.tensor(reader, name, device);
        let matmul = |q: QTensor| Linear::new(q, weights);
        let embed_q = qt(reader, "token_embd.weight")?;
        let embed = Embedding::new(embed_q.dequantize(device)?, cfg.n_embd);
        let output = match qt(reader, "output.weight") {
            Ok(w) => matmul(w)?,
            Err(_) => matmul(embed_q)?, // tied embeddings
        };
        let norm = qt(reader, "output_norm.weight")?.dequantize(device)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let mm = |reader: &mut R, n: &str| -> Result<Linear> {
                matmul(qt(reader, &format!("{p}.{n}"))?)
            };
            let bias = |reader: &mut R, n: &str| -> Result<Option<Tensor>> {
                match ct.tensor_infos.contains_key(&format!("{p}.{n}")) {
                    true => Ok(Some(qt(reader, &format!("{p}.{n}"))?.dequantize(device)?)),
                    false => Ok(None),
                }
            };
            layers.push(Layer {
                wq: mm(reader, "attn_q.weight")?,
                wk: mm(reader, "attn_k.weight")?,
                wv: mm(reader, "attn_v.weight")?,
                bq: bias(reader, "attn_q.bias")?,
                bk: bias(reader, "attn_k.bias")?,
                bv: bias(reader, "attn_v.bias")?,
                wo: mm(reader, "attn_output.weight")?,
                attn_norm: qt(reader, &format!("{p}.attn_norm.weight"))?.dequantize(device)?,
                ffn_norm: qt(reader, &format!("{p}.ffn_norm.weight"))?.dequantize(device)?,
                w_gate: mm(reader, "ffn_gate.weight")?,
                w_up: mm(reader, "ffn_up.weight")?,
                w_down: mm(reader, "ffn_down.weight")?,
            });
        }
        let (cos, sin) = rope_tables(cfg.head_dim, cfg.rope_base, cfg.context_length, device)?;
        Ok(Decoder {
            cfg,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// Makes `dst` hold the first `len` cached positions of `src` (a copy of their keys and
    /// values: far cheaper than prefilling them again). On error `dst` is left empty.
    pub fn copy_prefix(&self, dst: &mut KvState, src: &KvState, len: usize) -> Result<()> {
        dst.truncate(0);
        let len = len.min(src.len);
        if len == 0 {
            return Ok(());
        }
        for (to, from) in dst.layers.iter_mut().zip(&src.layers) {
            let copied = match &from.store {
                KvStore::Cpu(buffers) => {
                    match &mut to.store {
                        KvStore::Cpu(mine) if mine.shape() == buffers.shape() => {
                            mine.copy_prefix(buffers, len, self.cfg.context_length)
                        }
                        mine => {
                            let (heads, dim) = buffers.shape();
                            let mut fresh = attention::KvBuffers::new(heads, dim);
                            fresh.copy_prefix(buffers, len, self.cfg.context_length);
                            *mine = KvStore::Cpu(fresh);
                        }
                    }
                    to.len = len;
                    Ok(())
                }
                KvStore::Tensors { keys, values } => to.append(
                    &keys.narrow(2, 0, len)?,
                    &values.narrow(2, 0, len)?,
                    self.cfg.context_length,
                ),
                KvStore::Empty => {
                    candle_core::bail!("cache without buffers holds {len} positions")
                }
            };
            if let Err(e) = copied {
                dst.truncate(0);
                return Err(e);
            }
        }
        dst.len = len;
        Ok(())
    }

    /// An empty cache for one sequence.
    pub fn new_state(&self) -> KvState {
        KvState {
            layers: (0..self.cfg.n_layer).map(|_| KvCache::new()).collect(),
            len: 0,
        }
    }

    /// Runs `tokens` of one sequence at positions `state.len()..`, appends them to its cache, and
    /// returns the logits (f32, vocab-sized) of the last position.
    pub fn forward(&self, state: &mut KvState, tokens: &[u32]) -> Result<Tensor> {
        let pos = state.len;
        let seq = tokens.len();
        if seq == 0 {
            candle_core::bail!("forward needs at least one token");
        }
        self.check_room(pos + seq)?;
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let mask = LazyMask::new(seq, pos, &self.device);
        let cos = self.cos.narrow(0, pos, seq)?;
        let sin = self.sin.narrow(0, pos, seq)?;
        let mut x = self.embed.forward(&ids)?;
        let result = (|| -> Result<Tensor> {
            for (layer, cache) in self.layers.iter().zip(state.layers.iter_mut()) {
                let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.cfg.rms_eps as f32)?;
                let (q, k, v) = project_qkv(&self.cfg, layer, &h)?;
                let y = attend(&self.cfg, cache, &q, &k, &v, &mask, &cos, &sin)?;
                x = (layer.wo.forward(&y)? + &x)?;
                x = self.feed_forward(layer, &x)?;
            }
            let last = x.i((.., seq - 1..seq, ..))?;
            self.logits(&last)?.squeeze(0)?.squeeze(0)
        })();
        self.settle(state, pos, seq, result.is_ok());
        result
    }

    /// One pass for several sequences at once: `tokens[i]` are the next tokens of `states[i]`
    /// (one while decoding; more when tokens a grammar forces are fed together). Every weight
    /// matrix is multiplied with all rows together (one pass over the weights instead of one per
    /// sequence), while attention runs per sequence against its own cache, causally masked within
    /// its rows. Returns each sequence's logits at its last new position. Row results equal
    /// [`Decoder::forward`] up to the matmul kernel's accumulation order.
    pub fn forward_batch(
        &self,
        states: &mut [&mut KvState],
        tokens: &[&[u32]],
    ) -> Result<Vec<Tensor>> {
        let b = tokens.len();
        if b == 0 || b != states.len() || tokens.iter().any(|t| t.is_empty()) {
            candle_core::bail!("forward_batch needs at least one token per sequence");
        }
        for (s, t) in states.iter().zip(tokens) {
            self.check_room(s.len + t.len())?;
        }
        let positions: Vec<usize> = states.iter().map(|s| s.len).collect();
        let lens: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0, |at, &n| {
                let o = *at;
                *at += n;
                Some(o)
            })
            .collect();
        let rope_at = |table: &Tensor| -> Result<Vec<Tensor>> {
            positions
                .iter()
                .zip(&lens)
                .map(|(&p, &n)| table.narrow(0, p, n))
                .collect()
        };
        let (cos, sin) = (rope_at(&self.cos)?, rope_at(&self.sin)?);
        let masks: Vec<LazyMask> = positions
            .iter()
            .zip(&lens)
            .map(|(&p, &n)| LazyMask::new(n, p, &self.device))
            .collect();
        let flat: Vec<u32> = tokens.iter().flat_map(|t| t.iter().copied()).collect();
        let ids = Tensor::new(flat.as_slice(), &self.device)?.unsqueeze(0)?;
        let mut x = self.embed.forward(&ids)?; // (1, rows, d): the sequences side by side
        let result = (|| -> Result<Vec<Tensor>> {
            for (l, layer) in self.layers.iter().enumerate() {
                let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.cfg.rms_eps as f32)?;
                let (q, k, v) = project_qkv(&self.cfg, layer, &h)?;
                let mut ys = Vec::with_capacity(b);
                for (i, state) in states.iter_mut().enumerate() {
                    // Sequence i is rows offsets[i].. : `(1, heads, n, hd)` views of the batched
                    // projections.
                    let rows = |t: &Tensor| t.narrow(2, offsets[i], lens[i])?.contiguous();
                    let cache = &mut state.layers[l];
                    ys.push(attend(
                        &self.cfg,
                        cache,
                        &rows(&q)?,
                        &rows(&k)?,
                        &rows(&v)?,
                        &masks[i],
                        &cos[i],
                        &sin[i],
                    )?);
                }
                let y = Tensor::cat(&ys, 1)?;
                x = (layer.wo.forward(&y)? + &x)?;
                x = self.feed_forward(layer, &x)?;
            }
            // Only each sequence's last row needs logits.
            let last: Vec<u32> = offsets
                .iter()
                .zip(&lens)
                .map(|(&o, &n)| (o + n - 1) as u32)
                .collect();
            if last.len() < flat.len() {
                let last = Tensor::new(last.as_slice(), &self.device)?;
                x = x.index_select(&last, 1)?;
            }
            let logits = self.logits(&x)?.squeeze(0)?; // (b, vocab)
            (0..b).map(|i| logits.get(i)).collect()
        })();
        for ((state, &pos), &n) in states.iter_mut().zip(&positions).zip(&lens) {
            self.settle(state, pos, n, result.is_ok());
        }
        result
    }

    fn check_room(&self, needed: usize) -> Result<()> {
        if needed > self.cfg.context_length {
            candle_core::bail!(
                "{needed} positions exceed the context length {}",
                self.cfg.context_length
            );
        }
        Ok(())
    }

    /// After a pass: the new positions count (`ok`), or every layer is cut back to `pos` so the
    /// cache stays exactly the prefix it held before the failed pass.
    fn settle(&self, state: &mut KvState, pos: usize, added: usize, ok: bool) {
        if ok {
            state.len = pos + added;
        } else {
            for cache in &mut state.layers {
                cache.len = cache.len.min(pos);
            }
            state.len = pos;
        }
    }

    fn feed_forward(&self, layer: &Layer, x: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &layer.ffn_norm, self.cfg.rms_eps as f32)?;
        let gate = candle_nn::ops::silu(&layer.w_gate.forward(&h)?)?;
        let up = layer.w_up.forward(&h)?;
        layer.w_down.forward(&(gate * up)?)? + x
    }

    /// f32 logits of every row of `x` `(1, rows, d)`.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let x = candle_nn::ops::rms_norm(x, &self.norm, self.cfg.rms_eps as f32)?;
        self.output.forward(&x)?.to_dtype(DType::F32)
    }
}

/// candle has SIMD matmul kernels for Q4_0, Q8_0 and the K-quants but only scalar code for
/// Q4_1, Q5_0 and Q5_1 (SmolLM2's Q4_1; the many Q5_0 tensors of Qwen2.5-0.5B, whose 896-wide
/// rows cannot use K-quants). Where [`PackedQuant`] does not take the file's blocks (other
/// CPUs, GPUs, Q5_1), those are re-quantized once at load time to Q8_0, which is at
/// least as precise (8-bit blocks of 32) and 4-10x faster here; memory grows by ~60% for them.
/// A GPU gets the same Q8_0 weights, so both devices multiply identical weights.
fn with_fast_kernel(q: QTensor, device: &Device) -> Result<QTensor> {
    match q.dtype() {
        GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => {
            let q8 = QTensor::quantize(&q.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?;
            if device.is_cpu() {
                return Ok(q8);
            }
            // The same Q8_0 weights on a GPU, uploaded the way the GGUF loader uploads: it zeroes
            // the row padding that candle's CUDA kernels read. (`QTensor::quantize_onto` leaves
            // that padding uninitialized in candle 0.11: NaN logits for rows that are not a
            // multiple of 512 wide, e.g. Qwen2.5-0.5B's 896.)
            let storage = QStorage::from_data(q8.data()?, device, GgmlDType::Q8_0)?;
            QTensor::new(storage, q8.shape().clone())
        }
        _ => Ok(q),
    }
}

/// The query, key and value projections of `x` `(1, seq, d)` as `(1, heads, seq, head_dim)`.
fn project_qkv(cfg: &DecoderConfig, layer: &Layer, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, seq, _) = x.dims3()?;
    let project = |w: &Linear, bias: &Option<Tensor>, heads: usize| -> Result<Tensor> {
        let mut t = w.forward(x)?;
        if let Some(bias) = bias {
            t = t.broadcast_add(bias)?;
        }
        t.reshape((b, seq, heads, cfg.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((
        project(&layer.wq, &layer.bq, cfg.n_head)?,
        project(&layer.wk, &layer.bk, cfg.n_kv_head)?,
        project(&layer.wv, &layer.bv, cfg.n_kv_head)?,
    ))
}

/// Attention of one sequence: rotates `q`, `k` (`(1, heads, seq, hd)`) to their positions,
/// appends `k`, `v` to `cache`, and returns the attended values `(1, seq, n_head * hd)` (before
/// the output projection).
#[allow(clippy::too_many_arguments)]
fn attend(
    cfg: &DecoderConfig,
    cache: &mut KvCache,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &LazyMask,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (b, _, seq, _) = q.dims4()?;
    let rope = |t: &Tensor| {
        if cfg.rope_neox {
            candle_nn::rotary_emb::rope(t, cos, sin)
        } else {
            candle_nn::rotary_emb::rope_i(t, cos, sin)
        }
    };
    let q = rope(q)?;
    let k = rope(k)?;
    cache.append(&k, v, cfg.context_length)?;
    match &cache.store {
        KvStore::Cpu(buffers) => cpu_attention(cfg, &buffers.view(cache.len), &q, b, seq),
        KvStore::Tensors { keys, values } => {
            let (k, v) = (
                keys.narrow(2, 0, cache.len)?,
                values.narrow(2, 0, cache.len)?,
            );
            generic_attention(cfg, &q, &k, &v, mask)
        }
        KvStore::Empty => candle_core::bail!("no cache after appending"),
    }
}

/// Attention with candle ops (any device and dtype): `q` `(b, heads, seq, hd)` rotated, `k`,
/// `v` every cached position's keys and values (the new ones last).
fn generic_attention(
    cfg: &DecoderConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &LazyMask,
) -> Result<Tensor> {
    let (b, _, seq, _) = q.dims4()?;
    // Grouped-query attention without copying keys/values per query head: the `groups` query
    // heads that share a kv head are stacked along the sequence axis, `(b, n_kv, groups*seq, hd)`.
    let groups = cfg.n_head / cfg.n_kv_head;
    let q = q.reshape((b, cfg.n_kv_head, groups * seq, cfg.head_dim))?;
    let mut att = (q.matmul(&k.t()?)? / (cfg.head_dim as f64).sqrt())?;
    if let Some(mask) = mask.get()? {
        let mask = if groups > 1 {
            mask.repeat((groups, 1))?
        } else {
            mask.clone()
        };
        att = att.broadcast_add(&mask)?;
    }
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    att.matmul(v)?
        .reshape((b, cfg.n_head, seq, cfg.head_dim))?
        .transpose(1, 2)?
        .reshape((b, seq, cfg.n_head * cfg.head_dim))
}

/// [`attention::causal_attention`] of `q` `(1, heads, seq, hd)` (rotated) over `cache`, which
/// already holds the new positions; the result `(1, seq, heads * hd)` in `q`'s dtype.
fn cpu_attention(
    cfg: &DecoderConfig,
    cache: &attention::Cache,
    q: &Tensor,
    b: usize,
    seq: usize,
) -> Result<Tensor> {
    if b != 1 {
        candle_core::bail!("attention runs per sequence (batch {b})");
    }
    let rows = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let heads = attention::Heads {
        query: cfg.n_head,
        kv: cfg.n_kv_head,
        dim: cfg.head_dim,
    };
    let out = attention::causal_attention(heads, &rows, cache, seq);
    Tensor::from_vec(out, (1, seq, cfg.n_head * cfg.head_dim), q.device())?.to_dtype(q.dtype())
}

/// The causal mask of `seq` new positions after `pos` cached ones, made on first use (only the
/// generic attention path uses it; none for a single position) and then shared by every layer.
struct LazyMask<'a> {
    seq: usize,
    pos: usize,
    device: &'a Device,
    mask: std::cell::OnceCell<Option<Tensor>>,
}

impl<'a> LazyMask<'a> {
    fn new(seq: usize, pos: usize, device: &'a Device) -> Self {
        LazyMask {
            seq,
            pos,
            device,
            mask: std::cell::OnceCell::new(),
        }
    }

    fn get(&self) -> Result<Option<&Tensor>> {
        if let Some(mask) = self.mask.get() {
            return Ok(mask.as_ref());
        }
        let mask = if self.seq > 1 {
            Some(causal_mask(self.seq, self.pos, self.device)?)
        } else {
            None
        };
        Ok(self.mask.get_or_init(|| mask).as_ref())
    }
}

/// Additive causal mask `(seq, pos + seq)`: 0 where query `i` may see key `j`, -inf elsewhere.
fn causal_mask(seq: usize, pos: usize, device: &Device) -> Result<Tensor> {
    let kv = pos + seq;
    let data: Vec<f32> = (0..seq)
        .flat_map(|i| (0..kv).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(data, (seq, kv), device)
}

fn rope_tables(
    head_dim: usize,
    base: f32,
    context: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / head_dim as f32))
        .collect();
    let inv = Tensor::new(inv.as_slice(), device)?;
    let t = Tensor::arange(0u32, context as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((context, 1))?;
    let freqs = t.broadcast_mul(&inv.reshape((1, head_dim / 2))?)?;
    Ok((freqs.cos()?, freqs.sin()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header whose sizes no model has is refused with an error naming them.
    #[test]
    fn impossible_gguf_headers_are_refused() {
        let good = DecoderConfig {
            arch: "qwen2".into(),
            n_layer: 28,
            n_head: 12,
            n_kv_head: 2,
            n_embd: 1536,
            head_dim: 128,
            context_length: 32_768,
            rms_eps: 1e-6,
            rope_base: 10_000.0,
            rope_neox: true,
        };
        good.check().unwrap();
        type Damage = fn(&mut DecoderConfig);
        let cases: [(&str, Damage); 8] = [
            ("heads", |c| c.n_head = 0),
            ("heads", |c| c.n_kv_head = 0),
            ("heads", |c| c.n_kv_head = 5),
            ("head dimension", |c| c.head_dim = 0),
            ("head dimension", |c| c.head_dim = 127),
            ("layers", |c| c.n_layer = 4_000_000_000),
            ("context length", |c| c.context_length = 4_000_000_000),
            ("embedding", |c| c.n_embd = 0),
        ];
        for (what, damage) in cases {
            let mut cfg = good.clone();
            damage(&mut cfg);
            let err = cfg.check().unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    /// The fused CPU attention gives the generic path's values through a cache that grows:
    /// a prompt chunk, decode steps, then several positions at once.
    #[test]
    fn fused_attention_matches_the_generic_path() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = DecoderConfig {
            arch: "qwen2".into(),
            n_layer: 1,
            n_head: 6,
            n_kv_head: 2,
            n_embd: 6 * 16,
            head_dim: 16,
            context_length: 1024,
            rms_eps: 1e-6,
            rope_base: 10_000.0,
            rope_neox: true,
        };
        let (cos, sin) = rope_tables(cfg.head_dim, cfg.rope_base, cfg.context_length, &dev)?;
        let mut fused = KvCache::new();
        let mut pos = 0;
        for (step, seq) in [300usize, 1, 1, 3, 1].into_iter().enumerate() {
            let random = |heads: usize, salt: u64| {
                Tensor::randn(0f32, 1.0, (1, heads, seq, cfg.head_dim), &dev)
                    .map(|t| (t * (1.0 + salt as f64 * 0.1)).unwrap())
            };
            let (q, k, v) = (random(6, 1)?, random(2, 2)?, random(2, 3)?);
            let (c, s) = (cos.narrow(0, pos, seq)?, sin.narrow(0, pos, seq)?);
            let mask = LazyMask::new(seq, pos, &dev);
            let got = attend(&cfg, &mut fused, &q, &k, &v, &mask, &c, &s)?;
            // The generic path over the same cached (f16) values.
            let KvStore::Cpu(buffers) = &fused.store else {
                panic!("a CPU cache keeps f16 buffers");
            };
            let (keys, values) = buffers.rows(fused.len);
            let shape = (1, cfg.n_kv_head, fused.len, cfg.head_dim);
            let (k, v) = (
                Tensor::from_vec(keys, shape, &dev)?,
                Tensor::from_vec(values, shape, &dev)?,
            );
            let q = candle_nn::rotary_emb::rope(&q, &c, &s)?;
            let want = generic_attention(&cfg, &q, &k, &v, &mask)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff < 1e-5,
                "step {step} ({seq} positions): max diff {diff}"
            );
            pos += seq;
        }
        Ok(())
    }

    /// The dense prompt path and the quantized decode path compute the same product: every row
    /// of a 64-row input (dense) matches that row multiplied alone (quantized kernel).
    #[test]
    fn dense_and_quantized_paths_agree() -> Result<()> {
        let dev = Device::Cpu;
        let (out_dim, in_dim) = (48, 96);
        let w: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let w = Tensor::from_vec(w, (out_dim, in_dim), &dev)?;
        let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0)?);
        let linear = Linear {
            product: Product::Candle(QMatMul::from_arc(q.clone())?),
            dense_prefill: Some(q),
        };
        let x: Vec<f32> = (0..DENSE_MIN_ROWS * in_dim)
            .map(|i| ((i * 104_729 % 997) as f32 / 498.5) - 1.0)
            .collect();
        let x = Tensor::from_vec(x, (1, DENSE_MIN_ROWS, in_dim), &dev)?;
        let dense = linear.forward(&x)?;
        assert_eq!(dense.dims(), &[1, DENSE_MIN_ROWS, out_dim]);
        for row in [0, 17, DENSE_MIN_ROWS - 1] {
            let alone = linear.forward(&x.narrow(1, row, 1)?)?;
            let diff = (dense.narrow(1, row, 1)? - &alone)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            let scale = alone.abs()?.max_all()?.to_scalar::<f32>()?;
            // Q8_0 activations in the quantized path: ~1% relative error at most.
            assert!(
                diff <= 0.02 * scale,
                "row {row}: max diff {diff} (scale {scale})"
            );
        }
        Ok(())
    }
}
