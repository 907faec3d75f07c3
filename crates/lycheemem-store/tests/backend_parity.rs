//! The PostgreSQL backend against the embedded one: the same writes give the same reads,
//! listings, exports and search results (full-text scores equal to 1e-5, vector hits in the
//! same order). Needs `LYCHEEMEM_TEST_POSTGRES_URL` (`cargo xtask test` starts a throwaway
//! cluster and sets it; `scripts/postgres.sh start DIR` prints one).

mod common;

use common::*;
use lycheemem_core::{NodeKind, Purpose, TokenUsage};
use lycheemem_store::prelude::*;
use lycheemem_store::{ExportOptions, Hit, SessionInfo, StoreOptions, Target, VectorQuery};

/// An embedded store and a PostgreSQL one, each keyed to its own temporary folder (bind the
/// folders first, so they are dropped after the stores).
fn both_backends() -> (
    (tempfile::TempDir, tempfile::TempDir),
    Box<dyn MemoryStore>,
    Box<dyn MemoryStore>,
) {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let redb: Box<dyn MemoryStore> =
        Box::new(lycheemem_store::Store::open(d1.path(), StoreOptions::new(DIMS)).unwrap());
    let pg = postgres(d2.path());
    ((d1, d2), redb, pg)
}

/// Writes `texts` as the turns of a new session `session` (no vectors) into each store.
fn add_session_texts(stores: [&dyn MemoryStore; 2], session: &str, texts: &[String]) {
    let a = ns("alice");
    for store in stores {
        store
            .put_session(&a, SessionInfo::new(sid(session), None))
            .unwrap();
        let turns = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (turn(session, i as u32, t), None))
            .collect();
        store.add_turns(&a, turns).unwrap();
    }
}

fn postgres(dir: &std::path::Path) -> Box<dyn MemoryStore> {
    let url = std::env::var("LYCHEEMEM_TEST_POSTGRES_URL").expect(
        "backend_parity needs LYCHEEMEM_TEST_POSTGRES_URL: a PostgreSQL database with pgvector \
         (run the README's test command, or scripts/postgres.sh install && \
         scripts/postgres.sh start DIR, which prints the URL)",
    );
    let name = dir.file_name().unwrap().to_string_lossy().to_lowercase();
    let schema: String = format!(
        "parity_{}",
        name.chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
    );
    let config = lycheemem_store_postgres::PgConfig::new(url).with_schema(schema);
    Box::new(lycheemem_store_postgres::PgStore::open(&config, StoreOptions::new(DIMS)).unwrap())
}

const WORDS: [&str; 16] = [
    "cat", "bike", "Paris", "concert", "garden", "tomatoes", "running", "marathon", "painting",
    "sunset", "guitar", "lessons", "hiking", "trail", "coffee", "roasting",
];

