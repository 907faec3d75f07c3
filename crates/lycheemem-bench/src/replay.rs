//! A log of the encoder's LLM calls, so that rebuilding a memory never pays for a call twice.
//!
//! Building a LoCoMo conversation's memory costs an hour or more of local LLM time, and the
//! LLM's output is only the first step: segmentation comes before it, and storage, evidence
//! organization and indexing come after. When any of those later steps changes (a fix in how
//! restated records are merged, say), the memory has to be rebuilt, but the encoder's answers to
//! the same prompts have not changed. [`ReplayLlm`] wraps the encode LLM of a benchmark run:
//! a call whose model, messages and options were answered before gets that answer back from
//! `<cache>/encode-calls.jsonl`; any other call goes to the model and its answer is appended
//! (synced) before it is returned. The same log makes a killed construction lose nothing: the
//! calls of the session it was in the middle of are answered from the log when it resumes.
//!
//! A benchmark run keeps two logs ([`ReplayLlm::with_shared_log`]): the results folder's own
//! (`<out>/encoder-calls.jsonl`), which receives every call made or replayed while building a
//! memory for that folder (a finished memory opened from the cache adds nothing) and is
//! committed with the report; and the cache's, shared by every run on the machine. So a fresh
//! clone rebuilds such a report's memories without the LLM, and a construction stopped on one
//! machine continues on another.
//!
//! Identical calls made at the same time (two constructions of one item start with the same
//! segment) go to the model once: the others wait for that answer and are replayed from it, so a
//! key in the log has one answer, and a rebuilt memory gets back exactly what it was given.
//!
//! A replayed completion carries the token counts and latency of the call that produced it, so
//! construction tokens (docs/algorithm.md, "Cost and token accounting") are the same whether or not a call was replayed; the number of
//! replayed calls is reported, since they make wall time shorter.

use lycheemem_core::{Error, Result};
use lycheemem_llm::{ChatMessage, Completion, GenerateOptions, Llm};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// One answered call in the log.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    key: String,
    completion: Completion,
}

/// An [`Llm`] that answers calls it has logged before from the log, and logs every other call.
pub struct ReplayLlm {
    inner: Arc<dyn Llm>,
    /// The log every answered call ends up in.
    path: PathBuf,
    /// A second log, read too, that receives the calls made (not those replayed).
    shared: Option<PathBuf>,
    /// Answers by key, and whether `path` holds them already.
    answers: Mutex<HashMap<String, (Completion, bool)>>,
    /// Keys of the calls now with the model; a caller of the same key waits on `answered`.
    in_flight: Mutex<HashSet<String>>,
    answered: Condvar,
    replayed: AtomicU64,
    made: AtomicU64,
}

impl ReplayLlm {
    /// Wraps `inner`, loading the calls already logged in `path` (created on first append). A
    /// line cut short by a kill is skipped (that call is simply made again); a key logged twice
    /// keeps its first answer.
    pub fn open(inner: Arc<dyn Llm>, path: &Path) -> Result<ReplayLlm> {
        Self::open_logs(inner, path, None)
    }

    /// Wraps `inner` with two logs: calls logged in either are replayed; `path` receives every
    /// call answered that it lacks (made or replayed from `shared`), `shared` the calls made.
    pub fn with_shared_log(inner: Arc<dyn Llm>, path: &Path, shared: &Path) -> Result<ReplayLlm> {
        Self::open_logs(inner, path, Some(shared))
    }

    fn open_logs(inner: Arc<dyn Llm>, path: &Path, shared: Option<&Path>) -> Result<ReplayLlm> {
        let mut answers: HashMap<String, (Completion, bool)> = HashMap::new();
        // The folder's own log first: its answers are the ones its memories were built from.
        for (log, own) in [(path, true)].into_iter().chain(shared.map(|s| (s, false))) {
            for e in read_log(log)? {
                answers
                    .entry(e.key)
                    .and_modify(|a| a.1 |= own)
                    .or_insert((e.completion, own));
            }
        }
        Ok(ReplayLlm {
            inner,
            path: path.to_path_buf(),
            shared: shared.map(Path::to_path_buf),
            answers: Mutex::new(answers),
            in_flight: Mutex::new(HashSet::new()),
            answered: Condvar::new(),
            replayed: AtomicU64::new(0),
            made: AtomicU64::new(0),
        })
    }

