//! The CPU KV cache ([`KvBuffers`], `f16`) and causal grouped-query attention over it: the
//! decoder's attention for a sequence's new positions against its whole cache, without the
//! tensors the generic path materializes.
//!
//! The generic path (candle ops) builds, per layer, the full score matrix of every query head
//! against every cached key, a causal mask repeated per query head, and a copy of the scores for
//! each of scaling, masking and softmax. At a few thousand cached positions those are hundreds of
//! megabytes per layer, freshly mapped (page faults), written and read several times, with a
//! libm `exp` per score: a profile of 8,600-token prompts put over 40% of the time there.
//!
//! Here the query rows that share a key/value head (the group's heads, for a block of positions)
//! are gathered into one small matrix, their scores against the visible keys computed by GEMMs
//! (the scale folded in), softmax applied in place row by row (only the keys each row may see, a
//! polynomial `exp`), and the values multiplied by further GEMMs; the normalization is applied to
//! the output rows. For the GEMMs the cache is read in spans of [`SPAN_KEYS`] positions, each
//! widened from `f16` into a per-thread buffer that stays in a core's cache while the span is
//! used (`f16` halves the bytes a long context's decode step reads). Keys are stored
//! dimension-major within tiles of [`TILE_KEYS`] (16) positions (see [`KvBuffers`]), so a
//! decode step (one position), which skips the GEMMs, reads each tile front to back and scores
//! its 16 keys per vector of multiply-adds with no horizontal sums, converting the `f16` values
//! where they lie (`in_place`, where the CPU has F16C) instead of widening them first; values
//! stay position-major and each value row is added into the group's outputs. Scratch buffers
//! are per thread and reused, so a decode step allocates nothing but its output. Blocks of
//! (key/value head, positions) run in parallel
//! on candle's worker threads.

use half::f16;
use lycheemem_core::vector::exp_nonpositive;
use std::cell::RefCell;
use std::sync::Mutex;

/// The most query rows (group heads × positions) a block holds. Every block widens each span of
/// its head's keys and values and has gemm pack it, so more rows share that work: prefill of an
/// 8,192-token prompt on Qwen2.5-1.5B (2 threads, AVX2) went 45.3 → 51.2 → 54.2 → 54.1 tok/s
/// at 48 → 192 → 384 → 768 rows per block (`results/llm-attention/NOTES.md`, "Session 53").
const MAX_BLOCK_ROWS: usize = 384;

/// The fewest query rows per block while the scores budget allows more (the size used before
/// blocks grew with the context).
const MIN_BLOCK_ROWS: usize = 48;

/// Bytes of one block's scores (rows × visible keys, `f32`), which its thread keeps as scratch:
/// long contexts get fewer rows per block (384 up to ~21,800 visible keys, 256 at 32,768).
const BLOCK_SCORES_BYTES: usize = 32 << 20;

/// Blocks wanted per worker thread, where a chunk has positions enough (load balance).
const BLOCKS_PER_THREAD: usize = 4;

/// Positions per block for `seq` new positions of `kv` key/value heads whose groups have
/// `groups` query heads, against `visible` keys, on `threads` worker threads.
fn positions_per_block(
    seq: usize,
    kv: usize,
    groups: usize,
    visible: usize,
    threads: usize,
) -> usize {
    let rows = (BLOCK_SCORES_BYTES / std::mem::size_of::<f32>() / visible.max(1))
        .clamp(MIN_BLOCK_ROWS, MAX_BLOCK_ROWS);
    let balanced = (seq * kv).div_ceil(BLOCKS_PER_THREAD * threads.max(1));
    (rows / groups).min(balanced).max(1)
}

/// A decode step whose group has at most this many query heads takes the direct path (each key
/// and value read once, no GEMM packing).
const DIRECT_ROWS: usize = 8;

/// Cached positions per tile: the unit of the keys' layout (and of the cache's capacity). A
/// tile of 16 keys holds each dimension's 16 values side by side (32 bytes), so a decode step
/// reads a head's keys front to back, one vector of 16 keys per dimension.
pub(crate) const TILE_KEYS: usize = KEY_LANES;

/// Cached positions widened to `f32` at a time for the GEMMs, a multiple of [`TILE_KEYS`]:
/// 256 KB of keys or values at head dimension 128 (within a core's L2 cache). Spans start at
/// multiples of this from position 0 whatever the block or the cache's length, and no GEMM sums
/// over more than 512 keys (gemm splits a longer inner dimension into blocks whose size depends
/// on its length), so a row's sums never depend on the block or the moment it is computed in.
const SPAN_KEYS: usize = 512;

/// Distance between the rows of a widened span of keys: a span's width plus one vector, so
/// its rows do not all map to the same L1 cache sets (4 KB apart would).
const SPAN_STRIDE: usize = SPAN_KEYS + KEY_LANES;

/// Keys scored per vector of multiply-adds on the decode path.
const KEY_LANES: usize = 16;

/// Output dimensions a decode step's value sums accumulate in registers at a time.
const VALUE_LANES: usize = 32;

/// Calls `fast` (an `#[inline(always)]` function of the enclosing scope) compiled for AVX-512F,
/// or AVX2 and FMA, when the CPU has them, and `portable` as compiled otherwise; the value is
/// returned from the enclosing function. (`fast` may use `f32::mul_add`, a single instruction
/// there; `portable` should not: without FMA it is a library call.)
macro_rules! simd_dispatch {
    ($fast:path, $portable:path; ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn wide($($arg: $ty),*) $(-> $ret)? {
                $fast($($arg),*)
            }
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                $fast($($arg),*)
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked above).
                return unsafe { wide($($arg),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                return unsafe { avx2($($arg),*) };
            }
        }
        $portable($($arg),*)
    }};
}

