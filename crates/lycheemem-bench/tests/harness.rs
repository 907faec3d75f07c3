//! The harness end to end on a tiny LoCoMo-shaped file with scripted models: construction is
//! cached and shared by retrieval variants, predictions are checkpointed and a rerun makes no
//! new calls, reports are written, and evidence recall reflects what was retrieved.

use lycheemem::Components;
use lycheemem_bench::run::{self, Backends, RunSpec};
use lycheemem_bench::{RunMeta, Variant, construct, dataset, write_reports};
use lycheemem_core::{Config, Result as LlmResult};
use lycheemem_llm::{ChatMessage, Completion, GenerateOptions, Llm};
use lycheemem_testkit::{HashEmbedder, ScriptedLlm};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

fn locomo_file(dir: &std::path::Path) -> std::path::PathBuf {
    let turns1 = serde_json::json!([
        {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a tabby cat named Miso last week."},
        {"speaker": "Bob", "dia_id": "D1:2", "text": "Congratulations on Miso the tabby cat!"},
        {"speaker": "Ann", "dia_id": "D1:3", "text": "She sleeps on my keyboard all day."},
        {"speaker": "Bob", "dia_id": "D1:4", "text": "I started training for a marathon in Berlin."}
    ]);
    let turns2 = serde_json::json!([
        {"speaker": "Bob", "dia_id": "D2:1", "text": "The Berlin marathon is in September."},
        {"speaker": "Ann", "dia_id": "D2:2", "text": "Good luck with the marathon training!"}
    ]);
    let data = serde_json::json!([{
        "sample_id": "conv-x",
        "conversation": {
            "speaker_a": "Ann", "speaker_b": "Bob",
            "session_1_date_time": "1:56 pm on 8 May, 2023", "session_1": turns1,
            "session_2_date_time": "2:00 pm on 20 May, 2023", "session_2": turns2
        },
        "qa": [
            {"question": "What is the name of Ann's cat?", "answer": "Miso", "evidence": ["D1:1"], "category": 4},
            {"question": "Which city is Bob's marathon in?", "answer": "Berlin", "evidence": ["D1:4", "D2:1"], "category": 1},
            {"question": "Trick question?", "adversarial_answer": "x", "evidence": [], "category": 5}
        ]
    }]);
    let path = dir.join("locomo_tiny.json");
    std::fs::write(&path, data.to_string()).unwrap();
    path
}

fn backends(llm: Arc<ScriptedLlm>, judge: Arc<ScriptedLlm>) -> Backends {
    Backends {
        components: Components::with_llm(Arc::new(HashEmbedder::new(64)), llm),
        judge: Some(judge),
    }
}

/// A judge double: CORRECT exactly when the gold answer is "Miso".
fn miso_judge() -> Arc<ScriptedLlm> {
    Arc::new(ScriptedLlm::responding(|m| {
        let user = m.last().map_or("", |m| m.content.as_str());
        if user.contains("Gold answer: Miso") {
            r#"{"verdict": "CORRECT"}"#.into()
        } else {
            r#"{"verdict": "WRONG"}"#.into()
        }
    }))
}

/// A run of `variants` with the harness defaults (k 15, 2-turn chunks, seed 7, one job).
fn spec_for(
    dataset: &std::path::Path,
    out: &std::path::Path,
    cache: &std::path::Path,
    variants: &[&str],
) -> RunSpec {
    RunSpec {
        dataset: dataset.to_path_buf(),
        variants: variants.iter().map(|v| v.to_string()).collect(),
        out: out.to_path_buf(),
        cache: cache.to_path_buf(),
        postgres: None,
        items: vec![],
        categories: vec![],
        limit: None,
        seed: 7,
        retrieval_only: false,
        top_k: 15,
        naive_chunk_turns: 2,
        full_context_reserve: 1024,
        max_sessions: None,
        jobs: 1,
        session_lookahead: 0,
        variant_items: Default::default(),
        plans_only: false,
        peer_python: None,
    }
}

#[test]
fn a_plans_only_run_makes_every_plan_and_builds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let b = backends(llm.clone(), miso_judge());
    let spec = RunSpec {
        plans_only: true,
        ..spec_for(
            &dir.path().join("locomo_tiny.json"),
            &dir.path().join("results"),
            &dir.path().join("cache"),
            &["full", "no_planner", "naive_rag"],
        )
    };
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    // Two questions, one planning variant: two planner calls and nothing else.
    assert_eq!(llm.calls(), 2);
    let plans = std::fs::read_to_string(spec.cache.join("plans.jsonl")).unwrap();
    assert_eq!(plans.lines().count(), 2);
    let kept = std::fs::read_to_string(spec.out.join("plans.jsonl")).unwrap();
    assert_eq!(
        kept.lines().count(),
        2,
        "the results folder keeps its plans"
    );
    assert!(run::predictions(&spec.out).unwrap().is_empty());
    assert!(run::constructions(&spec.out).unwrap().is_empty());
    let built: Vec<_> = std::fs::read_dir(&spec.cache)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .collect();
    assert!(built.is_empty(), "no memory is built: {built:?}");
    // The full run that follows plans nothing again: encoder and answer calls only.
    let full = RunSpec {
        plans_only: false,
        ..spec.clone()
    };
    let before = llm.calls();
    run::run(&data, &full, &Config::default(), &b, &mut |_| {}).unwrap();
    let plans = std::fs::read_to_string(spec.cache.join("plans.jsonl")).unwrap();
    assert_eq!(plans.lines().count(), 2, "no plan made twice");
    assert!(llm.calls() > before);
    assert_eq!(run::predictions(&spec.out).unwrap().len(), 6);
}

