//! The storage backend conformance suite: what every `MemoryStore` must do — writes and reads,
//! namespaces, cascading deletes, filters, paging, searches, export/import, the restatement
//! rule, BM25 statistics and bad input — written against the traits only. It runs against the
//! backend `LYCHEEMEM_TEST_BACKEND` names (`redb`, the default); a new backend adds itself to
//! `common::open_backend` and must pass it unchanged. What only the redb store does (its lock,
//! its index folders, its HNSW tuning) is tested in `redb_store.rs`.

mod common;

use common::*;
use lycheemem_core::{NodeKind, Purpose, TokenUsage, TurnRef};
use lycheemem_store::prelude::*;
use lycheemem_store::{
    ExportOptions, ItemRef, NodeMembers, SegmentOutcome, SegmentWrite, SessionInfo, Target,
    VectorQuery,
};

fn open(dir: &std::path::Path) -> Box<dyn MemoryStore> {
    open_backend(dir)
}

#[test]
fn turns_segments_records_nodes_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("alice");
    store
        .put_session(&a, SessionInfo::new(sid("s1"), Some("2023-05-08".into())))
        .unwrap();
    add_turns(&*store, &a, "s1", 6, 0);
    let mut w = segment_write(
        &a,
        "s1",
        0,
        3,
        &["Alice adopted a cat", "Alice lives in Oslo"],
        100,
    );
    let seg_record = w.records[0].0.clone();
    let day = node(NodeKind::Temporal, "day:2023-05-07", &[&seg_record]);
    let month = node(NodeKind::Temporal, "month:2023-05", &[&seg_record]);
    w.nodes.push((day, Some(vector(7))));
    w.nodes.push((month, None));
    w.state.push((
        sid("s1"),
        "segmenter".into(),
        serde_json::json!({"centroid": [1, 2]}),
    ));
    w.usage.push(TokenUsage {
        purpose: Purpose::Encode,
        model: "m".into(),
        prompt_tokens: 100,
        completion_tokens: 20,
        latency_ms: 5,
        estimated: false,
    });
    store.commit_segment(&a, w).unwrap();

    let stats = store.stats(&a).unwrap();
    assert_eq!(
        (stats.sessions, stats.turns, stats.segments, stats.records),
        (1, 6, 1, 2)
    );
    assert_eq!(stats.nodes["entity"], 1);
    assert_eq!(stats.nodes["temporal"], 2);
    assert_eq!(
        stats.pending_vectors, 1,
        "the month node was stored without a vector"
    );
    assert_eq!(stats.usage.tokens(Purpose::Encode), 120);
    assert_eq!(stats.vectors, stats.indexed_vectors);
    assert_eq!(stats.text_rows["record"], 2);
    assert_eq!(stats.text_rows["turn"], 6);

    // Vector search finds the record by its own vector.
    let hits = store
        .vector_search(&a, &VectorQuery::new(Target::Record, vector(101), 1))
        .unwrap();
    assert_eq!(
        hits[0].item,
        ItemRef::Record(w_id(&a, "Alice lives in Oslo"))
    );
    assert!(hits[0].score > 0.99);
    // BM25 finds it by a word (stemmed: "adopting" matches "adopted").
    let hits = store
        .text_search(&a, Target::Record, "adopting cats", 5, None)
        .unwrap();
    assert_eq!(hits[0].item, ItemRef::Record(seg_record.record_id.clone()));
    // Temporal range lookup: the day inside the range and the month it touches.
    let found = store
        .temporal_nodes(&a, "2023-05-01", "2023-05-10")
        .unwrap();
    let ids: Vec<&str> = found.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["temporal:day:2023-05-07", "temporal:month:2023-05"]);
    assert!(
        store
            .temporal_nodes(&a, "2023-05-08", "2023-06-30")
            .unwrap()
            .len()
            == 1
    );
    assert!(
        store
            .temporal_nodes(&a, "2023-07", "2023-08")
            .unwrap()
            .is_empty()
    );
    assert!(store.temporal_nodes(&a, "last week", "2023-08").is_err());
    // The temporal channel's read: the same nodes, in order, with every record listed.
    for (since, until) in [
        ("2023-05-01", "2023-05-10"),
        ("2023-05", "2023-06-30"),
        ("2023-07", "2023-08"),
    ] {
        let members = store.temporal_members(&a, since, until).unwrap();
        let expected: Vec<NodeMembers> = store
            .temporal_nodes(&a, since, until)
            .unwrap()
            .into_iter()
            .map(|n| NodeMembers::of(n, usize::MAX))
            .collect();
        assert_eq!(members, expected, "{since}..{until}");
    }
    assert!(
        !store.temporal_members(&a, "2023-05", "2023-05").unwrap()[0]
            .record_ids
            .as_ref()
            .unwrap()
            .is_empty()
    );
    assert!(store.temporal_members(&a, "last week", "2023-08").is_err());
    // Turn windows clamp at both ends.
    let window = store
        .turn_window(
            &a,
            &TurnRef {
                session: sid("s1"),
                index: 1,
            },
            2,
        )
        .unwrap();
    assert_eq!(
        window.iter().map(|t| t.index).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    let state = store.state(&a, &sid("s1"), "segmenter").unwrap().unwrap();
    assert_eq!(state["centroid"][1], 2);
    let segs = store.segments(&a, &sid("s1")).unwrap();
    assert_eq!(segs[0].record_ids.len(), 2);
    // Pending vectors can be filled in later.
    let pending = store.pending_vectors(&a, 10).unwrap();
    assert_eq!(pending.len(), 1);
    assert!(pending[0].1.starts_with("month:2023-05"));
    store
        .set_vectors(&a, &[(pending[0].0.clone(), vector(9))])
        .unwrap();
    assert_eq!(store.stats(&a).unwrap().pending_vectors, 0);
    let hits = store
        .vector_search(
            &a,
            &VectorQuery::new(Target::Node(NodeKind::Temporal), vector(9), 1),
        )
        .unwrap();
    assert_eq!(hits[0].item, ItemRef::Node("temporal:month:2023-05".into()));
}

