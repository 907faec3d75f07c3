//! LiCoMemory's write path (docs/licomemory.md, "Write path"; SPEC-licomemory §2): per chunk,
//! the session summary created or updated (one call) and the chunk's entities and relations
//! extracted (one call) — [`ChunkWriter::extract`], outside any lock — then merged with the
//! stored graph and embedded — [`organize_chunk`], which the caller runs under the namespace's
//! commit lock and commits as one [`SegmentWrite`].

use lycheemem_core::config::{LicoMemoryConfig, LicoSummaryMode};
use lycheemem_core::text::head_and_tail;
use lycheemem_core::{
    Cancel, Error, EvidenceNode, NodeKind, Purpose, Record, Result, Segment, SessionId, TokenUsage,
    Turn, date::parse_date,
};
use lycheemem_core::{Namespace, vector::dot};
use lycheemem_embed::Embedder;
use lycheemem_llm::{ChatMessage, Completion, GenerateOptions, Llm};
use lycheemem_store::{MemoryStore, SegmentOutcome, SegmentWrite, StoreLookup};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::graph::{
    Entity, EntityType, Triple, entity_node_id, new_entity_node, node_entity, same_entity,
    triple_record, word_set,
};
use crate::{prompts, schema};

/// The per-session state entry holding a session's summary.
pub const SUMMARY_STATE: &str = "licomemory.summary";

/// One theme of a session summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Theme {
    pub theme: String,
    pub summary: String,
}

/// A session node: its summary's keys and themes, and the keys' vectors (parallel to `keys`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSummary {
    pub session_id: String,
    pub session_time: Option<String>,
    pub keys: Vec<String>,
    pub themes: Vec<Theme>,
    #[serde(default)]
    pub key_vectors: Vec<Vec<f32>>,
    /// Turns of the session the summary covers (a whole-session summary is not made again
    /// while the session has no more).
    #[serde(default)]
    pub turns: u32,
}

impl SessionSummary {
    /// The stored summary of a session, if any.
    pub fn load(
        store: &dyn StoreLookup,
        ns: &Namespace,
        session: &SessionId,
    ) -> Result<Option<SessionSummary>> {
        match store.state(ns, session, SUMMARY_STATE)? {
            Some(v) => serde_json::from_value(v).map(Some).map_err(|e| {
                Error::Store(format!(
                    "the summary of session {session} is unreadable: {e}"
                ))
            }),
            None => Ok(None),
        }
    }

    /// The JSON shown to an update call (no vectors).
    fn prompt_json(&self) -> String {
        serde_json::json!({
            "session_id": self.session_id,
            "session_time": self.session_time,
            "keys": self.keys,
            "themes": self.themes,
        })
        .to_string()
    }

    /// Best relevance of this session to query vectors: the mean of the `top` highest query ×
    /// key cosines.
    pub fn relevance(&self, queries: &[Vec<f32>], top: usize) -> f32 {
        let cos: Vec<f32> = queries
            .iter()
            .flat_map(|q| self.key_vectors.iter().map(move |k| dot(q, k)))
            .collect();
        crate::rank::session_score(cos, top)
    }
}

/// The parsed reply of a summary call.
#[derive(Debug, Deserialize)]
struct SummaryReply {
    keys: Vec<String>,
    themes: Vec<Theme>,
}