#[test]
fn a_run_caches_checkpoints_scores_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    assert_eq!(data.items[0].questions.len(), 3);
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let judge = miso_judge();
    let spec = spec_for(
        &dir.path().join("locomo_tiny.json"),
        &dir.path().join("results"),
        &dir.path().join("cache"),
        &[
            "full",
            "no_planner",
            "record_vector_only",
            "naive_rag",
            "full_context",
        ],
    );
    let b = backends(llm.clone(), judge.clone());
    let mut lines = Vec::new();
    run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap();
    let preds = run::predictions(&spec.out).unwrap();
    // Category 5 is not selected by default: 2 questions × 5 variants.
    assert_eq!(preds.len(), 10, "{lines:#?}");
    for p in &preds {
        assert!(p.prediction.is_some());
        assert!(p.recall.is_some(), "{p:?}");
        assert!(p.f1.is_some());
        assert_eq!(p.judge_correct, Some(p.question_id == "conv-x-q1"), "{p:?}");
    }
    // Everything is found in a memory this small (k = 15 covers every item).
    let full_context: Vec<_> = preds
        .iter()
        .filter(|p| p.variant == "full_context")
        .collect();
    assert!(full_context.iter().all(|p| p.recall == Some(1.0)));
    // One construction shared by the three memory variants; one plan per question.
    let builds = run::constructions(&spec.out).unwrap();
    assert_eq!(builds.iter().filter(|b| b.report.hash != "none").count(), 3);
    let hashes: std::collections::BTreeSet<_> = builds
        .iter()
        .filter(|b| b.report.hash != "none")
        .map(|b| b.report.hash.clone())
        .collect();
    assert_eq!(hashes.len(), 1);
    assert!(builds[0].report.segments >= 1 && builds[0].report.records >= 6);
    let plans = std::fs::read_to_string(spec.cache.join("plans.jsonl")).unwrap();
    assert_eq!(plans.lines().count(), 2, "plans are made once per question");
    // A rerun finds every prediction checkpointed and calls no model.
    let calls = (llm.calls(), judge.calls());
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    assert_eq!((llm.calls(), judge.calls()), calls);
    assert_eq!(run::predictions(&spec.out).unwrap().len(), 10);
    // A new results folder reuses the cached memory and plans: only answers and verdicts.
    let spec2 = RunSpec {
        out: dir.path().join("results2"),
        variants: vec!["no_lexical".into()],
        ..spec.clone()
    };
    run::run(&data, &spec2, &Config::default(), &b, &mut |_| {}).unwrap();
    assert_eq!(
        llm.calls(),
        calls.0 + 2,
        "two answers, no encoding, no planning"
    );
    let md = write_reports(
        &spec.out,
        &RunMeta {
            command: "test".into(),
            dataset: "locomo_tiny.json".into(),
            dataset_sha256: data.sha256.clone(),
            top_k: 15,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(md.contains("| full |"), "{md}");
    assert!(md.contains("single_hop (n=1)"), "{md}");
    for f in [
        "summary.md",
        "summary.json",
        "run.json",
        "categories.svg",
        "quality_vs_construction_tokens.svg",
    ] {
        assert!(spec.out.join(f).exists(), "{f}");
    }
}

#[test]
fn a_killed_construction_resumes_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = Arc::new(ScriptedLlm::echo_encoder());
    let cfg = Config::default();
    let hash = lycheemem_bench::variant::construction_hash(&cfg);
    let cache = lycheemem_bench::construct::MemoryHome {
        cache: dir.path().join("cache"),
        postgres: None,
    };
    let comps = backends(llm.clone(), llm.clone()).components;
    // Build only the first session: the run is stopped as it finishes (the stop is noticed
    // before the next session).
    let stop = AtomicBool::new(false);
    let err = lycheemem_bench::construct::build_or_open(
        &cache,
        data.kind,
        &data.items[0],
        &cfg,
        &hash,
        comps.clone(),
        lycheemem_bench::construct::BuildOptions {
            stop: Some(&stop),
            session_lookahead: 0,
        },
        &mut |_| stop.store(true, Ordering::SeqCst),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        err.to_string().contains("stopped before session 2 of 2"),
        "{err:#}"
    );
    let calls = llm.calls();
    let (_, report, cached) = lycheemem_bench::construct::build_or_open(
        &cache,
        data.kind,
        &data.items[0],
        &cfg,
        &hash,
        comps,
        Default::default(),
        &mut |_| {},
    )
    .unwrap();
    assert!(!cached);
    assert_eq!(report.turns, 6, "session 1 kept, session 2 added");
    assert_eq!(report.sessions, 2);
    assert!(llm.calls() > calls, "only the new session is encoded");
    assert_eq!(report.encode_calls as usize, llm.calls());
}

#[test]
fn a_session_slice_keeps_only_questions_answerable_inside_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let sliced = run::first_sessions(&data, 1);
    assert_eq!(sliced.items[0].sessions.len(), 1);
    let ids: Vec<&str> = sliced.items[0]
        .questions
        .iter()
        .map(|q| q.id.as_str())
        .collect();
    assert_eq!(ids, ["conv-x-q1"], "q2 needs session 2; q3 has no evidence");
}

/// (variant, question, prediction, recall, verdict, evidence ids).
type PredictionKey = (
    String,
    String,
    Option<String>,
    Option<f64>,
    Option<bool>,
    Vec<String>,
);

#[test]
fn parallel_jobs_give_the_same_results_as_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    // Two conversations, so memories are built concurrently too.
    let one = locomo_file(dir.path());
    let mut data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&one).unwrap()).unwrap();
    let mut second = data[0].clone();
    second["sample_id"] = "conv-y".into();
    // Other dates, so no encoder call of conv-y repeats one of conv-x: a repeated call is
    // replayed from the log when the other build finished first, which only a sequential run
    // guarantees.
    second["conversation"]["session_1_date_time"] = "1:56 pm on 8 May, 2024".into();
    second["conversation"]["session_2_date_time"] = "2:00 pm on 20 May, 2024".into();
    data.as_array_mut().unwrap().push(second);
    let path = dir.path().join("locomo_two.json");
    std::fs::write(&path, data.to_string()).unwrap();
    let data = dataset::load(&path).unwrap();
    let run_with = |jobs: usize, out: &str, cache: &str| {
        let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
        let judge = miso_judge();
        let spec = RunSpec {
            jobs,
            variant_items: [("no_planner".to_string(), vec!["conv-y".to_string()])].into(),
            ..spec_for(
                &path,
                &dir.path().join(out),
                &dir.path().join(cache),
                &["full", "no_planner", "naive_rag"],
            )
        };
        let mut lines = Vec::new();
        run::run(
            &data,
            &spec,
            &Config::default(),
            &backends(llm.clone(), judge),
            &mut |l| lines.push(l),
        )
        .unwrap();
        let mut preds: Vec<PredictionKey> = run::predictions(&spec.out)
            .unwrap()
            .into_iter()
            .map(|p| {
                let ids: Vec<String> = p.evidence.iter().map(|e| e.id.clone()).collect();
                (
                    p.variant,
                    p.question_id,
                    p.prediction,
                    p.recall,
                    p.judge_correct,
                    ids,
                )
            })
            .collect();
        preds.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        let mut builds: Vec<_> = run::constructions(&spec.out)
            .unwrap()
            .into_iter()
            .map(|c| {
                (
                    c.variant,
                    c.report.item,
                    c.report.segments,
                    c.report.records,
                )
            })
            .collect();
        builds.sort();
        let plans = std::fs::read_to_string(spec.cache.join("plans.jsonl")).unwrap();
        (preds, builds, plans.lines().count(), llm.calls(), lines)
    };
    // A restriction naming an unknown item is an error, not a silent no-op.
    let mut typo = RunSpec {
        retrieval_only: true,
        variant_items: [("no_planner".to_string(), vec!["conv-z".to_string()])].into(),
        ..spec_for(
            &path,
            &dir.path().join("typo"),
            &dir.path().join("typo-cache"),
            &["no_planner"],
        )
    };
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let b = backends(llm.clone(), llm.clone());
    let err = run::run(&data, &typo, &Config::default(), &b, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("conv-z"), "{err}");
    typo.variant_items = [("eager".to_string(), vec!["conv-x".to_string()])].into();
    assert!(run::run(&data, &typo, &Config::default(), &b, &mut |_| {}).is_err());
    assert_eq!(llm.calls(), 0);

    let (seq_preds, seq_builds, seq_plans, seq_calls, _) = run_with(1, "seq", "seq-cache");
    let (par_preds, par_builds, par_plans, par_calls, lines) = run_with(4, "par", "par-cache");
    assert_eq!(
        seq_preds.len(),
        10,
        "2 items x 2 questions x 2 variants, + no_planner on conv-y only"
    );
    assert!(
        !seq_preds
            .iter()
            .any(|p| p.0 == "no_planner" && p.1.starts_with("conv-x"))
    );
    assert_eq!(par_builds, seq_builds);
    assert_eq!((par_plans, par_calls), (seq_plans, seq_calls));
    // Same evidence in the same order (retrieval breaks every score tie by target).
    assert_eq!(par_preds, seq_preds);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("building 2 memories, 2 at a time")),
        "{lines:#?}"
    );
}