/// `a · b + c`, fused into one instruction (one rounding) when `FUSED`.
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

/// The attention's shape: query heads, key/value heads (a divisor of the query heads) and the
/// head dimension.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub(crate) query: usize,
    pub(crate) kv: usize,
    pub(crate) dim: usize,
}

/// A view of a [`KvBuffers`]' first `len` positions.
pub(crate) struct Cache<'a> {
    pub(crate) keys: &'a [f16],
    pub(crate) values: &'a [f16],
    pub(crate) capacity: usize,
    pub(crate) len: usize,
}

/// Where key `j` of key/value head `h`, dimension `d` lies in the keys of a cache of `capacity`
/// positions: `(kv heads, capacity / TILE_KEYS tiles, dim, TILE_KEYS)`, row-major.
fn key_at(capacity: usize, dim: usize, h: usize, j: usize, d: usize) -> usize {
    (h * capacity + j / TILE_KEYS * TILE_KEYS) * dim + d * TILE_KEYS + j % TILE_KEYS
}

/// `x` as `f16`, beyond its range the largest finite value of the sign (an infinite key or value
/// would make the weight-0 products of rows that may not see it NaN).
fn saturating_f16(x: f32) -> f16 {
    f16::from_f32(x.clamp(f16::MIN.to_f32(), f16::MAX.to_f32()))
}

/// One layer's cached keys and values of one sequence on the CPU, as `f16`: keys
/// `(kv heads, capacity / TILE_KEYS, dim, TILE_KEYS)` (each tile of positions dimension-major),
/// values `(kv heads, capacity, dim)`. The capacity is a multiple of [`TILE_KEYS`] and doubles
/// when full; which positions are valid is the owner's `len`.
pub(crate) struct KvBuffers {
    heads: usize,
    dim: usize,
    capacity: usize,
    keys: Vec<f16>,
    values: Vec<f16>,
}

impl KvBuffers {
    pub(crate) fn new(heads: usize, dim: usize) -> Self {
        KvBuffers {
            heads,
            dim,
            capacity: 0,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// `(kv heads, dim)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.heads, self.dim)
    }

    /// Room for `needed` positions (at most `max` unless more are needed), keeping the first
    /// `keep`.
    fn reserve(&mut self, needed: usize, keep: usize, max: usize) {
        if needed <= self.capacity {
            return;
        }
        let capacity = needed
            .next_power_of_two()
            .clamp(TILE_KEYS, max.max(needed).max(TILE_KEYS))
            .div_ceil(TILE_KEYS)
            * TILE_KEYS;
        let (heads, dim) = (self.heads, self.dim);
        let mut keys = vec![f16::ZERO; heads * capacity * dim];
        let mut values = vec![f16::ZERO; heads * capacity * dim];
        // Within a head the first `n` positions are the first `n * dim` elements in both layouts
        // (for keys, `n` rounded up to whole tiles).
        let (kept_keys, kept_values) = (keep.div_ceil(TILE_KEYS) * TILE_KEYS * dim, keep * dim);
        for h in 0..heads {
            let (from, to) = (h * self.capacity * dim, h * capacity * dim);
            keys[to..][..kept_keys].copy_from_slice(&self.keys[from..][..kept_keys]);
            values[to..][..kept_values].copy_from_slice(&self.values[from..][..kept_values]);
        }
        self.keys = keys;
        self.values = values;
        self.capacity = capacity;
    }

    /// Writes `seq` positions at `at..` (kept: the first `at`): `k` and `v` are
    /// `(kv heads, seq, dim)` row-major. At most `max` positions are allocated unless more are
    /// needed.
    pub(crate) fn write(&mut self, at: usize, k: &[f32], v: &[f32], seq: usize, max: usize) {
        let (heads, dim) = (self.heads, self.dim);
        assert!(k.len() == heads * seq * dim && v.len() == k.len());
        self.reserve(at + seq, at, max);
        for h in 0..heads {
            for i in 0..seq {
                let j = at + i;
                let (key, value) = (&k[(h * seq + i) * dim..][..dim], &v[(h * seq + i) * dim..]);
                for (d, x) in key.iter().enumerate() {
                    self.keys[key_at(self.capacity, dim, h, j, d)] = saturating_f16(*x);
                }
                let to = &mut self.values[(h * self.capacity + j) * dim..][..dim];
                for (y, x) in to.iter_mut().zip(value) {
                    *y = saturating_f16(*x);
                }
            }
        }
    }

    /// Makes these buffers hold `src`'s first `len` positions (reusing their allocation).
    pub(crate) fn copy_prefix(&mut self, src: &KvBuffers, len: usize, max: usize) {
        assert!(len <= src.capacity && src.shape() == self.shape());
        self.reserve(len, 0, max);
        let dim = self.dim;
        let (kept_keys, kept_values) = (len.div_ceil(TILE_KEYS) * TILE_KEYS * dim, len * dim);
        for h in 0..self.heads {
            let (from, to) = (h * src.capacity * dim, h * self.capacity * dim);
            self.keys[to..][..kept_keys].copy_from_slice(&src.keys[from..][..kept_keys]);
            self.values[to..][..kept_values].copy_from_slice(&src.values[from..][..kept_values]);
        }
    }

    /// The first `len` positions (written before).
    pub(crate) fn view(&self, len: usize) -> Cache<'_> {
        assert!(len <= self.capacity);
        Cache {
            keys: &self.keys,
            values: &self.values,
            capacity: self.capacity,
            len,
        }
    }