    /// Calls answered from the log so far.
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// Calls that went to the model so far.
    pub fn made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    /// Calls in the log.
    pub fn logged(&self) -> usize {
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The log key of a call: the model, every message and every generation option.
    fn key(&self, messages: &[ChatMessage], options: &GenerateOptions) -> String {
        let src = serde_json::json!({
            "model": self.inner.model_id(),
            "messages": messages,
            "options": options,
        });
        hex::encode(Sha256::digest(src.to_string().as_bytes()))
    }

    /// Appends an answer to the own log and notes that the log holds it.
    fn log_own(&self, entry: &Entry) -> Result<()> {
        self.append(&self.path, entry)?;
        if let Some(a) = self
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&entry.key)
        {
            a.1 = true;
        }
        Ok(())
    }

    fn append(&self, path: &Path, entry: &Entry) -> Result<()> {
        // `append_line` locks the file: threads and processes appending at once stay whole.
        crate::jsonl::append_line(path, entry).map_err(|e| Error::Store(format!("{e:#}")))
    }
}

/// Marks a call as no longer with the model when dropped (answered, failed or panicked).
struct FlightGuard<'a> {
    llm: &'a ReplayLlm,
    key: &'a str,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        self.llm
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.key);
        self.llm.answered.notify_all();
    }
}

/// The entries of a log (none when it does not exist), read by the crate's one JSON Lines
/// policy (a torn last line is ignored; any other unreadable line is an error).
fn read_log(path: &Path) -> Result<Vec<Entry>> {
    crate::jsonl::read_lines(path).map_err(|e| Error::Store(format!("{e:#}")))
}