/// A run with two jobs (waves of 4 items) and no answer or judge calls, writing its results and
/// cache under `dir`.
fn two_jobs_retrieval_only(
    dir: &std::path::Path,
    dataset: &std::path::Path,
    variants: &[&str],
) -> RunSpec {
    RunSpec {
        jobs: 2,
        retrieval_only: true,
        ..spec_for(dataset, &dir.join("results"), &dir.join("cache"), variants)
    }
}

/// A flag a test double sets or waits on.
fn flag() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Five copies of the tiny conversation, `conv-0` … `conv-4`, each with a line of its own in
/// `session` (`zq<n>x`, so none replays another's encoder calls).
fn five_conversations(
    dir: &std::path::Path,
    session: &str,
) -> (std::path::PathBuf, dataset::Dataset) {
    let one = locomo_file(dir);
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&one).unwrap()).unwrap();
    let items: Vec<serde_json::Value> = (0..5)
        .map(|n| {
            let mut item = data[0].clone();
            item["sample_id"] = format!("conv-{n}").into();
            item["conversation"][session][1]["text"] =
                format!("Good luck with the marathon training! Note {n}: zq{n}x.").into();
            item
        })
        .collect();
    let path = dir.join("locomo_five.json");
    std::fs::write(&path, serde_json::Value::from(items).to_string()).unwrap();
    let data = dataset::load(&path).unwrap();
    (path, data)
}

