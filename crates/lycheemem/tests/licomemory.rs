//! LiCoMemory as a memory strategy through the facade, with a real store, a deterministic
//! embedder and scripted LLMs: two calls per chunk, the summary really updated, entity and
//! relation dedup with provenance per session, retrieval of the chunks the best triples came
//! from, restart and deletion behaviour, the strategy guard, and the same graph and search on
//! PostgreSQL (needs `LYCHEEMEM_TEST_POSTGRES_URL`).

use lycheemem::{Components, Memory, NewTurn, QueryOptions};
use lycheemem_core::config::LicoSummaryMode;
use lycheemem_core::{Config, MemoryStrategy, Namespace, NodeKind, Purpose, SessionId};
use lycheemem_licomemory::{SessionSummary, answer_messages};
use lycheemem_llm::ChatMessage;
use lycheemem_testkit::{HashEmbedder, ScriptedLlm};
use serde_json::json;
use std::sync::Arc;

fn user_text(messages: &[ChatMessage]) -> String {
    messages
        .last()
        .map(|m| m.content.clone())
        .unwrap_or_default()
}

/// Replies to LiCoMemory's write-path prompts from what the chunk says.
fn encoder_reply(messages: &[ChatMessage]) -> String {
    let system = messages.first().map_or("", |m| m.content.as_str());
    let text = user_text(messages);
    if system.starts_with("You write the summary") {
        return json!({"keys": ["pets", "2024/03/01"], "themes": [
            {"theme": "Pets", "summary": "The user talked about their dog."}]})
        .to_string();
    }
    if system.starts_with("You keep the summary") {
        let current: serde_json::Value = serde_json::from_str(
            text.split("Current summary:\n")
                .nth(1)
                .and_then(|t| t.split("\n\nNext part").next())
                .unwrap(),
        )
        .unwrap();
        let mut keys: Vec<String> = serde_json::from_value(current["keys"].clone()).unwrap();
        let mut themes = current["themes"].as_array().unwrap().clone();
        if text.contains("cello") && !keys.iter().any(|k| k == "cello") {
            keys.push("cello".into());
            themes.push(json!({"theme": "Music", "summary": "The user learns the cello."}));
        }
        return json!({"keys": keys, "themes": themes}).to_string();
    }
    if system.starts_with("You extract a knowledge graph") {
        let rel = |s: &str, t: &str, r: &str| json!({"source": s, "target": t, "relation": r, "strength": 8});
        let ent = |n: &str, t: &str| json!({"name": n, "type": t});
        let (entities, relations) = if text.contains("adopted a beagle") {
            (
                vec![
                    ent("User", "person"),
                    ent("Rex", "object"),
                    ent("beagle", "concept"),
                ],
                vec![rel("User", "Rex", "owns"), rel("Rex", "beagle", "is a")],
            )
        } else if text.contains("dog food") {
            return "I cannot produce JSON today".into();
        } else if text.contains("cello teacher") {
            (
                vec![ent("user", "person"), ent("Ms. Ortiz", "person")],
                vec![rel("USER", "Ms. Ortiz", "has cello teacher")],
            )
        } else if text.contains("moved to Lisbon") {
            (
                vec![ent("User", "person"), ent("Lisbon", "location")],
                vec![rel("User", "Lisbon", "moved to")],
            )
        } else if text.contains("Rex is adjusting") {
            (
                vec![ent("User", "person"), ent("rex", "object")],
                vec![rel("user", "rex", "owns")],
            )
        } else {
            (vec![], vec![])
        };
        return json!({"entities": entities, "relations": relations}).to_string();
    }
    panic!("unexpected encoder prompt: {system}");
}

fn query_reply(messages: &[ChatMessage]) -> String {
    let text = user_text(messages);
    let entities = if text.contains("dog") {
        json!([{"name": "Rex", "type": "object"}, {"name": "User", "type": "person"}])
    } else if text.contains("live") {
        json!([{"name": "Lisbon", "type": "location"}])
    } else {
        json!([])
    };
    json!({ "entities": entities }).to_string()
}

