//! Quantized weight matrices repacked for x86-64 CPUs with AVX2, FMA and F16C but no VNNI,
//! multiplied with 8-bit activations in the integer domain: the K-quants Q4_K and Q6_K (blocks
//! of 256 values) and the 32-value formats Q4_1, Q5_0 and Q8_0.
//!
//! candle 0.11 multiplies K-quant weights on these CPUs with tiles of 16 rows whose block scales
//! (and Q4_K's mins) it expands to `f32` at load time, Q6_K's values to one byte each (33 % and
//! 52 % more bytes than the file's blocks, read on every decoding step), and converts every
//! sub-block's integer sum to `f32` for each activation row. It has only scalar code for Q4_1 and
//! Q5_0, so the decoder used to re-quantize those to Q8_0 at load (70 % and 55 % more bytes per
//! decoding step than the file's blocks: SmolLM2's Q4_1 layers, Qwen2.5-0.5B's Q5_0 ones).
//!
//! Here the tiles keep the file's bits, 16 weight rows side by side so that each 32-bit lane of
//! an AVX2 vector accumulates one row and no product needs a horizontal sum:
//! - K-quants: 4-bit values two to a byte (Q6_K's two high bits four to a byte beside them),
//!   scales and mins as bytes, applied in the integer domain (`madd_epi16` of a sub-block's
//!   16-bit sums by the row's scale, as llama.cpp does); Q4_K's min correction and Q6_K's offset
//!   of 32 are one more `madd_epi16` per pair of sub-blocks against the activations' sub-block
//!   sums; one conversion to `f32` per block and row. Activations are quantized per 256 values
//!   (llama.cpp's `Q8_K`). Tiles are 5.5 % (Q4_K) and 1 % (Q6_K) larger than the file's blocks.
//! - 32-value formats: the values as in the file (4-bit two to a byte, Q5_0's fifth bits one per
//!   value, Q8_0's bytes), the block scales (and Q4_1's mins) as the file's `f16`; one conversion
//!   to `f32` per block and row. Activations are quantized per 32 values, as llama.cpp quantizes
//!   them for these formats. Tiles are exactly the file's size.
//!
//! Only used where it was measured faster (see `results/llm-decode-kernels/NOTES.md`): CPUs with
//! AVX2 and FMA and neither AVX-512-VNNI nor AVX-VNNI, where candle has no integer dot-product
//! instruction either. Everywhere else candle's kernels run. The module exists on x86-64 only.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Storage, Tensor};
use std::arch::x86_64::*;

/// Values per K-quant block (and K-quant activation block).
const BLOCK: usize = 256;
/// Values per block of the 32-value formats (and their activation blocks).
const BLOCK32: usize = 32;
/// Bytes per Q4_K block in the GGUF file: `d`, `dmin` (f16), 12 bytes of 6-bit scales and
/// mins, 128 bytes of 4-bit values.
const Q4K_BLOCK_BYTES: usize = 144;
/// Bytes per Q6_K block in the GGUF file: 128 bytes of low 4 bits, 64 of high 2 bits, 16 `i8`
/// scales (one per 16 values), `d` (f16).
const Q6K_BLOCK_BYTES: usize = 210;
/// Bytes per Q4_1 block: `d`, `m` (f16), 16 bytes of 4-bit values.
const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes per Q5_0 block: `d` (f16), 4 bytes of fifth bits, 16 bytes of low 4 bits.
const Q5_0_BLOCK_BYTES: usize = 22;
/// Bytes per Q8_0 block: `d` (f16), 32 `i8` values.
const Q8_0_BLOCK_BYTES: usize = 34;
/// Weight rows per tile (two AVX2 vectors of `i32`/`f32` lanes, one lane per row).
const TILE_ROWS: usize = 16;
/// Activation rows multiplied with a tile while it is in L1 (their accumulators fill the
/// registers).
const ROWS_PER_UNIT: usize = 4;

/// One 256-value block of 16 Q4_K weight rows.
#[repr(C, align(64))]
#[derive(Clone)]
struct TileQ4K {
    /// `[group of 8 values (32)][row (16)][4 bytes]`; byte `j` of a group holds value `8g + j`
    /// in its low nibble and value `8g + j + 4` in its high nibble.
    qs: [u8; BLOCK / 8 * TILE_ROWS * 4],
    /// `[sub-block (8)][row (16)]`: the 6-bit scale of each 32-value sub-block.
    scales: [[u8; TILE_ROWS]; 8],
    /// `[pair of sub-blocks (4)][row (16)][2]`: the 6-bit mins of sub-blocks `2p` and `2p + 1`.
    mins: [[u8; TILE_ROWS * 2]; 4],
    /// Per row: the block's scale multiplier (`d`) and min multiplier (`dmin`).
    d: [f32; TILE_ROWS],
    dmin: [f32; TILE_ROWS],
}

/// One 256-value block of 16 Q6_K weight rows; a weight is `d · scale · (q - 32)` with `q` in
/// `0..64`.
#[repr(C, align(64))]
#[derive(Clone)]
struct TileQ6K {
    /// The low 4 bits of `q`, laid out as [`TileQ4K::qs`].
    low: [u8; BLOCK / 8 * TILE_ROWS * 4],
    /// `[group of 16 values (16)][row (16)][4 bytes]`; bits `2i..2i + 2` of byte `j` of a group
    /// are the high 2 bits of value `16G + 4i + j`.
    high: [u8; BLOCK / 16 * TILE_ROWS * 4],
    /// `[group of 16 values (16)][row (16)]`: the signed scale of each 16 values.
    scales: [[i8; TILE_ROWS]; 16],
    /// Per row: the block's scale multiplier.
    d: [f32; TILE_ROWS],
}

/// One 32-value block of 16 Q4_1 weight rows; a weight is `d · q + m` with `q` in `0..16`.
#[repr(C, align(64))]
#[derive(Clone)]
struct TileQ4_1 {
    /// `[group of 8 values (4)][row (16)][4 bytes]`, as [`TileQ4K::qs`].
    qs: [u8; BLOCK32 / 8 * TILE_ROWS * 4],
    /// Per row: `d` and `m` as the file's `f16` bits.
    d: [u16; TILE_ROWS],
    m: [u16; TILE_ROWS],
}

/// One 32-value block of 16 Q5_0 weight rows; a weight is `d · (q - 16)` with `q` in `0..32`.
#[repr(C, align(32))]
#[derive(Clone)]
struct TileQ5_0 {
    /// The low 4 bits of `q`, laid out as [`TileQ4_1::qs`].
    low: [u8; BLOCK32 / 8 * TILE_ROWS * 4],
    /// `[row (16)][4 bytes]`: bit `2g + h` of byte `j` is the fifth bit of value `8g + 4h + j`
    /// (the value whose low 4 bits are in nibble `h` of byte `j` of group `g`).
    high: [u8; TILE_ROWS * 4],
    /// Per row: `d` as the file's `f16` bits.
    d: [u16; TILE_ROWS],
}

/// One 32-value block of 16 Q8_0 weight rows; a weight is `d · q`.
#[repr(C, align(32))]
#[derive(Clone)]
struct TileQ8_0 {
    /// `[group of 4 values (8)][row (16)][4 bytes]`: byte `j` of group `g` is value `4g + j`.
    qs: [i8; BLOCK32 * TILE_ROWS],
    /// Per row: `d` as the file's `f16` bits.
    d: [u16; TILE_ROWS],
}

