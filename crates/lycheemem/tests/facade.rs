//! The facade end to end with a real store and real MiniLM embeddings; scripted LLMs make the
//! assertions exact.

use lycheemem::{Components, Memory, NewTurn, QueryOptions};
use lycheemem_core::{Config, Namespace, Purpose, SessionId};
use lycheemem_embed::Embedder;
use lycheemem_testkit::{RecordingEmbedder, ScriptedLlm, minilm};
use std::sync::{Arc, OnceLock};

fn embedder() -> Arc<dyn Embedder> {
    static E: OnceLock<Arc<dyn Embedder>> = OnceLock::new();
    E.get_or_init(|| Arc::new(minilm())).clone()
}

const PLAN: &str = r#"{"question_type": "single", "semantic_queries": [], "temporal_filter": null, "routes": [{"route_id": "r1", "goal": "find it", "queries": [], "constraints": [], "temporal_filter": null}]}"#;

fn components(answer: &str) -> (Components, Arc<ScriptedLlm>) {
    let encoder = Arc::new(ScriptedLlm::echo_encoder());
    let answer = answer.to_string();
    let planner = Arc::new(ScriptedLlm::responding(|_| PLAN.to_string()));
    let answerer = Arc::new(ScriptedLlm::responding(move |_| answer.clone()));
    (
        Components {
            embedder: embedder(),
            reranker: None,
            encode_llm: encoder.clone(),
            plan_llm: planner,
            answer_llm: answerer,
        },
        encoder,
    )
}

