//! BERT-family sentence embedders read from an upstream sentence-transformers folder.

use candle_core::{D, DType, Device, IndexOp};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config as BertConfig, HiddenAct};
use lycheemem_core::config::SegmentCalibration;
use lycheemem_core::{ComputeDevice, Error, Result};
use serde::Deserialize;
use std::path::Path;

use crate::Embedder;
use crate::bert_cpu::{Activation, BertShape, CpuBert, Tokens};
use crate::runtime::{batch_tensors, load_tokenizer, model_err, read_json, thread_pool};

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Mean of the token vectors under the attention mask (all-MiniLM-L6-v2).
    Mean,
    /// The first (`[CLS]`) token's vector (BGE models).
    Cls,
}

/// Load-time options. `Default` reads everything from the model folder and runs on the `auto`
/// device (the GPU in a `cuda` build with one present, else the CPU with all cores).
#[derive(Debug, Clone, Default)]
pub struct EmbedderOptions {
    /// Where the model runs (default `auto`).
    pub device: ComputeDevice,
    /// Inference threads; 0 = all cores.
    pub threads: usize,
    /// Texts per forward pass; 0 = 32.
    pub batch_size: usize,
    /// Overrides `1_Pooling/config.json`.
    pub pooling: Option<Pooling>,
    /// Overrides `sentence_bert_config.json`'s `max_seq_length` (tokens, specials included).
    pub max_tokens: Option<usize>,
    /// Identifier reported by [`Embedder::model_id`]; default: the folder name.
    pub model_id: Option<String>,
    /// Which forward pass runs the model (default: the native one on the CPU).
    pub engine: EmbedEngine,
}

/// The code that runs the encoder's forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EmbedEngine {
    /// On the CPU, lycheemem's own forward pass (unpadded batches, fused QKV, vectorized GELU
    /// and softmax, no weight packing for short queries); on a GPU, candle's model.
    #[default]
    Native,
    /// candle-transformers' `BertModel` everywhere (the reference the native pass is tested
    /// against).
    Candle,
}

/// The forward pass in use.
enum Forward {
    Candle(BertModel),
    Cpu(CpuBert),
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

/// A BERT sentence embedder (see the crate docs).
pub struct BertEmbedder {
    model: Forward,
    tokenizer: tokenizers::Tokenizer,
    device: Device,
    pool: Option<rayon::ThreadPool>,
    pooling: Pooling,
    pad_id: u32,
    batch_size: usize,
    dimension: usize,
    max_tokens: usize,
    model_id: String,
    segment_calibration: Option<SegmentCalibration>,
}

impl BertEmbedder {
    /// Attaches the segmentation calibration fitted to these weights (the model manifest's
    /// `segment_calibration`).
    pub fn with_segment_calibration(mut self, calibration: Option<SegmentCalibration>) -> Self {
        self.segment_calibration = calibration;
        self
    }

