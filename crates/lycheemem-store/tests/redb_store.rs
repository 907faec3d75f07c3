//! What only the redb store does: one process per directory, its dimension record, its derived
//! index folders (rebuilt when deleted), and its HNSW / exact-search tuning. The behaviour every
//! backend shares is in `conformance.rs`.

mod common;

use common::*;
use lycheemem_core::TurnRef;
use lycheemem_store::prelude::*;
use lycheemem_store::{ItemRef, SessionInfo, Store, StoreOptions, Target, VectorQuery};

fn open(dir: &std::path::Path) -> Store {
    Store::open(dir, StoreOptions::new(DIMS)).unwrap()
}

#[test]
fn second_opener_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let _first = open(dir.path());
    let err = Store::open(dir.path(), StoreOptions::new(DIMS))
        .err()
        .expect("second open must fail")
        .to_string();
    assert!(err.contains("already open"), "{err}");
}

#[test]
fn reopening_with_other_dimensions_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()));
    let err = Store::open(dir.path(), StoreOptions::new(DIMS + 1))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("8-dimensional"), "{err}");
}

#[test]
fn deleted_index_folders_are_rebuilt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let a = ns("a");
    let before;
    {
        let store = open(dir.path());
        add_turns(&store, &a, "s", 10, 0);
        store
            .commit_segment(
                &a,
                segment_write(&a, "s", 0, 9, &["the quick fox", "lazy dog"], 20),
            )
            .unwrap();
        before = store.stats(&a).unwrap();
    }
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let store = open(dir.path());
    assert_eq!(store.stats(&a).unwrap(), before);
    let hits = store
        .vector_search(&a, &VectorQuery::new(Target::Turn, vector(4), 1))
        .unwrap();
    assert_eq!(
        hits[0].item,
        ItemRef::Turn(TurnRef {
            session: sid("s"),
            index: 4
        })
    );
    assert_eq!(
        store
            .text_search(&a, Target::Record, "fox", 3, None)
            .unwrap()
            .len(),
        1
    );
    // A corrupt index file is also rebuilt rather than refused.
    drop(store);
    let file = dir.path().join("index/vectors/a/turn.usearch");
    std::fs::write(&file, b"garbage").unwrap();
    let store = open(dir.path());
    assert_eq!(store.stats(&a).unwrap(), before);
}

#[test]
fn session_filter_never_returns_fewer_than_k_when_more_match() {
    let dir = tempfile::tempdir().unwrap();
    // Force the HNSW filtered path (no small-set shortcut).
    let mut opts = StoreOptions::new(DIMS);
    opts.index.exact_search_below = 0;
    let store = Store::open(dir.path(), opts).unwrap();
    let a = ns("a");
    add_turns(&store, &a, "big", 400, 0);
    add_turns(&store, &a, "small", 12, 10_000);
    for (session, expected) in [("small", 10), ("big", 10)] {
        let q = VectorQuery::new(Target::Turn, vector(3), 10).in_session(sid(session));
        let hits = store.vector_search(&a, &q).unwrap();
        assert_eq!(hits.len(), expected, "{session}");
        for h in &hits {
            let ItemRef::Turn(t) = &h.item else { panic!() };
            assert_eq!(t.session.as_str(), session);
        }
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
    }
    // Exact path: the best match within "small" is the true best.
    let q = VectorQuery::new(Target::Turn, vector(10_005), 3).in_session(sid("small"));
    let hits = store.vector_search(&a, &q).unwrap();
    assert_eq!(
        hits[0].item,
        ItemRef::Turn(TurnRef {
            session: sid("small"),
            index: 5
        })
    );
    // Text search with a session filter.
    let hits = store
        .text_search(&a, Target::Turn, "turn", 50, Some(&sid("small")))
        .unwrap();
    assert_eq!(hits.len(), 12);
}

#[test]
fn a_small_namespace_is_searched_exactly_whatever_the_hnsw_settings() {
    let dir = tempfile::tempdir().unwrap();
    // A graph so sparse and a beam so narrow that HNSW alone misses true neighbours.
    let mut opts = StoreOptions::new(DIMS);
    opts.index.hnsw_connectivity = 2;
    opts.index.hnsw_expansion_add = 2;
    opts.index.hnsw_expansion_search = 1;
    let store = Store::open(dir.path(), opts).unwrap();
    let a = ns("a");
    add_turns(&store, &a, "s", 300, 0);
    let items: Vec<ItemRef> = (0..300)
        .map(|index| {
            ItemRef::Turn(TurnRef {
                session: sid("s"),
                index,
            })
        })
        .collect();
    let stored = store.vectors(&a, &items).unwrap();
    for seed in 0..20u64 {
        let query = vector(50_000 + seed);
        let mut truth: Vec<(usize, f32)> = stored
            .iter()
            .enumerate()
            .map(|(i, v)| {
                (
                    i,
                    lycheemem_core::vector::cosine(v.as_ref().unwrap(), &query),
                )
            })
            .collect();
        truth.sort_by(|x, y| y.1.total_cmp(&x.1));
        let hits = store
            .vector_search(&a, &VectorQuery::new(Target::Turn, query, 10))
            .unwrap();
        let found: Vec<&ItemRef> = hits.iter().map(|h| &h.item).collect();
        let expected: Vec<&ItemRef> = truth[..10].iter().map(|(i, _)| &items[*i]).collect();
        assert_eq!(found, expected, "query {seed}");
    }
}

