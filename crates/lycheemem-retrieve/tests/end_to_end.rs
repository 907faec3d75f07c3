//! Retrieval end to end on a small two-speaker, multi-session conversation: scripted LLM for
//! encoding, planning and answering; real MiniLM embeddings; a real store.

use lycheemem_core::config::{AnswerConfig, EncodeConfig, OrganizeConfig, RetrievalConfig};
use lycheemem_core::{
    CandidateTarget, Channel, FinalizeReason, Namespace, Role, Segment, SessionId, Turn,
};
use lycheemem_embed::Embedder;
use lycheemem_encode::{SegmentEncoder, build_segment_write};
use lycheemem_retrieve::{Retriever, SearchRequest, SearchResult, answer};
use lycheemem_store::prelude::*;
use lycheemem_store::{SessionInfo, Store, StoreOptions};
use lycheemem_testkit::{RecordingEmbedder, ScriptedLlm, minilm};
use std::sync::{Arc, OnceLock};

const S1_RECORDS: &str = r#"{"records": [
 {"memory_type": "event", "semantic_text": "Caroline went to a pottery class on 2023-05-07.", "entities": ["Caroline"], "tags": ["pottery", "hobby"], "temporal": {"t_ref": "yesterday", "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0], "source_role": "user"},
 {"memory_type": "event", "semantic_text": "Melanie ran a charity race.", "entities": ["Melanie"], "tags": ["running", "charity"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [1], "source_role": "user"}
], "disambiguation_context": "Caroline and Melanie are friends."}"#;

const S2_RECORDS: &str = r#"{"records": [
 {"memory_type": "fact", "semantic_text": "Caroline painted a portrait of her grandmother.", "entities": ["Caroline"], "tags": ["painting", "art"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [0], "source_role": "user"},
 {"memory_type": "fact", "semantic_text": "Melanie painted a sunrise over the lake.", "entities": ["Melanie"], "tags": ["painting", "art"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [1], "source_role": "user"},
 {"memory_type": "preference", "semantic_text": "Melanie prefers hiking to running.", "entities": ["Melanie"], "tags": ["hiking", "running"], "temporal": {"t_ref": null, "t_valid_from": null, "t_valid_to": null}, "evidence_turns": [2], "source_role": "user"}
], "disambiguation_context": ""}"#;

/// `(session id, date, [(speaker, text)])`.
type SessionScript = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

struct World {
    _dir: tempfile::TempDir,
    store: Store,
    embedder: lycheemem_embed::BertEmbedder,
    ns: Namespace,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let embedder = minilm();
        let store = Store::open(dir.path(), StoreOptions::new(embedder.dimension())).unwrap();
        let ns = Namespace::new("friends").unwrap();
        let encoder_llm = Arc::new(ScriptedLlm::new(&[S1_RECORDS, S2_RECORDS]));
        let encoder = SegmentEncoder::new(encoder_llm, EncodeConfig::default());
        let sessions: [SessionScript; 2] = [
            (
                "s1",
                "8 May 2023",
                &[
                    (
                        "Caroline",
                        "I went to a pottery class yesterday, it was so relaxing.",
                    ),
                    (
                        "Melanie",
                        "Nice! I ran a charity race for mental health last Saturday.",
                    ),
                ],
            ),
            (
                "s2",
                "20 June 2023",
                &[
                    (
                        "Caroline",
                        "I finished a portrait of my grandmother this week.",
                    ),
                    (
                        "Melanie",
                        "I painted a sunrise over the lake, my favourite so far.",
                    ),
                    (
                        "Melanie",
                        "Honestly I like hiking more than running these days.",
                    ),
                ],
            ),
        ];
        for (sid, date, turns) in sessions {
            let session = SessionId::new(sid).unwrap();
            store
                .put_session(&ns, SessionInfo::new(session.clone(), Some(date.into())))
                .unwrap();
            let texts: Vec<String> = turns.iter().map(|(s, t)| format!("{s}: {t}")).collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let vectors = embedder.embed(&refs).unwrap();
            let rows = turns
                .iter()
                .zip(vectors)
                .enumerate()
                .map(|(i, ((speaker, text), v))| {
                    (
                        Turn {
                            session: session.clone(),
                            index: i as u32,
                            role: Role::User,
                            speaker: Some(speaker.to_string()),
                            text: text.to_string(),
                            time: None,
                        },
                        Some(v),
                    )
                })
                .collect();
            store.add_turns(&ns, rows).unwrap();
            let last = turns.len() as u32 - 1;
            let segment = Segment {
                id: Segment::make_id(&session, 0, last),
                session: session.clone(),
                first_turn: 0,
                last_turn: last,
                exchanges: last + 1,
                tokens: 40,
                reason: FinalizeReason::SessionFlush,
            };
            let built = build_segment_write(
                &encoder,
                &embedder,
                &OrganizeConfig::default(),
                &store,
                &ns,
                &segment,
            )
            .unwrap();
            assert_eq!(built.outcome.failure, None);
            store.commit_segment(&ns, built.write).unwrap();
        }
        World {
            _dir: dir,
            store,
            embedder,
            ns,
        }
    })
}