/// One 256-value block of an activation row quantized to `i8` (`x ≈ d · q`), for K-quants.
#[repr(C)]
#[derive(Clone)]
struct ActivationBlock {
    qs: [i8; BLOCK],
    d: f32,
    /// Sums of `qs` over 32-value sub-blocks `2p` (low 16 bits) and `2p + 1` (high 16 bits).
    sum32_pairs: [i32; 4],
    /// Sums of `qs` over 16-value groups `2p` (low 16 bits) and `2p + 1` (high 16 bits).
    sum16_pairs: [i32; 8],
}

/// One 32-value block of an activation row quantized to `i8` (`x ≈ d · q`), for the 32-value
/// formats.
#[repr(C)]
#[derive(Clone)]
struct ActivationBlock32 {
    qs: [i8; BLOCK32],
    d: f32,
    /// The sum of `qs`.
    sum: i32,
}

/// An activation block type: how many values it holds and how a row's values are quantized.
trait Activation: Clone + Send + Sync {
    const VALUES: usize;
    const ZERO: Self;
    /// `x` (`VALUES` values) quantized into `out`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    unsafe fn quantize(x: &[f32], out: &mut Self);
    /// The quantized values and their scale `d`.
    #[cfg(test)]
    fn parts(&self) -> (&[i8], f32);
}

impl Activation for ActivationBlock {
    const VALUES: usize = BLOCK;
    const ZERO: Self = ActivationBlock {
        qs: [0; BLOCK],
        d: 0.0,
        sum32_pairs: [0; 4],
        sum16_pairs: [0; 8],
    };
    unsafe fn quantize(x: &[f32], out: &mut Self) {
        // SAFETY: this function's precondition.
        unsafe { quantize_block_avx2(x, out) }
    }
    #[cfg(test)]
    fn parts(&self) -> (&[i8], f32) {
        (&self.qs, self.d)
    }
}

impl Activation for ActivationBlock32 {
    const VALUES: usize = BLOCK32;
    const ZERO: Self = ActivationBlock32 {
        qs: [0; BLOCK32],
        d: 0.0,
        sum: 0,
    };
    unsafe fn quantize(x: &[f32], out: &mut Self) {
        // SAFETY: this function's precondition.
        unsafe { quantize_block32_avx2(x, out) }
    }
    #[cfg(test)]
    fn parts(&self) -> (&[i8], f32) {
        (&self.qs, self.d)
    }
}

/// A tile type: one block of 16 weight rows and the activation blocks it multiplies.
trait Tile: Sync {
    type Act: Activation;
    /// Adds the tile's products with `M` activation blocks to `acc` (`acc[i][h]`: rows
    /// `8h..8h + 8` of the tile).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    unsafe fn add_products<const M: usize>(
        &self,
        acts: &[&Self::Act; M],
        acc: &mut [[__m256; 2]; M],
    );
}

/// A quantized matrix `(out, in)` repacked into tiles, applied as `x · Wᵀ`.
pub(crate) struct PackedQuant {
    out_dim: usize,
    in_dim: usize,
    /// `[out / 16][in / values per block]`.
    tiles: Tiles,
}

enum Tiles {
    Q4K(Vec<TileQ4K>),
    Q6K(Vec<TileQ6K>),
    Q4_1(Vec<TileQ4_1>),
    Q5_0(Vec<TileQ5_0>),
    Q8_0(Vec<TileQ8_0>),
}

/// Whether this CPU takes the repacked path (see the module documentation).
pub(crate) fn preferred_here() -> bool {
    use std::arch::is_x86_feature_detected as has;
    let vnni = (has!("avx512f") && has!("avx512vnni")) || has!("avxvnni");
    supported_here() && !vnni
}

/// Whether this CPU can run the kernels at all.
fn supported_here() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c")
}

/// The 6-bit scale and min of sub-block `j` from a Q4_K block's 12 packed bytes.
fn scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Value `v` (`0..64`) of a Q6_K block: low 4 bits in `ql` (values `128h + 32k + l` in the low
/// nibbles of byte `64h + 32(k % 2) + l` for `k < 2`, the high nibbles for `k >= 2`), high 2 bits
/// in bits `2k..2k + 2` of `qh[32h + l]`.
fn q6k_value(ql: &[u8], qh: &[u8], v: usize) -> u8 {
    let (half, k, l) = (v / 128, v % 128 / 32, v % 32);
    let low = ql[64 * half + 32 * (k % 2) + l];
    let low = if k < 2 { low & 0x0F } else { low >> 4 };
    low | (((qh[32 * half + l] >> (2 * k)) & 3) << 4)
}

impl PackedQuant {
    /// The repacked copy of `weight` where this CPU prefers it (see [`preferred_here`]) and the
    /// weight is a CPU Q4_K, Q6_K, Q4_1, Q5_0 or Q8_0 matrix with `out % 16 == 0` and `in` a
    /// multiple of its block; `None` otherwise.
    pub(crate) fn for_cpu(weight: &QTensor) -> Result<Option<Self>> {
        if !preferred_here() || !weight.device().is_cpu() {
            return Ok(None);
        }
        Self::pack(weight)
    }

    /// The repacked copy of a matrix of a packed type and a suitable shape, on any CPU with
    /// AVX2, FMA and F16C.
    fn pack(weight: &QTensor) -> Result<Option<Self>> {
        let (values, block_bytes) = match weight.dtype() {
            GgmlDType::Q4K => (BLOCK, Q4K_BLOCK_BYTES),
            GgmlDType::Q6K => (BLOCK, Q6K_BLOCK_BYTES),
            GgmlDType::Q4_1 => (BLOCK32, Q4_1_BLOCK_BYTES),
            GgmlDType::Q5_0 => (BLOCK32, Q5_0_BLOCK_BYTES),
            GgmlDType::Q8_0 => (BLOCK32, Q8_0_BLOCK_BYTES),
            _ => return Ok(None),
        };
        if !supported_here() {
            return Ok(None);
        }
        let (out_dim, in_dim) = weight.shape().dims2()?;
        if out_dim == 0
            || in_dim == 0
            || !out_dim.is_multiple_of(TILE_ROWS)
            || !in_dim.is_multiple_of(values)
        {
            return Ok(None);
        }
        let data = weight.data()?;
        let blocks_per_row = in_dim / values;
        if data.len() != out_dim * blocks_per_row * block_bytes {
            candle_core::bail!(
                "{:?} weight {out_dim}x{in_dim} holds {} bytes, expected {}",
                weight.dtype(),
                data.len(),
                out_dim * blocks_per_row * block_bytes
            );
        }
        // The file's block of tile row `t`, row `r` of the tile, block `b` of the row.
        let block = |t: usize, r: usize, b: usize| {
            let at = ((t * TILE_ROWS + r) * blocks_per_row + b) * block_bytes;
            &data[at..at + block_bytes]
        };
        // Tiles in `[out / 16][in / values]` order.
        let at = || (0..out_dim / TILE_ROWS).flat_map(|t| (0..blocks_per_row).map(move |b| (t, b)));
        let tiles = match weight.dtype() {
            GgmlDType::Q4K => Tiles::Q4K(at().map(|(t, b)| pack_q4k(|r| block(t, r, b))).collect()),
            GgmlDType::Q6K => Tiles::Q6K(at().map(|(t, b)| pack_q6k(|r| block(t, r, b))).collect()),
            GgmlDType::Q4_1 => {
                Tiles::Q4_1(at().map(|(t, b)| pack_q4_1(|r| block(t, r, b))).collect())
            }
            GgmlDType::Q5_0 => {
                Tiles::Q5_0(at().map(|(t, b)| pack_q5_0(|r| block(t, r, b))).collect())
            }
            _ => Tiles::Q8_0(at().map(|(t, b)| pack_q8_0(|r| block(t, r, b))).collect()),
        };
        Ok(Some(PackedQuant {
            out_dim,
            in_dim,
            tiles,
        }))
    }

    /// `x · Wᵀ` for `x` of shape `(…, in)` as `(…, out)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let dims = x.dims().to_vec();
        match dims.last() {
            Some(&k) if k == self.in_dim => {}
            _ => candle_core::bail!(
                "input of shape {dims:?} for a {}x{} weight",
                self.out_dim,
                self.in_dim
            ),
        }
        let rows = x.elem_count() / self.in_dim;
        let mut out = vec![0f32; rows * self.out_dim];
        {
            let (storage, layout) = x.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("the repacked quantized path runs on the CPU only")
            };
            let start = layout.start_offset();
            let input = &cpu.as_slice::<f32>()?[start..start + rows * self.in_dim];
            match &self.tiles {
                Tiles::Q4K(tiles) => self.multiply(tiles, input, rows, &mut out),
                Tiles::Q6K(tiles) => self.multiply(tiles, input, rows, &mut out),
                Tiles::Q4_1(tiles) => self.multiply(tiles, input, rows, &mut out),
                Tiles::Q5_0(tiles) => self.multiply(tiles, input, rows, &mut out),
                Tiles::Q8_0(tiles) => self.multiply(tiles, input, rows, &mut out),
            }
        }
        let mut out_dims = dims;
        *out_dims.last_mut().expect("checked above") = self.out_dim;
        Tensor::from_vec(out, out_dims, x.device())
    }

    /// `out (rows, out) = input (rows, in) · Wᵀ` for this matrix's `tiles`.
    fn multiply<T: Tile>(&self, tiles: &[T], input: &[f32], rows: usize, out: &mut [f32]) {
        let blocks_per_row = self.in_dim / T::Act::VALUES;
        // SAFETY: a `PackedQuant` exists only where the CPU has AVX2, FMA and F16C (`pack`).
        let activations = unsafe { quantize_rows::<T::Act>(input, rows, self.in_dim) };
        let row_units = rows.div_ceil(ROWS_PER_UNIT);
        let units = self.out_dim / TILE_ROWS * row_units;
        let out_ptr = out.as_mut_ptr() as usize;
        let out_dim = self.out_dim;
        candle_core::utils::barrier_pool().execute_chunked(units, |range| {
            for unit in range {
                // Row units vary fastest: consecutive units reuse one column of tiles.
                let tile_row = unit / row_units;
                let first = unit % row_units * ROWS_PER_UNIT;
                let count = (rows - first).min(ROWS_PER_UNIT);
                let acts = &activations[first * blocks_per_row..][..count * blocks_per_row];
                let mut sums = [[0f32; TILE_ROWS]; ROWS_PER_UNIT];
                let column = &tiles[tile_row * blocks_per_row..(tile_row + 1) * blocks_per_row];
                // SAFETY: as for `quantize_rows` above.
                unsafe { tile_column(column, acts, count, &mut sums) };
                for (i, row_sums) in sums[..count].iter().enumerate() {
                    // SAFETY: every unit writes its own (row, 16 columns) cells of `out`, which
                    // outlives the pool call; no two units share a cell.
                    unsafe {
                        let dst =
                            (out_ptr as *mut f32).add((first + i) * out_dim + tile_row * TILE_ROWS);
                        std::ptr::copy_nonoverlapping(row_sums.as_ptr(), dst, TILE_ROWS);
                    }
                }
            }
        });
    }
}

