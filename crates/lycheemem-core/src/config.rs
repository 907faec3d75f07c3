//! The typed configuration: every constant of the LycheeMemory V2 algorithm (docs/algorithm.md)
//! with the paper's value as the default, plus [`Config::reference_code`], the preset with the
//! values of the authors' public implementation where it differs from the paper.
//!
//! Configs are read from TOML. Every section and field is optional (missing ones take the
//! default) and unknown keys are rejected, so a typo never silently falls back to a default.
//!
//! ```
//! use lycheemem_core::Config;
//! let cfg = Config::from_toml_str("[segment]\ncut_threshold = 0.6\n").unwrap();
//! assert_eq!(cfg.segment.cut_threshold, 0.6);
//! assert_eq!(cfg.segment.target_tokens, 600);
//! assert!(Config::from_toml_str("[segment]\ncut_treshold = 0.6\n").is_err());
//! ```

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::error::{Error, Result};
use crate::plan::QuestionType;

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub models: ModelsConfig,
    pub segment: SegmentConfig,
    pub encode: EncodeConfig,
    pub organize: OrganizeConfig,
    pub store: StoreConfig,
    pub retrieval: RetrievalConfig,
    pub answer: AnswerConfig,
    /// Which memory design builds and searches the memory (`strategy = "lycheemem"` or
    /// `"licomemory"`). Both share the models, the store and every command; a namespace is
    /// built by one of them (docs/licomemory.md).
    pub strategy: MemoryStrategy,
    /// LiCoMemory (CogniGraph): every constant of its write and read paths, as the authors'
    /// public code sets them (docs/licomemory.md). Read only with `strategy = "licomemory"`.
    pub licomemory: LicoMemoryConfig,
}

/// The memory designs the engine runs (`strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryStrategy {
    /// LycheeMemory V2: semantic segments, one encoder call per segment, planned multi-route
    /// retrieval (docs/algorithm.md).
    #[default]
    Lycheemem,
    /// LiCoMemory: per-chunk session summaries and entity-relation triples, CogniRank
    /// retrieval (docs/licomemory.md).
    Licomemory,
}

impl MemoryStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryStrategy::Lycheemem => "lycheemem",
            MemoryStrategy::Licomemory => "licomemory",
        }
    }
}

/// How LiCoMemory keeps its session summaries (`licomemory.summary`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LicoSummaryMode {
    /// The paper: created by a session's first chunk and updated by every later chunk (one
    /// call per chunk).
    #[default]
    PerChunk,
    /// The authors' shipped batch mode: one call summarizing the whole session when it is
    /// flushed.
    PerSession,
    /// No summaries (the `licomemory_no_summary` ablation): session relevance is the floor.
    Off,
}

/// LiCoMemory's constants (docs/licomemory.md; SPEC-licomemory §4). Defaults follow the paper's
/// method with the authors' code constants: per-chunk summaries, CogniRank on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LicoMemoryConfig {
    pub summary: LicoSummaryMode,
    /// Keys a new summary may have (one of them the session date).
    pub summary_max_keys: usize,
    /// The summary length the prompt asks for, in words (low, high).
    pub summary_words: (u32, u32),
    /// `per_session` summaries: the session text shown to the call keeps this many characters
    /// from its head and from its tail.
    pub summary_session_chars: usize,
    /// Output budget of every LiCoMemory LLM call (authors: 1000).
    pub max_output_tokens: u32,
    /// Most entities and most relations one extraction call may return, and most themes a
    /// summary may hold: bounds of the JSON schemas (the authors' text format has none) that
    /// keep a reply inside `max_output_tokens`.
    pub max_entities_per_chunk: usize,
    pub max_relations_per_chunk: usize,
    pub max_themes: usize,
    /// Most entities one question may name.
    pub max_query_entities: usize,
    /// Temperature of the summary, extraction and query-entity calls (authors: 0.1).
    pub temperature: f32,
    /// Entities of one type whose lowercased word sets have Jaccard similarity at least this
    /// are one entity (authors: 0.85).
    pub entity_merge_jaccard: f64,
    /// Anchor entities kept per question (`top_k`; authors' YAML 5).
    pub anchor_entities: usize,
    /// Nearest entities fetched per query entity before the anchor score is applied.
    pub anchor_candidates: usize,
    /// Anchor score `cosine_weight · cos + type_weight · [same type]` (authors: 0.7 / 0.3).
    pub entity_cosine_weight: f32,
    pub entity_type_weight: f32,
    /// Pool pre-score bonus `rank_bonus · max(1/(r_src+1), 1/(r_tgt+1))` (authors: 0.2); an
    /// end that is not an anchor has rank `anchor_entities`.
    pub rank_bonus: f32,
    /// Candidate pool size `max(pool_factor · top_triples, pool_min)` (authors: 2, 20).
    pub pool_factor: usize,
    pub pool_min: usize,
    /// Session relevance: mean of this many best query-entity × key cosines (authors: 3).
    pub session_key_top: usize,
    /// Without query entities, the question's words of at least this many letters stand in.
    pub query_word_min_len: usize,
    /// Session summaries put in the answer prompt (authors' YAML 1).
    pub top_summaries: usize,
    /// `S_sem = summary_weight · Ss + (1 − summary_weight) · St` (authors' YAML 0.2).
    pub summary_weight: f32,
    /// CogniRank: a session relevance of 0 (or none) counts as this (authors: 0.01).
    pub session_score_floor: f32,
    /// CogniRank (the paper: `S_sem` times a Weibull decay of the gap between the question's
    /// and the triple's dates); off = the authors' shipped SimpleRank `(1 − w)·St + w·Ss`.
    pub cogni_rank: bool,
    /// CogniRank's Weibull decay; off = `S_sem` alone (the `licomemory_no_decay` ablation).
    pub temporal_decay: bool,
    /// Weibull shape `k` of the decay `exp(-(Δτ/τ̂)^k)` (authors' YAML 0.1); the scale τ̂ is
    /// the median gap over the pool, at least `decay_scale_floor_days`.
    pub weibull_shape: f64,
    pub decay_scale_floor_days: f64,
    /// Triples kept after reranking and shown to the answerer (authors' YAML 20).
    pub top_triples: usize,
    /// Chunks collected from the ranked triples (authors' YAML 15).
    pub top_chunks: usize,
    /// Chunks are shown with their session date (`enable_sessiontime`).
    pub chunk_session_date: bool,
    /// Chunks are shown whole; off = only the user's turns (`enable_full`).
    pub chunk_full: bool,
}

