//! The storage seam: what the rest of lycheemem needs from a store, as traits. [`crate::Store`]
//! (redb + usearch + tantivy) implements all of them; another backend (e.g. PostgreSQL) plugs
//! in by implementing them and passing the conformance suite in `tests/conformance.rs`.
//!
//! The traits are split by role so each caller depends on what it uses: encoding reads
//! ([`StoreLookup`]), retrieval reads and searches ([`RetrievalStore`]), the server lists
//! ([`StoreCatalog`]); the facade holds the whole [`MemoryStore`].
//!
//! Contract for every backend: every call takes a [`Namespace`] and never reads or writes across
//! one; each write call is one atomic transaction, durable when it returns; a read sees every
//! write that returned before it; items keep their ids (`ItemRef` strings) across restarts.

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{EvidenceNode, Namespace, Record, Result, SessionId, Turn, TurnRef};
use std::io::{BufRead, Write};

use crate::transfer::{EmbedFn, ExportOptions, ImportReceipt};
use crate::types::{
    DeleteReceipt, Hit, ItemRef, NamespaceStats, NodeMembers, SegmentRow, SegmentWrite,
    SessionInfo, Target, VectorQuery, WriteReceipt,
};

/// Point reads by id: what encoding and retrieval look up.
pub trait StoreLookup: Send + Sync {
    fn session(&self, ns: &Namespace, id: &SessionId) -> Result<Option<SessionInfo>>;

    /// Turns `first..=last` of a session (clamped to what exists).
    fn turn_range(
        &self,
        ns: &Namespace,
        session: &SessionId,
        first: u32,
        last: u32,
    ) -> Result<Vec<Turn>>;

    /// The records with these ids that exist, in the order asked.
    fn records(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<Record>>;

    /// The nodes with these ids that exist, in the order asked.
    fn nodes(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<EvidenceNode>>;

    /// The record links of the nodes with these ids that exist, in the order asked: each node's
    /// record count, and its record ids when it links at most `list_up_to` records (node
    /// expansion scores a small node's records one by one and searches a large one with
    /// [`StoreSearch::vector_search_node`]). A backend may answer large nodes without decoding
    /// their member lists.
    fn node_members(
        &self,
        ns: &Namespace,
        ids: &[String],
        list_up_to: usize,
    ) -> Result<Vec<NodeMembers>> {
        Ok(self
            .nodes(ns, ids)?
            .into_iter()
            .map(|n| NodeMembers::of(n, list_up_to))
            .collect())
    }

    fn state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
    ) -> Result<Option<serde_json::Value>>;
}

/// Index queries: vector (HNSW or exact), full text (BM25), temporal nodes, and the vectors retrieval scores with.
pub trait StoreSearch: Send + Sync {
    /// Nearest neighbours by cosine similarity among one namespace's items of one target.
    ///
    /// A namespace holding at most `exact_search_below` vectors of the target is searched
    /// exactly (an HNSW graph can leave a node unreachable); a larger one goes through its HNSW
    /// index. With a session filter the result is exact when the session is small and otherwise
    /// falls back to an exact scan whenever the filtered HNSW search returns fewer than `k` hits
    /// while more matching vectors exist — a filter never silently shortens the list.
    fn vector_search(&self, ns: &Namespace, q: &VectorQuery) -> Result<Vec<Hit>>;

    /// Nearest neighbours among the given items of one target (e.g. the records of a node):
    /// exact when the list is small, otherwise a filtered HNSW search with the exact fallback.
    fn vector_search_within(
        &self,
        ns: &Namespace,
        target: Target,
        vector: &[f32],
        k: usize,
        ids: &[String],
    ) -> Result<Vec<Hit>>;

