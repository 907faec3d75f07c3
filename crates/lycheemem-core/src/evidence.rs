//! Retrieval candidates and the evidence handed to the answerer, with full provenance.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use crate::turn::TurnRef;

/// A retrieval channel (docs/algorithm.md, "Routes and channels"), including the lexical BM25
/// channel added by lycheemem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    Temporal,
    EvidenceNode,
    Record,
    RawTurn,
    SourceWindow,
    Lexical,
}

/// What a candidate points at.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CandidateTarget {
    Record {
        record_id: String,
    },
    /// A raw turn, or a window of adjacent turns `first..=last` of one session.
    Turns {
        first: TurnRef,
        last_index: u32,
    },
}

/// Why a candidate was found: every channel, query variant, node and route that hit it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub channels: BTreeSet<Channel>,
    /// Indices into the route's query variants that matched.
    pub variants: BTreeSet<usize>,
    pub nodes: BTreeSet<String>,
    pub routes: BTreeSet<String>,
}

impl Provenance {
    /// Unions another provenance into this one (used when a candidate is hit twice).
    pub fn merge(&mut self, other: &Provenance) {
        self.channels.extend(other.channels.iter().copied());
        self.variants.extend(other.variants.iter().copied());
        self.nodes.extend(other.nodes.iter().cloned());
        self.routes.extend(other.routes.iter().cloned());
    }
}

/// A candidate inside one route, before fusion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub target: CandidateTarget,
    /// Channel field score (max over hits; never summed).
    pub field_score: f32,
    /// Best similarity mapped to `r = clamp(2*cos - 1, 0, 1)`.
    pub r: f32,
    /// Cross-encoder score when the route pool was reranked.
    pub rerank_score: Option<f32>,
    /// Route-local final score.
    pub route_score: f32,
    pub provenance: Provenance,
}

/// One item of evidence chosen for the answer prompt, with the scores that chose it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub target: CandidateTarget,
    /// The text shown to the answerer.
    pub text: String,
    /// Best route score across routes.
    pub best_route_score: f32,
    /// Reciprocal-rank-fusion sum over routes.
    pub rrf: f32,
    /// Fused score `0.82*best + 0.18*rrf/max_rrf` (with default weights).
    pub final_score: f32,
    /// The MMR objective at the time the item was selected.
    pub mmr_score: f32,
    pub provenance: Provenance,
}