/// Deterministic text: `n` words picked by `seed`.
fn text(seed: u64, n: usize) -> String {
    (0..n)
        .map(|i| WORDS[((seed * 7 + i as u64 * 5 + (seed >> 2)) % 16) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The same history for any backend: three sessions, segments with records and nodes of
/// several kinds (temporal too), a restatement, a pending vector, a deleted record, usage.
fn write_history(store: &dyn MemoryStore) {
    let a = ns("alice");
    for (s, date) in [
        ("s1", "2023-05-08"),
        ("s2", "2023-06-10"),
        ("s3", "2023-07-02"),
    ] {
        store
            .put_session(&a, SessionInfo::new(sid(s), Some(date.into())))
            .unwrap();
        let turns = (0..12u32)
            .map(|i| {
                let seed = u64::from(i) + 100 * u64::from(s.as_bytes()[1]);
                (
                    turn(
                        s,
                        i,
                        &format!("{} and {}", text(seed, 6), text(seed + 3, 3)),
                    ),
                    (i != 5).then(|| vector(seed)),
                )
            })
            .collect();
        store.add_turns(&a, turns).unwrap();
        for (first, last) in [(0u32, 5u32), (6, 11)] {
            let seed = 1000 * u64::from(s.as_bytes()[1]) + u64::from(first);
            let texts: Vec<String> = (0..4).map(|i| text(seed + i, 5 + i as usize)).collect();
            let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
            let mut w = segment_write(&a, s, first, last, &texts, seed);
            let refs: Vec<&lycheemem_core::Record> = w.records.iter().map(|(r, _)| r).collect();
            let mut temporal = node(NodeKind::Temporal, &format!("day:{date}"), &refs[..2]);
            temporal.span = Some((date.to_string(), date.to_string()));
            let topic = node(NodeKind::Topic, &text(seed, 2), &refs[1..]);
            w.nodes.push((temporal, Some(vector(seed + 50))));
            w.nodes.push((topic, None));
            w.records[3].1 = None;
            w.usage.push(TokenUsage {
                purpose: Purpose::Encode,
                model: "m".into(),
                prompt_tokens: seed,
                completion_tokens: 9,
                latency_ms: 1,
                estimated: false,
            });
            store.commit_segment(&a, w).unwrap();
        }
    }
    // A restatement in another segment of s1 (same text → same record id).
    let restated = text(1000 * u64::from(b'1'), 5);
    store
        .commit_segment(&a, segment_write(&a, "s1", 6, 11, &[&restated], 7))
        .unwrap();
    let victim = all_record_ids(store, &a)[2].clone();
    store.delete_record(&a, &victim).unwrap();
}

fn all_record_ids(store: &dyn MemoryStore, a: &lycheemem_core::Namespace) -> Vec<String> {
    store
        .all_records(a)
        .unwrap()
        .into_iter()
        .map(|r| r.record_id)
        .collect()
}

/// An export with the write sequence numbers (which count different things per backend)
/// taken out.
fn export_without_seq(store: &dyn MemoryStore) -> Vec<serde_json::Value> {
    let mut bytes = Vec::new();
    store
        .export(
            &ns("alice"),
            &mut bytes,
            ExportOptions {
                include_vectors: true,
            },
        )
        .unwrap();
    String::from_utf8(bytes)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if let Some(o) = v.as_object_mut() {
                o.remove("seq");
            }
            v
        })
        .collect()
}

fn assert_same_hits(what: &str, a: &[Hit], b: &[Hit]) {
    let ids = |h: &[Hit]| h.iter().map(|h| h.item.clone()).collect::<Vec<_>>();
    assert_eq!(ids(a), ids(b), "{what}: different hits");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x.score - y.score).abs() <= 1e-5 * x.score.abs().max(1.0),
            "{what}: {} scores {} vs {}",
            x.item,
            x.score,
            y.score
        );
    }
}

#[test]
fn both_backends_store_list_export_and_search_alike() {
    let (_dirs, redb, pg) = both_backends();
    write_history(&*redb);
    write_history(&*pg);
    let a = ns("alice");

    assert_eq!(redb.sessions(&a).unwrap(), pg.sessions(&a).unwrap());
    assert_eq!(redb.all_records(&a).unwrap(), pg.all_records(&a).unwrap());
    assert_eq!(redb.all_nodes(&a).unwrap(), pg.all_nodes(&a).unwrap());
    assert_eq!(redb.usage_log(&a).unwrap(), pg.usage_log(&a).unwrap());
    assert_eq!(
        redb.pending_vectors(&a, 100).unwrap(),
        pg.pending_vectors(&a, 100).unwrap()
    );
    assert_eq!(
        redb.temporal_nodes(&a, "2023-05", "2023-06-30").unwrap(),
        pg.temporal_nodes(&a, "2023-05", "2023-06-30").unwrap()
    );
    let (sr, sp) = (redb.stats(&a).unwrap(), pg.stats(&a).unwrap());
    assert_eq!(
        (
            sr.sessions,
            sr.turns,
            sr.segments,
            sr.records,
            &sr.nodes,
            &sr.vectors
        ),
        (
            sp.sessions,
            sp.turns,
            sp.segments,
            sp.records,
            &sp.nodes,
            &sp.vectors
        )
    );
    assert_eq!(sr.text_rows, sp.text_rows);
    assert_eq!(sr.pending_vectors, sp.pending_vectors);
    assert_eq!(export_without_seq(&*redb), export_without_seq(&*pg));

    let mut compared = 0;
    for target in Target::ALL {
        for (i, query) in [
            "cat bike",
            "Paris concert sunset",
            "guitar lessons",
            "s2 turn",
        ]
        .iter()
        .enumerate()
        {
            for session in [None, Some(sid("s2"))] {
                let what = format!("text {target} {query:?} {session:?}");
                let r = redb
                    .text_search(&a, target, query, 7, session.as_ref())
                    .unwrap();
                let p = pg
                    .text_search(&a, target, query, 7, session.as_ref())
                    .unwrap();
                assert_same_hits(&what, &r, &p);
                compared += usize::from(!r.is_empty());
                let mut q = VectorQuery::new(target, vector(9000 + i as u64), 6);
                q.session = session.clone();
                let r = redb.vector_search(&a, &q).unwrap();
                let p = pg.vector_search(&a, &q).unwrap();
                assert_same_hits(&format!("vector {what}"), &r, &p);
                compared += usize::from(!r.is_empty());
            }
        }
    }
    // Most of the searches found something (the comparison is not between empty lists).
    assert!(compared >= 60, "only {compared} non-empty result lists");
    let nodes: Vec<String> = redb
        .all_nodes(&a)
        .unwrap()
        .into_iter()
        .map(|n| n.node_id)
        .collect();
    for kind in [NodeKind::Topic, NodeKind::Temporal, NodeKind::Entity] {
        let q = vector(77);
        let r = redb
            .vector_search_within(&a, Target::Node(kind), &q, 3, &nodes)
            .unwrap();
        let p = pg
            .vector_search_within(&a, Target::Node(kind), &q, 3, &nodes)
            .unwrap();
        assert_same_hits(&format!("within {kind:?}"), &r, &p);
    }
}

