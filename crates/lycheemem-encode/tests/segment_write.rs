//! From finalized segments to committed store writes, with a scripted LLM, the bag-of-words
//! test embedder and a real store: nodes merge across segments, ρ is persisted and feeds the
//! next prompt, failures are recorded without records, usage is logged.

use lycheemem_core::config::{EncodeConfig, OrganizeConfig};
use lycheemem_core::{FinalizeReason, Namespace, Purpose, Role, Segment, SessionId, Turn};
use lycheemem_encode::{REFERENCE_STATE, SegmentEncoder, build_segment_write};
use lycheemem_store::prelude::*;
use lycheemem_store::{SegmentOutcome, SessionInfo, Store, StoreOptions};
use lycheemem_testkit::{HashEmbedder, ScriptedLlm};
use std::sync::Arc;

const FIRST: &str = r#"{"records": [
 {"memory_type": "event", "semantic_text": "Caroline adopted a dog named Rex.", "entities": ["Caroline", "Rex"], "tags": ["pets"], "temporal": {"t_ref": "yesterday", "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0], "source_role": "user"}
], "disambiguation_context": "Caroline is the user; Rex is her dog."}"#;

const SECOND: &str = r#"{"records": [
 {"memory_type": "fact", "semantic_text": "Caroline walks Rex every morning.", "entities": ["Caroline", "Rex"], "tags": ["pets", "routine"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0, 1], "source_role": "user"}
], "disambiguation_context": "Caroline is the user."}"#;

fn segment(session: &SessionId, first: u32, last: u32) -> Segment {
    Segment {
        id: Segment::make_id(session, first, last),
        session: session.clone(),
        first_turn: first,
        last_turn: last,
        exchanges: last - first + 1,
        tokens: 20,
        reason: FinalizeReason::SemanticBoundary,
    }
}

/// A store with session `s1` of namespace `alice` holding `texts` as alternating user /
/// assistant turns, embedded by the bag-of-words embedder.
fn store_with_turns(
    dims: usize,
    date: Option<&str>,
    texts: &[&str],
) -> (tempfile::TempDir, Store, HashEmbedder) {
    let dir = tempfile::tempdir().unwrap();
    let embedder = HashEmbedder::new(dims);
    let store = Store::open(dir.path(), StoreOptions::new(dims)).unwrap();
    let ns = Namespace::new("alice").unwrap();
    let s = SessionId::new("s1").unwrap();
    store
        .put_session(&ns, SessionInfo::new(s.clone(), date.map(String::from)))
        .unwrap();
    let turns = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            let turn = Turn {
                session: s.clone(),
                index: i as u32,
                role,
                speaker: None,
                text: t.to_string(),
                time: None,
            };
            (turn, Some(embedder.embed_one(t)))
        })
        .collect();
    store.add_turns(&ns, turns).unwrap();
    (dir, store, embedder)
}

#[test]
fn segments_become_records_nodes_and_reference_context() {
    let (_dir, store, embedder) = store_with_turns(
        32,
        Some("8 May, 2023"),
        &[
            "I adopted a dog yesterday!",
            "Congratulations, what's his name?",
            "Rex. I walk him every morning.",
            "Lovely routine.",
        ],
    );
    let ns = Namespace::new("alice").unwrap();
    let s = SessionId::new("s1").unwrap();

    let llm = Arc::new(ScriptedLlm::new(&[
        FIRST,
        SECOND,
        "nonsense",
        "still nonsense",
    ]));
    // The published ρ, with the session's last records (the default carries the note only).
    let encoder = SegmentEncoder::new(
        llm.clone(),
        EncodeConfig {
            reference_records: 12,
            ..Default::default()
        },
    );
    let organize = OrganizeConfig::default();
    for (first, last) in [(0, 1), (2, 3)] {
        let built = build_segment_write(
            &encoder,
            &embedder,
            &organize,
            &store,
            &ns,
            &segment(&s, first, last),
        )
        .unwrap();
        assert_eq!(built.outcome.failure, None);
        assert!(built.write.records.iter().all(|(_, v)| v.is_some()));
        store.commit_segment(&ns, built.write).unwrap();
    }
    // The second prompt carries ρ from the first segment.
    let second_prompt = &llm.prompts()[1][1].content;
    assert!(second_prompt.contains("Rex is her dog"), "{second_prompt}");
    assert!(second_prompt.contains("Caroline adopted a dog named Rex."));
    // "yesterday" resolved against the session date; temporal nodes exist for it.
    let records = store.all_records(&ns).unwrap();
    assert_eq!(records.len(), 2);
    let adopted = records
        .iter()
        .find(|r| r.semantic_text.contains("adopted"))
        .unwrap();
    assert_eq!(adopted.temporal.t_ref.as_deref(), Some("2023-05-07"));
    assert_eq!(adopted.evidence_turns, vec![0]);
    let walks = records
        .iter()
        .find(|r| r.semantic_text.contains("walks"))
        .unwrap();
    assert_eq!(
        walks.evidence_turns,
        vec![2, 3],
        "local indices become absolute"
    );
    assert_eq!(
        store
            .temporal_nodes(&ns, "2023-05-01", "2023-05-31")
            .unwrap()
            .len(),
        2
    );
    // Entity nodes merged across segments.
    let caroline = store
        .nodes(&ns, &["entity:caroline".to_string()])
        .unwrap()
        .remove(0);
    assert_eq!(caroline.record_ids.len(), 2);
    assert!(caroline.search_text.contains("adopted") && caroline.search_text.contains("walks"));
    let stats = store.stats(&ns).unwrap();
    assert_eq!(stats.pending_vectors, 0);
    assert_eq!(stats.vectors, stats.indexed_vectors);
    assert_eq!(stats.usage.by_purpose[&Purpose::Encode].calls, 2);
    let rho = store.state(&ns, &s, REFERENCE_STATE).unwrap().unwrap();
    assert!(rho.to_string().contains("Caroline is the user."));

    // A segment the LLM cannot encode: recorded as failed, no records, ρ unchanged, usage kept.
    store
        .add_turns(
            &ns,
            vec![(
                Turn {
                    session: s.clone(),
                    index: 4,
                    role: Role::User,
                    speaker: None,
                    text: "ok".into(),
                    time: None,
                },
                None,
            )],
        )
        .unwrap();
    let built = build_segment_write(
        &encoder,
        &embedder,
        &organize,
        &store,
        &ns,
        &segment(&s, 4, 4),
    )
    .unwrap();
    assert!(built.outcome.failure.is_some());
    assert!(built.write.records.is_empty() && built.write.state.is_empty());
    store.commit_segment(&ns, built.write).unwrap();
    let rows = store.segments(&ns, &s).unwrap();
    assert!(matches!(rows[2].outcome, SegmentOutcome::Failed { .. }));
    assert_eq!(
        store.stats(&ns).unwrap().usage.by_purpose[&Purpose::Encode].calls,
        4
    );
    assert_eq!(store.state(&ns, &s, REFERENCE_STATE).unwrap().unwrap(), rho);
    // Asking for turns that are not stored is an error, not an LLM call.
    let calls = llm.calls();
    assert!(
        build_segment_write(
            &encoder,
            &embedder,
            &organize,
            &store,
            &ns,
            &segment(&s, 4, 9)
        )
        .is_err()
    );
    assert_eq!(llm.calls(), calls);
}

