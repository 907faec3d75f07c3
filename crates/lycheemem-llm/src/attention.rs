//! Causal grouped-query attention on the CPU over plain `f32` slices: the decoder's attention
//! for a sequence's new positions against its whole KV cache, without the tensors the generic
//! path materializes.
//!
//! The generic path (candle ops) builds, per layer, the full score matrix of every query head
//! against every cached key, a causal mask repeated per query head, and a copy of the scores for
//! each of scaling, masking and softmax. At a few thousand cached positions those are hundreds of
//! megabytes per layer, freshly mapped (page faults), written and read several times, with a
//! libm `exp` per score: a profile of 8,600-token prompts put over 40% of the time there.
//!
//! Here the query rows that share a key/value head (the group's heads, for a block of positions)
//! are gathered into one small matrix, their scores against the visible keys computed by one
//! GEMM (the scale folded in), softmax applied in place row by row (only the keys each row may
//! see, a polynomial `exp`), and the values multiplied by a second GEMM; the normalization is
//! applied to the output rows. Scratch buffers are per thread and reused, so a decode step
//! allocates nothing but its output. Blocks of (key/value head, positions) run in parallel on
//! candle's worker threads. A decode step (one position) skips the GEMMs: each key is dotted
//! with the group's query rows and each value row added into their outputs, read once.

use lycheemem_core::vector::exp_nonpositive;
use std::cell::RefCell;
use std::sync::Mutex;

/// Query rows (group heads × positions) per block: the block's scores (rows × visible keys)
/// stay within a core's L2 cache for a few thousand keys.
const BLOCK_ROWS: usize = 48;

/// A decode step whose group has at most this many query heads takes the direct path (each key
/// and value read once, no GEMM packing).
const DIRECT_ROWS: usize = 8;

/// The attention's shape: query heads, key/value heads (a divisor of the query heads) and the
/// head dimension.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub(crate) query: usize,
    pub(crate) kv: usize,
    pub(crate) dim: usize,
}

/// A key/value cache as laid out by the decoder: `(kv heads, capacity, dim)` row-major, with
/// positions `0..len` valid.
pub(crate) struct Cache<'a> {
    pub(crate) keys: &'a [f32],
    pub(crate) values: &'a [f32],
    pub(crate) capacity: usize,
    pub(crate) len: usize,
}