/// One Q4_K tile from its 16 rows' file blocks (`block(r)`: row `r`'s 144 bytes).
fn pack_q4k<'a>(block: impl Fn(usize) -> &'a [u8]) -> TileQ4K {
    let mut tile = TileQ4K {
        qs: [0; BLOCK / 8 * TILE_ROWS * 4],
        scales: [[0; TILE_ROWS]; 8],
        mins: [[0; TILE_ROWS * 2]; 4],
        d: [0.0; TILE_ROWS],
        dmin: [0.0; TILE_ROWS],
    };
    for r in 0..TILE_ROWS {
        let block = block(r);
        tile.d[r] = f16_at(block, 0).to_f32();
        tile.dmin[r] = f16_at(block, 2).to_f32();
        let packed_scales = &block[4..16];
        for sub in 0..8 {
            let (scale, min) = scale_min(sub, packed_scales);
            tile.scales[sub][r] = scale;
            tile.mins[sub / 2][r * 2 + sub % 2] = min;
        }
        // The file's 4-bit values: 32-byte chunk `c` holds values `64c + j` in its low nibbles
        // and `64c + 32 + j` in its high nibbles.
        let qs = &block[16..];
        pack_nibble_pairs(&mut tile.qs, r, |v| {
            let byte = qs[v / 64 * 32 + v % 32];
            if v % 64 < 32 { byte & 0x0F } else { byte >> 4 }
        });
    }
    tile
}

/// The little-endian `f16` at byte `at` of a file block.
fn f16_at(block: &[u8], at: usize) -> half::f16 {
    half::f16::from_le_bytes([block[at], block[at + 1]])
}

/// Row `r` of a tile's 4-bit values (`value(v)`, below 16, for `v` from 0 to 8 times the number
/// of groups `dst` holds) in the `[group of 8 values][row][4 bytes]` layout of [`TileQ4K::qs`].
fn pack_nibble_pairs(dst: &mut [u8], r: usize, value: impl Fn(usize) -> u8) {
    for g in 0..dst.len() / (TILE_ROWS * 4) {
        for j in 0..4 {
            dst[(g * TILE_ROWS + r) * 4 + j] = value(8 * g + j) | (value(8 * g + j + 4) << 4);
        }
    }
}

/// One Q6_K tile from its 16 rows' file blocks (`block(r)`: row `r`'s 210 bytes).
fn pack_q6k<'a>(block: impl Fn(usize) -> &'a [u8]) -> TileQ6K {
    let mut tile = TileQ6K {
        low: [0; BLOCK / 8 * TILE_ROWS * 4],
        high: [0; BLOCK / 16 * TILE_ROWS * 4],
        scales: [[0; TILE_ROWS]; 16],
        d: [0.0; TILE_ROWS],
    };
    for r in 0..TILE_ROWS {
        let block = block(r);
        let (ql, qh) = (&block[..128], &block[128..192]);
        for (group, &scale) in block[192..208].iter().enumerate() {
            tile.scales[group][r] = scale as i8;
        }
        tile.d[r] = f16_at(block, 208).to_f32();
        let value = |v: usize| q6k_value(ql, qh, v);
        pack_nibble_pairs(&mut tile.low, r, |v| value(v) & 0x0F);
        for g in 0..BLOCK / 16 {
            for j in 0..4 {
                tile.high[(g * TILE_ROWS + r) * 4 + j] = (0..4).fold(0, |byte, i| {
                    byte | ((value(16 * g + 4 * i + j) >> 4) << (2 * i))
                });
            }
        }
    }
    tile
}

/// The 4-bit value `v` (`0..32`) of a Q4_1 or Q5_0 block's 16 bytes: values `j` in the low
/// nibbles, `16 + j` in the high ones.
fn nibble32(qs: &[u8], v: usize) -> u8 {
    if v < 16 {
        qs[v] & 0x0F
    } else {
        qs[v - 16] >> 4
    }
}

