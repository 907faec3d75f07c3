//! The two baselines that build no memory, answering with the same answer prompt as lycheemem:
//! `naive_rag` (fixed chunks of raw turns, vector top-k) and `full_context` (the whole history,
//! newest sessions kept when it does not fit the answer model's context).

use crate::dataset::Item;
use anyhow::Result;
use lycheemem::EvidenceItem;
use lycheemem_core::date::normalize_date;
use lycheemem_core::{
    CandidateTarget, Evidence, Provenance, Role, SessionId, TemporalScope, TurnRef, estimate_tokens,
};
use lycheemem_embed::Embedder;

/// One chunk: `turns` consecutive turns of a session, as one snippet.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub session: String,
    pub session_date: Option<String>,
    pub first: u32,
    pub text: String,
    pub turns: Vec<u32>,
}

fn speaker_line(t: &lycheemem::NewTurn) -> String {
    let who = t.speaker.clone().unwrap_or_else(|| match t.role {
        Role::Assistant => "assistant".into(),
        Role::System => "system".into(),
        Role::User => "user".into(),
    });
    format!("{who}: {}", t.text)
}

/// Splits every session into chunks of `size` turns (the last chunk of a session may be
/// shorter; chunks never cross sessions).
pub fn chunks(item: &Item, size: usize) -> Vec<Chunk> {
    let size = size.max(1);
    let mut out = Vec::new();
    for s in &item.sessions {
        let date = s
            .date
            .as_deref()
            .map(|d| normalize_date(d).unwrap_or(d.into()));
        for (c, group) in s.turns.chunks(size).enumerate() {
            let first = (c * size) as u32;
            out.push(Chunk {
                session: s.id.clone(),
                session_date: date.clone(),
                first,
                text: group
                    .iter()
                    .map(speaker_line)
                    .collect::<Vec<_>>()
                    .join("\n"),
                turns: (first..first + group.len() as u32).collect(),
            });
        }
    }
    out
}

fn snippet(
    session: &str,
    date: Option<String>,
    first: u32,
    turns: Vec<u32>,
    text: String,
    score: f32,
) -> Result<EvidenceItem> {
    Ok(EvidenceItem {
        evidence: Evidence {
            target: CandidateTarget::Turns {
                first: TurnRef {
                    session: SessionId::new(session)?,
                    index: first,
                },
                last_index: turns.last().copied().unwrap_or(first),
            },
            text,
            best_route_score: score,
            rrf: 0.0,
            final_score: score,
            mmr_score: score,
            provenance: Provenance::default(),
        },
        session: session.to_string(),
        session_date: date,
        memory_type: None,
        temporal: TemporalScope::default(),
        entities: Vec::new(),
        turns,
        // The prompt shortens a chunk by its lines, from both ends.
        dialogue: Vec::new(),
        focus_turns: Vec::new(),
    })
}

/// Vector index over an item's chunks (exact search; a conversation is small).
pub struct ChunkIndex {
    chunks: Vec<Chunk>,
    vectors: Vec<Vec<f32>>,
}

impl ChunkIndex {
    pub fn build(item: &Item, size: usize, embedder: &dyn Embedder) -> Result<ChunkIndex> {
        let chunks = chunks(item, size);
        let mut vectors = Vec::with_capacity(chunks.len());
        for batch in chunks.chunks(64) {
            let texts: Vec<&str> = batch.iter().map(|c| c.text.as_str()).collect();
            vectors.extend(embedder.embed(&texts)?);
        }
        Ok(ChunkIndex { chunks, vectors })
    }

    /// The `k` chunks most similar to the question, best first.
    pub fn search(
        &self,
        question: &str,
        k: usize,
        embedder: &dyn Embedder,
    ) -> Result<Vec<EvidenceItem>> {
        let q = embedder.embed(&[question])?.pop().unwrap_or_default();
        let mut scored: Vec<(f32, usize)> = self
            .vectors
            .iter()
            .enumerate()
            .map(|(i, v)| (lycheemem_core::vector::dot(&q, v), i))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scored
            .into_iter()
            .take(k)
            .map(|(score, i)| {
                let c = &self.chunks[i];
                snippet(
                    &c.session,
                    c.session_date.clone(),
                    c.first,
                    c.turns.clone(),
                    c.text.clone(),
                    score,
                )
            })
            .collect()
    }
}

/// The whole history as one snippet per session, oldest first, keeping the newest sessions that
/// fit in `budget_tokens`. Returns the items and how many sessions were dropped.
pub fn full_context(item: &Item, budget_tokens: usize) -> Result<(Vec<EvidenceItem>, usize)> {
    let mut kept = Vec::new();
    let mut used = 0usize;
    for s in item.sessions.iter().rev() {
        if s.turns.is_empty() {
            continue;
        }
        let text = s
            .turns
            .iter()
            .map(speaker_line)
            .collect::<Vec<_>>()
            .join("\n");
        let cost = estimate_tokens(&text) as usize + 16;
        if used + cost > budget_tokens {
            break;
        }
        used += cost;
        let date = s
            .date
            .as_deref()
            .map(|d| normalize_date(d).unwrap_or(d.into()));
        kept.push(snippet(
            &s.id,
            date,
            0,
            (0..s.turns.len() as u32).collect(),
            text,
            1.0,
        )?);
    }
    let non_empty = item.sessions.iter().filter(|s| !s.turns.is_empty()).count();
    let dropped = non_empty - kept.len();
    kept.reverse();
    Ok((kept, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Session;
    use lycheemem::NewTurn;

    fn item() -> Item {
        let session = |id: &str, n: usize| Session {
            id: id.into(),
            date: Some("2024-01-02".into()),
            turns: (0..n)
                .map(|i| NewTurn::spoken("Ann", format!("{id} turn {i} about gardening")))
                .collect(),
            origins: vec![Default::default(); n],
        };
        Item {
            id: "x".into(),
            sessions: vec![session("s1", 5), session("s2", 3)],
            questions: vec![],
        }
    }

    #[test]
    fn chunks_stay_inside_sessions() {
        let c = chunks(&item(), 2);
        let shape: Vec<(&str, Vec<u32>)> = c
            .iter()
            .map(|c| (c.session.as_str(), c.turns.clone()))
            .collect();
        assert_eq!(
            shape,
            vec![
                ("s1", vec![0, 1]),
                ("s1", vec![2, 3]),
                ("s1", vec![4]),
                ("s2", vec![0, 1]),
                ("s2", vec![2])
            ]
        );
        assert!(c[0].text.starts_with("Ann: s1 turn 0"));
    }

    #[test]
    fn naive_rag_finds_the_matching_chunk() {
        let embedder = lycheemem_testkit::HashEmbedder::new(64);
        let index = ChunkIndex::build(&item(), 1, &embedder).unwrap();
        let top = index
            .search("s2 turn 1 about gardening", 3, &embedder)
            .unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].session, "s2");
        assert_eq!(top[0].turns, vec![1]);
    }

    #[test]
    fn full_context_keeps_the_newest_sessions_that_fit() {
        let (all, dropped) = full_context(&item(), 100_000).unwrap();
        assert_eq!((all.len(), dropped), (2, 0));
        assert_eq!(all[0].session, "s1");
        let small = estimate_tokens(&"Ann: s2 turn 0 about gardening\n".repeat(3)) as usize + 20;
        let (some, dropped) = full_context(&item(), small).unwrap();
        assert_eq!((some.len(), dropped), (1, 1));
        assert_eq!(some[0].session, "s2");
    }
}
