//! Crash safety: a child process writes turns, segments and deletions, printing an `ACK` line
//! after each call returns; the parent kills it with SIGKILL at a random moment, reopens the
//! store and checks that every acknowledged write is there, that no record lacks its raw turns,
//! and that the derived indexes agree with redb. Rounds accumulate in one store, so each round
//! also recovers from the previous kill. `LYCHEEMEM_CRASH_ROUNDS` overrides the round count.

mod common;

use common::*;
use lycheemem_core::{Namespace, NodeKind, TurnRef};
use lycheemem_store::prelude::*;
use lycheemem_store::{
    ItemRef, SegmentOutcome, SegmentWrite, Store, StoreOptions, Target, VectorQuery,
};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const CHILD_ENV: &str = "LYCHEEMEM_CRASH_CHILD";

fn options() -> StoreOptions {
    let mut o = StoreOptions::new(DIMS);
    // Checkpoint often so kills also land inside index saves and change-log trimming.
    o.index.checkpoint_every = 25;
    // Searches go through the HNSW index (not the exact scan small namespaces get).
    o.index.exact_search_below = 0;
    o
}

/// A vector derived from the text, so the parent can recompute what the child stored.
fn vector_for(text: &str) -> Vec<f32> {
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    vector(h)
}

fn ack(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ACK {line}").unwrap();
    out.flush().unwrap();
}

/// The child: writes until killed (or until it has done plenty).
fn run_child(dir: &str, round: u64) {
    let store = Store::open(dir, options()).unwrap();
    let ns = ns("crash");
    let session = format!("s{}", round % 3);
    let mut next = store
        .session(&ns, &sid(&session))
        .unwrap()
        .map_or(0, |s| s.turn_count);
    let mut mine: Vec<String> = Vec::new();
    for step in 0..10_000u64 {
        let first = next;
        let mut batch = Vec::new();
        let mut batch_texts = Vec::new();
        for _ in 0..1 + step % 3 {
            let text = format!("round{round} step{step} turn{next} token{round}x{next}");
            batch.push((turn(&session, next, &text), Some(vector_for(&text))));
            batch_texts.push(text);
            next += 1;
        }
        store.add_turns(&ns, batch).unwrap();
        for (i, t) in (first..next).zip(&batch_texts) {
            ack(&format!("turn {session} {i} {t}"));
        }
        let seg = segment(&session, first, next - 1);
        let text = format!("fact of round {round} step {step}");
        let mut rec = record(&ns, &session, &seg, &text, Some("2023-05-08"));
        rec.evidence_turns = vec![first, next - 1];
        let key = format!("person-{}", step % 4);
        let node_id = NodeKind::Entity.node_id(&key);
        let mut entity = match store
            .nodes(&ns, std::slice::from_ref(&node_id))
            .unwrap()
            .pop()
        {
            Some(n) => n,
            None => node(NodeKind::Entity, &key, &[]),
        };
        entity.record_ids.insert(rec.record_id.clone());
        entity.sessions.insert(session.clone());
        let mut write = SegmentWrite::new(seg, SegmentOutcome::Encoded);
        write.nodes.push((entity, Some(vector(step))));
        write.records.push((rec.clone(), Some(vector_for(&text))));
        write.state.push((
            sid(&session),
            "segmenter".into(),
            serde_json::json!({ "next": next }),
        ));
        store.commit_segment(&ns, write).unwrap();
        ack(&format!("record {}", rec.record_id));
        mine.push(rec.record_id);
        if step % 4 == 3 {
            let victim = mine.remove(0);
            // Announced first: a delete the kill interrupts may or may not have happened.
            ack(&format!("deleting {victim}"));
            store.delete_record(&ns, &victim).unwrap();
            ack(&format!("deleted {victim}"));
        }
    }
}

#[test]
fn crash_child() {
    if let (Ok(dir), Ok(round)) = (
        std::env::var(CHILD_ENV),
        std::env::var("LYCHEEMEM_CRASH_ROUND"),
    ) {
        run_child(&dir, round.parse().unwrap());
    }
}

/// Small seeded generator for kill delays.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

#[derive(Default)]
struct Acknowledged {
    /// Acknowledged turns with the text the child wrote.
    turns: BTreeMap<(String, u32), String>,
    records: BTreeSet<String>,
    deleted: BTreeSet<String>,
    /// Deletes begun but not acknowledged: either outcome is correct.
    maybe_deleted: BTreeSet<String>,
    last_turn: Option<(String, u32)>,
}

