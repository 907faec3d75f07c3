//! Structured evidence organization (docs/algorithm.md, "Evidence nodes"): records → upserts of
//! evidence nodes. No model.
//!
//! Kinds: `entity` (each entity), `topic` (each tag; plus the memory type when
//! `memory_type_as_tag` is on), `entity_topic` (each entity × tag, key `entity::tag`), `temporal`
//! (`day:YYYY-MM-DD` and `month:YYYY-MM` for every date in t_ref / t_valid_from / t_valid_to),
//! and one `event_frame` per finalized segment (key = the segment id). Repeated keys merge:
//! record ids, sessions, entities and tags are unioned, the temporal span widens, and the search
//! text (label + linked record texts) grows up to a cap.

use lycheemem_core::config::OrganizeConfig;
use lycheemem_core::date::CalendarDate;
use lycheemem_core::{EvidenceNode, NodeKind, Record, Segment, normalize_key};
use std::collections::{BTreeMap, BTreeSet};

/// What one segment contributes to one node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeUpsert {
    pub node_id: String,
    pub kind: NodeKind,
    pub key: String,
    pub label: String,
    /// `(record id, record text)` of each linked record, in record order.
    pub records: Vec<(String, String)>,
    pub sessions: BTreeSet<String>,
    pub entities: BTreeSet<String>,
    pub tags: BTreeSet<String>,
    /// ISO dates seen (for the span).
    pub dates: BTreeSet<String>,
}

impl NodeUpsert {
    fn new(kind: NodeKind, key: String, label: String) -> Self {
        NodeUpsert {
            node_id: kind.node_id(&key),
            kind,
            key,
            label,
            records: Vec::new(),
            sessions: BTreeSet::new(),
            entities: BTreeSet::new(),
            tags: BTreeSet::new(),
            dates: BTreeSet::new(),
        }
    }

    fn link(&mut self, r: &Record, dates: &[CalendarDate]) {
        if !self.records.iter().any(|(id, _)| id == &r.record_id) {
            self.records
                .push((r.record_id.clone(), r.semantic_text.clone()));
        }
        self.sessions.insert(r.source_session.to_string());
        self.entities.extend(r.entities.iter().cloned());
        self.tags.extend(r.tags.iter().cloned());
        self.dates.extend(dates.iter().map(CalendarDate::iso));
    }
}

/// The node upserts for one finalized segment's records, in a deterministic order.
pub fn organize(records: &[Record], segment: &Segment, cfg: &OrganizeConfig) -> Vec<NodeUpsert> {
    let mut nodes: BTreeMap<String, NodeUpsert> = BTreeMap::new();
    let mut upsert =
        |kind: NodeKind, key: String, label: &str, r: &Record, dates: &[CalendarDate]| {
            let id = kind.node_id(&key);
            nodes
                .entry(id)
                .or_insert_with(|| NodeUpsert::new(kind, key, label.to_string()))
                .link(r, dates);
        };
    for r in records {
        let dates = r.dates();
        let mut tags: Vec<(String, String)> = r
            .tags
            .iter()
            .map(|t| (normalize_key(t), t.clone()))
            .filter(|(k, _)| !k.is_empty())
            .collect();
        if cfg.memory_type_as_tag {
            tags.push((
                r.memory_type.as_str().to_string(),
                r.memory_type.as_str().to_string(),
            ));
        }
        let entities: Vec<(String, &String)> = r
            .entities
            .iter()
            .map(|e| (normalize_key(e), e))
            .filter(|(k, _)| !k.is_empty())
            .collect();
        for (key, label) in &entities {
            upsert(NodeKind::Entity, key.clone(), label, r, &dates);
        }
        for (key, label) in &tags {
            upsert(NodeKind::Topic, key.clone(), label, r, &dates);
        }
        for (ekey, elabel) in &entities {
            for (tkey, tlabel) in &tags {
                upsert(
                    NodeKind::EntityTopic,
                    format!("{ekey}::{tkey}"),
                    &format!("{elabel} / {tlabel}"),
                    r,
                    &dates,
                );
            }
        }
        for d in &dates {
            if let Some(day) = d.day_key() {
                upsert(NodeKind::Temporal, day, &d.iso(), r, &dates);
            }
            upsert(
                NodeKind::Temporal,
                d.month_key(),
                &d.month_key()["month:".len()..],
                r,
                &dates,
            );
        }
    }
    if !records.is_empty() {
        let label = format!(
            "{} turns {}-{}",
            segment.session, segment.first_turn, segment.last_turn
        );
        for r in records {
            upsert(
                NodeKind::EventFrame,
                segment.id.clone(),
                &label,
                r,
                &r.dates(),
            );
        }
    }
    nodes.into_values().collect()
}

fn truncate_chars(s: &mut String, max: usize) {
    if let Some((i, _)) = s.char_indices().nth(max) {
        s.truncate(i);
    }
}

/// Applies an upsert to the stored node (or creates it), following the merge rules of
/// docs/algorithm.md, "Evidence nodes".
pub fn merge(
    existing: Option<EvidenceNode>,
    up: &NodeUpsert,
    cfg: &OrganizeConfig,
) -> EvidenceNode {
    let mut node = existing.unwrap_or_else(|| EvidenceNode {
        node_id: up.node_id.clone(),
        kind: up.kind,
        key: up.key.clone(),
        label: up.label.clone(),
        record_ids: BTreeSet::new(),
        sessions: BTreeSet::new(),
        entities: BTreeSet::new(),
        tags: BTreeSet::new(),
        span: None,
        search_text: up.label.clone(),
    });
    for (id, text) in &up.records {
        if node.record_ids.insert(id.clone())
            && node.search_text.chars().count() < cfg.node_text_chars
        {
            node.search_text.push('\n');
            node.search_text.push_str(text);
        }
    }
    truncate_chars(&mut node.search_text, cfg.node_text_chars);
    node.sessions.extend(up.sessions.iter().cloned());
    node.entities.extend(up.entities.iter().cloned());
    node.tags.extend(up.tags.iter().cloned());
    if let (Some(first), Some(last)) = (up.dates.first(), up.dates.last()) {
        node.span = Some(match node.span.take() {
            Some((a, b)) => (a.min(first.clone()), b.max(last.clone())),
            None => (first.clone(), last.clone()),
        });
    }
    node
}