fn w_id(ns: &lycheemem_core::Namespace, text: &str) -> String {
    lycheemem_core::Record::make_id(ns, text)
}

#[test]
fn bad_writes_are_rejected_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("a");
    add_turns(&*store, &a, "s", 2, 0);
    // Skipping ahead.
    let err = store
        .add_turns(&a, vec![(turn("s", 5, "x"), None)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("next turn index is 2"), "{err}");
    // An identical retry is accepted; a different text at the same index is not.
    store
        .add_turns(
            &a,
            vec![(turn("s", 1, "s turn 1 about word1"), Some(vector(1)))],
        )
        .unwrap();
    assert!(
        store
            .add_turns(&a, vec![(turn("s", 1, "changed"), None)])
            .is_err()
    );
    // Wrong dimensions, NaN.
    assert!(
        store
            .add_turns(&a, vec![(turn("s", 2, "x"), Some(vec![1.0; 3]))])
            .is_err()
    );
    let mut nan = vector(3);
    nan[0] = f32::NAN;
    assert!(
        store
            .add_turns(&a, vec![(turn("s", 2, "x"), Some(nan))])
            .is_err()
    );
    // A batch with one bad turn stores none of it.
    let batch = vec![(turn("s", 2, "ok"), None), (turn("s", 9, "bad"), None)];
    assert!(store.add_turns(&a, batch).is_err());
    assert_eq!(store.turns(&a, &sid("s")).unwrap().len(), 2);
    // A segment beyond the stored turns, a record citing a missing turn, a node with an
    // unknown record.
    assert!(
        store
            .commit_segment(&a, segment_write(&a, "s", 0, 4, &["x"], 1))
            .is_err()
    );
    let mut w = segment_write(&a, "s", 0, 1, &["y"], 1);
    w.records[0].0.evidence_turns = vec![7];
    let err = store.commit_segment(&a, w).unwrap_err().to_string();
    assert!(err.contains("s#7"), "{err}");
    let mut w = segment_write(&a, "s", 0, 1, &["z"], 1);
    w.records.clear();
    assert!(store.commit_segment(&a, w).is_err());
    let stats = store.stats(&a).unwrap();
    assert_eq!((stats.segments, stats.records), (0, 0));
}

