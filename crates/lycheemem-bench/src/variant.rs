//! The systems a benchmark compares, each a named configuration: the method (`full`), its
//! construction ablations, its retrieval ablations, and two baselines that build no memory.

use crate::peer::PeerKind;
use anyhow::{Result, bail};
use lycheemem_core::config::{
    CalibrationSource, LicoMemoryConfig, LicoSummaryMode, RecordStyle, SegmentCalibration,
    SegmentPolicy,
};
use lycheemem_core::{Config, MemoryStrategy};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Every variant name, in report order.
pub const VARIANTS: [&str; 21] = [
    "full",
    "spec_write",
    "eager",
    "fixed_window",
    "semantic_calibrated",
    "summary_records",
    "no_cross_segment_context",
    "record_vector_only",
    "no_planner",
    "no_fusion",
    "no_rerank",
    "no_lexical",
    "spec_selection",
    "naive_rag",
    "full_context",
    "licomemory",
    "licomemory_simple",
    "licomemory_no_summary",
    "licomemory_no_decay",
    "mem0",
    "amem",
];

/// How a variant answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VariantKind {
    /// A lycheemem memory built with `config` and searched with `config.retrieval`.
    Memory,
    /// Fixed chunks of raw turns, vector top-k, the same answer prompt.
    NaiveRag,
    /// The whole history in the answer prompt, truncated to the model's context.
    FullContext,
    /// Another memory system, run from its own package (see [`crate::peer`]).
    Peer(PeerKind),
}

/// A named configuration.
#[derive(Debug, Clone)]
pub struct Variant {
    pub name: String,
    pub kind: VariantKind,
    pub config: Config,
}

impl Variant {
    /// The variant `name` derived from the base configuration (models, k and constants shared).
    pub fn new(name: &str, base: &Config) -> Result<Variant> {
        let mut config = base.clone();
        let kind = match name {
            "naive_rag" => VariantKind::NaiveRag,
            "full_context" => VariantKind::FullContext,
            _ => match PeerKind::from_name(name) {
                Some(peer) => VariantKind::Peer(peer),
                None => VariantKind::Memory,
            },
        };
        match name {
            // Baselines and peer systems take the base configuration as it is.
            _ if kind != VariantKind::Memory => {}
            "full" => {}
            "eager" => config.segment.policy = SegmentPolicy::PerExchange,
            "fixed_window" => config.segment.policy = SegmentPolicy::FixedWindow,
            // Semantic segmentation with the embedder's fitted calibration (issue #36; the
            // default since, so it differs from `full` only under a config that says otherwise).
            "semantic_calibrated" => {
                config.segment.surprise_calibration = CalibrationSource::Embedder
            }
            // The published write path: segmentation constants as published, 12 records in ρ
            // (what `full` was before both defaults changed).
            "spec_write" => config.use_spec_write(),
            "summary_records" => config.encode.record_style = RecordStyle::SummaryRecords,
            "no_cross_segment_context" => config.encode.cross_segment_context = false,
            "record_vector_only" | "no_planner" | "no_fusion" | "no_rerank" | "no_lexical"
            | "spec_selection" => config.retrieval.apply_ablation(name)?,
            // LiCoMemory: the paper's method with the authors' constants; their shipped
            // settings (SimpleRank, whole-session summaries); and two ablations.
            "licomemory" => config.strategy = MemoryStrategy::Licomemory,
            "licomemory_simple" => {
                config.strategy = MemoryStrategy::Licomemory;
                config.licomemory = LicoMemoryConfig::authors_shipped();
            }
            "licomemory_no_summary" => {
                config.strategy = MemoryStrategy::Licomemory;
                config.licomemory.summary = LicoSummaryMode::Off;
            }
            "licomemory_no_decay" => {
                config.strategy = MemoryStrategy::Licomemory;
                config.licomemory.temporal_decay = false;
            }
            other => bail!("unknown variant {other:?}; known: {}", VARIANTS.join(", ")),
        }
        Ok(Variant {
            name: name.to_string(),
            kind,
            config,
        })
    }