#[test]
fn output_budget_grows_with_the_segment_and_truncated_replies_keep_complete_records() {
    let texts: Vec<String> = (0..6).map(|i| format!("turn {i}")).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let (_dir, store, embedder) = store_with_turns(16, None, &texts);
    let ns = Namespace::new("alice").unwrap();
    let s = SessionId::new("s1").unwrap();
    // Two complete records (one with braces inside a string), then the reply is cut off.
    let cut = r#"{"records": [
 {"memory_type": "fact", "semantic_text": "Rex is a beagle.", "entities": ["Rex"], "tags": [], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0], "source_role": "user"},
 {"memory_type": "fact", "semantic_text": "Caroline walks Rex {daily}.", "entities": ["Caroline", "Rex"], "tags": ["pets"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [1], "source_role": "user"},
 {"memory_type": "fact", "semantic_text": "Half a rec"#;
    let llm = Arc::new(ScriptedLlm::new(&[cut, FIRST]));
    let encoder = SegmentEncoder::new(llm.clone(), EncodeConfig::default());
    let organize = OrganizeConfig::default();
    let built = build_segment_write(
        &encoder,
        &embedder,
        &organize,
        &store,
        &ns,
        &segment(&s, 0, 5),
    )
    .unwrap();
    assert!(built.outcome.truncated);
    assert_eq!(built.outcome.records.len(), 2, "{cut}");
    assert_eq!(llm.calls(), 1, "a salvaged reply needs no repair call");
    let built = build_segment_write(
        &encoder,
        &embedder,
        &organize,
        &store,
        &ns,
        &segment(&s, 0, 0),
    )
    .unwrap();
    assert!(!built.outcome.truncated);
    let budgets: Vec<u32> = llm.options().iter().map(|o| o.max_tokens).collect();
    assert_eq!(budgets, vec![256 + 6 * 192, 256 + 192]);
}

/// A segment that ends before it starts (a damaged import or state) is refused before any LLM
/// call, with both ends named.
#[test]
fn a_segment_ending_before_it_starts_is_refused() {
    let (_dir, store, embedder) = store_with_turns(16, None, &["one", "two", "three"]);
    let ns = Namespace::new("alice").unwrap();
    let s = SessionId::new("s1").unwrap();
    let llm = Arc::new(ScriptedLlm::new(&[FIRST]));
    let encoder = SegmentEncoder::new(llm.clone(), EncodeConfig::default());
    let backwards = Segment {
        first_turn: 2,
        last_turn: 1,
        exchanges: 1,
        ..segment(&s, 1, 1)
    };
    let Err(err) = build_segment_write(
        &encoder,
        &embedder,
        &OrganizeConfig::default(),
        &store,
        &ns,
        &backwards,
    ) else {
        panic!("a backwards segment was encoded");
    };
    assert!(
        matches!(err, lycheemem_core::Error::InvalidInput(_)),
        "{err}"
    );
    assert!(err.to_string().contains("before it starts"), "{err}");
    assert_eq!(llm.calls(), 0);
}