#[derive(Debug, Deserialize)]
struct ExtractedEntity {
    name: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct ExtractedRelation {
    source: String,
    target: String,
    relation: String,
    strength: Value,
}

#[derive(Debug, Deserialize)]
struct ExtractionReply {
    entities: Vec<ExtractedEntity>,
    relations: Vec<ExtractedRelation>,
}

/// What a chunk's LLM calls produced, before the merge with the stored graph.
#[derive(Debug, Clone)]
pub struct ChunkExtraction {
    pub segment: Segment,
    pub session_date: Option<String>,
    /// The session summary after this chunk, when it changed.
    pub summary: Option<SessionSummary>,
    pub entities: Vec<Entity>,
    pub triples: Vec<Triple>,
    /// Lowercased names of relation ends the extraction did not list with a type.
    pub untyped: Vec<String>,
    pub usage: Vec<TokenUsage>,
    pub calls: u32,
    /// Why the extraction (or the summary) failed; the raw turns stay stored either way.
    pub failure: Option<String>,
    /// Whether the extraction call failed (the chunk is committed as failed).
    pub extraction_failed: bool,
}

/// The chunk's turns as dialogue lines.
pub fn dialogue_lines(turns: &[Turn]) -> Vec<String> {
    turns
        .iter()
        .map(lycheemem_store::rules::turn_search_text)
        .collect()
}

/// A date as the authors write it: `YYYY/MM/DD` (or the text as given when unreadable).
pub fn slash_date(date: Option<&str>) -> String {
    match date.and_then(parse_date) {
        Some(p) => p.date.iso().replace('-', "/"),
        None => date.unwrap_or("unknown").to_string(),
    }
}

/// The metered usage of a call.
fn usage(reply: &Completion, purpose: Purpose) -> TokenUsage {
    TokenUsage {
        purpose,
        model: reply.model.clone(),
        prompt_tokens: reply.prompt_tokens,
        completion_tokens: reply.completion_tokens,
        latency_ms: reply.latency_ms,
        estimated: reply.usage_estimated,
    }
}

/// Makes a schema-constrained call and parses its reply. `Ok(Err(why))` is a failed call or an
/// unreadable reply (the caller records it and goes on); `Err` only for cancellation.
pub(crate) fn call_json<T: serde::de::DeserializeOwned>(
    llm: &dyn Llm,
    messages: &[ChatMessage],
    options: &GenerateOptions,
    purpose: Purpose,
    usage_out: &mut Vec<TokenUsage>,
) -> Result<std::result::Result<T, String>> {
    let reply = match llm.complete(messages, options) {
        Ok(r) => r,
        Err(Error::Cancelled(why)) => return Err(Error::Cancelled(why)),
        Err(e) => return Ok(Err(format!("LLM call failed: {e}"))),
    };
    usage_out.push(usage(&reply, purpose));
    Ok(parse_reply(&reply.text).map_err(|e| format!("unreadable reply: {e}")))
}

/// Raw JSON first, then the first fenced code block (as the authors parse).
fn parse_reply<T: serde::de::DeserializeOwned>(text: &str) -> std::result::Result<T, String> {
    match serde_json::from_str::<T>(text.trim()) {
        Ok(v) => Ok(v),
        Err(first) => {
            let fenced = text
                .split("```")
                .nth(1)
                .map(|b| b.trim_start_matches("json").trim());
            match fenced {
                Some(b) => serde_json::from_str::<T>(b).map_err(|e| e.to_string()),
                None => Err(first.to_string()),
            }
        }
    }
}

/// Clean summary fields: trimmed, non-empty, keys deduplicated case-insensitively.
fn clean_summary(reply: SummaryReply, session: &SessionId, date: Option<&str>) -> SessionSummary {
    // Keys as the authors read them: split on commas, trimmed, lowercased.
    let mut keys: Vec<String> = Vec::new();
    for k in reply.keys.iter().flat_map(|k| k.split(',')) {
        let k = k.trim().to_lowercase();
        if !k.is_empty() && !keys.contains(&k) {
            keys.push(k);
        }
    }
    let themes = reply
        .themes
        .into_iter()
        .filter_map(|t| {
            let (theme, summary) = (t.theme.trim().to_string(), t.summary.trim().to_string());
            (!summary.is_empty()).then_some(Theme { theme, summary })
        })
        .collect();
    SessionSummary {
        session_id: session.to_string(),
        session_time: date.map(str::to_string),
        keys,
        themes,
        key_vectors: Vec::new(),
        turns: 0,
    }
}

/// Makes LiCoMemory's write-path LLM calls.
#[derive(Clone)]
pub struct ChunkWriter {
    llm: Arc<dyn Llm>,
    cfg: LicoMemoryConfig,
}

impl ChunkWriter {
    pub fn new(llm: Arc<dyn Llm>, cfg: LicoMemoryConfig) -> Self {
        ChunkWriter { llm, cfg }
    }