impl Default for LicoMemoryConfig {
    fn default() -> Self {
        LicoMemoryConfig {
            summary: LicoSummaryMode::PerChunk,
            summary_max_keys: 5,
            summary_words: (150, 220),
            summary_session_chars: 6000,
            max_output_tokens: 1000,
            max_entities_per_chunk: 16,
            max_relations_per_chunk: 16,
            max_themes: 12,
            max_query_entities: 8,
            temperature: 0.1,
            entity_merge_jaccard: 0.85,
            anchor_entities: 5,
            anchor_candidates: 64,
            entity_cosine_weight: 0.7,
            entity_type_weight: 0.3,
            rank_bonus: 0.2,
            pool_factor: 2,
            pool_min: 20,
            session_key_top: 3,
            query_word_min_len: 3,
            top_summaries: 1,
            summary_weight: 0.2,
            session_score_floor: 0.01,
            cogni_rank: true,
            temporal_decay: true,
            weibull_shape: 0.1,
            decay_scale_floor_days: 1.0,
            top_triples: 20,
            top_chunks: 15,
            chunk_session_date: true,
            chunk_full: true,
        }
    }
}

impl LicoMemoryConfig {
    /// The authors' shipped settings: SimpleRank (CogniRank off) and one summary per whole
    /// session (the `licomemory_simple` variant).
    pub fn authors_shipped() -> LicoMemoryConfig {
        LicoMemoryConfig {
            summary: LicoSummaryMode::PerSession,
            cogni_rank: false,
            ..LicoMemoryConfig::default()
        }
    }

    /// The candidate pool size: `max(pool_factor · top_triples, pool_min)`.
    pub fn pool_size(&self) -> usize {
        (self.pool_factor * self.top_triples).max(self.pool_min)
    }
}

impl Config {
    /// The paper's constants: `Config::default()` with the SPEC's selection rules
    /// ([`RetrievalConfig::use_spec_selection`]) in place of lycheemem's.
    pub fn paper() -> Config {
        let mut cfg = Config::default();
        cfg.retrieval.use_spec_selection();
        cfg.use_spec_write();
        cfg
    }

    /// The published write path where the default departs from it: segmentation constants as
    /// published (not calibrated to the embedder) and 12 earlier records in ρ.
    pub fn use_spec_write(&mut self) {
        self.segment.surprise_calibration = CalibrationSource::Published;
        self.encode.reference_records = 12;
    }

    /// The values of the authors' public reference implementation where they differ from the
    /// paper: 1000/1500/2000 segment tokens, cut threshold 0.55, no exchange cap, surprise
    /// against the centroid of the last 2 exchanges, memory type appended to tags.
    pub fn reference_code() -> Config {
        let mut cfg = Config::paper();
        cfg.segment.min_tokens = 1000;
        cfg.segment.target_tokens = 1500;
        cfg.segment.max_tokens = 2000;
        cfg.segment.cut_threshold = 0.55;
        cfg.segment.max_exchanges = 0;
        cfg.segment.previous_window = 2;
        cfg.organize.memory_type_as_tag = true;
        cfg
    }

    /// A named preset: `paper` or `reference_code`.
    pub fn preset(name: &str) -> Result<Config> {
        match name {
            "paper" => Ok(Config::paper()),
            "reference_code" => Ok(Config::reference_code()),
            other => Err(Error::Config(format!(
                "unknown preset {other:?} (expected paper or reference_code)"
            ))),
        }
    }

