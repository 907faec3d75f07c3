//! The store's public vocabulary: what is written, what is asked, what comes back.

use lycheemem_core::config::{StoreConfig, VectorPrecision};
use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{Error, EvidenceNode, NodeKind, Record, Result, Segment, SessionId, TurnRef};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// How a store is opened. `dims` is fixed when the store is created; reopening with another
/// value is an error (the vectors would not be comparable).
#[derive(Debug, Clone, PartialEq)]
pub struct StoreOptions {
    pub dims: usize,
    pub index: StoreConfig,
    /// Cap on an evidence node's search text, used when a deletion rewrites a node.
    pub node_text_chars: usize,
}

impl StoreOptions {
    /// Default index settings for `dims`-dimensional vectors.
    pub fn new(dims: usize) -> Self {
        StoreOptions {
            dims,
            index: StoreConfig::default(),
            node_text_chars: lycheemem_core::config::OrganizeConfig::default().node_text_chars,
        }
    }

    pub fn with_precision(mut self, precision: VectorPrecision) -> Self {
        self.index.vector_precision = precision;
        self
    }
}

/// What a vector or full-text entry points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    Record,
    Turn,
    Node(NodeKind),
}

impl Target {
    /// Every target, in code order.
    pub const ALL: [Target; 7] = [
        Target::Record,
        Target::Turn,
        Target::Node(NodeKind::Entity),
        Target::Node(NodeKind::Topic),
        Target::Node(NodeKind::EntityTopic),
        Target::Node(NodeKind::Temporal),
        Target::Node(NodeKind::EventFrame),
    ];

    /// `record`, `turn`, or the node kind (`entity`, `topic`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Record => "record",
            Target::Turn => "turn",
            Target::Node(kind) => kind.as_str(),
        }
    }

    pub fn parse(s: &str) -> Result<Target> {
        Target::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| Error::InvalidInput(format!("unknown index target {s:?}")))
    }

    pub(crate) fn code(self) -> u8 {
        Target::ALL.iter().position(|t| *t == self).unwrap_or(0) as u8
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored item: a record, an evidence node or a raw turn.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemRef {
    Record(String),
    Node(String),
    Turn(TurnRef),
}

impl ItemRef {
    /// The item's id as kept in the indexes: the record id, the node id, or `session#index`.
    pub fn id(&self) -> String {
        match self {
            ItemRef::Record(id) | ItemRef::Node(id) => id.clone(),
            ItemRef::Turn(t) => format!("{}#{}", t.session, t.index),
        }
    }

    /// The index target of the item (a node's kind is the prefix of its id).
    pub fn target(&self) -> Target {
        match self {
            ItemRef::Record(_) => Target::Record,
            ItemRef::Turn(_) => Target::Turn,
            ItemRef::Node(id) => NodeKind::ALL
                .into_iter()
                .find(|k| id.starts_with(&format!("{}:", k.as_str())))
                .map_or(Target::Node(NodeKind::Entity), Target::Node),
        }
    }

    /// Rebuilds an item reference from a target and an index id.
    pub fn from_id(target: Target, id: &str) -> Result<ItemRef> {
        Ok(match target {
            Target::Record => ItemRef::Record(id.to_string()),
            Target::Node(_) => ItemRef::Node(id.to_string()),
            Target::Turn => {
                let (session, index) = id
                    .rsplit_once('#')
                    .and_then(|(s, i)| Some((s, i.parse::<u32>().ok()?)))
                    .ok_or_else(|| Error::Store(format!("malformed turn id {id:?}")))?;
                ItemRef::Turn(TurnRef {
                    session: SessionId::new(session)?,
                    index,
                })
            }
        })
    }
}

impl fmt::Display for ItemRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ItemRef::Record(id) => write!(f, "record:{id}"),
            ItemRef::Node(id) => write!(f, "node:{id}"),
            ItemRef::Turn(t) => write!(f, "turn:{}#{}", t.session, t.index),
        }
    }
}

/// An evidence node's record links as node expansion needs them
/// ([`crate::StoreLookup::node_members`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMembers {
    pub node_id: String,
    /// How many records the node links.
    pub records: usize,
    /// The linked record ids (sorted) when the node links at most the `list_up_to` asked for;
    /// `None` for a larger node, which is searched with
    /// [`crate::StoreSearch::vector_search_node`] instead of listed.
    pub record_ids: Option<Vec<String>>,
}

impl NodeMembers {
    /// The members of `node`, listed when it links at most `list_up_to` records.
    pub fn of(node: EvidenceNode, list_up_to: usize) -> NodeMembers {
        let records = node.record_ids.len();
        NodeMembers {
            node_id: node.node_id,
            records,
            record_ids: (records <= list_up_to).then(|| node.record_ids.into_iter().collect()),
        }
    }
}