#[test]
fn namespaces_never_see_each_other_and_deleting_one_spares_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (a, b) = (ns("tenant-a"), ns("tenant-b"));
    // Interleaved writes with the same session names and texts.
    for round in 0..3u32 {
        for n in [&a, &b] {
            add_turns(&*store, n, "shared", 2, 0);
            let w = segment_write(
                n,
                "shared",
                round * 2,
                round * 2 + 1,
                &[&format!("fact {round}")],
                50,
            );
            store.commit_segment(n, w).unwrap();
        }
    }
    let before_b = store.stats(&b).unwrap();
    // Same texts, but ids are per namespace and searches stay inside.
    for n in [&a, &b] {
        let hits = store
            .text_search(n, Target::Record, "fact", 10, None)
            .unwrap();
        assert_eq!(hits.len(), 3);
        for h in hits {
            let ItemRef::Record(id) = h.item else {
                panic!()
            };
            assert_eq!(store.records(n, &[id]).unwrap().len(), 1);
        }
    }
    let receipt = store.delete_namespace(&a).unwrap();
    assert_eq!(
        (receipt.sessions, receipt.turns, receipt.records),
        (1, 6, 3)
    );
    assert_eq!(receipt.nodes_removed, 3);
    let after_a = store.stats(&a).unwrap();
    assert_eq!(after_a.turns + after_a.records + after_a.segments, 0);
    assert!(after_a.indexed_vectors.values().all(|v| *v == 0));
    assert!(after_a.text_rows.values().all(|v| *v == 0));
    assert!(
        store
            .text_search(&a, Target::Turn, "turn", 10, None)
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.stats(&b).unwrap(), before_b);
    assert_eq!(store.namespaces().unwrap(), vec![b.clone()]);
    // Survives a reopen too.
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.stats(&b).unwrap(), before_b);
    assert_eq!(store.stats(&a).unwrap().turns, 0);
}

#[test]
fn deleting_a_record_cascades_to_nodes_and_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("a");
    add_turns(&*store, &a, "s", 4, 0);
    let w = segment_write(
        &a,
        "s",
        0,
        3,
        &["Alice owns a red bicycle", "Alice likes tea"],
        10,
    );
    let (bike, tea) = (w.records[0].0.clone(), w.records[1].0.clone());
    let only_bike = node(NodeKind::Topic, "bicycles", &[&bike]);
    let mut w = w;
    w.nodes.push((only_bike, Some(vector(77))));
    store.commit_segment(&a, w).unwrap();

    let receipt = store.delete_record(&a, &bike.record_id).unwrap();
    assert_eq!(receipt.records, 1);
    assert_eq!(
        receipt.nodes_removed, 1,
        "the topic node linked only the bicycle"
    );
    assert_eq!(
        receipt.nodes_updated, 1,
        "the entity node keeps the tea record"
    );
    assert_eq!(receipt.vectors, 2);
    let entity = &store.all_nodes(&a).unwrap()[0];
    assert_eq!(entity.record_ids.len(), 1);
    assert!(
        !entity.search_text.contains("bicycle"),
        "{}",
        entity.search_text
    );
    assert!(entity.search_text.contains("tea"));
    assert!(
        store
            .text_search(&a, Target::Record, "bicycle", 5, None)
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .text_search(&a, Target::Node(NodeKind::Entity), "bicycle", 5, None)
            .unwrap()
            .is_empty()
    );
    // The rewritten node's old vector (which embedded the deleted text) is gone and queued.
    let stats = store.stats(&a).unwrap();
    assert_eq!(stats.indexed_vectors["entity"], 0);
    assert_eq!(stats.pending_vectors, 1);
    assert_eq!(
        store.segments(&a, &sid("s")).unwrap()[0].record_ids,
        vec![tea.record_id.clone()]
    );

    let receipt = store.delete_session(&a, &sid("s")).unwrap();
    assert_eq!(
        (receipt.sessions, receipt.turns, receipt.segments),
        (1, 4, 1)
    );
    assert_eq!((receipt.records, receipt.nodes_removed), (1, 1));
    let stats = store.stats(&a).unwrap();
    assert_eq!(stats.turns + stats.records + stats.pending_vectors, 0);
    assert!(stats.vectors.values().all(|v| *v == 0));
}

