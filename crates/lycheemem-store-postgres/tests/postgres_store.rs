//! What only the PostgreSQL backend does: several store handles (as several server replicas
//! would hold) on one schema, concurrent migrations, the stored dimension, the HNSW path and
//! its exact fallback. The backend-independent behaviour is the store crate's conformance suite
//! (`LYCHEEMEM_TEST_BACKEND=postgres`). Needs `LYCHEEMEM_TEST_POSTGRES_URL`.

use lycheemem_core::{Error, Namespace, Role, SessionId, Turn};
use lycheemem_store::prelude::*;
use lycheemem_store::{StoreOptions, Target, VectorQuery};
use lycheemem_store_postgres::{PgConfig, PgStore};
use std::sync::atomic::{AtomicU64, Ordering};

const DIMS: usize = 8;

fn url() -> String {
    std::env::var("LYCHEEMEM_TEST_POSTGRES_URL").expect(
        "these tests need LYCHEEMEM_TEST_POSTGRES_URL: a PostgreSQL database with pgvector \
         (run the README's test command, or scripts/postgres.sh install && \
         scripts/postgres.sh start DIR, which prints the URL)",
    )
}

/// A schema no other test (or earlier run) uses.
fn fresh_schema(tag: &str) -> PgConfig {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    PgConfig::new(url()).with_schema(format!(
        "pt_{tag}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000,
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

fn sid(name: &str) -> SessionId {
    SessionId::new(name).unwrap()
}

fn turn(session: &str, index: u32, text: &str) -> Turn {
    Turn {
        session: sid(session),
        index,
        role: Role::User,
        speaker: None,
        text: text.into(),
        time: None,
    }
}

/// A deterministic unit vector.
fn vector(seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1234_5678;
    let mut v: Vec<f32> = (0..DIMS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        })
        .collect();
    let n = v.iter().map(|a| a * a).sum::<f32>().sqrt();
    v.iter_mut().for_each(|a| *a /= n);
    v
}

#[test]
fn two_handles_on_one_schema_see_each_others_writes_and_serialize_appends() {
    let config = fresh_schema("replicas");
    let one = PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
    let two = PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
    let a = ns("a");
    std::thread::scope(|s| {
        for t in 0..8u32 {
            let store = if t % 2 == 0 { &one } else { &two };
            let a = a.clone();
            s.spawn(move || {
                let session = format!("s{t}");
                for i in 0..10u32 {
                    store
                        .add_turns(
                            &a,
                            vec![(
                                turn(&session, i, &format!("turn {i} of {session}")),
                                Some(vector(u64::from(t * 100 + i))),
                            )],
                        )
                        .unwrap();
                }
            });
        }
    });
    for store in [&one, &two] {
        let sessions = store.sessions(&a).unwrap();
        assert_eq!(sessions.len(), 8);
        assert!(sessions.iter().all(|s| s.turn_count == 10));
        assert_eq!(store.stats(&a).unwrap().turns, 80);
    }
    // The same turn sent by both handles at once (a client retrying through another
    // replica): stored once, both calls succeed.
    std::thread::scope(|s| {
        for store in [&one, &two] {
            let a = a.clone();
            s.spawn(move || {
                store
                    .add_turns(&a, vec![(turn("s0", 10, "the retry"), None)])
                    .unwrap();
            });
        }
    });
    assert_eq!(one.turns(&a, &sid("s0")).unwrap().len(), 11);
    // Different content at one index from two handles: exactly one wins, the other is told.
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = [(&one, "left"), (&two, "right")]
            .into_iter()
            .map(|(store, text)| {
                let a = a.clone();
                s.spawn(move || store.add_turns(&a, vec![(turn("s1", 10, text), None)]))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(Error::InvalidInput(m)) if m.contains("already exists")))
    );
}

#[test]
fn concurrent_openers_of_a_new_store_migrate_it_once() {
    let config = fresh_schema("migrate");
    let stores: Vec<PgStore> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| PgStore::open(&config, StoreOptions::new(DIMS))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    assert_eq!(stores.len(), 4);
    assert!(PgStore::exists(&config).unwrap());
}

#[test]
fn the_vector_dimension_is_fixed_when_the_store_is_created() {
    let config = fresh_schema("dims");
    assert!(!PgStore::exists(&config).unwrap());
    assert!(matches!(
        PgStore::open(&config, StoreOptions::new(0)),
        Err(Error::NotFound(_))
    ));
    PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
    assert!(matches!(
        PgStore::open(&config, StoreOptions::new(DIMS * 2)),
        Err(Error::InvalidInput(_))
    ));
    let reopened = PgStore::open(&config, StoreOptions::new(0)).unwrap();
    assert_eq!(reopened.options().dims, DIMS);
    assert!(matches!(
        PgStore::open(
            &PgConfig::new(url()).with_schema("Bad-Name"),
            StoreOptions::new(DIMS)
        ),
        Err(Error::Config(_))
    ));
}

#[test]
fn hnsw_searches_return_k_hits_and_agree_with_exact_search() {
    let config = fresh_schema("hnsw");
    let mut options = StoreOptions::new(DIMS);
    options.index.exact_search_below = 10;
    let approximate = PgStore::open(&config, options).unwrap();
    let mut exact_options = StoreOptions::new(DIMS);
    exact_options.index.exact_search_below = 1_000_000;
    let exact = PgStore::open(&config, exact_options).unwrap();
    let a = ns("a");
    for s in 0..10u32 {
        let session = format!("s{s}");
        let turns = (0..30u32)
            .map(|i| {
                (
                    turn(&session, i, "words"),
                    Some(vector(u64::from(s * 1000 + i))),
                )
            })
            .collect();
        approximate.add_turns(&a, turns).unwrap();
    }
    let mut agree = 0usize;
    let mut total = 0usize;
    for probe in 0..20u64 {
        for session in [None, Some(sid("s3"))] {
            let mut q = VectorQuery::new(Target::Turn, vector(50_000 + probe), 10);
            q.session = session.clone();
            let got = approximate.vector_search(&a, &q).unwrap();
            let want = exact.vector_search(&a, &q).unwrap();
            assert_eq!(got.len(), 10, "a filter never shortens the list");
            assert_eq!(want.len(), 10);
            if let Some(s) = &session {
                assert!(got.iter().all(|h| matches!(&h.item,
                    lycheemem_store::ItemRef::Turn(t) if &t.session == s)));
            }
            let want_ids: Vec<_> = want.iter().map(|h| &h.item).collect();
            agree += got.iter().filter(|h| want_ids.contains(&&h.item)).count();
            total += 10;
        }
    }
    let recall = agree as f64 / total as f64;
    assert!(
        recall >= 0.9,
        "HNSW recall@10 {recall:.3} against exact search"
    );
}

#[test]
fn control_characters_in_text_round_trip() {
    let config = fresh_schema("nul");
    let store = PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
    let a = ns("a");
    let text = "a NUL \u{0} byte, a bell \u{7}, and 😀";
    store
        .add_turns(&a, vec![(turn("s", 0, text), Some(vector(1)))])
        .unwrap();
    assert_eq!(store.turns(&a, &sid("s")).unwrap()[0].text, text);
    assert_eq!(
        store
            .text_search(&a, Target::Turn, "bell", 3, None)
            .unwrap()
            .len(),
        1
    );
}

/// A store made by schema version 1 (postings without length ids, no document-frequency table)
/// is upgraded when opened: the same full-text hits and scores, and each term's document
/// frequency counted into `lm_term_df`; later writes keep it exact.
#[test]
fn a_version_1_store_is_upgraded_with_the_same_full_text_scores() {
    let config = fresh_schema("v1");
    let a = ns("a");
    let texts = [
        "the red fox jumps over the lazy dog",
        "a red car and a red bike",
        "the dog sleeps",
        "foxes and dogs are not the same",
    ];
    let search = |store: &PgStore| {
        store
            .text_search(&a, Target::Turn, "red dog fox", 10, None)
            .unwrap()
            .into_iter()
            .map(|h| (format!("{:?}", h.item), h.score))
            .collect::<Vec<_>>()
    };
    let before = {
        let store = PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
        let turns = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (turn("s", i as u32, t), Some(vector(i as u64))))
            .collect();
        store.add_turns(&a, turns).unwrap();
        search(&store)
    };
    assert_eq!(before.len(), 4);
    let mut client = postgres::Client::connect(&config.url, postgres::NoTls).unwrap();
    let schema = &config.schema;
    client
        .batch_execute(&format!(
            "SET search_path = \"{schema}\";
             DROP TABLE lm_term_df;
             ALTER TABLE lm_postings DROP CONSTRAINT lm_postings_pkey;
             ALTER TABLE lm_postings DROP COLUMN norm_id;
             ALTER TABLE lm_postings ADD PRIMARY KEY (ns, term, target, id);
             UPDATE lm_meta SET value = '1' WHERE key = 'schema_version';"
        ))
        .unwrap();
    let store = PgStore::open(&config, StoreOptions::new(DIMS)).unwrap();
    assert_eq!(search(&store), before);
    let df = |client: &mut postgres::Client, term: &str| -> i64 {
        client
            .query_opt(
                &format!("SELECT df FROM \"{schema}\".lm_term_df WHERE ns = 'a' AND term = $1"),
                &[&term],
            )
            .unwrap()
            .map_or(0, |r| r.get(0))
    };
    assert_eq!(df(&mut client, "red"), 2, "two documents hold 'red'");
    assert_eq!(df(&mut client, "the"), 3);
    store
        .add_turns(&a, vec![(turn("s", 4, "the red moon"), Some(vector(9)))])
        .unwrap();
    assert_eq!(df(&mut client, "red"), 3);
    assert_eq!(df(&mut client, "the"), 4);
    store.delete_namespace(&a).unwrap();
    assert_eq!(
        df(&mut client, "the"),
        0,
        "a deleted namespace's terms are gone"
    );
}
