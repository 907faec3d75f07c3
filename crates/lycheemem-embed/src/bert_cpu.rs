//! A BERT encoder forward pass for the CPU, written for sentence embedding.
//!
//! candle's `BertModel` pads each batch to its longest text and runs every step as a tensor
//! op: broadcast bias and mask temporaries, a scalar `erf` per GELU input, a scalar `exp` per
//! attention score, and a packed GEMM even for a one-text query of a dozen tokens, where packing
//! the weights costs more than the product. This forward pass computes the same function with:
//!
//! * **no padding**: the batch's tokens are one `tokens × hidden` matrix (each text keeps its own
//!   length); attention runs per text and head, so no mask is needed;
//! * **fused QKV**: one projection with the three weight matrices stacked;
//! * **linear layers** as `x · Wᵀ` on the weights as stored (`out × in`, rows contiguous): a
//!   GEMM (`gemm` crate) for many tokens, a row-dot kernel for few (a query), which reads each
//!   weight row once and packs nothing;
//! * **epilogues in place**: bias, GELU (an `erf` approximation with absolute error < 3e-7)
//!   and softmax (a polynomial `exp`, relative error < 3e-7) over slices the compiler
//!   vectorizes, with AVX2 / AVX-512 variants chosen at run time; residual and LayerNorm fused.
//!
//! It is used on the CPU device for the architectures it supports (absolute positions; GELU,
//! tanh-GELU or ReLU activations); anything else, and every GPU, runs candle's model. Parity:
//! `tests/parity.rs` (sentence-transformers fixtures, cosine ≥ 0.9999) and the unit tests
//! below (candle's model on the same texts, cosine ≥ 0.99999).

use lycheemem_core::vector::{dot, exp_nonpositive};
use lycheemem_core::{Error, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::Path;

/// Up to this many tokens in a batch (a query) the forward pass runs on the calling thread,
/// with linear layers by [`row_dots`] instead of a packed GEMM: a few milliseconds of work,
/// which synchronizing a pool at every step would slow more than it helps, and which leaves the
/// other cores to concurrent searches.
const SMALL_BATCH_TOKENS: usize = 24;

/// The feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `0.5·x·(1 + erf(x/√2))`.
    Gelu,
    /// The tanh approximation.
    GeluTanh,
    Relu,
}

/// The dimensions and constants of a BERT encoder.
#[derive(Debug, Clone)]
pub(crate) struct BertShape {
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub type_vocab: usize,
    pub eps: f32,
    pub activation: Activation,
}

/// A linear layer `y = x·Wᵀ + b`, `W` stored `out × in` (rows contiguous).
struct Linear {
    w: Vec<f32>,
    b: Vec<f32>,
    inputs: usize,
    outputs: usize,
}

struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

struct Layer {
    /// Query, key and value stacked: `3·hidden × hidden`.
    qkv: Linear,
    attention_out: Linear,
    attention_norm: Norm,
    intermediate: Linear,
    output: Linear,
    output_norm: Norm,
}

/// The loaded encoder.
pub(crate) struct CpuBert {
    shape: BertShape,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embedding_norm: Norm,
    layers: Vec<Layer>,
    threads: usize,
}

/// One text's token ids and token type ids (specials included, no padding).
pub(crate) struct Tokens<'a> {
    pub ids: &'a [u32],
    pub types: &'a [u32],
}

/// Named f32 tensors of a safetensors file.
struct Weights {
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    prefix: String,
}