/// Waits (30 s at most) until `flag` is set; sets `gave_up` when it was not.
fn wait_for(flag: &AtomicBool, gave_up: &AtomicBool) {
    let start = std::time::Instant::now();
    while !flag.load(Ordering::SeqCst) {
        if start.elapsed() > std::time::Duration::from_secs(30) {
            gave_up.store(true, Ordering::SeqCst);
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// An LLM (an encoder or a planner) that passes calls on and notes when one has seen `marker`;
/// with `hold`, that call first waits (30 s at most) until `hold` is set, and notes if it gave up.
struct WatchingLlm {
    inner: Arc<ScriptedLlm>,
    marker: &'static str,
    seen: Arc<AtomicBool>,
    hold: Option<(Arc<AtomicBool>, Arc<AtomicBool>)>,
}

impl Llm for WatchingLlm {
    fn complete(
        &self,
        messages: &[ChatMessage],
        options: &GenerateOptions,
    ) -> LlmResult<Completion> {
        if messages.iter().any(|m| m.content.contains(self.marker)) {
            self.seen.store(true, Ordering::SeqCst);
            if let Some((hold, gave_up)) = &self.hold {
                wait_for(hold, gave_up);
            }
        }
        self.inner.complete(messages, options)
    }
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}

/// The planner: each call waits (30 s at most) until the encoder has seen its marker, and notes
/// when it gave up waiting.
struct WaitingPlanner {
    inner: Arc<ScriptedLlm>,
    seen: Arc<AtomicBool>,
    gave_up: Arc<AtomicBool>,
}

impl Llm for WaitingPlanner {
    fn complete(
        &self,
        messages: &[ChatMessage],
        options: &GenerateOptions,
    ) -> LlmResult<Completion> {
        wait_for(&self.seen, &self.gave_up);
        self.inner.complete(messages, options)
    }
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}

/// One LoCoMo conversation of four sessions, three turns each; session `k`'s first turn carries
/// the marker `zq<k>x`.
fn four_sessions(dir: &std::path::Path) -> (std::path::PathBuf, dataset::Dataset) {
    let mut conversation = serde_json::json!({"speaker_a": "Ann", "speaker_b": "Bob"});
    for k in 1..=4 {
        conversation[format!("session_{k}_date_time")] = format!("1:56 pm on {k} May, 2023").into();
        conversation[format!("session_{k}")] = serde_json::json!([
            {"speaker": "Ann", "dia_id": format!("D{k}:1"), "text": format!("Note {k}: zq{k}x, I fed the cat at {k} o'clock.")},
            {"speaker": "Bob", "dia_id": format!("D{k}:2"), "text": format!("I ran {k} miles in Berlin today.")},
            {"speaker": "Ann", "dia_id": format!("D{k}:3"), "text": format!("The cat slept {k} hours after that.")}
        ]);
    }
    let data = serde_json::json!([{
        "sample_id": "conv-4s",
        "conversation": conversation,
        "qa": [
            {"question": "When did Ann feed the cat?", "answer": "1 o'clock", "evidence": ["D1:1"], "category": 4},
            {"question": "How far did Bob run?", "answer": "3 miles", "evidence": ["D3:2"], "category": 4},
            {"question": "How long did the cat sleep?", "answer": "4 hours", "evidence": ["D4:3"], "category": 1}
        ]
    }]);
    let path = dir.join("locomo_four_sessions.json");
    std::fs::write(&path, data.to_string()).unwrap();
    let data = dataset::load(&path).unwrap();
    (path, data)
}

/// An encoder whose calls for `hold` wait (30 s at most, noting it when they gave up) until a
/// call for `release` has been made.
struct GatedLlm {
    inner: Arc<ScriptedLlm>,
    hold: &'static str,
    release: &'static str,
    released: Arc<AtomicBool>,
    gave_up: Arc<AtomicBool>,
}

impl Llm for GatedLlm {
    fn complete(
        &self,
        messages: &[ChatMessage],
        options: &GenerateOptions,
    ) -> LlmResult<Completion> {
        let says = |marker: &str| messages.iter().any(|m| m.content.contains(marker));
        if says(self.release) {
            self.released.store(true, Ordering::SeqCst);
        }
        if says(self.hold) {
            wait_for(&self.released, &self.gave_up);
        }
        self.inner.complete(messages, options)
    }
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}

#[test]
fn sessions_encoded_ahead_leave_the_memory_a_sequential_build_makes() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = four_sessions(dir.path());
    let encoder_calls = |llm: &ScriptedLlm| {
        llm.prompts()
            .iter()
            .filter(|p| p.iter().any(|m| m.content.contains("Segment turns:")))
            .count()
    };
    // Sequentially.
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let sequential = RunSpec {
        retrieval_only: true,
        ..spec_for(
            &path,
            &dir.path().join("seq/results"),
            &dir.path().join("seq/cache"),
            &["full"],
        )
    };
    let b = backends(llm.clone(), miso_judge());
    run::run(&data, &sequential, &Config::default(), &b, &mut |_| {}).unwrap();
    let seq_calls = encoder_calls(&llm);
    // Two sessions ahead: the build's first session waits until the third session's encoder
    // call has been made, which only a session encoded ahead can make.
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let (released, gave_up) = (flag(), flag());
    let mut b = backends(llm.clone(), miso_judge());
    b.components.encode_llm = Arc::new(GatedLlm {
        inner: llm.clone(),
        hold: "zq1x",
        release: "zq3x",
        released: released.clone(),
        gave_up: gave_up.clone(),
    });
    let ahead = RunSpec {
        session_lookahead: 2,
        retrieval_only: true,
        ..spec_for(
            &path,
            &dir.path().join("ahead/results"),
            &dir.path().join("ahead/cache"),
            &["full"],
        )
    };
    let mut lines = Vec::new();
    run::run(&data, &ahead, &Config::default(), &b, &mut |l| {
        lines.push(l)
    })
    .unwrap();
    assert!(
        !gave_up.load(Ordering::SeqCst),
        "no session was encoded ahead"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("sessions encoded ahead (2 at a time)")),
        "{lines:#?}"
    );
    // Each encoder prompt reached the model once (the build replayed or joined the calls made
    // ahead), and the memory is the sequential one.
    assert_eq!(encoder_calls(&llm), seq_calls);
    let (seq, ahead_built) = (
        run::constructions(&sequential.out).unwrap(),
        run::constructions(&ahead.out).unwrap(),
    );
    let key = |c: &run::ConstructionLine| {
        let r = &c.report;
        (
            r.segments,
            r.records,
            r.encode_calls,
            r.prompt_tokens,
            r.completion_tokens,
        )
    };
    assert_eq!(key(&ahead_built[0]), key(&seq[0]));
    assert_eq!(ahead_built[0].report.encode_calls as usize, seq_calls);
    let evidence = |out: &Path| {
        let mut p = run::predictions(out).unwrap();
        p.sort_by(|a, b| a.question_id.cmp(&b.question_id));
        p.into_iter()
            .map(|p| {
                p.evidence
                    .into_iter()
                    .map(|e| (e.id, e.turns, e.score.to_bits()))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(evidence(&ahead.out), evidence(&sequential.out));
    // The scratch memory is gone.
    let left: Vec<String> = std::fs::read_dir(&ahead.cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".lookahead"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_run_over_many_items_goes_in_waves_builds_ahead_and_checkpoints_each() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = five_conversations(dir.path(), "session_2");
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let mut b = backends(llm.clone(), miso_judge());
    // The first wave's questions are planned only once the fifth conversation's memory is being
    // built: memories are built ahead, not after the wave's questions.
    let (seen, gave_up) = (flag(), flag());
    b.components.encode_llm = Arc::new(WatchingLlm {
        inner: llm.clone(),
        marker: "zq4x",
        seen: seen.clone(),
        hold: None,
    });
    b.components.plan_llm = Arc::new(WaitingPlanner {
        inner: llm.clone(),
        seen: seen.clone(),
        gave_up: gave_up.clone(),
    });
    let spec = two_jobs_retrieval_only(dir.path(), &path, &["full", "naive_rag"]);
    let mut lines = Vec::new();
    run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap();
    // Two jobs: waves of 4 items. All 5 memories are built 2 at a time, ahead of the questions;
    // the fifth item's questions are evaluated with the second wave.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("building 5 memories, 2 at a time, ahead of their questions")),
        "{lines:#?}"
    );
    assert!(seen.load(Ordering::SeqCst));
    assert!(
        !gave_up.load(Ordering::SeqCst),
        "the first wave was planned before the fifth memory was started"
    );
    for variant in ["full", "naive_rag"] {
        let file = spec
            .out
            .join("predictions")
            .join(format!("{variant}.jsonl"));
        let items: Vec<String> = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<run::Prediction>(l).unwrap().item)
            .collect();
        assert_eq!(items.len(), 10, "2 questions x 5 items");
        let fifth = items.iter().position(|i| i == "conv-4").unwrap();
        assert_eq!(fifth, 8, "the last wave's predictions come last: {items:?}");
    }
    let builds = run::constructions(&spec.out).unwrap();
    assert_eq!(builds.len(), 10, "a memory and a naive-RAG line per item");
    // Report lines lost (a run stopped between a prediction and its line) are written again by
    // the next run, which has no question left to evaluate and calls no model.
    std::fs::remove_file(spec.out.join("construction.jsonl")).unwrap();
    let calls = llm.calls();
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    assert_eq!(llm.calls(), calls);
    let again = run::constructions(&spec.out).unwrap();
    assert_eq!(again.len(), 10, "{again:#?}");
}

#[test]
fn a_wave_is_planned_while_its_memories_are_being_built() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = five_conversations(dir.path(), "session_2");
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let mut b = backends(llm.clone(), miso_judge());
    // conv-0 (first wave) cannot finish its memory until a question has been planned: a run that
    // waited for the wave's memories before planning would hold it the full 30 s.
    let (planned, gave_up) = (flag(), flag());
    b.components.encode_llm = Arc::new(WatchingLlm {
        inner: llm.clone(),
        marker: "zq0x",
        seen: flag(),
        hold: Some((planned.clone(), gave_up.clone())),
    });
    // Every call contains the empty marker: the planner notes its first call.
    b.components.plan_llm = Arc::new(WatchingLlm {
        inner: llm.clone(),
        marker: "",
        seen: planned.clone(),
        hold: None,
    });
    let spec = two_jobs_retrieval_only(dir.path(), &path, &["full"]);
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    assert!(planned.load(Ordering::SeqCst));
    assert!(
        !gave_up.load(Ordering::SeqCst),
        "conv-0's memory waited for the first wave's plans"
    );
    // The plans made early are the ones used: every question has its prediction.
    assert_eq!(run::predictions(&spec.out).unwrap().len(), 10);
}

#[test]
fn a_memory_that_fails_to_build_stops_the_run_after_the_earlier_waves_are_saved() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = five_conversations(dir.path(), "session_2");
    let b = backends(Arc::new(ScriptedLlm::pipeline("Miso")), miso_judge());
    let spec = two_jobs_retrieval_only(dir.path(), &path, &["full"]);
    // The fifth conversation's memory cannot be opened: a file is where its folder goes.
    // As the run hashes it: resolved for the test embedder (which has no calibration).
    let hash = Variant::new("full", &Config::default())
        .unwrap()
        .resolved(None)
        .construction_hash();
    let (folder, _) = construct::paths(&spec.cache, data.kind, "conv-4", &hash).unwrap();
    std::fs::create_dir_all(&spec.cache).unwrap();
    std::fs::write(&folder, "not a memory").unwrap();
    let mut lines = Vec::new();
    let err = run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap_err();
    assert!(format!("{err:#}").contains("locomo.conv-4"), "{err:#}");
    // The builder's error is shown as its own line, not only as the run's final error.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("the memory builder stopped:") && l.contains("locomo.conv-4")),
        "{lines:#?}"
    );
    // The fifth memory failed; the first wave's questions were still evaluated and saved.
    let items: BTreeSet<String> = run::predictions(&spec.out)
        .unwrap()
        .into_iter()
        .map(|p| p.item)
        .collect();
    let first_wave: BTreeSet<String> = (0..4).map(|n| format!("conv-{n}")).collect();
    assert_eq!(items, first_wave);
}

