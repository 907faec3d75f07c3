//! [`Memory`]: one store directory plus the models, with the write path (turns → exchanges →
//! online segmentation → one encoder call per finalized segment → store) and the read path
//! (plan → recall → fusion → selection → answer).
//!
//! Ingestion is incremental and restart-safe. Raw turns (with their vectors) are committed
//! before any LLM work. Each session's ingest state — the exchange builder, exchanges waiting
//! for the segmenter, the segmenter state, and the next turn to consume — is persisted with
//! every segment it finalizes (same transaction) and after every call, so a process that dies
//! anywhere resumes exactly where the last commit left off, and ingesting a conversation in
//! pieces across restarts yields the same segments and records as one uninterrupted run.

use lycheemem_core::config::{LicoSummaryMode, SegmentPolicy};
use lycheemem_core::{Cancel, MemoryStrategy};
use lycheemem_core::{
    Config, Error, Namespace, Purpose, Result, Role, Segment, SessionId, TokenUsage, Turn,
    UsageTotals,
};
use lycheemem_encode::{SegmentEncoder, encode_segment, organize_segment};
use lycheemem_licomemory::{ChunkWriter, LicoRequest, LicoRetriever, SUMMARY_STATE};
use lycheemem_retrieve::{EvidenceItem, Retriever, SearchRequest, SearchResult};
use lycheemem_segment::{
    ExchangeBuilder, ExchangeInput, ExchangeMode, PendingExchange, Segmenter, SegmenterState,
};
use lycheemem_store::prelude::*;
use lycheemem_store::{
    DeleteReceipt, ExportOptions, ImportReceipt, ItemRef, LockGuard, LockScope, NamespaceStats,
    SegmentOutcome, SessionInfo, Store, StoreOptions,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::path::Path;
use std::sync::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::components::Components;

/// The per-session state name of the ingest pipeline.
pub const INGEST_STATE: &str = "ingest";

/// Longest accepted turn text, in characters.
pub const MAX_TURN_CHARS: usize = 200_000;

/// Longest accepted speaker name, turn time or session date, in characters (they are labels,
/// repeated in every prompt that shows their turns).
pub const MAX_LABEL_CHARS: usize = 1_000;

/// One incoming turn (its index is assigned by the memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewTurn {
    pub role: Role,
    /// Speaker name in multi-party logs; `None` in plain chat.
    #[serde(default)]
    pub speaker: Option<String>,
    pub text: String,
    /// ISO date or date-time of the turn, if known.
    #[serde(default)]
    pub time: Option<String>,
}

impl NewTurn {
    pub fn user(text: impl Into<String>) -> Self {
        NewTurn {
            role: Role::User,
            speaker: None,
            text: text.into(),
            time: None,
        }
    }

    pub fn assistant(text: impl Into<String>) -> Self {
        NewTurn {
            role: Role::Assistant,
            speaker: None,
            text: text.into(),
            time: None,
        }
    }

    /// A turn of a named speaker in a multi-party log.
    pub fn spoken(speaker: impl Into<String>, text: impl Into<String>) -> Self {
        NewTurn {
            role: Role::User,
            speaker: Some(speaker.into()),
            text: text.into(),
            time: None,
        }
    }
}

/// What an ingest or flush call did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestReceipt {
    pub turns_stored: u64,
    /// Turns given again that were already stored (an idempotent retry or re-read file).
    #[serde(default)]
    pub turns_already_stored: u64,
    pub exchanges: u64,
    pub segments: Vec<SegmentSummary>,
    pub records: u64,
    pub failed_segments: u64,
    pub encode_calls: u64,
    pub encode_tokens: u64,
}

impl IngestReceipt {
    /// Adds another receipt's counts to this one.
    pub fn merge(&mut self, other: IngestReceipt) {
        self.turns_stored += other.turns_stored;
        self.turns_already_stored += other.turns_already_stored;
        self.exchanges += other.exchanges;
        self.segments.extend(other.segments);
        self.records += other.records;
        self.failed_segments += other.failed_segments;
        self.encode_calls += other.encode_calls;
        self.encode_tokens += other.encode_tokens;
    }
}

/// Where [`Memory::append_turns`] stored a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendReceipt {
    /// Index of the first newly stored turn in its session (the session's next index when
    /// nothing was new).
    pub first_index: u32,
    /// Turns newly stored.
    pub count: u64,
    /// Turns of the batch that were already stored with the same content at their positions
    /// (a retried or repeated batch, see [`Memory::append_turns_at`]).
    #[serde(default)]
    pub already_stored: u64,
}

/// One finalized segment as reported to the caller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentSummary {
    pub segment: Segment,
    pub records: usize,
    pub failure: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct IngestState {
    builder: ExchangeBuilder,
    /// Exchanges built but not yet given to the segmenter.
    queue: VecDeque<PendingExchange>,
    segmenter: SegmenterState,
    /// The first turn not yet given to the exchange builder.
    next_turn: u32,
    /// Exchanges given to the segmenter so far.
    #[serde(default)]
    exchanges: u64,
    /// Segments the segmenter finalized that are not committed yet. One exchange can finalize
    /// several (an oversized exchange closes the open segment and becomes a segment per turn);
    /// each is committed with a state that still lists the ones after it, so a crash between
    /// two of them loses none: the next call encodes the rest first.
    #[serde(default)]
    finalized: VecDeque<Segment>,
}

/// Options of a question.
#[derive(Debug, Clone, Default)]
pub struct QueryOptions {
    /// Requested evidence count (the effective k is at least `retrieval.min_top_k`).
    pub top_k: usize,
    /// Recent dialogue for the planner.
    pub context: String,
    /// The question's reference date (ISO); relative dates resolve against it.
    pub reference_date: Option<String>,
    /// Keep the stage accounting and the candidates not chosen (`SearchResult::stages`,
    /// `dropped`; what `explain` lists as not chosen).
    pub trace: bool,
    /// Raise it to stop the question's LLM calls (e.g. when a server's client went away); the
    /// call then returns `Error::Cancelled`.
    pub cancel: lycheemem_core::Cancel,
}