    /// The variant with its segmentation constants as a memory will use them under an embedder
    /// with `calibration` (what a run hashes and builds with).
    pub fn resolved(mut self, calibration: Option<&SegmentCalibration>) -> Variant {
        self.config.segment = self.config.segment.resolved(calibration);
        self
    }

    /// Whether questions need the planner LLM.
    pub fn plans(&self) -> bool {
        self.kind == VariantKind::Memory
            && self.config.strategy == MemoryStrategy::Lycheemem
            && self.config.retrieval.planner
    }

    /// Whether this is a LiCoMemory variant (its own search and answer prompt).
    pub fn licomemory(&self) -> bool {
        self.kind == VariantKind::Memory && self.config.strategy == MemoryStrategy::Licomemory
    }

    /// Hash of everything that shapes the constructed memory (embedder, encoder LLM,
    /// segmentation, encoding, organization, index settings, ingestion protocol) and nothing
    /// that only shapes retrieval: variants with equal hashes share one built memory.
    pub fn construction_hash(&self) -> String {
        construction_hash(&self.config)
    }
}

/// Bumped whenever the way benchmark turns are fed to the memory changes.
pub const INGEST_PROTOCOL: u32 = 1;

/// See [`Variant::construction_hash`].
pub fn construction_hash(config: &Config) -> String {
    let mut segment = serde_json::to_value(&config.segment).unwrap_or_default();
    if config.segment.surprise_calibration == CalibrationSource::Published
        && let Some(map) = segment.as_object_mut()
    {
        // Explicit constants (the default, and every resolved config): the hash stays what it
        // was before the field existed.
        map.remove("surprise_calibration");
    }
    let mut key = serde_json::json!({
        "protocol": INGEST_PROTOCOL,
        "embedder": config.models.embedder,
        "encode_llm": config.models.encode_llm,
        "segment": segment,
        "encode": config.encode,
        "organize": config.organize,
        "store": store_key(config),
    });
    // LiCoMemory's write path (only then, so LycheeMemory's hashes stay as they were).
    if config.strategy == MemoryStrategy::Licomemory {
        let l = &config.licomemory;
        key["strategy"] = serde_json::json!(config.strategy.as_str());
        key["licomemory_write"] = serde_json::json!({
            "summary": l.summary,
            "summary_max_keys": l.summary_max_keys,
            "summary_words": l.summary_words,
            "summary_session_chars": l.summary_session_chars,
            "max_output_tokens": l.max_output_tokens,
            "max_entities_per_chunk": l.max_entities_per_chunk,
            "max_relations_per_chunk": l.max_relations_per_chunk,
            "max_themes": l.max_themes,
            "temperature": l.temperature,
            "entity_merge_jaccard": l.entity_merge_jaccard,
        });
    }
    hex::encode(Sha256::digest(key.to_string().as_bytes()))[..12].to_string()
}

/// The store settings that shape what is built: all but where a PostgreSQL store lives, how
/// many connections reach it (the same memory built in a directory or in a schema has one hash)
/// and how much memory caches take.
fn store_key(config: &Config) -> serde_json::Value {
    let mut store = serde_json::to_value(&config.store).unwrap_or_default();
    if let Some(map) = store.as_object_mut() {
        map.remove("postgres_schema");
        map.remove("postgres_pool_size");
        map.remove("node_cache_mb");
    }
    store
}

