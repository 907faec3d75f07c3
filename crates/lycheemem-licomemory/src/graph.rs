//! LiCoMemory's graph as stored records and nodes (docs/licomemory.md, "Storage"): an entity is
//! an entity node keyed by its type and its name's word set, a triple is a record per (triple,
//! session) — identical triples of one session merge and unite their turns, a triple restated in
//! another session is another record with the same text, so a triple's provenance list is the
//! set of records sharing its text. Pure functions.

use lycheemem_core::{
    EvidenceNode, MemoryType, Namespace, NodeKind, Record, SessionId, SourceRole, TemporalScope,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// The seven entity types of the extraction prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntityType {
    Person,
    Time,
    Organization,
    Location,
    Event,
    Concept,
    Object,
}

impl EntityType {
    pub const ALL: [EntityType; 7] = [
        EntityType::Person,
        EntityType::Time,
        EntityType::Organization,
        EntityType::Location,
        EntityType::Event,
        EntityType::Concept,
        EntityType::Object,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EntityType::Person => "person",
            EntityType::Time => "time",
            EntityType::Organization => "organization",
            EntityType::Location => "location",
            EntityType::Event => "event",
            EntityType::Concept => "concept",
            EntityType::Object => "object",
        }
    }

    /// Case-insensitive; anything else is `None`.
    pub fn parse(s: &str) -> Option<EntityType> {
        let s = s.trim().to_ascii_lowercase();
        EntityType::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// A typed entity as extracted (its name as first written).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entity {
    pub name: String,
    pub kind: EntityType,
}

/// The lowercased whitespace-separated words of a name, as a set (the authors' `set(name.lower().split())`).
pub fn word_set(name: &str) -> BTreeSet<String> {
    name.split_whitespace().map(str::to_lowercase).collect()
}

/// Word-set Jaccard similarity of two names (0 when both are empty).
pub fn name_jaccard(a: &str, b: &str) -> f64 {
    let (a, b) = (word_set(a), word_set(b));
    let union = a.union(&b).count();
    if union == 0 {
        return 0.0;
    }
    a.intersection(&b).count() as f64 / union as f64
}

/// Whether two extracted entities are one: same type and word-set Jaccard at least `threshold`
/// (equal lowercased names have equal word sets).
pub fn same_entity(a: &Entity, b: &Entity, threshold: f64) -> bool {
    a.kind == b.kind && name_jaccard(&a.name, &b.name) >= threshold
}

/// The entity node key: `type::words`, the name's word set in order. Names with equal word sets
/// (Jaccard 1) share a key.
pub fn entity_key(e: &Entity) -> String {
    let words: Vec<String> = word_set(&e.name).into_iter().collect();
    format!("{}::{}", e.kind.as_str(), words.join(" "))
}

/// The entity node id of an entity.
pub fn entity_node_id(e: &Entity) -> String {
    NodeKind::Entity.node_id(&entity_key(e))
}

/// The text an entity is embedded as, and its node label: `name (type)`.
pub fn entity_label(e: &Entity) -> String {
    format!("{} ({})", e.name.trim(), e.kind.as_str())
}

/// An entity node's entity, read back from its key (type) and label (name).
pub fn node_entity(node: &EvidenceNode) -> Option<Entity> {
    let (kind, _) = node.key.split_once("::")?;
    let kind = EntityType::parse(kind)?;
    let suffix = format!(" ({})", kind.as_str());
    let name = node.label.strip_suffix(&suffix).unwrap_or(&node.label);
    Some(Entity {
        name: name.to_string(),
        kind,
    })
}

/// A fresh entity node for `e` (linking no record yet).
pub fn new_entity_node(e: &Entity) -> EvidenceNode {
    let label = entity_label(e);
    EvidenceNode {
        node_id: entity_node_id(e),
        kind: NodeKind::Entity,
        key: entity_key(e),
        label: label.clone(),
        record_ids: BTreeSet::new(),
        sessions: BTreeSet::new(),
        entities: BTreeSet::new(),
        tags: BTreeSet::new(),
        span: None,
        search_text: label,
    }
}

/// One relation between two canonical entities, with the chunk it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Triple {
    pub source: String,
    pub relation: String,
    pub target: String,
    /// 1–10 as extracted.
    pub strength: u8,
}