/// An answer with its evidence and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub text: String,
    pub search: SearchResult,
    /// Planner and answer calls.
    pub usage: Vec<TokenUsage>,
}

impl Answer {
    pub fn evidence(&self) -> &[EvidenceItem] {
        &self.search.evidence
    }

    /// Prompt + completion tokens of the planner and answer calls.
    pub fn tokens(&self) -> u64 {
        self.usage
            .iter()
            .map(|u| u.prompt_tokens + u.completion_tokens)
            .sum()
    }
}

/// What [`Memory::rederive`] changed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RederiveReport {
    pub sessions: u64,
    pub segments: u64,
    pub records_before: u64,
    pub records_after: u64,
    /// Record texts that exist now but did not before, and the reverse.
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub ingest: IngestReceipt,
}

/// Long-term memory in one directory.
pub struct Memory {
    store: Box<dyn MemoryStore>,
    config: Config,
    components: Components,
    encoder: SegmentEncoder,
    /// LiCoMemory's write-path calls (`strategy = "licomemory"`).
    chunk_writer: ChunkWriter,
    segmenter: Segmenter,
    /// Serializes turn appends (index allocation). Locks are taken in the order of these
    /// fields: `append`, `derived`, a session's lock, `commit`.
    append: Mutex<()>,
    /// Shared by processing (any number of sessions at once), exclusive for the operations that
    /// rewrite derived data (deletes, import, rederive). Appends do not wait for it, so turns are
    /// acknowledged while a segment is being encoded.
    derived: RwLock<()>,
    /// Sessions being processed: a session's ingest state and ρ are read, advanced and written
    /// back by one caller at a time, so its segments are encoded in order. Different sessions
    /// encode concurrently (their LLM calls overlap: a local LLM decodes them together).
    busy: Mutex<HashSet<(Namespace, SessionId)>>,
    busy_freed: Condvar,
    /// Serializes organizing a segment's records into the stored nodes and committing it: the
    /// node merge is a read-modify-write of nodes that other sessions update too.
    commit: Mutex<()>,
}

/// The locks a session's processing holds (released in field order: store locks first).
struct SessionLocks<'a> {
    _store: [LockGuard; 2],
    _derived: RwLockReadGuard<'a, ()>,
    _session: SessionGuard<'a>,
}

/// The locks of an operation that rewrites a namespace's derived data.
struct ExclusiveLocks<'a> {
    _store: LockGuard,
    _derived: RwLockWriteGuard<'a, ()>,
    _append: std::sync::MutexGuard<'a, ()>,
}

/// A session's processing lock: the session is in `Memory::busy` while this lives.
struct SessionGuard<'a> {
    memory: &'a Memory,
    key: (Namespace, SessionId),
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let mut busy = self.memory.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.remove(&self.key);
        self.memory.busy_freed.notify_all();
    }
}

impl Memory {
    /// Opens (or creates) the memory in `dir` with the models named in `config.models`, fetching
    /// missing manifest models into `models_dir`.
    pub fn open(dir: impl AsRef<Path>, config: Config, models_dir: &Path) -> Result<Memory> {
        let components = Components::from_config(&config, models_dir, &mut |_| {})?;
        Memory::with_components(dir, config, components)
    }

    /// Opens the memory in `dir` with explicitly supplied backends.
    pub fn with_components(
        dir: impl AsRef<Path>,
        config: Config,
        components: Components,
    ) -> Result<Memory> {
        let store = open_backend(dir.as_ref(), &config, components.embedder.dimension())?;
        Memory::with_store(store, config, components)
    }

    /// A memory over any storage backend (see [`lycheemem_store::MemoryStore`]); its vectors
    /// must have the embedder's dimension.
    pub fn with_store(
        store: Box<dyn MemoryStore>,
        config: Config,
        components: Components,
    ) -> Result<Memory> {
        check_strategy(store.as_ref(), config.strategy)?;
        let encoder = SegmentEncoder::new(components.encode_llm.clone(), config.encode.clone());
        let chunk_writer =
            ChunkWriter::new(components.encode_llm.clone(), config.licomemory.clone());
        let mut segment = config
            .segment
            .resolved(components.embedder.segment_calibration().as_ref());
        if config.strategy == MemoryStrategy::Licomemory {
            // LiCoMemory's chunk is one exchange (two consecutive turns of a two-speaker log),
            // whatever its length: never split at turn boundaries.
            segment.policy = SegmentPolicy::PerExchange;
            segment.max_tokens = u32::MAX;
        }
        let segmenter = Segmenter::new(segment);
        Ok(Memory {
            store,
            config,
            components,
            encoder,
            chunk_writer,
            segmenter,
            append: Mutex::new(()),
            derived: RwLock::new(()),
            busy: Mutex::new(HashSet::new()),
            busy_freed: Condvar::new(),
            commit: Mutex::new(()),
        })
    }

    /// Opens only the storage of an existing memory in `dir` (no models): for reading,
    /// exporting or deleting without loading an embedder or an LLM. The vector dimension is the
    /// one the store was created with. [`Error::NotFound`] when `dir` holds no memory.
    pub fn open_store(dir: impl AsRef<Path>, config: &Config) -> Result<Box<dyn MemoryStore>> {
        let dir = dir.as_ref();
        if !store_exists(dir, config)? {
            return Err(Error::NotFound(format!("no store at {}", dir.display())));
        }
        // Dimension 0: whatever the store was created with.
        open_backend(dir, config, 0)
    }

    pub fn store(&self) -> &dyn MemoryStore {
        self.store.as_ref()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Embeds texts in one batch (none for an empty list).
    fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.components.embedder.embed(&refs)
    }