/// One Q4_1 tile from its 16 rows' file blocks (`block(r)`: row `r`'s 20 bytes).
fn pack_q4_1<'a>(block: impl Fn(usize) -> &'a [u8]) -> TileQ4_1 {
    let mut tile = TileQ4_1 {
        qs: [0; BLOCK32 / 8 * TILE_ROWS * 4],
        d: [0; TILE_ROWS],
        m: [0; TILE_ROWS],
    };
    for r in 0..TILE_ROWS {
        let block = block(r);
        tile.d[r] = f16_at(block, 0).to_bits();
        tile.m[r] = f16_at(block, 2).to_bits();
        pack_nibble_pairs(&mut tile.qs, r, |v| nibble32(&block[4..], v));
    }
    tile
}

/// One Q5_0 tile from its 16 rows' file blocks (`block(r)`: row `r`'s 22 bytes).
fn pack_q5_0<'a>(block: impl Fn(usize) -> &'a [u8]) -> TileQ5_0 {
    let mut tile = TileQ5_0 {
        low: [0; BLOCK32 / 8 * TILE_ROWS * 4],
        high: [0; TILE_ROWS * 4],
        d: [0; TILE_ROWS],
    };
    for r in 0..TILE_ROWS {
        let block = block(r);
        tile.d[r] = f16_at(block, 0).to_bits();
        let fifth = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        pack_nibble_pairs(&mut tile.low, r, |v| nibble32(&block[6..], v));
        for j in 0..4 {
            tile.high[r * 4 + j] = (0..8).fold(0, |byte, bit| {
                // Bit `2g + h` of byte `j`: value `8g + 4h + j`.
                let v = 4 * bit + j;
                byte | ((((fifth >> v) & 1) as u8) << bit)
            });
        }
    }
    tile
}

/// One Q8_0 tile from its 16 rows' file blocks (`block(r)`: row `r`'s 34 bytes).
fn pack_q8_0<'a>(block: impl Fn(usize) -> &'a [u8]) -> TileQ8_0 {
    let mut tile = TileQ8_0 {
        qs: [0; BLOCK32 * TILE_ROWS],
        d: [0; TILE_ROWS],
    };
    for r in 0..TILE_ROWS {
        let block = block(r);
        tile.d[r] = f16_at(block, 0).to_bits();
        for v in 0..BLOCK32 {
            tile.qs[(v / 4 * TILE_ROWS + r) * 4 + v % 4] = block[2 + v] as i8;
        }
    }
    tile
}

/// `rows` rows of `cols` values as activation blocks, row-major.
///
/// # Safety
/// The CPU has AVX2 and FMA ([`supported_here`]).
unsafe fn quantize_rows<A: Activation>(input: &[f32], rows: usize, cols: usize) -> Vec<A> {
    let per_row = cols / A::VALUES;
    let mut blocks = vec![A::ZERO; rows * per_row];
    let fill = |range: std::ops::Range<usize>, blocks: &mut [A]| {
        for (i, block) in range.zip(blocks.iter_mut()) {
            // SAFETY: this function's precondition.
            unsafe { A::quantize(&input[i * A::VALUES..][..A::VALUES], block) };
        }
    };
    if rows == 1 {
        fill(0..per_row, &mut blocks);
    } else {
        let ptr = blocks.as_mut_ptr() as usize;
        let total = blocks.len();
        candle_core::utils::barrier_pool().execute_chunked(total, |range| {
            // SAFETY: the pool hands out disjoint ranges of `0..total`, within `blocks`.
            let mine = unsafe {
                std::slice::from_raw_parts_mut((ptr as *mut A).add(range.start), range.len())
            };
            fill(range, mine);
        });
    }
    blocks
}

/// `Tile` for a tile type whose kernel is `$kernel`.
macro_rules! tile_kernel {
    ($tile:ty, $act:ty, $kernel:ident) => {
        impl Tile for $tile {
            type Act = $act;
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn add_products<const M: usize>(
                &self,
                acts: &[&$act; M],
                acc: &mut [[__m256; 2]; M],
            ) {
                $kernel::<M>(self, acts, acc)
            }
        }
    };
}

tile_kernel!(TileQ4K, ActivationBlock, q4k_block);
tile_kernel!(TileQ6K, ActivationBlock, q6k_block);
tile_kernel!(TileQ4_1, ActivationBlock32, q4_1_block);
tile_kernel!(TileQ5_0, ActivationBlock32, q5_0_block);
tile_kernel!(TileQ8_0, ActivationBlock32, q8_0_block);

/// `sums[i][r] = Σ_b acts[i · blocks + b] · tiles[b] row r` for the first `count` rows.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
unsafe fn tile_column<T: Tile>(
    tiles: &[T],
    acts: &[T::Act],
    count: usize,
    sums: &mut [[f32; TILE_ROWS]; ROWS_PER_UNIT],
) {
    // SAFETY: this function's precondition.
    unsafe {
        match count {
            1 => column::<T, 1>(tiles, acts, sums),
            2 => column::<T, 2>(tiles, acts, sums),
            3 => column::<T, 3>(tiles, acts, sums),
            _ => column::<T, 4>(tiles, acts, sums),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn column<T: Tile, const M: usize>(
    tiles: &[T],
    acts: &[T::Act],
    sums: &mut [[f32; TILE_ROWS]; ROWS_PER_UNIT],
) {
    let blocks = tiles.len();
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for (b, tile) in tiles.iter().enumerate() {
        let rows: [&T::Act; M] = std::array::from_fn(|i| &acts[i * blocks + b]);
        // SAFETY: AVX2, FMA and F16C are present (this function's features).
        unsafe { tile.add_products::<M>(&rows, &mut acc) };
    }
    for (row, halves) in sums.iter_mut().zip(&acc) {
        // SAFETY: each half is 8 of the row's 16 floats.
        unsafe {
            _mm256_storeu_ps(row.as_mut_ptr(), halves[0]);
            _mm256_storeu_ps(row.as_mut_ptr().add(8), halves[1]);
        }
    }
}

/// Four activation bytes at `at` (at most `N - 4`), in every 32-bit lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn broadcast4<const N: usize>(qs: &[i8; N], at: usize) -> __m256i {
    assert!(at + 4 <= N);
    // SAFETY: 4 bytes within `qs` (checked above; constant for every caller's unrolled loop).
    _mm256_set1_epi32(unsafe { (qs.as_ptr().add(at) as *const i32).read_unaligned() })
}

/// Eight of a tile's `f16` per-row factors (rows `8h..8h + 8`) as `f32`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_lanes(bits: &[u16; TILE_ROWS], h: usize) -> __m256 {
    assert!(h < 2);
    // SAFETY: 8 of the 16 values.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(bits.as_ptr().add(8 * h) as *const __m128i) })
}

/// 32 bytes of a tile's value array at byte `at`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn load32<T: Copy, const N: usize>(bytes: &[T; N], at: usize) -> __m256i {
    assert!(std::mem::size_of::<T>() == 1 && at + 32 <= N);
    // SAFETY: 32 bytes within the array (checked above).
    unsafe { _mm256_loadu_si256(bytes.as_ptr().add(at) as *const __m256i) }
}