impl Triple {
    /// `src - relation - tgt`: the triple's text, embedded and shown.
    pub fn text(&self) -> String {
        format!(
            "{} - {} - {}",
            self.source.trim(),
            self.relation.trim(),
            self.target.trim()
        )
    }
}

/// The record holding one provenance entry of a triple: its session, the turns of the chunk
/// that stated it, and the session date. Its id depends on the lowercased triple text and the
/// session, so an exact restatement in the same session merges (the turns are united) and one in
/// another session is a second entry.
pub fn triple_record(
    ns: &Namespace,
    t: &Triple,
    session: &SessionId,
    session_date: Option<&str>,
    segment_id: &str,
    turns: Vec<u32>,
) -> Record {
    let text = t.text();
    Record {
        record_id: Record::make_id(ns, &format!("{}\n{session}", text.to_lowercase())),
        memory_type: MemoryType::Fact,
        semantic_text: text.clone(),
        normalized_text: text,
        entities: vec![t.source.clone(), t.target.clone()],
        tags: vec![t.relation.clone()],
        temporal: TemporalScope {
            t_ref: session_date.map(str::to_string),
            ..TemporalScope::default()
        },
        evidence_turns: turns,
        source_session: session.clone(),
        source_role: SourceRole::Both,
        segment_id: segment_id.to_string(),
        created_at: session_date.map(str::to_string),
        confidence: f32::from(t.strength.clamp(1, 10)) / 10.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, kind: EntityType) -> Entity {
        Entity {
            name: name.into(),
            kind,
        }
    }

    #[test]
    fn entities_merge_on_type_and_word_jaccard() {
        let t = 0.85;
        assert!(same_entity(
            &e("Caroline", EntityType::Person),
            &e("caroline", EntityType::Person),
            t
        ));
        assert!(same_entity(
            &e("Support Group LGBTQ", EntityType::Organization),
            &e("lgbtq support  group", EntityType::Organization),
            t
        ));
        // Same name, different type: two entities.
        assert!(!same_entity(
            &e("Paris", EntityType::Location),
            &e("Paris", EntityType::Person),
            t
        ));
        // 5 of 6 words: 0.83 < 0.85.
        assert!(!same_entity(
            &e("a b c d e", EntityType::Concept),
            &e("a b c d e f", EntityType::Concept),
            t
        ));
        // 7 of 8 words: 0.875 >= 0.85.
        assert!(same_entity(
            &e("a b c d e f g", EntityType::Concept),
            &e("a b c d e f g h", EntityType::Concept),
            t
        ));
        assert_eq!(name_jaccard("", ""), 0.0);
        assert_eq!(
            entity_key(&e("Support Group LGBTQ", EntityType::Organization)),
            "organization::group lgbtq support"
        );
    }

    #[test]
    fn a_node_gives_back_its_entity() {
        let ent = e("Melanie Smith", EntityType::Person);
        let node = new_entity_node(&ent);
        assert_eq!(node.label, "Melanie Smith (person)");
        assert_eq!(node.node_id, "entity:person::melanie smith");
        assert_eq!(node_entity(&node), Some(ent));
    }

    #[test]
    fn a_triple_restated_in_another_session_is_another_entry() {
        let ns = Namespace::new("n").unwrap();
        let t = Triple {
            source: "Caroline".into(),
            relation: "adopted".into(),
            target: "a dog".into(),
            strength: 12,
        };
        let s1 = SessionId::new("s1").unwrap();
        let s2 = SessionId::new("s2").unwrap();
        let a = triple_record(&ns, &t, &s1, Some("2023-05-08"), "s1#0-1", vec![0, 1]);
        let shouted = Triple {
            relation: "ADOPTED".into(),
            ..t.clone()
        };
        let b = triple_record(&ns, &shouted, &s1, None, "s1#4-5", vec![4, 5]);
        let c = triple_record(&ns, &t, &s2, None, "s2#0-1", vec![0, 1]);
        assert_eq!(a.record_id, b.record_id);
        assert_ne!(a.record_id, c.record_id);
        assert_eq!(a.semantic_text, "Caroline - adopted - a dog");
        assert_eq!(a.confidence, 1.0);
        assert_eq!(a.temporal.t_ref.as_deref(), Some("2023-05-08"));
    }
}