/// A two-session chat: the user's facts change topic now and then.
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
                (
                    "I just adopted a beagle called Rex.",
                    "Congratulations! Beagles are lovely.",
                ),
                (
                    "Rex loves long walks in the park.",
                    "That's great exercise for both of you.",
                ),
                (
                    "Do you know good dog food brands?",
                    "Look for brands with real meat first.",
                ),
                (
                    "By the way, I started learning the cello.",
                    "Wonderful! How are the lessons going?",
                ),
                (
                    "My cello teacher is called Ms. Ortiz.",
                    "Teachers make a big difference.",
                ),
            ]),
        ),
        (
            "s2",
            "2024-04-10",
            chat(&[
                (
                    "I moved to Lisbon last week.",
                    "Exciting! How do you like it?",
                ),
                (
                    "The food in Lisbon is amazing, especially pastel de nata.",
                    "They are famous for good reason.",
                ),
                (
                    "Rex is adjusting well to the new flat.",
                    "Glad to hear the dog is happy.",
                ),
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

fn snapshot(memory: &Memory, ns: &Namespace) -> (Vec<(u32, u32)>, Vec<String>) {
    let mut segments = Vec::new();
    for s in memory.store().sessions(ns).unwrap() {
        for row in memory.store().segments(ns, &s.id).unwrap() {
            segments.push((row.segment.first_turn, row.segment.last_turn));
        }
    }
    let mut records: Vec<String> = memory
        .store()
        .all_records(ns)
        .unwrap()
        .into_iter()
        .map(|r| r.semantic_text)
        .collect();
    records.sort();
    (segments, records)
}

#[test]
fn ingest_segments_encodes_and_answers_with_a_receipt() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, encoder) = components("Rex is a beagle.");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    let ns = Namespace::new("alice").unwrap();
    ingest(&memory, &ns, None);
    let stats = memory.stats(&ns).unwrap();
    assert_eq!(stats.turns, 16);
    assert!(stats.segments >= 2, "at least one segment per session");
    assert!(
        stats.segments < 8,
        "segments batch several exchanges: {}",
        stats.segments
    );
    assert_eq!(
        stats.records, 16,
        "the echo encoder makes one record per turn"
    );
    assert_eq!(stats.vectors, stats.indexed_vectors);
    let construction = memory.construction(&ns).unwrap();
    assert_eq!(construction.exchanges, 8);
    assert_eq!(construction.encode_calls, stats.segments);
    assert_eq!(encoder.calls() as u64, stats.segments);

    let answer = memory
        .answer(
            &ns,
            "What breed is my dog Rex?",
            &QueryOptions {
                reference_date: Some("2024-05-01".into()),
                ..QueryOptions::default()
            },
        )
        .unwrap();
    assert_eq!(answer.text, "Rex is a beagle.");
    assert!(
        answer
            .evidence()
            .iter()
            .any(|e| e.evidence.text.contains("beagle called Rex"))
    );
    assert_eq!(answer.usage.len(), 2);
    assert_eq!(answer.usage[0].purpose, Purpose::Plan);
    assert_eq!(answer.usage[1].purpose, Purpose::Answer);
    let usage = memory.usage(&ns).unwrap();
    assert_eq!(usage.by_purpose[&Purpose::Plan].calls, 1);
    assert_eq!(usage.by_purpose[&Purpose::Answer].calls, 1);
    assert_eq!(usage.by_purpose[&Purpose::Encode].calls, stats.segments);
}

#[test]
fn restarting_mid_conversation_gives_the_same_segments_and_records() {
    let ns = Namespace::new("bob").unwrap();
    // One uninterrupted run.
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    ingest(&memory, &ns, None);
    let uninterrupted = snapshot(&memory, &ns);
    drop(memory);
    // Half of each session, drop the handle, reopen, the rest.
    let dir = tempfile::tempdir().unwrap();
    for (sid, date, turns) in conversation() {
        let session = SessionId::new(sid).unwrap();
        let half = turns.len() / 2 + 1;
        {
            let (comp, _) = components("x");
            let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
            memory
                .add_turns(&ns, &session, Some(date), turns[..half].to_vec())
                .unwrap();
        }
        let (comp, _) = components("x");
        let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
        memory
            .add_turns(&ns, &session, None, turns[half..].to_vec())
            .unwrap();
        memory.flush(&ns, &session).unwrap();
    }
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    assert_eq!(snapshot(&memory, &ns), uninterrupted);
}

const CRASH_CHILD: &str = "LYCHEEMEM_FACADE_CRASH_CHILD";

/// Three segments finalized by one exchange: the second exchange is over the segment limit
/// (900 tokens), so it closes the open segment and becomes one segment per turn.
fn three_segment_exchange() -> Vec<NewTurn> {
    let long = |who: &str| format!("{who} practised the cello today. {}", "scales ".repeat(600));
    vec![
        NewTurn::user("I just adopted a beagle called Rex."),
        NewTurn::assistant("Congratulations! Beagles are lovely."),
        NewTurn::user(long("I")),
        NewTurn::assistant(long("You")),
        NewTurn::user("Rex loves long walks in the park."),
        NewTurn::assistant("That's great exercise for both of you."),
    ]
}

/// The child of the crash test: its process dies (abort, no unwinding, nothing flushed) inside
/// the second encoder call.
#[test]
fn crash_child_dies_in_the_second_encoder_call() {
    let Ok(dir) = std::env::var(CRASH_CHILD) else {
        return;
    };
    let (mut comp, _) = components("x");
    let calls = std::sync::atomic::AtomicUsize::new(0);
    comp.encode_llm = Arc::new(ScriptedLlm::responding(move |messages| {
        if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            std::process::abort();
        }
        lycheemem_testkit::echo_encoder_reply(messages.last().map_or("", |m| m.content.as_str()))
    }));
    let memory = Memory::with_components(&dir, Config::default(), comp).unwrap();
    let ns = Namespace::new("dana").unwrap();
    let session = SessionId::new("s1").unwrap();
    let _ = memory.add_turns(&ns, &session, Some("2024-03-01"), three_segment_exchange());
    unreachable!("the encoder aborts the process");
}

#[test]
fn a_crash_between_the_segments_of_one_exchange_loses_none_of_them() {
    let ns = Namespace::new("dana").unwrap();
    let session = SessionId::new("s1").unwrap();
    let turns = three_segment_exchange();
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    memory
        .add_turns(&ns, &session, Some("2024-03-01"), turns.clone())
        .unwrap();
    memory.flush(&ns, &session).unwrap();
    let uninterrupted = snapshot(&memory, &ns);
    assert!(uninterrupted.0.len() >= 3, "{:?}", uninterrupted.0);
    drop(memory);

    // A child process dies during the second encoder call: the first segment is committed, the
    // other two segments of that exchange are not.
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child_dies_in_the_second_encoder_call",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_CHILD, dir.path())
        .output()
        .unwrap();
    assert!(
        !out.status.success() && out.status.code().is_none(),
        "the child must die by a signal (abort), not exit: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    assert_eq!(
        snapshot(&memory, &ns).0.len(),
        1,
        "one segment was committed"
    );
    assert_eq!(memory.stats(&ns).unwrap().turns, 6, "every turn is stored");
    memory.flush(&ns, &session).unwrap();
    assert_eq!(snapshot(&memory, &ns), uninterrupted);
}