    /// Parses TOML, then validates.
    pub fn from_toml_str(text: &str) -> Result<Config> {
        let cfg: Config = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a TOML file.
    pub fn from_toml_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Config::from_toml_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    pub fn to_toml_string(&self) -> String {
        toml::to_string_pretty(self).expect("config serializes")
    }

    /// Checks cross-field invariants a typo-free file can still violate.
    pub fn validate(&self) -> Result<()> {
        let s = &self.segment;
        if !(s.min_tokens > 0 && s.min_tokens <= s.target_tokens && s.target_tokens <= s.max_tokens)
        {
            return Err(Error::Config(format!(
                "segment tokens must satisfy 0 < min ({}) <= target ({}) <= max ({})",
                s.min_tokens, s.target_tokens, s.max_tokens
            )));
        }
        if !(0.0..=1.0).contains(&s.cut_threshold) {
            return Err(Error::Config(format!(
                "segment.cut_threshold {} is not in [0, 1]",
                s.cut_threshold
            )));
        }
        if s.previous_window == 0 || s.surprise_history == 0 {
            return Err(Error::Config(
                "segment.previous_window and segment.surprise_history must be >= 1".into(),
            ));
        }
        if [s.abs_surprise_scale, s.cohesion_scale, s.z_mad_scale]
            .iter()
            .any(|v| !v.is_finite() || *v <= 0.0)
        {
            return Err(Error::Config(
                "segment.abs_surprise_scale, segment.cohesion_scale and segment.z_mad_scale must be > 0"
                    .into(),
            ));
        }
        if self.encode.reference_note_chars > self.encode.reference_context_chars {
            return Err(Error::Config(
                "encode.reference_note_chars must not exceed encode.reference_context_chars".into(),
            ));
        }
        let l = &self.licomemory;
        if !(0.0..=1.0).contains(&l.entity_merge_jaccard)
            || !(0.0..=1.0).contains(&l.summary_weight)
            || l.weibull_shape.is_nan()
            || l.weibull_shape <= 0.0
            || l.decay_scale_floor_days.is_nan()
            || l.decay_scale_floor_days <= 0.0
            || l.anchor_entities == 0
            || l.top_triples == 0
            || l.top_chunks == 0
            || l.session_key_top == 0
        {
            return Err(Error::Config(
                "licomemory: entity_merge_jaccard and summary_weight must lie in [0, 1], \
                 weibull_shape and decay_scale_floor_days must be positive, and \
                 anchor_entities, top_triples, top_chunks and session_key_top at least 1"
                    .into(),
            ));
        }
        let r = &self.retrieval;
        if r.min_top_k == 0 || r.rrf_kappa <= 0.0 {
            return Err(Error::Config(
                "retrieval.min_top_k and retrieval.rrf_kappa must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Which model serves which purpose. Names are entries of `models/manifest.toml`, a local
/// directory (`dir:<path>`) or, for LLMs, `openai:<model>@<base_url>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsConfig {
    /// Where fetched model files live.
    pub dir: String,
    /// Sentence embedder (BERT family).
    pub embedder: String,
    /// Cross-encoder reranker; empty = no reranking (no reranker weights are available offline).
    pub reranker: String,
    /// LLM used to encode segments into records.
    pub encode_llm: String,
    /// LLM used by the query planner.
    pub plan_llm: String,
    /// LLM used to answer questions.
    pub answer_llm: String,
    /// Threads for model inference; 0 = all cores.
    pub threads: usize,
    /// Texts per embedding batch.
    pub embed_batch_size: usize,
    /// Local LLMs: most concurrent calls decoded together (continuous batching); 0 = the
    /// backend's default (8), 1 = one call at a time.
    pub llm_batch: usize,
    /// Where the embedder, the reranker and local LLMs run: `auto` (the first CUDA GPU when
    /// the binary was built with the `cuda` feature and one is present, else the CPU), `cpu`,
    /// `cuda` or `cuda:N`.
    pub device: ComputeDevice,
    /// How local LLMs hold their weight matrices: `quantized` (as in the GGUF; least memory),
    /// `f16` or `f32` (dequantized once at load: 3-8x the memory; dense matrix products).
    pub llm_weights: LlmWeights,
    /// Local LLMs: what happens to tokens a JSON schema forces (keys, separators, the rest of
    /// an enum value): `fast_forward` feeds them in one pass with the token sampled before them
    /// instead of one decoding step each (the same text; its tokenization is the canonical one,
    /// so a later sampled token can differ from step-by-step decoding), `decode` steps them.
    pub llm_forced_tokens: ForcedTokens,
}

/// What a local LLM does with tokens a JSON schema forces (`models.llm_forced_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForcedTokens {
    /// Fed together, in one forward pass, right after the sampled token that precedes them.
    #[default]
    FastForward,
    /// One decoding step each, sampled from a mask that allows only them.
    Decode,
}

/// How a local LLM holds its weight matrices (`models.llm_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmWeights {
    /// As stored in the GGUF file, multiplied by candle's quantized kernels.
    #[default]
    Quantized,
    /// Dequantized to f16 at load time.
    F16,
    /// Dequantized to f32 at load time (the exact reference for the quantized kernels).
    F32,
}

/// Where model inference runs (`models.device`, `--device`). Written `auto`, `cpu`, `cuda`
/// (= `cuda:0`) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    /// The first CUDA GPU if this binary has CUDA support and one answers, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for ComputeDevice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let ordinal = |n: &str| {
            n.parse::<usize>().map_err(|_| {
                Error::Config(format!("device {s:?}: the CUDA ordinal must be a number"))
            })
        };
        match t.as_str() {
            "auto" => Ok(ComputeDevice::Auto),
            "cpu" => Ok(ComputeDevice::Cpu),
            "cuda" | "gpu" => Ok(ComputeDevice::Cuda(0)),
            _ => match t.strip_prefix("cuda:") {
                Some(n) => Ok(ComputeDevice::Cuda(ordinal(n)?)),
                None => Err(Error::Config(format!(
                    "device {s:?}: expected auto, cpu, cuda or cuda:N"
                ))),
            },
        }
    }
}

impl std::fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ComputeDevice::Auto => f.write_str("auto"),
            ComputeDevice::Cpu => f.write_str("cpu"),
            ComputeDevice::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Serialize for ComputeDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ComputeDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            dir: "models".into(),
            embedder: "all-minilm-l6-v2".into(),
            reranker: String::new(),
            encode_llm: "local:qwen2.5-coder-0.5b-instruct".into(),
            plan_llm: "local:qwen2.5-coder-0.5b-instruct".into(),
            answer_llm: "local:qwen2.5-coder-0.5b-instruct".into(),
            threads: 0,
            embed_batch_size: 32,
            llm_batch: 0,
            device: ComputeDevice::Auto,
            llm_weights: LlmWeights::Quantized,
            llm_forced_tokens: ForcedTokens::FastForward,
        }
    }
}

/// Segmentation policy (docs/algorithm.md, "Order of decisions": the method and its ablations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentPolicy {
    /// Online semantic segmentation (the method).
    Semantic,
    /// Every exchange is its own segment ("eager" per-turn memory).
    PerExchange,
    /// Target-length windows with an exchange cap and no semantic signal.
    FixedWindow,
}