    /// The first `len` positions' keys and values as `f32`, `(kv heads, len, dim)` row-major
    /// each (the layout of the generic attention path).
    #[cfg(test)]
    pub(crate) fn rows(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        let (heads, dim) = (self.heads, self.dim);
        let mut keys = Vec::with_capacity(heads * len * dim);
        let mut values = Vec::with_capacity(heads * len * dim);
        for h in 0..heads {
            for j in 0..len {
                for d in 0..dim {
                    keys.push(self.keys[key_at(self.capacity, dim, h, j, d)].to_f32());
                    values.push(self.values[(h * self.capacity + j) * dim + d].to_f32());
                }
            }
        }
        (keys, values)
    }
}

/// Per-thread buffers of the current block.
#[derive(Default)]
struct Scratch {
    /// The block's query rows, gathered.
    queries: Vec<f32>,
    /// rows × visible keys.
    scores: Vec<f32>,
    /// rows × dim.
    out: Vec<f32>,
    /// One span of keys (dimension-major) or values (position-major), widened.
    span: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Attention of `seq` new positions, the last `seq` of the cache's `len`: `q` is
/// `(query heads, seq, dim)` (rotated), the result `(seq, query heads × dim)`. Position `i` of
/// the new ones sees the cached keys `0..=len - seq + i`; query head `h` uses key/value head
/// `h / (query / kv)`.
pub(crate) fn causal_attention(heads: Heads, q: &[f32], cache: &Cache, seq: usize) -> Vec<f32> {
    attention(heads, q, cache, seq, in_place::available(heads.dim))
}

/// [`causal_attention`]; `in_place`: decode steps read the `f16` cache where it lies (the CPU
/// has the instructions, see [`in_place`]) instead of widening spans of it first. Both give the
/// same bits.
fn attention(heads: Heads, q: &[f32], cache: &Cache, seq: usize, in_place: bool) -> Vec<f32> {
    let Heads { query, kv, dim } = heads;
    let groups = query / kv;
    assert!(
        groups * kv == query
            && seq <= cache.len
            && cache.len <= cache.capacity
            && cache.capacity.is_multiple_of(TILE_KEYS),
        "attention shapes: {heads:?}, seq {seq}, cache {} of {}",
        cache.len,
        cache.capacity
    );
    assert!(q.len() == query * seq * dim);
    assert!(cache.keys.len() >= kv * cache.capacity * dim);
    assert!(cache.values.len() >= kv * cache.capacity * dim);
    let width = query * dim;
    let mut out = vec![0f32; seq * width];
    let positions_per_block = positions_per_block(
        seq,
        kv,
        groups,
        cache.len,
        // The pool that runs the blocks: its workers and the calling thread. (candle's
        // `get_num_threads` reads the environment and parses /proc/cpuinfo on every call.)
        candle_core::utils::barrier_pool().n_workers() + 1,
    );
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
            let rows = block(heads, q, cache, seq, (h, p0, p1), in_place);
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
    (h, p0, p1): (usize, usize, usize),
    in_place: bool,
) -> Vec<f32> {
    let Heads { query, kv, dim } = heads;
    let groups = query / kv;
    let positions = p1 - p0;
    let rows = groups * positions;
    let before = cache.len - seq;
    // Every row is multiplied with all cached keys and values (the ones it may not see get
    // weight 0), as in the generic path: a row's sums then never depend on which rows share its
    // block, so a prompt's positions get the same bits from attention however the prompt was
    // chunked (after a prefix-cache hit, or prefilled beside other sequences), as long as each
    // chunk has two positions or more. Only the first prompt chunk pays for it (up to half its
    // keys are hidden from a row). A single-position pass (a decode step) takes the direct path
    // below, whose sums run in another order.
    let visible = cache.len;
    let keys = &cache.keys[h * cache.capacity * dim..][..cache.capacity * dim];
    let values = &cache.values[h * cache.capacity * dim..][..visible * dim];
    let scale = 1.0 / (dim as f32).sqrt();
    // A decode step (one position: the group's few rows) reads each key and value once; a GEMM
    // would pack (copy) every tile first.
    let direct = seq == 1 && rows <= DIRECT_ROWS;
    // GEMMs get two rows at least (a zero row added to a lone one): gemm multiplies a single
    // row by another kernel, whose sums would round differently from the same row's in a block.
    let gemm_rows = if direct { rows } else { rows.max(2) };
    SCRATCH.with(|scratch| {
        let Scratch {
            queries,
            scores,
            out,
            span,
        } = &mut *scratch.borrow_mut();
        queries.clear();
        for g in 0..groups {
            let head = h * groups + g;
            queries.extend_from_slice(&q[(head * seq + p0) * dim..][..positions * dim]);
        }
        queries.resize(gemm_rows * dim, 0.0);
        scores.clear();
        scores.resize(gemm_rows * visible, 0.0);
        span.resize(SPAN_STRIDE * dim, 0.0);
        for first in (0..visible).step_by(SPAN_KEYS) {
            let n = SPAN_KEYS.min(visible - first);
            if direct && in_place {
                let tiles = &keys[first * dim..][..n.div_ceil(TILE_KEYS) * TILE_KEYS * dim];
                // SAFETY: `in_place` is only set where `in_place::available` holds.
                unsafe {
                    in_place::key_scores(&mut scores[first..], visible, queries, tiles, n, scale)
                };
                continue;
            }
            // The span's keys, dimension-major: row d holds dimension d of its n keys, gathered
            // from the tiles' rows.
            for (t, tile) in (first..first + n).step_by(TILE_KEYS).enumerate() {
                let count = TILE_KEYS.min(first + n - tile);
                let stored = &keys[tile * dim..][..TILE_KEYS * dim];
                for (to, from) in span
                    .chunks_exact_mut(SPAN_STRIDE)
                    .zip(stored.chunks_exact(TILE_KEYS))
                {
                    widen(&mut to[t * TILE_KEYS..][..count], &from[..count]);
                }
            }
            let dst = &mut scores[first..];
            if direct {
                key_scores(dst, visible, queries, span, n, scale);
            } else {
                // scores[.., span] = scale · queries (rows × dim) · span (dim × n)
                product(
                    dst,
                    queries,
                    span,
                    Gemm {
                        shape: (gemm_rows, n, dim),
                        strides: (visible, dim, SPAN_STRIDE),
                        scale,
                        accumulate: false,
                    },
                );
            }
        }
        let sums: Vec<f32> = scores
            .chunks_mut(visible)
            .take(rows)
            .enumerate()
            .map(|(r, row)| softmax_prefix(row, before + p0 + r % positions + 1))
            .collect();
        out.clear();
        out.resize(gemm_rows * dim, 0.0);
        for first in (0..visible).step_by(SPAN_KEYS) {
            let n = SPAN_KEYS.min(visible - first);
            let weights = &scores[first..];
            if direct && in_place {
                let stored = &values[first * dim..][..n * dim];
                // SAFETY: as for the keys above.
                unsafe { in_place::weighted_values(out, weights, visible, stored, dim) };
                continue;
            }
            let span = &mut span[..n * dim];
            widen(span, &values[first * dim..][..n * dim]);
            if direct {
                weighted_values(out, weights, visible, span, dim);
            } else {
                // out += scores[.., span] (rows × n) · span (n × dim)
                product(
                    out,
                    weights,
                    span,
                    Gemm {
                        shape: (gemm_rows, dim, n),
                        strides: (dim, visible, dim),
                        scale: 1.0,
                        accumulate: first > 0,
                    },
                );
            }
        }
        for (row, &sum) in out.chunks_mut(dim).zip(&sums) {
            let inv = 1.0 / sum;
            for v in row {
                *v *= inv;
            }
        }
        out[..rows * dim].to_vec()
    })
}

/// `dst ← src` widened to `f32`, with the CPU's F16C conversions when it has them.
fn widen(dst: &mut [f32], src: &[f16]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx,f16c")]
        fn f16c(dst: &mut [f32], src: &[f16]) {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
            let whole = src.len() / 8 * 8;
            for (d, s) in dst[..whole].chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                // SAFETY: `s` holds 8 f16 (16 bytes) and `d` 8 f32; unaligned loads and stores.
                unsafe {
                    let halves = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
                    _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(halves));
                }
            }
            for (d, s) in dst[whole..].iter_mut().zip(&src[whole..]) {
                *d = s.to_f32();
            }
        }
        if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX and F16C (checked above).
            return unsafe { f16c(dst, src) };
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// One [`product`]: `shape` is (m, n, k), `strides` the distances between rows of `dst`,
/// `lhs` and `rhs`; `accumulate` adds to `dst` instead of overwriting it.
struct Gemm {
    shape: (usize, usize, usize),
    strides: (usize, usize, usize),
    scale: f32,
    accumulate: bool,
}

