//! The segment encoder with a scripted LLM: well-formed, fenced, truncated, wrong types,
//! out-of-range turn indices, empty and non-JSON output — and node derivation golden tests.

use lycheemem_core::config::{EncodeConfig, OrganizeConfig, RecordStyle};
use lycheemem_core::{
    FinalizeReason, MemoryType, Namespace, NodeKind, Role, Segment, SessionId, SourceRole, Turn,
};
use lycheemem_encode::{ReferenceContext, SegmentEncoder, SegmentInput, organize};
use lycheemem_testkit::ScriptedLlm;
use std::sync::Arc;

/// The scripted LLM with fixed usage (100 prompt + 20 completion tokens per call).
fn scripted(replies: &[&str]) -> Arc<ScriptedLlm> {
    Arc::new(ScriptedLlm::new(replies).with_usage(100, 20))
}

fn session() -> SessionId {
    SessionId::new("s1").unwrap()
}

fn turns() -> Vec<Turn> {
    let t = |i: u32, speaker: &str, text: &str| Turn {
        session: session(),
        index: i,
        role: Role::User,
        speaker: Some(speaker.into()),
        text: text.into(),
        time: None,
    };
    vec![
        t(
            10,
            "Caroline",
            "I went to the LGBTQ support group yesterday.",
        ),
        t(
            11,
            "Melanie",
            "That's great! I painted a sunrise last week.",
        ),
        t(
            12,
            "Caroline",
            "Lovely. I'm thinking about adoption agencies.",
        ),
    ]
}

fn segment() -> Segment {
    Segment {
        id: Segment::make_id(&session(), 10, 12),
        session: session(),
        first_turn: 10,
        last_turn: 12,
        exchanges: 3,
        tokens: 40,
        reason: FinalizeReason::SemanticBoundary,
    }
}

const GOOD: &str = r#"{"records": [
 {"memory_type": "event", "semantic_text": "Caroline went to the LGBTQ support group on 2023-05-07.", "entities": ["Caroline", "LGBTQ support group"], "tags": ["support group"], "temporal": {"t_ref": "2023-05-07", "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0], "source_role": "user"},
 {"memory_type": "opinion", "semantic_text": "Melanie painted a sunrise.", "entities": ["Melanie"], "tags": ["painting"], "temporal": {"t_ref": "last week", "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [1, 7], "source_role": "user"}
], "disambiguation_context": "Caroline and Melanie are friends."}"#;

fn encode(
    style: RecordStyle,
    replies: &[&str],
) -> (
    lycheemem_encode::EncodeOutcome,
    Arc<ScriptedLlm>,
    ReferenceContext,
) {
    let llm = scripted(replies);
    let encoder = SegmentEncoder::new(
        llm.clone(),
        EncodeConfig {
            record_style: style,
            ..Default::default()
        },
    );
    let ns = Namespace::new("alice").unwrap();
    let turns = turns();
    let seg = segment();
    let input = SegmentInput {
        namespace: &ns,
        segment: &seg,
        turns: &turns,
        session_date: Some("1:56 pm on 8 May, 2023"),
    };
    let mut rho = ReferenceContext::default();
    let out = encoder.encode(&input, &mut rho);
    (out, llm, rho)
}

#[test]
fn well_formed_output_becomes_validated_records() {
    let (out, llm, rho) = encode(RecordStyle::Typed, &[GOOD]);
    assert_eq!(out.failure, None);
    assert_eq!(out.calls, 1);
    assert_eq!(out.records.len(), 2);
    let a = &out.records[0];
    assert_eq!(a.memory_type, MemoryType::Event);
    assert_eq!(a.evidence_turns, [10], "local index 0 → absolute turn 10");
    assert_eq!(a.temporal.t_ref.as_deref(), Some("2023-05-07"));
    assert_eq!(a.created_at.as_deref(), Some("2023-05-08"));
    assert_eq!(
        a.normalized_text,
        "event: Caroline went to the LGBTQ support group on 2023-05-07."
    );
    assert_eq!(a.source_role, SourceRole::User);
    let b = &out.records[1];
    assert_eq!(b.memory_type, MemoryType::Fact, "unknown type → fact");
    assert_eq!(b.evidence_turns, [11], "out-of-range index 7 dropped");
    assert_eq!(
        b.temporal.t_ref.as_deref(),
        Some("2023-05-01"),
        "relative date resolved against the session date"
    );
    assert!(out.dropped >= 1);
    // The prompt carries the session date and tagged turns; ρ is updated afterwards.
    let prompt = &llm.prompts()[0][1].content;
    assert!(
        prompt.contains("Session date: 2023-05-08T13:56:00"),
        "{prompt}"
    );
    assert!(
        prompt.contains("[1] Melanie (user): That's great!"),
        "{prompt}"
    );
    assert_eq!(rho.note, "Caroline and Melanie are friends.");
    assert!(
        rho.recent_records.is_empty(),
        "the default ρ keeps no records"
    );
}

#[test]
fn fenced_output_is_accepted() {
    let fenced = format!("```json\n{GOOD}\n```");
    let (out, _, _) = encode(RecordStyle::Typed, &[&fenced]);
    assert_eq!(out.records.len(), 2);
}

#[test]
fn truncated_output_gets_one_repair_round_showing_the_error() {
    let (out, llm, _) = encode(RecordStyle::Typed, &[&GOOD[..120], GOOD]);
    assert_eq!(out.failure, None);
    assert_eq!(out.calls, 2);
    assert_eq!((out.prompt_tokens, out.completion_tokens), (200, 40));
    let repair = llm.prompts()[1].clone();
    assert_eq!(repair.len(), 4);
    assert!(
        repair[3].content.contains("truncated"),
        "{}",
        repair[3].content
    );
}

#[test]
fn garbage_twice_fails_without_records_and_never_panics() {
    for replies in [
        vec!["", ""],
        vec!["I cannot do that.", "Still no."],
        vec!["{\"records\": 5}", "[1, 2]"],
    ] {
        let (out, _, rho) = encode(RecordStyle::Typed, &replies);
        assert!(out.records.is_empty());
        assert_eq!(out.calls, 2);
        let failure = out.failure.unwrap();
        assert!(
            failure.contains("s1#10-12") && failure.contains("2 call(s)"),
            "{failure}"
        );
        assert_eq!(
            rho,
            ReferenceContext::default(),
            "a failed segment leaves ρ untouched"
        );
    }
}

#[test]
fn wrong_types_inside_records_are_coerced_or_dropped() {
    let reply = r#"{"records": [
      {"memory_type": 3, "semantic_text": "Caroline is researching adoption agencies.", "entities": ["Caroline", 7, ""], "tags": "adoption", "temporal": "soon", "evidence_turns": ["2", -1, 2], "source_role": "robot"},
      {"memory_type": "fact", "semantic_text": ""},
      "not an object",
      {"memory_type": "fact", "semantic_text": "Caroline is researching adoption agencies.", "evidence_turns": [0]}
    ], "disambiguation_context": 12}"#;
    let (out, _, _) = encode(RecordStyle::Typed, &[reply]);
    assert_eq!(
        out.records.len(),
        1,
        "identical text merges: {:#?}",
        out.records
    );
    let r = &out.records[0];
    assert_eq!(r.memory_type, MemoryType::Fact);
    assert_eq!(r.entities, ["Caroline"]);
    assert!(r.tags.is_empty());
    assert!(r.temporal.is_empty());
    assert_eq!(
        r.evidence_turns,
        [10, 12],
        "provenance of the duplicate is unioned"
    );
    assert_eq!(r.source_role, SourceRole::Both);
    assert_eq!(out.disambiguation, "");
}