    /// The `k` records linked to evidence node `node_id` nearest to `vector`: the same hits as
    /// [`StoreSearch::vector_search_within`] over the node's record ids (none when the node
    /// does not exist). [`StoreSearch::vector_search_node_many`] for one vector.
    fn vector_search_node(
        &self,
        ns: &Namespace,
        node_id: &str,
        vector: &[f32],
        k: usize,
    ) -> Result<Vec<Hit>> {
        Ok(self
            .vector_search_node_many(ns, node_id, &[vector], k)?
            .pop()
            .unwrap_or_default())
    }

    /// Node expansion scores a node of at most this many records member by member (one read
    /// of their vectors) and searches a larger one with
    /// [`StoreSearch::vector_search_node_many`]: where that search is cheaper depends on the
    /// backend.
    fn node_search_above(&self) -> usize {
        256
    }

    /// [`StoreSearch::vector_search_node`] for several query vectors at once (one list per
    /// vector, in order): a backend may read the node's members once for all of them, and keep
    /// a large node's members resolved between calls, as long as every write that returned is
    /// seen.
    fn vector_search_node_many(
        &self,
        ns: &Namespace,
        node_id: &str,
        vectors: &[&[f32]],
        k: usize,
    ) -> Result<Vec<Vec<Hit>>>;

    /// BM25 top-`k` among one namespace's items of one target, optionally within a session.
    fn text_search(
        &self,
        ns: &Namespace,
        target: Target,
        query: &str,
        k: usize,
        session: Option<&SessionId>,
    ) -> Result<Vec<Hit>>;

    /// Temporal nodes whose key overlaps `[since, until]`: `day:` keys inside the range and
    /// `month:` keys of every month it touches. Bounds are ISO dates (`YYYY-MM-DD` or `YYYY-MM`,
    /// a month meaning its first day for `since` and its last day for `until`).
    fn temporal_nodes(&self, ns: &Namespace, since: &str, until: &str)
    -> Result<Vec<EvidenceNode>>;

    /// The members of [`StoreSearch::temporal_nodes`]' nodes, in the same order, each listing
    /// every record: what the temporal channel reads (a backend may skip decoding the nodes'
    /// other fields).
    fn temporal_members(
        &self,
        ns: &Namespace,
        since: &str,
        until: &str,
    ) -> Result<Vec<NodeMembers>> {
        Ok(self
            .temporal_nodes(ns, since, until)?
            .into_iter()
            .map(|n| NodeMembers::of(n, usize::MAX))
            .collect())
    }

    /// Vectors for similarity scoring: the in-memory indexed vector (unit length, at the
    /// index's precision) where there is one, else the stored vector. Same cosine as
    /// [`Store::vectors`] without reading vector rows from the database.
    fn scoring_vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>>;
}

/// Listings and inspection: namespaces, sessions, whole tables, pages, counts, usage, stored vectors.
pub trait StoreCatalog: Send + Sync {
    /// The dimension of the store's vectors (fixed when the store was created).
    fn vector_dims(&self) -> usize;

    /// Every namespace with at least one session.
    fn namespaces(&self) -> Result<Vec<Namespace>>;

    /// Whether the namespace holds any session (one key lookup, no decoding).
    fn has_namespace(&self, ns: &Namespace) -> Result<bool>;

    /// The namespace's sessions in id order.
    fn sessions(&self, ns: &Namespace) -> Result<Vec<SessionInfo>>;

    /// All turns of a session in order.
    fn turns(&self, ns: &Namespace, session: &SessionId) -> Result<Vec<Turn>>;

    /// The turns within `radius` of `index` in its session: `(session, index ± radius)`.
    fn turn_window(&self, ns: &Namespace, at: &TurnRef, radius: u32) -> Result<Vec<Turn>>;

    /// Every record of the namespace in id order.
    fn all_records(&self, ns: &Namespace) -> Result<Vec<Record>>;

    /// One page of the namespace's records in id order (of one session's records with
    /// `session`), and how many there are in all. Only the page is read and decoded; the rest
    /// is counted by key.
    fn records_page(
        &self,
        ns: &Namespace,
        session: Option<&SessionId>,
        offset: usize,
        limit: usize,
    ) -> Result<(usize, Vec<Record>)>;