impl Weights {
    fn load(path: &Path, model_type: Option<&str>) -> Result<Self> {
        let loaded = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
            .map_err(|e| Error::Model(format!("cannot read {}: {e}", path.display())))?;
        let mut tensors = HashMap::with_capacity(loaded.len());
        for (name, t) in loaded {
            let dims = t.dims().to_vec();
            let data = t
                .to_dtype(candle_core::DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| Error::Model(format!("{}: tensor {name}: {e}", path.display())))?;
            tensors.insert(name, (dims, data));
        }
        // Checkpoints name the encoder's tensors bare or under the model type (`bert.`).
        let prefix = [String::new(), format!("{}.", model_type.unwrap_or("bert"))]
            .into_iter()
            .find(|p| tensors.contains_key(&format!("{p}embeddings.word_embeddings.weight")))
            .ok_or_else(|| {
                Error::Model(format!(
                    "{}: no BERT embeddings tensor (embeddings.word_embeddings.weight)",
                    path.display()
                ))
            })?;
        Ok(Weights { tensors, prefix })
    }

    /// The tensor `name` (under the prefix), checked to have `dims`.
    fn take(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        let full = format!("{}{name}", self.prefix);
        let (got, data) = self
            .tensors
            .remove(&full)
            .ok_or_else(|| Error::Model(format!("tensor {full} is missing")))?;
        if got != dims {
            return Err(Error::Model(format!(
                "tensor {full} has shape {got:?}, expected {dims:?}"
            )));
        }
        Ok(data)
    }

    fn linear(&mut self, name: &str, outputs: usize, inputs: usize) -> Result<Linear> {
        Ok(Linear {
            w: self.take(&format!("{name}.weight"), &[outputs, inputs])?,
            b: self.take(&format!("{name}.bias"), &[outputs])?,
            inputs,
            outputs,
        })
    }

    fn norm(&mut self, name: &str, size: usize) -> Result<Norm> {
        // Older checkpoints call LayerNorm's parameters gamma / beta.
        let (g, b) = if self
            .tensors
            .contains_key(&format!("{}{name}.weight", self.prefix))
        {
            ("weight", "bias")
        } else {
            ("gamma", "beta")
        };
        Ok(Norm {
            gamma: self.take(&format!("{name}.{g}"), &[size])?,
            beta: self.take(&format!("{name}.{b}"), &[size])?,
        })
    }
}