#[test]
fn export_import_round_trip_with_and_without_vectors() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("src");
    store
        .put_session(&a, SessionInfo::new(sid("s"), Some("2023-01-02".into())))
        .unwrap();
    add_turns(&*store, &a, "s", 4, 0);
    let mut w = segment_write(&a, "s", 0, 3, &["one fact", "another fact"], 5);
    w.state.push((
        sid("s"),
        "reference_context".into(),
        serde_json::json!(["one fact"]),
    ));
    store.commit_segment(&a, w).unwrap();
    let mut failed = SegmentWrite::new(
        segment("s", 3, 3),
        SegmentOutcome::Failed {
            error: "bad json".into(),
        },
    );
    failed.usage.push(TokenUsage {
        purpose: Purpose::Encode,
        model: "m".into(),
        prompt_tokens: 3,
        completion_tokens: 4,
        latency_ms: 1,
        estimated: true,
    });
    store.commit_segment(&a, failed).unwrap();

    let mut with_vectors = Vec::new();
    store
        .export(
            &a,
            &mut with_vectors,
            ExportOptions {
                include_vectors: true,
            },
        )
        .unwrap();
    let b = ns("copy");
    let receipt = store
        .import(&b, &mut with_vectors.as_slice(), None)
        .unwrap();
    assert_eq!(receipt.vectors_pending, 0);
    let (sa, sb) = (store.stats(&a).unwrap(), store.stats(&b).unwrap());
    assert_eq!(sa, sb);
    // Ids are kept as exported, so node links and segments stay valid.
    assert_eq!(
        store.all_records(&a).unwrap(),
        store.all_records(&b).unwrap()
    );
    assert_eq!(store.all_nodes(&a).unwrap(), store.all_nodes(&b).unwrap());
    assert_eq!(
        store.turns(&a, &sid("s")).unwrap(),
        store.turns(&b, &sid("s")).unwrap()
    );
    assert_eq!(
        store.segments(&a, &sid("s")).unwrap(),
        store.segments(&b, &sid("s")).unwrap()
    );
    assert_eq!(
        store.state(&b, &sid("s"), "reference_context").unwrap(),
        Some(serde_json::json!(["one fact"]))
    );
    // Importing again into a non-empty namespace is refused.
    assert!(
        store
            .import(&b, &mut with_vectors.as_slice(), None)
            .is_err()
    );

    // Without vectors: recomputed by the embedding function.
    let mut without = Vec::new();
    store
        .export(&a, &mut without, ExportOptions::default())
        .unwrap();
    let c = ns("recomputed");
    let embed = |texts: &[String]| -> lycheemem_core::Result<Vec<Vec<f32>>> {
        Ok(texts.iter().map(|t| vector(t.len() as u64)).collect())
    };
    let receipt = store
        .import(&c, &mut without.as_slice(), Some(&embed))
        .unwrap();
    assert_eq!(receipt.vectors_imported, 0);
    assert_eq!(receipt.vectors_computed, 4 + 2 + 1);
    let sc = store.stats(&c).unwrap();
    assert_eq!(sc.indexed_vectors, sa.indexed_vectors);
    // A malformed line is reported with its number and nothing is imported.
    let mut broken = without.clone();
    broken.extend_from_slice(b"{not json}\n");
    let err = store
        .import(&ns("broken"), &mut broken.as_slice(), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("line"), "{err}");
    assert_eq!(store.stats(&ns("broken")).unwrap().turns, 0);
    // The whole file is checked before anything is written: a file cut at a line end, an end
    // line whose counts disagree, a record of a session the file lacks, a record citing a turn
    // the file lacks, a segment ending before it starts, a node linking a missing record: each
    // refused, nothing imported.
    let text = String::from_utf8(without.clone()).unwrap();
    let lines: Vec<String> = text.lines().map(String::from).collect();
    let find = |kind: &str| {
        lines
            .iter()
            .position(|l| l.contains(&format!("\"kind\":\"{kind}\"")))
            .unwrap()
    };
    let edit = |f: &dyn Fn(&mut Vec<String>)| {
        let mut l = lines.clone();
        f(&mut l);
        l.join("\n") + "\n"
    };
    let session_line = find("session");
    let record_line = find("record");
    let node_line = find("node");
    let cases: Vec<(&str, String)> = vec![
        ("truncated", edit(&|l| l.truncate(l.len() - 2))),
        (
            "lines are missing",
            edit(&|l| {
                l.remove(find("turn"));
            }),
        ),
        (
            "does not hold",
            edit(&|l| {
                l.remove(session_line);
                // The end line's count follows, so only the reference is wrong.
                let end = l.len() - 1;
                l[end] = l[end].replace("\"sessions\":1", "\"sessions\":0");
            }),
        ),
        (
            "cites turn",
            edit(&|l| {
                let mut v: serde_json::Value = serde_json::from_str(&l[record_line]).unwrap();
                v["record"]["evidence_turns"] = serde_json::json!([999]);
                l[record_line] = v.to_string();
            }),
        ),
        (
            "after it ends",
            edit(&|l| {
                let i = find("segment");
                let mut v: serde_json::Value = serde_json::from_str(&l[i]).unwrap();
                let last = v["segment"]["last_turn"].as_u64().unwrap();
                v["segment"]["first_turn"] = serde_json::json!(last + 1);
                l[i] = v.to_string();
            }),
        ),
        (
            "links record",
            edit(&|l| {
                let mut v: serde_json::Value = serde_json::from_str(&l[node_line]).unwrap();
                v["node"]["record_ids"] = serde_json::json!(["no-such-record"]);
                l[node_line] = v.to_string();
            }),
        ),
    ];
    for (want, file) in cases {
        let err = store
            .import(&ns("checked"), &mut file.as_bytes(), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
        assert!(
            !store.has_namespace(&ns("checked")).unwrap(),
            "{want}: nothing imported"
        );
    }
}

