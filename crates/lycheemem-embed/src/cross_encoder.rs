//! Cross-encoder rerankers: BERT and XLM-RoBERTa sequence-classification checkpoints scoring
//! `(query, passage)` pairs, as bge-reranker-base / bge-reranker-v2-m3 and ms-marco-MiniLM do.

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Linear, VarBuilder, linear};
use candle_transformers::models::bert::{BertModel, Config as BertConfig};
use candle_transformers::models::xlm_roberta::{
    Config as XlmRobertaConfig, XLMRobertaForSequenceClassification,
};
use lycheemem_core::{ComputeDevice, Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

use crate::Reranker;
use crate::runtime::{batch_tensors, load_tokenizer, model_err, read_json, thread_pool};

/// The checkpoint architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrossEncoderArch {
    /// `BertForSequenceClassification`: BERT, pooler (dense + tanh on `[CLS]`), linear classifier.
    Bert,
    /// `XLMRobertaForSequenceClassification`: XLM-R, head dense + tanh on `<s>`, out projection.
    XlmRoberta,
}

/// Load-time options; `Default` reads everything from the folder and runs on the `auto` device.
#[derive(Debug, Clone, Default)]
pub struct CrossEncoderOptions {
    /// Where the model runs (default `auto`).
    pub device: ComputeDevice,
    /// Inference threads; 0 = all cores.
    pub threads: usize,
    /// Pairs per forward pass; 0 = 16.
    pub batch_size: usize,
    /// Overrides the architecture read from `config.json` (`model_type`).
    pub arch: Option<CrossEncoderArch>,
    /// Tokens per pair (specials included); default `min(512, max_position_embeddings - 2)`.
    pub max_tokens: Option<usize>,
    pub model_id: Option<String>,
}

#[derive(Deserialize)]
struct HeadConfig {
    model_type: Option<String>,
    num_labels: Option<usize>,
    id2label: Option<BTreeMap<String, String>>,
    max_position_embeddings: usize,
    pad_token_id: Option<u32>,
}

enum Network {
    Bert {
        bert: BertModel,
        pooler: Linear,
        classifier: Linear,
    },
    XlmRoberta(XLMRobertaForSequenceClassification),
}

/// A cross-encoder reranker (see the module docs).
pub struct CrossEncoder {
    network: Network,
    arch: CrossEncoderArch,
    tokenizer: tokenizers::Tokenizer,
    device: Device,
    pool: Option<rayon::ThreadPool>,
    pad_id: u32,
    num_labels: usize,
    batch_size: usize,
    model_id: String,
}

