//! [`Store`]: the redb + usearch + tantivy backend. This module opens a store (the process lock,
//! the tables, the derived indexes) and runs write transactions; its parts: `writer` (one write
//! transaction: rows, the change log, cascading deletes), `recovery` (bringing the derived
//! indexes up to date with redb), `reads` (lookups and catalog), `search` (vector, full-text and
//! temporal search), `write` (the [`StoreWrite`] and [`StoreAdmin`] implementations).

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{
    Error, EvidenceNode, Namespace, NodeKind, Record, Result, SessionId, Turn, TurnRef, UsageTotals,
};
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableHandle};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use crate::backend::{StoreAdmin, StoreCatalog, StoreLookup, StoreSearch, StoreWrite};
use crate::fulltext::{FullText, TextDoc};
use crate::keys;
use crate::rules::{record_search_text as record_text, turn_search_text as turn_text};
use crate::tables::*;
use crate::types::*;
use crate::vectors::VectorIndexes;

mod node_cache;
mod reads;
mod recovery;
mod search;
mod write;
mod writer;

pub(crate) use writer::Writer;

/// A memory store in one directory. See the crate docs.
pub struct Store {
    dir: PathBuf,
    db: Database,
    options: StoreOptions,
    store_id: String,
    /// Serializes writers; held while redb commits and the indexes apply the change.
    write: Mutex<()>,
    vectors: RwLock<VectorIndexes>,
    text: RwLock<FullText>,
    /// Large nodes' members resolved to index keys, cleared by every write.
    node_cache: RwLock<node_cache::NodeCache>,
    /// Held for the store's lifetime: the process lock on the directory.
    _lock: File,
}

const DB_FILE: &str = "store.redb";
/// The table layout this build writes, kept in the `format` counter; a store of a later format
/// is refused. 1: the node members table (`tables::NODE_MEMBERS`, filled on first open).
/// Builds before format 1 do not check it and do not maintain that table: a store opened by
/// this build must not be written by an older one.
const STORE_FORMAT: u64 = 1;
/// How long opening waits for a directory lock held by someone else before it says so.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(10);
const LOCK_FILE: &str = "LOCK";

fn lock_poisoned<T>(p: std::sync::PoisonError<T>) -> T {
    p.into_inner()
}

/// The namespace part of a table key (everything before the first 0 byte).
fn key_namespace(key: &[u8]) -> Option<&str> {
    let end = key.iter().position(|b| *b == 0)?;
    std::str::from_utf8(&key[..end]).ok()
}

/// What the indexes need to know about one item's current row.
struct IndexedItem {
    key: u64,
    text: String,
    sessions: Vec<String>,
}

impl Store {
    /// Whether `dir` holds a store (of this backend).
    pub fn exists(dir: impl AsRef<Path>) -> bool {
        dir.as_ref().join(DB_FILE).exists()
    }