#[cfg(unix)] // the unwritable checkpoint is a dangling symlink
#[test]
fn a_run_that_fails_stops_the_memories_being_built_at_their_next_session() {
    let dir = tempfile::tempdir().unwrap();
    // conv-4's marker is in its first session; its encoding is held until the run has failed.
    let (path, data) = five_conversations(dir.path(), "session_1");
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let mut b = backends(llm.clone(), miso_judge());
    let (failed, gave_up) = (flag(), flag());
    let seen = flag();
    let plan_gave_up = flag();
    b.components.encode_llm = Arc::new(WatchingLlm {
        inner: llm.clone(),
        marker: "zq4x",
        seen: seen.clone(),
        hold: Some((failed.clone(), gave_up.clone())),
    });
    // The first wave is planned (and then fails) once conv-4's build is under way.
    b.components.plan_llm = Arc::new(WaitingPlanner {
        inner: llm.clone(),
        seen,
        gave_up: plan_gave_up.clone(),
    });
    let spec = two_jobs_retrieval_only(dir.path(), &path, &["full"]);
    // The first wave's predictions cannot be saved: their file is a link into a folder that
    // does not exist (read, it is a checkpoint not yet written; opened for writing, an error).
    std::fs::create_dir_all(spec.out.join("predictions")).unwrap();
    std::os::unix::fs::symlink(
        dir.path().join("no-such-folder").join("full.jsonl"),
        spec.out.join("predictions").join("full.jsonl"),
    )
    .unwrap();
    let mut lines = Vec::new();
    let err = run::run(&data, &spec, &Config::default(), &b, &mut |l| {
        if l.starts_with("stopping:") {
            failed.store(true, Ordering::SeqCst);
        }
        lines.push(l);
    })
    .unwrap_err();
    assert!(format!("{err:#}").contains("full.jsonl"), "{err:#}");
    assert!(!plan_gave_up.load(Ordering::SeqCst));
    assert!(
        !gave_up.load(Ordering::SeqCst),
        "the run did not say it was stopping while conv-4 was being built: {lines:#?}"
    );
    // conv-4 finished the session in progress (its line is reported after the stop) and built
    // no more: it is not complete, and a later run continues it.
    let stop = lines
        .iter()
        .position(|l| l.starts_with("stopping:"))
        .unwrap();
    assert!(
        lines[stop..]
            .iter()
            .any(|l| l.starts_with("construct conv-4") && l.contains("session 1/2")),
        "{lines:#?}"
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("conv-4") && l.contains("session 2/2"))
    );
    // As the run hashes it: resolved for the test embedder (which has no calibration).
    let hash = Variant::new("full", &Config::default())
        .unwrap()
        .resolved(None)
        .construction_hash();
    let conv4 = data.items.iter().find(|i| i.id == "conv-4").unwrap();
    assert!(!construct::is_built(&spec.cache, data.kind, conv4, &hash));
    let conv0 = data.items.iter().find(|i| i.id == "conv-0").unwrap();
    assert!(construct::is_built(&spec.cache, data.kind, conv0, &hash));
}

#[test]
fn a_rebuilt_memory_replays_the_logged_encoder_calls() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let b = backends(llm.clone(), miso_judge());
    let cache = dir.path().join("cache");
    let mut spec = spec_for(
        &dir.path().join("locomo_tiny.json"),
        &dir.path().join("results"),
        &cache,
        &["full"],
    );
    spec.retrieval_only = true;
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    let first = run::constructions(&spec.out).unwrap()[0].report.clone();
    assert!(first.encode_calls >= 1);
    let log = std::fs::read_to_string(cache.join("encode-calls.jsonl")).unwrap();
    assert_eq!(log.lines().count() as u64, first.encode_calls);
    // Throw the memory away (as a fix after the LLM step would) and build it again.
    for entry in std::fs::read_dir(&cache).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else if !path.to_string_lossy().ends_with(".jsonl") {
            std::fs::remove_file(&path).unwrap();
        }
    }
    let calls = llm.calls();
    let mut lines = Vec::new();
    let spec2 = RunSpec {
        out: dir.path().join("results2"),
        ..spec.clone()
    };
    run::run(&data, &spec2, &Config::default(), &b, &mut |l| {
        lines.push(l)
    })
    .unwrap();
    assert_eq!(llm.calls(), calls, "no call made twice: {lines:#?}");
    let again = run::constructions(&spec2.out).unwrap()[0].report.clone();
    assert_eq!(
        (
            again.encode_calls,
            again.prompt_tokens,
            again.completion_tokens,
            again.records
        ),
        (
            first.encode_calls,
            first.prompt_tokens,
            first.completion_tokens,
            first.records
        ),
        "the same construction, at the same token cost"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("0 made, {} replayed", first.encode_calls))),
        "{lines:#?}"
    );
    // The second results folder keeps the calls it replayed from the cache.
    let kept = std::fs::read_to_string(spec2.out.join(run::ENCODER_CALLS)).unwrap();
    assert_eq!(kept.lines().count() as u64, first.encode_calls);
}