/// One search result. `score` is cosine similarity for vector search and BM25 for full text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    pub item: ItemRef,
    pub target: Target,
    pub score: f32,
}

/// A query vector must have the store's dimension.
pub fn check_query_dims(vector: &[f32], dims: usize) -> Result<()> {
    if vector.len() == dims {
        return Ok(());
    }
    Err(Error::InvalidInput(format!(
        "query vector has {} dimensions, the store holds {dims}",
        vector.len()
    )))
}

/// A nearest-neighbour query.
#[derive(Debug, Clone, PartialEq)]
pub struct VectorQuery {
    pub target: Target,
    pub vector: Vec<f32>,
    pub k: usize,
    /// Only items of this session (nodes: linked to a record of this session).
    pub session: Option<SessionId>,
}

impl VectorQuery {
    pub fn new(target: Target, vector: Vec<f32>, k: usize) -> Self {
        VectorQuery {
            target,
            vector,
            k,
            session: None,
        }
    }

    pub fn in_session(mut self, session: SessionId) -> Self {
        self.session = Some(session);
        self
    }
}

/// A dated conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: SessionId,
    /// The session date (ISO) when known; relative dates in its turns resolve against it.
    pub date: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// Number of turns stored; the next turn gets this index.
    #[serde(default)]
    pub turn_count: u32,
}

impl SessionInfo {
    pub fn new(id: SessionId, date: Option<String>) -> Self {
        SessionInfo {
            id,
            date,
            metadata: BTreeMap::new(),
            turn_count: 0,
        }
    }
}

/// How the encoding of a segment ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum SegmentOutcome {
    Encoded,
    /// The encoder gave up; the raw turns stay searchable.
    Failed {
        error: String,
    },
}

/// A finalized segment as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentRow {
    pub segment: Segment,
    pub outcome: SegmentOutcome,
    pub record_ids: Vec<String>,
    /// The write sequence of the transaction that stored it.
    pub seq: u64,
}

/// Everything one finalized segment writes, committed in one transaction: its records and the
/// node states after merging (each with its vector, or `None` to fill in later), per-session
/// state (e.g. the segmenter state and the encoder's reference context), and usage entries.
#[derive(Debug, Clone)]
pub struct SegmentWrite {
    pub segment: Segment,
    pub outcome: SegmentOutcome,
    pub records: Vec<(Record, Option<Vec<f32>>)>,
    pub nodes: Vec<(EvidenceNode, Option<Vec<f32>>)>,
    pub state: Vec<(SessionId, String, serde_json::Value)>,
    pub usage: Vec<TokenUsage>,
}

impl SegmentWrite {
    /// A write of `segment` with nothing attached yet.
    pub fn new(segment: Segment, outcome: SegmentOutcome) -> Self {
        SegmentWrite {
            segment,
            outcome,
            records: Vec::new(),
            nodes: Vec::new(),
            state: Vec::new(),
            usage: Vec::new(),
        }
    }
}

/// Acknowledgement of a durable write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteReceipt {
    /// The store's write sequence after the commit.
    pub seq: u64,
}

/// What a deletion removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteReceipt {
    pub sessions: u64,
    pub turns: u64,
    pub segments: u64,
    pub records: u64,
    /// Nodes removed because no record links to them any more.
    pub nodes_removed: u64,
    /// Nodes that lost a link and were rewritten (their vectors await re-embedding).
    pub nodes_updated: u64,
    pub vectors: u64,
    pub state_entries: u64,
    pub usage_entries: u64,
}

impl DeleteReceipt {
    /// Adds another receipt's counts to this one.
    pub fn add(&mut self, other: &DeleteReceipt) {
        self.sessions += other.sessions;
        self.turns += other.turns;
        self.segments += other.segments;
        self.records += other.records;
        self.nodes_removed += other.nodes_removed;
        self.nodes_updated += other.nodes_updated;
        self.vectors += other.vectors;
        self.state_entries += other.state_entries;
        self.usage_entries += other.usage_entries;
    }
}

/// Counts for one namespace, from redb and from each derived index.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NamespaceStats {
    pub sessions: u64,
    pub turns: u64,
    pub segments: u64,
    pub failed_segments: u64,
    pub records: u64,
    pub nodes: BTreeMap<String, u64>,
    /// Vectors stored in redb, per target.
    pub vectors: BTreeMap<String, u64>,
    /// Vectors in the HNSW indexes, per target.
    pub indexed_vectors: BTreeMap<String, u64>,
    /// Full-text rows, per target.
    pub text_rows: BTreeMap<String, u64>,
    /// Items whose vector is missing or stale and should be (re-)embedded.
    pub pending_vectors: u64,
    pub usage: lycheemem_core::UsageTotals,
}
