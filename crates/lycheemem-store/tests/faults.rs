//! Faults beyond a kill: damaged or missing derived indexes (rebuilt from redb), a damaged
//! database file (a clear error, no panic), and a full disk during writes (a clear error; the
//! store reopens with everything acknowledged). The full disk is a child process whose file
//! size limit (`ulimit -f`, with SIGXFSZ ignored so writes fail with EFBIG) stops its writes.

mod common;

use common::*;
use lycheemem_store::prelude::*;
use lycheemem_store::{ItemRef, Store, StoreOptions, Target, VectorQuery};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

fn options() -> StoreOptions {
    let mut o = StoreOptions::new(DIMS);
    o.index.exact_search_below = 0;
    o.index.checkpoint_every = 10;
    o
}

fn text_of(session: &str, i: u32) -> String {
    format!("{session} turn {i} mentions token{i}x")
}

/// Adds turns `from..to` of `session`, one transaction each.
fn fill(store: &Store, session: &str, from: u32, to: u32) {
    let ns = ns("f");
    for i in from..to {
        let text = text_of(session, i);
        store
            .add_turns(
                &ns,
                vec![(turn(session, i, &text), Some(vector(u64::from(i))))],
            )
            .unwrap();
    }
}

/// Every turn `0..n` of `session` is found by its token and by its vector.
fn assert_searchable(store: &Store, session: &str, n: u32, what: &str) {
    let ns = ns("f");
    let stats = store.stats(&ns).unwrap();
    assert_eq!(stats.vectors, stats.indexed_vectors, "{what}: vector index");
    assert_eq!(stats.text_rows["turn"], stats.turns, "{what}: text index");
    for i in (0..n).step_by(7) {
        let expected = ItemRef::Turn(lycheemem_core::TurnRef {
            session: sid(session),
            index: i,
        });
        let hits = store
            .text_search(&ns, Target::Turn, &format!("token{i}x"), 1, None)
            .unwrap();
        assert_eq!(
            hits.first().map(|h| &h.item),
            Some(&expected),
            "{what}: text {i}"
        );
        let q = VectorQuery::new(Target::Turn, vector(u64::from(i)), 3);
        let hits = store.vector_search(&ns, &q).unwrap();
        assert!(
            hits.iter().any(|h| h.item == expected),
            "{what}: vector {i}"
        );
    }
}

fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn damaged_or_missing_indexes_are_rebuilt_from_the_database() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), options()).unwrap();
        fill(&store, "s", 0, 60);
        store.checkpoint().unwrap();
    }
    let index = dir.path().join("index");
    // 1. Every index file overwritten with garbage.
    for f in files_under(&index) {
        std::fs::write(&f, b"\x00garbage\xff").unwrap();
    }
    let store = Store::open(dir.path(), options()).unwrap();
    assert_searchable(&store, "s", 60, "garbage");
    fill(&store, "s", 60, 70);
    store.checkpoint().unwrap();
    drop(store);
    // 2. Every index file cut to half its length.
    for f in files_under(&index) {
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }
    let store = Store::open(dir.path(), options()).unwrap();
    assert_searchable(&store, "s", 70, "truncated");
    fill(&store, "s", 70, 75);
    store.checkpoint().unwrap();
    drop(store);
    // 3. One byte changed in the middle of every index file, lengths kept (a loader that only
    // parses the header would accept it and serve wrong vectors).
    for f in files_under(&index) {
        let mut bytes = std::fs::read(&f).unwrap();
        if bytes.is_empty() {
            continue;
        }
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x5a;
        std::fs::write(&f, bytes).unwrap();
    }
    let store = Store::open(dir.path(), options()).unwrap();
    assert_searchable(&store, "s", 75, "one byte changed");
    drop(store);
    // 4. The whole index folder gone.
    std::fs::remove_dir_all(&index).unwrap();
    let store = Store::open(dir.path(), options()).unwrap();
    assert_searchable(&store, "s", 75, "removed");
}

