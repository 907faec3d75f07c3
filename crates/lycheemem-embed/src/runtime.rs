//! Shared runtime plumbing for the candle models: device choice, thread pools, tokenized batches.

use candle_core::{Device, Tensor};
use lycheemem_core::{ComputeDevice, Error, Result};
use tokenizers::Encoding;

/// Whether this build can run models on CUDA GPUs (the `cuda` feature).
pub const CUDA_SUPPORT: bool = cfg!(feature = "cuda");

/// The candle device for `choice`, shared by every model of the process (one CUDA context per
/// GPU). `Auto` is the first GPU when this build has CUDA support and one answers, else the
/// CPU; an explicit `cuda:N` fails with the reason when the build lacks CUDA support or the GPU
/// does not answer.
pub fn candle_device(choice: ComputeDevice) -> Result<Device> {
    match choice {
        ComputeDevice::Cpu => Ok(Device::Cpu),
        ComputeDevice::Cuda(i) => cuda_device(i),
        ComputeDevice::Auto => match cuda_device(0) {
            Ok(d) => Ok(d),
            Err(e) => {
                if cfg!(feature = "cuda") {
                    tracing::info!("device auto: no usable GPU ({e}); running on the CPU");
                }
                Ok(Device::Cpu)
            }
        },
    }
}

/// `choice` with `auto` decided: the GPU the models will run on, or the CPU.
pub fn resolve_device(choice: ComputeDevice) -> Result<ComputeDevice> {
    Ok(match candle_device(choice)?.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => ComputeDevice::Cuda(gpu_id),
        _ => ComputeDevice::Cpu,
    })
}

/// `cpu` or `cuda:N`: what [`candle_device`] gave.
pub fn device_label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<Device> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static OPENED: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut opened = OPENED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = opened.get(&ordinal) {
        return Ok(d.clone());
    }
    let device = Device::new_cuda(ordinal).map_err(|e| {
        Error::Model(format!(
            "CUDA device {ordinal} is not usable ({e}); check that an NVIDIA driver is installed \
             and the GPU is visible (nvidia-smi), or choose --device cpu"
        ))
    })?;
    opened.insert(ordinal, device.clone());
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(ordinal: usize) -> Result<Device> {
    Err(Error::Model(format!(
        "device cuda:{ordinal}: this binary was built without CUDA support; rebuild with \
         `--features cuda` (README, \"Running on a GPU\") or choose --device cpu"
    )))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_is_always_there_and_auto_falls_back_to_it() {
        assert!(candle_device(ComputeDevice::Cpu).unwrap().is_cpu());
        assert_eq!(device_label(&Device::Cpu), "cpu");
        if !cfg!(feature = "cuda") {
            assert_eq!(
                resolve_device(ComputeDevice::Auto).unwrap(),
                ComputeDevice::Cpu
            );
            let e = candle_device(ComputeDevice::Cuda(0))
                .unwrap_err()
                .to_string();
            assert!(e.contains("built without CUDA support"), "{e}");
        }
    }
}