/// Online semantic segmentation (docs/algorithm.md, "Segmentation").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SegmentConfig {
    pub policy: SegmentPolicy,
    /// Length-pressure lower anchor (tokens). Paper 300; reference code 1000.
    pub min_tokens: u32,
    /// Finalize once a segment reaches this many tokens. Paper 600; reference code 1500.
    pub target_tokens: u32,
    /// Never exceed this many tokens. Paper 900; reference code 2000.
    pub max_tokens: u32,
    /// Finalize once a segment holds this many exchanges; 0 = no cap. Paper 10; reference
    /// code: no cap. (A number rather than an `Option` so TOML can express "no cap".)
    pub max_exchanges: u32,
    /// Cut when `P_cut >= cut_threshold`. Paper 0.50; reference code 0.55.
    pub cut_threshold: f64,
    /// Surprise compares against the centroid of the last `previous_window` exchanges.
    /// Paper 1 (the last exchange); reference code 2.
    pub previous_window: usize,
    /// Size of the ring of past surprise values kept per session.
    pub surprise_history: usize,
    /// Text embedded per exchange keeps this many chars from the head and from the tail.
    pub embed_head_tail_chars: usize,
    /// Absolute surprise signal `clip((s - center) / scale, lo, hi)`.
    pub abs_surprise_center: f64,
    pub abs_surprise_scale: f64,
    pub abs_surprise_clip: (f64, f64),
    /// Cohesion signal `min(cap, drop / scale)`.
    pub cohesion_scale: f64,
    pub cohesion_cap: f64,
    /// Robust z needs at least this much history; otherwise z = 0.
    pub z_min_history: usize,
    /// MAD consistency constant.
    pub z_mad_scale: f64,
    /// MAD of 0 is replaced by this.
    pub z_mad_floor: f64,
    pub z_clip: (f64, f64),
    /// Weight of `max(abs, z_factor * z)`.
    pub w_surprise: f64,
    pub z_factor: f64,
    pub w_cohesion: f64,
    pub w_length: f64,
    pub w_turns: f64,
    /// `P_cut = sigmoid(bias + score)`.
    pub bias: f64,
    /// Length pressure: below `short_fraction * min` tokens.
    pub length_short_fraction: f64,
    pub length_very_short: f64,
    /// Linear from `length_short.0` at `short_fraction*min` to `length_short.1` at `min`.
    pub length_short: (f64, f64),
    /// Linear on `min..target`.
    pub length_mid: (f64, f64),
    /// Linear on `target..max`.
    pub length_long: (f64, f64),
    /// At or above max.
    pub length_over: f64,
    /// Turn pressure for n <= 1, n = 2, n = 3.
    pub turns_one: f64,
    pub turns_two: f64,
    pub turns_three: f64,
    /// n >= 4: `min(turns_cap, turns_base + turns_step*(n-4))`.
    pub turns_base: f64,
    pub turns_step: f64,
    pub turns_cap: f64,
    /// Where `abs_surprise_center`, `abs_surprise_scale` and `cohesion_scale` come from:
    /// `published` uses the values above; `embedder` (the default) replaces them by the
    /// embedder's fitted calibration (`lycheemem models calibrate`, stored with its manifest
    /// entry) when it has one, and uses the values above when it has none (docs/algorithm.md,
    /// "Calibration to the embedder").
    pub surprise_calibration: CalibrationSource,
}

/// Where the similarity-scaled segmentation constants come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CalibrationSource {
    /// The constants as configured (SPEC §1's by default).
    Published,
    /// The embedder's fitted calibration, when its manifest entry carries one.
    Embedder,
}

/// An embedder's fitted surprise statistics (see `lycheemem_segment::calibration`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SegmentCalibration {
    /// Replaces `abs_surprise_center`: the median surprise against the previous exchanges.
    pub surprise_center: f64,
    /// Replaces `abs_surprise_scale`: the surprise's robust spread (1.4826 · MAD).
    pub surprise_scale: f64,
    /// Replaces `cohesion_scale`.
    pub cohesion_scale: f64,
}

impl SegmentCalibration {
    /// Whether every value is finite and positive (a calibration read from a file may not be).
    pub fn is_valid(&self) -> bool {
        [
            self.surprise_center,
            self.surprise_scale,
            self.cohesion_scale,
        ]
        .iter()
        .all(|v| v.is_finite() && *v > 0.0)
    }
}

impl SegmentConfig {
    /// The constants as the segmenter will use them: with `surprise_calibration = "embedder"`
    /// and a valid `calibration`, its values replace the three similarity-scaled constants.
    /// The result always says `published` (its values are explicit), so two configs that
    /// segment alike compare and hash alike.
    pub fn resolved(&self, calibration: Option<&SegmentCalibration>) -> SegmentConfig {
        let mut cfg = self.clone();
        if cfg.surprise_calibration == CalibrationSource::Embedder
            && let Some(c) = calibration.filter(|c| c.is_valid())
        {
            cfg.abs_surprise_center = c.surprise_center;
            cfg.abs_surprise_scale = c.surprise_scale;
            cfg.cohesion_scale = c.cohesion_scale;
        }
        cfg.surprise_calibration = CalibrationSource::Published;
        cfg
    }
}

impl Default for SegmentConfig {
    fn default() -> Self {
        SegmentConfig {
            policy: SegmentPolicy::Semantic,
            min_tokens: 300,
            target_tokens: 600,
            max_tokens: 900,
            max_exchanges: 10,
            cut_threshold: 0.50,
            previous_window: 1,
            surprise_history: 64,
            embed_head_tail_chars: 2000,
            abs_surprise_center: 0.20,
            abs_surprise_scale: 0.14,
            abs_surprise_clip: (-1.0, 2.5),
            cohesion_scale: 0.06,
            cohesion_cap: 2.5,
            z_min_history: 5,
            z_mad_scale: 1.4826,
            z_mad_floor: 1e-6,
            z_clip: (-2.0, 4.0),
            w_surprise: 0.65,
            z_factor: 0.45,
            w_cohesion: 0.45,
            w_length: 0.90,
            w_turns: 0.30,
            bias: -1.10,
            length_short_fraction: 0.7,
            length_very_short: -1.30,
            length_short: (-0.80, 0.00),
            length_mid: (0.45, 1.90),
            length_long: (1.90, 2.80),
            length_over: 3.00,
            turns_one: -0.85,
            turns_two: -0.15,
            turns_three: 0.15,
            turns_base: 0.30,
            turns_step: 0.15,
            turns_cap: 1.0,
            surprise_calibration: CalibrationSource::Embedder,
        }
    }
}

/// Record style produced by the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordStyle {
    /// Typed atomic records (the method).
    Typed,
    /// Ablation: one untyped summary record per segment.
    SummaryRecords,
}