#[test]
fn a_stopped_run_continues_on_another_machine_from_its_results_folder() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let b = backends(llm.clone(), miso_judge());
    let mut spec = spec_for(
        &dir.path().join("locomo_tiny.json"),
        &dir.path().join("results"),
        &dir.path().join("cache"),
        &["full"],
    );
    spec.retrieval_only = true;
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    let first = run::constructions(&spec.out).unwrap()[0].report.clone();
    let preds = |out: &std::path::Path| {
        run::predictions(out)
            .unwrap()
            .into_iter()
            .map(|p| (p.question_id, serde_json::to_string(&p.evidence).unwrap()))
            .collect::<std::collections::BTreeSet<_>>()
    };
    let first_preds = preds(&spec.out);
    assert!(!first_preds.is_empty());
    // Another machine: no cache; the results folder as committed, its predictions and memory
    // reports gone (as if the run had stopped before making them).
    std::fs::remove_dir_all(&spec.cache).unwrap();
    std::fs::remove_dir_all(spec.out.join("predictions")).unwrap();
    std::fs::remove_file(spec.out.join("construction.jsonl")).unwrap();
    let calls = llm.calls();
    let mut lines = Vec::new();
    run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap();
    assert_eq!(
        llm.calls(),
        calls,
        "no encoder or planner call made: {lines:#?}"
    );
    let again = run::constructions(&spec.out).unwrap()[0].report.clone();
    assert_eq!(
        (again.encode_calls, again.prompt_tokens, again.records),
        (first.encode_calls, first.prompt_tokens, first.records)
    );
    assert_eq!(preds(&spec.out), first_preds);
    // Nothing was logged twice in the results folder.
    let kept = std::fs::read_to_string(spec.out.join(run::ENCODER_CALLS)).unwrap();
    assert_eq!(kept.lines().count() as u64, first.encode_calls);
}

#[test]
fn a_report_lists_every_run_recorded_in_its_folder() {
    use lycheemem_bench::report::{latest_run, record_run, runs};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    let run = |command: &str, hash: &str| RunMeta {
        command: command.into(),
        commit: "abc1234".into(),
        dataset: "locomo_tiny.json".into(),
        config_hashes: [("full".to_string(), hash.to_string())].into(),
        ..Default::default()
    };
    let first = run("lycheemem-bench run --items conv-1", "h1");
    let second = run("lycheemem-bench run --items conv-2", "h1");
    assert!(latest_run(&out).is_err(), "nothing recorded yet");
    record_run(&out, &first).unwrap();
    record_run(&out, &second).unwrap();
    // Killed before writing its reports: the run log still says which run was the latest.
    assert_eq!(latest_run(&out).unwrap().command, second.command);
    let md = write_reports(&out, &second).unwrap();
    assert!(
        md.contains("- latest command: `lycheemem-bench run --items conv-2`"),
        "{md}"
    );
    assert!(md.contains("## Runs recorded in this folder"), "{md}");
    assert!(
        md.contains("| full (h1) | `lycheemem-bench run --items conv-1` |"),
        "{md}"
    );
    assert!(!md.contains("config hashes"), "{md}");
    // A later run of the same variant under another configuration is called out.
    let third = run("lycheemem-bench run --items conv-3 | tee log", "h2");
    record_run(&out, &third).unwrap();
    let md = write_reports(&out, &third).unwrap();
    assert!(
        md.contains("`full` ran under 2 config hashes (h1, h2)"),
        "{md}"
    );
    assert!(
        md.contains("conv-3 \\| tee log"),
        "a pipe cannot break the table: {md}"
    );
    assert_eq!(runs(&out).unwrap().len(), 3);
    // Regenerating the report (`bench report`) records nothing new.
    write_reports(&out, &latest_run(&out).unwrap()).unwrap();
    assert_eq!(runs(&out).unwrap().len(), 3);
    // A run killed after an earlier one wrote `run.json` is still the latest one.
    let fourth = run("lycheemem-bench run --items conv-4", "h2");
    record_run(&out, &fourth).unwrap();
    assert_eq!(latest_run(&out).unwrap().command, fourth.command);
    let md = write_reports(&out, &latest_run(&out).unwrap()).unwrap();
    assert!(
        md.contains("- latest command: `lycheemem-bench run --items conv-4`"),
        "{md}"
    );
}

/// LiCoMemory's calls answered from their prompts: a fixed summary; per dialogue line the
/// speaker (a person) mentions each other capitalized word (a concept); a question's
/// capitalized words as its entities; "Miso" for everything else (the answer).
fn licomemory_llm() -> Arc<ScriptedLlm> {
    fn capitalized(text: &str) -> Vec<String> {
        text.split(|c: char| !c.is_alphabetic())
            .filter(|w| w.len() >= 3 && w.chars().next().is_some_and(char::is_uppercase))
            .map(str::to_string)
            .collect()
    }
    Arc::new(ScriptedLlm::responding(|m| {
        let system = m.first().map_or("", |m| m.content.as_str());
        let user = m.last().map_or("", |m| m.content.as_str());
        if system.starts_with("You write the summary") || system.starts_with("You keep the summary")
        {
            return r#"{"keys": ["pets", "sports"], "themes": [{"theme": "Talk", "summary": "They talked."}]}"#.into();
        }
        if system.starts_with("You extract a knowledge graph") {
            let input: serde_json::Value = serde_json::from_str(user).unwrap();
            let (mut entities, mut relations) = (Vec::new(), Vec::new());
            for line in input["text"].as_str().unwrap().lines() {
                let (who, said) = line.split_once(": ").unwrap();
                entities.push(serde_json::json!({"name": who, "type": "person"}));
                for w in capitalized(said).into_iter().filter(|w| w != who) {
                    entities.push(serde_json::json!({"name": w, "type": "concept"}));
                    relations.push(serde_json::json!({"source": who, "target": w, "relation": "mentions", "strength": 5}));
                }
            }
            return serde_json::json!({"entities": entities, "relations": relations}).to_string();
        }
        if system.starts_with("You list the entities") {
            let question = user.split("Question: ").nth(1).unwrap_or("");
            let entities: Vec<_> = capitalized(question)
                .into_iter()
                .map(|w| serde_json::json!({"name": w, "type": "person"}))
                .collect();
            return serde_json::json!({ "entities": entities }).to_string();
        }
        "Miso".into()
    }))
}

#[test]
fn licomemory_variants_build_their_graphs_and_retrieve_the_evidence_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = licomemory_llm();
    let spec = spec_for(
        &dir.path().join("locomo_tiny.json"),
        &dir.path().join("results"),
        &dir.path().join("cache"),
        &["licomemory", "licomemory_no_decay", "licomemory_simple"],
    );
    let b = backends(llm.clone(), miso_judge());
    let mut lines = Vec::new();
    run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap();
    let preds = run::predictions(&spec.out).unwrap();
    assert_eq!(preds.len(), 6, "{lines:#?}");
    for p in &preds {
        assert_eq!(p.prediction.as_deref(), Some("Miso"), "{p:?}");
        // Two turns a chunk: Ann's cat is in the first chunk, Bob's Berlin in the second and
        // in session 2's only one.
        assert_eq!(p.recall, Some(1.0), "{p:?}");
        assert!(p.plan_tokens > 0 && p.context_tokens > 0, "{p:?}");
        assert_eq!(p.judge_correct, Some(p.question_id == "conv-x-q1"), "{p:?}");
    }
    // Two memories: the ranking ablation shares the paper method's. Three chunks: two calls
    // each, or one each plus one summary per session (authors' shipped settings).
    let builds = run::constructions(&spec.out).unwrap();
    let memories: BTreeSet<(String, u64)> = builds
        .iter()
        .map(|b| (b.report.hash.clone(), b.report.encode_calls))
        .collect();
    let mut calls: Vec<u64> = memories.iter().map(|m| m.1).collect();
    calls.sort_unstable();
    assert_eq!(calls, [5, 6], "{builds:#?}");
    // `--top-k` bounds LiCoMemory's chunks as it bounds every variant's evidence items (the
    // memories are reused from the cache).
    let mut one = spec.clone();
    one.top_k = 1;
    one.out = dir.path().join("results-k1");
    run::run(&data, &one, &Config::default(), &b, &mut |_| {}).unwrap();
    let preds = run::predictions(&one.out).unwrap();
    assert_eq!(preds.len(), 6);
    assert!(preds.iter().all(|p| p.evidence.len() == 1), "{preds:#?}");
}