    fn options(&self, schema: Value, cancel: &Cancel) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.cfg.max_output_tokens.max(1),
            temperature: self.cfg.temperature,
            json_schema: Some(schema),
            cancel: cancel.clone(),
            ..Default::default()
        }
    }

    /// The summary call: a new summary of `text`, or `current` updated with it.
    fn summarize(
        &self,
        current: Option<&SessionSummary>,
        session: &SessionId,
        date: Option<&str>,
        text: &str,
        cancel: &Cancel,
        usage_out: &mut Vec<TokenUsage>,
    ) -> Result<std::result::Result<SessionSummary, String>> {
        let day = slash_date(date);
        let (system, user, max_keys) = match current {
            None => (
                prompts::summary_create(&self.cfg, &day),
                format!("Session {session}, date {day}.\nDialogue:\n{text}"),
                self.cfg.summary_max_keys,
            ),
            Some(s) => (
                prompts::summary_update(&self.cfg),
                format!(
                    "Current summary:\n{}\n\nNext part of session {session} (date {day}):\n{text}",
                    s.prompt_json()
                ),
                (s.keys.len() + self.cfg.summary_max_keys).max(self.cfg.summary_max_keys),
            ),
        };
        let messages = [ChatMessage::system(system), ChatMessage::user(user)];
        let options = self.options(
            schema::summary_schema(max_keys, self.cfg.max_themes),
            cancel,
        );
        Ok(call_json::<SummaryReply>(
            self.llm.as_ref(),
            &messages,
            &options,
            Purpose::Encode,
            usage_out,
        )?
        .map(|r| clean_summary(r, session, date)))
    }

    /// The two calls of one chunk (the summary call only in `per_chunk` mode).
    pub fn extract(
        &self,
        store: &dyn StoreLookup,
        ns: &Namespace,
        segment: &Segment,
        cancel: &Cancel,
    ) -> Result<ChunkExtraction> {
        let session = &segment.session;
        let info = store
            .session(ns, session)?
            .ok_or_else(|| Error::NotFound(format!("session {session} in namespace {ns}")))?;
        let date = info.date.clone();
        let turns = store.turn_range(ns, session, segment.first_turn, segment.last_turn)?;
        let text = dialogue_lines(&turns).join("\n");
        let mut out = ChunkExtraction {
            segment: segment.clone(),
            session_date: date.clone(),
            summary: None,
            entities: Vec::new(),
            triples: Vec::new(),
            untyped: Vec::new(),
            usage: Vec::new(),
            calls: 0,
            failure: None,
            extraction_failed: false,
        };
        let mut failures: Vec<String> = Vec::new();
        if self.cfg.summary == LicoSummaryMode::PerChunk {
            let current = SessionSummary::load(store, ns, session)?;
            out.calls += 1;
            match self.summarize(
                current.as_ref(),
                session,
                date.as_deref(),
                &text,
                cancel,
                &mut out.usage,
            )? {
                Ok(mut s) => {
                    s.turns = segment.last_turn + 1;
                    out.summary = Some(s);
                }
                Err(why) => failures.push(format!("summary: {why}")),
            }
        }
        let input = serde_json::json!({
            "text": text,
            "session_time": slash_date(date.as_deref()),
            "session_id": session.as_str(),
        });
        let messages = [
            ChatMessage::system(prompts::EXTRACTION),
            ChatMessage::user(input.to_string()),
        ];
        let options = self.options(
            schema::extraction_schema(
                self.cfg.max_entities_per_chunk,
                self.cfg.max_relations_per_chunk,
            ),
            cancel,
        );
        out.calls += 1;
        match call_json::<ExtractionReply>(
            self.llm.as_ref(),
            &messages,
            &options,
            Purpose::Encode,
            &mut out.usage,
        )? {
            Ok(reply) => {
                let got = read_extraction(reply, self.cfg.entity_merge_jaccard);
                out.entities = got.entities;
                out.triples = got.triples;
                out.untyped = got.untyped.into_iter().collect();
                out.untyped.sort();
            }
            Err(why) => {
                out.extraction_failed = true;
                failures.push(format!("extraction: {why}"));
            }
        }
        out.failure = (!failures.is_empty()).then(|| failures.join("; "));
        Ok(out)
    }

    /// `per_session` mode: one call summarizing a whole session (its text bounded to
    /// `summary_session_chars` from the head and from the tail). `None` when it failed (the
    /// reason is returned), or when the stored summary already covers every turn of the session (a
    /// session flushed again is not summarized again).
    pub fn summarize_session(
        &self,
        store: &dyn MemoryStore,
        ns: &Namespace,
        session: &SessionId,
        cancel: &Cancel,
    ) -> Result<(Option<SessionSummary>, Vec<TokenUsage>, Option<String>)> {
        let info = store
            .session(ns, session)?
            .ok_or_else(|| Error::NotFound(format!("session {session} in namespace {ns}")))?;
        let turns = store.turns(ns, session)?;
        let mut usage = Vec::new();
        let covered = SessionSummary::load(store, ns, session)?.map_or(0, |s| s.turns);
        if turns.is_empty() || covered as usize >= turns.len() {
            return Ok((None, usage, None));
        }
        let text = head_and_tail(
            &dialogue_lines(&turns).join("\n"),
            self.cfg.summary_session_chars,
        );
        match self.summarize(
            None,
            session,
            info.date.as_deref(),
            &text,
            cancel,
            &mut usage,
        )? {
            Ok(mut s) => {
                s.turns = turns.len() as u32;
                Ok((Some(s), usage, None))
            }
            Err(why) => Ok((None, usage, Some(format!("summary: {why}")))),
        }
    }
}