/// Segment encoding (docs/algorithm.md, "Encoding").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EncodeConfig {
    pub record_style: RecordStyle,
    /// Feed the reference context ρ to the encoder (off = `no_cross_segment_context` ablation).
    pub cross_segment_context: bool,
    /// Budget for the previous disambiguation note inside ρ.
    pub reference_note_chars: usize,
    /// Budget for the whole ρ.
    pub reference_context_chars: usize,
    /// Number of most recent record texts of the session included in ρ. The published method
    /// shows 12 (`Config::paper()`); the default shows none, only the disambiguation note:
    /// measured on a held-out conversation, 0.84x the construction tokens at the same evidence
    /// recall (docs/algorithm.md, "Departures on the write path").
    pub reference_records: usize,
    /// Repair retries after malformed output before giving up on a segment.
    pub repair_retries: u32,
    /// Completion budget for one encoder call: `output_tokens_base + output_tokens_per_turn ×
    /// turns`, capped at `max_output_tokens` (short segments need little; long ones need room
    /// so the JSON is not cut off).
    pub output_tokens_base: u32,
    pub output_tokens_per_turn: u32,
    pub max_output_tokens: u32,
    /// Each turn's text in the encoder prompt keeps at most this many chars (head and tail).
    pub turn_chars: usize,
    /// Most records one segment may produce (bounds the constrained output) ...
    pub max_records: usize,
    /// ... and at most this many per turn of the segment (small models otherwise keep
    /// inventing records until the token budget truncates the JSON).
    pub max_records_per_turn: usize,
    /// Repetition penalty for local encoder calls (small models otherwise loop inside strings).
    pub repeat_penalty: f32,
}

impl Default for EncodeConfig {
    fn default() -> Self {
        EncodeConfig {
            record_style: RecordStyle::Typed,
            cross_segment_context: true,
            reference_note_chars: 1200,
            reference_context_chars: 2400,
            reference_records: 0,
            repair_retries: 1,
            output_tokens_base: 256,
            output_tokens_per_turn: 192,
            max_output_tokens: 2048,
            turn_chars: 4000,
            max_records: 24,
            max_records_per_turn: 3,
            repeat_penalty: 1.1,
        }
    }
}

/// Structured evidence organization (docs/algorithm.md, "Evidence nodes").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrganizeConfig {
    /// Append the memory type to each record's tags (reference code: on; paper: off).
    pub memory_type_as_tag: bool,
    /// Cap on a node's searchable text.
    pub node_text_chars: usize,
}

impl Default for OrganizeConfig {
    fn default() -> Self {
        OrganizeConfig {
            memory_type_as_tag: false,
            node_text_chars: 2000,
        }
    }
}

/// Element type of the approximate vector indexes (the truth in redb is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VectorPrecision {
    F32,
    F16,
}

/// Storage and index tuning (not part of the algorithm; no SPEC constant lives here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Element type of the HNSW vector indexes.
    pub vector_precision: VectorPrecision,
    /// HNSW graph degree (usearch `connectivity`).
    pub hnsw_connectivity: usize,
    /// HNSW beam width while inserting.
    pub hnsw_expansion_add: usize,
    /// HNSW beam width while searching.
    pub hnsw_expansion_search: usize,
    /// A vector search over at most this many vectors (a namespace's of one target, or a
    /// filter's allowed set) is answered exactly instead of through the HNSW index.
    pub exact_search_below: usize,
    /// Memory for evidence nodes kept resolved between searches (embedded store): each node
    /// of at least 64 records that node expansion touches keeps its members' vectors packed in
    /// one matrix, searched exactly, until the next write. Past this many MiB the least
    /// recently used nodes leave.
    pub node_cache_mb: usize,
    /// Persist the derived indexes (and trim the change log) after this many changes, or after
    /// a quarter of the indexed vectors when that is more.
    pub checkpoint_every: u64,
    /// PostgreSQL backend (a `postgresql://` store location): the schema holding the store.
    pub postgres_schema: String,
    /// PostgreSQL backend: connections each process keeps in its pool.
    pub postgres_pool_size: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            vector_precision: VectorPrecision::F32,
            hnsw_connectivity: 16,
            hnsw_expansion_add: 128,
            hnsw_expansion_search: 64,
            exact_search_below: 2048,
            node_cache_mb: 256,
            checkpoint_every: 10_000,
            postgres_schema: "lycheemem".into(),
            postgres_pool_size: 8,
        }
    }
}

/// Per-question-type retrieval multipliers and bonuses (docs/algorithm.md, "Recall budgets and
/// question types").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypeProfile {
    pub m_node: f64,
    pub m_rec: f64,
    pub m_turn: f64,
    /// Raw-turn score multiplier.
    pub raw_mult: f64,
    pub assistant_bonus: f64,
    pub user_bonus: f64,
    /// Source window: turns on each side of an anchor's evidence turns.
    pub window: u32,
    /// Raw-turn share of k and the score ratio against the best record (reference-code values;
    /// used when `RetrievalConfig::per_type_limiter` is on).
    pub raw_ratio: f64,
    pub raw_score_ratio: f64,
}

/// The per-type table (docs/algorithm.md, "Recall budgets and question types"), one profile per
/// question type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TypeProfiles {
    pub single: TypeProfile,
    pub other: TypeProfile,
    pub prior_assistant_response: TypeProfile,
    pub personalized_advice: TypeProfile,
    pub aggregate: TypeProfile,
    pub temporal: TypeProfile,
    pub comparison: TypeProfile,
}

impl TypeProfiles {
    pub fn get(&self, t: QuestionType) -> &TypeProfile {
        match t {
            QuestionType::Single => &self.single,
            QuestionType::Other => &self.other,
            QuestionType::PriorAssistantResponse => &self.prior_assistant_response,
            QuestionType::PersonalizedAdvice => &self.personalized_advice,
            QuestionType::Aggregate => &self.aggregate,
            QuestionType::Temporal => &self.temporal,
            QuestionType::Comparison => &self.comparison,
        }
    }
}