fn search(
    question: &str,
    plan: Option<&str>,
    cfg: &RetrievalConfig,
) -> (SearchResult, Arc<ScriptedLlm>) {
    let w = world();
    let planner = Arc::new(match plan {
        Some(p) => ScriptedLlm::new(&[p]),
        None => ScriptedLlm::new::<&str>(&[]),
    });
    let retriever = Retriever {
        store: &w.store,
        embedder: &w.embedder,
        reranker: None,
        planner: Some(planner.as_ref()),
        cfg,
    };
    let req = SearchRequest {
        question,
        context: "",
        reference_date: Some("2023-06-21"),
        top_k: 5,
        plan: None,
        trace: true,
        cancel: Default::default(),
    };
    (retriever.search(&w.ns, &req).unwrap(), planner)
}

fn record_texts(r: &SearchResult) -> Vec<&str> {
    r.evidence
        .iter()
        .filter(|e| e.memory_type.is_some())
        .map(|e| e.evidence.text.as_str())
        .collect()
}

#[test]
fn a_dated_question_is_answered_from_the_record_found_through_the_temporal_channel() {
    let plan = r#"{"question_type": "temporal", "semantic_queries": ["Caroline activity"],
      "temporal_filter": {"since": "on 2023-05-07", "until": "on 2023-05-07"},
      "routes": [{"route_id": "r1", "goal": "what Caroline did that day", "queries": ["Caroline activity"], "constraints": [{"kind": "person", "value": "Caroline"}], "temporal_filter": null}]}"#;
    let (result, planner) = search(
        "What did Caroline do on 7 May 2023?",
        Some(plan),
        &RetrievalConfig::default(),
    );
    assert_eq!(planner.calls(), 1);
    assert_eq!(
        result.plan.routes[0].temporal_filter.since.as_deref(),
        Some("2023-05-07")
    );
    let top = &result.evidence[0];
    assert!(
        top.evidence.text.contains("pottery"),
        "{}",
        result.explain()
    );
    assert!(
        top.evidence
            .provenance
            .channels
            .contains(&Channel::Temporal)
    );
    assert!(
        top.evidence
            .provenance
            .nodes
            .contains("temporal:day:2023-05-07")
    );
    assert_eq!(result.usage.len(), 1);
    // The answer prompt carries the record with its time and session date, and the question date.
    let answerer = ScriptedLlm::new(&["Caroline went to a pottery class."]);
    let a = answer(
        &answerer,
        "What did Caroline do on 7 May 2023?",
        Some("2023-06-21"),
        &result.evidence,
        &AnswerConfig::default(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(a.text, "Caroline went to a pottery class.");
    let prompt = &answerer.prompts()[0][1].content;
    assert!(
        prompt
            .contains("time 2023-05-07; session date 2023-05-08) Caroline went to a pottery class"),
        "{prompt}"
    );
    assert!(prompt.contains("Question date: 2023-06-21"));
}

#[test]
fn a_person_specific_question_ranks_that_persons_fact_above_the_other_speakers() {
    let plan = r#"{"question_type": "single", "semantic_queries": ["Melanie painting"], "temporal_filter": null,
      "routes": [{"route_id": "r1", "goal": "what Melanie painted", "queries": ["Melanie painted"], "constraints": [{"kind": "person", "value": "Melanie"}], "temporal_filter": null}]}"#;
    let (result, _) = search(
        "What did Melanie paint?",
        Some(plan),
        &RetrievalConfig::default(),
    );
    let records = record_texts(&result);
    let melanie = records
        .iter()
        .position(|t| t.contains("sunrise"))
        .expect("Melanie's painting is retrieved");
    if let Some(caroline) = records.iter().position(|t| t.contains("grandmother")) {
        assert!(melanie < caroline, "{}", result.explain());
    }
    let answerer = ScriptedLlm::new(&["A sunrise over the lake."]);
    answer(
        &answerer,
        "What did Melanie paint?",
        None,
        &result.evidence,
        &AnswerConfig::default(),
        &Default::default(),
    )
    .unwrap();
    assert!(
        answerer.prompts()[0][0]
            .content
            .contains("answer about that person only")
    );
}