/// `dst (m × n) (+)= scale · lhs (m × k) · rhs (k × n)`, all row-major with the given row
/// strides, on the calling thread.
fn product(dst: &mut [f32], lhs: &[f32], rhs: &[f32], g: Gemm) {
    let (m, n, k) = g.shape;
    let (dst_rs, lhs_rs, rhs_rs) = g.strides;
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(dst_rs >= n && lhs_rs >= k && rhs_rs >= n);
    assert!(dst.len() >= (m - 1) * dst_rs + n);
    assert!(lhs.len() >= (m - 1) * lhs_rs + k && rhs.len() >= (k - 1) * rhs_rs + n);
    // SAFETY: with these strides every element read or written lies within the slices (their
    // lengths are asserted above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            g.accumulate,
            lhs.as_ptr(),
            1,
            lhs_rs as isize,
            rhs.as_ptr(),
            1,
            rhs_rs as isize,
            1.0,
            g.scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `scores (rows × n, row stride `stride`) = scale · queries (rows × dim) · span (dim × n)`,
/// `span` a widened span of keys (`dim` rows [`SPAN_STRIDE`] apart, dimension-major, the first
/// `n` columns valid): 16 keys per vector of multiply-adds, up to four query rows per pass over
/// the keys (each key vector loaded once for all of them), no horizontal sums (the decode
/// step's path).
fn key_scores(
    scores: &mut [f32],
    stride: usize,
    queries: &[f32],
    span: &[f32],
    n: usize,
    scale: f32,
) {
    /// Rows `r0..r0 + R` of the scores of keys `first..first + width`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn rows<const R: usize, const FUSED: bool>(
        scores: &mut [f32],
        stride: usize,
        queries: &[f32],
        span: &[f32],
        (first, width): (usize, usize),
        r0: usize,
        dim: usize,
        scale: f32,
    ) {
        // Lanes past `n` read stale span columns and are not stored.
        let mut lanes = [[0f32; KEY_LANES]; R];
        let queries = &queries[r0 * dim..][..R * dim];
        for d in 0..dim {
            let keys = &span[d * SPAN_STRIDE + first..][..KEY_LANES];
            for (r, acc) in lanes.iter_mut().enumerate() {
                let q = queries[r * dim + d];
                for (a, k) in acc.iter_mut().zip(keys) {
                    *a = madd::<FUSED>(q, *k, *a);
                }
            }
        }
        for (r, acc) in lanes.iter().enumerate() {
            for (s, a) in scores[(r0 + r) * stride + first..][..width]
                .iter_mut()
                .zip(acc)
            {
                *s = scale * a;
            }
        }
    }
    #[inline(always)]
    fn body<const FUSED: bool>(
        scores: &mut [f32],
        stride: usize,
        queries: &[f32],
        span: &[f32],
        n: usize,
        scale: f32,
    ) {
        let dim = span.len() / SPAN_STRIDE;
        let count = queries.len() / dim.max(1);
        for first in (0..n).step_by(KEY_LANES) {
            let keys = (first, KEY_LANES.min(n - first));
            let mut r0 = 0;
            while count - r0 >= 4 {
                rows::<4, FUSED>(scores, stride, queries, span, keys, r0, dim, scale);
                r0 += 4;
            }
            match count - r0 {
                3 => rows::<3, FUSED>(scores, stride, queries, span, keys, r0, dim, scale),
                2 => rows::<2, FUSED>(scores, stride, queries, span, keys, r0, dim, scale),
                1 => rows::<1, FUSED>(scores, stride, queries, span, keys, r0, dim, scale),
                _ => {}
            }
        }
    }
    simd_dispatch!(body::<true>, body::<false>; (
        scores: &mut [f32],
        stride: usize,
        queries: &[f32],
        span: &[f32],
        n: usize,
        scale: f32,
    ))
}

