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
    path: PathBuf,
    answers: Mutex<HashMap<String, Completion>>,
    file: Mutex<()>,
    replayed: AtomicU64,
    made: AtomicU64,
}

impl ReplayLlm {
    /// Wraps `inner`, loading the calls already logged in `path` (created on first append). A
    /// line cut short by a kill is skipped (that call is simply made again).
    pub fn open(inner: Arc<dyn Llm>, path: &Path) -> Result<ReplayLlm> {
        let mut answers = HashMap::new();
        match std::fs::read(path) {
            Ok(bytes) => {
                for line in bytes.split(|b| *b == b'\n') {
                    if let Ok(e) = serde_json::from_slice::<Entry>(line) {
                        answers.insert(e.key, e.completion);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::Store(format!("reading {}: {e}", path.display()))),
        }
        Ok(ReplayLlm {
            inner,
            path: path.to_path_buf(),
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

    fn append(&self, entry: &Entry) -> Result<()> {
        let _guard = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let io = |e: std::io::Error| Error::Store(format!("writing {}: {e}", self.path.display()));
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        let mut line = serde_json::to_vec(entry).map_err(|e| Error::Store(e.to_string()))?;
        line.push(b'\n');
        f.write_all(&line).map_err(io)?;
        f.sync_data().map_err(io)
    }
}

impl Llm for ReplayLlm {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        let key = self.key(messages, options);
        if let Some(c) = self
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            self.replayed.fetch_add(1, Ordering::Relaxed);
            return Ok(c.clone());
        }
        let completion = self.inner.complete(messages, options)?;
        self.made.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            key,
            completion: completion.clone(),
        };
        self.append(&entry)?;
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.key, entry.completion);
        Ok(completion)
    }

    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}
