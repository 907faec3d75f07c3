//! LiCoMemory's read path (docs/licomemory.md, "Read path"; SPEC-licomemory §3): the question's
//! typed entities (one call), anchor entities, the candidate triple pool, session relevance,
//! CogniRank (or SimpleRank), and the chunks the ranked triples came from. The result is a
//! [`SearchResult`] whose evidence items are the chunks (so evidence recall is counted on them
//! like on any other strategy's items) and whose context blocks hold the session summaries and
//! the triples.

use lycheemem_core::config::LicoMemoryConfig;
use lycheemem_core::{
    Cancel, CandidateTarget, Error, Evidence, NodeKind, Plan, Provenance, Purpose, Record, Result,
    Role, SessionId, TokenUsage, TurnRef, vector::dot,
};
use lycheemem_embed::Embedder;
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm};
use lycheemem_retrieve::{ContextBlock, EvidenceItem, SearchResult};
use lycheemem_store::{ItemRef, MemoryStore, SegmentRow, Target, VectorQuery};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use crate::graph::{Entity, EntityType, entity_label, node_entity};
use crate::rank;
use crate::write::{SessionSummary, call_json, dialogue_lines, slash_date};
use crate::{prompts, schema};

#[derive(Debug, Deserialize)]
struct QueryEntity {
    name: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct QueryEntities {
    entities: Vec<QueryEntity>,
}

/// The question's entities as extracted (cached by callers that replay questions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueryAnalysis {
    pub entities: Vec<Entity>,
    /// Why no entities came back (failed call, unreadable reply), if so.
    pub fallback: Option<String>,
    pub usage: Option<TokenUsage>,
}

/// The question's typed entities: one call at the question time.
pub fn query_entities(
    llm: &dyn Llm,
    question: &str,
    question_date: Option<&str>,
    cfg: &LicoMemoryConfig,
    cancel: &Cancel,
) -> Result<QueryAnalysis> {
    let messages = [
        ChatMessage::system(prompts::QUERY_ENTITIES),
        ChatMessage::user(format!(
            "Question time: {}\nQuestion: {}",
            slash_date(question_date),
            question.trim()
        )),
    ];
    let options = GenerateOptions {
        max_tokens: cfg.max_output_tokens.max(1),
        temperature: cfg.temperature,
        json_schema: Some(schema::query_entities_schema(cfg.max_query_entities)),
        cancel: cancel.clone(),
        ..Default::default()
    };
    let mut usage = Vec::new();
    let reply = call_json::<QueryEntities>(llm, &messages, &options, Purpose::Plan, &mut usage)?;
    let usage = usage.pop();
    Ok(match reply {
        Ok(r) => {
            let mut entities: Vec<Entity> = Vec::new();
            for e in r.entities {
                let name = e.name.trim();
                if name.is_empty() {
                    continue;
                }
                let ent = Entity {
                    name: name.to_string(),
                    kind: EntityType::parse(&e.kind).unwrap_or(EntityType::Concept),
                };
                if !entities.contains(&ent) {
                    entities.push(ent);
                }
            }
            QueryAnalysis {
                fallback: entities
                    .is_empty()
                    .then(|| "no query entities extracted".to_string()),
                entities,
                usage,
            }
        }
        Err(why) => QueryAnalysis {
            entities: Vec::new(),
            fallback: Some(why),
            usage,
        },
    })
}

/// One question for [`LicoRetriever::search`].
pub struct LicoRequest<'a> {
    pub question: &'a str,
    /// The question's date (ISO or any accepted format): the decay and relative dates use it.
    pub reference_date: Option<&'a str>,
    /// Entities extracted before (e.g. a replayed run); `None` makes the call.
    pub analysis: Option<&'a QueryAnalysis>,
    pub cancel: Cancel,
}

/// LiCoMemory's retrieval over a store.
pub struct LicoRetriever<'a> {
    pub store: &'a dyn MemoryStore,
    pub embedder: &'a dyn Embedder,
    /// The query-entity LLM (`None`: the question's words stand in for its entities).
    pub llm: Option<&'a dyn Llm>,
    pub cfg: &'a LicoMemoryConfig,
}

/// A triple in the pool: its records (one per session that stated it), each with its gap Δτ
/// to the question date in days (0 when either date is missing).
struct PooledTriple {
    text: String,
    /// `(src, rel, tgt)` as the answer prompt shows it.
    line: String,
    records: Vec<(Record, f64)>,
    /// cos(question, triple).
    cos: f32,
    pre: f32,
    score: f32,
}