#[test]
fn invalid_utf8_and_huge_text_are_handled() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("a");
    // Huge text is stored and searchable; it is the caller's job to cap what it embeds.
    let big = "lorem ipsum ".repeat(100_000);
    store
        .add_turns(&a, vec![(turn("s", 0, &big), Some(vector(1)))])
        .unwrap();
    assert_eq!(
        store
            .text_search(&a, Target::Turn, "ipsum", 1, None)
            .unwrap()
            .len(),
        1
    );
    // Invalid UTF-8 in an import file is a clear error.
    let mut bytes = Vec::new();
    store
        .export(&a, &mut bytes, ExportOptions::default())
        .unwrap();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    assert!(store.import(&ns("b"), &mut bytes.as_slice(), None).is_err());
}

#[test]
fn records_are_listed_page_by_page_per_namespace_and_session() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("alice");
    for (session, seed, texts) in [
        ("s1", 10, &["r one", "r two", "r three"][..]),
        ("s2", 20, &["r four", "r five"][..]),
    ] {
        store
            .put_session(&a, SessionInfo::new(sid(session), None))
            .unwrap();
        add_turns(&*store, &a, session, 4, seed);
        store
            .commit_segment(&a, segment_write(&a, session, 0, 3, texts, seed * 10))
            .unwrap();
    }
    let all = store.all_records(&a).unwrap();
    assert_eq!(all.len(), 5);
    // Pages cover every record once, in id order.
    let mut paged = Vec::new();
    for offset in [0, 2, 4] {
        let (total, page) = store.records_page(&a, None, offset, 2).unwrap();
        assert_eq!(total, 5);
        paged.extend(page);
    }
    assert_eq!(paged, all);
    let (total, page) = store.records_page(&a, None, 9, 2).unwrap();
    assert_eq!((total, page.len()), (5, 0));
    // One session's records only.
    let (total, page) = store.records_page(&a, Some(&sid("s2")), 0, 10).unwrap();
    assert_eq!(total, 2);
    assert!(page.iter().all(|r| r.source_session.as_str() == "s2"));
    let (total, page) = store.records_page(&a, Some(&sid("s1")), 1, 1).unwrap();
    assert_eq!((total, page.len()), (3, 1));
    // Another namespace sees nothing.
    let (total, page) = store.records_page(&ns("bob"), None, 0, 10).unwrap();
    assert_eq!((total, page.len()), (0, 0));
}

#[test]
fn scoring_vectors_match_the_stored_vectors_by_cosine() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("alice");
    store
        .put_session(&a, SessionInfo::new(sid("s1"), None))
        .unwrap();
    add_turns(&*store, &a, "s1", 3, 5);
    let w = segment_write(&a, "s1", 0, 2, &["Alice adopted a cat"], 77);
    let rid = w.records[0].0.record_id.clone();
    store.commit_segment(&a, w).unwrap();
    let items = vec![
        ItemRef::Record(rid),
        ItemRef::Turn(TurnRef {
            session: sid("s1"),
            index: 1,
        }),
        ItemRef::Record("r_missing".into()),
    ];
    let stored = store.vectors(&a, &items).unwrap();
    let scoring = store.scoring_vectors(&a, &items).unwrap();
    assert_eq!(scoring.len(), 3);
    for (s, v) in stored.iter().zip(&scoring).take(2) {
        let (s, v) = (s.as_ref().unwrap(), v.as_ref().unwrap());
        let cos = lycheemem_core::vector::cosine(s, v);
        assert!(cos > 0.9999, "cosine {cos}");
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-4,
            "indexed vectors are unit length: {norm}"
        );
    }
    assert!(scoring[2].is_none());
}