fn components() -> (Components, Arc<ScriptedLlm>) {
    let encoder = Arc::new(ScriptedLlm::responding(encoder_reply));
    (
        Components {
            embedder: Arc::new(HashEmbedder::new(64)),
            reranker: None,
            encode_llm: encoder.clone(),
            plan_llm: Arc::new(ScriptedLlm::responding(query_reply)),
            answer_llm: Arc::new(ScriptedLlm::responding(|_| "Rex, a beagle.".into())),
        },
        encoder,
    )
}

fn lico() -> Config {
    Config {
        strategy: MemoryStrategy::Licomemory,
        ..Config::default()
    }
}

fn conversation() -> Vec<(&'static str, &'static str, Vec<NewTurn>)> {
    let chat = |pairs: &[(&str, &str)]| -> Vec<NewTurn> {
        pairs
            .iter()
            .flat_map(|(u, a)| [NewTurn::user(*u), NewTurn::assistant(*a)])
            .collect()
    };
    vec![
        (
            "s1",
            "2024-03-01",
            chat(&[
                ("I just adopted a beagle called Rex.", "Congratulations!"),
                (
                    "Do you know good dog food brands?",
                    "Look for real meat first.",
                ),
                ("My cello teacher is called Ms. Ortiz.", "Teachers matter."),
            ]),
        ),
        (
            "s2",
            "2024-04-10",
            chat(&[
                ("I moved to Lisbon last week.", "Exciting!"),
                ("Rex is adjusting well to the new flat.", "Glad to hear it."),
            ]),
        ),
    ]
}

fn ingest(memory: &Memory, ns: &Namespace, split_at: Option<usize>) {
    for (sid, date, turns) in conversation() {
        let session = SessionId::new(sid).unwrap();
        match split_at {
            Some(n) if n < turns.len() => {
                let (a, b) = turns.split_at(n);
                memory
                    .add_turns(ns, &session, Some(date), a.to_vec())
                    .unwrap();
                memory.add_turns(ns, &session, None, b.to_vec()).unwrap();
            }
            _ => {
                memory.add_turns(ns, &session, Some(date), turns).unwrap();
            }
        }
        memory.flush(ns, &session).unwrap();
    }
}

/// Record texts with their sessions and turns, and entity node ids with their record counts.
fn graph(memory: &Memory, ns: &Namespace) -> (Vec<String>, Vec<(String, usize)>) {
    let mut records: Vec<String> = memory
        .store()
        .all_records(ns)
        .unwrap()
        .into_iter()
        .map(|r| {
            format!(
                "{} @{} {:?}",
                r.semantic_text, r.source_session, r.evidence_turns
            )
        })
        .collect();
    records.sort();
    let nodes = memory
        .store()
        .all_nodes(ns)
        .unwrap()
        .into_iter()
        .map(|n| {
            assert_eq!(n.kind, NodeKind::Entity);
            (n.node_id, n.record_ids.len())
        })
        .collect();
    (records, nodes)
}