/// A planner query that names another person's fact must not lift that fact above the
/// question's own answer: the route's queries widen recall, the question and goal score.
#[test]
fn a_planner_query_widens_recall_but_the_question_and_goal_score() {
    let plan = r#"{"question_type": "single", "semantic_queries": [], "temporal_filter": null,
      "routes": [{"route_id": "r1", "goal": "what Melanie painted", "queries": ["Caroline painted a portrait of her grandmother."], "constraints": [], "temporal_filter": null}]}"#;
    let q = "What did Melanie paint?";
    let rank = |cfg: &RetrievalConfig| {
        let (result, _) = search(q, Some(plan), cfg);
        let records = record_texts(&result);
        let at = |needle: &str| records.iter().position(|t| t.contains(needle));
        (at("sunrise"), at("grandmother"), result.explain())
    };
    let (melanie, caroline, explain) = rank(&RetrievalConfig::default());
    let melanie = melanie.expect("Melanie's painting is retrieved");
    assert!(caroline.is_none_or(|c| melanie < c), "{explain}");
    // The SPEC's rule (each candidate keeps its best score over every variant) lets the query's
    // near-copy of the other fact win: the difference this switch makes.
    let spec = RetrievalConfig {
        planner_queries_recall_only: false,
        ..RetrievalConfig::default()
    };
    let (melanie, caroline, explain) = rank(&spec);
    let caroline = caroline.expect("the query's target is retrieved");
    assert!(melanie.is_none_or(|m| caroline < m), "{explain}");
}

#[test]
fn unparseable_plans_fall_back_to_the_question_and_no_planner_makes_no_call() {
    let (result, planner) = search(
        "Where did Melanie run?",
        Some("no idea"),
        &RetrievalConfig::default(),
    );
    assert_eq!(planner.calls(), 1);
    assert!(result.plan_fallback.is_some());
    assert_eq!(result.plan.routes.len(), 1);
    assert!(
        record_texts(&result)
            .iter()
            .any(|t| t.contains("charity race"))
    );
    let mut cfg = RetrievalConfig::default();
    cfg.apply_ablation("no_planner").unwrap();
    let (result, planner) = search("Where did Melanie run?", None, &cfg);
    assert_eq!(planner.calls(), 0);
    assert!(result.usage.is_empty());
    assert!(!result.evidence.is_empty());
}

#[test]
fn ablations_change_what_retrieval_uses() {
    let q = "What does Melanie prefer, hiking or running?";
    let mut cfg = RetrievalConfig::default();
    cfg.apply_ablation("record_vector_only").unwrap();
    let (result, _) = search(q, None, &cfg);
    assert!(!result.evidence.is_empty());
    for e in &result.evidence {
        assert!(matches!(e.evidence.target, CandidateTarget::Record { .. }));
        assert!(
            e.evidence
                .provenance
                .channels
                .iter()
                .all(|c| *c == Channel::Record),
            "{:?}",
            e.evidence.provenance.channels
        );
    }
    let mut cfg = RetrievalConfig::default();
    cfg.apply_ablation("no_lexical").unwrap();
    let (result, _) = search(q, None, &cfg);
    assert!(
        result
            .evidence
            .iter()
            .all(|e| !e.evidence.provenance.channels.contains(&Channel::Lexical))
    );
    let (full, _) = search(q, None, &RetrievalConfig::default());
    assert!(
        full.evidence
            .iter()
            .any(|e| e.evidence.provenance.channels.contains(&Channel::Lexical))
    );
    let mut cfg = RetrievalConfig::default();
    cfg.apply_ablation("no_fusion").unwrap();
    let (result, _) = search(q, None, &cfg);
    assert!(result.evidence.iter().all(|e| e.evidence.rrf == 0.0));
    assert!(
        result
            .evidence
            .windows(2)
            .all(|w| w[0].evidence.final_score >= w[1].evidence.final_score)
    );
    // Every variant returns at most k items, and the explain view names each one.
    assert!(full.evidence.len() <= full.k);
    let explain = full.explain();
    assert!(explain.contains("final") && explain.contains("channels"));
}