#[test]
fn a_panicking_encoder_fails_its_segment_and_the_session_moves_on() {
    let ns = Namespace::new("erin").unwrap();
    let session = SessionId::new("s1").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut comp, _) = components("x");
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    comp.encode_llm = Arc::new(ScriptedLlm::responding(move |messages| {
        if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            panic!("a defect reached by the second segment");
        }
        lycheemem_testkit::echo_encoder_reply(messages.last().map_or("", |m| m.content.as_str()))
    }));
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    let mut receipt = memory
        .add_turns(&ns, &session, Some("2024-03-01"), three_segment_exchange())
        .unwrap();
    receipt.merge(memory.flush(&ns, &session).unwrap());
    assert_eq!(receipt.failed_segments, 1, "{receipt:?}");
    let failure = receipt
        .segments
        .iter()
        .find_map(|s| s.failure.clone())
        .unwrap();
    assert!(failure.contains("panicked"), "{failure}");
    assert!(
        calls.load(std::sync::atomic::Ordering::SeqCst) >= 3,
        "the segments after the failed one were encoded"
    );
    let stats = memory.stats(&ns).unwrap();
    assert_eq!(stats.failed_segments, 1, "{stats:?}");
    assert!(stats.records >= 2, "{stats:?}");
    assert!(
        memory.unprocessed_sessions(&ns).unwrap().is_empty(),
        "nothing is left queued"
    );
    // A later call finds nothing stuck.
    memory
        .add_turns(&ns, &session, None, vec![NewTurn::user("One more thing.")])
        .unwrap();
    memory.flush(&ns, &session).unwrap();
}

#[test]
fn deletes_rederive_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    let ns = Namespace::new("carol").unwrap();
    ingest(&memory, &ns, Some(3));
    let before = memory.stats(&ns).unwrap();
    // Rederive with the same models and config changes nothing.
    let report = memory.rederive(&ns).unwrap();
    assert_eq!(report.records_before, report.records_after);
    assert!(report.added.is_empty() && report.removed.is_empty());
    assert_eq!(memory.stats(&ns).unwrap().records, before.records);
    // Rederive with the eager policy: one segment per exchange.
    drop(memory);
    let mut eager = Config::default();
    eager.segment.policy = lycheemem_core::config::SegmentPolicy::PerExchange;
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), eager, comp).unwrap();
    let report = memory.rederive(&ns).unwrap();
    assert_eq!(report.segments, 8);
    // Deleting a record re-embeds the nodes it left.
    let id = memory.store().all_records(&ns).unwrap()[0]
        .record_id
        .clone();
    let receipt = memory.delete_record(&ns, &id).unwrap();
    assert_eq!(receipt.records, 1);
    assert_eq!(memory.stats(&ns).unwrap().pending_vectors, 0);
    assert!(memory.delete_record(&ns, &id).is_err(), "already gone");
    let receipt = memory
        .delete_session(&ns, &SessionId::new("s2").unwrap())
        .unwrap();
    assert_eq!(receipt.turns, 6);
    // Bad input: empty and oversized turns, bad dates, unknown namespaces.
    let s = SessionId::new("s3").unwrap();
    assert!(
        memory
            .add_turns(&ns, &s, None, vec![NewTurn::user("  ")])
            .is_err()
    );
    assert!(
        memory
            .add_turns(
                &ns,
                &s,
                None,
                vec![NewTurn::user("x".repeat(lycheemem::MAX_TURN_CHARS + 1))]
            )
            .is_err()
    );
    assert!(
        memory
            .add_turns(&ns, &s, Some("the day after"), vec![NewTurn::user("hi")])
            .is_err()
    );
    // Speaker names, turn times and session dates are labels: long ones are refused.
    let long = "y".repeat(lycheemem::MAX_LABEL_CHARS + 1);
    let named = NewTurn {
        speaker: Some(long.clone()),
        ..NewTurn::user("hi")
    };
    let timed = NewTurn {
        time: Some(long.clone()),
        ..NewTurn::user("hi")
    };
    for turn in [named, timed] {
        let err = memory.add_turns(&ns, &s, None, vec![turn]).unwrap_err();
        assert!(
            matches!(err, lycheemem_core::Error::InvalidInput(_)),
            "{err}"
        );
    }
    let err = memory
        .add_turns(&ns, &s, Some(&long), vec![NewTurn::user("hi")])
        .unwrap_err();
    assert!(err.to_string().contains("characters"), "{err}");
    let nobody = Namespace::new("nobody").unwrap();
    assert!(
        memory
            .search(&nobody, "anything?", &QueryOptions::default())
            .is_err()
    );
    // A k no answer prompt could hold is refused before any index is asked for it.
    for top_k in [lycheemem_retrieve::MAX_TOP_K + 1, usize::MAX] {
        let err = memory
            .search(
                &ns,
                "What is my dog's name?",
                &QueryOptions {
                    top_k,
                    ..QueryOptions::default()
                },
            )
            .unwrap_err();
        assert!(
            matches!(err, lycheemem_core::Error::InvalidInput(_)),
            "{err}"
        );
    }
    assert!(
        memory
            .flush(&ns, &SessionId::new("missing").unwrap())
            .is_err()
    );
    let receipt = memory.delete_namespace(&ns).unwrap();
    assert!(receipt.turns > 0);
    assert!(memory.stats(&ns).is_err());
}