/// Adds one Q4_1 block's products of the tile's 16 rows with `M` activation rows to `acc`.
#[allow(clippy::needless_range_loop)] // `h`: the tile's rows and the accumulator half
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_1_block<const M: usize>(
    tile: &TileQ4_1,
    acts: &[&ActivationBlock32; M],
    acc: &mut [[__m256; 2]; M],
) {
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones16 = _mm256_set1_epi16(1);
    for h in 0..2 {
        // 16-bit sums over the block: at most 4 · 2 · 2 · 15 · 127 = 30,480 per lane.
        let mut partial = [_mm256_setzero_si256(); M];
        for g in 0..4 {
            let w = load32(&tile.qs, (g * TILE_ROWS + h * 8) * 4);
            let lo = _mm256_and_si256(w, low_nibbles);
            let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low_nibbles);
            for (m, act) in acts.iter().enumerate() {
                let both = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, broadcast4(&act.qs, 8 * g)),
                    _mm256_maddubs_epi16(hi, broadcast4(&act.qs, 8 * g + 4)),
                );
                partial[m] = _mm256_add_epi16(partial[m], both);
            }
        }
        let (d, min) = (f16_lanes(&tile.d, h), f16_lanes(&tile.m, h));
        for (m, act) in acts.iter().enumerate() {
            // Σ (d·q + min)·(da·a) = d·da·Σ q·a + min·da·Σ a.
            let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(partial[m], ones16));
            let da = _mm256_set1_ps(act.d);
            acc[m][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, da), acc[m][h]);
            acc[m][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(act.d * act.sum as f32), acc[m][h]);
        }
    }
}

/// Adds one Q5_0 block's products of the tile's 16 rows with `M` activation rows to `acc`.
#[allow(clippy::needless_range_loop)] // `h`: the tile's rows and the accumulator half
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q5_0_block<const M: usize>(
    tile: &TileQ5_0,
    acts: &[&ActivationBlock32; M],
    acc: &mut [[__m256; 2]; M],
) {
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let fifth = _mm256_set1_epi8(0x10);
    let ones16 = _mm256_set1_epi16(1);
    for h in 0..2 {
        let hb = load32(&tile.high, h * 8 * 4);
        // Bit `k` of each byte of `hb` moved to bit 4. A 16-bit shift left by at most 4 or right
        // by at most 3 moves no other byte's bit into bit 4 (a right shift by 4 would).
        let bit = |k: usize| -> __m256i {
            let moved = match k {
                0 => _mm256_slli_epi16(hb, 4),
                1 => _mm256_slli_epi16(hb, 3),
                2 => _mm256_slli_epi16(hb, 2),
                3 => _mm256_slli_epi16(hb, 1),
                4 => hb,
                5 => _mm256_srli_epi16(hb, 1),
                6 => _mm256_srli_epi16(hb, 2),
                _ => _mm256_srli_epi16(hb, 3),
            };
            _mm256_and_si256(moved, fifth)
        };
        let mut dots = [_mm256_setzero_si256(); M];
        for pair in 0..2 {
            // 16-bit sums over two groups: at most 2 · 2 · 2 · 31 · 127 = 31,496 per lane.
            let mut partial = [_mm256_setzero_si256(); M];
            for g in 2 * pair..2 * pair + 2 {
                let w = load32(&tile.low, (g * TILE_ROWS + h * 8) * 4);
                let lo = _mm256_or_si256(_mm256_and_si256(w, low_nibbles), bit(2 * g));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(w, 4), low_nibbles),
                    bit(2 * g + 1),
                );
                for (m, act) in acts.iter().enumerate() {
                    let both = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, broadcast4(&act.qs, 8 * g)),
                        _mm256_maddubs_epi16(hi, broadcast4(&act.qs, 8 * g + 4)),
                    );
                    partial[m] = _mm256_add_epi16(partial[m], both);
                }
            }
            for (dot, part) in dots.iter_mut().zip(partial) {
                *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(part, ones16));
            }
        }
        let d = f16_lanes(&tile.d, h);
        for (m, act) in acts.iter().enumerate() {
            // Σ d·(q - 16)·(da·a) = d·da·(Σ q·a - 16·Σ a).
            let total = _mm256_sub_epi32(dots[m], _mm256_set1_epi32(act.sum << 4));
            acc[m][h] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(total),
                _mm256_mul_ps(d, _mm256_set1_ps(act.d)),
                acc[m][h],
            );
        }
    }
}

/// Adds one Q8_0 block's products of the tile's 16 rows with `M` activation rows to `acc`.
#[allow(clippy::needless_range_loop)] // `h`: the tile's rows and the accumulator half
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_0_block<const M: usize>(
    tile: &TileQ8_0,
    acts: &[&ActivationBlock32; M],
    acc: &mut [[__m256; 2]; M],
) {
    let ones16 = _mm256_set1_epi16(1);
    for h in 0..2 {
        let mut dots = [_mm256_setzero_si256(); M];
        for g in 0..8 {
            let w = load32(&tile.qs, (g * TILE_ROWS + h * 8) * 4);
            // `maddubs` multiplies unsigned by signed bytes: |w| times a with w's sign. Each
            // 16-bit pair sum is at most 2 · 128 · 127 = 32,512.
            let magnitude = _mm256_abs_epi8(w);
            for (m, act) in acts.iter().enumerate() {
                let signed = _mm256_sign_epi8(broadcast4(&act.qs, 4 * g), w);
                let pairs = _mm256_maddubs_epi16(magnitude, signed);
                dots[m] = _mm256_add_epi32(dots[m], _mm256_madd_epi16(pairs, ones16));
            }
        }
        let d = f16_lanes(&tile.d, h);
        for (m, act) in acts.iter().enumerate() {
            acc[m][h] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dots[m]),
                _mm256_mul_ps(d, _mm256_set1_ps(act.d)),
                acc[m][h],
            );
        }
    }
}

/// Adds one block's products of the tile's 16 rows with `M` activation rows to `acc`
/// (`acc[i][h]`: rows `8h..8h + 8` of the tile).
// `h` picks both the tile's rows (byte offsets) and the accumulator half.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn q4k_block<const M: usize>(
    tile: &TileQ4K,
    acts: &[&ActivationBlock; M],
    acc: &mut [[__m256; 2]; M],
) {
    let low_nibbles = _mm256_set1_epi8(0x0F);
    for h in 0..2 {
        // Per activation row, lane r: Σ_sub scale[sub][r] · Σ_{v in sub} q[r][v] · a[v].
        let mut scaled = [_mm256_setzero_si256(); M];
        for sub in 0..8 {
            // SAFETY: 8 of the 16 bytes of `scales[sub]`.
            let s8 =
                unsafe { _mm_loadl_epi64(tile.scales[sub].as_ptr().add(h * 8) as *const __m128i) };
            // Lanes (2r, 2r + 1) of the 16-bit products belong to row r.
            let scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));
            // 16-bit sums over the sub-block's 32 values: at most 4 · 2 · 2 · 15 · 127 =
            // 30,480 per lane, within i16.
            let mut partial = [_mm256_setzero_si256(); M];
            for quad in 0..4 {
                let g = sub * 4 + quad;
                // SAFETY: 32 of the tile's bytes: group g, rows 8h..8h + 8.
                let w = unsafe {
                    _mm256_loadu_si256(
                        tile.qs.as_ptr().add((g * TILE_ROWS + h * 8) * 4) as *const __m256i
                    )
                };
                let lo = _mm256_and_si256(w, low_nibbles);
                let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low_nibbles);
                for (m, act) in acts.iter().enumerate() {
                    let a_lo = broadcast4(&act.qs, 8 * g);
                    let a_hi = broadcast4(&act.qs, 8 * g + 4);
                    let both = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, a_lo),
                        _mm256_maddubs_epi16(hi, a_hi),
                    );
                    partial[m] = _mm256_add_epi16(partial[m], both);
                }
            }
            for (sum, part) in scaled.iter_mut().zip(partial) {
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(part, scale));
            }
        }
        // Per activation row, lane r: Σ_sub min[sub][r] · Σ_{v in sub} a[v].
        let mut mins = [_mm256_setzero_si256(); M];
        for pair in 0..4 {
            // SAFETY: 16 of the 32 bytes of `mins[pair]`: rows 8h..8h + 8, two each.
            let m8 =
                unsafe { _mm_loadu_si128(tile.mins[pair].as_ptr().add(h * 16) as *const __m128i) };
            let min = _mm256_cvtepu8_epi16(m8);
            for (m, act) in acts.iter().enumerate() {
                let sums = _mm256_set1_epi32(act.sum32_pairs[pair]);
                mins[m] = _mm256_add_epi32(mins[m], _mm256_madd_epi16(min, sums));
            }
        }
        // SAFETY: 8 of the 16 floats of `d` and `dmin`.
        let (d, dmin) = unsafe {
            (
                _mm256_loadu_ps(tile.d.as_ptr().add(h * 8)),
                _mm256_loadu_ps(tile.dmin.as_ptr().add(h * 8)),
            )
        };
        for (m, act) in acts.iter().enumerate() {
            let da = _mm256_set1_ps(act.d);
            acc[m][h] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(scaled[m]),
                _mm256_mul_ps(d, da),
                acc[m][h],
            );
            acc[m][h] = _mm256_fnmadd_ps(
                _mm256_cvtepi32_ps(mins[m]),
                _mm256_mul_ps(dmin, da),
                acc[m][h],
            );
        }
    }
}