#[test]
fn node_members_and_node_search_see_every_write_that_returned() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("alice");
    add_turns(&*store, &a, "s", 6, 0);
    // One node linking 70 records: large enough for a backend to keep it resolved.
    let texts: Vec<String> = (0..70).map(|i| format!("Alice fact number {i}")).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let w = segment_write(&a, "s", 0, 3, &refs, 10);
    let node_id = w.nodes[0].0.node_id.clone();
    let mut records: Vec<lycheemem_core::Record> =
        w.records.iter().map(|(r, _)| r.clone()).collect();
    store.commit_segment(&a, w).unwrap();
    let ids = vec![node_id.clone(), "entity:nobody".to_string()];

    let listed = store.node_members(&a, &ids, 100).unwrap();
    assert_eq!(listed.len(), 1, "a missing node is left out");
    let mut expected: Vec<String> = records.iter().map(|r| r.record_id.clone()).collect();
    expected.sort();
    assert_eq!(listed[0].records, 70);
    assert_eq!(listed[0].record_ids.as_deref(), Some(expected.as_slice()));
    let unlisted = store.node_members(&a, &ids, 10).unwrap();
    assert_eq!((unlisted[0].records, &unlisted[0].record_ids), (70, &None));

    let by_node = |q: &[f32], k: usize| store.vector_search_node(&a, &node_id, q, k).unwrap();
    let within = |q: &[f32], k: usize, ids: &[String]| {
        store
            .vector_search_within(&a, Target::Record, q, k, ids)
            .unwrap()
    };
    let q = vector(15);
    assert_eq!(by_node(&q, 5), within(&q, 5, &expected));
    assert_eq!(
        by_node(&q, 1)[0].item,
        ItemRef::Record(records[5].record_id.clone())
    );
    assert!(
        store
            .vector_search_node(&a, "entity:nobody", &q, 5)
            .unwrap()
            .is_empty()
    );
    assert!(store.vector_search_node(&a, &node_id, &[1.0], 5).is_err());

    // A later segment adds a record to the node: the next search sees it.
    let fresh = vector(999);
    let mut w = segment_write(&a, "s", 4, 5, &["Alice moved to Lisbon"], 999);
    let lisbon = w.records[0].0.clone();
    assert_ne!(
        by_node(&fresh, 1)[0].item,
        ItemRef::Record(lisbon.record_id.clone())
    );
    records.push(lisbon.clone());
    let all: Vec<&lycheemem_core::Record> = records.iter().collect();
    let merged = node(NodeKind::Entity, "topic-s-0", &all);
    assert_eq!(merged.node_id, node_id);
    w.nodes = vec![(merged.clone(), Some(vector(1010)))];
    store.commit_segment(&a, w).unwrap();
    let hit = &by_node(&fresh, 1)[0];
    assert_eq!(hit.item, ItemRef::Record(lisbon.record_id.clone()));
    assert!(hit.score > 0.999);
    assert_eq!(store.node_members(&a, &ids, 10).unwrap()[0].records, 71);

    // Deleting the record unlinks it at once.
    store.delete_record(&a, &lisbon.record_id).unwrap();
    assert_eq!(store.node_members(&a, &ids, 10).unwrap()[0].records, 70);
    assert!(
        by_node(&fresh, 70)
            .iter()
            .all(|h| h.item != ItemRef::Record(lisbon.record_id.clone()))
    );
    assert_eq!(by_node(&fresh, 70).len(), 70);

    // Stated again after its deletion (a new item for the store) and linked again: the node
    // finds it, as the node search of every write that returned must.
    let mut w = segment_write(&a, "s", 4, 5, &["Alice moved to Lisbon"], 999);
    assert_eq!(w.records[0].0.record_id, lisbon.record_id);
    w.nodes = vec![(merged, Some(vector(1010)))];
    store.commit_segment(&a, w).unwrap();
    let hit = &by_node(&fresh, 1)[0];
    assert_eq!(hit.item, ItemRef::Record(lisbon.record_id.clone()));
    assert!(hit.score > 0.999);
    assert_eq!(store.node_members(&a, &ids, 10).unwrap()[0].records, 71);
}