    /// Shared access to derived data plus the session's processing lock, in this process and
    /// (for a store that several processes share) in the store.
    fn lock_session(&self, ns: &Namespace, session: &SessionId) -> Result<SessionLocks<'_>> {
        let key = (ns.clone(), session.clone());
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while busy.contains(&key) {
            busy = self
                .busy_freed
                .wait(busy)
                .unwrap_or_else(|p| p.into_inner());
        }
        busy.insert(key.clone());
        drop(busy);
        let guard = SessionGuard { memory: self, key };
        // Taken after the session's mark: a caller waiting for a busy session holds no read
        // lock, so it cannot keep a delete (and the appends queued behind it) waiting.
        let derived = self.derived.read().unwrap_or_else(|p| p.into_inner());
        let store_derived = self.store.lock(LockScope::Derived {
            ns,
            exclusive: false,
        })?;
        let store_session = self.store.lock(LockScope::Session(ns, session))?;
        Ok(SessionLocks {
            _store: [store_session, store_derived],
            _derived: derived,
            _session: guard,
        })
    }

    fn lock_append(&self) -> std::sync::MutexGuard<'_, ()> {
        self.append.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends and processing excluded, for operations that rewrite turns or derived data of a
    /// namespace (in the store: its derived data, exclusively).
    fn lock_all(&self, ns: &Namespace) -> Result<ExclusiveLocks<'_>> {
        let append = self.lock_append();
        let derived = self.derived.write().unwrap_or_else(|p| p.into_inner());
        let store = self.store.lock(LockScope::Derived {
            ns,
            exclusive: true,
        })?;
        Ok(ExclusiveLocks {
            _store: store,
            _derived: derived,
            _append: append,
        })
    }

    /// Stores turns of `session` (creating it, with `date`, if new; a given date updates it)
    /// and advances segmentation; segments that finalize are encoded and stored.
    pub fn add_turns(
        &self,
        ns: &Namespace,
        session: &SessionId,
        date: Option<&str>,
        turns: Vec<NewTurn>,
    ) -> Result<IngestReceipt> {
        let appended = self.append_turns(ns, session, date, turns)?;
        let mut receipt = self.process(ns, session)?;
        receipt.turns_stored = appended.count;
        Ok(receipt)
    }

    /// [`Memory::add_turns`] for a batch whose first turn belongs at `first_index` of the
    /// session: idempotent, so a retried request or a re-read file adds nothing twice (see
    /// [`Memory::append_turns_at`]).
    pub fn add_turns_at(
        &self,
        ns: &Namespace,
        session: &SessionId,
        date: Option<&str>,
        first_index: u32,
        turns: Vec<NewTurn>,
    ) -> Result<IngestReceipt> {
        let appended = self.append_turns_at(ns, session, date, Some(first_index), turns)?;
        let mut receipt = self.process(ns, session)?;
        receipt.turns_stored = appended.count;
        receipt.turns_already_stored = appended.already_stored;
        Ok(receipt)
    }

    /// Stores turns durably (validated, embedded) without segmenting or encoding them; call
    /// [`Memory::process`] later (e.g. from a background worker). Returns where they went.
    pub fn append_turns(
        &self,
        ns: &Namespace,
        session: &SessionId,
        date: Option<&str>,
        turns: Vec<NewTurn>,
    ) -> Result<AppendReceipt> {
        self.append_turns_at(ns, session, date, None, turns)
    }

    /// Stores turns like [`Memory::append_turns`]; with `first_index`, the batch's first turn
    /// belongs at that index of the session. Turns at indexes the session already holds must
    /// equal the stored ones (role, speaker, text, time) and are skipped; the rest are appended.
    /// A mismatch is [`Error::Conflict`]; a first index past the session's end is
    /// [`Error::InvalidInput`] (it would leave a gap). Either way nothing is stored.
    pub fn append_turns_at(
        &self,
        ns: &Namespace,
        session: &SessionId,
        date: Option<&str>,
        first_index: Option<u32>,
        turns: Vec<NewTurn>,
    ) -> Result<AppendReceipt> {
        if turns.is_empty() {
            return Err(Error::InvalidInput("no turns given".into()));
        }
        for (i, t) in turns.iter().enumerate() {
            if t.text.trim().is_empty() {
                return Err(Error::InvalidInput(format!(
                    "turn {i} of the batch is empty"
                )));
            }
            if t.text.chars().count() > MAX_TURN_CHARS {
                return Err(Error::InvalidInput(format!(
                    "turn {i} of the batch has {} characters; the limit is {MAX_TURN_CHARS}",
                    t.text.chars().count()
                )));
            }
            for (what, label) in [("speaker", &t.speaker), ("time", &t.time)] {
                if let Some(label) = label
                    && label.chars().count() > MAX_LABEL_CHARS
                {
                    return Err(Error::InvalidInput(format!(
                        "turn {i} of the batch has a {what} of {} characters; the limit is \
                         {MAX_LABEL_CHARS}",
                        label.chars().count()
                    )));
                }
            }
        }
        if let Some(d) = date
            && d.chars().count() > MAX_LABEL_CHARS
        {
            return Err(Error::InvalidInput(format!(
                "the session date has {} characters; the limit is {MAX_LABEL_CHARS}",
                d.chars().count()
            )));
        }
        if let Some(d) = date
            && lycheemem_core::date::parse_date(d).is_none()
        {
            return Err(Error::InvalidInput(format!(
                "session date {d:?} is not a date (try YYYY-MM-DD)"
            )));
        }
        let _guard = self.lock_append();
        let _store_guard = self.store.lock(LockScope::Append(ns, session))?;
        let existing = self.store.session(ns, session)?;
        let held = existing.as_ref().map_or(0, |s| s.turn_count);
        let mut turns = turns;
        let mut already_stored = 0u64;
        if let Some(first) = first_index {
            if first > held {
                return Err(Error::InvalidInput(format!(
                    "the batch starts at turn {first} of session {session}, which holds {held} \
                     turns: the next turn index is {held}"
                )));
            }
            let overlap = (held - first).min(turns.len() as u32);
            if overlap > 0 {
                let stored = self
                    .store
                    .turn_range(ns, session, first, first + overlap - 1)?;
                for (given, stored) in turns.iter().zip(&stored) {
                    let same = given.role == stored.role
                        && given.speaker == stored.speaker
                        && given.text == stored.text
                        && given.time == stored.time;
                    if !same {
                        return Err(Error::Conflict(format!(
                            "turn {session}#{} is already stored with other content \
                             (stored: {:?}; given: {:?}); nothing was stored",
                            stored.index,
                            lycheemem_core::text::head_and_tail(&stored.text, 80),
                            lycheemem_core::text::head_and_tail(&given.text, 80),
                        )));
                    }
                }
                turns.drain(..overlap as usize);
                already_stored = u64::from(overlap);
            }
        }
        // A new session is created; a given date that differs from the stored one updates it.
        let same_date = existing
            .as_ref()
            .is_some_and(|s| date.is_none() || s.date.as_deref() == date);
        if !same_date {
            let mut info = existing.unwrap_or_else(|| SessionInfo::new(session.clone(), None));
            if let Some(d) = date {
                info.date = Some(d.to_string());
            }
            self.store.put_session(ns, info)?;
        }
        if turns.is_empty() {
            return Ok(AppendReceipt {
                first_index: held,
                count: 0,
                already_stored,
            });
        }
        let start = self.store.session(ns, session)?.map_or(0, |s| s.turn_count);
        let stored: Vec<Turn> = turns
            .into_iter()
            .enumerate()
            .map(|(i, t)| Turn {
                session: session.clone(),
                index: start + i as u32,
                role: t.role,
                speaker: t.speaker,
                text: t.text,
                time: t.time,
            })
            .collect();
        // The same text a single-turn exchange embeds, so two-speaker logs reuse the turn vector.
        let head_tail = self.config.segment.embed_head_tail_chars;
        let texts: Vec<String> = stored
            .iter()
            .map(|t| {
                format!(
                    "{}: {}",
                    t.author(),
                    lycheemem_core::text::head_and_tail(&t.text, head_tail)
                )
            })
            .collect();
        let vectors = self.embed(&texts)?;
        let n = stored.len() as u64;
        // Durable before any LLM work.
        self.store.add_turns(
            ns,
            stored
                .into_iter()
                .zip(vectors.into_iter().map(Some))
                .collect(),
        )?;
        Ok(AppendReceipt {
            first_index: start,
            count: n,
            already_stored,
        })
    }

    /// Segments (and encodes) the turns of a session stored but not yet processed.
    pub fn process(&self, ns: &Namespace, session: &SessionId) -> Result<IngestReceipt> {
        let _guards = self.lock_session(ns, session)?;
        self.advance(ns, session, false)
    }

    /// Sessions of a namespace holding stored turns that were never processed (e.g. appended
    /// before a shutdown), with the number of such turns.
    pub fn unprocessed_sessions(&self, ns: &Namespace) -> Result<Vec<(SessionId, u32)>> {
        let mut out = Vec::new();
        if !self.store.has_namespace(ns)? {
            return Ok(out);
        }
        for s in self.store.sessions(ns)? {
            let state = self.load_state(ns, &s.id)?;
            if s.turn_count > state.next_turn {
                out.push((s.id.clone(), s.turn_count - state.next_turn));
            }
        }
        Ok(out)
    }

    /// Closes a session: the pending exchange and the active segment are finalized and encoded.
    pub fn flush(&self, ns: &Namespace, session: &SessionId) -> Result<IngestReceipt> {
        let _guards = self.lock_session(ns, session)?;
        if self.store.session(ns, session)?.is_none() {
            return Err(Error::NotFound(format!(
                "session {session} in namespace {ns}"
            )));
        }
        self.advance(ns, session, true)
    }

    fn load_state(&self, ns: &Namespace, session: &SessionId) -> Result<IngestState> {
        match self.store.state(ns, session, INGEST_STATE)? {
            Some(v) => serde_json::from_value(v)
                .map_err(|e| Error::Store(format!("ingest state of {session} is unreadable: {e}"))),
            None => Ok(IngestState {
                builder: ExchangeBuilder::new(ExchangeMode::Chat),
                queue: VecDeque::new(),
                segmenter: SegmenterState::new(session.clone()),
                next_turn: 0,
                exchanges: 0,
                finalized: VecDeque::new(),
            }),
        }
    }

    /// The ingest state of a session whose first `turns` turns count as processed (used for
    /// memories written below the facade, e.g. synthetic benchmark stores).
    pub(crate) fn processed_state(session: &SessionId, turns: u32) -> Result<serde_json::Value> {
        Self::state_value(&IngestState {
            builder: ExchangeBuilder::new(ExchangeMode::Chat),
            queue: VecDeque::new(),
            segmenter: SegmenterState::new(session.clone()),
            next_turn: turns,
            exchanges: 0,
            finalized: VecDeque::new(),
        })
    }

    fn state_value(state: &IngestState) -> Result<serde_json::Value> {
        serde_json::to_value(state)
            .map_err(|e| Error::Store(format!("cannot serialize the ingest state: {e}")))
    }

    /// Feeds the session's unconsumed turns through exchanges and the segmenter; encodes and
    /// commits every finalized segment together with the state at that point.
    fn advance(&self, ns: &Namespace, session: &SessionId, flush: bool) -> Result<IngestReceipt> {
        let mut receipt = IngestReceipt::default();
        let mut state = self.load_state(ns, session)?;
        // Segments finalized before a crash come first, in order.
        self.commit_finalized(ns, &mut state, &mut receipt)?;
        let turns = self
            .store
            .turn_range(ns, session, state.next_turn, u32::MAX)?;
        if state.next_turn == 0
            && let Some(first) = turns.first()
        {
            // Two-speaker logs (named speakers) make every turn its own exchange (LiCoMemory:
            // every two turns one chunk).
            let mode = if first.speaker.is_some() {
                match self.config.strategy {
                    MemoryStrategy::Lycheemem => ExchangeMode::PerTurn,
                    MemoryStrategy::Licomemory => ExchangeMode::TurnPairs,
                }
            } else {
                ExchangeMode::Chat
            };
            state.builder = ExchangeBuilder::new(mode);
        }
        for t in &turns {
            if let Some(ex) = state.builder.push(t) {
                state.queue.push_back(ex);
            }
            state.next_turn = t.index + 1;
        }
        if flush && let Some(ex) = state.builder.finish() {
            state.queue.push_back(ex);
        }
        // Single-turn exchanges (two-speaker logs) reuse the stored turn vector; the others are
        // embedded in one batch.
        let head_tail = self.config.segment.embed_head_tail_chars;
        let single: Vec<ItemRef> = state
            .queue
            .iter()
            .filter(|e| e.turns.len() == 1)
            .map(|e| {
                ItemRef::Turn(lycheemem_core::TurnRef {
                    session: session.clone(),
                    index: e.turns[0].0,
                })
            })
            .collect();
        let mut stored = self.store.vectors(ns, &single)?.into_iter();
        let mut slots: Vec<Option<Vec<f32>>> = state
            .queue
            .iter()
            .map(|e| {
                if e.turns.len() == 1 {
                    stored.next().flatten()
                } else {
                    None
                }
            })
            .collect();
        let missing: Vec<usize> = (0..slots.len()).filter(|i| slots[*i].is_none()).collect();
        let texts: Vec<String> = missing
            .iter()
            .map(|i| state.queue[*i].embedding_text(head_tail))
            .collect();
        for (i, v) in missing.into_iter().zip(self.embed(&texts)?) {
            slots[i] = Some(v);
        }
        let vectors: Vec<Vec<f32>> = slots
            .into_iter()
            .map(|v| v.ok_or_else(|| Error::Model("the embedder returned too few vectors".into())))
            .collect::<Result<_>>()?;
        for vector in vectors {
            let Some(ex) = state.queue.pop_front() else {
                break;
            };
            let Some(first_turn) = ex.first_turn() else {
                continue;
            };
            receipt.exchanges += 1;
            state.exchanges += 1;
            let input = ExchangeInput {
                first_turn,
                turn_tokens: ex.turn_tokens(),
                vector,
            };
            let (segments, _decision) = self.segmenter.push(&mut state.segmenter, input);
            state.finalized.extend(segments);
            self.commit_finalized(ns, &mut state, &mut receipt)?;
        }
        if flush && let Some(seg) = self.segmenter.flush(&mut state.segmenter) {
            state.finalized.push_back(seg);
            self.commit_finalized(ns, &mut state, &mut receipt)?;
        }
        if flush
            && self.config.strategy == MemoryStrategy::Licomemory
            && self.config.licomemory.summary == LicoSummaryMode::PerSession
        {
            receipt.merge(self.summarize_session(ns, session)?);
        }
        self.store
            .put_state(ns, session, INGEST_STATE, &Self::state_value(&state)?)?;
        Ok(receipt)
    }

    /// Encodes and commits the state's finalized segments in order, each with the state that
    /// lists only the segments after it.
    fn commit_finalized(
        &self,
        ns: &Namespace,
        state: &mut IngestState,
        receipt: &mut IngestReceipt,
    ) -> Result<()> {
        while let Some(seg) = state.finalized.pop_front() {
            receipt.merge(self.encode_and_commit(ns, &seg, state)?);
        }
        Ok(())
    }

    /// LiCoMemory's `per_session` summary: one call over the whole session at its flush; the
    /// summary (with its key vectors) and the call's usage are stored.
    fn summarize_session(&self, ns: &Namespace, session: &SessionId) -> Result<IngestReceipt> {
        let (summary, usage, failure) = self.chunk_writer.summarize_session(
            self.store.as_ref(),
            ns,
            session,
            &Cancel::default(),
        )?;
        if let Some(s) = summary {
            let value = lycheemem_licomemory::summary_state(s, self.components.embedder.as_ref())?;
            self.store.put_state(ns, session, SUMMARY_STATE, &value)?;
        }
        if let Some(why) = failure {
            tracing::warn!("session {session}: {why}");
        }
        if !usage.is_empty() {
            self.store.log_usage(ns, &usage)?;
        }
        Ok(IngestReceipt {
            encode_calls: usage.len() as u64,
            encode_tokens: usage
                .iter()
                .map(|u| u.prompt_tokens + u.completion_tokens)
                .sum(),
            ..IngestReceipt::default()
        })
    }

    /// LiCoMemory's chunk write: its calls outside the commit lock, the merge with the stored
    /// graph and the commit under it.
    fn extract_and_commit(
        &self,
        ns: &Namespace,
        segment: &Segment,
        state: &IngestState,
    ) -> Result<IngestReceipt> {
        let extraction =
            self.chunk_writer
                .extract(self.store.as_ref(), ns, segment, &Cancel::default())?;
        let (failure, calls) = (extraction.failure.clone(), extraction.calls);
        let tokens: u64 = extraction
            .usage
            .iter()
            .map(|u| u.prompt_tokens + u.completion_tokens)
            .sum();
        let state_value = Self::state_value(state)?;
        let _commit = self.commit.lock().unwrap_or_else(|p| p.into_inner());
        let _store_commit = self.store.lock(LockScope::Commit(ns))?;
        let mut write = lycheemem_licomemory::organize_chunk(
            extraction,
            self.components.embedder.as_ref(),
            self.store.as_ref(),
            ns,
            &self.config.licomemory,
        )?;
        write.state.push((
            segment.session.clone(),
            INGEST_STATE.to_string(),
            state_value,
        ));
        let records = write.records.len();
        let failed = matches!(write.outcome, SegmentOutcome::Failed { .. });
        self.store.commit_segment(ns, write)?;
        Ok(IngestReceipt {
            segments: vec![SegmentSummary {
                segment: segment.clone(),
                records,
                failure,
            }],
            records: records as u64,
            failed_segments: u64::from(failed),
            encode_calls: u64::from(calls),
            encode_tokens: tokens,
            ..IngestReceipt::default()
        })
    }

    fn encode_and_commit(
        &self,
        ns: &Namespace,
        segment: &Segment,
        state: &IngestState,
    ) -> Result<IngestReceipt> {
        if self.config.strategy == MemoryStrategy::Licomemory {
            return self.extract_and_commit(ns, segment, state);
        }
        // The LLM call runs outside the commit lock, so other sessions' segments are encoded
        // meanwhile; the node merge and the commit are one step under it.
        let encoded = encode_segment(&self.encoder, self.store.as_ref(), ns, segment)?;
        let state_value = Self::state_value(state)?;
        let _commit = self.commit.lock().unwrap_or_else(|p| p.into_inner());
        let _store_commit = self.store.lock(LockScope::Commit(ns))?;
        let built = organize_segment(
            encoded,
            self.components.embedder.as_ref(),
            &self.config.organize,
            self.store.as_ref(),
            ns,
        )?;
        let mut write = built.write;
        write.state.push((
            segment.session.clone(),
            INGEST_STATE.to_string(),
            state_value,
        ));
        let records = write.records.len();
        self.store.commit_segment(ns, write)?;
        let outcome = built.outcome;
        Ok(IngestReceipt {
            turns_stored: 0,
            turns_already_stored: 0,
            exchanges: 0,
            segments: vec![SegmentSummary {
                segment: segment.clone(),
                records,
                failure: outcome.failure.clone(),
            }],
            records: records as u64,
            failed_segments: u64::from(outcome.failure.is_some()),
            encode_calls: u64::from(outcome.calls),
            encode_tokens: outcome.prompt_tokens + outcome.completion_tokens,
        })
    }

    fn require_namespace(&self, ns: &Namespace) -> Result<()> {
        if !self.store.has_namespace(ns)? {
            return Err(Error::NotFound(format!(
                "namespace {ns} has no memory (ingest something first)"
            )));
        }
        Ok(())
    }

    /// Finds the evidence for a question (one planner call unless disabled). The planner's
    /// usage is logged.
    pub fn search(
        &self,
        ns: &Namespace,
        question: &str,
        opts: &QueryOptions,
    ) -> Result<SearchResult> {
        self.require_namespace(ns)?;
        if self.config.strategy == MemoryStrategy::Licomemory {
            // `top_k` asks for that many chunks; LiCoMemory has no use for `context`.
            let mut cfg = self.config.licomemory.clone();
            if opts.top_k > 0 {
                cfg.top_chunks = opts.top_k;
            }
            let retriever = LicoRetriever {
                store: self.store.as_ref(),
                embedder: self.components.embedder.as_ref(),
                llm: Some(self.components.plan_llm.as_ref()),
                cfg: &cfg,
            };
            let result = retriever.search(
                ns,
                &LicoRequest {
                    question,
                    reference_date: opts.reference_date.as_deref(),
                    analysis: None,
                    cancel: opts.cancel.clone(),
                },
            )?;
            if !result.usage.is_empty() {
                self.store.log_usage(ns, &result.usage)?;
            }
            return Ok(result);
        }
        let retriever = Retriever {
            store: self.store.as_ref(),
            embedder: self.components.embedder.as_ref(),
            reranker: self.components.reranker.as_deref(),
            planner: Some(self.components.plan_llm.as_ref()),
            cfg: &self.config.retrieval,
        };
        let req = SearchRequest {
            question,
            context: &opts.context,
            reference_date: opts.reference_date.as_deref(),
            top_k: opts.top_k,
            plan: None,
            trace: opts.trace,
            cancel: opts.cancel.clone(),
        };
        let result = retriever.search(ns, &req)?;
        if !result.usage.is_empty() {
            self.store.log_usage(ns, &result.usage)?;
        }
        Ok(result)
    }

    /// Answers a question from memory: search, then one answer call. Both calls are logged.
    pub fn answer(&self, ns: &Namespace, question: &str, opts: &QueryOptions) -> Result<Answer> {
        let search = self.search(ns, question, opts)?;
        let reply = match self.config.strategy {
            MemoryStrategy::Lycheemem => lycheemem_retrieve::answer(
                self.components.answer_llm.as_ref(),
                question,
                opts.reference_date.as_deref(),
                &search.evidence,
                &self.config.answer,
                &opts.cancel,
            )?,
            MemoryStrategy::Licomemory => lycheemem_licomemory::answer(
                self.components.answer_llm.as_ref(),
                question,
                opts.reference_date.as_deref(),
                &search,
                &self.config.licomemory,
                &self.config.answer,
                &opts.cancel,
            )?,
        };
        self.store
            .log_usage(ns, std::slice::from_ref(&reply.usage))?;
        let mut usage = search.usage.clone();
        usage.push(reply.usage);
        Ok(Answer {
            text: reply.text,
            search,
            usage,
        })
    }

    /// Re-embeds items whose vectors are missing or stale (e.g. nodes rewritten by a delete).
    pub fn reembed_pending(&self, ns: &Namespace) -> Result<usize> {
        let mut done = 0;
        loop {
            let pending = self.store.pending_vectors(ns, 256)?;
            if pending.is_empty() {
                return Ok(done);
            }
            let mut pending = pending;
            if self.config.strategy == MemoryStrategy::Licomemory {
                // LiCoMemory embeds an entity as its label (`name (type)`), not with the texts
                // of the triples it links.
                let ids: Vec<String> = pending
                    .iter()
                    .filter_map(|(i, _)| match i {
                        ItemRef::Node(id) => Some(id.clone()),
                        _ => None,
                    })
                    .collect();
                let labels: std::collections::HashMap<String, String> = self
                    .store
                    .nodes(ns, &ids)?
                    .into_iter()
                    .map(|n| (n.node_id, n.label))
                    .collect();
                for (item, text) in &mut pending {
                    if let ItemRef::Node(id) = item
                        && let Some(label) = labels.get(id)
                    {
                        text.clone_from(label);
                    }
                }
            }
            let texts: Vec<&str> = pending.iter().map(|(_, t)| t.as_str()).collect();
            let vectors = self.components.embedder.embed(&texts)?;
            let items: Vec<(ItemRef, Vec<f32>)> =
                pending.into_iter().map(|(i, _)| i).zip(vectors).collect();
            let n = self.store.set_vectors(ns, &items)?;
            if n == 0 {
                return Ok(done);
            }
            done += n;
        }
    }

    /// Runs a record or session delete; "not found" when it removed nothing; then re-embeds
    /// the nodes the cascade rewrote.
    fn delete_then_reembed(
        &self,
        ns: &Namespace,
        what: String,
        delete: impl FnOnce(&dyn MemoryStore) -> Result<DeleteReceipt>,
        removed: impl Fn(&DeleteReceipt) -> u64,
    ) -> Result<DeleteReceipt> {
        let _guards = self.lock_all(ns)?;
        let r = delete(self.store.as_ref())?;
        if removed(&r) == 0 {
            return Err(Error::NotFound(format!("{what} in namespace {ns}")));
        }
        self.reembed_pending(ns)?;
        Ok(r)
    }

    pub fn delete_record(&self, ns: &Namespace, record_id: &str) -> Result<DeleteReceipt> {
        self.delete_then_reembed(
            ns,
            format!("record {record_id}"),
            |s| s.delete_record(ns, record_id),
            |r| r.records,
        )
    }

    pub fn delete_session(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.delete_then_reembed(
            ns,
            format!("session {session}"),
            |s| s.delete_session(ns, session),
            |r| r.sessions,
        )
    }

    pub fn delete_namespace(&self, ns: &Namespace) -> Result<DeleteReceipt> {
        let _guards = self.lock_all(ns)?;
        self.require_namespace(ns)?;
        self.store.delete_namespace(ns)
    }

    pub fn export(
        &self,
        ns: &Namespace,
        out: &mut dyn std::io::Write,
        include_vectors: bool,
    ) -> Result<u64> {
        self.require_namespace(ns)?;
        self.store
            .export(ns, out, ExportOptions { include_vectors })
    }

    pub fn import(
        &self,
        ns: &Namespace,
        input: &mut dyn std::io::BufRead,
    ) -> Result<ImportReceipt> {
        let _guards = self.lock_all(ns)?;
        let embedder = self.components.embedder.clone();
        let embed = move |texts: &[String]| -> Result<Vec<Vec<f32>>> {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            embedder.embed(&refs)
        };
        let receipt = self.store.import(ns, input, Some(&embed))?;
        if self.config.strategy == MemoryStrategy::Licomemory {
            self.embed_entity_labels(ns)?;
        }
        Ok(receipt)
    }

    /// LiCoMemory: every entity node's vector from its label (`name (type)`), e.g. after an
    /// import embedded the nodes a delete had rewritten from their search text.
    fn embed_entity_labels(&self, ns: &Namespace) -> Result<()> {
        let nodes: Vec<(ItemRef, String)> = self
            .store
            .all_nodes(ns)?
            .into_iter()
            .filter(|n| n.kind == lycheemem_core::NodeKind::Entity)
            .map(|n| (ItemRef::Node(n.node_id), n.label))
            .collect();
        for batch in nodes.chunks(256) {
            let texts: Vec<String> = batch.iter().map(|(_, l)| l.clone()).collect();
            let vectors = self.embed(&texts)?;
            let items: Vec<(ItemRef, Vec<f32>)> =
                batch.iter().map(|(i, _)| i.clone()).zip(vectors).collect();
            self.store.set_vectors(ns, &items)?;
        }
        Ok(())
    }

    /// Counts from the store plus token usage by purpose.
    pub fn stats(&self, ns: &Namespace) -> Result<NamespaceStats> {
        self.require_namespace(ns)?;
        self.store.stats(ns)
    }

    /// Token usage of a namespace by purpose.
    pub fn usage(&self, ns: &Namespace) -> Result<UsageTotals> {
        let mut totals = UsageTotals::default();
        for u in self.store.usage_log(ns)? {
            totals.add(&u);
        }
        Ok(totals)
    }

    /// Re-runs segmentation and encoding over every stored raw turn of the namespace with the
    /// current models, prompts and config, and reports which record texts changed.
    pub fn rederive(&self, ns: &Namespace) -> Result<RederiveReport> {
        self.require_namespace(ns)?;
        let _guards = self.lock_all(ns)?;
        let before: BTreeSet<String> = self
            .store
            .all_records(ns)?
            .into_iter()
            .map(|r| r.semantic_text)
            .collect();
        let sessions = self.store.sessions(ns)?;
        let mut report = RederiveReport {
            sessions: sessions.len() as u64,
            records_before: before.len() as u64,
            ..RederiveReport::default()
        };
        for s in &sessions {
            self.store.clear_session_derived(ns, &s.id)?;
        }
        for s in &sessions {
            report.ingest.merge(self.advance(ns, &s.id, true)?);
        }
        let after: BTreeSet<String> = self
            .store
            .all_records(ns)?
            .into_iter()
            .map(|r| r.semantic_text)
            .collect();
        report.segments = report.ingest.segments.len() as u64;
        report.records_after = after.len() as u64;
        report.added = after.difference(&before).cloned().collect();
        report.removed = before.difference(&after).cloned().collect();
        Ok(report)
    }

    /// Construction cost so far: encode calls and tokens, and the calls per-exchange (eager)
    /// encoding would have made for the same exchanges.
    pub fn construction(&self, ns: &Namespace) -> Result<Construction> {
        let usage = self.usage(ns)?;
        let encode = usage
            .by_purpose
            .get(&Purpose::Encode)
            .copied()
            .unwrap_or_default();
        let mut exchanges = 0u64;
        let mut segments = 0u64;
        for s in self.store.sessions(ns)? {
            let state = self.load_state(ns, &s.id)?;
            exchanges += state.exchanges;
            segments += self.store.segments(ns, &s.id)?.len() as u64;
        }
        Ok(Construction {
            encode_calls: encode.calls,
            encode_tokens: encode.prompt_tokens + encode.completion_tokens,
            segments,
            exchanges,
        })
    }
}