impl Default for TypeProfiles {
    fn default() -> Self {
        #[allow(clippy::too_many_arguments)]
        fn p(
            m_node: f64,
            m_rec: f64,
            m_turn: f64,
            raw_mult: f64,
            a: f64,
            u: f64,
            window: u32,
            rr: f64,
            rs: f64,
        ) -> TypeProfile {
            TypeProfile {
                m_node,
                m_rec,
                m_turn,
                raw_mult,
                assistant_bonus: a,
                user_bonus: u,
                window,
                raw_ratio: rr,
                raw_score_ratio: rs,
            }
        }
        TypeProfiles {
            single: p(1.00, 1.00, 1.00, 1.00, 0.0, 0.0, 1, 0.40, 0.72),
            other: p(1.00, 1.00, 1.00, 1.00, 0.0, 0.0, 1, 0.40, 0.72),
            prior_assistant_response: p(0.95, 0.95, 3.00, 1.22, 0.18, 0.04, 4, 0.62, 0.52),
            personalized_advice: p(1.25, 1.20, 1.80, 1.05, 0.04, 0.08, 3, 0.48, 0.62),
            aggregate: p(1.55, 1.45, 0.90, 1.00, 0.0, 0.0, 1, 0.40, 0.70),
            temporal: p(1.35, 1.30, 1.45, 1.00, 0.0, 0.0, 2, 0.42, 0.64),
            comparison: p(1.35, 1.30, 1.30, 1.00, 0.0, 0.0, 2, 0.40, 0.66),
        }
    }
}

/// Weights of the MMR similarity between two candidates (docs/algorithm.md, "Read path:
/// selection").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimilarityWeights {
    pub same_session: f64,
    pub entities: f64,
    pub variants: f64,
    pub nodes: f64,
    pub turns: f64,
    pub words: f64,
}

impl Default for SimilarityWeights {
    fn default() -> Self {
        SimilarityWeights {
            same_session: 0.15,
            entities: 0.20,
            variants: 0.15,
            nodes: 0.15,
            turns: 0.10,
            words: 0.25,
        }
    }
}

/// Plan-guided multi-route retrieval (docs/algorithm.md, "Read path"), including its ablation
/// switches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrievalConfig {
    /// k = max(requested, min_top_k).
    pub min_top_k: usize,
    /// One planner LLM call per question (off = `no_planner` ablation).
    pub planner: bool,
    /// Cross-check the planner's question type against the question's wording (a specialized
    /// type needs a cue in the question; docs/algorithm.md, "Planning").
    pub question_type_cues: bool,
    pub planner_context_chars: usize,
    pub max_queries: usize,
    pub max_routes: usize,
    pub max_queries_per_route: usize,
    pub max_constraints: usize,
    /// Query variants per route.
    pub max_variants: usize,
    /// The planner's route queries (the variants after the question and the route's goal) only
    /// widen recall: a candidate's channel score and similarity `r` are measured against the
    /// question and the goal, and a candidate only those queries found is scored as the record or
    /// raw-turn channel would score it for them. Off = the SPEC's rule (each candidate keeps its
    /// best score over every variant); docs/algorithm.md, "Routes and channels".
    pub planner_queries_recall_only: bool,
    /// Channel switches. `record_vector_only` = only `records`.
    pub channel_temporal: bool,
    pub channel_nodes: bool,
    pub channel_records: bool,
    pub channel_turns: bool,
    /// BM25 over records and turns (beyond the paper).
    pub channel_lexical: bool,
    /// Recall budgets: node and record recall `max(recall_factor*k, recall_floor) * m`.
    pub recall_factor: usize,
    pub recall_floor: usize,
    /// Raw-turn recall `max(k, turn_recall_floor) * m_turn`.
    pub turn_recall_floor: usize,
    /// Temporal recall `max(temporal_factor*k, temporal_floor)` record links (docs/algorithm.md,
    /// read-path departure 3).
    pub temporal_factor: usize,
    pub temporal_floor: usize,
    /// Rerank pool `max(rerank_floor, rerank_factor*k)`.
    pub rerank_floor: usize,
    pub rerank_factor: usize,
    /// Cross-encoder rerank of the route pool (needs a reranker model; off = `no_rerank`).
    pub rerank: bool,
    pub types: TypeProfiles,
    /// Temporal node scores.
    pub temporal_day_score: f64,
    pub temporal_month_score: f64,
    /// Evidence-node weights per kind.
    pub node_weight_entity: f64,
    pub node_weight_topic: f64,
    pub node_weight_entity_topic: f64,
    pub node_weight_event_frame: f64,
    pub node_weight_temporal: f64,
    /// Record field score `record_base + record_scale * r`.
    pub record_base: f64,
    pub record_scale: f64,
    /// Raw-turn field score `(turn_base + turn_scale * r) * raw_mult + role bonus`.
    pub turn_base: f64,
    pub turn_scale: f64,
    /// Lexical field score `lexical_base + lexical_scale * bm25/max_bm25`.
    pub lexical_base: f64,
    pub lexical_scale: f64,
    /// Type bonuses.
    pub bonus_prior_assistant: f64,
    pub bonus_personalized: f64,
    pub bonus_temporal_fields: f64,
    pub bonus_aggregate_event: f64,
    /// Temporal boost when the record's time overlaps the filter, else when its session does.
    pub temporal_boost_record: f64,
    pub temporal_boost_session: f64,
    /// Anchors whose evidence turns get source windows.
    pub window_anchors: usize,
    /// A raw-turn hit (raw-turn or lexical channel) is shown with this many turns of its session
    /// before it and after it: in dialogue the turn that matches a question's wording is often
    /// itself a question, and the answer is the reply that follows it (docs/algorithm.md,
    /// read-path departure 9).
    pub raw_turn_context_before: u32,
    pub raw_turn_context_after: u32,
    /// Route-local score `field + r_weight*r + min(variant_cap, variant_step*#variants)` (the
    /// published `source_weight` is taken as 1: docs/algorithm.md, read-path departure 10).
    pub route_r_weight: f64,
    pub route_variant_step: f64,
    pub route_variant_cap: f64,
    /// Fusion across routes (off = `no_fusion`: sort by raw field score, cut to k).
    pub fusion: bool,
    pub rrf_kappa: f64,
    /// RRF over each route's top `max(rrf_depth_factor*k, 4*quota)` (`fusion::rrf_depth`).
    pub rrf_depth_factor: usize,
    pub fusion_best_weight: f64,
    pub fusion_rrf_weight: f64,
    /// Route quota `max(1, min(quota_cap, k / routes))`.
    pub quota_cap: usize,
    /// MMR `mmr_relevance*final - mmr_redundancy*max_sim` over a pool of `mmr_pool_factor*k`.
    pub mmr: bool,
    pub mmr_relevance: f64,
    pub mmr_redundancy: f64,
    pub mmr_pool_factor: usize,
    pub similarity: SimilarityWeights,
    /// Raw-turn/window limiter: at most `max(raw_min, round(k*raw_ratio))` with score >=
    /// `max(raw_score_floor, raw_score_ratio * best record)`.
    pub raw_min: usize,
    pub raw_ratio: f64,
    pub raw_score_floor: f64,
    pub raw_score_ratio: f64,
    /// Use the per-type ratios of the reference code instead of `raw_ratio`/`raw_score_ratio`.
    pub per_type_limiter: bool,
    /// The SPEC's raw-turn/window count limiter above (`raw_min`, `raw_ratio`, `raw_score_floor`,
    /// `raw_score_ratio`, `per_type_limiter`). Off by default: `evidence_token_budget` bounds
    /// what the evidence costs the answer prompt instead (docs/algorithm.md, "Read path:
    /// selection").
    pub raw_count_limiter: bool,
    /// Estimated tokens the chosen evidence may take in the answer prompt (0 = no budget); an
    /// item that does not fit is skipped for the next best (the first item always fits).
    pub evidence_token_budget: usize,
    /// Never let `evidence_token_budget` hold fewer than k raw-turn items of this question's
    /// candidates: the budget used is `max(evidence_token_budget, k × (1 +
    /// raw_turn_context_before + raw_turn_context_after) × median tokens per raw turn)`, the
    /// median over the raw-turn and window candidates (a window's tokens divided by its turns).
    /// Keeps the budget from starving memories whose turns are long.
    pub evidence_budget_turn_floor: bool,
    /// Min-max normalize final scores within the MMR pool before MMR, so `mmr_relevance` and
    /// `mmr_redundancy` trade the same amounts with and without a cross-encoder.
    pub mmr_normalize_relevance: bool,
}