fn verify(store: &Store, ns: &Namespace, acked: &Acknowledged, round: u64) {
    // Every acknowledged turn is there with the text the child wrote.
    for ((session, index), text) in &acked.turns {
        let turns = store.turn_range(ns, &sid(session), *index, *index).unwrap();
        assert_eq!(
            turns.len(),
            1,
            "round {round}: acknowledged turn {session}#{index} missing"
        );
        assert_eq!(
            &turns[0].text, text,
            "round {round}: turn {session}#{index} changed"
        );
    }
    // Acknowledged records exist unless an acknowledged delete removed them.
    let all: BTreeSet<String> = store
        .all_records(ns)
        .unwrap()
        .into_iter()
        .map(|r| r.record_id)
        .collect();
    for id in &acked.records {
        if acked.deleted.contains(id) {
            assert!(
                !all.contains(id),
                "round {round}: deleted record {id} came back"
            );
        } else if !acked.maybe_deleted.contains(id) {
            assert!(
                all.contains(id),
                "round {round}: acknowledged record {id} missing"
            );
        }
    }
    // No record without its raw turns; no node linking a missing record.
    for r in store.all_records(ns).unwrap() {
        let count = store
            .session(ns, &r.source_session)
            .unwrap()
            .unwrap()
            .turn_count;
        assert!(
            r.evidence_turns.iter().all(|t| *t < count),
            "round {round}: {} lacks turns",
            r.record_id
        );
    }
    for n in store.all_nodes(ns).unwrap() {
        assert!(!n.record_ids.is_empty());
        assert_eq!(
            store
                .records(ns, &n.record_ids.iter().cloned().collect::<Vec<_>>())
                .unwrap()
                .len(),
            n.record_ids.len()
        );
    }
    // Derived indexes agree with redb.
    let stats = store.stats(ns).unwrap();
    assert_eq!(
        stats.vectors, stats.indexed_vectors,
        "round {round}: vector index out of sync"
    );
    assert_eq!(stats.text_rows["turn"], stats.turns, "round {round}");
    assert_eq!(stats.text_rows["record"], stats.records, "round {round}");
    assert_eq!(
        stats.text_rows["entity"], stats.nodes["entity"],
        "round {round}"
    );
    // A search per round: the last acknowledged turn is found by vector and by a unique token.
    if let Some((session, index)) = &acked.last_turn {
        let text = store
            .turn_range(ns, &sid(session), *index, *index)
            .unwrap()
            .remove(0)
            .text;
        let expected = ItemRef::Turn(TurnRef {
            session: sid(session),
            index: *index,
        });
        // The turn's vector is stored, unchanged, whatever the approximate index does.
        let stored = store.vectors(ns, std::slice::from_ref(&expected)).unwrap();
        assert_eq!(
            stored[0].as_deref(),
            Some(vector_for(&text).as_slice()),
            "round {round}: the last acknowledged turn's vector is lost or changed"
        );
        // Its own vector is the HNSW index's best hit (cosine 1).
        let query = VectorQuery::new(Target::Turn, vector_for(&text), 5);
        let hits = store.vector_search(ns, &query).unwrap();
        if hits.first().map(|h| &h.item) != Some(&expected) {
            // Which cause: the key missing from the index or holding another vector (a
            // recovery defect), or an indexed vector the graph search cannot reach (a beam
            // over every indexed vector still misses it).
            let scoring = store
                .scoring_vectors(ns, std::slice::from_ref(&expected))
                .unwrap()
                .remove(0)
                .map(|v| lycheemem_core::vector::cosine(&v, &vector_for(&text)));
            store.set_hnsw_expansion_search(
                stats.indexed_vectors.values().sum::<u64>() as usize + 64,
            );
            let full_beam = store.vector_search(ns, &query).unwrap();
            panic!(
                "round {round}: vector search missed the last acknowledged turn {expected:?} \
                 (the indexed vector's cosine with the stored one: {scoring:?}; found with a \
                 beam over the whole index: {}; indexed {:?}, stored {:?}; hits: {:?})",
                full_beam.iter().any(|h| h.item == expected),
                stats.indexed_vectors,
                stats.vectors,
                hits.iter().map(|h| (&h.item, h.score)).collect::<Vec<_>>()
            );
        }
        let token = text.split(' ').next_back().unwrap();
        let hits = store.text_search(ns, Target::Turn, token, 1, None).unwrap();
        assert_eq!(
            hits[0].item, expected,
            "round {round}: text search for {token}"
        );
    }
}

#[test]
fn sigkill_at_random_moments_loses_nothing_acknowledged() {
    let rounds: u64 = std::env::var("LYCHEEMEM_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let ns = ns("crash");
    let seed = std::env::var("LYCHEEMEM_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = Lcg(seed);
    let mut acked = Acknowledged::default();
    let mut total_acks = 0usize;
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env("LYCHEEMEM_CRASH_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<String>>()
        });
        let mut stderr = child.stderr.take().unwrap();
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        std::thread::sleep(Duration::from_millis(30 + rng.next(400)));
        // A child still running is killed; one that already stopped must have ended cleanly
        // (it did all its steps) — a panic or an error exit is a failure.
        let killed = child.kill().is_ok();
        let status = child.wait().unwrap();
        let lines = reader.join().unwrap();
        let child_err = err_reader.join().unwrap();
        {
            use std::os::unix::process::ExitStatusExt;
            let by_sigkill = status.signal() == Some(9);
            assert!(
                (killed && by_sigkill) || status.success(),
                "round {round}: the child ended with {status:?}:\n{child_err}"
            );
        }
        assert!(
            !child_err.contains("panicked"),
            "round {round}: the child panicked:\n{child_err}"
        );
        if std::env::var("CRASH_DEBUG").is_ok() {
            for l in &lines {
                eprintln!("r{round} {l}");
            }
        }
        for line in lines.iter().filter_map(|l| l.strip_prefix("ACK ")) {
            total_acks += 1;
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["turn", session, index, text @ ..] if text.len() == 4 => {
                    let key = (session.to_string(), index.parse().unwrap());
                    acked.turns.insert(key.clone(), text.join(" "));
                    acked.last_turn = Some(key);
                }
                ["record", id] => {
                    acked.records.insert(id.to_string());
                }
                ["deleting", id] => {
                    acked.maybe_deleted.insert(id.to_string());
                }
                ["deleted", id] => {
                    acked.deleted.insert(id.to_string());
                }
                _ => {} // a line cut by the kill
            }
        }
        let store = Store::open(dir.path(), options())
            .unwrap_or_else(|e| panic!("round {round}: store did not reopen: {e}"));
        verify(&store, &ns, &acked, round);
    }
    assert!(
        total_acks > rounds as usize,
        "children acknowledged too little to test anything"
    );
    eprintln!(
        "{rounds} kills, {total_acks} acknowledged writes, {} turns",
        acked.turns.len()
    );
}