/// `out (rows × dim) += weights (rows × keys, row stride `stride`) · values (keys × dim)`: up to
/// four output rows, 32 dimensions at a time, accumulate in registers over all the keys (each
/// value vector loaded once for all of them; the decode step's path).
fn weighted_values(out: &mut [f32], weights: &[f32], stride: usize, values: &[f32], dim: usize) {
    /// Rows `r0..r0 + R`, dimensions `d0..d0 + VALUE_LANES`.
    #[inline(always)]
    fn rows<const R: usize, const FUSED: bool>(
        out: &mut [f32],
        weights: &[f32],
        stride: usize,
        values: &[f32],
        dim: usize,
        (r0, d0): (usize, usize),
    ) {
        let keys = values.len() / dim;
        let mut acc = [[0f32; VALUE_LANES]; R];
        for j in 0..keys {
            let value = &values[j * dim + d0..][..VALUE_LANES];
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = weights[(r0 + r) * stride + j];
                for (a, v) in acc.iter_mut().zip(value) {
                    *a = madd::<FUSED>(w, *v, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (o, a) in out[(r0 + r) * dim + d0..][..VALUE_LANES]
                .iter_mut()
                .zip(acc)
            {
                *o += a;
            }
        }
    }
    #[inline(always)]
    fn body<const FUSED: bool>(
        out: &mut [f32],
        weights: &[f32],
        stride: usize,
        values: &[f32],
        dim: usize,
    ) {
        let count = out.len() / dim.max(1);
        let whole = dim / VALUE_LANES * VALUE_LANES;
        for d0 in (0..whole).step_by(VALUE_LANES) {
            let mut r0 = 0;
            while count - r0 >= 4 {
                rows::<4, FUSED>(out, weights, stride, values, dim, (r0, d0));
                r0 += 4;
            }
            match count - r0 {
                3 => rows::<3, FUSED>(out, weights, stride, values, dim, (r0, d0)),
                2 => rows::<2, FUSED>(out, weights, stride, values, dim, (r0, d0)),
                1 => rows::<1, FUSED>(out, weights, stride, values, dim, (r0, d0)),
                _ => {}
            }
        }
        // Dimensions past the last whole group of lanes.
        for (j, value) in values.chunks_exact(dim).enumerate() {
            for (r, row) in out.chunks_exact_mut(dim).enumerate() {
                let w = weights[r * stride + j];
                for (o, v) in row[whole..].iter_mut().zip(&value[whole..]) {
                    *o = madd::<FUSED>(w, *v, *o);
                }
            }
        }
    }
    simd_dispatch!(body::<true>, body::<false>; (
        out: &mut [f32],
        weights: &[f32],
        stride: usize,
        values: &[f32],
        dim: usize,
    ))
}

/// The decode step's products read straight from the `f16` cache with F16C conversions: the
/// same multiply-adds in the same order as [`key_scores`] and [`weighted_values`] over widened
/// spans (the same bits), without writing and reading the `f32` copy. A session-52 version on
/// tiles of 256 keys was slower in batched decoding (each 16 keys read 32 bytes from 128 rows
/// 512 bytes apart); on tiles of 16 keys the reads run front to back.
mod in_place {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
    use super::{KEY_LANES, TILE_KEYS};
    use half::f16;

    /// Calls `$rows::<R>(args…, r0)` for the rows `0..$count` in groups of six (`R` = 6), then
    /// once for the rest (`R` < 6), `r0` being each group's first row.
    #[cfg(target_arch = "x86_64")]
    macro_rules! in_groups_of_six {
        ($count:expr, $rows:ident($($arg:expr),*)) => {{
            let count = $count;
            let mut r0 = 0;
            while count - r0 >= 6 {
                $rows::<6>($($arg,)* r0);
                r0 += 6;
            }
            match count - r0 {
                5 => $rows::<5>($($arg,)* r0),
                4 => $rows::<4>($($arg,)* r0),
                3 => $rows::<3>($($arg,)* r0),
                2 => $rows::<2>($($arg,)* r0),
                1 => $rows::<1>($($arg,)* r0),
                _ => {}
            }
        }};
    }

    /// Whether this CPU runs the in-place products for heads of `dim` dimensions (a multiple of
    /// 32: the widened path sums the dimensions past the last 32 in another order).
    pub(super) fn available(dim: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            dim.is_multiple_of(32) && has!("avx2") && has!("fma") && has!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = dim;
            false
        }
    }

    /// [`super::key_scores`] for keys still in their tiles: `tiles` holds the tiles of keys
    /// `0..n` (whole tiles), `queries` the rows (`dim` each).
    ///
    /// # Safety
    /// [`available`] holds.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn key_scores(
        scores: &mut [f32],
        stride: usize,
        queries: &[f32],
        tiles: &[f16],
        n: usize,
        scale: f32,
    ) {
        let dim = tiles.len() / n.div_ceil(TILE_KEYS).max(1) / TILE_KEYS;
        let count = queries.len() / dim.max(1);
        for (t, tile) in tiles.chunks_exact(TILE_KEYS * dim).enumerate() {
            let keys = (t * TILE_KEYS, KEY_LANES.min(n - t * TILE_KEYS));
            in_groups_of_six!(count, key_rows(scores, stride, queries, tile, keys, scale));
        }
    }

    /// Not reached: [`available`] is false off x86-64.
    #[cfg(not(target_arch = "x86_64"))]
    pub(super) unsafe fn key_scores(
        _: &mut [f32],
        _: usize,
        _: &[f32],
        _: &[f16],
        _: usize,
        _: f32,
    ) {
        unreachable!("in-place attention products need x86-64")
    }

    /// Rows `r0..r0 + R` of the scores of one tile's keys `first..first + width`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn key_rows<const R: usize>(
        scores: &mut [f32],
        stride: usize,
        queries: &[f32],
        tile: &[f16],
        (first, width): (usize, usize),
        scale: f32,
        r0: usize,
    ) {
        use std::arch::x86_64::*;
        let dim = tile.len() / TILE_KEYS;
        let queries = &queries[r0 * dim..][..R * dim];
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (d, keys) in tile.chunks_exact(TILE_KEYS).enumerate() {
            // SAFETY: `keys` holds 16 f16 (32 bytes); unaligned loads.
            let (k0, k1) = unsafe {
                let p = keys.as_ptr().cast::<__m128i>();
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(p)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let q = _mm256_set1_ps(queries[r * dim + d]);
                acc[0] = _mm256_fmadd_ps(q, k0, acc[0]);
                acc[1] = _mm256_fmadd_ps(q, k1, acc[1]);
            }
        }
        let scale = _mm256_set1_ps(scale);
        for (r, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; KEY_LANES];
            // SAFETY: `lanes` holds 16 floats.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(scale, acc[0]));
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), _mm256_mul_ps(scale, acc[1]));
            }
            scores[(r0 + r) * stride + first..][..width].copy_from_slice(&lanes[..width]);
        }
    }

    /// [`super::weighted_values`] for values still in the cache: `values` holds keys' values
    /// `(keys, dim)` as stored.
    ///
    /// # Safety
    /// [`available`] holds for `dim`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn weighted_values(
        out: &mut [f32],
        weights: &[f32],
        stride: usize,
        values: &[f16],
        dim: usize,
    ) {
        let count = out.len() / dim.max(1);
        for d0 in (0..dim).step_by(16) {
            in_groups_of_six!(count, value_rows(out, weights, stride, values, dim, d0));
        }
    }

    /// Not reached: [`available`] is false off x86-64.
    #[cfg(not(target_arch = "x86_64"))]
    pub(super) unsafe fn weighted_values(_: &mut [f32], _: &[f32], _: usize, _: &[f16], _: usize) {
        unreachable!("in-place attention products need x86-64")
    }

    /// Rows `r0..r0 + R`, dimensions `d0..d0 + 16`, summed over all the keys in registers and
    /// then added to `out`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn value_rows<const R: usize>(
        out: &mut [f32],
        weights: &[f32],
        stride: usize,
        values: &[f16],
        dim: usize,
        d0: usize,
        r0: usize,
    ) {
        use std::arch::x86_64::*;
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (j, value) in values.chunks_exact(dim).enumerate() {
            let value = &value[d0..][..16];
            // SAFETY: `value` holds 16 f16 (32 bytes); unaligned loads.
            let (v0, v1) = unsafe {
                let p = value.as_ptr().cast::<__m128i>();
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(p)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(weights[(r0 + r) * stride + j]);
                acc[0] = _mm256_fmadd_ps(w, v0, acc[0]);
                acc[1] = _mm256_fmadd_ps(w, v1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let row = &mut out[(r0 + r) * dim + d0..][..16];
            // SAFETY: `row` holds 16 floats; unaligned loads and stores.
            unsafe {
                let p = row.as_mut_ptr();
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), acc[0]));
                _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), acc[1]));
            }
        }
    }
}