#[test]
fn a_damaged_database_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), options()).unwrap();
        fill(&store, "s", 0, 40);
    }
    let db = dir.path().join("store.redb");
    let len = std::fs::metadata(&db).unwrap().len();
    let original = std::fs::read(&db).unwrap();
    let header_zeroed = {
        let mut b = original.clone();
        b[..512].fill(0);
        b
    };
    let damages: Vec<(&str, Vec<u8>)> = vec![
        ("cut to a third", original[..original.len() / 3].to_vec()),
        ("cut to 100 bytes", original[..100].to_vec()),
        ("header zeroed", header_zeroed),
        ("garbage", vec![0x5a; len as usize]),
    ];
    for (what, damage) in damages {
        std::fs::write(&db, damage).unwrap();
        let opened = std::panic::catch_unwind(|| Store::open(dir.path(), options()));
        match opened {
            Err(_) => panic!("{what}: opening panicked"),
            Ok(Err(e)) => {
                let m = e.to_string();
                assert!(
                    m.contains("store.redb") || m.contains("database"),
                    "{what}: {m}"
                );
            }
            // Opened (the damage missed everything redb reads): it must still answer or err.
            Ok(Ok(store)) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _ = store.stats(&ns("f"));
                    let _ = store.turn_range(&ns("f"), &sid("s"), 0, 40);
                }));
                assert!(r.is_ok(), "{what}: reading a damaged store panicked");
            }
        }
    }
}

const CHILD: &str = "LYCHEEMEM_FULL_DISK_CHILD";

/// The child: appends turns until a write fails, printing `ACK i` after each acknowledged turn
/// and `ERR <message>` for the failure.
#[test]
fn full_disk_child() {
    let Ok(dir) = std::env::var(CHILD) else {
        return;
    };
    let store = match Store::open(&dir, options()) {
        Ok(s) => s,
        Err(e) => {
            println!("ERR open: {e}");
            return;
        }
    };
    let ns = ns("f");
    let start = store
        .session(&ns, &sid("s"))
        .unwrap()
        .map_or(0, |s| s.turn_count);
    for i in start..start + 100_000 {
        let text = format!("{} {}", text_of("s", i), "padding ".repeat(200));
        match store.add_turns(&ns, vec![(turn("s", i, &text), Some(vector(u64::from(i))))]) {
            Ok(_) => println!("ACK {i}"),
            Err(e) => {
                println!("ERR {e}");
                return;
            }
        }
    }
}

#[test]
fn a_full_disk_is_a_clear_error_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), options()).unwrap();
        fill(&store, "s", 0, 5);
    }
    let exe = std::env::current_exe().unwrap();
    let mut acknowledged = 5u32;
    // Each round the limit leaves room for a little more than the store holds now.
    for round in 0..3 {
        let size: u64 = files_under(dir.path())
            .iter()
            .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
            .max()
            .unwrap_or(0);
        let blocks = size / 1024 + 256 * (round + 1);
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" full_disk_child --exact --nocapture --test-threads=1"
            ))
            .arg(&exe)
            .env(CHILD, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "round {round}: child {:?}: {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "round {round}: {stderr}");
        let mut error = None;
        for line in BufReader::new(out.stdout.as_slice())
            .lines()
            .map_while(Result::ok)
        {
            if let Some(i) = line.strip_prefix("ACK ") {
                acknowledged = acknowledged.max(i.parse::<u32>().unwrap() + 1);
            } else if let Some(e) = line.strip_prefix("ERR ") {
                error = Some(e.to_string());
            }
        }
        let error = error.unwrap_or_else(|| panic!("round {round}: no write failed"));
        eprintln!("round {round}: {acknowledged} turns acknowledged, then: {error}");
        assert!(
            error.contains("storage error") || error.contains("I/O error"),
            "round {round}: {error}"
        );
        // Without the limit the store opens and holds every acknowledged turn.
        let store = Store::open(dir.path(), options())
            .unwrap_or_else(|e| panic!("round {round}: reopen after a full disk: {e}"));
        let held = store
            .session(&ns("f"), &sid("s"))
            .unwrap()
            .unwrap()
            .turn_count;
        assert!(
            held >= acknowledged,
            "round {round}: {held} < {acknowledged}"
        );
        let turns = store.turn_range(&ns("f"), &sid("s"), 0, held).unwrap();
        for t in &turns[5..acknowledged as usize] {
            assert!(t.text.starts_with(&text_of("s", t.index)), "round {round}");
        }
        assert_searchable(&store, "s", 5, &format!("round {round}"));
    }
}