thread_local! {
    /// (gathered query rows, scores, output rows) of the current block.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Attention of `seq` new positions, the last `seq` of the cache's `len`: `q` is
/// `(query heads, seq, dim)` (rotated), the result `(seq, query heads × dim)`. Position `i` of
/// the new ones sees the cached keys `0..=len - seq + i`; query head `h` uses key/value head
/// `h / (query / kv)`.
pub(crate) fn causal_attention(heads: Heads, q: &[f32], cache: &Cache, seq: usize) -> Vec<f32> {
    let Heads { query, kv, dim } = heads;
    let groups = query / kv;
    assert!(
        groups * kv == query && seq <= cache.len && cache.len <= cache.capacity,
        "attention shapes: {heads:?}, seq {seq}, cache {} of {}",
        cache.len,
        cache.capacity
    );
    assert!(q.len() == query * seq * dim);
    assert!(cache.keys.len() >= kv * cache.capacity * dim);
    assert!(cache.values.len() >= kv * cache.capacity * dim);
    let width = query * dim;
    let mut out = vec![0f32; seq * width];
    let positions_per_block = (BLOCK_ROWS / groups).max(1);
    let blocks: Vec<(usize, usize)> = (0..kv)
        .flat_map(|h| (0..seq).step_by(positions_per_block).map(move |p0| (h, p0)))
        .collect();
    // Blocks run on candle's own worker threads (the ones every other op of the decoder uses:
    // a second pool would compete with its spinning workers for the same cores). Each block's
    // rows are kept apart and placed in `out` afterwards.
    let results: Vec<Mutex<Vec<f32>>> = blocks.iter().map(|_| Mutex::new(Vec::new())).collect();
    candle_core::utils::barrier_pool().execute_chunked(blocks.len(), |range| {
        for b in range {
            let (h, p0) = blocks[b];
            let p1 = (p0 + positions_per_block).min(seq);
            let rows = block(heads, q, cache, seq, h, p0, p1);
            *results[b].lock().unwrap_or_else(|e| e.into_inner()) = rows;
        }
    });
    for (&(h, p0), rows) in blocks.iter().zip(results) {
        let rows = rows.into_inner().unwrap_or_else(|e| e.into_inner());
        let positions = rows.len() / (groups * dim);
        for g in 0..groups {
            let head = h * groups + g;
            for p in 0..positions {
                let from = &rows[(g * positions + p) * dim..][..dim];
                out[(p0 + p) * width + head * dim..][..dim].copy_from_slice(from);
            }
        }
    }
    out
}

/// One block: key/value head `h`, new positions `p0..p1`; returns its output rows ordered
/// (group head, position), each `dim` wide.
fn block(
    heads: Heads,
    q: &[f32],
    cache: &Cache,
    seq: usize,
    h: usize,
    p0: usize,
    p1: usize,
) -> Vec<f32> {
    let Heads { query, kv, dim } = heads;
    let groups = query / kv;
    let positions = p1 - p0;
    let rows = groups * positions;
    let before = cache.len - seq;
    // Every row is multiplied with all cached keys and values (the ones it may not see get
    // weight 0), as in the generic path: a row's sums then never depend on which rows share its
    // block, so a prompt's positions get the same bits however it was chunked (after a
    // prefix-cache hit, or prefilled beside other sequences). Only the first prompt chunk pays
    // for it (up to half its keys are hidden from a row). A single-position step takes the
    // direct path below, whose sums run in another order.
    let visible = cache.len;
    let keys = &cache.keys[h * cache.capacity * dim..][..visible * dim];
    let values = &cache.values[h * cache.capacity * dim..][..visible * dim];
    let scale = 1.0 / (dim as f32).sqrt();
    SCRATCH.with(|scratch| {
        let (qs, scores, acc) = &mut *scratch.borrow_mut();
        qs.clear();
        for g in 0..groups {
            let head = h * groups + g;
            qs.extend_from_slice(&q[(head * seq + p0) * dim..][..positions * dim]);
        }
        scores.clear();
        scores.resize(rows * visible, 0.0);
        // A decode step (one position: the group's few rows) reads each key and value once;
        // a GEMM would pack (copy) the head's whole cache first, twice per step.
        let direct = seq == 1 && rows <= DIRECT_ROWS;
        if direct {
            key_scores(scores, qs, keys, dim, scale);
        } else {
            // scores = scale · qs (rows × dim) · keysᵀ (dim × visible): the keys read transposed.
            product(
                scores,
                qs,
                keys,
                (rows, visible, dim),
                Transposed::Yes,
                scale,
            );
        }
        let sums: Vec<f32> = scores
            .chunks_mut(visible)
            .enumerate()
            .map(|(r, row)| softmax_prefix(row, before + p0 + r % positions + 1))
            .collect();
        acc.clear();
        acc.resize(rows * dim, 0.0);
        // acc = scores (rows × visible) · values (visible × dim)
        if direct {
            weighted_values(acc, scores, values, rows, dim);
        } else {
            product(
                acc,
                scores,
                values,
                (rows, dim, visible),
                Transposed::No,
                1.0,
            );
        }
        for (row, &sum) in acc.chunks_mut(dim).zip(&sums) {
            let inv = 1.0 / sum;
            for v in row {
                *v *= inv;
            }
        }
        acc.clone()
    })
}

/// Whether the right operand of [`product`] is stored transposed (`n × k` row-major).
#[derive(Clone, Copy, PartialEq)]
enum Transposed {
    Yes,
    No,
}

/// `dst (m × n) = beta · lhs (m × k) · rhs (k × n)`, all row-major (`rhs` stored as its
/// transpose, `n × k`, with [`Transposed::Yes`]), on the calling thread.
fn product(
    dst: &mut [f32],
    lhs: &[f32],
    rhs: &[f32],
    (m, n, k): (usize, usize, usize),
    transposed: Transposed,
    beta: f32,
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= k * n);
    // Strides in elements: (column, row) of rhs read as k × n.
    let (rhs_cs, rhs_rs) = match transposed {
        Transposed::Yes => (k as isize, 1),
        Transposed::No => (1, n as isize),
    };
    // SAFETY: the slices hold at least m × n, m × k and k × n elements (asserted above), and
    // with these strides every element read or written lies within them.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            0.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `scores (rows × keys) = scale · queries (rows × dim) · keysᵀ`, reading each key row once (the
/// decode step's path), compiled for AVX-512 or AVX2 when the CPU has them.
fn key_scores(scores: &mut [f32], queries: &[f32], keys: &[f32], dim: usize, scale: f32) {
    #[inline(always)]
    fn body(scores: &mut [f32], queries: &[f32], keys: &[f32], dim: usize, scale: f32) {
        let n = keys.len() / dim;
        for (j, key) in keys.chunks_exact(dim).enumerate() {
            for (r, query) in queries.chunks_exact(dim).enumerate() {
                // 16 running sums (one vector register), then halved down to one.
                let mut lanes = [0f32; 16];
                let mut pairs = query.chunks_exact(16).zip(key.chunks_exact(16));
                for (a, b) in &mut pairs {
                    for l in 0..16 {
                        lanes[l] += a[l] * b[l];
                    }
                }
                let mut tail = 0f32;
                for (a, b) in query[dim / 16 * 16..].iter().zip(&key[dim / 16 * 16..]) {
                    tail += a * b;
                }
                for width in [8, 4, 2, 1] {
                    for l in 0..width {
                        lanes[l] += lanes[l + width];
                    }
                }
                scores[r * n + j] = scale * (lanes[0] + tail);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(scores: &mut [f32], queries: &[f32], keys: &[f32], dim: usize, scale: f32) {
            body(scores, queries, keys, dim, scale)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(scores: &mut [f32], queries: &[f32], keys: &[f32], dim: usize, scale: f32) {
            body(scores, queries, keys, dim, scale)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { wide(scores, queries, keys, dim, scale) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { avx2(scores, queries, keys, dim, scale) };
        }
    }
    body(scores, queries, keys, dim, scale)
}

/// `out (rows × dim) = weights (rows × keys) · values (keys × dim)`, reading each value row once
/// (the decode step's path), compiled for AVX-512 or AVX2 when the CPU has them.
fn weighted_values(out: &mut [f32], weights: &[f32], values: &[f32], rows: usize, dim: usize) {
    #[inline(always)]
    fn body(out: &mut [f32], weights: &[f32], values: &[f32], rows: usize, dim: usize) {
        let keys = values.len() / dim;
        for (j, value) in values.chunks_exact(dim).enumerate() {
            for (r, row) in out.chunks_exact_mut(dim).enumerate().take(rows) {
                let w = weights[r * keys + j];
                for (o, v) in row.iter_mut().zip(value) {
                    *o += w * v;
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(out: &mut [f32], weights: &[f32], values: &[f32], rows: usize, dim: usize) {
            body(out, weights, values, rows, dim)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(out: &mut [f32], weights: &[f32], values: &[f32], rows: usize, dim: usize) {
            body(out, weights, values, rows, dim)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { wide(out, weights, values, rows, dim) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { avx2(out, weights, values, rows, dim) };
        }
    }
    body(out, weights, values, rows, dim)
}

/// Replaces `row[..sees]` by `e^(x - max)` and zeroes the rest (keys the row may not see);
/// returns the sum of the exponentials.
fn softmax_prefix(row: &mut [f32], sees: usize) -> f32 {
    let (seen, hidden) = row.split_at_mut(sees);
    hidden.fill(0.0);
    let max = lanes_max(seen);
    exp_shifted(seen, max);
    seen.iter().sum()
}

/// The largest value of a non-empty row (16 running maxima the compiler keeps in one vector).
fn lanes_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for chunk in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &x in chunks.remainder() {
        max = max.max(x);
    }
    max
}

/// `x ← e^(x - max)` over the row, compiled for AVX-512 or AVX2 when the CPU has them.
fn exp_shifted(row: &mut [f32], max: f32) {
    #[inline(always)]
    fn body(row: &mut [f32], max: f32) {
        for x in row {
            *x = exp_nonpositive(*x - max);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(row: &mut [f32], max: f32) {
            body(row, max)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(row: &mut [f32], max: f32) {
            body(row, max)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { wide(row, max) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { avx2(row, max) };
        }
    }
    body(row, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook computation: per query head and position, softmax over the visible keys of
    /// the scaled dot products, in f64.
    fn reference(heads: Heads, q: &[f32], cache: &Cache, seq: usize) -> Vec<f32> {
        let Heads { query, kv, dim } = heads;
        let groups = query / kv;
        let mut out = vec![0f32; seq * query * dim];
        for head in 0..query {
            let h = head / groups;
            for p in 0..seq {
                let sees = cache.len - seq + p + 1;
                let qrow = &q[(head * seq + p) * dim..][..dim];
                let scores: Vec<f64> = (0..sees)
                    .map(|j| {
                        let k = &cache.keys[(h * cache.capacity + j) * dim..][..dim];
                        qrow.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..dim {
                    let v: f64 = (0..sees)
                        .map(|j| e[j] * cache.values[(h * cache.capacity + j) * dim + d] as f64)
                        .sum();
                    out[p * query * dim + head * dim + d] = (v / sum) as f32;
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn matches_the_textbook_computation_for_prefill_and_decode_shapes() {
        // (query heads, kv heads, dim, cached before, new positions, capacity)
        for (query, kv, dim, before, seq, capacity) in [
            (12, 2, 16, 0, 1, 4),      // the first token
            (12, 2, 16, 37, 1, 64),    // one decode step, 6 heads per group
            (14, 2, 128, 500, 1, 512), // a decode step at Qwen 0.5B's head shape
            (9, 3, 8, 5, 70, 128),     // a prefill chunk of several blocks, 3 per group
            (4, 4, 32, 100, 3, 128),   // no grouping, tokens a grammar forces together
            (14, 2, 64, 0, 20, 20),    // 7 per group (more than one block of positions)
        ] {
            let heads = Heads { query, kv, dim };
            let len = before + seq;
            let keys = values(kv * capacity * dim, 1);
            let vals = values(kv * capacity * dim, 2);
            let q = values(query * seq * dim, 3);
            let cache = Cache {
                keys: &keys,
                values: &vals,
                capacity,
                len,
            };
            let got = causal_attention(heads, &q, &cache, seq);
            let want = reference(heads, &q, &cache, seq);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-5,
                "{heads:?} before {before} seq {seq}: worst {worst}"
            );
        }
    }

    /// A position's values are the same bits whichever prompt chunk it is computed in (so a
    /// prefix-cache hit or batching never changes a sequence's tokens).
    #[test]
    fn a_row_does_not_depend_on_how_the_prompt_was_chunked() {
        let heads = Heads {
            query: 9,
            kv: 3,
            dim: 64,
        };
        let (len, capacity) = (700, 1024);
        let keys = values(3 * capacity * 64, 7);
        let vals = values(3 * capacity * 64, 8);
        let whole_q = values(9 * len * 64, 9);
        let cache = Cache {
            keys: &keys,
            values: &vals,
            capacity,
            len,
        };
        let whole = causal_attention(heads, &whole_q, &cache, len);
        let width = 9 * 64;
        for cached in [1usize, 7, 50, 119, 300, 698] {
            let seq = len - cached;
            let q: Vec<f32> = (0..9)
                .flat_map(|h| whole_q[(h * len + cached) * 64..][..seq * 64].to_vec())
                .collect();
            let part = causal_attention(heads, &q, &cache, seq);
            assert!(
                part.iter()
                    .zip(&whole[cached * width..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "the last {seq} positions differ from the whole prompt's"
            );
        }
    }

    #[test]
    fn keys_past_the_cache_length_are_never_read() {
        // Garbage (NaN) beyond `len` in the buffers must not reach the output.
        let heads = Heads {
            query: 4,
            kv: 2,
            dim: 8,
        };
        let (capacity, len, seq) = (16, 5, 2);
        let mut keys = values(2 * capacity * 8, 4);
        let mut vals = values(2 * capacity * 8, 5);
        for h in 0..2 {
            for j in len..capacity {
                for d in 0..8 {
                    keys[(h * capacity + j) * 8 + d] = f32::NAN;
                    vals[(h * capacity + j) * 8 + d] = f32::NAN;
                }
            }
        }
        let q = values(4 * seq * 8, 6);
        let cache = Cache {
            keys: &keys,
            values: &vals,
            capacity,
            len,
        };
        let got = causal_attention(heads, &q, &cache, seq);
        assert!(got.iter().all(|v| v.is_finite()), "{got:?}");
        let want = reference(heads, &q, &cache, seq);
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}