/// Replaces `row[..sees]` by `e^(x - max)` and zeroes the rest (keys the row may not see);
/// returns the sum of the exponentials.
fn softmax_prefix(row: &mut [f32], sees: usize) -> f32 {
    let (seen, hidden) = row.split_at_mut(sees);
    hidden.fill(0.0);
    let max = lanes_max(seen);
    exp_shifted(seen, max)
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

/// `x ← e^(x - max)` over the row; returns their sum (16 running sums in the same pass).
fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
    #[inline(always)]
    fn body(row: &mut [f32], max: f32) -> f32 {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact_mut(16);
        for chunk in &mut chunks {
            for (x, sum) in chunk.iter_mut().zip(&mut lanes) {
                *x = exp_nonpositive(*x - max);
                *sum += *x;
            }
        }
        let mut tail = 0f32;
        for x in chunks.into_remainder() {
            *x = exp_nonpositive(*x - max);
            tail += *x;
        }
        lanes.iter().sum::<f32>() + tail
    }
    simd_dispatch!(body, body; (row: &mut [f32], max: f32) -> f32)
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
                        (0..dim)
                            .map(|d| {
                                let k = cache.keys[key_at(cache.capacity, dim, h, j, d)];
                                qrow[d] as f64 * k.to_f64()
                            })
                            .sum::<f64>()
                            / (dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..dim {
                    let v: f64 = (0..sees)
                        .map(|j| e[j] * cache.values[(h * cache.capacity + j) * dim + d].to_f64())
                        .sum();
                    out[p * query * dim + head * dim + d] = (v / sum) as f32;
                }
            }
        }
        out
    }

    /// Stored as the cache stores them.
    fn halves(x: Vec<f32>) -> Vec<f16> {
        x.into_iter().map(f16::from_f32).collect()
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
            (12, 2, 16, 0, 1, 256),     // the first token
            (12, 2, 16, 37, 1, 256),    // one decode step, 6 heads per group
            (14, 2, 128, 500, 1, 512),  // a decode step at Qwen 0.5B's head shape
            (9, 3, 8, 5, 70, 256),      // a prefill chunk of several blocks, 3 per group
            (4, 4, 32, 100, 3, 256),    // no grouping, tokens a grammar forces together
            (14, 2, 64, 0, 20, 256),    // 7 per group (more than one block of positions)
            (12, 2, 16, 512, 1, 768),   // a decode step over whole tiles only
            (12, 2, 16, 1500, 1, 2048), // a decode step over two spans of keys
            (9, 3, 8, 1030, 5, 2048),   // a chunk over two spans
            (16, 2, 32, 300, 1, 512),   // a decode step of 8 rows per group (two passes of 4)
            (4, 4, 40, 100, 1, 256),    // one row per group; a dimension past whole lanes
            (10, 2, 72, 700, 1, 1024),  // 5 rows (4 + 1), 72 = 2 × 32 + 8 dimensions
            (12, 2, 128, 600, 1, 1024), // a decode step over several key tiles
            (12, 2, 32, 530, 9, 1024),  // a chunk over several key tiles (partial last one)
        ] {
            let heads = Heads { query, kv, dim };
            let len = before + seq;
            let keys = halves(values(kv * capacity * dim, 1));
            let vals = halves(values(kv * capacity * dim, 2));
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

    /// A prompt position's values are the same bits whichever chunk of two or more positions it
    /// is computed in, and whenever (each chunk sees the cache as long as its own end): attention
    /// adds no dependence on how a prompt was split after a prefix-cache hit or beside other
    /// sequences.
    #[test]
    fn a_row_does_not_depend_on_how_the_prompt_was_chunked() {
        let len = 1100;
        let capacity = 2048;
        // (query heads, kv heads, dim): grouped, Qwen2.5-1.5B's head shape, and no grouping
        // (one row per position: a chunk of 49 leaves a block of a single row).
        for (query, kv, dim) in [(9, 3, 64), (12, 2, 128), (4, 4, 32)] {
            let heads = Heads { query, kv, dim };
            let keys = halves(values(kv * capacity * dim, 7));
            let vals = halves(values(kv * capacity * dim, 8));
            let whole_q = values(query * len * dim, 9);
            let at = |len| Cache {
                keys: &keys,
                values: &vals,
                capacity,
                len,
            };
            let whole = causal_attention(heads, &whole_q, &at(len), len);
            let width = query * dim;
            for bounds in [
                vec![0, 512, 1024, len],
                vec![0, 7, 56, 105, 600, 1098, len],
                vec![0, 300, 349, 513, 515, len],
            ] {
                for pair in bounds.windows(2) {
                    let (from, to) = (pair[0], pair[1]);
                    let seq = to - from;
                    let q: Vec<f32> = (0..query)
                        .flat_map(|h| whole_q[(h * len + from) * dim..][..seq * dim].to_vec())
                        .collect();
                    let part = causal_attention(heads, &q, &at(to), seq);
                    assert!(
                        part.iter()
                            .zip(&whole[from * width..to * width])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{heads:?}: positions {from}..{to} differ from the whole prompt's"
                    );
                }
            }
        }
    }

    #[test]
    fn decode_steps_give_the_same_bits_in_place_as_from_widened_spans() {
        if !in_place::available(64) {
            return; // Nothing to compare on this CPU: only the widened path exists.
        }
        // Qwen2.5-1.5B's shape, SmolLM2's grouping, Qwen2.5-0.5B's seven heads per group, and
        // one head per group.
        for (query, kv, dim) in [(12, 2, 128), (9, 3, 64), (14, 2, 64), (4, 4, 32)] {
            let heads = Heads { query, kv, dim };
            let capacity = 1024;
            let keys = halves(values(kv * capacity * dim, 11));
            let vals = halves(values(kv * capacity * dim, 12));
            for len in [1, 15, 16, 17, 511, 512, 513, 700, 1024] {
                let cache = Cache {
                    keys: &keys,
                    values: &vals,
                    capacity,
                    len,
                };
                let q = values(query * dim, len as u64);
                let widened = attention(heads, &q, &cache, 1, false);
                let direct = attention(heads, &q, &cache, 1, true);
                assert!(
                    widened
                        .iter()
                        .zip(&direct)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{heads:?}, {len} keys: the in-place products differ"
                );
            }
        }
    }

    #[test]
    fn blocks_grow_within_the_scores_budget_and_keep_every_thread_busy() {
        // Qwen2.5-1.5B's heads (2 key/value heads of 6 query heads), a 512-position chunk.
        assert_eq!(positions_per_block(512, 2, 6, 8192, 2), MAX_BLOCK_ROWS / 6);
        for visible in [1, 600, 8192, 32_768, 131_072] {
            for threads in [1, 2, 16] {
                let p = positions_per_block(512, 2, 6, visible, threads);
                let rows = p * 6;
                assert!(p >= 1 && rows <= MAX_BLOCK_ROWS);
                assert!(rows <= MIN_BLOCK_ROWS || rows * visible * 4 <= BLOCK_SCORES_BYTES);
                assert!(2 * 512usize.div_ceil(p) >= BLOCKS_PER_THREAD * threads);
            }
        }
        // A decode step: one position per block.
        assert_eq!(positions_per_block(1, 2, 6, 4096, 2), 1);
    }

    #[test]
    fn buffers_keep_what_was_written_across_growth_and_prefix_copies() {
        let (heads, dim, max) = (2, 8, 4096);
        let mut kv = KvBuffers::new(heads, dim);
        // What `rows` should give: per head, every written position's values as f16.
        let (mut keys, mut vals) = (vec![Vec::new(); heads], vec![Vec::new(); heads]);
        let mut len = 0;
        for (step, seq) in [3usize, 300, 1, 250, 1].into_iter().enumerate() {
            let k = values(heads * seq * dim, 10 + step as u64);
            let v = values(heads * seq * dim, 20 + step as u64);
            kv.write(len, &k, &v, seq, max);
            for h in 0..heads {
                let part = |x: &[f32]| -> Vec<f32> {
                    x[h * seq * dim..][..seq * dim]
                        .iter()
                        .map(|x| f16::from_f32(*x).to_f32())
                        .collect()
                };
                keys[h].extend(part(&k));
                vals[h].extend(part(&v));
            }
            len += seq;
            assert!(kv.capacity.is_multiple_of(TILE_KEYS));
            assert!(kv.capacity >= len);
            assert_eq!(
                kv.rows(len),
                (keys.concat(), vals.concat()),
                "after step {step}"
            );
        }
        // A prefix copy into buffers that held something else, then a write after it.
        let mut other = KvBuffers::new(heads, dim);
        other.write(
            0,
            &values(heads * 700 * dim, 1),
            &values(heads * 700 * dim, 2),
            700,
            max,
        );
        other.copy_prefix(&kv, 301, max);
        let prefix = |x: &[Vec<f32>]| -> Vec<f32> {
            x.iter().flat_map(|h| h[..301 * dim].to_vec()).collect()
        };
        assert_eq!(other.rows(301), (prefix(&keys), prefix(&vals)));
        let mut small = KvBuffers::new(heads, dim);
        small.copy_prefix(&kv, 301, max);
        assert_eq!(small.rows(301), (prefix(&keys), prefix(&vals)));
    }

    #[test]
    fn out_of_range_values_are_stored_as_the_largest_half() {
        assert_eq!(saturating_f16(1e9), f16::MAX);
        assert_eq!(saturating_f16(-1e9), f16::MIN);
        assert_eq!(saturating_f16(f32::INFINITY), f16::MAX);
        assert_eq!(saturating_f16(1.5), f16::from_f32(1.5));
        assert!(saturating_f16(f32::NAN).is_nan());
    }

    #[test]
    fn widening_gives_each_half_exactly() {
        // Every length around the 8-wide conversions, values across f16's range (subnormals,
        // infinities and NaN included).
        let all: Vec<f16> = (0..=u16::MAX).step_by(7).map(f16::from_bits).collect();
        for len in [0, 1, 7, 8, 9, 23, all.len()] {
            let mut wide = vec![0f32; len];
            widen(&mut wide, &all[..len]);
            for (w, h) in wide.iter().zip(&all) {
                let want = h.to_f32();
                assert!(
                    w.to_bits() == want.to_bits() || (w.is_nan() && want.is_nan()),
                    "{h:?}: {w} != {want}"
                );
            }
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
        let (capacity, len, seq) = (256, 5, 2);
        let mut keys = halves(values(2 * capacity * 8, 4));
        let mut vals = halves(values(2 * capacity * 8, 5));
        for h in 0..2 {
            for j in len..capacity {
                for d in 0..8 {
                    keys[key_at(capacity, 8, h, j, d)] = f16::NAN;
                    vals[(h * capacity + j) * 8 + d] = f16::NAN;
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