impl Default for RetrievalConfig {
    fn default() -> Self {
        RetrievalConfig {
            min_top_k: 15,
            planner: true,
            question_type_cues: true,
            planner_context_chars: 2000,
            max_queries: 16,
            max_routes: 8,
            max_queries_per_route: 8,
            max_constraints: 12,
            max_variants: 8,
            planner_queries_recall_only: true,
            channel_temporal: true,
            channel_nodes: true,
            channel_records: true,
            channel_turns: true,
            channel_lexical: true,
            recall_factor: 3,
            recall_floor: 30,
            turn_recall_floor: 20,
            temporal_factor: 10,
            temporal_floor: 100,
            rerank_floor: 100,
            rerank_factor: 4,
            rerank: true,
            types: TypeProfiles::default(),
            temporal_day_score: 0.42,
            temporal_month_score: 0.28,
            node_weight_entity: 0.34,
            node_weight_topic: 0.32,
            node_weight_entity_topic: 0.38,
            node_weight_event_frame: 0.42,
            node_weight_temporal: 0.36,
            record_base: 0.30,
            record_scale: 0.30,
            turn_base: 0.34,
            turn_scale: 0.42,
            lexical_base: 0.30,
            lexical_scale: 0.30,
            bonus_prior_assistant: 0.08,
            bonus_personalized: 0.05,
            bonus_temporal_fields: 0.04,
            bonus_aggregate_event: 0.03,
            temporal_boost_record: 0.08,
            temporal_boost_session: 0.04,
            window_anchors: 5,
            raw_turn_context_before: 0,
            raw_turn_context_after: 1,
            route_r_weight: 0.03,
            route_variant_step: 0.01,
            route_variant_cap: 0.03,
            fusion: true,
            rrf_kappa: 60.0,
            rrf_depth_factor: 4,
            fusion_best_weight: 0.82,
            fusion_rrf_weight: 0.18,
            quota_cap: 4,
            mmr: true,
            mmr_relevance: 0.75,
            mmr_redundancy: 0.25,
            mmr_pool_factor: 3,
            similarity: SimilarityWeights::default(),
            raw_min: 2,
            raw_ratio: 0.40,
            raw_score_floor: 0.35,
            raw_score_ratio: 0.72,
            per_type_limiter: false,
            raw_count_limiter: false,
            evidence_token_budget: 1000,
            evidence_budget_turn_floor: true,
            mmr_normalize_relevance: true,
        }
    }
}

impl RetrievalConfig {
    /// Selection exactly as the published algorithm states it (docs/algorithm.md, "Departures
    /// from the published selection, and why"): the raw-turn count limiter, MMR on raw final
    /// scores, no evidence token budget.
    pub fn use_spec_selection(&mut self) {
        self.raw_count_limiter = true;
        self.evidence_token_budget = 0;
        self.mmr_normalize_relevance = false;
    }

    /// Applies a named retrieval ablation of the paper's Table 5 (plus `no_lexical`, and
    /// `spec_selection`: the SPEC's selection rules instead of lycheemem's).
    pub fn apply_ablation(&mut self, name: &str) -> Result<()> {
        match name {
            "full" => {}
            "record_vector_only" => {
                self.channel_temporal = false;
                self.channel_nodes = false;
                self.channel_turns = false;
                self.channel_lexical = false;
            }
            "no_planner" => self.planner = false,
            "no_fusion" => {
                self.fusion = false;
                self.rerank = false;
                self.mmr = false;
            }
            "no_rerank" => self.rerank = false,
            "no_lexical" => self.channel_lexical = false,
            "spec_selection" => self.use_spec_selection(),
            other => {
                return Err(Error::Config(format!(
                    "unknown retrieval ablation {other:?}"
                )));
            }
        }
        Ok(())
    }
}

