//! Nothing an LLM writes can panic the encoder's reply parsing: arbitrary text, and replies
//! shaped like the record schema with hostile values (absurd dates and relative phrases,
//! out-of-range or non-integer turn ids, unknown types, wrong JSON types, cut-off text). Each
//! reply gives records or a clear error; kept records cite only the segment's turns.

use lycheemem_core::{Namespace, SessionId};
use lycheemem_encode::parse::{ParseContext, extract_json, parse_records, parse_summary};
use proptest::prelude::*;
use serde_json::{Value, json};

fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        Just("200000000000 days ago".to_string()),
        Just("in 99999999999999 weeks".to_string()),
        Just("last month".to_string()),
        Just("9999999-99-99".to_string()),
        Just("-2000000000-01-01".to_string()),
        Just("2023-02-30".to_string()),
        Just("2023-05-08".to_string()),
        "[0-9]{1,20} (days|weeks|months|years) (ago|later)",
        "[a-z ]{0,40}",
    ]
}

fn hostile_value() -> impl Strategy<Value = Value> {
    lycheemem_testkit::hostile_json(hostile_string().boxed(), &[])
}

fn turn_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0i64..8).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        hostile_string().prop_map(Value::from),
    ]
}

fn record() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("fact".to_string()),
            Just("event".to_string()),
            Just("preference".to_string()),
            hostile_string()
        ],
        hostile_string(),
        prop::collection::vec(hostile_string(), 0..3),
        (hostile_string(), hostile_string(), hostile_value()),
        prop::collection::vec(turn_id(), 0..5),
        hostile_value(),
    )
        .prop_map(|(ty, text, entities, (t_ref, from, to), turns, role)| {
            json!({
                "memory_type": ty,
                "semantic_text": text,
                "entities": entities,
                "tags": [],
                "temporal": {"t_ref": t_ref, "t_valid_from": from, "t_valid_to": to},
                "evidence_turns": turns,
                "source_role": role,
            })
        })
}

fn reply() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        hostile_value().prop_map(|v| v.to_string()),
        (prop::collection::vec(record(), 0..4), hostile_string()).prop_map(|(records, d)| {
            json!({"records": records, "disambiguation_context": d}).to_string()
        }),
        // A reply cut off by the output budget.
        (
            prop::collection::vec(record(), 1..4),
            any::<prop::sample::Index>()
        )
            .prop_map(|(records, cut)| {
                let s = json!({"records": records, "disambiguation_context": ""}).to_string();
                let at = cut.index(s.len());
                s.char_indices()
                    .map(|(i, _)| i)
                    .take_while(|i| *i <= at)
                    .last()
                    .map_or(String::new(), |i| s[..i].to_string())
            }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn record_replies_never_panic_and_cite_only_the_segment(
        text in reply(),
        first_turn in prop_oneof![Just(0u32), Just(7u32), Just(u32::MAX - 3)],
        dated in any::<bool>(),
    ) {
        let ns = Namespace::new("p").unwrap();
        let session = SessionId::new("s").unwrap();
        let day = chrono::NaiveDate::from_ymd_opt(2023, 5, 8);
        let ctx = ParseContext {
            namespace: &ns,
            session: &session,
            segment_id: "seg",
            first_turn,
            turn_count: 3,
            session_date: if dated { day } else { None },
            created_at: dated.then(|| "2023-05-08".to_string()),
        };
        if let Ok(parsed) = parse_records(&text, &ctx) {
            for r in &parsed.records {
                prop_assert!(!r.semantic_text.trim().is_empty());
                for t in &r.evidence_turns {
                    prop_assert!(
                        *t >= first_turn && u64::from(*t) < u64::from(first_turn) + 3,
                        "turn {t} outside the segment"
                    );
                }
            }
        }
        let _ = parse_summary(&text, &ctx);
        let _ = extract_json(&text);
    }
}

#[test]
fn a_well_formed_reply_gives_its_record() {
    let ns = Namespace::new("p").unwrap();
    let session = SessionId::new("s").unwrap();
    let ctx = ParseContext {
        namespace: &ns,
        session: &session,
        segment_id: "seg",
        first_turn: 4,
        turn_count: 2,
        session_date: chrono::NaiveDate::from_ymd_opt(2023, 5, 8),
        created_at: Some("2023-05-08".into()),
    };
    let reply = json!({"records": [{"memory_type": "event", "semantic_text": "Ana moved to Lisbon 200000000000 days ago.",
        "entities": ["Ana"], "tags": [], "temporal": {"t_ref": "200000000000 days ago", "t_valid_from": null, "t_valid_to": null},
        "evidence_turns": [1], "source_role": "user"}], "disambiguation_context": ""});
    let parsed = parse_records(&reply.to_string(), &ctx).unwrap();
    assert_eq!(parsed.records.len(), 1);
    assert_eq!(parsed.records[0].evidence_turns, vec![5]);
}