    /// Opens (creating if needed) the store in `dir`, taking the directory's process lock and
    /// bringing the derived indexes up to date with redb. `options.dims == 0` opens an existing
    /// store with the dimension it was created with (for tools that load no embedder).
    pub fn open(dir: impl AsRef<Path>, options: StoreOptions) -> Result<Store> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io(&lock_path, e))?;
        // A process that starts a child (any thread of it) shares every open file with the
        // child until the child execs, the lock of a store just closed included: a lock held
        // that briefly is waited for, one held longer is another owner.
        let mut waited = std::time::Duration::ZERO;
        let mut locked = lock.try_lock();
        while matches!(locked, Err(std::fs::TryLockError::WouldBlock)) && waited < LOCK_PATIENCE {
            std::thread::sleep(LOCK_RETRY);
            waited += LOCK_RETRY;
            locked = lock.try_lock();
        }
        match locked {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::Locked(format!(
                    "store {} is already open in another process (it holds {}); \
                     stop that process or reach the memory through its server",
                    dir.display(),
                    lock_path.display()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(&lock_path, e)),
        }
        let db_path = dir.join(DB_FILE);
        let db = Database::create(&db_path).map_err(|e| {
            Error::Store(format!("cannot open database {}: {e}", db_path.display()))
        })?;
        let mut options = options;
        let (store_id, dims) = Self::init(&db, &options)?;
        options.dims = dims;
        let vectors = VectorIndexes::load(
            &dir.join("index").join("vectors"),
            options.dims,
            &options.index,
            &store_id,
        )?;
        let text = FullText::open(&dir.join("index").join("text"), &store_id)?;
        let store = Store {
            dir,
            db,
            options,
            store_id,
            write: Mutex::new(()),
            vectors: RwLock::new(vectors),
            text: RwLock::new(text),
            node_cache: RwLock::default(),
            _lock: lock,
        };
        store.recover()?;
        Ok(store)
    }

    /// Creates the tables, the store id and the dimension record on first open; checks them after.
    fn init(db: &Database, options: &StoreOptions) -> Result<(String, usize)> {
        let txn = db.begin_write().map_err(db_err)?;
        let store_id;
        let dims;
        {
            let w = Writer::open(&txn, options.dims, options.node_text_chars)?;
            let mut counters = w.counters;
            let stored_dims = counters.get("dims").map_err(db_err)?.map(|v| v.value());
            match stored_dims {
                Some(d) if options.dims == 0 => dims = d as usize,
                Some(d) if d as usize != options.dims => {
                    return Err(Error::Config(format!(
                        "this store holds {d}-dimensional vectors but the configured embedder \
                         produces {}; use the original embedder or a new store directory",
                        options.dims
                    )));
                }
                Some(_) => dims = options.dims,
                None if options.dims == 0 => {
                    return Err(Error::Config(
                        "vector dimensions must be positive (0 means \"as stored\", but this store is new)"
                            .into(),
                    ));
                }
                None => {
                    counters
                        .insert("dims", options.dims as u64)
                        .map_err(db_err)?;
                    dims = options.dims;
                }
            }
            let format = counters
                .get("format")
                .map_err(db_err)?
                .map_or(0, |v| v.value());
            if format > STORE_FORMAT {
                return Err(Error::Config(format!(
                    "this store was written by a newer lycheemem (store format {format}; this \
                     build reads formats up to {STORE_FORMAT}); upgrade lycheemem to open it"
                )));
            }
            if format < STORE_FORMAT {
                counters.insert("format", STORE_FORMAT).map_err(db_err)?;
            }
            let mut info = txn.open_table(INFO).map_err(db_err)?;
            let existing = info
                .get("store_id")
                .map_err(db_err)?
                .map(|v| v.value().to_string());
            store_id = match existing {
                Some(id) => id,
                None => {
                    let nanos = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos());
                    let id = format!("{nanos:x}-{:x}", std::process::id());
                    info.insert("store_id", id.as_str()).map_err(db_err)?;
                    id
                }
            };
        }
        txn.commit().map_err(db_err)?;
        Ok((store_id, dims))
    }

    fn counter(&self, name: &str) -> Result<u64> {
        let txn = self.db.begin_read().map_err(db_err)?;
        let t = txn.open_table(COUNTERS).map_err(db_err)?;
        Ok(t.get(name).map_err(db_err)?.map_or(0, |v| v.value()))
    }

    /// Runs `f` in one write transaction, commits it durably, then applies its changes to the
    /// derived indexes.
    pub(crate) fn write<T>(
        &self,
        f: impl FnOnce(&mut Writer<'_>) -> Result<T>,
    ) -> Result<(T, WriteReceipt)> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        let txn = self.db.begin_write().map_err(db_err)?;
        let (value, seq) = {
            let mut w = Writer::open(&txn, self.options.dims, self.options.node_text_chars)?;
            let value = f(&mut w)?;
            (value, w.finish()?)
        };
        txn.commit().map_err(db_err)?;
        self.node_cache
            .write()
            .unwrap_or_else(lock_poisoned)
            .invalidate();
        let mut vectors = self.vectors.write().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        let applied = self.apply_changes(&mut vectors, &mut text, seq);
        // Again now that the vector indexes hold the write (or failed to): a node resolved in
        // between may have read a member's vector as the index held it before.
        self.node_cache
            .write()
            .unwrap_or_else(lock_poisoned)
            .invalidate();
        applied?;
        // Saving costs time proportional to the index size and replaying on open costs time
        // proportional to the changes since the save: checkpoint when the changes reach a
        // quarter of the index (and at least `checkpoint_every`), so neither dominates.
        let threshold = self
            .options
            .index
            .checkpoint_every
            .max(vectors.total_len() as u64 / 4);
        if seq.saturating_sub(vectors.saved.min(text.committed)) >= threshold {
            self.checkpoint_locked(&mut vectors, &mut text)?;
        }
        Ok((value, WriteReceipt { seq }))
    }

    /// Changes the HNSW search beam width (`hnsw_expansion_search`) for this session: higher
    /// trades speed for recall.
    pub fn set_hnsw_expansion_search(&self, n: usize) {
        self.vectors
            .write()
            .unwrap_or_else(lock_poisoned)
            .set_expansion_search(n.max(1));
    }

    /// The directory this store lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    /// The current write sequence.
    pub fn seq(&self) -> Result<u64> {
        self.counter("seq")
    }

    // ----- writes -------------------------------------------------------------------------

    // ----- reads --------------------------------------------------------------------------

    fn read(&self) -> Result<redb::ReadTransaction> {
        self.db.begin_read().map_err(db_err)
    }

    /// Rows of a `ns \0 id` table: those of `ids` that exist, in the order asked, or (with
    /// `None`) every row of the namespace in id order.
    fn rows<R: serde::de::DeserializeOwned>(
        &self,
        table: redb::TableDefinition<&[u8], &[u8]>,
        ns: &Namespace,
        ids: Option<&[String]>,
        what: &str,
    ) -> Result<Vec<R>> {
        let txn = self.read()?;
        let t = txn.open_table(table).map_err(db_err)?;
        match ids {
            Some(ids) => ids
                .iter()
                .filter_map(|id| get_json::<R>(&t, &keys::ns_str(ns, id), what).transpose())
                .collect(),
            None => scan_prefix(&t, &keys::ns(ns))?
                .iter()
                .map(|(_, v)| from_json(v, what))
                .collect(),
        }
    }

    /// Total bytes of the database file and the index folders.
    pub fn disk_bytes(&self) -> u64 {
        fn size(p: &Path) -> u64 {
            match std::fs::metadata(p) {
                Ok(m) if m.is_dir() => std::fs::read_dir(p)
                    .map(|d| d.flatten().map(|e| size(&e.path())).sum())
                    .unwrap_or(0),
                Ok(m) => m.len(),
                Err(_) => 0,
            }
        }
        size(&self.dir)
    }

    pub(crate) fn read_txn(&self) -> Result<redb::ReadTransaction> {
        self.read()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.checkpoint() {
            tracing::warn!(
                "could not persist the indexes on close (they will catch up on open): {e}"
            );
        }
    }
}
