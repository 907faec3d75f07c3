//! Two `Memory` values on one PostgreSQL store, as two server replicas hold it: concurrent
//! appends to the same sessions through both lose no turn and duplicate none, and every segment
//! is encoded (one LLM call) and stored exactly once. Needs `LYCHEEMEM_TEST_POSTGRES_URL`.

use lycheemem::{Components, Memory, NewTurn};
use lycheemem_core::{Config, Namespace, SessionId};
use lycheemem_testkit::{ScriptedLlm, minilm};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

fn components(embedder: Arc<dyn lycheemem_embed::Embedder>) -> (Components, Arc<ScriptedLlm>) {
    let encoder = Arc::new(ScriptedLlm::echo_encoder());
    let other = Arc::new(ScriptedLlm::pipeline("unused"));
    (
        Components {
            embedder,
            reranker: None,
            encode_llm: encoder.clone(),
            plan_llm: other.clone(),
            answer_llm: other,
        },
        encoder,
    )
}

#[test]
fn two_memories_on_one_postgres_store_lose_no_turn_and_encode_each_segment_once() {
    let url = lycheemem_testkit::postgres_test_url();
    let mut config = Config::default();
    config.store.postgres_schema = lycheemem_testkit::unique_schema("replicas");
    let embedder: Arc<dyn lycheemem_embed::Embedder> = Arc::new(minilm());
    let (ca, enc_a) = components(embedder.clone());
    let (cb, enc_b) = components(embedder);
    let one = Memory::with_components(Path::new(&url), config.clone(), ca).unwrap();
    let two = Memory::with_components(Path::new(&url), config, cb).unwrap();
    let ns = Namespace::new("team").unwrap();
    let sessions = [SessionId::new("s0").unwrap(), SessionId::new("s1").unwrap()];
    let topics = [
        "my garden",
        "a trip to Lisbon",
        "the cello",
        "a new job",
        "marathon training",
    ];
    // Four writers, two per replica, each sending 8 exchanges alternately to both sessions.
    std::thread::scope(|s| {
        for w in 0..4usize {
            let memory = if w % 2 == 0 { &one } else { &two };
            let (ns, sessions) = (&ns, &sessions);
            s.spawn(move || {
                for i in 0..8usize {
                    let session = &sessions[(w + i) % 2];
                    let topic = topics[(w * 3 + i) % topics.len()];
                    memory
                        .add_turns(
                            ns,
                            session,
                            Some("2024-05-01"),
                            vec![
                                NewTurn::user(format!(
                                    "writer {w} message {i}: let me tell you about {topic}"
                                )),
                                NewTurn::assistant(format!(
                                    "reply {i} to writer {w} about {topic}"
                                )),
                            ],
                        )
                        .unwrap();
                }
            });
        }
    });
    for session in &sessions {
        one.flush(&ns, session).unwrap();
    }
    let store = one.store();
    let mut records = 0usize;
    let mut segments = 0usize;
    let mut texts = BTreeSet::new();
    for session in &sessions {
        let turns = store.turns(&ns, session).unwrap();
        // Indexes are 0..n without a gap, every pair is kept together, nothing is doubled.
        for (i, t) in turns.iter().enumerate() {
            assert_eq!(t.index as usize, i);
            assert!(
                texts.insert(t.text.clone()),
                "turn stored twice: {}",
                t.text
            );
        }
        for pair in turns.chunks(2) {
            let (user, reply) = (&pair[0].text, &pair[1].text);
            let tag = user
                .split(':')
                .next()
                .unwrap()
                .replace("writer ", "")
                .replace(" message ", "/");
            let (w, i) = tag.split_once('/').unwrap();
            assert!(
                reply.starts_with(&format!("reply {i} to writer {w} ")),
                "{user} / {reply}"
            );
        }
        // Every turn lies in exactly one stored segment, and segments are in order.
        let segs = store.segments(&ns, session).unwrap();
        let mut next = 0u32;
        for row in &segs {
            assert_eq!(
                row.segment.first_turn, next,
                "a gap or an overlap in {session}"
            );
            next = row.segment.last_turn + 1;
            assert!(matches!(
                row.outcome,
                lycheemem_store::SegmentOutcome::Encoded
            ));
        }
        assert_eq!(
            next as usize,
            turns.len(),
            "{session} is not fully segmented"
        );
        segments += segs.len();
        records += store
            .records_page(&ns, Some(session), 0, usize::MAX)
            .unwrap()
            .0;
    }
    assert_eq!(
        texts.len(),
        4 * 8 * 2,
        "every acknowledged turn is stored once"
    );
    // One encoder call per segment across both replicas: none encoded twice.
    assert_eq!(enc_a.calls() + enc_b.calls(), segments);
    // The echo encoder states one record per turn.
    assert_eq!(records, texts.len());
}