    /// Every node of the namespace in id order.
    fn all_nodes(&self, ns: &Namespace) -> Result<Vec<EvidenceNode>>;

    /// The segments of a session in turn order.
    fn segments(&self, ns: &Namespace, session: &SessionId) -> Result<Vec<SegmentRow>>;

    /// Every usage entry of the namespace in the order logged.
    fn usage_log(&self, ns: &Namespace) -> Result<Vec<TokenUsage>>;

    /// Counts from redb and from both derived indexes.
    fn stats(&self, ns: &Namespace) -> Result<NamespaceStats>;

    /// Stored vectors of items (`None` where an item or its vector is missing).
    fn vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>>;

    /// Items whose vector is missing or stale, with the text to embed, at most `limit`.
    fn pending_vectors(&self, ns: &Namespace, limit: usize) -> Result<Vec<(ItemRef, String)>>;
}

/// Ingest writes. Each call is one atomic, durable transaction; a returned receipt means it is on disk.
pub trait StoreWrite: Send + Sync {
    /// Creates or updates a session's date and metadata (its turn count is kept).
    fn put_session(&self, ns: &Namespace, info: SessionInfo) -> Result<WriteReceipt>;

    /// Appends raw turns (with their vectors, or `None` to embed later) in one durable
    /// transaction. Each turn's index must be its session's next index; re-sending an identical
    /// stored turn is a no-op, so a client may retry after a crash. Unknown sessions are created
    /// without a date.
    fn add_turns(
        &self,
        ns: &Namespace,
        turns: Vec<(Turn, Option<Vec<f32>>)>,
    ) -> Result<WriteReceipt>;

    /// Stores one finalized segment — its row, records, node states, session state and usage —
    /// in a single transaction.
    fn commit_segment(&self, ns: &Namespace, write: SegmentWrite) -> Result<WriteReceipt>;

    /// Stores a named per-session state value (e.g. `segmenter`, `reference_context`).
    fn put_state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<WriteReceipt>;

    /// Appends entries to the namespace's usage log.
    fn log_usage(&self, ns: &Namespace, usage: &[TokenUsage]) -> Result<WriteReceipt>;

    /// Sets the vectors of existing items (e.g. after embedding [`Store::pending_vectors`]);
    /// returns how many items were found.
    fn set_vectors(&self, ns: &Namespace, items: &[(ItemRef, Vec<f32>)]) -> Result<usize>;
}

/// Deletes (cascading, with receipts), export / import, and persisting derived state.
pub trait StoreAdmin: Send + Sync {
    /// Deletes a record; see [`DeleteReceipt`] for the cascade.
    fn delete_record(&self, ns: &Namespace, record_id: &str) -> Result<DeleteReceipt>;