/// Adds one block's products of the tile's 16 rows with `M` activation rows to `acc`.
#[allow(clippy::needless_range_loop)] // `h`: the tile's rows and the accumulator half
#[target_feature(enable = "avx2,fma")]
#[inline]
fn q6k_block<const M: usize>(
    tile: &TileQ6K,
    acts: &[&ActivationBlock; M],
    acc: &mut [[__m256; 2]; M],
) {
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let bits = |mask: i8| _mm256_set1_epi8(mask);
    for h in 0..2 {
        // Per activation row, lane r: Σ_G scale[G][r] · Σ_{v in G} q[r][v] · a[v].
        let mut scaled = [_mm256_setzero_si256(); M];
        for group in 0..16 {
            // SAFETY: 8 of the 16 bytes of `scales[group]`.
            let s8 = unsafe {
                _mm_loadl_epi64(tile.scales[group].as_ptr().add(h * 8) as *const __m128i)
            };
            let scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));
            // SAFETY: 32 bytes each: nibble groups 2G and 2G + 1, high-bit group G, rows
            // 8h..8h + 8.
            let (w0, w1, hb) = unsafe {
                let at = |g: usize| (g * TILE_ROWS + h * 8) * 4;
                (
                    _mm256_loadu_si256(tile.low.as_ptr().add(at(2 * group)) as *const __m256i),
                    _mm256_loadu_si256(tile.low.as_ptr().add(at(2 * group + 1)) as *const __m256i),
                    _mm256_loadu_si256(tile.high.as_ptr().add(at(group)) as *const __m256i),
                )
            };
            // Values 16G + 4i + j (i = 0..4) of each row's 4-byte lanes, 0..64.
            let v0 = _mm256_or_si256(
                _mm256_and_si256(w0, low_nibbles),
                _mm256_slli_epi16(_mm256_and_si256(hb, bits(0x03)), 4),
            );
            let v1 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(w0, 4), low_nibbles),
                _mm256_slli_epi16(_mm256_and_si256(hb, bits(0x0C)), 2),
            );
            let v2 = _mm256_or_si256(
                _mm256_and_si256(w1, low_nibbles),
                _mm256_and_si256(hb, bits(0x30)),
            );
            let v3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(w1, 4), low_nibbles),
                _mm256_srli_epi16(_mm256_and_si256(hb, bits(0xC0u8 as i8)), 2),
            );
            for (m, act) in acts.iter().enumerate() {
                let at = 16 * group;
                // Two products of at most 2 · 63 · 127 each: within i16.
                let first = _mm256_add_epi16(
                    _mm256_maddubs_epi16(v0, broadcast4(&act.qs, at)),
                    _mm256_maddubs_epi16(v1, broadcast4(&act.qs, at + 4)),
                );
                let second = _mm256_add_epi16(
                    _mm256_maddubs_epi16(v2, broadcast4(&act.qs, at + 8)),
                    _mm256_maddubs_epi16(v3, broadcast4(&act.qs, at + 12)),
                );
                scaled[m] = _mm256_add_epi32(
                    scaled[m],
                    _mm256_add_epi32(
                        _mm256_madd_epi16(first, scale),
                        _mm256_madd_epi16(second, scale),
                    ),
                );
            }
        }
        // The offset: per activation row, lane r: Σ_G scale[G][r] · Σ_{v in G} a[v].
        let mut offsets = [_mm256_setzero_si256(); M];
        for pair in 0..8 {
            // SAFETY: 8 of the 16 bytes of `scales[2p]` and `scales[2p + 1]`.
            let (even, odd) = unsafe {
                (
                    _mm_loadl_epi64(tile.scales[2 * pair].as_ptr().add(h * 8) as *const __m128i),
                    _mm_loadl_epi64(tile.scales[2 * pair + 1].as_ptr().add(h * 8) as *const __m128i),
                )
            };
            let scales = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd));
            for (m, act) in acts.iter().enumerate() {
                let sums = _mm256_set1_epi32(act.sum16_pairs[pair]);
                offsets[m] = _mm256_add_epi32(offsets[m], _mm256_madd_epi16(scales, sums));
            }
        }
        // SAFETY: 8 of the 16 floats of `d`.
        let d = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add(h * 8)) };
        for (m, act) in acts.iter().enumerate() {
            let total = _mm256_sub_epi32(scaled[m], _mm256_slli_epi32(offsets[m], 5));
            acc[m][h] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(total),
                _mm256_mul_ps(d, _mm256_set1_ps(act.d)),
                acc[m][h],
            );
        }
    }
}

/// The largest magnitude of `x` (a multiple of 8 values), or `None` when the block has no
/// finite scale: a NaN or infinite value (the caller's logits would be meaningless anyway; the
/// block then counts as zero, which keeps them finite), or values too small for a finite
/// inverse scale (|x| < 3.7e-37 throughout).
#[target_feature(enable = "avx2,fma")]
fn block_scale(x: &[f32]) -> Option<f32> {
    assert!(x.len().is_multiple_of(8));
    let sign = _mm256_set1_ps(-0.0);
    let largest = _mm256_set1_ps(f32::MAX);
    let mut amax = _mm256_setzero_ps();
    let mut non_finite = _mm256_setzero_ps();
    for chunk in x.chunks_exact(8) {
        // SAFETY: 8 values.
        let v = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(chunk.as_ptr()) });
        amax = _mm256_max_ps(amax, v);
        // True for NaN (unordered) and infinities.
        non_finite = _mm256_or_ps(non_finite, _mm256_cmp_ps::<_CMP_NLE_UQ>(v, largest));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
    let max = lanes.iter().fold(0f32, |a, &b| a.max(b));
    (_mm256_movemask_ps(non_finite) == 0 && (127.0 / max).is_finite()).then_some(max)
}