impl CrossEncoder {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir`.
    pub fn load(dir: &Path, options: CrossEncoderOptions) -> Result<Self> {
        let config_path = dir.join("config.json");
        let head: HeadConfig = read_json(&config_path)?;
        let arch = match (options.arch, head.model_type.as_deref()) {
            (Some(a), _) => a,
            (None, Some("bert")) => CrossEncoderArch::Bert,
            (None, Some("xlm-roberta" | "roberta")) => CrossEncoderArch::XlmRoberta,
            (None, other) => {
                return Err(Error::Model(format!(
                    "{}: model_type {other:?} is not a supported cross-encoder (bert, xlm-roberta)",
                    config_path.display()
                )));
            }
        };
        // Transformers' rule: explicit num_labels, else the size of id2label, else 2.
        let num_labels = head
            .num_labels
            .or(head.id2label.as_ref().map(BTreeMap::len))
            .unwrap_or(2);
        let max_tokens = options
            .max_tokens
            .unwrap_or(512)
            .min(head.max_position_embeddings.saturating_sub(2))
            .max(8);
        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"), max_tokens)?;
        let device = crate::runtime::candle_device(options.device)?;
        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(Error::Model(format!("{} is missing", weights.display())));
        }
        // SAFETY: the file is memory-mapped read-only; model files are not modified while loaded.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, &device) }
            .map_err(model_err("cannot map model.safetensors"))?;
        let network = match arch {
            CrossEncoderArch::Bert => {
                let config: BertConfig = read_json(&config_path)?;
                let load = || -> candle_core::Result<Network> {
                    Ok(Network::Bert {
                        bert: BertModel::load(vb.pp("bert"), &config)?,
                        pooler: linear(
                            config.hidden_size,
                            config.hidden_size,
                            vb.pp("bert.pooler.dense"),
                        )?,
                        classifier: linear(config.hidden_size, num_labels, vb.pp("classifier"))?,
                    })
                };
                load().map_err(model_err("cannot load BERT cross-encoder weights"))?
            }
            CrossEncoderArch::XlmRoberta => {
                // transformers >= 5 no longer writes `position_embedding_type`; candle needs it.
                let mut raw: serde_json::Value = read_json(&config_path)?;
                if let Some(obj) = raw.as_object_mut() {
                    obj.entry("position_embedding_type")
                        .or_insert_with(|| "absolute".into());
                }
                let config: XlmRobertaConfig = serde_json::from_value(raw)
                    .map_err(|e| Error::Model(format!("{}: {e}", config_path.display())))?;
                Network::XlmRoberta(
                    XLMRobertaForSequenceClassification::new(num_labels, &config, vb)
                        .map_err(model_err("cannot load XLM-RoBERTa cross-encoder weights"))?,
                )
            }
        };
        let model_id = options.model_id.unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "cross-encoder".into())
        });
        Ok(CrossEncoder {
            network,
            arch,
            tokenizer,
            device,
            pool: thread_pool(options.threads)?,
            pad_id: head.pad_token_id.unwrap_or(0),
            num_labels,
            batch_size: if options.batch_size == 0 {
                16
            } else {
                options.batch_size
            },
            model_id,
        })
    }

    pub fn arch(&self) -> CrossEncoderArch {
        self.arch
    }

    pub fn num_labels(&self) -> usize {
        self.num_labels
    }

    /// Raw classifier logits, `num_labels` per pair.
    pub fn logits(&self, query: &str, passages: &[&str]) -> Result<Vec<Vec<f32>>> {
        if passages.is_empty() {
            return Ok(Vec::new());
        }
        crate::runtime::run_in(self.pool.as_ref(), || {
            let pairs: Vec<(String, String)> = passages
                .iter()
                .map(|p| (query.to_string(), p.to_string()))
                .collect();
            let encodings = self
                .tokenizer
                .encode_batch(pairs, true)
                .map_err(|e| Error::Model(format!("tokenization failed: {e}")))?;
            let mut order: Vec<usize> = (0..passages.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(encodings[i].get_ids().len()));
            let mut out = vec![Vec::new(); passages.len()];
            for chunk in order.chunks(self.batch_size) {
                let batch: Vec<&tokenizers::Encoding> =
                    chunk.iter().map(|&i| &encodings[i]).collect();
                let rows = self
                    .forward(&batch)
                    .map_err(model_err("cross-encoder forward pass"))?;
                for (&i, row) in chunk.iter().zip(rows) {
                    out[i] = row;
                }
            }
            Ok(out)
        })
    }

    fn forward(&self, batch: &[&tokenizers::Encoding]) -> candle_core::Result<Vec<Vec<f32>>> {
        let (ids, types, mask) = batch_tensors(batch, self.pad_id, &self.device)?;
        let logits: Tensor = match &self.network {
            Network::Bert {
                bert,
                pooler,
                classifier,
            } => {
                let hidden = bert.forward(&ids, &types, Some(&mask))?;
                let pooled = pooler.forward(&hidden.i((.., 0))?.contiguous()?)?.tanh()?;
                classifier.forward(&pooled)?
            }
            Network::XlmRoberta(model) => model.forward(&ids, &mask, &types)?,
        };
        logits.to_vec2::<f32>()
    }
}

impl Reranker for CrossEncoder {
    /// The single logit for one-label rerankers (bge-reranker, ms-marco); for multi-label
    /// checkpoints the last label's logit (the "relevant" class by convention).
    fn score(&self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        Ok(self
            .logits(query, passages)?
            .into_iter()
            .map(|row| row.last().copied().unwrap_or(f32::NAN))
            .collect())
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }
}