/// Hash of a whole configuration (recorded in reports).
pub fn config_hash(config: &Config) -> String {
    let json = serde_json::to_string(config).unwrap_or_default();
    hex::encode(Sha256::digest(json.as_bytes()))[..12].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_construction_hash_stays_what_cached_memories_were_built_under() {
        // Memories built by earlier runs (and their replayed encoder calls) are found by this
        // hash: a new setting that does not change what is built must leave it alone.
        let base = Config::default();
        assert_eq!(construction_hash(&base), "1aa9e6f0ceb4");
        let mut tuned = base.clone();
        tuned.store.node_cache_mb += 1;
        tuned.store.postgres_pool_size += 1;
        tuned.store.postgres_schema.push('x');
        assert_eq!(construction_hash(&tuned), construction_hash(&base));
        tuned.store.hnsw_connectivity += 1;
        assert_ne!(construction_hash(&tuned), construction_hash(&base));
    }

    #[test]
    fn retrieval_ablations_share_the_construction_and_construction_ablations_do_not() {
        let base = Config::default();
        let full = Variant::new("full", &base).unwrap();
        for name in [
            "record_vector_only",
            "no_planner",
            "no_fusion",
            "no_rerank",
            "no_lexical",
            "spec_selection",
        ] {
            let v = Variant::new(name, &base).unwrap();
            assert_eq!(v.construction_hash(), full.construction_hash(), "{name}");
            assert_ne!(config_hash(&v.config), config_hash(&full.config), "{name}");
        }
        for name in [
            "eager",
            "fixed_window",
            "summary_records",
            "no_cross_segment_context",
        ] {
            let v = Variant::new(name, &base).unwrap();
            assert_ne!(v.construction_hash(), full.construction_hash(), "{name}");
        }
        assert!(full.plans());
        assert!(!Variant::new("no_planner", &base).unwrap().plans());
        assert_eq!(
            Variant::new("naive_rag", &base).unwrap().kind,
            VariantKind::NaiveRag
        );
        assert!(Variant::new("bogus", &base).is_err());
        // Every peer system is a known variant of its own kind.
        for peer in crate::peer::PeerKind::ALL {
            assert!(VARIANTS.contains(&peer.name()), "{}", peer.name());
            let v = Variant::new(peer.name(), &base).unwrap();
            assert_eq!(v.kind, VariantKind::Peer(peer));
        }
        for name in VARIANTS {
            Variant::new(name, &base).unwrap();
        }
        // LiCoMemory: the ranking ablation shares the paper method's construction; shipped
        // settings and no summaries build their own; none plans.
        let lico = Variant::new("licomemory", &base).unwrap();
        assert!(lico.licomemory() && !lico.plans());
        assert_ne!(lico.construction_hash(), full.construction_hash());
        let no_decay = Variant::new("licomemory_no_decay", &base).unwrap();
        assert_eq!(no_decay.construction_hash(), lico.construction_hash());
        for name in ["licomemory_simple", "licomemory_no_summary"] {
            let v = Variant::new(name, &base).unwrap();
            assert_ne!(v.construction_hash(), lico.construction_hash(), "{name}");
        }
    }

    #[test]
    fn calibrated_segmentation_hashes_by_the_constants_it_uses() {
        let base = Config::default();
        let full = Variant::new("full", &base).unwrap();
        let spec = Variant::new("spec_write", &base).unwrap();
        // The default calibrates to the embedder, so `semantic_calibrated` is `full`.
        let calibrated = Variant::new("semantic_calibrated", &base).unwrap();
        assert_eq!(calibrated.construction_hash(), full.construction_hash());
        assert_ne!(spec.construction_hash(), full.construction_hash());
        assert_eq!(spec.config.encode.reference_records, 12);
        assert_eq!(full.config.encode.reference_records, 0);
        let fitted = SegmentCalibration {
            surprise_center: 0.62,
            surprise_scale: 0.11,
            cohesion_scale: 0.047,
        };
        // Resolved, `full` segments with the embedder's fitted constants, or with the published
        // ones when the embedder has none — then exactly as `spec_write` does.
        let fitted_full = full.clone().resolved(Some(&fitted));
        assert_eq!(fitted_full.config.segment.abs_surprise_center, 0.62);
        let plain_full = full.clone().resolved(None);
        let resolved_spec = spec.clone().resolved(Some(&fitted));
        assert_eq!(plain_full.config.segment, resolved_spec.config.segment);
        assert_ne!(
            fitted_full.construction_hash(),
            plain_full.construction_hash()
        );
        // `spec_write` ignores an embedder's calibration.
        assert_eq!(resolved_spec.construction_hash(), spec.construction_hash());
    }
}
