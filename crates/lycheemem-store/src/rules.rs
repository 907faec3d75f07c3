//! Domain rules every storage backend applies the same way, kept out of any one backend's
//! transaction code: what a restated record becomes and what an evidence node is rewritten to
//! when it loses records (docs/algorithm.md, "Storage rules"). Pure functions over the core
//! types.

use lycheemem_core::{EvidenceNode, Record, Turn};

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