#[test]
fn the_stage_trace_follows_the_candidates_from_channels_to_the_final_list() {
    let (r, _) = search("What did Melanie paint?", None, &RetrievalConfig::default());
    let names: Vec<&str> = r.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "channel:temporal",
            "channel:evidence_node",
            "channel:record",
            "channel:raw_turn",
            "channel:lexical",
            "channel:source_window",
            "union",
            "pool",
            "final"
        ]
    );
    let turns = |name: &str| -> std::collections::BTreeSet<(String, u32)> {
        r.stages
            .iter()
            .find(|s| s.name == name)
            .unwrap()
            .items
            .iter()
            .flat_map(|i| i.turns.iter().map(|t| (i.session.clone(), *t)))
            .collect()
    };
    let stage = |name: &str| r.stages.iter().find(|s| s.name == name).unwrap();
    assert_eq!(stage("final").items.len(), r.evidence.len());
    assert!(turns("final").is_subset(&turns("pool")));
    assert!(turns("pool").is_subset(&turns("union")));
    assert!(stage("union").items.len() >= stage("pool").items.len());
    // Everything the union held is either chosen or listed as dropped with a reason.
    assert_eq!(
        stage("union").items.len(),
        r.evidence.len() + r.dropped.len()
    );
    // Without the trace nothing is kept.
    let w = world();
    let retriever = Retriever {
        store: &w.store,
        embedder: &w.embedder,
        reranker: None,
        planner: None,
        cfg: &RetrievalConfig::default(),
    };
    let plain = retriever
        .search(
            &w.ns,
            &SearchRequest {
                question: "What did Melanie paint?",
                top_k: 5,
                ..SearchRequest::default()
            },
        )
        .unwrap();
    assert!(plain.stages.is_empty() && plain.dropped.is_empty());
    assert_eq!(plain.evidence.len(), r.evidence.len());
}

#[test]
fn a_source_window_is_described_by_its_own_turns_not_by_its_anchor() {
    let (r, _) = search("What did Melanie paint?", None, &RetrievalConfig::default());
    let windows: Vec<_> = r
        .evidence
        .iter()
        .filter(|e| {
            e.evidence
                .provenance
                .channels
                .contains(&Channel::SourceWindow)
        })
        .collect();
    assert!(!windows.is_empty(), "{}", r.explain());
    for w in windows {
        // An anchor's entities and evidence nodes would make MMR see the window as its copy.
        assert!(w.entities.is_empty(), "{:?}", w.entities);
        assert!(
            w.evidence.provenance.nodes.is_empty(),
            "{:?}",
            w.evidence.provenance.nodes
        );
        // Its focus is its anchors' cited turns, inside it (the prompt trims around them).
        assert!(!w.focus_turns.is_empty(), "{w:?}");
        assert!(w.focus_turns.iter().all(|t| w.turns.contains(t)), "{w:?}");
        assert_eq!(w.dialogue.len(), w.turns.len());
    }
}

/// Nothing a planner writes can panic plan parsing: arbitrary text and plan-shaped replies
/// with hostile values give a plan or a clear error (the caller then falls back).
mod plan_replies {
    use lycheemem_core::config::RetrievalConfig;
    use lycheemem_retrieve::planner::parse_plan;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn hostile() -> impl Strategy<Value = Value> {
        let strings = prop_oneof![
            any::<String>(),
            Just("200000000000 days ago".to_string()),
            Just("9999999-12-31".to_string()),
            Just("last week".to_string()),
        ];
        lycheemem_testkit::hostile_json(strings.boxed(), &[])
    }