#[test]
fn chunks_become_a_deduplicated_graph_with_provenance_and_an_updated_summary() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, encoder) = components();
    let memory = Memory::with_components(dir.path(), lico(), comp).unwrap();
    let ns = Namespace::new("ana").unwrap();
    ingest(&memory, &ns, None);
    // Five chunks (one exchange each), two calls per chunk.
    assert_eq!(encoder.calls(), 10);
    let (records, nodes) = graph(&memory, &ns);
    assert_eq!(
        records,
        [
            "Rex - is a - beagle @s1 [0, 1]",
            "User - has cello teacher - Ms. Ortiz @s1 [4, 5]",
            "User - moved to - Lisbon @s2 [0, 1]",
            "User - owns - Rex @s1 [0, 1]",
            // The same triple stated again in another session: a second provenance entry.
            "User - owns - Rex @s2 [2, 3]",
        ]
    );
    let user = nodes
        .iter()
        .find(|(id, _)| id == "entity:person::user")
        .expect("one User entity whatever the case");
    assert_eq!(user.1, 4);
    assert!(nodes.iter().any(|(id, _)| id == "entity:object::rex"));
    assert_eq!(nodes.len(), 5, "{nodes:?}");
    // The chunk whose extraction failed is stored as failed, its turns kept.
    let rows = memory
        .store()
        .segments(&ns, &SessionId::new("s1").unwrap())
        .unwrap();
    assert_eq!(rows.len(), 3);
    assert!(matches!(
        rows[1].outcome,
        lycheemem_store::SegmentOutcome::Failed { .. }
    ));
    assert_eq!(memory.store().stats(&ns).unwrap().turns, 10);
    // The summary was created by the first chunk and updated by the third.
    let s1 = SessionSummary::load(memory.store(), &ns, &SessionId::new("s1").unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(s1.keys, ["pets", "2024/03/01", "cello"]);
    assert_eq!(s1.themes.len(), 2);
    assert_eq!(s1.key_vectors.len(), 3);
    let usage = memory.usage(&ns).unwrap();
    assert_eq!(usage.by_purpose[&Purpose::Encode].calls, 10);

    // Search: the triples touching Rex and User, their chunks, the best session's summary.
    let opts = QueryOptions {
        reference_date: Some("2024-04-12".into()),
        ..QueryOptions::default()
    };
    let result = memory.search(&ns, "What dog do I have?", &opts).unwrap();
    let too_many = QueryOptions {
        top_k: usize::MAX,
        ..opts.clone()
    };
    assert!(matches!(
        memory.search(&ns, "What dog do I have?", &too_many),
        Err(lycheemem_core::Error::InvalidInput(_))
    ));
    let chunks: Vec<(String, Vec<u32>)> = result
        .evidence
        .iter()
        .map(|e| (e.session.clone(), e.turns.clone()))
        .collect();
    assert!(chunks.contains(&("s2".into(), vec![2, 3])), "{chunks:?}");
    assert!(chunks.contains(&("s1".into(), vec![0, 1])), "{chunks:?}");
    assert!(chunks.len() <= 4);
    let triples = result
        .context
        .iter()
        .find(|b| b.title == "Triples")
        .expect("a triples block");
    assert!(triples.lines.contains(&"(User, owns, Rex)".to_string()));
    assert_eq!(
        triples
            .lines
            .iter()
            .filter(|l| *l == "(User, owns, Rex)")
            .count(),
        1,
        "a triple is listed once, whatever its provenance"
    );
    assert!(
        result
            .context
            .iter()
            .any(|b| b.title.starts_with("Session s"))
    );
    let messages = answer_messages(
        "What dog do I have?",
        Some("2024-04-12"),
        &result,
        &memory.config().licomemory,
        &memory.config().answer,
    );
    let prompt = &messages[0].content;
    let at = |s: &str| {
        prompt
            .find(s)
            .unwrap_or_else(|| panic!("{s:?} in {prompt}"))
    };
    assert!(at("Question time: 2024/04/12") < at("Session summary:"));
    assert!(at("Session summary:") < at("Triples: "));
    assert!(at("Triples: ") < at("Chunk 1: ["));
    let answer = memory.answer(&ns, "What dog do I have?", &opts).unwrap();
    assert_eq!(answer.text, "Rex, a beagle.");
    let usage = memory.usage(&ns).unwrap();
    assert_eq!(usage.by_purpose[&Purpose::Plan].calls, 2);
    assert_eq!(usage.by_purpose[&Purpose::Answer].calls, 1);
}

#[test]
fn a_restart_mid_session_builds_the_same_graph() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ns = Namespace::new("ana").unwrap();
    let (comp, _) = components();
    let whole = Memory::with_components(a.path(), lico(), comp).unwrap();
    ingest(&whole, &ns, None);
    let (comp, _) = components();
    let split = Memory::with_components(b.path(), lico(), comp).unwrap();
    let s1 = SessionId::new("s1").unwrap();
    let (_, date, turns) = conversation().remove(0);
    split
        .add_turns(&ns, &s1, Some(date), turns[..3].to_vec())
        .unwrap();
    drop(split);
    let (comp, _) = components();
    let split = Memory::with_components(b.path(), lico(), comp).unwrap();
    split
        .add_turns(&ns, &s1, None, turns[3..].to_vec())
        .unwrap();
    split.flush(&ns, &s1).unwrap();
    let (_, date, turns) = conversation().remove(1);
    let s2 = SessionId::new("s2").unwrap();
    split.add_turns(&ns, &s2, Some(date), turns).unwrap();
    split.flush(&ns, &s2).unwrap();
    assert_eq!(graph(&whole, &ns), graph(&split, &ns));
    assert_eq!(
        SessionSummary::load(whole.store(), &ns, &s1).unwrap(),
        SessionSummary::load(split.store(), &ns, &s1).unwrap()
    );
}