/// 32 values times `inverse`, rounded to nearest (ties to even) and saturated to `i8`, in order.
#[target_feature(enable = "avx2,fma")]
fn quantize32(x: &[f32], inverse: __m256) -> __m256i {
    assert_eq!(x.len(), 32);
    // SAFETY: 8 of the 32 values each.
    let [a, b, c, d] = std::array::from_fn(|j| unsafe {
        _mm256_cvtps_epi32(_mm256_mul_ps(
            _mm256_loadu_ps(x.as_ptr().add(8 * j)),
            inverse,
        ))
    });
    _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d)),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    )
}

/// `x` (256 values) as `d · q` with `q` in `-127..=127` rounded to nearest (ties to even),
/// and its sub-block sums; zero where [`block_scale`] finds no scale.
#[target_feature(enable = "avx2,fma")]
fn quantize_block_avx2(x: &[f32], out: &mut ActivationBlock) {
    assert_eq!(x.len(), BLOCK);
    let Some(max) = block_scale(x) else {
        *out = ActivationBlock::ZERO;
        return;
    };
    let inverse = _mm256_set1_ps(127.0 / max);
    let ones = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    // Sums of 16 values (at most 16 · 127: within i16).
    let mut sums16 = [0i32; 16];
    for sub in 0..8 {
        let packed = quantize32(&x[32 * sub..][..32], inverse);
        // SAFETY: 32 of the 256 bytes.
        unsafe { _mm256_storeu_si256(out.qs.as_mut_ptr().add(32 * sub) as *mut __m256i, packed) };
        let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, packed), ones16);
        // Lane i: the sum of values 4i..4i + 4 of the sub-block.
        let mut s = [0i32; 8];
        // SAFETY: 8 i32.
        unsafe { _mm256_storeu_si256(s.as_mut_ptr() as *mut __m256i, sums) };
        sums16[2 * sub] = s[..4].iter().sum();
        sums16[2 * sub + 1] = s[4..].iter().sum();
    }
    out.d = max / 127.0;
    let pack =
        |lo: i32, hi: i32| (lo as i16 as u16 as u32 | ((hi as i16 as u16 as u32) << 16)) as i32;
    for pair in 0..4 {
        let sum32 = |sub: usize| sums16[2 * sub] + sums16[2 * sub + 1];
        out.sum32_pairs[pair] = pack(sum32(2 * pair), sum32(2 * pair + 1));
    }
    for pair in 0..8 {
        out.sum16_pairs[pair] = pack(sums16[2 * pair], sums16[2 * pair + 1]);
    }
}