    /// Loads `config.json`, `tokenizer.json`, `model.safetensors` and, when present,
    /// `1_Pooling/config.json` and `sentence_bert_config.json` from `dir`.
    pub fn load(dir: &Path, options: EmbedderOptions) -> Result<Self> {
        let config: BertConfig = read_json(&dir.join("config.json"))?;
        let pooling = match options.pooling {
            Some(p) => p,
            None => match dir.join("1_Pooling/config.json") {
                p if p.is_file() => {
                    let pc: PoolingConfig = read_json(&p)?;
                    match (pc.pooling_mode_cls_token, pc.pooling_mode_mean_tokens) {
                        (true, false) => Pooling::Cls,
                        (false, true) => Pooling::Mean,
                        _ => {
                            return Err(Error::Model(format!(
                                "{}: only mean or CLS pooling is supported",
                                p.display()
                            )));
                        }
                    }
                }
                _ => Pooling::Mean,
            },
        };
        let sbert = dir.join("sentence_bert_config.json");
        let configured_max = if sbert.is_file() {
            read_json::<SentenceBertConfig>(&sbert)?.max_seq_length
        } else {
            None
        };
        let max_tokens = options
            .max_tokens
            .or(configured_max)
            .unwrap_or(512)
            .min(config.max_position_embeddings);
        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"), max_tokens)?;
        let device = crate::runtime::candle_device(options.device)?;
        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(Error::Model(format!("{} is missing", weights.display())));
        }
        let native = options.engine == EmbedEngine::Native && matches!(device, Device::Cpu);
        let model = if native {
            let shape = BertShape {
                hidden: config.hidden_size,
                heads: config.num_attention_heads,
                layers: config.num_hidden_layers,
                intermediate: config.intermediate_size,
                max_positions: config.max_position_embeddings,
                type_vocab: config.type_vocab_size,
                eps: config.layer_norm_eps as f32,
                activation: match config.hidden_act {
                    HiddenAct::Gelu => Activation::Gelu,
                    HiddenAct::GeluApproximate => Activation::GeluTanh,
                    HiddenAct::Relu => Activation::Relu,
                },
            };
            let threads = match options.threads {
                0 => rayon::current_num_threads(),
                n => n,
            };
            Forward::Cpu(CpuBert::load(
                &weights,
                shape,
                config.model_type.as_deref(),
                threads,
            )?)
        } else {
            // SAFETY: the file is memory-mapped read-only; model files are not modified while
            // loaded.
            let vb =
                unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, &device) }
                    .map_err(model_err("cannot map model.safetensors"))?;
            Forward::Candle(
                BertModel::load(vb, &config).map_err(model_err("cannot load BERT weights"))?,
            )
        };
        let model_id = options.model_id.unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "bert".into())
        });
        Ok(BertEmbedder {
            model,
            tokenizer,
            device,
            pool: thread_pool(options.threads)?,
            pooling,
            pad_id: config.pad_token_id as u32,
            batch_size: if options.batch_size == 0 {
                32
            } else {
                options.batch_size
            },
            dimension: config.hidden_size,
            max_tokens,
            model_id,
            segment_calibration: None,
        })
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Tokens (specials included) kept per text; longer texts are truncated.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    fn embed_sorted(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Model(format!("tokenization failed: {e}")))?;
        // Longest first, so each batch pads to nearly its own length.
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(encodings[i].get_ids().len()));
        let mut out = vec![Vec::new(); texts.len()];
        for chunk in order.chunks(self.batch_size) {
            let batch: Vec<&tokenizers::Encoding> = chunk.iter().map(|&i| &encodings[i]).collect();
            let vectors = match &self.model {
                Forward::Cpu(model) => self.forward_native(model, &batch)?,
                Forward::Candle(model) => self
                    .forward(model, &batch)
                    .map_err(model_err("embedding forward pass"))?,
            };
            for (&i, v) in chunk.iter().zip(vectors) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// The native CPU forward pass: each text's hidden states pooled and normalized.
    fn forward_native(
        &self,
        model: &CpuBert,
        batch: &[&tokenizers::Encoding],
    ) -> Result<Vec<Vec<f32>>> {
        let texts: Vec<Tokens<'_>> = batch
            .iter()
            .map(|e| Tokens {
                ids: e.get_ids(),
                types: e.get_type_ids(),
            })
            .collect();
        let hidden = model.forward(&texts)?;
        let h = self.dimension;
        Ok(hidden
            .into_iter()
            .map(|states| {
                let rows = (states.len() / h).max(1);
                let mut v = match self.pooling {
                    Pooling::Cls => states[..h.min(states.len())].to_vec(),
                    Pooling::Mean => {
                        let mut sum = vec![0f32; h];
                        for row in states.chunks(h) {
                            for (s, x) in sum.iter_mut().zip(row) {
                                *s += x;
                            }
                        }
                        sum.iter_mut().for_each(|s| *s /= rows as f32);
                        sum
                    }
                };
                v.resize(h, 0.0);
                lycheemem_core::vector::normalize(&mut v);
                v
            })
            .collect())
    }

    fn forward(
        &self,
        model: &BertModel,
        batch: &[&tokenizers::Encoding],
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        let (ids, types, mask) = batch_tensors(batch, self.pad_id, &self.device)?;
        let hidden = model.forward(&ids, &types, Some(&mask))?;
        let pooled = match self.pooling {
            Pooling::Cls => hidden.i((.., 0))?,
            Pooling::Mean => {
                let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
                let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
                let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
                summed.broadcast_div(&counts)?
            }
        };
        let norms = pooled
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .clamp(1e-12, f64::INFINITY)?;
        pooled.broadcast_div(&norms)?.to_vec2::<f32>()
    }
}

impl Embedder for BertEmbedder {
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        crate::runtime::run_in(self.pool.as_ref(), || self.embed_sorted(texts))
    }

    fn dimension(&self) -> usize {
        self.dimension
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn segment_calibration(&self) -> Option<SegmentCalibration> {
        self.segment_calibration
    }
}