impl CpuBert {
    /// Loads the encoder from `model.safetensors`; `threads` is the pool the caller runs it in
    /// (it sizes the GEMM's parallelism).
    pub(crate) fn load(
        weights: &Path,
        shape: BertShape,
        model_type: Option<&str>,
        threads: usize,
    ) -> Result<Self> {
        let h = shape.hidden;
        if h == 0 || shape.intermediate == 0 || shape.type_vocab == 0 {
            return Err(Error::Model(format!(
                "hidden size {h}, intermediate size {} and {} token types must all be positive",
                shape.intermediate, shape.type_vocab
            )));
        }
        if shape.heads == 0 || !h.is_multiple_of(shape.heads) {
            return Err(Error::Model(format!(
                "hidden size {h} is not a multiple of {} heads",
                shape.heads
            )));
        }
        let mut w = Weights::load(weights, model_type)?;
        let vocab = w
            .tensors
            .get(&format!("{}embeddings.word_embeddings.weight", w.prefix))
            .and_then(|(d, _)| d.first().copied())
            .unwrap_or(0);
        let word = w.take("embeddings.word_embeddings.weight", &[vocab, h])?;
        let position = w.take(
            "embeddings.position_embeddings.weight",
            &[shape.max_positions, h],
        )?;
        let token_type = w.take(
            "embeddings.token_type_embeddings.weight",
            &[shape.type_vocab, h],
        )?;
        let embedding_norm = w.norm("embeddings.LayerNorm", h)?;
        let mut layers = Vec::with_capacity(shape.layers);
        for i in 0..shape.layers {
            let p = format!("encoder.layer.{i}");
            let q = w.linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = w.linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = w.linear(&format!("{p}.attention.self.value"), h, h)?;
            let qkv = Linear {
                w: [q.w, k.w, v.w].concat(),
                b: [q.b, k.b, v.b].concat(),
                inputs: h,
                outputs: 3 * h,
            };
            layers.push(Layer {
                qkv,
                attention_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attention_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h)?,
                intermediate: w.linear(
                    &format!("{p}.intermediate.dense"),
                    shape.intermediate,
                    h,
                )?,
                output: w.linear(&format!("{p}.output.dense"), h, shape.intermediate)?,
                output_norm: w.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        Ok(CpuBert {
            shape,
            word,
            position,
            token_type,
            embedding_norm,
            layers,
            threads: threads.max(1),
        })
    }

    /// The last hidden states of every text: `texts[i]` gets `len_i × hidden` values, rows in
    /// token order. Runs in the caller's rayon pool.
    pub(crate) fn forward(&self, texts: &[Tokens<'_>]) -> Result<Vec<Vec<f32>>> {
        let h = self.shape.hidden;
        let mut spans = Vec::with_capacity(texts.len());
        let mut total = 0usize;
        for t in texts {
            if t.ids.len() != t.types.len() {
                return Err(Error::Model(format!(
                    "{} token ids but {} token types",
                    t.ids.len(),
                    t.types.len()
                )));
            }
            if t.ids.len() > self.shape.max_positions {
                return Err(Error::Model(format!(
                    "a text of {} tokens does not fit {} positions",
                    t.ids.len(),
                    self.shape.max_positions
                )));
            }
            spans.push((total, t.ids.len()));
            total += t.ids.len();
        }
        let mut x = vec![0f32; total * h];
        for (t, &(start, _)) in texts.iter().zip(&spans) {
            for (j, (&id, &ty)) in t.ids.iter().zip(t.types).enumerate() {
                let (id, ty) = (id as usize, ty as usize);
                if id >= self.word.len() / h || ty >= self.shape.type_vocab {
                    return Err(Error::Model(format!(
                        "token id {id} / type {ty} outside the model's vocabulary"
                    )));
                }
                let row = &mut x[(start + j) * h..(start + j + 1) * h];
                let (w, p, ty) = (
                    &self.word[id * h..(id + 1) * h],
                    &self.position[j * h..(j + 1) * h],
                    &self.token_type[ty * h..(ty + 1) * h],
                );
                for (((v, w), p), t) in row.iter_mut().zip(w).zip(p).zip(ty) {
                    *v = w + p + t;
                }
            }
        }
        layer_norm_rows(&mut x, None, &self.embedding_norm, h, self.shape.eps);
        let mut qkv = Vec::new();
        let mut context = vec![0f32; total * h];
        let mut projected = Vec::new();
        let mut inner = Vec::new();
        let serial = total <= SMALL_BATCH_TOKENS;
        for layer in &self.layers {
            self.linear(&layer.qkv, &x, total, &mut qkv);
            self.attention(&qkv, &spans, &mut context, serial);
            self.linear(&layer.attention_out, &context, total, &mut projected);
            layer_norm_rows(
                &mut x,
                Some(&projected),
                &layer.attention_norm,
                h,
                self.shape.eps,
            );
            self.linear(&layer.intermediate, &x, total, &mut inner);
            activate(&mut inner, self.shape.activation, serial);
            self.linear(&layer.output, &inner, total, &mut projected);
            layer_norm_rows(
                &mut x,
                Some(&projected),
                &layer.output_norm,
                h,
                self.shape.eps,
            );
        }
        Ok(spans
            .iter()
            .map(|&(start, len)| x[start * h..(start + len) * h].to_vec())
            .collect())
    }

    /// `out = x·Wᵀ + b` for `rows` rows of `x`.
    fn linear(&self, l: &Linear, x: &[f32], rows: usize, out: &mut Vec<f32>) {
        let (k, n) = (l.inputs, l.outputs);
        out.clear();
        out.resize(rows * n, 0.0);
        if rows == 0 {
            return;
        }
        if rows <= SMALL_BATCH_TOKENS {
            row_dots(x, rows, l, out);
            return;
        }
        let parallelism = if self.threads > 1 {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: `out` is rows × n, `x` rows × k, `l.w` n × k (read as its transpose, k × n
        // with row stride 1 and column stride k); all strides are in elements and in bounds.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                l.w.as_ptr(),
                k as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism,
            );
        }
        for row in out.chunks_mut(n) {
            for (v, b) in row.iter_mut().zip(&l.b) {
                *v += b;
            }
        }
    }

    /// Scaled dot-product attention per text and head: `context` gets each head's output in
    /// its columns.
    fn attention(&self, qkv: &[f32], spans: &[(usize, usize)], context: &mut [f32], serial: bool) {
        let h = self.shape.hidden;
        let heads = self.shape.heads;
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        let tasks: Vec<(usize, usize, usize)> = spans
            .iter()
            .flat_map(|&(start, len)| (0..heads).map(move |head| (start, len, head)))
            .collect();
        let head_output = |&(start, len, head): &(usize, usize, usize)| {
            let row = |i: usize, part: usize| {
                let base = (start + i) * 3 * h + part * h + head * d;
                &qkv[base..base + d]
            };
            let mut out = vec![0f32; len * d];
            let mut scores = vec![0f32; len];
            for i in 0..len {
                let q = row(i, 0);
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = dot(q, row(j, 1)) * scale;
                }
                softmax(&mut scores);
                let o = &mut out[i * d..(i + 1) * d];
                for (j, &p) in scores.iter().enumerate() {
                    for (a, v) in o.iter_mut().zip(row(j, 2)) {
                        *a += p * v;
                    }
                }
            }
            out
        };
        let outputs: Vec<Vec<f32>> = if serial {
            tasks.iter().map(head_output).collect()
        } else {
            tasks.par_iter().map(head_output).collect()
        };
        for (&(start, len, head), out) in tasks.iter().zip(outputs) {
            for i in 0..len {
                context[(start + i) * h + head * d..(start + i) * h + (head + 1) * d]
                    .copy_from_slice(&out[i * d..(i + 1) * d]);
            }
        }
    }
}

/// `out = x·Wᵀ + b` for a few rows (a query's tokens) as dot products. With AVX2 and FMA, up
/// to three input rows against four weight rows per pass: twelve sums in registers, each
/// weight vector loaded once for all the rows and each input vector once for all four weight
/// rows, one horizontal sum per output at the end; a block of four weight rows (6 KB at 384
/// inputs) stays in L1 while the row groups pass over it, and the weights stream in storage
/// order. Otherwise one dot product per output.
fn row_dots(x: &[f32], rows: usize, l: &Linear, out: &mut [f32]) {
    let (k, n) = (l.inputs, l.outputs);
    assert!(x.len() >= rows * k && out.len() >= rows * n && l.w.len() == n * k);
    #[cfg(target_arch = "x86_64")]
    let done = if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the CPU has AVX2 and FMA (checked above); shapes asserted above.
        unsafe { row_dots_avx2(x, rows, l, out) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    // The outputs the blocked kernel left (all of them without AVX2), one dot at a time.
    for col in done..n {
        let w = &l.w[col * k..(col + 1) * k];
        for r in 0..rows {
            out[r * n + col] = dot(&x[r * k..(r + 1) * k], w) + l.b[col];
        }
    }
}

/// [`row_dots`]' blocked kernel (`x` holds `rows × k`, `out` `rows × n`): fills the outputs of
/// whole blocks of four weight rows and returns how many that is.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_dots_avx2(x: &[f32], rows: usize, l: &Linear, out: &mut [f32]) -> usize {
    let (k, n) = (l.inputs, l.outputs);
    let blocks = n / 4 * 4;
    for c0 in (0..blocks).step_by(4) {
        let w = &l.w[c0 * k..(c0 + 4) * k];
        let mut r0 = 0;
        while r0 < rows {
            let take = (rows - r0).min(3);
            let x = &x[r0 * k..(r0 + take) * k];
            let out = &mut out[r0 * n..];
            match take {
                3 => dots_avx2::<3>(x, w, k, &l.b[c0..c0 + 4], &mut out[c0..], n),
                2 => dots_avx2::<2>(x, w, k, &l.b[c0..c0 + 4], &mut out[c0..], n),
                _ => dots_avx2::<1>(x, w, k, &l.b[c0..c0 + 4], &mut out[c0..], n),
            }
            r0 += take;
        }
    }
    blocks
}

/// `out[r · stride + c] = x_r · w_c + bias[c]` for the `R` rows of `x` (`R × k`) and the 4 rows
/// of `w` (`4 × k`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn dots_avx2<const R: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    assert!(x.len() == R * k && w.len() == 4 * k);
    let whole = k / 8 * 8;
    // acc[c][r]: weight row c, input row r.
    let mut acc = [[_mm256_setzero_ps(); R]; 4];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 ≤ k, so every load lies within its row of `x` or `w` (lengths
        // asserted above).
        unsafe {
            let xv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(xp.add(r * k + i)));
            for (c, acc) in acc.iter_mut().enumerate() {
                let wv = _mm256_loadu_ps(wp.add(c * k + i));
                for (a, xv) in acc.iter_mut().zip(&xv) {
                    *a = _mm256_fmadd_ps(*xv, wv, *a);
                }
            }
        }
    }
    for (c, (acc, b)) in acc.iter().zip(bias).enumerate() {
        for (r, v) in acc.iter().enumerate() {
            let half = _mm_add_ps(_mm256_castps256_ps128(*v), _mm256_extractf128_ps::<1>(*v));
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let one = _mm_add_ss(pair, _mm_shuffle_ps::<0b01>(pair, pair));
            // The inputs past the last whole vector (none at the usual widths).
            let tail = if whole < k {
                dot(
                    &x[r * k + whole..(r + 1) * k],
                    &w[c * k + whole..(c + 1) * k],
                )
            } else {
                0.0
            };
            out[r * stride + c] = _mm_cvtss_f32(one) + tail + b;
        }
    }
}

