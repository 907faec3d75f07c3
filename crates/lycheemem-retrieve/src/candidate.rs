//! A retrieval candidate inside one route: what it is (a record or a window of raw turns), what
//! scoring, similarity and the prompt need to know about it, and its scores with provenance.

use lycheemem_core::{CandidateTarget, MemoryType, Provenance, SourceRole, TemporalScope};

/// What is known about the item a candidate points at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ItemInfo {
    pub session: String,
    /// The session date (ISO) when known.
    pub session_date: Option<String>,
    /// Records: the semantic text. Turns: `speaker: text` lines.
    pub text: String,
    /// `None` for raw turns.
    pub memory_type: Option<MemoryType>,
    pub role: Option<SourceRole>,
    pub entities: Vec<String>,
    /// Turn indices the item covers (records: their evidence turns).
    pub turns: Vec<u32>,
    /// Raw turns and windows: each shown turn's `speaker: text`, parallel to `turns` (`text` is
    /// their lines joined). Empty for records.
    pub dialogue: Vec<String>,
    /// Raw turns and windows: the turns the item was found for (a raw-turn hit; the cited turns
    /// of a window's anchors). The answer prompt keeps them when it trims the snippet.
    pub focus: Vec<u32>,
    pub temporal: TemporalScope,
}

/// A candidate with its scores. `field` and `r` keep the maximum over every hit (never a sum).
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub target: CandidateTarget,
    pub info: ItemInfo,
    pub field: f32,
    /// Best similarity mapped to `clamp(2·cos − 1, 0, 1)`.
    pub r: f32,
    pub rerank: Option<f32>,
    pub route_score: f32,
    pub provenance: Provenance,
    /// Only the planner's route queries found it (not the question, the route's goal or the
    /// time filter); see `RetrievalConfig::planner_queries_recall_only`.
    pub queries_only: bool,
}

impl Scored {
    pub fn new(target: CandidateTarget) -> Self {
        Scored {
            target,
            info: ItemInfo::default(),
            field: 0.0,
            r: 0.0,
            rerank: None,
            route_score: 0.0,
            provenance: Provenance::default(),
            queries_only: false,
        }
    }

    /// Raw-turn or source-window candidates (as opposed to records).
    pub fn is_raw(&self) -> bool {
        matches!(self.target, CandidateTarget::Turns { .. })
    }

    /// Folds another hit of the same candidate (or a raw hit inside a window) in: max scores,
    /// union provenance, union focus turns.
    pub fn absorb(&mut self, other: &Scored) {
        self.field = self.field.max(other.field);
        self.r = self.r.max(other.r);
        self.provenance.merge(&other.provenance);
        self.queries_only &= other.queries_only;
        for t in &other.info.focus {
            if !self.info.focus.contains(t) {
                self.info.focus.push(*t);
            }
        }
        self.info.focus.sort_unstable();
    }
}

/// `clamp(2·cos − 1, 0, 1)`: the reference implementation's squared-L2 mapping on unit vectors.
pub fn r_of(cos: f32) -> f32 {
    (2.0 * cos - 1.0).clamp(0.0, 1.0)
}