/// A `python` for the peer variants that runs the test's stand-in peer (`fixtures/fake_peer.py`)
/// instead of the real driver.
fn fake_peer_python(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = lycheemem_testkit::manifest_dir().join("tests/fixtures/fake_peer.py");
    let python = dir.join("fake-venv/bin/python");
    std::fs::create_dir_all(python.parent().unwrap()).unwrap();
    std::fs::write(
        &python,
        format!("#!/bin/sh\nexec python3 {} \"$@\"\n", script.display()),
    )
    .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    python
}

/// The tiny LoCoMo file, an LLM answering the stand-in peer's extraction prompt and the
/// questions, and a run of `variants` on the stand-in peer (k = 2).
fn peer_run(
    dir: &Path,
    variants: &[&str],
    jobs: usize,
) -> (dataset::Dataset, Arc<ScriptedLlm>, Backends, RunSpec) {
    let data = dataset::load(&locomo_file(dir)).unwrap();
    let llm = Arc::new(ScriptedLlm::responding(|m| {
        let user = m.last().map_or("", |m| m.content.as_str());
        if user.starts_with("Extract memories") {
            r#"{"memory": []}"#.into()
        } else {
            "Miso".into()
        }
    }));
    let b = backends(llm.clone(), miso_judge());
    let spec = RunSpec {
        top_k: 2,
        jobs,
        peer_python: Some(fake_peer_python(dir)),
        ..spec_for(
            &dir.join("locomo_tiny.json"),
            &dir.join("results"),
            &dir.join("cache"),
            variants,
        )
    };
    (data, llm, b, spec)
}

#[test]
fn peer_builds_run_side_by_side_and_report_in_variant_order() {
    let dir = tempfile::tempdir().unwrap();
    // Both peer variants on the stand-in peer, two builds at once.
    let (data, _llm, b, spec) = peer_run(dir.path(), &["amem", "mem0"], 2);
    let mut lines = Vec::new();
    run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l)).unwrap();
    let built = run::constructions(&spec.out).unwrap();
    let names: Vec<&str> = built.iter().map(|c| c.variant.as_str()).collect();
    assert_eq!(names, ["amem", "mem0"], "{lines:#?}");
    for c in &built {
        assert_eq!(
            (c.report.exchanges, c.report.records),
            (3, 3),
            "{}",
            c.variant
        );
        assert_eq!(
            c.report.encode_calls, 3,
            "every call is metered, replayed or not"
        );
    }
    assert_ne!(
        built[0].report.hash, built[1].report.hash,
        "separate stores"
    );
    assert_eq!(run::predictions(&spec.out).unwrap().len(), 4);
}

#[test]
fn peer_builds_of_later_waves_start_while_the_first_wave_builds() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = five_conversations(dir.path(), "session_2");
    let (_, _llm, b, spec) = peer_run(dir.path(), &["mem0"], 2);
    let spec = RunSpec {
        dataset: path,
        ..spec
    };
    // Two jobs: waves of 4 items. The stand-in peer's build of conv-0 (wave 1) waits until the
    // build of conv-4 (wave 2) has started, which only a builder working across waves does.
    std::fs::create_dir_all(spec.cache.join("peers")).unwrap();
    std::fs::write(spec.cache.join("peers/hold-mem0"), "").unwrap();
    let mut lines = Vec::new();
    let outcome = run::run(&data, &spec, &Config::default(), &b, &mut |l| lines.push(l));
    assert!(outcome.is_ok(), "{outcome:?}: {lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("building 5 memories, 2 at a time, ahead of their questions")),
        "{lines:#?}"
    );
    let built = run::constructions(&spec.out).unwrap();
    let items: Vec<&str> = built.iter().map(|c| c.report.item.as_str()).collect();
    assert_eq!(items, ["conv-0", "conv-1", "conv-2", "conv-3", "conv-4"]);
    let predicted: Vec<String> = run::predictions(&spec.out)
        .unwrap()
        .into_iter()
        .map(|p| p.item)
        .collect();
    assert_eq!(predicted.len(), 10, "2 questions x 5 items");
    assert_eq!(predicted[8..], ["conv-4", "conv-4"], "{predicted:?}");
}

#[test]
fn a_failed_peer_build_stops_the_run_but_the_finished_one_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (data, _llm, b, spec) = peer_run(dir.path(), &["amem", "mem0"], 2);
    std::fs::create_dir_all(spec.cache.join("peers")).unwrap();
    std::fs::write(spec.cache.join("peers/fail-amem"), "").unwrap();
    let err = run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap_err();
    assert!(
        format!("{err:#}").contains("failing as the test asked"),
        "{err:#}"
    );
    let built = run::constructions(&spec.out).unwrap();
    let names: Vec<&str> = built.iter().map(|c| c.variant.as_str()).collect();
    assert_eq!(names, ["mem0"]);
    assert!(run::predictions(&spec.out).unwrap().is_empty());
    // Once the failure is gone, a rerun reuses mem0's build and makes amem's.
    std::fs::remove_file(spec.cache.join("peers/fail-amem")).unwrap();
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    let built = run::constructions(&spec.out).unwrap();
    let names: Vec<&str> = built.iter().map(|c| c.variant.as_str()).collect();
    assert_eq!(names, ["mem0", "amem"]);
    assert_eq!(run::predictions(&spec.out).unwrap().len(), 4);
}

/// A judge that fails once `started` exists (a peer build of a later wave has begun).
struct JudgeFailingOnce {
    started: std::path::PathBuf,
}

impl Llm for JudgeFailingOnce {
    fn complete(&self, _: &[ChatMessage], _: &GenerateOptions) -> LlmResult<Completion> {
        let begun = std::time::Instant::now();
        while !self.started.exists() && begun.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Err(lycheemem_core::Error::Model(
            "the judge failed as the test asked".into(),
        ))
    }
    fn model_id(&self) -> &str {
        "failing-judge"
    }
    fn context_length(&self) -> Option<usize> {
        None
    }
}