#[test]
fn a_real_small_model_runs_the_whole_pipeline() {
    // SmolLM2-135M for every purpose: only the structure is asserted (the model is tiny).
    let models = lycheemem_testkit::models_root();
    lycheemem_testkit::model_dir("smollm2-135m-instruct");
    let store = lycheemem_models::ModelStore::open(&models).unwrap();
    let llm = lycheemem_llm::open_llm(
        "local:smollm2-135m-instruct",
        &store,
        lycheemem_llm::LocalOptions::default(),
    )
    .unwrap();
    let components = Components {
        embedder: embedder(),
        reranker: None,
        encode_llm: llm.clone(),
        plan_llm: llm.clone(),
        answer_llm: llm,
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::default();
    cfg.encode.max_output_tokens = 384;
    cfg.answer.max_output_tokens = 48;
    let memory = Memory::with_components(dir.path(), cfg, components).unwrap();
    let ns = Namespace::new("small").unwrap();
    let s = SessionId::new("s1").unwrap();
    memory
        .add_turns(
            &ns,
            &s,
            Some("2024-03-01"),
            vec![
                NewTurn::user("I adopted a beagle called Rex yesterday."),
                NewTurn::assistant("Congratulations on adopting Rex!"),
            ],
        )
        .unwrap();
    let receipt = memory.flush(&ns, &s).unwrap();
    assert!(!receipt.segments.is_empty());
    let stats = memory.stats(&ns).unwrap();
    assert_eq!(stats.turns, 2);
    assert!(stats.segments >= 1);
    let answer = memory
        .answer(&ns, "What is my dog's name?", &QueryOptions::default())
        .unwrap();
    assert!(!answer.text.is_empty());
    assert!(
        !answer.evidence().is_empty(),
        "raw turns are searchable even if encoding failed"
    );
    assert_eq!(answer.usage.last().unwrap().purpose, Purpose::Answer);
    assert!(answer.tokens() > 0);
}

#[test]
fn two_speaker_logs_embed_each_turn_once() {
    let recording = Arc::new(RecordingEmbedder::new(embedder()));
    let (mut comp, _) = components("x");
    comp.embedder = recording.clone();
    let dir = tempfile::tempdir().unwrap();
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    let ns = Namespace::new("duo").unwrap();
    let s = SessionId::new("s1").unwrap();
    let turns = vec![
        NewTurn::spoken("Caroline", "I went to a pottery class yesterday."),
        NewTurn::spoken("Melanie", "Nice! I ran a charity race."),
        NewTurn::spoken("Caroline", "I am thinking about adopting a child."),
    ];
    memory
        .add_turns(&ns, &s, Some("2023-05-08"), turns)
        .unwrap();
    memory.flush(&ns, &s).unwrap();
    // Each turn is its own exchange: the segmenter reuses the turn vector instead of
    // embedding the same text again.
    let texts = recording.texts();
    for turn in [
        "Caroline: I went to a pottery class yesterday.",
        "Melanie: Nice! I ran a charity race.",
        "Caroline: I am thinking about adopting a child.",
    ] {
        assert_eq!(texts.iter().filter(|t| *t == turn).count(), 1, "{texts:?}");
    }
    assert_eq!(memory.construction(&ns).unwrap().exchanges, 3);
}

/// Sessions processed at the same time encode concurrently (the LLM sees both calls at once),
/// and the evidence nodes they both update end up as if the sessions had gone one after the
/// other.
#[test]
fn sessions_encode_concurrently_and_their_node_merges_lose_nothing() {
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};
    let ns = Namespace::new("alice").unwrap();
    // Sequential reference.
    let seq_dir = tempfile::tempdir().unwrap();
    let (comp, _) = components("-");
    let seq = Memory::with_components(seq_dir.path(), Config::default(), comp).unwrap();
    ingest(&seq, &ns, None);

    // The first encoder call waits (up to 10 s) for a second one to start: with one call at a
    // time the second never starts while the first waits, and the peak stays 1.
    #[derive(Default)]
    struct Calls {
        state: Mutex<(usize, usize, usize)>, // (started, in flight, peak in flight)
        cv: Condvar,
    }
    let calls = Arc::new(Calls::default());
    let encoder = Arc::new(ScriptedLlm::responding({
        let calls = calls.clone();
        move |m| {
            let mut s = calls.state.lock().unwrap();
            s.0 += 1;
            s.1 += 1;
            s.2 = s.2.max(s.1);
            calls.cv.notify_all();
            let deadline = Instant::now() + Duration::from_secs(10);
            while s.0 < 2 && Instant::now() < deadline {
                s = calls
                    .cv
                    .wait_timeout(s, Duration::from_millis(50))
                    .unwrap()
                    .0;
            }
            s.1 -= 1;
            drop(s);
            lycheemem_testkit::echo_encoder_reply(m.last().map_or("", |m| m.content.as_str()))
        }
    }));
    let (mut comp, _) = components("-");
    comp.encode_llm = encoder;
    let dir = tempfile::tempdir().unwrap();
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    std::thread::scope(|scope| {
        for (sid, date, turns) in conversation() {
            let (memory, ns) = (&memory, &ns);
            scope.spawn(move || {
                let session = SessionId::new(sid).unwrap();
                memory.add_turns(ns, &session, Some(date), turns).unwrap();
                memory.flush(ns, &session).unwrap();
            });
        }
    });
    assert_eq!(
        calls.state.lock().unwrap().2,
        2,
        "the sessions' calls overlapped"
    );
    assert_eq!(snapshot(&memory, &ns), snapshot(&seq, &ns));
    let links = |m: &Memory| {
        let mut nodes: Vec<(String, Vec<String>)> = m
            .store()
            .all_nodes(&ns)
            .unwrap()
            .into_iter()
            .map(|n| (n.node_id, n.record_ids.into_iter().collect()))
            .collect();
        nodes.sort();
        nodes
    };
    let nodes = links(&memory);
    assert!(
        nodes.iter().any(|(_, records)| records.len() > 5),
        "a node shared by both sessions: {nodes:?}"
    );
    assert_eq!(nodes, links(&seq));
}