#[test]
fn llm_errors_are_failures_not_panics() {
    let llm = scripted(&[]);
    llm.push_error("server down");
    llm.push_error("still down");
    let encoder = SegmentEncoder::new(llm, EncodeConfig::default());
    let ns = Namespace::new("alice").unwrap();
    let (turns, seg) = (turns(), segment());
    let out = encoder.encode(
        &SegmentInput {
            namespace: &ns,
            segment: &seg,
            turns: &turns,
            session_date: None,
        },
        &mut ReferenceContext::default(),
    );
    assert!(out.records.is_empty());
    assert!(out.failure.unwrap().contains("still down"));
}

#[test]
fn summary_records_variant_makes_one_untyped_record() {
    let (out, _, _) = encode(
        RecordStyle::SummaryRecords,
        &[
            r#"{"summary": "Caroline went to a support group; Melanie painted.", "disambiguation_context": ""}"#,
        ],
    );
    assert_eq!(out.records.len(), 1);
    assert_eq!(out.records[0].evidence_turns, [10, 11, 12]);
    assert!(out.records[0].entities.is_empty() && out.records[0].temporal.is_empty());
}

#[test]
fn no_cross_segment_context_leaves_rho_out_of_the_prompt() {
    let llm = scripted(&[GOOD, GOOD, GOOD]);
    let ns = Namespace::new("alice").unwrap();
    let (turns, seg) = (turns(), segment());
    let input = SegmentInput {
        namespace: &ns,
        segment: &seg,
        turns: &turns,
        session_date: Some("2023-05-08"),
    };
    // The published ρ: the note and the session's last records (the default keeps the note
    // only).
    let published = EncodeConfig {
        reference_records: 12,
        ..Default::default()
    };
    let mut rho = ReferenceContext::default();
    rho.update(
        "Mel is Melanie.",
        ["Caroline likes hiking.".to_string()],
        &published,
    );
    SegmentEncoder::new(llm.clone(), published.clone()).encode(&input, &mut rho.clone());
    SegmentEncoder::new(
        llm.clone(),
        EncodeConfig {
            cross_segment_context: false,
            ..Default::default()
        },
    )
    .encode(&input, &mut rho);
    let prompts = llm.prompts();
    assert!(
        prompts[0][1]
            .content
            .contains("Resolved references:\nMel is Melanie.\n- Caroline likes hiking.")
    );
    assert!(!prompts[1][1].content.contains("Resolved references"));
    assert_eq!(
        prompts[0][0].content, prompts[1][0].content,
        "the instructions are a fixed prefix"
    );
    // The default ρ carries the note and no record.
    let mut rho = ReferenceContext::default();
    rho.update(
        "Mel is Melanie.",
        ["Caroline likes hiking.".to_string()],
        &EncodeConfig::default(),
    );
    SegmentEncoder::new(llm.clone(), EncodeConfig::default()).encode(&input, &mut rho);
    let last = &llm.prompts()[2][1].content;
    assert!(
        last.contains("Resolved references:\nMel is Melanie."),
        "{last}"
    );
    assert!(!last.contains("Caroline likes hiking."), "{last}");
}

