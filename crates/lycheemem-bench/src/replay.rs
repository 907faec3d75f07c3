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
//! A replayed completion carries the token counts and latency of the call that produced it, so
//! construction tokens (SPEC §6) are the same whether or not a call was replayed; the number of
//! replayed calls is reported, since they make wall time shorter.

use lycheemem_core::{Error, Result};
use lycheemem_llm::{ChatMessage, Completion, GenerateOptions, Llm};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    file: Mutex<()>,
    replayed: AtomicU64,
    made: AtomicU64,
}

impl ReplayLlm {
    /// Wraps `inner`, loading the calls already logged in `path` (created on first append). A
    /// line cut short by a kill is skipped (that call is simply made again).
    pub fn open(inner: Arc<dyn Llm>, path: &Path) -> Result<ReplayLlm> {
        Self::open_logs(inner, path, None)
    }

    /// Wraps `inner` with two logs: calls logged in either are replayed; `path` receives every
    /// call answered that it lacks (made or replayed from `shared`), `shared` the calls made.
    pub fn with_shared_log(inner: Arc<dyn Llm>, path: &Path, shared: &Path) -> Result<ReplayLlm> {
        Self::open_logs(inner, path, Some(shared))
    }

    fn open_logs(inner: Arc<dyn Llm>, path: &Path, shared: Option<&Path>) -> Result<ReplayLlm> {
        let mut answers = HashMap::new();
        for (log, own) in shared.map(|s| (s, false)).into_iter().chain([(path, true)]) {
            for e in read_log(log)? {
                answers.insert(e.key, (e.completion, own));
            }
        }
        Ok(ReplayLlm {
            inner,
            path: path.to_path_buf(),
            shared: shared.map(Path::to_path_buf),
            answers: Mutex::new(answers),
            file: Mutex::new(()),
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

    fn append(&self, path: &Path, entry: &Entry) -> Result<()> {
        let _guard = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let io = |e: std::io::Error| Error::Store(format!("writing {}: {e}", path.display()));
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let mut line = serde_json::to_vec(entry).map_err(|e| Error::Store(e.to_string()))?;
        line.push(b'\n');
        f.write_all(&line).map_err(io)?;
        f.sync_data().map_err(io)
    }
}

/// The entries of a log (none when it does not exist). A line cut short by a kill is skipped.
fn read_log(path: &Path) -> Result<Vec<Entry>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(bytes
            .split(|b| *b == b'\n')
            .filter_map(|line| serde_json::from_slice::<Entry>(line).ok())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::Store(format!("reading {}: {e}", path.display()))),
    }
}

impl Llm for ReplayLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        let key = self.key(messages, options);
        let logged = self
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        if let Some((completion, in_own_log)) = logged {
            if !in_own_log {
                // Copied into this log outside the lock (two threads replaying the same call
                // may both copy it; the log is read by key, so that is harmless).
                let entry = Entry {
                    key,
                    completion: completion.clone(),
                };
                self.append(&self.path, &entry)?;
                if let Some(a) = self
                    .answers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_mut(&entry.key)
                {
                    a.1 = true;
                }
            }
            self.replayed.fetch_add(1, Ordering::Relaxed);
            return Ok(completion);
        }
        let completion = self.inner.complete(messages, options)?;
        self.made.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            key,
            completion: completion.clone(),
        };
        self.append(&self.path, &entry)?;
        if let Some(shared) = &self.shared {
            self.append(shared, &entry)?;
        }
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.key, (entry.completion, true));
        Ok(completion)
    }

    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}