/// Entities deduplicated within the chunk (first seen is canonical) and relations between
/// them, deduplicated on the lowercased (source, target, relation) with the higher strength
/// kept. A relation end that is no listed entity becomes an entity of type concept; a relation
/// from an entity to itself is dropped.
fn read_extraction(reply: ExtractionReply, threshold: f64) -> Extracted {
    let mut entities: Vec<Entity> = Vec::new();
    let canonical = |e: Entity, entities: &mut Vec<Entity>| -> Entity {
        if let Some(found) = entities.iter().find(|x| same_entity(x, &e, threshold)) {
            return found.clone();
        }
        entities.push(e.clone());
        e
    };
    let mut by_name: HashMap<String, Entity> = HashMap::new();
    for x in reply.entities {
        let name = x.name.trim();
        if name.is_empty() {
            continue;
        }
        let kind = EntityType::parse(&x.kind).unwrap_or(EntityType::Concept);
        let e = canonical(
            Entity {
                name: name.to_string(),
                kind,
            },
            &mut entities,
        );
        by_name.entry(name.to_lowercase()).or_insert(e);
    }
    let mut triples: BTreeMap<(String, String, String), Triple> = BTreeMap::new();
    let mut untyped: HashSet<String> = HashSet::new();
    for r in reply.relations {
        let (src, tgt, rel) = (r.source.trim(), r.target.trim(), r.relation.trim());
        if src.is_empty() || tgt.is_empty() || rel.is_empty() {
            continue;
        }
        let mut end = |name: &str| -> Entity {
            match by_name.get(&name.to_lowercase()) {
                Some(e) => e.clone(),
                None => {
                    // An end the model did not list: a listed entity with the same words, of
                    // whatever type; else a new one, typed later from the stored graph.
                    if let Some(e) = entities
                        .iter()
                        .find(|x| word_set(&x.name) == word_set(name))
                        .cloned()
                    {
                        by_name.insert(name.to_lowercase(), e.clone());
                        return e;
                    }
                    untyped.insert(name.to_lowercase());
                    let e = canonical(
                        Entity {
                            name: name.to_string(),
                            kind: EntityType::Concept,
                        },
                        &mut entities,
                    );
                    by_name.insert(name.to_lowercase(), e.clone());
                    e
                }
            }
        };
        let (s, t) = (end(src), end(tgt));
        if word_set(&s.name) == word_set(&t.name) && s.kind == t.kind {
            continue;
        }
        let strength = strength(&r.strength);
        let key = (
            s.name.to_lowercase(),
            t.name.to_lowercase(),
            rel.to_lowercase(),
        );
        let entry = triples.entry(key).or_insert_with(|| Triple {
            source: s.name.clone(),
            relation: rel.to_string(),
            target: t.name.clone(),
            strength,
        });
        entry.strength = entry.strength.max(strength);
    }
    // Entities no relation touches are dropped (the authors delete isolated nodes).
    let touched: HashSet<String> = triples
        .values()
        .flat_map(|t| [t.source.to_lowercase(), t.target.to_lowercase()])
        .collect();
    entities.retain(|e| touched.contains(&e.name.to_lowercase()));
    untyped.retain(|n| entities.iter().any(|e| e.name.to_lowercase() == *n));
    Extracted {
        entities,
        triples: triples.into_values().collect(),
        untyped,
    }
}