#[test]
fn nodes_are_derived_per_kind_with_normalized_keys() {
    let (out, _, _) = encode(RecordStyle::Typed, &[GOOD]);
    let nodes = organize(&out.records, &segment(), &OrganizeConfig::default());
    let ids: Vec<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "entity:caroline",
            "entity:lgbtq support group",
            "entity:melanie",
            "entity_topic:caroline::support group",
            "entity_topic:lgbtq support group::support group",
            "entity_topic:melanie::painting",
            "event_frame:s1#10-12",
            "temporal:day:2023-05-01",
            "temporal:day:2023-05-07",
            "temporal:month:2023-05",
            "topic:painting",
            "topic:support group",
        ]
    );
    let month = nodes
        .iter()
        .find(|n| n.node_id == "temporal:month:2023-05")
        .unwrap();
    assert_eq!(month.records.len(), 2);
    let frame = nodes
        .iter()
        .find(|n| n.kind == NodeKind::EventFrame)
        .unwrap();
    assert_eq!(frame.label, "s1 turns 10-12");
    assert_eq!(frame.records.len(), 2);
    // The memory type as a tag is a flag, off by default.
    let tagged = organize(
        &out.records,
        &segment(),
        &OrganizeConfig {
            memory_type_as_tag: true,
            ..Default::default()
        },
    );
    assert!(
        tagged.iter().any(|n| n.node_id == "topic:event")
            && tagged.iter().any(|n| n.node_id == "topic:fact")
    );
}

#[test]
fn merging_unions_links_and_widens_the_span() {
    let (out, _, _) = encode(RecordStyle::Typed, &[GOOD]);
    let cfg = OrganizeConfig::default();
    let first = organize(&out.records[..1], &segment(), &cfg);
    let second = organize(&out.records[1..], &segment(), &cfg);
    let frame = |ups: &[lycheemem_encode::NodeUpsert]| {
        ups.iter()
            .find(|u| u.kind == NodeKind::EventFrame)
            .unwrap()
            .clone()
    };
    let node = lycheemem_encode::organize::merge(None, &frame(&first), &cfg);
    let node = lycheemem_encode::organize::merge(Some(node), &frame(&second), &cfg);
    assert_eq!(node.record_ids.len(), 2);
    assert_eq!(
        node.span,
        Some(("2023-05-01".to_string(), "2023-05-07".to_string()))
    );
    assert!(
        node.search_text
            .starts_with("s1 turns 10-12\nCaroline went")
            && node.search_text.contains("Melanie painted")
    );
    let again = lycheemem_encode::organize::merge(Some(node.clone()), &frame(&second), &cfg);
    assert_eq!(again, node, "re-applying an upsert changes nothing");
}

#[test]
fn relative_time_is_annotated_once() {
    let reply = |text: &str| {
        format!(
            r#"{{"records": [{{"memory_type": "event", "semantic_text": "{text}", "entities": [], "tags": [], "temporal": {{"t_ref": null, "t_valid_from": null, "t_valid_to": null}}, "evidence_turns": [0], "source_role": "user"}}], "disambiguation_context": ""}}"#
        )
    };
    let plain = reply("Caroline went to the support group yesterday.");
    let (out, _, _) = encode(RecordStyle::Typed, &[plain.as_str()]);
    assert_eq!(
        out.records[0].semantic_text,
        "Caroline went to the support group yesterday (2023-05-07)."
    );
    assert_eq!(out.records[0].temporal.t_ref.as_deref(), Some("2023-05-07"));
    // Copied from an earlier, already annotated record: left as it is.
    let annotated = reply("Caroline went to the support group yesterday (2023-05-07).");
    let (out, _, _) = encode(RecordStyle::Typed, &[annotated.as_str()]);
    assert_eq!(
        out.records[0].semantic_text,
        "Caroline went to the support group yesterday (2023-05-07)."
    );
}