#[test]
fn a_restated_record_keeps_its_first_statement_and_unions_the_cited_turns() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let a = ns("a");
    add_turns(&*store, &a, "s", 10, 0);
    add_turns(&*store, &a, "t", 4, 50);
    store
        .commit_segment(
            &a,
            segment_write(&a, "s", 0, 3, &["Alice owns a red bicycle"], 10),
        )
        .unwrap();
    // A later segment of the same session states the same text (a small encoder copying its
    // reference context does this) and cites its own turn.
    store
        .commit_segment(
            &a,
            segment_write(
                &a,
                "s",
                4,
                7,
                &["Alice owns a red bicycle", "Alice likes tea"],
                20,
            ),
        )
        .unwrap();
    // Another session states it too.
    store
        .commit_segment(
            &a,
            segment_write(&a, "t", 0, 3, &["Alice owns a red bicycle"], 30),
        )
        .unwrap();
    let id = w_id(&a, "Alice owns a red bicycle");
    let records = store.all_records(&a).unwrap();
    assert_eq!(records.len(), 2, "identical text is one record");
    let bike = records.iter().find(|r| r.record_id == id).unwrap();
    assert_eq!(bike.source_session, sid("s"), "the first statement stays");
    assert_eq!(bike.segment_id, "s#0-3");
    assert_eq!(
        bike.evidence_turns,
        [0, 4],
        "the same session's restatement adds its turn"
    );
    // The indexes keep the first statement: its vector, and one full-text entry.
    let bike_ref = ItemRef::Record(id.clone());
    assert_eq!(
        store.vectors(&a, std::slice::from_ref(&bike_ref)).unwrap(),
        [Some(vector(10))]
    );
    let hits = store
        .text_search(&a, Target::Record, "red bicycle", 10, None)
        .unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    // A record whose vector was still pending takes the restatement's.
    let mut pending = segment_write(&a, "s", 8, 8, &["Alice rides at dawn"], 40);
    pending.records[0].1 = None;
    store.commit_segment(&a, pending).unwrap();
    let dawn = ItemRef::Record(w_id(&a, "Alice rides at dawn"));
    assert_eq!(
        store.vectors(&a, std::slice::from_ref(&dawn)).unwrap(),
        [None]
    );
    store
        .commit_segment(
            &a,
            segment_write(&a, "s", 9, 9, &["Alice rides at dawn"], 50),
        )
        .unwrap();
    assert_eq!(
        store.vectors(&a, std::slice::from_ref(&dawn)).unwrap(),
        [Some(vector(50))]
    );
    assert!(store.pending_vectors(&a, 10).unwrap().is_empty());
    let hits = store
        .vector_search(&a, &VectorQuery::new(Target::Record, vector(50), 1))
        .unwrap();
    assert_eq!(hits[0].item, dawn, "{hits:?}");

    // Deleting it clears it from every segment of its session; deleting the other session
    // leaves it alone.
    store.delete_session(&a, &sid("t")).unwrap();
    assert!(
        store
            .all_records(&a)
            .unwrap()
            .iter()
            .any(|r| r.record_id == id)
    );
    store.delete_record(&a, &id).unwrap();
    for seg in store.segments(&a, &sid("s")).unwrap() {
        assert!(!seg.record_ids.contains(&id), "{:?}", seg.segment.id);
    }
}

/// Writes the same session (turns and records about cats and bikes) into `ns` of `store`.
fn write_cats_and_bikes(store: &dyn MemoryStore, ns: &lycheemem_core::Namespace) {
    store
        .put_session(ns, SessionInfo::new(sid("s1"), Some("2023-05-08".into())))
        .unwrap();
    add_turns(store, ns, "s1", 4, 0);
    let texts = [
        "Alice adopted a tabby cat",
        "Alice rides her bike to work",
        "The cat sleeps on the bike seat",
        "Alice bought a cat tree and a cat bed",
        "Bob fixed the bike chain",
        "Alice thinks a cat is better than a dog",
    ];
    store
        .commit_segment(ns, segment_write(ns, "s1", 0, 3, &texts, 100))
        .unwrap();
}