impl Llm for ReplayLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        let key = self.key(messages, options);
        let logged = loop {
            // Looked up under the in-flight lock: a call leaves `in_flight` only after its answer
            // is in `answers`, so a key found in neither is asked of the model exactly once.
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            let logged = self
                .answers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&key)
                .cloned();
            if logged.is_some() {
                break logged;
            }
            if in_flight.insert(key.clone()) {
                break None; // this caller asks the model
            }
            // The same call is with the model: wait for its answer (or its failure, after which
            // this caller asks the model itself).
            while in_flight.contains(&key) {
                in_flight = self
                    .answered
                    .wait(in_flight)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        if let Some((completion, in_own_log)) = logged {
            if !in_own_log {
                // Copied into this log outside the lock (two threads replaying the same call
                // may both copy it; the log is read by key, so that is harmless).
                self.log_own(&Entry {
                    key,
                    completion: completion.clone(),
                })?;
            }
            self.replayed.fetch_add(1, Ordering::Relaxed);
            return Ok(completion);
        }
        // Whatever happens below, the key leaves `in_flight` and waiting callers wake.
        let _flight = FlightGuard {
            llm: self,
            key: &key,
        };
        let completion = self.inner.complete(messages, options)?;
        self.made.fetch_add(1, Ordering::Relaxed);
        // Known before it is written: a failed write never sends the call to the model again
        // (a later replay copies it into the own log).
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone(), (completion.clone(), false));
        let entry = Entry {
            key: key.clone(),
            completion: completion.clone(),
        };
        self.log_own(&entry)?;
        if let Some(shared) = &self.shared {
            self.append(shared, &entry)?;
        }
        Ok(completion)
    }

    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_testkit::ScriptedLlm;
    use std::io::Write;
    use std::time::Duration;

    fn ask(llm: &ReplayLlm, prompt: &str) -> String {
        llm.complete(&[ChatMessage::user(prompt)], &GenerateOptions::default())
            .unwrap()
            .text
    }

    #[test]
    fn identical_calls_at_the_same_time_go_to_the_model_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.jsonl");
        let shared = dir.path().join("shared.jsonl");
        let n = AtomicU64::new(0);
        let inner = Arc::new(ScriptedLlm::responding(move |_| {
            std::thread::sleep(Duration::from_millis(300));
            format!("answer {}", n.fetch_add(1, Ordering::SeqCst))
        }));
        let llm = ReplayLlm::with_shared_log(inner.clone(), &path, &shared).unwrap();
        let texts: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| ask(&llm, "same"))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(inner.calls(), 1, "one call to the model");
        assert!(texts.iter().all(|t| t == "answer 0"), "{texts:?}");
        assert_eq!((llm.made(), llm.replayed()), (1, 3));
        for log in [&path, &shared] {
            assert_eq!(std::fs::read_to_string(log).unwrap().lines().count(), 1);
        }
    }

    /// Fails its first call and answers every later one; each call lasts 300 ms. Counts the
    /// calls and the most that were with it at once.
    #[derive(Default)]
    struct FailsFirst {
        calls: AtomicU64,
        running: AtomicU64,
        most_at_once: AtomicU64,
    }

    impl Llm for FailsFirst {
        fn complete(&self, _: &[ChatMessage], _: &GenerateOptions) -> Result<Completion> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_at_once.fetch_max(now, Ordering::SeqCst);
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            self.running.fetch_sub(1, Ordering::SeqCst);
            if n == 0 {
                return Err(Error::Model("the model is down".into()));
            }
            Ok(Completion {
                text: "answer".into(),
                finish_reason: lycheemem_llm::FinishReason::Stop,
                prompt_tokens: 1,
                completion_tokens: 1,
                cached_prompt_tokens: 0,
                latency_ms: 300,
                usage_estimated: false,
                model: "fails-first".into(),
            })
        }
        fn model_id(&self) -> &str {
            "fails-first"
        }
        fn context_length(&self) -> Option<usize> {
            None
        }
    }

    #[test]
    fn a_failed_call_lets_a_waiting_caller_ask_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let inner = Arc::new(FailsFirst::default());
        let llm = ReplayLlm::open(inner.clone(), &dir.path().join("calls.jsonl")).unwrap();
        let call = || llm.complete(&[ChatMessage::user("x")], &GenerateOptions::default());
        let (first, second) = std::thread::scope(|s| {
            let first = s.spawn(call);
            while inner.running.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now(); // until the first call is with the model
            }
            let second = s.spawn(call);
            (first.join().unwrap(), second.join().unwrap())
        });
        assert!(first.is_err());
        assert_eq!(
            second.unwrap().text,
            "answer",
            "the waiter asked after the failure"
        );
        assert_eq!(inner.calls.load(Ordering::SeqCst), 2);
        assert_eq!(
            inner.most_at_once.load(Ordering::SeqCst),
            1,
            "never both at once"
        );
        assert!(
            llm.in_flight.lock().unwrap().is_empty(),
            "no key left in flight"
        );
        assert_eq!(ask(&llm, "x"), "answer", "now replayed");
        assert_eq!(inner.calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_torn_last_line_neither_loses_the_next_call_nor_hides_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.jsonl");
        let inner = Arc::new(ScriptedLlm::responding(|m| format!("re {}", m[0].content)));
        let llm = ReplayLlm::open(inner.clone(), &path).unwrap();
        ask(&llm, "one");
        drop(llm);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"key\":\"abc\",\"compl").unwrap(); // killed mid-write
        drop(f);
        let llm = ReplayLlm::open(inner.clone(), &path).unwrap();
        assert_eq!(llm.logged(), 1);
        ask(&llm, "two");
        drop(llm);
        let llm = ReplayLlm::open(inner.clone(), &path).unwrap();
        assert_eq!(
            llm.logged(),
            2,
            "the call after the torn line is replayable"
        );
        assert_eq!(
            (ask(&llm, "one"), ask(&llm, "two")),
            ("re one".into(), "re two".into())
        );
        assert_eq!(inner.calls(), 2, "nothing asked twice");
        assert_eq!(llm.replayed(), 2);
    }

    #[test]
    fn a_key_logged_twice_replays_its_first_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.jsonl");
        let inner = Arc::new(ScriptedLlm::new(&["first", "second"]));
        let llm = ReplayLlm::open(inner.clone(), &path).unwrap();
        ask(&llm, "q");
        // The same key answered differently, as two unsynchronized runs could have logged it.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&text.replace("\"first\"", "\"second\""));
        std::fs::write(&path, text).unwrap();
        let llm = ReplayLlm::open(inner, &path).unwrap();
        assert_eq!(llm.logged(), 1);
        assert_eq!(ask(&llm, "q"), "first");
    }

    #[test]
    fn the_folders_own_answer_wins_over_the_caches() {
        let dir = tempfile::tempdir().unwrap();
        let (own, shared) = (
            dir.path().join("own.jsonl"),
            dir.path().join("shared.jsonl"),
        );
        let by = |reply: &str, log: &Path| {
            let llm = ReplayLlm::open(Arc::new(ScriptedLlm::new(&[reply])), log).unwrap();
            ask(&llm, "q")
        };
        by("from the folder", &own);
        by("from the cache", &shared);
        let inner = Arc::new(ScriptedLlm::new::<&str>(&[]));
        let llm = ReplayLlm::with_shared_log(inner.clone(), &own, &shared).unwrap();
        assert_eq!(ask(&llm, "q"), "from the folder");
        assert_eq!(inner.calls(), 0);
    }
}
