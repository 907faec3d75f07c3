//! Domain rules every storage backend applies the same way, kept out of any one backend's
//! transaction code: what a restated record becomes and what an evidence node is rewritten to
//! when it loses records (docs/algorithm.md, "Storage rules"). Pure functions over the core
//! types.

use lycheemem_core::date::parse_date;
use lycheemem_core::{Error, EvidenceNode, NodeKind, Record, Result, SessionId, Turn};
use std::collections::HashSet;

use crate::types::{SegmentRow, SegmentWrite};

/// Identical text → same id → one record with unioned provenance (docs/algorithm.md, "Storage
/// rules"). The first statement stays the record (its session, segment, date, type and
/// fields); a restatement in the same session adds the turns it cites. A record cites one
/// session, so a restatement in another session adds no citation (its raw turns stay
/// searchable).
pub fn merge_restatement(stored: Record, restated: Record) -> Record {
    let mut merged = stored;
    if merged.source_session == restated.source_session {
        merged.evidence_turns.extend(restated.evidence_turns);
        merged.evidence_turns.sort_unstable();
        merged.evidence_turns.dedup();
    }
    merged
}

/// A node rewritten from the records it still links (`records`, those of `node.record_ids`
/// that exist): sessions, entities, tags, date span and search text are recomputed; its id,
/// kind, key and label stay.
pub fn rebuild_node(mut node: EvidenceNode, records: &[Record], text_chars: usize) -> EvidenceNode {
    node.sessions.clear();
    node.entities.clear();
    node.tags.clear();
    let mut dates: Vec<String> = Vec::new();
    for r in records {
        node.sessions.insert(r.source_session.to_string());
        node.entities.extend(r.entities.iter().cloned());
        node.tags.extend(r.tags.iter().cloned());
        dates.extend(r.dates().iter().map(|d| d.iso()));
    }
    dates.sort();
    node.span = match (dates.first(), dates.last()) {
        (Some(a), Some(b)) => Some((a.clone(), b.clone())),
        _ => None,
    };
    node.search_text = EvidenceNode::compose_search_text(
        &node.label,
        records.iter().map(|r| r.semantic_text.as_str()),
        text_chars,
    );
    node
}

/// The full-text document of a record: its normalized text, then its entities and tags, each
/// after ` | `.
pub fn record_search_text(r: &Record) -> String {
    let mut text = r.normalized_text.clone();
    for extra in r.entities.iter().chain(&r.tags) {
        text.push_str(" | ");
        text.push_str(extra);
    }
    text
}

/// The text a record's vector is computed from (its normalized text).
pub fn record_embed_text(r: &Record) -> String {
    r.normalized_text.clone()
}

/// The full-text document and embedded text of a raw turn: `author: text`.
pub fn turn_search_text(t: &Turn) -> String {
    format!("{}: {}", t.author(), t.text)
}

/// A vector a store accepts: `dims` finite components, not all zero.
pub fn check_vector(v: &[f32], dims: usize) -> Result<()> {
    if v.len() != dims {
        return Err(Error::InvalidInput(format!(
            "vector has {} dimensions, the store holds {dims}-dimensional vectors",
            v.len()
        )));
    }
    if v.iter().any(|x| !x.is_finite()) || v.iter().all(|x| *x == 0.0) {
        return Err(Error::InvalidInput(
            "vector must be finite and non-zero".into(),
        ));
    }
    Ok(())
}

/// What [`check_segment_write`] asks a backend's write transaction.
pub trait StoredFacts {
    /// A stored session's turn count (`None`: unknown session).
    fn turn_count(&mut self, session: &SessionId) -> Result<Option<u32>>;
    /// Whether a record id is stored.
    fn record_stored(&mut self, id: &str) -> Result<bool>;
}

/// Checks that everything a segment write references is stored: its turns, every record's
/// evidence turns, and every node's records (those of the write or already stored).
pub fn check_segment_write(write: &SegmentWrite, stored: &mut dyn StoredFacts) -> Result<()> {
    let seg = &write.segment;
    let held = stored.turn_count(&seg.session)?.ok_or_else(|| {
        Error::InvalidInput(format!(
            "segment {}: unknown session {}",
            seg.id, seg.session
        ))
    })?;
    if seg.first_turn > seg.last_turn || seg.last_turn >= held {
        return Err(Error::InvalidInput(format!(
            "segment {} covers turns {}..={} but session {} has {held} turns",
            seg.id, seg.first_turn, seg.last_turn, seg.session
        )));
    }
    for (r, _) in &write.records {
        let count = if r.source_session == seg.session {
            held
        } else {
            stored.turn_count(&r.source_session)?.unwrap_or(0)
        };
        if let Some(bad) = r.evidence_turns.iter().find(|t| **t >= count) {
            return Err(Error::InvalidInput(format!(
                "record {} cites turn {}#{bad}, which is not stored",
                r.record_id, r.source_session
            )));
        }
    }
    let new_ids: HashSet<&str> = write
        .records
        .iter()
        .map(|(r, _)| r.record_id.as_str())
        .collect();
    for (n, _) in &write.nodes {
        for rid in &n.record_ids {
            if !new_ids.contains(rid.as_str()) && !stored.record_stored(rid)? {
                return Err(Error::InvalidInput(format!(
                    "node {} links record {rid}, which is not stored",
                    n.node_id
                )));
            }
        }
    }
    Ok(())
}

/// The stored row of a segment write committed at write sequence `seq`.
pub fn segment_row(write: &SegmentWrite, seq: u64) -> SegmentRow {
    SegmentRow {
        segment: write.segment.clone(),
        outcome: write.outcome.clone(),
        record_ids: write
            .records
            .iter()
            .map(|(r, _)| r.record_id.clone())
            .collect(),
        seq,
    }
}

/// The inclusive node-id ranges of the temporal nodes overlapping `[since, until]`: `day:` keys
/// inside the range and `month:` keys of every month it touches (bounds are ISO dates,
/// `YYYY-MM-DD` or `YYYY-MM`; a month means its first day for `since`, its last for `until`).
/// Empty when `since` is after `until`.
pub fn temporal_node_ranges(since: &str, until: &str) -> Result<Vec<(String, String)>> {
    let parse = |s: &str| {
        parse_date(s)
            .map(|d| d.date)
            .ok_or_else(|| Error::InvalidInput(format!("unparseable date bound {s:?}")))
    };
    let (since, until) = (parse(since)?.first_day(), parse(until)?.last_day());
    if since > until {
        return Ok(Vec::new());
    }
    let day = |d: chrono::NaiveDate| NodeKind::Temporal.node_id(&format!("day:{d}"));
    let month =
        |d: chrono::NaiveDate| NodeKind::Temporal.node_id(&format!("month:{}", d.format("%Y-%m")));
    Ok(vec![(day(since), day(until)), (month(since), month(until))])
}
