//! Builders shared by the store tests: deterministic vectors, turns, records, nodes, segments.
#![allow(dead_code)]

use lycheemem_core::{
    EvidenceNode, FinalizeReason, MemoryType, Namespace, NodeKind, Record, Role, Segment,
    SessionId, SourceRole, TemporalScope, Turn,
};
use lycheemem_store::{SegmentOutcome, SegmentWrite};
use std::collections::BTreeSet;

pub const DIMS: usize = 8;

/// The backend the conformance suite runs against: `LYCHEEMEM_TEST_BACKEND` — `redb` (the
/// default) or `postgres`, which needs `LYCHEEMEM_TEST_POSTGRES_URL` (a database with pgvector;
/// `scripts/postgres.sh start DIR` prints one). A PostgreSQL store lives in a schema named
/// after `dir`, so reopening the same directory reopens the same store and every test gets its
/// own. A new backend adds its constructor here.
pub fn open_backend(dir: &std::path::Path) -> Box<dyn lycheemem_store::MemoryStore> {
    match std::env::var("LYCHEEMEM_TEST_BACKEND").as_deref() {
        Ok("redb") | Err(_) => Box::new(
            lycheemem_store::Store::open(dir, lycheemem_store::StoreOptions::new(DIMS)).unwrap(),
        ),
        Ok("postgres") => {
            let url = std::env::var("LYCHEEMEM_TEST_POSTGRES_URL").expect(
                "LYCHEEMEM_TEST_BACKEND=postgres needs LYCHEEMEM_TEST_POSTGRES_URL \
                 (scripts/postgres.sh start DIR prints one)",
            );
            let config =
                lycheemem_store_postgres::PgConfig::new(url).with_schema(postgres_schema(dir));
            Box::new(
                lycheemem_store_postgres::PgStore::open(
                    &config,
                    lycheemem_store::StoreOptions::new(DIMS),
                )
                .unwrap(),
            )
        }
        Ok(other) => panic!("unknown LYCHEEMEM_TEST_BACKEND {other:?} (known: redb, postgres)"),
    }
}

/// A schema name unique to a directory: `t_` and a hash of its path.
fn postgres_schema(dir: &std::path::Path) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in dir.to_string_lossy().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("t_{h:016x}")
}

pub fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

pub fn sid(name: &str) -> SessionId {
    SessionId::new(name).unwrap()
}

/// A deterministic unit vector for `seed` (splitmix64 components).
pub fn vector(seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut v: Vec<f32> = (0..DIMS)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        })
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    v
}

pub fn turn(session: &str, index: u32, text: &str) -> Turn {
    Turn {
        session: sid(session),
        index,
        role: if index.is_multiple_of(2) {
            Role::User
        } else {
            Role::Assistant
        },
        speaker: None,
        text: text.to_string(),
        time: None,
    }
}

pub fn record(
    ns: &Namespace,
    session: &str,
    segment: &Segment,
    text: &str,
    date: Option<&str>,
) -> Record {
    Record {
        record_id: Record::make_id(ns, text),
        memory_type: MemoryType::Fact,
        semantic_text: text.to_string(),
        normalized_text: Record::make_normalized_text(MemoryType::Fact, text),
        entities: vec!["Alice".into()],
        tags: vec!["pets".into()],
        temporal: TemporalScope {
            t_ref: date.map(String::from),
            ..TemporalScope::default()
        },
        evidence_turns: vec![segment.first_turn],
        source_session: sid(session),
        source_role: SourceRole::User,
        segment_id: segment.id.clone(),
        created_at: None,
        confidence: 0.9,
    }
}

pub fn segment(session: &str, first: u32, last: u32) -> Segment {
    let s = sid(session);
    Segment {
        id: Segment::make_id(&s, first, last),
        session: s,
        first_turn: first,
        last_turn: last,
        exchanges: last - first + 1,
        tokens: 10,
        reason: FinalizeReason::SemanticBoundary,
    }
}

pub fn node(kind: NodeKind, key: &str, records: &[&Record]) -> EvidenceNode {
    let texts: Vec<&str> = records.iter().map(|r| r.semantic_text.as_str()).collect();
    EvidenceNode {
        node_id: kind.node_id(key),
        kind,
        key: key.to_string(),
        label: key.to_string(),
        record_ids: records.iter().map(|r| r.record_id.clone()).collect(),
        sessions: records
            .iter()
            .map(|r| r.source_session.to_string())
            .collect(),
        entities: BTreeSet::new(),
        tags: BTreeSet::new(),
        span: None,
        search_text: EvidenceNode::compose_search_text(key, texts, 2000),
    }
}

/// A segment write with records (vectors seeded from `seed`) and an entity node linking them.
pub fn segment_write(
    ns: &Namespace,
    session: &str,
    first: u32,
    last: u32,
    texts: &[&str],
    seed: u64,
) -> SegmentWrite {
    let seg = segment(session, first, last);
    let records: Vec<Record> = texts
        .iter()
        .map(|t| record(ns, session, &seg, t, None))
        .collect();
    let refs: Vec<&Record> = records.iter().collect();
    let entity = node(NodeKind::Entity, &format!("topic-{session}-{first}"), &refs);
    let mut w = SegmentWrite::new(seg, SegmentOutcome::Encoded);
    w.nodes = vec![(entity, Some(vector(seed + 1000)))];
    w.records = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| (r, Some(vector(seed + i as u64))))
        .collect();
    w
}

/// Adds `n` turns to `session` with vectors seeded by `seed + index`.
pub fn add_turns(
    store: &dyn lycheemem_store::MemoryStore,
    ns: &Namespace,
    session: &str,
    n: u32,
    seed: u64,
) {
    let start = store
        .session(ns, &sid(session))
        .unwrap()
        .map_or(0, |s| s.turn_count);
    let turns = (start..start + n)
        .map(|i| {
            (
                turn(session, i, &format!("{session} turn {i} about word{i}")),
                Some(vector(seed + u64::from(i))),
            )
        })
        .collect();
    store.add_turns(ns, turns).unwrap();
}