#[test]
fn deleting_a_session_removes_its_provenance_its_triples_and_orphan_entities() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components();
    let memory = Memory::with_components(dir.path(), lico(), comp).unwrap();
    let ns = Namespace::new("ana").unwrap();
    ingest(&memory, &ns, None);
    let receipt = memory
        .delete_session(&ns, &SessionId::new("s2").unwrap())
        .unwrap();
    assert_eq!(receipt.records, 2);
    assert_eq!(receipt.nodes_removed, 1, "Lisbon linked nothing else");
    let (records, nodes) = graph(&memory, &ns);
    assert_eq!(
        records,
        [
            "Rex - is a - beagle @s1 [0, 1]",
            "User - has cello teacher - Ms. Ortiz @s1 [4, 5]",
            "User - owns - Rex @s1 [0, 1]",
        ]
    );
    assert!(!nodes.iter().any(|(id, _)| id.contains("lisbon")));
    assert_eq!(memory.stats(&ns).unwrap().pending_vectors, 0);
    // A rewritten entity keeps its label embedding: searching by it still finds its triples.
    let result = memory
        .search(&ns, "Which dog?", &QueryOptions::default())
        .unwrap();
    assert!(result.evidence.iter().any(|e| e.turns == [0, 1]));
    // Export without vectors, import into a fresh store: the same graph, entities embedded
    // from their labels again, and the same search.
    let mut file = Vec::new();
    memory.export(&ns, &mut file, false).unwrap();
    let other = tempfile::tempdir().unwrap();
    let (comp, _) = components();
    let copy = Memory::with_components(other.path(), lico(), comp).unwrap();
    copy.import(&ns, &mut file.as_slice()).unwrap();
    assert_eq!(graph(&copy, &ns), graph(&memory, &ns));
    let user = vec![lycheemem_store::ItemRef::Node("entity:person::user".into())];
    assert_eq!(
        copy.store().vectors(&ns, &user).unwrap(),
        memory.store().vectors(&ns, &user).unwrap()
    );
    let again = copy
        .search(&ns, "Which dog?", &QueryOptions::default())
        .unwrap();
    let turns = |r: &lycheemem::SearchResult| -> Vec<(String, Vec<u32>)> {
        r.evidence
            .iter()
            .map(|e| (e.session.clone(), e.turns.clone()))
            .collect()
    };
    assert_eq!(turns(&again), turns(&result));
}

#[test]
fn whole_session_summaries_cost_one_call_per_session_and_the_strategy_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, encoder) = components();
    let mut cfg = lico();
    cfg.licomemory.summary = LicoSummaryMode::PerSession;
    let memory = Memory::with_components(dir.path(), cfg, comp).unwrap();
    let ns = Namespace::new("ana").unwrap();
    ingest(&memory, &ns, None);
    // Five extraction calls plus one summary per session; a session flushed again without new
    // turns is not summarized again.
    assert_eq!(encoder.calls(), 7);
    memory.flush(&ns, &SessionId::new("s1").unwrap()).unwrap();
    assert_eq!(encoder.calls(), 7);
    let s2 = SessionSummary::load(memory.store(), &ns, &SessionId::new("s2").unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(s2.session_time.as_deref(), Some("2024-04-10"));
    drop(memory);
    // The store remembers its strategy: opening it as LycheeMemory is refused, clearly.
    let (comp, _) = components();
    let err = Memory::with_components(dir.path(), Config::default(), comp)
        .err()
        .expect("a strategy mismatch is an error");
    assert!(
        err.to_string().contains("strategy = \"licomemory\""),
        "{err}"
    );
}

#[test]
fn a_lycheemem_store_is_not_opened_as_licomemory() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components();
    let ns = Namespace::new("ana").unwrap();
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    memory
        .add_turns(
            &ns,
            &SessionId::new("s1").unwrap(),
            None,
            vec![NewTurn::user("hi")],
        )
        .unwrap();
    drop(memory);
    let (comp, _) = components();
    assert!(Memory::with_components(dir.path(), lico(), comp).is_err());
}