#[test]
fn turns_sent_again_at_their_index_are_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let (comp, _) = components("x");
    let memory = Memory::with_components(dir.path(), Config::default(), comp).unwrap();
    let ns = Namespace::new("fay").unwrap();
    let s = SessionId::new("s1").unwrap();
    let turns = vec![
        NewTurn::user("I moved to Porto in March."),
        NewTurn::assistant("Porto is beautiful."),
        NewTurn::user("My brother visits next week."),
        NewTurn::assistant("Have a great time together."),
    ];
    let r = memory
        .add_turns_at(&ns, &s, Some("2024-04-01"), 0, turns[..2].to_vec())
        .unwrap();
    assert_eq!((r.turns_stored, r.turns_already_stored), (2, 0));
    // The same batch again (a retry, a re-read file): nothing new.
    let r = memory
        .add_turns_at(&ns, &s, Some("2024-04-01"), 0, turns[..2].to_vec())
        .unwrap();
    assert_eq!((r.turns_stored, r.turns_already_stored), (0, 2));
    // A longer batch from the start: only the tail is new.
    let r = memory
        .add_turns_at(&ns, &s, None, 0, turns.clone())
        .unwrap();
    assert_eq!((r.turns_stored, r.turns_already_stored), (2, 2));
    // Other content at a stored index: a conflict, and nothing is stored.
    let mut changed = turns.clone();
    changed[1] = NewTurn::assistant("Lisbon is beautiful.");
    changed.push(NewTurn::user("A fifth turn."));
    let e = memory.add_turns_at(&ns, &s, None, 0, changed).unwrap_err();
    assert!(matches!(e, lycheemem_core::Error::Conflict(_)), "{e}");
    // A batch past the end would leave a gap.
    let e = memory
        .add_turns_at(&ns, &s, None, 9, vec![NewTurn::user("late")])
        .unwrap_err();
    assert!(matches!(e, lycheemem_core::Error::InvalidInput(_)), "{e}");
    memory.flush(&ns, &s).unwrap();
    assert_eq!(memory.stats(&ns).unwrap().turns, 4);
    let records = memory.stats(&ns).unwrap().records;
    // After a flush, the whole session sent again changes nothing.
    let r = memory.add_turns_at(&ns, &s, None, 0, turns).unwrap();
    assert_eq!((r.turns_stored, r.turns_already_stored), (0, 4));
    memory.flush(&ns, &s).unwrap();
    assert_eq!(memory.stats(&ns).unwrap().turns, 4);
    assert_eq!(memory.stats(&ns).unwrap().records, records);
}