/// Answering (docs/algorithm.md, "Answer prompt").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnswerConfig {
    pub max_output_tokens: u32,
    /// Per-item cap on evidence text in the prompt.
    pub evidence_item_chars: usize,
}

impl Default for AnswerConfig {
    fn default() -> Self {
        AnswerConfig {
            max_output_tokens: 256,
            evidence_item_chars: 1200,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_papers() {
        let c = Config::default();
        assert_eq!(
            (
                c.segment.min_tokens,
                c.segment.target_tokens,
                c.segment.max_tokens
            ),
            (300, 600, 900)
        );
        assert_eq!(c.segment.cut_threshold, 0.50);
        assert_eq!(c.segment.max_exchanges, 10);
        assert_eq!(
            c.retrieval
                .types
                .get(QuestionType::PriorAssistantResponse)
                .m_turn,
            3.00
        );
        assert!(!c.organize.memory_type_as_tag);
        c.validate().unwrap();
    }

    #[test]
    fn devices_parse_print_and_round_trip_through_toml() {
        for (text, want) in [
            ("auto", ComputeDevice::Auto),
            ("CPU", ComputeDevice::Cpu),
            ("cuda", ComputeDevice::Cuda(0)),
            (" cuda:3 ", ComputeDevice::Cuda(3)),
        ] {
            assert_eq!(text.parse::<ComputeDevice>().unwrap(), want, "{text}");
        }
        for bad in ["", "cuda:", "cuda:-1", "cuda:x", "metal", "tpu:0"] {
            let e = bad.parse::<ComputeDevice>().unwrap_err().to_string();
            assert!(e.contains("device"), "{bad}: {e}");
        }
        assert_eq!(ComputeDevice::Cuda(2).to_string(), "cuda:2");
        let mut c = Config::default();
        assert_eq!(c.models.device, ComputeDevice::Auto);
        c.models.device = ComputeDevice::Cuda(1);
        let text = toml::to_string(&c).unwrap();
        assert!(text.contains("device = \"cuda:1\""), "{text}");
        let back: Config = toml::from_str(&text).unwrap();
        assert_eq!(back.models.device, ComputeDevice::Cuda(1));
        let err = toml::from_str::<Config>("[models]\ndevice = \"gpu:x\"\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("expected auto, cpu, cuda or cuda:N"),
            "{err}"
        );
    }

    #[test]
    fn reference_preset_differs_where_documented() {
        let r = Config::reference_code();
        assert_eq!(
            (
                r.segment.min_tokens,
                r.segment.target_tokens,
                r.segment.max_tokens
            ),
            (1000, 1500, 2000)
        );
        assert_eq!(r.segment.cut_threshold, 0.55);
        assert_eq!(r.segment.max_exchanges, 0);
        assert_eq!(r.segment.previous_window, 2);
        r.validate().unwrap();
        assert!(Config::preset("nope").is_err());
    }

    #[test]
    fn toml_round_trip() {
        let r = Config::reference_code();
        let back = Config::from_toml_str(&r.to_toml_string()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn rejects_invalid() {
        assert!(Config::from_toml_str("[segment]\nmin_tokens = 700\n").is_err());
        assert!(Config::from_toml_str("[retrieval]\nmin_top_k = 0\n").is_err());
        assert!(Config::from_toml_str("[nonsense]\n").is_err());
        let err = Config::from_toml_str("[segment]\npolicy = \"bogus\"\n").unwrap_err();
        assert!(err.to_string().contains("invalid configuration"));
    }

    #[test]
    fn ablations_are_switches() {
        let mut r = RetrievalConfig::default();
        r.apply_ablation("record_vector_only").unwrap();
        assert!(r.channel_records && !r.channel_nodes && !r.channel_turns && !r.channel_temporal);
        assert!(r.apply_ablation("bogus").is_err());
    }

    #[test]
    fn surprise_calibration_parses_validates_and_resolves() {
        let cfg =
            Config::from_toml_str("[segment]\nsurprise_calibration = \"embedder\"\n").unwrap();
        assert_eq!(
            cfg,
            Config::default(),
            "calibrated to the embedder by default"
        );
        let published =
            Config::from_toml_str("[segment]\nsurprise_calibration = \"published\"\n").unwrap();
        assert_eq!(
            published.segment.surprise_calibration,
            CalibrationSource::Published
        );
        assert_eq!(
            Config::paper().segment.surprise_calibration,
            CalibrationSource::Published
        );
        assert!(Config::from_toml_str("[segment]\nsurprise_calibration = \"bogus\"\n").is_err());
        assert!(Config::from_toml_str("[segment]\nabs_surprise_scale = 0.0\n").is_err());
        let c = SegmentCalibration {
            surprise_center: 0.39,
            surprise_scale: 0.17,
            cohesion_scale: 0.073,
        };
        let resolved = cfg.segment.resolved(Some(&c));
        assert_eq!(resolved.abs_surprise_center, 0.39);
        assert_eq!(resolved.cohesion_scale, 0.073);
        assert_eq!(resolved.surprise_calibration, CalibrationSource::Published);
        // Published keeps its constants; an invalid calibration is ignored.
        assert_eq!(
            published.segment.resolved(Some(&c)),
            published.segment.resolved(None)
        );
        assert_eq!(
            published.segment.resolved(Some(&c)).abs_surprise_center,
            0.20
        );
        let bad = SegmentCalibration {
            surprise_scale: f64::NAN,
            ..c
        };
        assert_eq!(
            cfg.segment.resolved(Some(&bad)).abs_surprise_center,
            SegmentConfig::default().abs_surprise_center
        );
    }
}