#[test]
fn search_within_a_set_of_items_and_vectors_by_item() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = StoreOptions::new(DIMS);
    opts.index.exact_search_below = 4;
    let store = Store::open(dir.path(), opts).unwrap();
    let a = ns("a");
    add_turns(&store, &a, "s", 40, 0);
    let ids: Vec<String> = (10..20).map(|i| format!("s#{i}")).collect();
    // Exact (≤ 4 allowed) and filtered HNSW (> 4) paths both stay inside the set.
    for set in [&ids[..3], &ids[..]] {
        let hits = store
            .vector_search_within(&a, Target::Turn, &vector(15), 5, set)
            .unwrap();
        assert_eq!(hits.len(), 5.min(set.len()));
        for h in &hits {
            assert!(set.contains(&match &h.item {
                ItemRef::Turn(t) => format!("{}#{}", t.session, t.index),
                _ => unreachable!(),
            }));
        }
    }
    let top = store
        .vector_search_within(&a, Target::Turn, &vector(15), 1, &ids)
        .unwrap();
    assert_eq!(
        top[0].item,
        ItemRef::Turn(TurnRef {
            session: sid("s"),
            index: 15
        })
    );
    let v = store
        .vectors(
            &a,
            &[
                ItemRef::Turn(TurnRef {
                    session: sid("s"),
                    index: 7,
                }),
                ItemRef::Record("nope".into()),
            ],
        )
        .unwrap();
    assert_eq!(v[0].as_deref(), Some(vector(7).as_slice()));
    assert_eq!(v[1], None);
}

/// usearch serves each concurrent search from a context reserved ahead; many more concurrent
/// searches than cores (a server's blocking pool) must all succeed, on a fresh index and on one
/// loaded from disk.
#[test]
fn many_concurrent_searches_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let n = ns("n");
    for reopen in [false, true] {
        let store = open(dir.path());
        if !reopen {
            store
                .put_session(&n, SessionInfo::new(sid("s"), None))
                .unwrap();
            add_turns(&store, &n, "s", 300, 1);
        }
        let store = std::sync::Arc::new(store);
        let threads: Vec<_> = (0..96u64)
            .map(|i| {
                let store = store.clone();
                let n = n.clone();
                std::thread::spawn(move || {
                    for _ in 0..5 {
                        let q = VectorQuery::new(Target::Turn, vector(i), 5);
                        assert_eq!(store.vector_search(&n, &q).unwrap().len(), 5);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        store.checkpoint().unwrap();
    }
}

/// Opens the database file of a closed store directly (what an older build left behind).
fn raw_database(dir: &std::path::Path) -> redb::Database {
    redb::Database::open(dir.join("store.redb")).unwrap()
}

const COUNTERS: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("counters");

#[test]
fn a_store_from_before_the_node_members_table_gets_it_filled_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let a = ns("a");
    let texts: Vec<String> = (0..70).map(|i| format!("Alice fact number {i}")).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let (node_id, expected, query) = {
        let store = open(dir.path());
        add_turns(&store, &a, "s", 6, 0);
        let w = segment_write(&a, "s", 0, 3, &refs, 10);
        let node_id = w.nodes[0].0.node_id.clone();
        store.commit_segment(&a, w).unwrap();
        let q = vector(15);
        let expected = store.vector_search_node(&a, &node_id, &q, 5).unwrap();
        (node_id, expected, q)
    };
    // What a store written before the table existed looks like: no table, no fill mark.
    {
        let db = raw_database(dir.path());
        let txn = db.begin_write().unwrap();
        let members: redb::TableDefinition<&[u8], &[u8]> =
            redb::TableDefinition::new("node_members");
        assert!(txn.delete_table(members).unwrap());
        txn.open_table(COUNTERS)
            .unwrap()
            .remove("node_members_filled")
            .unwrap();
        txn.commit().unwrap();
    }
    let store = open(dir.path());
    let ids = vec![node_id.clone()];
    let listed = store.node_members(&a, &ids, 100).unwrap();
    assert_eq!(listed[0].records, 70);
    assert_eq!(listed[0].record_ids.as_ref().map(Vec::len), Some(70));
    assert_eq!(store.node_members(&a, &ids, 10).unwrap()[0].records, 70);
    assert_eq!(
        store.vector_search_node(&a, &node_id, &query, 5).unwrap(),
        expected
    );
}

#[test]
fn a_store_of_a_later_format_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()));
    {
        let db = raw_database(dir.path());
        let txn = db.begin_write().unwrap();
        txn.open_table(COUNTERS)
            .unwrap()
            .insert("format", 1_000)
            .unwrap();
        txn.commit().unwrap();
    }
    let err = Store::open(dir.path(), StoreOptions::new(DIMS))
        .err()
        .expect("a later format must be refused")
        .to_string();
    assert!(
        err.contains("newer lycheemem") && err.contains("1000"),
        "{err}"
    );
}