    /// Deletes a session with its turns, segments, records (cascading to nodes) and state.
    fn delete_session(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt>;

    /// Deletes a session's records, segments and state but keeps the session and its raw turns
    /// (for re-deriving them with other models or prompts).
    fn clear_session_derived(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt>;

    /// Deletes everything in a namespace, including its usage log.
    fn delete_namespace(&self, ns: &Namespace) -> Result<DeleteReceipt>;

    /// Writes namespace `ns` as JSON Lines from one consistent snapshot; returns lines written.
    fn export(&self, ns: &Namespace, out: &mut dyn Write, opts: ExportOptions) -> Result<u64>;

    /// Imports an export into namespace `ns`, which must be empty. `embed` computes vectors the
    /// file lacks (texts in, unit vectors out); without it such items are left pending.
    fn import(
        &self,
        ns: &Namespace,
        input: &mut dyn BufRead,
        embed: Option<&EmbedFn>,
    ) -> Result<ImportReceipt>;

    /// Persists both derived indexes and trims the change log they no longer need.
    fn checkpoint(&self) -> Result<()>;
}

/// What a [`StoreLocks`] lock serializes, across every process sharing a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockScope<'a> {
    /// Allocating the turn indexes of a session (appends).
    Append(&'a Namespace, &'a SessionId),
    /// Processing a session: reading, advancing and writing back its ingest state, so its
    /// segments are encoded once and in order.
    Session(&'a Namespace, &'a SessionId),
    /// Merging a segment's records into the namespace's nodes and committing it.
    Commit(&'a Namespace),
    /// The namespace's derived data: shared by processing, exclusive for deletes, imports and
    /// re-derivation.
    Derived { ns: &'a Namespace, exclusive: bool },
}

impl LockScope<'_> {
    /// A stable text naming the lock (the same in every process).
    pub fn key(&self) -> String {
        match self {
            LockScope::Append(ns, s) => format!("append\u{0}{ns}\u{0}{s}"),
            LockScope::Session(ns, s) => format!("session\u{0}{ns}\u{0}{s}"),
            LockScope::Commit(ns) => format!("commit\u{0}{ns}"),
            LockScope::Derived { ns, .. } => format!("derived\u{0}{ns}"),
        }
    }

    /// Whether the lock is shared (several holders at once).
    pub fn shared(&self) -> bool {
        matches!(
            self,
            LockScope::Derived {
                exclusive: false,
                ..
            }
        )
    }
}

/// A held [`StoreLocks`] lock; dropping it releases the lock.
pub struct LockGuard(#[allow(dead_code)] Option<Box<dyn Send>>);

impl LockGuard {
    /// A guard with nothing to release (a backend whose store one process owns).
    pub fn none() -> Self {
        LockGuard(None)
    }

    /// A guard that releases the lock when `release` is dropped.
    pub fn new(release: Box<dyn Send>) -> Self {
        LockGuard(Some(release))
    }
}

/// Locks that serialize work on one store across processes (server replicas sharing a
/// database). They complement, never replace, the facade's in-process locks: a caller takes its
/// in-process lock first, then this one, always in the order append → derived → session →
/// commit. A lock is released when its guard drops, or when its process dies.
pub trait StoreLocks: Send + Sync {
    /// Blocks until the lock is held.
    fn lock(&self, scope: LockScope<'_>) -> Result<LockGuard>;

    /// The lock if it is free now (`None` when another process holds it).
    fn try_lock(&self, scope: LockScope<'_>) -> Result<Option<LockGuard>>;
}

/// Store-wide settings that every process using the store shares (e.g. the server's API
/// keys): named JSON values, each with a version that every write increments. Not part of any
/// namespace (exports leave them out).
pub trait StoreSettings: Send + Sync {
    /// The value and its version; `None` when it was never set.
    fn setting(&self, name: &str) -> Result<Option<(serde_json::Value, u64)>>;

    /// Writes a value and returns its new version. With `expected`, only if the current
    /// version is that (0: not set yet), else `Error::Conflict`: a read-modify-write that loses
    /// no concurrent update.
    fn put_setting(
        &self,
        name: &str,
        value: &serde_json::Value,
        expected: Option<u64>,
    ) -> Result<u64>;
}

/// The conflict a [`StoreSettings::put_setting`] with a stale `expected` version gets.
pub fn setting_conflict(name: &str, expected: u64, current: u64) -> lycheemem_core::Error {
    lycheemem_core::Error::Conflict(format!(
        "setting {name} changed meanwhile (version {current}, expected {expected}); read it again"
    ))
}

/// What retrieval needs: point reads and searches.
pub trait RetrievalStore: StoreLookup + StoreSearch {}
impl<T: StoreLookup + StoreSearch + ?Sized> RetrievalStore for T {}

/// A whole store backend, as the facade holds it.
pub trait MemoryStore:
    RetrievalStore + StoreCatalog + StoreWrite + StoreAdmin + StoreLocks + StoreSettings
{
}
impl<T> MemoryStore for T where
    T: RetrievalStore
        + StoreCatalog
        + StoreWrite
        + StoreAdmin
        + StoreLocks
        + StoreSettings
        + ?Sized
{
}