/// `x` (32 values) as `d · q` with `q` in `-127..=127` rounded to nearest (ties to even), and
/// the sum of `q`; zero where [`block_scale`] finds no scale.
#[target_feature(enable = "avx2,fma")]
fn quantize_block32_avx2(x: &[f32], out: &mut ActivationBlock32) {
    assert_eq!(x.len(), BLOCK32);
    let Some(max) = block_scale(x) else {
        *out = ActivationBlock32::ZERO;
        return;
    };
    let packed = quantize32(x, _mm256_set1_ps(127.0 / max));
    // SAFETY: the 32 bytes of `qs`.
    unsafe { _mm256_storeu_si256(out.qs.as_mut_ptr() as *mut __m256i, packed) };
    out.d = max / 127.0;
    out.sum = out.qs.iter().map(|&q| q as i32).sum();
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};

    const TYPES: [GgmlDType; 5] = [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
    ];

    /// A row width for `dtype`'s tests: two K-quant blocks, or 18 blocks of 32 (SmolLM2's 576,
    /// not a multiple of 256).
    fn width(dtype: GgmlDType) -> usize {
        match dtype {
            GgmlDType::Q4K | GgmlDType::Q6K => 512,
            _ => 576,
        }
    }

    /// The activations of `rows` rows as the kernels for `dtype` see them: `d · q` per block.
    fn seen(dtype: GgmlDType, x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        fn blocks<A: Activation>(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
            // SAFETY: every caller checks `supported_here` first.
            let blocks = unsafe { quantize_rows::<A>(x, rows, cols) };
            let dequantized = |b: &A| {
                let (qs, d) = b.parts();
                qs.iter().map(|&q| d * q as f32).collect::<Vec<_>>()
            };
            blocks.iter().flat_map(dequantized).collect()
        }
        match dtype {
            GgmlDType::Q4K | GgmlDType::Q6K => blocks::<ActivationBlock>(x, rows, cols),
            _ => blocks::<ActivationBlock32>(x, rows, cols),
        }
    }

    /// Deterministic values in `[-1, 1)` with a spread of magnitudes per block.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                // Some sub-blocks much larger than others, so scales and mins differ.
                u * (1.0 + (i / 32 % 5) as f32)
            })
            .collect()
    }

    fn quantized(dtype: GgmlDType, out_dim: usize, in_dim: usize, seed: u64) -> Result<QTensor> {
        let w = Tensor::from_vec(
            values(out_dim * in_dim, seed),
            (out_dim, in_dim),
            &Device::Cpu,
        )?;
        QTensor::quantize(&w, dtype)
    }

    /// A quantized test matrix and its tiles.
    fn packed(
        dtype: GgmlDType,
        out_dim: usize,
        in_dim: usize,
        seed: u64,
    ) -> Result<(QTensor, PackedQuant)> {
        let q = quantized(dtype, out_dim, in_dim, seed)?;
        let packed = PackedQuant::pack(&q)?.expect("a packed type of a tiled shape");
        Ok((q, packed))
    }

    /// The weight value of `row`, column `col` as the tiles store it.
    fn tile_value(p: &PackedQuant, row: usize, col: usize) -> f32 {
        let values = match p.tiles {
            Tiles::Q4K(_) | Tiles::Q6K(_) => BLOCK,
            _ => BLOCK32,
        };
        let blocks = p.in_dim / values;
        let at = row / TILE_ROWS * blocks + col / values;
        let (r, v) = (row % TILE_ROWS, col % values);
        let f16 = |bits: u16| half::f16::from_bits(bits).to_f32();
        let nibble = |bytes: &[u8]| {
            let byte = bytes[(v / 8 * TILE_ROWS + r) * 4 + v % 4];
            if v % 8 < 4 { byte & 0x0F } else { byte >> 4 }
        };
        match &p.tiles {
            Tiles::Q4K(tiles) => {
                let tile = &tiles[at];
                let sub = v / 32;
                tile.d[r] * tile.scales[sub][r] as f32 * nibble(&tile.qs) as f32
                    - tile.dmin[r] * tile.mins[sub / 2][r * 2 + sub % 2] as f32
            }
            Tiles::Q6K(tiles) => {
                let tile = &tiles[at];
                let group = v / 16;
                let (i, j) = (v % 16 / 4, v % 4);
                let high = (tile.high[(group * TILE_ROWS + r) * 4 + j] >> (2 * i)) & 3;
                let q = (nibble(&tile.low) | (high << 4)) as f32 - 32.0;
                tile.d[r] * tile.scales[group][r] as f32 * q
            }
            Tiles::Q4_1(tiles) => {
                let tile = &tiles[at];
                f16(tile.d[r]) * nibble(&tile.qs) as f32 + f16(tile.m[r])
            }
            Tiles::Q5_0(tiles) => {
                let tile = &tiles[at];
                let bit = 2 * (v / 8) + v % 8 / 4;
                let fifth = (tile.high[r * 4 + v % 4] >> bit) & 1;
                f16(tile.d[r]) * ((nibble(&tile.low) | (fifth << 4)) as f32 - 16.0)
            }
            Tiles::Q8_0(tiles) => {
                let tile = &tiles[at];
                f16(tile.d[r]) * tile.qs[(v / 4 * TILE_ROWS + r) * 4 + v % 4] as f32
            }
        }
    }

    #[test]
    fn the_tiles_hold_the_files_weights() -> Result<()> {
        if !supported_here() {
            return Ok(()); // nothing to check on a CPU without AVX2 and FMA
        }
        for dtype in TYPES {
            let (q, packed) = packed(dtype, 32, width(dtype), 1)?;
            let dense = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
            for (row, values) in dense.iter().enumerate() {
                for (col, &want) in values.iter().enumerate() {
                    let got = tile_value(&packed, row, col);
                    assert!(
                        (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "{dtype:?} row {row} col {col}: {got} vs {want}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Every packed type: see [`check_products`].
    #[test]
    fn products_match_the_dequantized_weights() -> Result<()> {
        if !supported_here() {
            return Ok(());
        }
        for dtype in TYPES {
            // Three K-quant blocks; 36 blocks of 32 (candle's Q4_1 and Q5_0 kernels, compared
            // against below, assert an even number of blocks in debug builds).
            let in_dim = match dtype {
                GgmlDType::Q4K | GgmlDType::Q6K => 3 * BLOCK,
                _ => 2 * width(dtype),
            };
            check_products(quantized(dtype, 48, in_dim, 2)?)?;
        }
        Ok(())
    }

    /// GGUF files may hold Q8_0 values of -128, which candle's quantizer never writes: their
    /// magnitude (128) still multiplies exactly.
    #[test]
    fn q8_0_values_of_minus_128_multiply_exactly() -> Result<()> {
        if !supported_here() {
            return Ok(());
        }
        let q = quantized(GgmlDType::Q8_0, 32, 576, 8)?;
        let mut data = q.data()?.into_owned();
        for block in data.chunks_exact_mut(Q8_0_BLOCK_BYTES) {
            for value in block[2..].iter_mut().step_by(3) {
                *value = 0x80;
            }
        }
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(data),
            &Device::Cpu,
            GgmlDType::Q8_0,
        )?;
        check_products(QTensor::new(storage, q.shape().clone())?)
    }

    /// For every row count a unit can hold (1–4) and several units: the packed product of `q`
    /// is exactly (up to f32 rounding) its dequantized weights times the 8-bit activations, and
    /// close to the f32 product and to candle's own kernel.
    fn check_products(q: QTensor) -> Result<()> {
        let dtype = q.dtype();
        let (out_dim, in_dim) = q.shape().dims2()?;
        let packed = PackedQuant::pack(&q)?.expect("a packed type of a tiled shape");
        let dense = q.dequantize(&Device::Cpu)?;
        let candle = candle_core::quantized::QMatMul::from_qtensor(q)?;
        {
            for rows in [1, 2, 3, 4, 5, 9] {
                let x = Tensor::from_vec(
                    values(rows * in_dim, 10 + rows as u64),
                    (1, rows, in_dim),
                    &Device::Cpu,
                )?;
                let got = packed.forward(&x)?;
                assert_eq!(got.dims(), &[1, rows, out_dim]);
                let max_diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                    (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
                };
                // The activations as the kernel sees them: d · q per block.
                let flat = x.flatten_all()?.to_vec1::<f32>()?;
                let seen = seen(dtype, &flat, rows, in_dim);
                let seen = Tensor::from_vec(seen, (1, rows, in_dim), &Device::Cpu)?;
                let exact = seen.broadcast_matmul(&dense.t()?)?;
                let scale = exact.abs()?.max_all()?.to_scalar::<f32>()?;
                let diff = max_diff(&got, &exact)?;
                assert!(
                    diff <= 1e-5 * scale,
                    "{dtype:?}, {rows} rows: max diff {diff} (scale {scale})"
                );
                // Against f32 activations and against candle's kernel (which quantizes
                // activations to 8 bits too): within the activations' rounding, ~1 % of the
                // scale.
                let diff = max_diff(&got, &x.broadcast_matmul(&dense.t()?)?)?;
                assert!(
                    diff <= 0.02 * scale,
                    "{dtype:?}, {rows} rows vs f32: {diff}"
                );
                let diff = max_diff(&got, &candle.forward(&x)?)?;
                assert!(
                    diff <= 0.02 * scale,
                    "{dtype:?}, {rows} rows vs candle: {diff}"
                );
            }
        }
        Ok(())
    }

    /// A zero block and a non-finite block quantize to zero: the products are finite and
    /// exactly those of the same rows with the non-finite block's values all zero.
    #[test]
    fn zero_and_non_finite_activation_blocks_give_finite_products() -> Result<()> {
        if !supported_here() {
            return Ok(());
        }
        for dtype in TYPES {
            let in_dim = width(dtype);
            let block = match dtype {
                GgmlDType::Q4K | GgmlDType::Q6K => BLOCK,
                _ => BLOCK32,
            };
            let (_, packed) = packed(dtype, 16, in_dim, 3)?;
            let product = |x: Vec<f32>| -> Result<Vec<f32>> {
                let x = Tensor::from_vec(x, (2, in_dim), &Device::Cpu)?;
                packed.forward(&x)?.flatten_all()?.to_vec1::<f32>()
            };
            let mut x = values(2 * in_dim, 4);
            x[..BLOCK].fill(0.0);
            let mut zeroed = x.clone();
            x[in_dim + 3] = f32::NAN;
            zeroed[in_dim..in_dim + block].fill(0.0);
            let got = product(x)?;
            assert!(got.iter().all(|v| v.is_finite()), "{dtype:?}");
            assert_eq!(got, product(zeroed)?, "{dtype:?}");
        }
        Ok(())
    }

    /// Activations stay within `-127..=127` whatever their magnitude, including blocks too
    /// small for a finite inverse scale (which count as zero).
    #[test]
    fn activations_stay_within_127() {
        fn check<A: Activation>() {
            for magnitude in [1e-38f32, 1e-30, 1.0, 3e38] {
                let x: Vec<f32> = values(A::VALUES, 7)
                    .iter()
                    .map(|v| v * (magnitude / 5.0))
                    .collect();
                // SAFETY: the caller checks `supported_here`.
                let blocks = unsafe { quantize_rows::<A>(&x, 1, A::VALUES) };
                let (qs, d) = blocks[0].parts();
                let at = (A::VALUES, magnitude);
                assert!(qs.iter().all(|&q| q != i8::MIN), "{at:?}");
                assert!(d.is_finite(), "{at:?}");
                if magnitude < 1e-36 {
                    assert_eq!(d, 0.0);
                    assert!(qs.iter().all(|&q| q == 0));
                } else {
                    assert!(qs.iter().any(|&q| q.unsigned_abs() == 127), "{at:?}");
                }
            }
        }
        if !supported_here() {
            return;
        }
        check::<ActivationBlock>();
        check::<ActivationBlock32>();
    }

    #[test]
    fn other_types_and_shapes_are_not_packed() -> Result<()> {
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q5_1, GgmlDType::Q5K] {
            assert!(PackedQuant::pack(&quantized(dtype, 16, 512, 5)?)?.is_none());
        }
        for dtype in TYPES {
            assert!(PackedQuant::pack(&quantized(dtype, 8, 512, 6)?)?.is_none());
        }
        Ok(())
    }
}