#[test]
fn a_long_exchange_is_one_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, encoder) = components();
    let memory = Memory::with_components(dir.path(), lico(), comp).unwrap();
    let ns = Namespace::new("ana").unwrap();
    let s1 = SessionId::new("s1").unwrap();
    let long_reply = "Congratulations! ".repeat(400);
    memory
        .add_turns(
            &ns,
            &s1,
            Some("2024-03-01"),
            vec![
                NewTurn::user("I just adopted a beagle called Rex."),
                NewTurn::assistant(long_reply),
            ],
        )
        .unwrap();
    memory.flush(&ns, &s1).unwrap();
    let rows = memory.store().segments(&ns, &s1).unwrap();
    let spans: Vec<(u32, u32)> = rows
        .iter()
        .map(|r| (r.segment.first_turn, r.segment.last_turn))
        .collect();
    assert_eq!(
        spans,
        [(0, 1)],
        "an exchange over the segment cap stays one chunk"
    );
    assert_eq!(encoder.calls(), 2);
}

/// Everything a search hands the answer prompt: the chunks with their turns, in order, and the
/// context blocks.
fn search_view(result: &lycheemem::SearchResult) -> (Vec<(String, Vec<u32>)>, Vec<String>) {
    let evidence = result
        .evidence
        .iter()
        .map(|e| (e.session.clone(), e.turns.clone()))
        .collect();
    let context = result
        .context
        .iter()
        .map(|b| format!("{}: {}", b.title, b.lines.join(" | ")))
        .collect();
    (evidence, context)
}

#[test]
fn postgresql_holds_the_same_graph_summaries_and_search_as_a_store_directory() {
    let url = lycheemem_testkit::postgres_test_url();
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components();
    let local = Memory::with_components(dir.path(), lico(), comp).unwrap();
    let mut cfg = lico();
    cfg.store.postgres_schema = lycheemem_testkit::unique_schema("licomemory");
    let (comp, pg_encoder) = components();
    let shared = Memory::with_components(std::path::Path::new(&url), cfg.clone(), comp).unwrap();
    let ns = Namespace::new("ana").unwrap();
    ingest(&local, &ns, None);
    ingest(&shared, &ns, None);
    assert_eq!(pg_encoder.calls(), 10);
    assert_eq!(graph(&shared, &ns), graph(&local, &ns));
    for sid in ["s1", "s2"] {
        let s = SessionId::new(sid).unwrap();
        assert_eq!(
            SessionSummary::load(shared.store(), &ns, &s).unwrap(),
            SessionSummary::load(local.store(), &ns, &s).unwrap()
        );
    }
    let opts = QueryOptions {
        reference_date: Some("2024-04-12".into()),
        ..QueryOptions::default()
    };
    let search = |m: &Memory| search_view(&m.search(&ns, "What dog do I have?", &opts).unwrap());
    let on_pg = search(&shared);
    assert!(!on_pg.0.is_empty() && !on_pg.1.is_empty());
    assert_eq!(on_pg, search(&local));
    // The deletion cascade is the same on both.
    let s2 = SessionId::new("s2").unwrap();
    let (a, b) = (
        shared.delete_session(&ns, &s2).unwrap(),
        local.delete_session(&ns, &s2).unwrap(),
    );
    assert_eq!((a.records, a.nodes_removed), (b.records, b.nodes_removed));
    assert_eq!(graph(&shared, &ns), graph(&local, &ns));
    assert_eq!(search(&shared), search(&local));
    // Reopened from the database by another process's view: the strategy is kept there too.
    drop(shared);
    let (comp, _) = components();
    let again = Memory::with_components(std::path::Path::new(&url), cfg.clone(), comp).unwrap();
    assert_eq!(graph(&again, &ns), graph(&local, &ns));
    let (comp, _) = components();
    let mut lychee = Config::default();
    lychee.store.postgres_schema = cfg.store.postgres_schema.clone();
    assert!(Memory::with_components(std::path::Path::new(&url), lychee, comp).is_err());
}