/// What [`read_extraction`] keeps of a reply.
struct Extracted {
    entities: Vec<Entity>,
    triples: Vec<Triple>,
    /// Lowercased names of relation ends the model did not list (typed `concept` unless the
    /// stored graph knows them under another type).
    untyped: HashSet<String>,
}

/// A strength that is not a number 1–10 becomes 1.
fn strength(v: &Value) -> u8 {
    let n = match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    match n {
        Some(x) if x.is_finite() && x >= 1.0 => x.min(10.0).round() as u8,
        _ => 1,
    }
}

/// The stored entity an extracted one is (same type, word-set Jaccard at least the threshold),
/// if any: by its key first (equal word sets), then — only for names long enough that unequal
/// word sets can reach the threshold — among the stored entities of its type.
fn stored_entity(
    store: &dyn MemoryStore,
    ns: &Namespace,
    e: &Entity,
    threshold: f64,
    all: &mut Option<Vec<EvidenceNode>>,
) -> Result<Option<EvidenceNode>> {
    if let Some(n) = store.nodes(ns, &[entity_node_id(e)])?.into_iter().next() {
        return Ok(Some(n));
    }
    // Unequal word sets A, B have Jaccard at most 1 - 1/|A ∪ B| and at most |A| / |A ∪ B|, so
    // they reach the threshold t only when |A ∪ B| >= 1/(1 - t) and |A| >= t·|A ∪ B|: a name
    // of fewer than t/(1 - t) words (6 at 0.85) can only match its own key.
    let words = word_set(&e.name).len() as f64;
    let min_union = (1.0 / (1.0 - threshold) - 1e-9).ceil();
    let scan = threshold < 1.0 && words + 1e-9 >= threshold * min_union;
    if scan {
        let nodes = match all {
            Some(n) => n,
            None => all.insert(
                store
                    .all_nodes(ns)?
                    .into_iter()
                    .filter(|n| n.kind == NodeKind::Entity)
                    .collect(),
            ),
        };
        for n in nodes.iter() {
            if let Some(stored) = node_entity(n)
                && same_entity(&stored, e, threshold)
            {
                return Ok(Some(n.clone()));
            }
        }
    }
    Ok(None)
}

/// A stored entity with the same words under any type (for a relation end the extraction did
/// not type), in type order.
fn stored_any_type(
    store: &dyn MemoryStore,
    ns: &Namespace,
    e: &Entity,
) -> Result<Option<EvidenceNode>> {
    let ids: Vec<String> = EntityType::ALL
        .iter()
        .map(|&kind| {
            entity_node_id(&Entity {
                name: e.name.clone(),
                kind,
            })
        })
        .collect();
    Ok(store.nodes(ns, &ids)?.into_iter().next())
}