/// The store setting naming the strategy a store was built with.
pub const STRATEGY_SETTING: &str = "memory_strategy";

/// Refuses to open a store with a strategy other than the one it was built with (a store that
/// never named one was built by LycheeMemory); a new, empty store records a non-default one.
fn check_strategy(store: &dyn MemoryStore, strategy: MemoryStrategy) -> Result<()> {
    let built = match store.setting(STRATEGY_SETTING)? {
        Some((v, _)) => v.as_str().unwrap_or_default().to_string(),
        None if strategy == MemoryStrategy::Lycheemem || !store.namespaces()?.is_empty() => {
            MemoryStrategy::Lycheemem.as_str().to_string()
        }
        None => {
            store.put_setting(
                STRATEGY_SETTING,
                &serde_json::Value::from(strategy.as_str()),
                Some(0),
            )?;
            strategy.as_str().to_string()
        }
    };
    if built != strategy.as_str() {
        return Err(Error::Config(format!(
            "this store was built with strategy = \"{built}\"; open it with that strategy \
             (it is configured as \"{}\")",
            strategy.as_str()
        )));
    }
    Ok(())
}

/// Construction cost of a namespace (docs/algorithm.md, "Cost and token accounting").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Construction {
    pub encode_calls: u64,
    pub encode_tokens: u64,
    pub segments: u64,
    /// Exchanges segmented: the number of calls per-exchange encoding would make.
    pub exchanges: u64,
}