#[test]
fn bm25_scores_depend_on_what_the_store_holds_not_on_what_it_held() {
    // Two stores end up holding the same namespace; one also held another namespace full of
    // the query's words, committed to the full-text index together with it (so they share an
    // index segment), then deleted. Deleted documents stay in a segment with live ones until a
    // merge purges them, and must not count towards document frequencies, the document count
    // or the average length.
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (clean, used) = (open(d1.path()), open(d2.path()));
    let (a, b) = (ns("alice"), ns("bob"));
    used.put_session(&b, SessionInfo::new(sid("s1"), None))
        .unwrap();
    add_turns(&*used, &b, "s1", 2, 50);
    let noise: Vec<String> = (0..12)
        .map(|i| format!("cat cat cat number {i} with a long tail of words to change lengths"))
        .collect();
    let noise: Vec<&str> = noise.iter().map(String::as_str).collect();
    used.commit_segment(&b, segment_write(&b, "s1", 0, 1, &noise, 500))
        .unwrap();
    write_cats_and_bikes(&*used, &a);
    assert_eq!(
        used.text_search(&b, Target::Record, "cat", 20, None)
            .unwrap()
            .len(),
        12
    );
    used.delete_namespace(&b).unwrap();
    write_cats_and_bikes(&*clean, &a);
    for (target, query) in [
        (Target::Record, "cat bike"),
        (Target::Record, "Alice cat"),
        (Target::Turn, "turn word2"),
    ] {
        let hits = |store: &dyn MemoryStore| -> Vec<(ItemRef, f32)> {
            store
                .text_search(&a, target, query, 4, None)
                .unwrap()
                .into_iter()
                .map(|h| (h.item, h.score))
                .collect()
        };
        let expected = hits(&*clean);
        assert!(!expected.is_empty());
        assert_eq!(hits(&*used), expected, "{query}");
    }
}

#[test]
fn bm25_ties_rank_by_id_whatever_order_the_documents_were_written_in() {
    let texts = ["a cat named Miso", "a cat named Tofu", "a cat named Yuzu"];
    let reversed: Vec<&str> = texts.iter().rev().copied().collect();
    let a = ns("alice");
    let top = |texts: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        store
            .put_session(&a, SessionInfo::new(sid("s1"), None))
            .unwrap();
        add_turns(&*store, &a, "s1", 2, 0);
        store
            .commit_segment(&a, segment_write(&a, "s1", 0, 1, texts, 100))
            .unwrap();
        let hits = store
            .text_search(&a, Target::Record, "cat", 2, None)
            .unwrap();
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].score, hits[1].score, "the three records tie");
        hits.into_iter().map(|h| h.item).collect::<Vec<_>>()
    };
    let forward = top(&texts);
    assert_eq!(top(&reversed), forward);
    let mut sorted = forward.clone();
    sorted.sort_by_key(|i| format!("{i:?}"));
    assert_eq!(forward, sorted);
}

#[test]
fn settings_are_versioned_and_refuse_stale_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    assert_eq!(store.setting("api_keys").unwrap(), None);
    let v1 = serde_json::json!({"keys": []});
    assert_eq!(store.put_setting("api_keys", &v1, Some(0)).unwrap(), 1);
    assert_eq!(store.setting("api_keys").unwrap(), Some((v1.clone(), 1)));
    // A writer that read version 0 lost the race: refused, nothing changed.
    let stale = serde_json::json!({"keys": ["x"]});
    assert!(matches!(
        store.put_setting("api_keys", &stale, Some(0)),
        Err(lycheemem_core::Error::Conflict(_))
    ));
    assert_eq!(store.setting("api_keys").unwrap(), Some((v1, 1)));
    assert_eq!(store.put_setting("api_keys", &stale, Some(1)).unwrap(), 2);
    assert_eq!(store.put_setting("api_keys", &stale, None).unwrap(), 3);
    // Settings belong to the store, not to a namespace: deleting one leaves them.
    let a = ns("a");
    store
        .put_session(&a, SessionInfo::new(sid("s"), None))
        .unwrap();
    store.delete_namespace(&a).unwrap();
    assert_eq!(store.setting("api_keys").unwrap().map(|(_, v)| v), Some(3));
    drop(store);
    let reopened = open(dir.path());
    assert_eq!(reopened.setting("api_keys").unwrap(), Some((stale, 3)));
}