/// A stored chunk: a segment of one session.
struct Chunk {
    session: SessionId,
    first: u32,
    last: u32,
    score: f32,
}

impl LicoRetriever<'_> {
    fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let v = self.embedder.embed(&refs)?;
        if v.len() != texts.len() {
            return Err(Error::Model("the embedder returned too few vectors".into()));
        }
        Ok(v)
    }

    /// Retrieves the chunks, triples and summaries for a question.
    pub fn search(
        &self,
        ns: &lycheemem_core::Namespace,
        req: &LicoRequest<'_>,
    ) -> Result<SearchResult> {
        let cfg = self.cfg;
        if cfg.top_chunks > lycheemem_retrieve::MAX_TOP_K {
            return Err(Error::InvalidInput(format!(
                "{} chunks asked for: the limit is {}",
                cfg.top_chunks,
                lycheemem_retrieve::MAX_TOP_K
            )));
        }
        // A question without a date is asked today (the decay and relative dates need one).
        let today = chrono::Utc::now()
            .date_naive()
            .format("%Y-%m-%d")
            .to_string();
        let question_date = Some(req.reference_date.unwrap_or(&today));
        let mut timings: BTreeMap<&'static str, f64> = BTreeMap::new();
        let clock = Instant::now();
        let analysis = match (req.analysis, self.llm) {
            (Some(a), _) => a.clone(),
            (None, Some(llm)) => {
                query_entities(llm, req.question, question_date, cfg, &req.cancel)?
            }
            (None, None) => QueryAnalysis {
                entities: Vec::new(),
                fallback: Some("no query-entity LLM".into()),
                usage: None,
            },
        };
        timings.insert("plan", clock.elapsed().as_secs_f64() * 1e3);
        req.cancel.check("a LiCoMemory search")?;

        // Embeddings: the question, each entity as `name (type)` (anchors) and by its name
        // (session keys); without entities the question's words stand in for the key match.
        let clock = Instant::now();
        let mut texts = vec![req.question.trim().to_string()];
        let key_queries: Vec<String> = if analysis.entities.is_empty() {
            question_words(req.question, cfg.query_word_min_len)
        } else {
            analysis.entities.iter().map(|e| e.name.clone()).collect()
        };
        texts.extend(analysis.entities.iter().map(entity_label));
        texts.extend(key_queries.iter().cloned());
        let mut vectors = self.embed(&texts)?.into_iter();
        let question_vec = vectors.next().unwrap_or_default();
        let entity_vecs: Vec<Vec<f32>> = vectors.by_ref().take(analysis.entities.len()).collect();
        let key_vecs: Vec<Vec<f32>> = vectors.collect();
        timings.insert("embed", clock.elapsed().as_secs_f64() * 1e3);

        let clock = Instant::now();
        // Anchors: the best entities by `0.7 cos + 0.3 [same type]` over the query entities
        // (the question itself, untyped, when there are none).
        let queries: Vec<(&[f32], Option<EntityType>)> = if analysis.entities.is_empty() {
            vec![(question_vec.as_slice(), None)]
        } else {
            analysis
                .entities
                .iter()
                .zip(&entity_vecs)
                .map(|(e, v)| (v.as_slice(), Some(e.kind)))
                .collect()
        };
        let mut candidates: Vec<String> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        for (v, _) in &queries {
            let hits = self.store.vector_search(
                ns,
                &VectorQuery::new(
                    Target::Node(NodeKind::Entity),
                    v.to_vec(),
                    cfg.anchor_candidates.max(cfg.anchor_entities),
                ),
            )?;
            for h in hits {
                if let ItemRef::Node(id) = h.item
                    && seen.insert(id.clone())
                {
                    candidates.push(id);
                }
            }
        }
        let refs: Vec<ItemRef> = candidates.iter().cloned().map(ItemRef::Node).collect();
        let cand_vecs = self.store.scoring_vectors(ns, &refs)?;
        let nodes: HashMap<String, lycheemem_core::EvidenceNode> = self
            .store
            .nodes(ns, &candidates)?
            .into_iter()
            .map(|n| (n.node_id.clone(), n))
            .collect();
        let mut scored: Vec<(f32, String)> = Vec::new();
        for (id, vec) in candidates.iter().zip(&cand_vecs) {
            let (Some(vec), Some(node)) = (vec, nodes.get(id)) else {
                continue;
            };
            let kind = node_entity(node).map(|e| e.kind);
            let best = queries
                .iter()
                .map(|(q, t)| rank::anchor_score(dot(q, vec), t.is_some() && *t == kind, cfg))
                .fold(f32::NEG_INFINITY, f32::max);
            scored.push((best, id.clone()));
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        scored.truncate(cfg.anchor_entities);
        let anchors: Vec<&lycheemem_core::EvidenceNode> =
            scored.iter().filter_map(|(_, id)| nodes.get(id)).collect();
        let anchor_rank: HashMap<String, usize> = anchors
            .iter()
            .enumerate()
            .filter_map(|(r, n)| node_entity(n).map(|e| (e.name.to_lowercase(), r)))
            .rev()
            .collect();

        // The pool: every triple touching an anchor, pre-scored, the best `pool_size` kept.
        let mut record_ids: Vec<String> = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for n in &anchors {
            for id in &n.record_ids {
                if seen.insert(id) {
                    record_ids.push(id.clone());
                }
            }
        }
        let records = self.store.records(ns, &record_ids)?;
        let rec_refs: Vec<ItemRef> = records
            .iter()
            .map(|r| ItemRef::Record(r.record_id.clone()))
            .collect();
        let rec_vecs = self.store.scoring_vectors(ns, &rec_refs)?;
        let mut pool: BTreeMap<String, PooledTriple> = BTreeMap::new();
        for (r, v) in records.into_iter().zip(rec_vecs) {
            let cos = v.as_deref().map_or(0.0, |v| dot(&question_vec, v));
            let rank_of = |i: usize| {
                r.entities
                    .get(i)
                    .and_then(|n| anchor_rank.get(&n.to_lowercase()).copied())
                    .unwrap_or(cfg.anchor_entities)
            };
            let pre = rank::pre_score(cos, rank_of(0), rank_of(1), cfg);
            let key = r.semantic_text.to_lowercase();
            let line = match (r.entities.as_slice(), r.tags.first()) {
                ([src, tgt], Some(rel)) => format!("({src}, {rel}, {tgt})"),
                _ => format!("({})", r.semantic_text),
            };
            let t = pool.entry(key).or_insert_with(|| PooledTriple {
                text: r.semantic_text.clone(),
                line,
                records: Vec::new(),
                cos,
                pre,
                score: 0.0,
            });
            t.pre = t.pre.max(pre);
            t.cos = t.cos.max(cos);
            let gap = rank::day_gap(question_date, r.created_at.as_deref()).unwrap_or(0.0);
            t.records.push((r, gap));
        }
        let mut pool: Vec<PooledTriple> = pool.into_values().collect();
        pool.sort_by(|a, b| b.pre.total_cmp(&a.pre).then_with(|| a.text.cmp(&b.text)));
        pool.truncate(cfg.pool_size());
        timings.insert("recall", clock.elapsed().as_secs_f64() * 1e3);

        // Session relevance of every session with a summary.
        let clock = Instant::now();
        let mut summaries: Vec<(f32, SessionSummary)> = Vec::new();
        for s in self.store.sessions(ns)? {
            if let Some(summary) = SessionSummary::load(self.store, ns, &s.id)? {
                let ss = summary.relevance(&key_vecs, cfg.session_key_top);
                summaries.push((ss, summary));
            }
        }
        let ss_of: HashMap<&str, f32> = summaries
            .iter()
            .map(|(ss, s)| (s.session_id.as_str(), *ss))
            .collect();

        // CogniRank (or SimpleRank) per provenance entry; a triple scores its best entry.
        let gaps: Vec<f64> = pool
            .iter()
            .flat_map(|t| t.records.iter().map(|(_, gap)| *gap))
            .collect();
        let scale = rank::decay_scale(&gaps, cfg);
        for t in &mut pool {
            let mut best = f32::NEG_INFINITY;
            for (r, gap) in &t.records {
                let ss = ss_of.get(r.source_session.as_str()).copied().unwrap_or(0.0);
                best = best.max(rank::triple_score(t.cos, ss, *gap, scale, cfg));
            }
            t.score = best;
            // The most relevant entry first: its chunks are collected first.
            t.records.sort_by(|(a, ga), (b, gb)| {
                ga.total_cmp(gb).then_with(|| a.record_id.cmp(&b.record_id))
            });
        }
        pool.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then_with(|| a.text.cmp(&b.text))
        });
        pool.truncate(cfg.top_triples);
        timings.insert("score", clock.elapsed().as_secs_f64() * 1e3);

        // Chunks: the segments holding the ranked triples' turns, in triple order.
        let clock = Instant::now();
        let mut segments: HashMap<SessionId, Vec<SegmentRow>> = HashMap::new();
        let mut chunks: Vec<Chunk> = Vec::new();
        'collect: for t in &pool {
            for (r, _) in &t.records {
                if !segments.contains_key(&r.source_session) {
                    let rows = self.store.segments(ns, &r.source_session)?;
                    segments.insert(r.source_session.clone(), rows);
                }
                let rows = &segments[&r.source_session];
                for turn in &r.evidence_turns {
                    let Some(row) = rows
                        .iter()
                        .find(|s| s.segment.first_turn <= *turn && *turn <= s.segment.last_turn)
                    else {
                        continue;
                    };
                    let seg = &row.segment;
                    if chunks
                        .iter()
                        .any(|c| c.session == seg.session && c.first == seg.first_turn)
                    {
                        continue;
                    }
                    if chunks.len() >= cfg.top_chunks {
                        break 'collect;
                    }
                    chunks.push(Chunk {
                        session: seg.session.clone(),
                        first: seg.first_turn,
                        last: seg.last_turn,
                        score: t.score,
                    });
                }
            }
        }
        let mut evidence = Vec::new();
        let mut dates: HashMap<SessionId, Option<String>> = HashMap::new();
        for c in &chunks {
            if !dates.contains_key(&c.session) {
                let d = self.store.session(ns, &c.session)?.and_then(|s| s.date);
                dates.insert(c.session.clone(), d);
            }
            let turns = self.store.turn_range(ns, &c.session, c.first, c.last)?;
            let dialogue = dialogue_lines(&turns);
            // `chunk_full = false` shows only the user's turns; the item still cites them all.
            let text = if cfg.chunk_full {
                dialogue.join("\n")
            } else {
                turns
                    .iter()
                    .zip(&dialogue)
                    .filter(|(t, _)| t.role == Role::User)
                    .map(|(_, l)| l.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            evidence.push(EvidenceItem {
                evidence: Evidence {
                    target: CandidateTarget::Turns {
                        first: TurnRef {
                            session: c.session.clone(),
                            index: c.first,
                        },
                        last_index: c.last,
                    },
                    text,
                    best_route_score: c.score,
                    rrf: 0.0,
                    final_score: c.score,
                    mmr_score: c.score,
                    provenance: Provenance::default(),
                },
                session: c.session.to_string(),
                session_date: dates[&c.session].clone(),
                memory_type: None,
                temporal: Default::default(),
                entities: Vec::new(),
                turns: turns.iter().map(|t| t.index).collect(),
                dialogue,
                focus_turns: Vec::new(),
            });
        }

        // Context: the most relevant session summaries, then the triples.
        summaries.sort_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then_with(|| a.1.session_id.cmp(&b.1.session_id))
        });
        let mut context: Vec<ContextBlock> = summaries
            .iter()
            .take(cfg.top_summaries)
            .map(|(_, s)| summary_block(s))
            .collect();
        if !pool.is_empty() {
            context.push(ContextBlock {
                title: "Triples".into(),
                lines: pool.iter().map(|t| t.line.clone()).collect(),
            });
        }
        timings.insert("fusion", clock.elapsed().as_secs_f64() * 1e3);
        Ok(SearchResult {
            plan: Plan::single_route(req.question),
            plan_fallback: analysis.fallback.clone(),
            k: cfg.top_chunks,
            evidence,
            usage: analysis.usage.clone().into_iter().collect(),
            timings,
            stages: Vec::new(),
            dropped: Vec::new(),
            context,
            candidates: Default::default(),
        })
    }
}

/// A session summary as a context block: `Session id (date)`, its keys, then each theme.
pub fn summary_block(s: &SessionSummary) -> ContextBlock {
    let mut lines = vec![format!("Keys: {}", s.keys.join(", "))];
    lines.extend(
        s.themes
            .iter()
            .map(|t| format!("{}: {}", t.theme, t.summary)),
    );
    ContextBlock {
        title: format!(
            "Session {} ({})",
            s.session_id,
            slash_date(s.session_time.as_deref())
        ),
        lines,
    }
}

/// The question's words of at least `min_len` letters, lowercased, each once.
pub fn question_words(question: &str, min_len: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in question.split(|c: char| !c.is_alphanumeric()) {
        let w = w.to_lowercase();
        if w.chars().filter(|c| c.is_alphabetic()).count() >= min_len && !out.contains(&w) {
            out.push(w);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_words_keep_words_of_three_letters_or_more_once() {
        assert_eq!(
            question_words("When did Caroline go to the LGBTQ group? When?", 3),
            ["when", "did", "caroline", "the", "lgbtq", "group"]
        );
    }
}