/// `x ← LayerNorm(x + residual)` row by row.
fn layer_norm_rows(x: &mut [f32], residual: Option<&[f32]>, n: &Norm, h: usize, eps: f32) {
    for (i, row) in x.chunks_mut(h).enumerate() {
        if let Some(r) = residual {
            for (a, b) in row.iter_mut().zip(&r[i * h..(i + 1) * h]) {
                *a += b;
            }
        }
        let mean = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, g), b) in row.iter_mut().zip(&n.gamma).zip(&n.beta) {
            *v = (*v - mean) * inv * g + b;
        }
    }
}

/// Runs `$body` (a loop over `&mut [f32]`) compiled for AVX-512, AVX2 or the baseline, as the
/// CPU allows; the loops are written so the compiler vectorizes them.
macro_rules! dispatch {
    ($name:ident, |$x:ident| $body:block) => {
        fn $name($x: &mut [f32]) {
            #[inline(always)]
            fn body($x: &mut [f32]) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn wide($x: &mut [f32]) {
                    body($x)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($x: &mut [f32]) {
                    body($x)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked above).
                    return unsafe { wide($x) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked above).
                    return unsafe { avx2($x) };
                }
            }
            body($x)
        }
    };
}

/// `erf(x)`, absolute error < 3e-7 (Abramowitz & Stegun 7.1.26 refined: Numerical Recipes'
/// `erfc` Chebyshev fit), branch-free.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    // erfc(z) = t·e^poly; poly ≤ 1e-7 for every z ≥ 0 (it rounds to e^0 there), inside the
    // exp's domain.
    let erfc = t * exp_nonpositive(poly);
    (1.0 - erfc).copysign(x)
}

