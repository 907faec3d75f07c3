//! Shared runtime plumbing for the candle models: device choice, thread pools, tokenized batches.

use candle_core::{Device, Tensor};
use lycheemem_core::{Error, Result};
use tokenizers::Encoding;

/// Where inference runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    /// CUDA device by ordinal (needs the `cuda` cargo feature).
    Cuda(usize),
}

impl DeviceChoice {
    pub(crate) fn device(self) -> Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(i) => {
                Device::new_cuda(i).map_err(|e| Error::Model(format!("CUDA device {i}: {e}")))
            }
        }
    }
}

pub(crate) fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model(format!("{context}: {e}"))
}

/// A private rayon pool with `threads` threads, or `None` for 0: run on candle's own pools,
/// sized by `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS` (default: all cores).
pub(crate) fn thread_pool(threads: usize) -> Result<Option<rayon::ThreadPool>> {
    if threads == 0 {
        return Ok(None);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lycheemem-infer-{i}"))
        .build()
        .map(Some)
        .map_err(|e| Error::Model(format!("cannot build an inference thread pool: {e}")))
}

/// Runs `f` inside `pool` when there is one.
pub(crate) fn run_in<T: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> T + Send) -> T {
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Pads a batch of encodings to its longest member and returns `(ids, type_ids, mask)` tensors
/// of shape `(batch, len)`.
pub(crate) fn batch_tensors(
    encodings: &[&Encoding],
    pad_id: u32,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let len = encodings
        .iter()
        .map(|e| e.get_ids().len())
        .max()
        .unwrap_or(0)
        .max(1);
    let n = encodings.len();
    let mut ids = vec![pad_id; n * len];
    let mut types = vec![0u32; n * len];
    let mut mask = vec![0u32; n * len];
    for (row, enc) in encodings.iter().enumerate() {
        let base = row * len;
        for (j, ((&id, &ty), &m)) in enc
            .get_ids()
            .iter()
            .zip(enc.get_type_ids())
            .zip(enc.get_attention_mask())
            .enumerate()
        {
            ids[base + j] = id;
            types[base + j] = ty;
            mask[base + j] = m;
        }
    }
    Ok((
        Tensor::from_vec(ids, (n, len), device)?,
        Tensor::from_vec(types, (n, len), device)?,
        Tensor::from_vec(mask, (n, len), device)?,
    ))
}

/// Loads `tokenizer.json` with truncation to `max_len` and no padding (batches pad themselves).
pub(crate) fn load_tokenizer(
    path: &std::path::Path,
    max_len: usize,
) -> Result<tokenizers::Tokenizer> {
    let mut tok = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| Error::Model(format!("cannot load tokenizer {}: {e}", path.display())))?;
    tok.with_padding(None);
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: max_len,
        strategy: tokenizers::TruncationStrategy::LongestFirst,
        ..Default::default()
    }))
    .map_err(|e| Error::Model(format!("cannot set truncation on {}: {e}", path.display())))?;
    Ok(tok)
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Model(format!("{}: {e}", path.display())))
}