/// MiniLM that reports a given segmentation calibration (as a manifest entry would give it).
struct CalibratedMiniLm(lycheemem_core::config::SegmentCalibration);

impl Embedder for CalibratedMiniLm {
    fn embed(&self, texts: &[&str]) -> lycheemem_core::Result<Vec<Vec<f32>>> {
        embedder().embed(texts)
    }
    fn dimension(&self) -> usize {
        embedder().dimension()
    }
    fn model_id(&self) -> &str {
        "calibrated-minilm"
    }
    fn segment_calibration(&self) -> Option<lycheemem_core::config::SegmentCalibration> {
        Some(self.0)
    }
}

#[test]
fn the_embedders_calibration_moves_boundaries_only_when_asked() {
    use lycheemem_core::config::{CalibrationSource, SegmentCalibration};
    let segments = |calibration: SegmentCalibration, source: CalibrationSource| {
        let dir = tempfile::tempdir().unwrap();
        let (mut comp, _) = components("unused");
        comp.embedder = Arc::new(CalibratedMiniLm(calibration));
        let mut config = Config::default();
        config.segment.surprise_calibration = source;
        let memory = Memory::with_components(dir.path(), config, comp).unwrap();
        let ns = Namespace::new("alice").unwrap();
        ingest(&memory, &ns, None);
        memory.stats(&ns).unwrap().segments
    };
    // Every exchange looks far more surprising than usual, or far less.
    let jumpy = SegmentCalibration {
        surprise_center: 0.001,
        surprise_scale: 0.001,
        cohesion_scale: 0.0001,
    };
    let calm = SegmentCalibration {
        surprise_center: 5.0,
        surprise_scale: 1.0,
        cohesion_scale: 100.0,
    };
    let published = segments(jumpy, CalibrationSource::Published);
    assert_eq!(published, segments(calm, CalibrationSource::Published));
    let many = segments(jumpy, CalibrationSource::Embedder);
    let few = segments(calm, CalibrationSource::Embedder);
    assert!(many > few, "{many} segments vs {few}");
    assert!(
        many >= published && few <= published,
        "{many} / {published} / {few}"
    );
}