dispatch!(gelu_erf, |x| {
    for v in x.iter_mut() {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
});

dispatch!(exp_shifted, |x| {
    for v in x.iter_mut() {
        *v = exp_nonpositive(*v);
    }
});

fn activate(x: &mut [f32], a: Activation, serial: bool) {
    match a {
        Activation::Gelu if serial => gelu_erf(x),
        Activation::Gelu => x.par_chunks_mut(4096).for_each(gelu_erf),
        Activation::GeluTanh => {
            let gelu_tanh = |c: &mut [f32]| {
                for v in c {
                    let u = 0.797_884_6 * (*v + 0.044_715 * *v * *v * *v);
                    *v = 0.5 * *v * (1.0 + u.tanh());
                }
            };
            if serial {
                gelu_tanh(x)
            } else {
                x.par_chunks_mut(4096).for_each(gelu_tanh)
            }
        }
        Activation::Relu => x.iter_mut().for_each(|v| *v = v.max(0.0)),
    }
}

/// In-place softmax.
fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v -= max;
    }
    exp_shifted(x);
    let sum: f32 = x.iter().sum();
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_within_3e7_of_the_series() {
        let mut worst = 0f64;
        let mut x = -6.0f64;
        while x <= 6.0 {
            let want = erf_reference(x);
            let got = f64::from(erf(x as f32));
            worst = worst.max((got - want).abs());
            x += 0.001;
        }
        assert!(worst < 3e-7, "worst absolute error {worst}");
        let mut v = vec![-3.0f32, -1.0, 0.0, 0.5, 2.0];
        gelu_erf(&mut v);
        let exact = |x: f64| 0.5 * x * (1.0 + erf_reference(x / std::f64::consts::SQRT_2));
        for (g, x) in v.iter().zip([-3.0, -1.0, 0.0, 0.5, 2.0]) {
            assert!((f64::from(*g) - exact(x)).abs() < 1e-6, "gelu({x}) = {g}");
        }
    }

    /// erf by its Taylor series (|x| ≤ 3) or continued fraction (larger), in f64.
    fn erf_reference(x: f64) -> f64 {
        let z = x.abs();
        let v = if z <= 3.0 {
            let mut term = z;
            let mut sum = z;
            let mut n = 0.0;
            while term.abs() > 1e-17 {
                n += 1.0;
                term *= -z * z / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction, evaluated from the tail.
            let mut f = 0.0;
            for k in (1..60).rev() {
                f = (k as f64 / 2.0) / (z + f);
            }
            1.0 - (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + f)
        };
        v.copysign(x)
    }

    /// `x·Wᵀ + b` in f64.
    fn linear_reference(x: &[f32], rows: usize, l: &Linear) -> Vec<f64> {
        let (k, n) = (l.inputs, l.outputs);
        let mut out = vec![0f64; rows * n];
        for r in 0..rows {
            for c in 0..n {
                let dot: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(l.w[c * k + i]))
                    .sum();
                out[r * n + c] = dot + f64::from(l.b[c]);
            }
        }
        out
    }

    #[test]
    fn row_dots_compute_the_linear_layer_for_every_row_count_and_width() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        // Inputs with and without a partial vector, outputs with and without a partial block
        // of four; row counts around the groups of three.
        for (k, n) in [(48, 64), (40, 37), (12, 8), (16, 6), (5, 3)] {
            let l = Linear {
                w: (0..n * k).map(|_| next()).collect(),
                b: (0..n).map(|_| next()).collect(),
                inputs: k,
                outputs: n,
            };
            for rows in [1, 2, 3, 4, 5, 7, SMALL_BATCH_TOKENS] {
                let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
                let want = linear_reference(&x, rows, &l);
                let mut got = vec![f32::NAN; rows * n];
                row_dots(&x, rows, &l, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(*g) - w).abs() < 1e-5,
                        "k {k}, n {n}, rows {rows}, output {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut s = vec![1.0f32, 3.0, -2.0, 0.5];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[1] > s[0] && s[0] > s[3] && s[3] > s[2]);
        let want = [1.0f32, 3.0, -2.0, 0.5].map(|v| (v - 3.0).exp());
        let total: f32 = want.iter().sum();
        for (g, w) in s.iter().zip(want) {
            assert!((g - w / total).abs() < 1e-6);
        }
    }
}