/// Merges a chunk's extraction with the stored graph and embeds what it writes: the triples
/// (`src - relation - tgt`) as records citing the chunk's turns, the entities (`name (type)`) as
/// entity nodes linking them, and the summary with its key vectors. The caller commits the
/// returned write in one transaction, under the namespace's commit lock.
pub fn organize_chunk(
    ex: ChunkExtraction,
    embedder: &dyn Embedder,
    store: &dyn MemoryStore,
    ns: &Namespace,
    cfg: &LicoMemoryConfig,
) -> Result<SegmentWrite> {
    let seg = &ex.segment;
    let outcome = match (&ex.failure, ex.extraction_failed) {
        (Some(why), true) => SegmentOutcome::Failed { error: why.clone() },
        _ => SegmentOutcome::Encoded,
    };
    let mut write = SegmentWrite::new(seg.clone(), outcome);
    write.usage = ex.usage.clone();
    let turns: Vec<u32> = (seg.first_turn..=seg.last_turn).collect();
    // Canonical entities: each extracted entity mapped to the stored one it is, if any.
    let mut all_nodes: Option<Vec<EvidenceNode>> = None;
    let mut nodes: BTreeMap<String, EvidenceNode> = BTreeMap::new();
    let mut canonical: HashMap<String, String> = HashMap::new(); // lowercased name -> node id
    for e in &ex.entities {
        let untyped = ex.untyped.contains(&e.name.to_lowercase());
        let node = match nodes.get(&entity_node_id(e)) {
            Some(n) => n.clone(),
            None => match stored_entity(store, ns, e, cfg.entity_merge_jaccard, &mut all_nodes)? {
                Some(n) => n,
                None if untyped => {
                    stored_any_type(store, ns, e)?.unwrap_or_else(|| new_entity_node(e))
                }
                None => new_entity_node(e),
            },
        };
        // The first entity of a name is the one its relations meet (as in the extraction).
        canonical
            .entry(e.name.to_lowercase())
            .or_insert_with(|| node.node_id.clone());
        nodes.entry(node.node_id.clone()).or_insert(node);
    }
    let name_of = |id: &str, nodes: &BTreeMap<String, EvidenceNode>| -> Option<String> {
        nodes.get(id).and_then(node_entity).map(|e| e.name)
    };
    let mut records: BTreeMap<String, (Record, [String; 2])> = BTreeMap::new();
    for t in &ex.triples {
        let (Some(src_id), Some(tgt_id)) = (
            canonical.get(&t.source.to_lowercase()).cloned(),
            canonical.get(&t.target.to_lowercase()).cloned(),
        ) else {
            continue;
        };
        if src_id == tgt_id {
            continue;
        }
        let triple = Triple {
            source: name_of(&src_id, &nodes).unwrap_or_else(|| t.source.clone()),
            relation: t.relation.clone(),
            target: name_of(&tgt_id, &nodes).unwrap_or_else(|| t.target.clone()),
            strength: t.strength,
        };
        let r = triple_record(
            ns,
            &triple,
            &seg.session,
            ex.session_date.as_deref(),
            &seg.id,
            turns.clone(),
        );
        match records.get_mut(&r.record_id) {
            Some((kept, _)) => kept.confidence = kept.confidence.max(r.confidence),
            None => {
                records.insert(r.record_id.clone(), (r, [src_id, tgt_id]));
            }
        }
    }
    for (r, ends) in records.values() {
        for id in ends {
            if let Some(n) = nodes.get_mut(id) {
                n.record_ids.insert(r.record_id.clone());
                n.sessions.insert(seg.session.to_string());
                if let Some(e) = node_entity(n) {
                    n.entities.insert(e.name);
                }
            }
        }
    }
    // Only entities a relation links are written (isolated entities are dropped).
    nodes.retain(|_, n| !n.record_ids.is_empty());
    let mut summary = ex.summary;
    let mut texts: Vec<String> = records
        .values()
        .map(|(r, _)| r.normalized_text.clone())
        .collect();
    texts.extend(nodes.values().map(|n| n.label.clone()));
    if let Some(s) = &summary {
        texts.extend(s.keys.iter().cloned());
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut vectors = if refs.is_empty() {
        Vec::new()
    } else {
        embedder.embed(&refs)?
    }
    .into_iter();
    if vectors.len() != texts.len() {
        return Err(Error::Model("the embedder returned too few vectors".into()));
    }
    for (r, _) in records.into_values() {
        write.records.push((r, vectors.next()));
    }
    for n in nodes.into_values() {
        write.nodes.push((n, vectors.next()));
    }
    if let Some(s) = &mut summary {
        s.key_vectors = vectors.by_ref().take(s.keys.len()).collect();
        let value = serde_json::to_value(&*s)
            .map_err(|e| Error::Store(format!("cannot serialize a summary: {e}")))?;
        write
            .state
            .push((seg.session.clone(), SUMMARY_STATE.to_string(), value));
    }
    Ok(write)
}

/// A summary with its key vectors, as the state value a `per_session` summary is stored as.
pub fn summary_state(
    mut summary: SessionSummary,
    embedder: &dyn Embedder,
) -> Result<serde_json::Value> {
    let refs: Vec<&str> = summary.keys.iter().map(String::as_str).collect();
    summary.key_vectors = if refs.is_empty() {
        Vec::new()
    } else {
        embedder.embed(&refs)?
    };
    serde_json::to_value(&summary)
        .map_err(|e| Error::Store(format!("cannot serialize a summary: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(text: &str) -> ExtractionReply {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn extraction_dedups_entities_and_relations_and_drops_isolated_entities() {
        let Extracted {
            entities,
            triples,
            untyped,
        } = read_extraction(
            reply(
                r#"{"entities": [
                    {"name": "Caroline", "type": "person"},
                    {"name": "caroline", "type": "person"},
                    {"name": "Support Group", "type": "organization"},
                    {"name": "Paris", "type": "location"}
                ],
                "relations": [
                    {"source": "Caroline", "target": "support group", "relation": "joined", "strength": 7},
                    {"source": "CAROLINE", "target": "Support Group", "relation": "Joined", "strength": 9},
                    {"source": "Caroline", "target": "Caroline", "relation": "is", "strength": 5},
                    {"source": "Caroline", "target": "painting", "relation": "likes", "strength": "high"}
                ]}"#,
            ),
            0.85,
        );
        let names: Vec<(&str, EntityType)> =
            entities.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(
            names,
            [
                ("Caroline", EntityType::Person),
                ("Support Group", EntityType::Organization),
                ("painting", EntityType::Concept),
            ]
        );
        assert_eq!(untyped, HashSet::from(["painting".to_string()]));
        let texts: Vec<(String, u8)> = triples.iter().map(|t| (t.text(), t.strength)).collect();
        assert_eq!(
            texts,
            [
                ("Caroline - likes - painting".to_string(), 1),
                ("Caroline - joined - Support Group".to_string(), 9),
            ]
        );
    }

    #[test]
    fn replies_parse_raw_or_fenced_and_strengths_default_to_one() {
        let fenced = "Here:\n```json\n{\"keys\": [\"a\"], \"themes\": []}\n```";
        let s: SummaryReply = parse_reply(fenced).unwrap();
        assert_eq!(s.keys, ["a"]);
        assert!(parse_reply::<SummaryReply>("no json").is_err());
        assert_eq!(strength(&serde_json::json!(7)), 7);
        assert_eq!(strength(&serde_json::json!(42)), 10);
        assert_eq!(strength(&serde_json::json!("x")), 1);
        assert_eq!(strength(&serde_json::json!(null)), 1);
        assert_eq!(strength(&serde_json::json!(-3)), 1);
    }
}