/// A run that stops (here: judging wave 1 failed) ends the peer builds still in progress
/// instead of waiting for them (they resume from their checkpoints).
#[test]
fn a_stopped_run_ends_the_peer_builds_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = five_conversations(dir.path(), "session_2");
    let (_, _llm, mut b, spec) = peer_run(dir.path(), &["mem0"], 2);
    let spec = RunSpec {
        dataset: path,
        ..spec
    };
    // Two jobs: waves of 4 items; the build of conv-4 (wave 2) hangs, and the judge of wave 1
    // fails once it has started.
    let peers = spec.cache.join("peers");
    std::fs::create_dir_all(&peers).unwrap();
    std::fs::write(peers.join("hang-mem0-conv-4"), "").unwrap();
    b.judge = Some(Arc::new(JudgeFailingOnce {
        started: peers.join("started-mem0-conv-4"),
    }));
    let err = run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap_err();
    assert!(
        format!("{err:#}").contains("the judge failed as the test asked"),
        "{err:#}"
    );
    assert!(
        peers.join("started-mem0-conv-4").exists(),
        "conv-4's build had started"
    );
    // The stand-in would leave this file had it run its 60 s out.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        !peers.join("survived-mem0").exists(),
        "the hung build was waited for, not ended"
    );
}

#[test]
fn a_peer_variant_is_fed_through_the_endpoint_metered_cached_and_judged() {
    let dir = tempfile::tempdir().unwrap();
    let (data, llm, b, spec) = peer_run(dir.path(), &["mem0"], 1);
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    // Three exchanges (two in session 1, one in session 2): one extraction call each, then one
    // answer per question (2); the judge is a separate model.
    assert_eq!(llm.calls(), 5);
    let built = run::constructions(&spec.out).unwrap();
    assert_eq!(built.len(), 1);
    let report = &built[0].report;
    assert_eq!(built[0].variant, "mem0");
    assert_eq!(
        (report.exchanges, report.records, report.encode_calls),
        (3, 3, 3)
    );
    assert!(report.prompt_tokens > 0 && report.completion_tokens > 0);
    assert_eq!(report.seconds, 1.5, "the driver's build time is kept");
    let predictions = run::predictions(&spec.out).unwrap();
    assert_eq!(predictions.len(), 2);
    for p in &predictions {
        assert_eq!(p.evidence.len(), 2, "top k = 2 memories");
        assert!(p.evidence.iter().all(|e| e.id.starts_with("record:s")));
        assert!(p.recall.is_some());
        assert_eq!(p.plan_tokens, 0, "searching made no LLM call");
        assert!(p.answer_tokens > 0);
    }
    let cat = predictions
        .iter()
        .find(|p| p.category == "single_hop")
        .unwrap();
    assert_eq!(cat.judge_correct, Some(true));
    // Evidence recall is exact: every retrieved memory names its exchange's turns.
    for p in &predictions {
        let retrieved: BTreeSet<(String, u32)> = p
            .evidence
            .iter()
            .flat_map(|e| e.turns.iter().map(|&t| (e.session.clone(), t)))
            .collect();
        assert!(retrieved.len() >= 2, "{retrieved:?}");
    }
    // A second run in a fresh results folder reuses the peer's build: no extraction call, and
    // the construction report still counts the whole build.
    let again = RunSpec {
        out: dir.path().join("results2"),
        ..spec.clone()
    };
    let before = llm.calls();
    run::run(&data, &again, &Config::default(), &b, &mut |_| {}).unwrap();
    assert_eq!(llm.calls() - before, 2, "answers only");
    let rebuilt = run::constructions(&again.out).unwrap();
    assert_eq!(rebuilt[0].report.tokens(), report.tokens());
    assert_eq!(rebuilt[0].report.seconds, report.seconds);
    // The peer's calls are logged in the results folder; a build redone from nothing (its
    // state deleted) replays them instead of calling the model, with the same token counts.
    let logged = std::fs::read_to_string(spec.out.join(run::PEER_CALLS)).unwrap();
    assert_eq!(logged.lines().count(), 3);
    std::fs::remove_dir_all(spec.cache.join("peers")).unwrap();
    let redone = RunSpec {
        out: dir.path().join("results3"),
        ..spec.clone()
    };
    let before = llm.calls();
    run::run(&data, &redone, &Config::default(), &b, &mut |_| {}).unwrap();
    assert_eq!(
        llm.calls() - before,
        2,
        "answers only: the extraction calls were replayed"
    );
    let replayed = run::constructions(&redone.out).unwrap();
    assert_eq!(replayed[0].report.tokens(), report.tokens());
    assert_eq!(replayed[0].report.records, 3);
}

#[test]
fn a_peer_build_stopped_in_a_unit_and_resumed_costs_what_an_unstopped_build_costs() {
    let dir = tempfile::tempdir().unwrap();
    let (data, llm, b, spec) = peer_run(dir.path(), &["mem0"], 1);
    // The stand-in peer stops in its second unit, after that unit's call.
    std::fs::create_dir_all(spec.cache.join("peers")).unwrap();
    std::fs::write(spec.cache.join("peers/stop-mem0"), "").unwrap();
    let err = run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap_err();
    assert!(format!("{err:#}").contains("stopped in a unit"), "{err:#}");
    assert_eq!(llm.calls(), 2);
    // Resumed, it adds the other two units (the cut-short unit's call is replayed).
    run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap();
    let resumed = run::constructions(&spec.out).unwrap()[0].report.clone();
    // The same build made in one go, in a fresh cache and results folder.
    let fresh = RunSpec {
        out: dir.path().join("results-fresh"),
        cache: dir.path().join("cache-fresh"),
        ..spec.clone()
    };
    run::run(&data, &fresh, &Config::default(), &b, &mut |_| {}).unwrap();
    let whole = run::constructions(&fresh.out).unwrap()[0].report.clone();
    assert_eq!(whole.encode_calls, 3);
    assert_eq!(
        (
            resumed.encode_calls,
            resumed.prompt_tokens,
            resumed.completion_tokens,
            resumed.seconds,
            resumed.records
        ),
        (
            whole.encode_calls,
            whole.prompt_tokens,
            whole.completion_tokens,
            whole.seconds,
            whole.records
        ),
        "the units finished before the stop are counted, the cut-short one once"
    );
}

#[test]
fn a_peer_variant_without_its_venv_says_how_to_make_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset::load(&locomo_file(dir.path())).unwrap();
    let llm = Arc::new(ScriptedLlm::pipeline("Miso"));
    let b = backends(llm.clone(), miso_judge());
    let spec = RunSpec {
        peer_python: Some(dir.path().join("no-venv/bin/python")),
        ..spec_for(
            &dir.path().join("locomo_tiny.json"),
            &dir.path().join("results"),
            &dir.path().join("cache"),
            &["mem0"],
        )
    };
    let e = run::run(&data, &spec, &Config::default(), &b, &mut |_| {}).unwrap_err();
    assert!(format!("{e:#}").contains("cargo xtask peer-venv"), "{e:#}");
    assert_eq!(llm.calls(), 0);
}