/// Full text over enough documents (1,000) for the PostgreSQL backend's pruning to act (a query's
/// rarest terms fill the list, common words are not read in full): the same hits and scores as
/// the embedded backend, for queries mixing common and rare words, with and without a session
/// filter.
#[test]
fn full_text_agrees_where_common_words_are_pruned() {
    let (_dirs, redb, pg) = both_backends();
    let a = ns("alice");
    // Word i of a 200-word vocabulary is drawn with weight 1 / (i + 1): a few very common
    // words, many rare ones.
    let vocab: Vec<String> = (0..200).map(|i| format!("w{i}")).collect();
    let weights: Vec<f64> = (0..200).map(|i| 1.0 / (i as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let word = |next: &mut dyn FnMut() -> f64| {
        let mut r = next() * total;
        for (i, w) in weights.iter().enumerate() {
            r -= w;
            if r <= 0.0 {
                return vocab[i].clone();
            }
        }
        vocab[199].clone()
    };
    for s in ["s1", "s2"] {
        let texts: Vec<String> = (0..500)
            .map(|_| {
                let n = 3 + (next() * 12.0) as usize;
                (0..n)
                    .map(|_| word(&mut next))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        add_session_texts([&*redb, &*pg], s, &texts);
    }
    let mut compared = 0;
    for q in 0..40u64 {
        // One or two common words with one or two rarer ones.
        let query = [
            vocab[(q % 3) as usize].clone(),
            vocab[(q * 7 % 40 + 5) as usize].clone(),
            vocab[(q * 13 % 150 + 40) as usize].clone(),
            vocab[(q % 2) as usize + 3].clone(),
        ][..2 + (q % 3) as usize]
            .join(" ");
        for k in [1, 5, 10, 25] {
            for session in [None, Some(sid("s2"))] {
                let r = redb
                    .text_search(&a, Target::Turn, &query, k, session.as_ref())
                    .unwrap();
                let p = pg
                    .text_search(&a, Target::Turn, &query, k, session.as_ref())
                    .unwrap();
                assert_same_hits(&format!("{query:?} k={k} {session:?}"), &r, &p);
                compared += usize::from(r.len() == k);
            }
        }
    }
    assert!(compared >= 250, "only {compared} full result lists");
}

/// Full text where PostgreSQL's pruning takes each branch (docs/algorithm.md, "Full-text
/// scoring"): "rare common" is answered by the documents of its rarest term alone; for "rare mid
/// common" a term outside the first candidates ("mid", in short documents that outscore the long
/// "rare" ones) is essential, so a second, wider restricted query must find the answer. Both
/// agree with the embedded backend.
#[test]
fn full_text_pruning_keeps_documents_outside_the_rarest_terms() {
    let (_dirs, redb, pg) = both_backends();
    let a = ns("alice");
    let mut texts: Vec<String> = (0..3000)
        .map(|i| format!("common filler{} other{}", i % 50, i % 7))
        .collect();
    texts.extend((0..40).map(|i| {
        format!(
            "rare common {}",
            (0..20)
                .map(|j| format!("pad{}", (i + j) % 30))
                .collect::<Vec<_>>()
                .join(" ")
        )
    }));
    texts.extend((0..100).map(|_| "mid mid mid common".to_string()));
    add_session_texts([&*redb, &*pg], "s1", &texts);
    for (query, top_word) in [("rare common", "rare"), ("rare mid common", "mid")] {
        let r = redb.text_search(&a, Target::Turn, query, 10, None).unwrap();
        let p = pg.text_search(&a, Target::Turn, query, 10, None).unwrap();
        assert_eq!(r.len(), 10, "{query}");
        assert_same_hits(query, &r, &p);
        // The expected winners: the first hit's text holds the query's best word.
        let lycheemem_store::ItemRef::Turn(first) = &r[0].item else {
            panic!("{query}: not a turn: {:?}", r[0].item)
        };
        let first = &texts[first.index as usize];
        assert!(first.contains(top_word), "{query}: {first}");
    }
}