/// Records every session's stored turns in `ns` as already processed, so a memory opened on a
/// store written below the facade (a bulk load through the store traits, or a synthetic
/// benchmark store) does not segment and encode them again.
pub fn mark_sessions_processed(store: &dyn MemoryStore, ns: &Namespace) -> Result<()> {
    for s in store.sessions(ns)? {
        if store.state(ns, &s.id, INGEST_STATE)?.is_none() {
            let state = Memory::processed_state(&s.id, s.turn_count)?;
            store.put_state(ns, &s.id, INGEST_STATE, &state)?;
        }
    }
    Ok(())
}

/// Whether `location` is a PostgreSQL connection URL (`postgres://` or `postgresql://`)
/// rather than a store directory.
pub fn is_postgres_location(location: &Path) -> bool {
    location
        .to_str()
        .is_some_and(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"))
}

/// Opens (creating if needed) the storage backend a location names: a PostgreSQL URL opens
/// the PostgreSQL + pgvector backend in schema `store.postgres_schema`; anything else is a
/// directory for the embedded redb store. `dims == 0` opens an existing store with its own
/// dimension.
pub(crate) fn open_backend(
    location: &Path,
    config: &Config,
    dims: usize,
) -> Result<Box<dyn MemoryStore>> {
    let options = store_options(config, dims);
    if is_postgres_location(location) {
        return open_postgres(location, config, options);
    }
    Ok(Box::new(Store::open(location, options)?))
}

/// The store options a configuration asks for.
pub(crate) fn store_options(config: &Config, dims: usize) -> StoreOptions {
    let mut options = StoreOptions::new(dims);
    options.index = config.store.clone();
    options.node_text_chars = config.organize.node_text_chars;
    options
}

#[cfg(feature = "postgres")]
pub(crate) fn postgres_config(
    location: &Path,
    config: &Config,
) -> lycheemem_store_postgres::PgConfig {
    let mut pg = lycheemem_store_postgres::PgConfig::new(location.to_string_lossy())
        .with_schema(config.store.postgres_schema.clone());
    pg.pool_size = config.store.postgres_pool_size;
    pg
}

#[cfg(feature = "postgres")]
fn open_postgres(
    location: &Path,
    config: &Config,
    options: StoreOptions,
) -> Result<Box<dyn MemoryStore>> {
    let pg = postgres_config(location, config);
    Ok(Box::new(lycheemem_store_postgres::PgStore::open(
        &pg, options,
    )?))
}

#[cfg(not(feature = "postgres"))]
fn open_postgres(
    _location: &Path,
    _config: &Config,
    _options: StoreOptions,
) -> Result<Box<dyn MemoryStore>> {
    Err(Error::Config(
        "this build has no PostgreSQL backend (the `postgres` feature of the lycheemem crate is off)".into(),
    ))
}

/// Whether a store exists at `location` (a directory or a PostgreSQL schema).
fn store_exists(location: &Path, config: &Config) -> Result<bool> {
    if !is_postgres_location(location) {
        return Ok(Store::exists(location));
    }
    #[cfg(feature = "postgres")]
    {
        lycheemem_store_postgres::PgStore::exists(&postgres_config(location, config))
    }
    #[cfg(not(feature = "postgres"))]
    {
        let _ = config;
        Ok(true)
    }
}