    fn plan_like() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            hostile().prop_map(|v| v.to_string()),
            (hostile(), hostile(), prop::collection::vec((hostile(), hostile(), hostile()), 0..6))
                .prop_map(|(ty, filter, routes)| {
                    let routes: Vec<Value> = routes
                        .into_iter()
                        .map(|(q, c, f)| {
                            json!({"route_id": "r", "goal": "g", "queries": q, "constraints": c, "temporal_filter": f})
                        })
                        .collect();
                    json!({"question_type": ty, "semantic_queries": [], "temporal_filter": filter, "routes": routes}).to_string()
                }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn plan_replies_never_panic(text in plan_like(), dated in any::<bool>()) {
            let cfg = RetrievalConfig::default();
            let date = dated.then_some("2023-05-08");
            if let Ok(plan) = parse_plan(&text, "When did Ana move?", date, &cfg) {
                prop_assert!(!plan.routes.is_empty());
            }
        }
    }
}

#[test]
fn a_raw_turn_hit_is_shown_with_its_reply_and_keeps_it_as_its_focus() {
    // Raw turns only, no windows: every evidence item is a raw-turn hit.
    let mut cfg = RetrievalConfig {
        planner: false,
        channel_records: false,
        channel_nodes: false,
        channel_lexical: false,
        channel_temporal: false,
        window_anchors: 0,
        ..Default::default()
    };
    let lines = |session: &str| -> Vec<String> {
        let w = world();
        let s = SessionId::new(session).unwrap();
        w.store
            .turn_range(&w.ns, &s, 0, u32::MAX)
            .unwrap()
            .iter()
            .map(lycheemem_store::rules::turn_search_text)
            .collect()
    };
    for (before, after) in [(0u32, 1u32), (0, 0), (1, 0)] {
        cfg.raw_turn_context_before = before;
        cfg.raw_turn_context_after = after;
        let (r, _) = search("What did Melanie paint?", None, &cfg);
        assert!(!r.evidence.is_empty(), "{}", r.explain());
        for e in &r.evidence {
            assert!(e.memory_type.is_none(), "{}", r.explain());
            let [hit] = e.focus_turns[..] else {
                panic!("one focus turn: {e:?}")
            };
            let all = lines(&e.session);
            let first = hit.saturating_sub(before);
            let last = (hit + after).min(all.len() as u32 - 1);
            assert_eq!(
                e.turns,
                (first..=last).collect::<Vec<_>>(),
                "{before}/{after}"
            );
            let shown: Vec<String> = (first..=last).map(|i| all[i as usize].clone()).collect();
            assert_eq!(e.dialogue, shown);
            assert_eq!(e.evidence.text, shown.join("\n"));
        }
        if (before, after) == (0, 1) {
            // Melanie's painting (s2 turn 1) comes with her next turn.
            assert!(
                r.evidence
                    .iter()
                    .any(|e| e.session == "s2" && e.turns == vec![1, 2]),
                "{}",
                r.explain()
            );
        }
    }
}

#[test]
fn every_routes_variants_are_embedded_in_one_batch_each_text_once() {
    let w = world();
    let plan = r#"{"question_type": "multi", "semantic_queries": [], "temporal_filter": null,
      "routes": [
        {"route_id": "r1", "goal": "what Melanie painted", "queries": ["Melanie's painting"], "constraints": [], "temporal_filter": null},
        {"route_id": "r2", "goal": "what Caroline painted", "queries": ["Melanie's painting", "portrait"], "constraints": [], "temporal_filter": null}]}"#;
    let planner = ScriptedLlm::new(&[plan]);
    let embedder = RecordingEmbedder::new(&w.embedder);
    let cfg = RetrievalConfig::default();
    let retriever = Retriever {
        store: &w.store,
        embedder: &embedder,
        reranker: None,
        planner: Some(&planner),
        cfg: &cfg,
    };
    let req = SearchRequest {
        question: "Who painted what?",
        context: "",
        reference_date: Some("2023-06-21"),
        top_k: 5,
        plan: None,
        trace: false,
        cancel: Default::default(),
    };
    let result = retriever.search(&w.ns, &req).unwrap();
    assert_eq!(result.plan.routes.len(), 2, "{:?}", result.plan);
    let batches = embedder.batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    let mut texts = batches[0].clone();
    texts.sort();
    let before = texts.len();
    texts.dedup();
    assert_eq!(texts.len(), before, "a text embedded twice: {batches:?}");
    assert!(texts.contains(&"Who painted what?".to_string()));
    assert!(texts.contains(&"portrait".to_string()));
    assert!(!result.evidence.is_empty());
}
