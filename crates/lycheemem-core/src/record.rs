//! Memory records (docs/algorithm.md, "Encoding") and the evidence nodes that index them
//! (docs/algorithm.md, "Evidence nodes").

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;

use crate::date::{CalendarDate, find_dates};
use crate::turn::{Namespace, SessionId};

/// The seven record types of LycheeMemory V2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryType {
    Fact,
    Preference,
    Event,
    Constraint,
    Procedure,
    FailurePattern,
    ToolAffordance,
}

impl MemoryType {
    pub const ALL: [MemoryType; 7] = [
        MemoryType::Fact,
        MemoryType::Preference,
        MemoryType::Event,
        MemoryType::Constraint,
        MemoryType::Procedure,
        MemoryType::FailurePattern,
        MemoryType::ToolAffordance,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MemoryType::Fact => "fact",
            MemoryType::Preference => "preference",
            MemoryType::Event => "event",
            MemoryType::Constraint => "constraint",
            MemoryType::Procedure => "procedure",
            MemoryType::FailurePattern => "failure_pattern",
            MemoryType::ToolAffordance => "tool_affordance",
        }
    }

    /// Parses an LLM-provided type leniently: case and separators are ignored, and anything
    /// unknown becomes [`MemoryType::Fact`] (docs/algorithm.md, "Validation and repair").
    pub fn parse_lenient(s: &str) -> MemoryType {
        let norm: String = s
            .trim()
            .chars()
            .map(|c| {
                if c == '-' || c == ' ' {
                    '_'
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect();
        MemoryType::ALL
            .into_iter()
            .find(|t| t.as_str() == norm)
            .unwrap_or(MemoryType::Fact)
    }
}

/// Which side of the conversation a record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceRole {
    User,
    Assistant,
    Both,
}

/// When a record's statement holds. Dates are ISO (`YYYY-MM-DD` or `YYYY-MM`) once normalized.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemporalScope {
    /// When the described thing happened or was stated.
    pub t_ref: Option<String>,
    pub t_valid_from: Option<String>,
    pub t_valid_to: Option<String>,
}

impl TemporalScope {
    pub fn is_empty(&self) -> bool {
        self.t_ref.is_none() && self.t_valid_from.is_none() && self.t_valid_to.is_none()
    }

    /// The present fields, in the order t_ref, t_valid_from, t_valid_to.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        [&self.t_ref, &self.t_valid_from, &self.t_valid_to]
            .into_iter()
            .flatten()
            .map(String::as_str)
    }
}

/// One typed, self-contained memory statement produced by the segment encoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Stable hash of namespace + semantic text; see [`Record::make_id`].
    pub record_id: String,
    pub memory_type: MemoryType,
    pub semantic_text: String,
    /// `"<type>: <text>"`, the text that is embedded and indexed.
    pub normalized_text: String,
    pub entities: Vec<String>,
    pub tags: Vec<String>,
    pub temporal: TemporalScope,
    /// Absolute turn indices in `source_session` that support the record.
    pub evidence_turns: Vec<u32>,
    pub source_session: SessionId,
    pub source_role: SourceRole,
    pub segment_id: String,
    /// The session date the record was created from (ISO), when known.
    pub created_at: Option<String>,
    pub confidence: f32,
}

impl Record {
    /// The stable record id for `semantic_text` in `namespace`: identical text in the same
    /// namespace always maps to the same record (docs/algorithm.md, "Storage rules").
    pub fn make_id(namespace: &Namespace, semantic_text: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(namespace.as_str().as_bytes());
        hasher.update([0u8]);
        hasher.update(semantic_text.trim().as_bytes());
        let digest = hasher.finalize();
        format!("r_{}", hex::encode(&digest[..12]))
    }

    /// Every distinct calendar date mentioned in the temporal fields, in field order.
    pub fn dates(&self) -> Vec<CalendarDate> {
        let mut out: Vec<CalendarDate> = Vec::new();
        for field in self.temporal.fields() {
            for d in find_dates(field) {
                if !out.contains(&d) {
                    out.push(d);
                }
            }
        }
        out
    }

    /// `"<type>: <text>"`.
    pub fn make_normalized_text(memory_type: MemoryType, semantic_text: &str) -> String {
        format!("{}: {}", memory_type.as_str(), semantic_text.trim())
    }
}

/// The kinds of evidence node (docs/algorithm.md, "Evidence nodes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    Entity,
    Topic,
    EntityTopic,
    Temporal,
    EventFrame,
}

impl NodeKind {
    pub const ALL: [NodeKind; 5] = [
        NodeKind::Entity,
        NodeKind::Topic,
        NodeKind::EntityTopic,
        NodeKind::Temporal,
        NodeKind::EventFrame,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodeKind::Entity => "entity",
            NodeKind::Topic => "topic",
            NodeKind::EntityTopic => "entity_topic",
            NodeKind::Temporal => "temporal",
            NodeKind::EventFrame => "event_frame",
        }
    }

    /// The node id for a normalized key: `kind:key`.
    pub fn node_id(self, key: &str) -> String {
        format!("{}:{key}", self.as_str())
    }
}

/// An index node linking records that share an entity, topic, entity×topic pair, date or segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvidenceNode {
    /// `kind:key`.
    pub node_id: String,
    pub kind: NodeKind,
    /// Normalized key (docs/algorithm.md, "Evidence nodes"), e.g. `caroline`,
    /// `caroline::adoption`, `day:2023-05-08`.
    pub key: String,
    /// Human-readable label (the first surface form seen).
    pub label: String,
    pub record_ids: BTreeSet<String>,
    pub sessions: BTreeSet<String>,
    pub entities: BTreeSet<String>,
    pub tags: BTreeSet<String>,
    /// Earliest and latest ISO date among the linked records' temporal fields.
    pub span: Option<(String, String)>,
    /// Label plus linked record texts, capped; the text that is embedded and indexed.
    pub search_text: String,
}

impl EvidenceNode {
    /// The node's search text: its label followed by the linked record texts, one per line,
    /// cut at `max_chars` characters (docs/algorithm.md, "Evidence nodes").
    pub fn compose_search_text<'a>(
        label: &str,
        record_texts: impl IntoIterator<Item = &'a str>,
        max_chars: usize,
    ) -> String {
        let mut text = label.to_string();
        for t in record_texts {
            if text.chars().count() >= max_chars {
                break;
            }
            text.push('\n');
            text.push_str(t);
        }
        if let Some((i, _)) = text.char_indices().nth(max_chars) {
            text.truncate(i);
        }
        text
    }
}
