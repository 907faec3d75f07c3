//! [`Store`]: opening and recovery, transactional writes, cascading deletes, queries.

use lycheemem_core::date::parse_date;
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
use crate::tables::*;
use crate::types::*;
use crate::vectors::VectorIndexes;

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
    /// Held for the store's lifetime: the process lock on the directory.
    _lock: File,
}

const DB_FILE: &str = "store.redb";
const LOCK_FILE: &str = "LOCK";

fn lock_poisoned<T>(p: std::sync::PoisonError<T>) -> T {
    p.into_inner()
}

/// The redb tables of one write transaction plus the counters it advances.
pub(crate) struct Writer<'t> {
    sessions: Table<'t, &'static [u8], &'static [u8]>,
    turns: Table<'t, &'static [u8], &'static [u8]>,
    segments: Table<'t, &'static [u8], &'static [u8]>,
    records: Table<'t, &'static [u8], &'static [u8]>,
    nodes: Table<'t, &'static [u8], &'static [u8]>,
    record_nodes: Table<'t, &'static [u8], ()>,
    session_records: Table<'t, &'static [u8], ()>,
    state: Table<'t, &'static [u8], &'static [u8]>,
    usage: Table<'t, &'static [u8], &'static [u8]>,
    vectors: Table<'t, &'static [u8], &'static [u8]>,
    keys: Table<'t, &'static [u8], &'static str>,
    id_keys: Table<'t, &'static [u8], u64>,
    pending: Table<'t, &'static [u8], ()>,
    changes: Table<'t, u64, &'static [u8]>,
    counters: Table<'t, &'static str, u64>,
    seq: u64,
    next_key: u64,
    dims: usize,
    node_text_chars: usize,
}

impl<'t> Writer<'t> {
    fn open(txn: &'t redb::WriteTransaction, dims: usize, node_text_chars: usize) -> Result<Self> {
        let counters = txn.open_table(COUNTERS).map_err(db_err)?;
        let seq = counters
            .get("seq")
            .map_err(db_err)?
            .map_or(0, |v| v.value());
        let next_key = counters
            .get("next_key")
            .map_err(db_err)?
            .map_or(1, |v| v.value());
        Ok(Writer {
            sessions: txn.open_table(SESSIONS).map_err(db_err)?,
            turns: txn.open_table(TURNS).map_err(db_err)?,
            segments: txn.open_table(SEGMENTS).map_err(db_err)?,
            records: txn.open_table(RECORDS).map_err(db_err)?,
            nodes: txn.open_table(NODES).map_err(db_err)?,
            record_nodes: txn.open_table(RECORD_NODES).map_err(db_err)?,
            session_records: txn.open_table(SESSION_RECORDS).map_err(db_err)?,
            state: txn.open_table(STATE).map_err(db_err)?,
            usage: txn.open_table(USAGE).map_err(db_err)?,
            vectors: txn.open_table(VECTORS).map_err(db_err)?,
            keys: txn.open_table(KEYS).map_err(db_err)?,
            id_keys: txn.open_table(ID_KEYS).map_err(db_err)?,
            pending: txn.open_table(PENDING).map_err(db_err)?,
            changes: txn.open_table(CHANGES).map_err(db_err)?,
            counters,
            seq,
            next_key,
            dims,
            node_text_chars,
        })
    }

    fn finish(mut self) -> Result<u64> {
        self.counters.insert("seq", self.seq).map_err(db_err)?;
        self.counters
            .insert("next_key", self.next_key)
            .map_err(db_err)?;
        Ok(self.seq)
    }

    fn log(&mut self, change: &Change) -> Result<()> {
        self.seq += 1;
        self.changes
            .insert(self.seq, to_json(change)?.as_slice())
            .map_err(db_err)?;
        Ok(())
    }

    fn log_item(&mut self, ns: &Namespace, target: Target, id: &str, key: u64) -> Result<()> {
        self.log(&Change::Item {
            ns: ns.to_string(),
            target,
            id: id.to_string(),
            key,
        })
    }

    fn check_vector(&self, v: &[f32]) -> Result<()> {
        if v.len() != self.dims {
            return Err(Error::InvalidInput(format!(
                "vector has {} dimensions, the store holds {}-dimensional vectors",
                v.len(),
                self.dims
            )));
        }
        if v.iter().any(|x| !x.is_finite()) || v.iter().all(|x| *x == 0.0) {
            return Err(Error::InvalidInput(
                "vector must be finite and non-zero".into(),
            ));
        }
        Ok(())
    }

    /// Stores (or clears, marking it pending) the vector of an item and its key → id mapping.
    fn set_vector(
        &mut self,
        ns: &Namespace,
        target: Target,
        key: u64,
        id: &str,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        let vkey = keys::vector(ns, target, key);
        self.keys.insert(vkey.as_slice(), id).map_err(db_err)?;
        let pkey = keys::pending(ns, target, id);
        self.id_keys.insert(pkey.as_slice(), key).map_err(db_err)?;
        match vector {
            Some(v) => {
                self.check_vector(v)?;
                self.vectors
                    .insert(vkey.as_slice(), vector_to_bytes(v).as_slice())
                    .map_err(db_err)?;
                self.pending.remove(pkey.as_slice()).map_err(db_err)?;
            }
            None => {
                self.vectors.remove(vkey.as_slice()).map_err(db_err)?;
                self.pending.insert(pkey.as_slice(), ()).map_err(db_err)?;
            }
        }
        Ok(())
    }

    /// Removes an item's vector, key mapping and pending mark; true when a vector existed.
    fn drop_vector(&mut self, ns: &Namespace, target: Target, key: u64, id: &str) -> Result<bool> {
        let vkey = keys::vector(ns, target, key);
        self.keys.remove(vkey.as_slice()).map_err(db_err)?;
        let pkey = keys::pending(ns, target, id);
        self.pending.remove(pkey.as_slice()).map_err(db_err)?;
        self.id_keys.remove(pkey.as_slice()).map_err(db_err)?;
        Ok(self
            .vectors
            .remove(vkey.as_slice())
            .map_err(db_err)?
            .is_some())
    }

    fn alloc_key(&mut self) -> u64 {
        let k = self.next_key;
        self.next_key += 1;
        k
    }

    pub(crate) fn session(&self, ns: &Namespace, id: &SessionId) -> Result<Option<SessionInfo>> {
        get_json(&self.sessions, &keys::ns_str(ns, id.as_str()), "session")
    }

    pub(crate) fn put_session(&mut self, ns: &Namespace, info: &SessionInfo) -> Result<()> {
        let key = keys::ns_str(ns, info.id.as_str());
        self.sessions
            .insert(key.as_slice(), to_json(info)?.as_slice())
            .map_err(db_err)?;
        Ok(())
    }

    /// Appends a turn (its index must be the session's next) or accepts an identical retry.
    pub(crate) fn add_turn(
        &mut self,
        ns: &Namespace,
        turn: Turn,
        vector: Option<&[f32]>,
    ) -> Result<bool> {
        let mut session = match self.session(ns, &turn.session)? {
            Some(s) => s,
            None => SessionInfo::new(turn.session.clone(), None),
        };
        let tkey = keys::session_index(ns, &turn.session, turn.index);
        if turn.index < session.turn_count {
            let existing: Option<TurnRow> = get_json(&self.turns, &tkey, "turn")?;
            return match existing {
                Some(row) if row.turn == turn => Ok(false),
                _ => Err(Error::InvalidInput(format!(
                    "turn {}#{} already exists with different content (turns are append-only)",
                    turn.session, turn.index
                ))),
            };
        }
        if turn.index != session.turn_count {
            return Err(Error::InvalidInput(format!(
                "turn {}#{} skips ahead: the session's next turn index is {}",
                turn.session, turn.index, session.turn_count
            )));
        }
        if let Some(v) = vector {
            self.check_vector(v)?;
        }
        let key = self.alloc_key();
        let id = ItemRef::Turn(turn.turn_ref()).id();
        session.turn_count += 1;
        self.put_session(ns, &session)?;
        let row = TurnRow { turn, key };
        self.turns
            .insert(tkey.as_slice(), to_json(&row)?.as_slice())
            .map_err(db_err)?;
        self.set_vector(ns, Target::Turn, key, &id, vector)?;
        self.log_item(ns, Target::Turn, &id, key)?;
        Ok(true)
    }

    pub(crate) fn record(&self, ns: &Namespace, id: &str) -> Result<Option<RecordRow>> {
        get_json(&self.records, &keys::ns_str(ns, id), "record")
    }

    pub(crate) fn put_record(
        &mut self,
        ns: &Namespace,
        record: Record,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        let rkey = keys::ns_str(ns, &record.record_id);
        // A record whose id is stored is a restatement: `rules::merge_restatement` (SPEC §2).
        let (key, record, indexed) = match self.record(ns, &record.record_id)? {
            Some(old) => {
                let merged = crate::rules::merge_restatement(old.record, record);
                // The indexed text and session are the first statement's, so the indexes
                // already hold this record unless its vector is still pending.
                let vkey = keys::vector(ns, Target::Record, old.key);
                let has_vector = self.vectors.get(vkey.as_slice()).map_err(db_err)?.is_some();
                (old.key, merged, has_vector)
            }
            None => (self.alloc_key(), record, false),
        };
        let link = keys::pair(ns, record.source_session.as_str(), &record.record_id);
        self.session_records
            .insert(link.as_slice(), ())
            .map_err(db_err)?;
        let id = record.record_id.clone();
        if !indexed {
            self.set_vector(ns, Target::Record, key, &id, vector)?;
        }
        let row = RecordRow { record, key };
        self.records
            .insert(rkey.as_slice(), to_json(&row)?.as_slice())
            .map_err(db_err)?;
        if indexed {
            return Ok(());
        }
        self.log_item(ns, Target::Record, &id, key)
    }

    pub(crate) fn node(&self, ns: &Namespace, id: &str) -> Result<Option<NodeRow>> {
        get_json(&self.nodes, &keys::ns_str(ns, id), "node")
    }

    pub(crate) fn put_node(
        &mut self,
        ns: &Namespace,
        node: EvidenceNode,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        let nkey = keys::ns_str(ns, &node.node_id);
        let (key, old_links) = match self.node(ns, &node.node_id)? {
            Some(old) => (old.key, old.node.record_ids),
            None => (self.alloc_key(), BTreeSet::new()),
        };
        for gone in old_links.difference(&node.record_ids) {
            let link = keys::pair(ns, gone, &node.node_id);
            self.record_nodes.remove(link.as_slice()).map_err(db_err)?;
        }
        // Only new links are written: a heavy node gains a few records per segment, and
        // re-inserting all of its links on every update made bulk ingestion quadratic.
        for rid in node.record_ids.difference(&old_links) {
            let link = keys::pair(ns, rid, &node.node_id);
            self.record_nodes
                .insert(link.as_slice(), ())
                .map_err(db_err)?;
        }
        let id = node.node_id.clone();
        let target = Target::Node(node.kind);
        self.set_vector(ns, target, key, &id, vector)?;
        let row = NodeRow { node, key };
        self.nodes
            .insert(nkey.as_slice(), to_json(&row)?.as_slice())
            .map_err(db_err)?;
        self.log_item(ns, target, &id, key)
    }

    pub(crate) fn put_segment(&mut self, ns: &Namespace, row: &SegmentRow) -> Result<()> {
        let key = keys::session_index(ns, &row.segment.session, row.segment.first_turn);
        self.segments
            .insert(key.as_slice(), to_json(row)?.as_slice())
            .map_err(db_err)?;
        Ok(())
    }

    pub(crate) fn put_state(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<()> {
        let key = keys::session_str(ns, session, name);
        self.state
            .insert(key.as_slice(), to_json(value)?.as_slice())
            .map_err(db_err)?;
        Ok(())
    }

    pub(crate) fn log_usage(&mut self, ns: &Namespace, usage: &TokenUsage) -> Result<()> {
        // Usage entries are keyed by a fresh index key so they stay ordered and unique.
        let id = self.alloc_key();
        let key = keys::seq(ns, id);
        self.usage
            .insert(key.as_slice(), to_json(usage)?.as_slice())
            .map_err(db_err)?;
        Ok(())
    }

    /// Applies one finalized segment's write after validating that everything it references
    /// exists: its turns, every record's evidence turns, and every node's records.
    pub(crate) fn commit_segment(&mut self, ns: &Namespace, write: SegmentWrite) -> Result<()> {
        let seg = &write.segment;
        let session = self.session(ns, &seg.session)?.ok_or_else(|| {
            Error::InvalidInput(format!(
                "segment {}: unknown session {}",
                seg.id, seg.session
            ))
        })?;
        if seg.first_turn > seg.last_turn || seg.last_turn >= session.turn_count {
            return Err(Error::InvalidInput(format!(
                "segment {} covers turns {}..={} but session {} has {} turns",
                seg.id, seg.first_turn, seg.last_turn, seg.session, session.turn_count
            )));
        }
        for (r, _) in &write.records {
            let count = if r.source_session == seg.session {
                session.turn_count
            } else {
                self.session(ns, &r.source_session)?
                    .map_or(0, |s| s.turn_count)
            };
            if let Some(bad) = r.evidence_turns.iter().find(|t| **t >= count) {
                return Err(Error::InvalidInput(format!(
                    "record {} cites turn {}#{bad}, which is not stored",
                    r.record_id, r.source_session
                )));
            }
        }
        let new_ids: HashSet<&str> = write
            .records
            .iter()
            .map(|(r, _)| r.record_id.as_str())
            .collect();
        for (n, _) in &write.nodes {
            for rid in &n.record_ids {
                if !new_ids.contains(rid.as_str()) && self.record(ns, rid)?.is_none() {
                    return Err(Error::InvalidInput(format!(
                        "node {} links record {rid}, which is not stored",
                        n.node_id
                    )));
                }
            }
        }
        let row = SegmentRow {
            segment: seg.clone(),
            outcome: write.outcome.clone(),
            record_ids: write
                .records
                .iter()
                .map(|(r, _)| r.record_id.clone())
                .collect(),
            seq: self.seq + 1,
        };
        self.put_segment(ns, &row)?;
        for (record, vector) in write.records {
            self.put_record(ns, record, vector.as_deref())?;
        }
        for (node, vector) in write.nodes {
            self.put_node(ns, node, vector.as_deref())?;
        }
        for (session, name, value) in &write.state {
            self.put_state(ns, session, name, value)?;
        }
        for u in &write.usage {
            self.log_usage(ns, u)?;
        }
        Ok(())
    }

    /// Deletes a record and unlinks it from its nodes; nodes left empty are deleted, the others
    /// are rewritten from their remaining records and queued for re-embedding.
    pub(crate) fn delete_record(&mut self, ns: &Namespace, id: &str) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let Some(row) = self.record(ns, id)? else {
            return Ok(receipt);
        };
        self.records
            .remove(keys::ns_str(ns, id).as_slice())
            .map_err(db_err)?;
        let link = keys::pair(ns, row.record.source_session.as_str(), id);
        self.session_records
            .remove(link.as_slice())
            .map_err(db_err)?;
        if self.drop_vector(ns, Target::Record, row.key, id)? {
            receipt.vectors += 1;
        }
        self.log_item(ns, Target::Record, id, row.key)?;
        receipt.records += 1;
        // Every segment of the session that stated the record (a restatement unions into the
        // first one) stops listing it.
        let seg_prefix = keys::session(ns, &row.record.source_session);
        for (k, v) in scan_prefix(&self.segments, &seg_prefix)? {
            let mut seg: SegmentRow = from_json(&v, "segment")?;
            if seg.record_ids.iter().any(|r| r == id) {
                seg.record_ids.retain(|r| r != id);
                self.segments
                    .insert(k.as_slice(), to_json(&seg)?.as_slice())
                    .map_err(db_err)?;
            }
        }
        let prefix = keys::pair(ns, id, "");
        let links = scan_keys(&self.record_nodes, &prefix)?;
        for link in links {
            self.record_nodes.remove(link.as_slice()).map_err(db_err)?;
            let node_id = String::from_utf8_lossy(keys::suffix(&link, &prefix)).into_owned();
            let Some(mut node_row) = self.node(ns, &node_id)? else {
                continue;
            };
            node_row.node.record_ids.remove(id);
            if node_row.node.record_ids.is_empty() {
                receipt.add(&self.delete_node(ns, &node_id)?);
            } else {
                let node = self.rebuild_node(ns, node_row.node)?;
                self.put_node(ns, node, None)?;
                receipt.nodes_updated += 1;
            }
        }
        Ok(receipt)
    }

    /// Recomputes a node's derived fields from the records it still links.
    fn rebuild_node(&self, ns: &Namespace, node: EvidenceNode) -> Result<EvidenceNode> {
        let mut records = Vec::with_capacity(node.record_ids.len());
        for rid in &node.record_ids {
            if let Some(r) = self.record(ns, rid)? {
                records.push(r.record);
            }
        }
        Ok(crate::rules::rebuild_node(
            node,
            &records,
            self.node_text_chars,
        ))
    }

    fn delete_node(&mut self, ns: &Namespace, id: &str) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let Some(row) = self.node(ns, id)? else {
            return Ok(receipt);
        };
        self.nodes
            .remove(keys::ns_str(ns, id).as_slice())
            .map_err(db_err)?;
        for rid in &row.node.record_ids {
            let link = keys::pair(ns, rid, id);
            self.record_nodes.remove(link.as_slice()).map_err(db_err)?;
        }
        let target = Target::Node(row.node.kind);
        if self.drop_vector(ns, target, row.key, id)? {
            receipt.vectors += 1;
        }
        self.log_item(ns, target, id, row.key)?;
        receipt.nodes_removed += 1;
        Ok(receipt)
    }

    /// Deletes what was derived from a session's turns — its records (cascading to nodes),
    /// segments and state — keeping the session and its raw turns.
    pub(crate) fn clear_session_derived(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
    ) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let prefix = keys::session(ns, session);
        for link in scan_keys(&self.session_records, &prefix)? {
            let rid = String::from_utf8_lossy(keys::suffix(&link, &prefix)).into_owned();
            receipt.add(&self.delete_record(ns, &rid)?);
        }
        for (k, _) in scan_prefix(&self.segments, &prefix)? {
            self.segments.remove(k.as_slice()).map_err(db_err)?;
            receipt.segments += 1;
        }
        for (k, _) in scan_prefix(&self.state, &prefix)? {
            self.state.remove(k.as_slice()).map_err(db_err)?;
            receipt.state_entries += 1;
        }
        Ok(receipt)
    }

    pub(crate) fn delete_session(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
    ) -> Result<DeleteReceipt> {
        let mut receipt = self.clear_session_derived(ns, session)?;
        let prefix = keys::session(ns, session);
        for (k, v) in scan_prefix(&self.turns, &prefix)? {
            let row: TurnRow = from_json(&v, "turn")?;
            self.turns.remove(k.as_slice()).map_err(db_err)?;
            let id = ItemRef::Turn(row.turn.turn_ref()).id();
            if self.drop_vector(ns, Target::Turn, row.key, &id)? {
                receipt.vectors += 1;
            }
            self.log_item(ns, Target::Turn, &id, row.key)?;
            receipt.turns += 1;
        }
        let skey = keys::ns_str(ns, session.as_str());
        if self
            .sessions
            .remove(skey.as_slice())
            .map_err(db_err)?
            .is_some()
        {
            receipt.sessions += 1;
        }
        Ok(receipt)
    }

    pub(crate) fn delete_namespace(&mut self, ns: &Namespace) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let prefix = keys::ns(ns);
        let end = keys::prefix_end(&prefix);
        let range = prefix.as_slice()..end.as_slice();
        fn drain<V: redb::Value + 'static>(
            table: &mut Table<'_, &'static [u8], V>,
            range: std::ops::Range<&[u8]>,
        ) -> Result<u64> {
            let mut n = 0;
            table
                .retain_in(range, |_, _| {
                    n += 1;
                    false
                })
                .map_err(db_err)?;
            Ok(n)
        }
        receipt.sessions = drain(&mut self.sessions, range.clone())?;
        receipt.turns = drain(&mut self.turns, range.clone())?;
        receipt.segments = drain(&mut self.segments, range.clone())?;
        receipt.records = drain(&mut self.records, range.clone())?;
        receipt.nodes_removed = drain(&mut self.nodes, range.clone())?;
        drain(&mut self.record_nodes, range.clone())?;
        drain(&mut self.session_records, range.clone())?;
        receipt.state_entries = drain(&mut self.state, range.clone())?;
        receipt.usage_entries = drain(&mut self.usage, range.clone())?;
        receipt.vectors = drain(&mut self.vectors, range.clone())?;
        drain(&mut self.keys, range.clone())?;
        drain(&mut self.id_keys, range.clone())?;
        drain(&mut self.pending, range)?;
        self.log(&Change::DropNamespace { ns: ns.to_string() })?;
        Ok(receipt)
    }

    /// Replaces the vector of an existing item; false when the item does not exist.
    pub(crate) fn set_item_vector(
        &mut self,
        ns: &Namespace,
        item: &ItemRef,
        vector: &[f32],
    ) -> Result<bool> {
        let (target, key, id) = match item {
            ItemRef::Record(id) => match self.record(ns, id)? {
                Some(r) => (Target::Record, r.key, id.clone()),
                None => return Ok(false),
            },
            ItemRef::Node(id) => match self.node(ns, id)? {
                Some(n) => (Target::Node(n.node.kind), n.key, id.clone()),
                None => return Ok(false),
            },
            ItemRef::Turn(t) => {
                let tkey = keys::session_index(ns, &t.session, t.index);
                match get_json::<TurnRow>(&self.turns, &tkey, "turn")? {
                    Some(row) => (Target::Turn, row.key, item.id()),
                    None => return Ok(false),
                }
            }
        };
        self.set_vector(ns, target, key, &id, Some(vector))?;
        self.log_item(ns, target, &id, key)?;
        Ok(true)
    }
}

/// The index target of an item (a node's kind is the prefix of its id).
fn item_target(item: &ItemRef) -> Target {
    match item {
        ItemRef::Record(_) => Target::Record,
        ItemRef::Turn(_) => Target::Turn,
        ItemRef::Node(id) => NodeKind::ALL
            .into_iter()
            .find(|k| id.starts_with(&format!("{}:", k.as_str())))
            .map_or(Target::Node(NodeKind::Entity), Target::Node),
    }
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

fn record_text(r: &Record) -> String {
    let mut text = r.normalized_text.clone();
    for extra in r.entities.iter().chain(&r.tags) {
        text.push_str(" | ");
        text.push_str(extra);
    }
    text
}

fn turn_text(t: &Turn) -> String {
    format!("{}: {}", t.author(), t.text)
}

impl Store {
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
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::Store(format!(
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

    /// Brings both derived indexes up to redb's write sequence: replays the change log when it
    /// still covers their position, otherwise rebuilds them from the tables.
    fn recover(&self) -> Result<()> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        self.backfill_id_keys()?;
        let seq = self.counter("seq")?;
        let floor = self.counter("log_floor")?;
        let mut vectors = self.vectors.write().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        let mut rebuilt = false;
        if vectors.applied > seq || vectors.applied < floor {
            self.rebuild_vectors(&mut vectors, seq)?;
            rebuilt = true;
        }
        if text.applied > seq || text.applied < floor {
            self.rebuild_text(&mut text, seq)?;
            rebuilt = true;
        }
        self.apply_changes(&mut vectors, &mut text, seq)?;
        if rebuilt {
            self.checkpoint_locked(&mut vectors, &mut text)?;
        }
        Ok(())
    }

    /// Stores written before the id → key table existed get it filled from the key → id table.
    fn backfill_id_keys(&self) -> Result<()> {
        if self.counter("id_keys_filled")? == 1 {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let key_table = txn.open_table(KEYS).map_err(db_err)?;
            let mut id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
            for entry in key_table.iter().map_err(db_err)? {
                let (k, id) = entry.map_err(db_err)?;
                let k = k.value();
                let Some(ns) = key_namespace(k) else { continue };
                let rest = &k[ns.len() + 1..];
                if rest.len() != 9 {
                    continue;
                }
                let mut id_key = k[..ns.len() + 2].to_vec();
                id_key.extend_from_slice(id.value().as_bytes());
                id_keys
                    .insert(id_key.as_slice(), keys::be_u64(&rest[1..]))
                    .map_err(db_err)?;
            }
            let mut counters = txn.open_table(COUNTERS).map_err(db_err)?;
            counters.insert("id_keys_filled", 1).map_err(db_err)?;
        }
        txn.commit().map_err(db_err)
    }

    fn rebuild_vectors(&self, vectors: &mut VectorIndexes, seq: u64) -> Result<()> {
        tracing::info!("rebuilding vector indexes from the database");
        vectors.reset()?;
        let txn = self.db.begin_read().map_err(db_err)?;
        let table = txn.open_table(VECTORS).map_err(db_err)?;
        let mut batch = Vec::new();
        for entry in table.iter().map_err(db_err)? {
            let (k, v) = entry.map_err(db_err)?;
            let k = k.value();
            let Some(ns) = key_namespace(k) else { continue };
            let rest = &k[ns.len() + 1..];
            if rest.len() != 9 {
                continue;
            }
            let target = Target::ALL[usize::from(rest[0]).min(Target::ALL.len() - 1)];
            batch.push((
                ns.to_string(),
                target,
                keys::be_u64(&rest[1..]),
                vector_from_bytes(v.value()),
            ));
            if batch.len() >= 20_000 {
                vectors.upsert_many(std::mem::take(&mut batch))?;
            }
        }
        vectors.upsert_many(batch)?;
        vectors.applied = seq;
        Ok(())
    }

    fn rebuild_text(&self, text: &mut FullText, seq: u64) -> Result<()> {
        tracing::info!("rebuilding the full-text index from the database");
        text.clear()?;
        let txn = self.db.begin_read().map_err(db_err)?;
        for table_def in [RECORDS, NODES, TURNS] {
            let table = txn.open_table(table_def).map_err(db_err)?;
            for entry in table.iter().map_err(db_err)? {
                let (k, v) = entry.map_err(db_err)?;
                let Some(ns) = key_namespace(k.value()) else {
                    continue;
                };
                let (target, id, item) = decode_item(table_def.name(), v.value())?;
                text.upsert(&TextDoc {
                    key: item.key,
                    ns,
                    target,
                    sessions: item.sessions.iter().map(String::as_str).collect(),
                    id: &id,
                    text: &item.text,
                })?;
            }
        }
        text.applied = seq;
        Ok(())
    }

    /// Applies the logged changes after each index's position up to `upto`.
    fn apply_changes(
        &self,
        vectors: &mut VectorIndexes,
        text: &mut FullText,
        upto: u64,
    ) -> Result<()> {
        let from = vectors.applied.min(text.applied);
        if from >= upto {
            return Ok(());
        }
        let txn = self.db.begin_read().map_err(db_err)?;
        let changes = txn.open_table(CHANGES).map_err(db_err)?;
        let records = txn.open_table(RECORDS).map_err(db_err)?;
        let nodes = txn.open_table(NODES).map_err(db_err)?;
        let turns = txn.open_table(TURNS).map_err(db_err)?;
        let vector_table = txn.open_table(VECTORS).map_err(db_err)?;
        // Vector inserts are batched (and inserted in parallel); a removal flushes the batch
        // first so operations on one key keep their order.
        let mut batch: Vec<(String, Target, u64, Vec<f32>)> = Vec::new();
        for entry in changes.range(from + 1..=upto).map_err(db_err)? {
            let (seq, bytes) = entry.map_err(db_err)?;
            let seq = seq.value();
            let change: Change = from_json(bytes.value(), "change")?;
            match change {
                Change::DropNamespace { ns } => {
                    if vectors.applied < seq {
                        vectors.upsert_many(std::mem::take(&mut batch))?;
                        vectors.drop_namespace(&ns)?;
                    }
                    if text.applied < seq {
                        text.drop_namespace(&ns);
                    }
                }
                Change::Item {
                    ns,
                    target,
                    id,
                    key,
                } => {
                    let namespace = Namespace::new(ns.clone())?;
                    let current = match target {
                        Target::Record => get_json::<RecordRow>(
                            &records,
                            &keys::ns_str(&namespace, &id),
                            "record",
                        )?
                        .map(|r| IndexedItem {
                            key: r.key,
                            text: record_text(&r.record),
                            sessions: vec![r.record.source_session.to_string()],
                        }),
                        Target::Node(_) => {
                            get_json::<NodeRow>(&nodes, &keys::ns_str(&namespace, &id), "node")?
                                .map(|n| IndexedItem {
                                    key: n.key,
                                    text: n.node.search_text,
                                    sessions: n.node.sessions.into_iter().collect(),
                                })
                        }
                        Target::Turn => match ItemRef::from_id(Target::Turn, &id)? {
                            ItemRef::Turn(t) => get_json::<TurnRow>(
                                &turns,
                                &keys::session_index(&namespace, &t.session, t.index),
                                "turn",
                            )?
                            .map(|r| IndexedItem {
                                key: r.key,
                                text: turn_text(&r.turn),
                                sessions: vec![r.turn.session.to_string()],
                            }),
                            _ => None,
                        },
                    }
                    .filter(|item| item.key == key);
                    if vectors.applied < seq {
                        let vkey = keys::vector(&namespace, target, key);
                        let vector = match &current {
                            Some(_) => vector_table
                                .get(vkey.as_slice())
                                .map_err(db_err)?
                                .map(|v| vector_from_bytes(v.value())),
                            None => None,
                        };
                        match vector {
                            Some(v) => batch.push((ns.clone(), target, key, v)),
                            None => {
                                vectors.upsert_many(std::mem::take(&mut batch))?;
                                vectors.remove(&ns, target, key)?;
                            }
                        }
                    }
                    if text.applied < seq {
                        match &current {
                            Some(item) => text.upsert(&TextDoc {
                                key,
                                ns: &ns,
                                target,
                                sessions: item.sessions.iter().map(String::as_str).collect(),
                                id: &id,
                                text: &item.text,
                            })?,
                            None => text.remove(key),
                        }
                    }
                }
            }
        }
        vectors.upsert_many(batch)?;
        vectors.applied = vectors.applied.max(upto);
        text.applied = text.applied.max(upto);
        Ok(())
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
        let mut vectors = self.vectors.write().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        self.apply_changes(&mut vectors, &mut text, seq)?;
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

    fn checkpoint_locked(&self, vectors: &mut VectorIndexes, text: &mut FullText) -> Result<()> {
        vectors.save(&self.store_id)?;
        text.commit(&self.store_id)?;
        let floor = vectors.saved.min(text.committed);
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut changes = txn.open_table(CHANGES).map_err(db_err)?;
            changes.retain_in(..=floor, |_, _| false).map_err(db_err)?;
            let mut counters = txn.open_table(COUNTERS).map_err(db_err)?;
            counters.insert("log_floor", floor).map_err(db_err)?;
        }
        txn.commit().map_err(db_err)?;
        Ok(())
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

    /// Top-k among `allowed` keys: exact for small sets, else filtered HNSW, falling back to
    /// exact when the filtered search comes back short.
    fn search_allowed(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        target: Target,
        vector: &[f32],
        k: usize,
        allowed: &HashSet<u64>,
    ) -> Result<Vec<(u64, f32)>> {
        let approximate = if allowed.len() > self.options.index.exact_search_below {
            let vectors = self.vectors.read().unwrap_or_else(lock_poisoned);
            Some(vectors.search(ns.as_str(), target, vector, k, Some(allowed))?)
        } else {
            None
        };
        match approximate {
            Some(hits) if hits.len() >= k.min(allowed.len()) => Ok(hits),
            _ => self.exact_search(txn, ns, target, vector, k, allowed),
        }
    }

    /// Index keys of the items of `target` that belong to `session`.
    fn session_keys(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        target: Target,
        session: &SessionId,
    ) -> Result<HashSet<u64>> {
        let prefix = keys::session(ns, session);
        let mut out = HashSet::new();
        match target {
            Target::Turn => {
                let t = txn.open_table(TURNS).map_err(db_err)?;
                for (_, v) in scan_prefix(&t, &prefix)? {
                    out.insert(from_json::<TurnRow>(&v, "turn")?.key);
                }
            }
            Target::Record | Target::Node(_) => {
                let links = txn.open_table(SESSION_RECORDS).map_err(db_err)?;
                let records = txn.open_table(RECORDS).map_err(db_err)?;
                let record_nodes = txn.open_table(RECORD_NODES).map_err(db_err)?;
                let nodes = txn.open_table(NODES).map_err(db_err)?;
                for link in scan_keys(&links, &prefix)? {
                    let rid = String::from_utf8_lossy(keys::suffix(&link, &prefix)).into_owned();
                    if let Target::Node(kind) = target {
                        let rprefix = keys::pair(ns, &rid, "");
                        for nlink in scan_keys(&record_nodes, &rprefix)? {
                            let nid = String::from_utf8_lossy(keys::suffix(&nlink, &rprefix));
                            if !nid.starts_with(&format!("{}:", kind.as_str())) {
                                continue;
                            }
                            if let Some(n) =
                                get_json::<NodeRow>(&nodes, &keys::ns_str(ns, &nid), "node")?
                            {
                                out.insert(n.key);
                            }
                        }
                    } else if let Some(r) =
                        get_json::<RecordRow>(&records, &keys::ns_str(ns, &rid), "record")?
                    {
                        out.insert(r.key);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Index keys of all of one namespace's items of `target` (the key → id table's range).
    fn target_keys(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        target: Target,
    ) -> Result<HashSet<u64>> {
        let mut prefix = keys::ns(ns);
        prefix.push(target.code());
        let end = keys::prefix_end(&prefix);
        let table = txn.open_table(KEYS).map_err(db_err)?;
        let mut out = HashSet::new();
        for entry in table
            .range(prefix.as_slice()..end.as_slice())
            .map_err(db_err)?
        {
            let (k, _) = entry.map_err(db_err)?;
            let k = k.value();
            if k.len() == prefix.len() + 8 {
                out.insert(keys::be_u64(&k[prefix.len()..]));
            }
        }
        Ok(out)
    }

    fn exact_search(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        target: Target,
        query: &[f32],
        k: usize,
        allowed: &HashSet<u64>,
    ) -> Result<Vec<(u64, f32)>> {
        let table = txn.open_table(VECTORS).map_err(db_err)?;
        let keys_list: Vec<u64> = allowed.iter().copied().collect();
        let indexed = self.vectors.read().unwrap_or_else(lock_poisoned).get_many(
            ns.as_str(),
            target,
            &keys_list,
        );
        let mut scored = Vec::with_capacity(allowed.len());
        for (key, found) in keys_list.into_iter().zip(indexed) {
            // In-memory indexed vector first; the stored row for vectors not indexed yet.
            let v = match found {
                Some(v) => v,
                None => match stored_vector(&table, ns, target, key)? {
                    Some(v) => v,
                    None => continue,
                },
            };
            scored.push((key, lycheemem_core::vector::cosine(&v, query)));
        }
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.truncate(k);
        Ok(scored)
    }

    /// Makes recent writes visible to full-text search.
    fn commit_text_if_dirty(&self) -> Result<()> {
        if !self.text.read().unwrap_or_else(lock_poisoned).is_dirty() {
            return Ok(());
        }
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        if text.is_dirty() {
            text.commit(&self.store_id)?;
        }
        Ok(())
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

/// Decodes a row of the records, nodes or turns table into what the indexes need.
fn decode_item(table: &str, bytes: &[u8]) -> Result<(Target, String, IndexedItem)> {
    Ok(match table {
        "records" => {
            let r: RecordRow = from_json(bytes, "record")?;
            (
                Target::Record,
                r.record.record_id.clone(),
                IndexedItem {
                    key: r.key,
                    text: record_text(&r.record),
                    sessions: vec![r.record.source_session.to_string()],
                },
            )
        }
        "nodes" => {
            let n: NodeRow = from_json(bytes, "node")?;
            (
                Target::Node(n.node.kind),
                n.node.node_id.clone(),
                IndexedItem {
                    key: n.key,
                    text: n.node.search_text.clone(),
                    sessions: n.node.sessions.iter().cloned().collect(),
                },
            )
        }
        _ => {
            let t: TurnRow = from_json(bytes, "turn")?;
            (
                Target::Turn,
                ItemRef::Turn(t.turn.turn_ref()).id(),
                IndexedItem {
                    key: t.key,
                    text: turn_text(&t.turn),
                    sessions: vec![t.turn.session.to_string()],
                },
            )
        }
    })
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

/// The stored (database) vector of one key.
fn stored_vector(
    table: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    ns: &Namespace,
    target: Target,
    key: u64,
) -> Result<Option<Vec<f32>>> {
    Ok(table
        .get(keys::vector(ns, target, key).as_slice())
        .map_err(db_err)?
        .map(|v| vector_from_bytes(v.value())))
}

impl StoreLookup for Store {
    fn session(&self, ns: &Namespace, id: &SessionId) -> Result<Option<SessionInfo>> {
        let txn = self.read()?;
        let t = txn.open_table(SESSIONS).map_err(db_err)?;
        get_json(&t, &keys::ns_str(ns, id.as_str()), "session")
    }

    fn turn_range(
        &self,
        ns: &Namespace,
        session: &SessionId,
        first: u32,
        last: u32,
    ) -> Result<Vec<Turn>> {
        let txn = self.read()?;
        let t = txn.open_table(TURNS).map_err(db_err)?;
        let start = keys::session_index(ns, session, first);
        let end = keys::session_index(ns, session, last);
        let mut out = Vec::new();
        for entry in t.range(start.as_slice()..=end.as_slice()).map_err(db_err)? {
            let (_, v) = entry.map_err(db_err)?;
            out.push(from_json::<TurnRow>(v.value(), "turn")?.turn);
        }
        Ok(out)
    }

    fn records(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<Record>> {
        let rows: Vec<RecordRow> = self.rows(RECORDS, ns, Some(ids), "record")?;
        Ok(rows.into_iter().map(|r| r.record).collect())
    }

    fn nodes(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<EvidenceNode>> {
        let rows: Vec<NodeRow> = self.rows(NODES, ns, Some(ids), "node")?;
        Ok(rows.into_iter().map(|r| r.node).collect())
    }

    fn state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
    ) -> Result<Option<serde_json::Value>> {
        let txn = self.read()?;
        let t = txn.open_table(STATE).map_err(db_err)?;
        get_json(&t, &keys::session_str(ns, session, name), "state")
    }
}

impl StoreSearch for Store {
    fn vector_search(&self, ns: &Namespace, q: &VectorQuery) -> Result<Vec<Hit>> {
        if q.vector.len() != self.options.dims {
            return Err(Error::InvalidInput(format!(
                "query vector has {} dimensions, the store holds {}",
                q.vector.len(),
                self.options.dims
            )));
        }
        let txn = self.read()?;
        let hits = match &q.session {
            None => {
                let vectors = self.vectors.read().unwrap_or_else(lock_poisoned);
                if vectors.len(ns.as_str(), q.target) > self.options.index.exact_search_below {
                    vectors.search(ns.as_str(), q.target, &q.vector, q.k, None)?
                } else {
                    drop(vectors);
                    let all = self.target_keys(&txn, ns, q.target)?;
                    self.exact_search(&txn, ns, q.target, &q.vector, q.k, &all)?
                }
            }
            Some(session) => {
                let allowed = self.session_keys(&txn, ns, q.target, session)?;
                self.search_allowed(&txn, ns, q.target, &q.vector, q.k, &allowed)?
            }
        };
        let key_table = txn.open_table(KEYS).map_err(db_err)?;
        let mut out = Vec::with_capacity(hits.len());
        for (key, score) in hits {
            if let Some(id) = key_table
                .get(keys::vector(ns, q.target, key).as_slice())
                .map_err(db_err)?
            {
                out.push(Hit {
                    item: ItemRef::from_id(q.target, id.value())?,
                    target: q.target,
                    score,
                });
            }
        }
        Ok(out)
    }

    fn vector_search_within(
        &self,
        ns: &Namespace,
        target: Target,
        vector: &[f32],
        k: usize,
        ids: &[String],
    ) -> Result<Vec<Hit>> {
        let txn = self.read()?;
        let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
        let mut allowed = HashSet::with_capacity(ids.len());
        let mut by_key = HashMap::with_capacity(ids.len());
        for id in ids {
            if let Some(k) = id_keys
                .get(keys::pending(ns, target, id).as_slice())
                .map_err(db_err)?
            {
                allowed.insert(k.value());
                by_key.insert(k.value(), id.as_str());
            }
        }
        let hits = self.search_allowed(&txn, ns, target, vector, k, &allowed)?;
        hits.into_iter()
            .filter_map(|(key, score)| by_key.get(&key).map(|id| (id, score)))
            .map(|(id, score)| {
                Ok(Hit {
                    item: ItemRef::from_id(target, id)?,
                    target,
                    score,
                })
            })
            .collect()
    }

    fn text_search(
        &self,
        ns: &Namespace,
        target: Target,
        query: &str,
        k: usize,
        session: Option<&SessionId>,
    ) -> Result<Vec<Hit>> {
        self.commit_text_if_dirty()?;
        let text = self.text.read().unwrap_or_else(lock_poisoned);
        text.search(
            ns.as_str(),
            target,
            query,
            k,
            session.map(SessionId::as_str),
        )?
        .into_iter()
        .map(|(id, score)| {
            Ok(Hit {
                item: ItemRef::from_id(target, &id)?,
                target,
                score,
            })
        })
        .collect()
    }

    fn temporal_nodes(
        &self,
        ns: &Namespace,
        since: &str,
        until: &str,
    ) -> Result<Vec<EvidenceNode>> {
        let parse = |s: &str| {
            parse_date(s)
                .map(|d| d.date)
                .ok_or_else(|| Error::InvalidInput(format!("unparseable date bound {s:?}")))
        };
        let (since, until) = (parse(since)?.first_day(), parse(until)?.last_day());
        if since > until {
            return Ok(Vec::new());
        }
        let txn = self.read()?;
        let t = txn.open_table(NODES).map_err(db_err)?;
        let day = |d: chrono::NaiveDate| NodeKind::Temporal.node_id(&format!("day:{d}"));
        let month = |d: chrono::NaiveDate| {
            NodeKind::Temporal.node_id(&format!("month:{}", d.format("%Y-%m")))
        };
        let mut out = Vec::new();
        for (lo, hi) in [(day(since), day(until)), (month(since), month(until))] {
            let lo = keys::ns_str(ns, &lo);
            let hi = keys::ns_str(ns, &hi);
            for entry in t.range(lo.as_slice()..=hi.as_slice()).map_err(db_err)? {
                let (_, v) = entry.map_err(db_err)?;
                out.push(from_json::<NodeRow>(v.value(), "node")?.node);
            }
        }
        Ok(out)
    }

    fn scoring_vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>> {
        let txn = self.read()?;
        let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
        let mut keyed = Vec::with_capacity(items.len());
        for item in items {
            let target = item_target(item);
            let key = id_keys
                .get(keys::pending(ns, target, &item.id()).as_slice())
                .map_err(db_err)?
                .map(|k| k.value());
            keyed.push((target, key));
        }
        let indexed: Vec<Option<Vec<f32>>> = {
            let vectors = self.vectors.read().unwrap_or_else(lock_poisoned);
            keyed
                .iter()
                .map(|(target, key)| {
                    let key = (*key)?;
                    vectors.get_many(ns.as_str(), *target, &[key]).pop()?
                })
                .collect()
        };
        let table = txn.open_table(VECTORS).map_err(db_err)?;
        let mut out = Vec::with_capacity(items.len());
        for ((target, key), found) in keyed.into_iter().zip(indexed) {
            out.push(match (found, key) {
                (Some(v), _) => Some(v),
                (None, Some(key)) => stored_vector(&table, ns, target, key)?,
                (None, None) => None,
            });
        }
        Ok(out)
    }
}

impl StoreCatalog for Store {
    fn namespaces(&self) -> Result<Vec<Namespace>> {
        let txn = self.read()?;
        let table = txn.open_table(SESSIONS).map_err(db_err)?;
        let mut out: Vec<Namespace> = Vec::new();
        for entry in table.iter().map_err(db_err)? {
            let (k, _) = entry.map_err(db_err)?;
            if let Some(ns) = key_namespace(k.value())
                && out.last().is_none_or(|l| l.as_str() != ns)
            {
                out.push(Namespace::new(ns)?);
            }
        }
        Ok(out)
    }

    fn has_namespace(&self, ns: &Namespace) -> Result<bool> {
        let txn = self.read()?;
        let t = txn.open_table(SESSIONS).map_err(db_err)?;
        let start = keys::ns(ns);
        let end = keys::prefix_end(&start);
        let mut range = t.range(start.as_slice()..end.as_slice()).map_err(db_err)?;
        Ok(range.next().transpose().map_err(db_err)?.is_some())
    }

    fn sessions(&self, ns: &Namespace) -> Result<Vec<SessionInfo>> {
        let txn = self.read()?;
        let t = txn.open_table(SESSIONS).map_err(db_err)?;
        scan_prefix(&t, &keys::ns(ns))?
            .iter()
            .map(|(_, v)| from_json(v, "session"))
            .collect()
    }

    fn turns(&self, ns: &Namespace, session: &SessionId) -> Result<Vec<Turn>> {
        self.turn_range(ns, session, 0, u32::MAX)
    }

    fn turn_window(&self, ns: &Namespace, at: &TurnRef, radius: u32) -> Result<Vec<Turn>> {
        self.turn_range(
            ns,
            &at.session,
            at.index.saturating_sub(radius),
            at.index.saturating_add(radius),
        )
    }

    fn all_records(&self, ns: &Namespace) -> Result<Vec<Record>> {
        let rows: Vec<RecordRow> = self.rows(RECORDS, ns, None, "record")?;
        Ok(rows.into_iter().map(|r| r.record).collect())
    }

    fn records_page(
        &self,
        ns: &Namespace,
        session: Option<&SessionId>,
        offset: usize,
        limit: usize,
    ) -> Result<(usize, Vec<Record>)> {
        let txn = self.read()?;
        let records = txn.open_table(RECORDS).map_err(db_err)?;
        let mut total = 0usize;
        let mut page = Vec::new();
        match session {
            None => {
                let prefix = keys::ns(ns);
                let end = keys::prefix_end(&prefix);
                for entry in records
                    .range(prefix.as_slice()..end.as_slice())
                    .map_err(db_err)?
                {
                    let (_, v) = entry.map_err(db_err)?;
                    if total >= offset && page.len() < limit {
                        page.push(from_json::<RecordRow>(v.value(), "record")?.record);
                    }
                    total += 1;
                }
            }
            Some(session) => {
                let links = txn.open_table(SESSION_RECORDS).map_err(db_err)?;
                let prefix = keys::session(ns, session);
                let end = keys::prefix_end(&prefix);
                for entry in links
                    .range(prefix.as_slice()..end.as_slice())
                    .map_err(db_err)?
                {
                    let (k, _) = entry.map_err(db_err)?;
                    if total >= offset && page.len() < limit {
                        let rid = String::from_utf8_lossy(keys::suffix(k.value(), &prefix));
                        if let Some(row) =
                            get_json::<RecordRow>(&records, &keys::ns_str(ns, &rid), "record")?
                        {
                            page.push(row.record);
                        }
                    }
                    total += 1;
                }
            }
        }
        Ok((total, page))
    }

    fn all_nodes(&self, ns: &Namespace) -> Result<Vec<EvidenceNode>> {
        let rows: Vec<NodeRow> = self.rows(NODES, ns, None, "node")?;
        Ok(rows.into_iter().map(|r| r.node).collect())
    }

    fn segments(&self, ns: &Namespace, session: &SessionId) -> Result<Vec<SegmentRow>> {
        let txn = self.read()?;
        let t = txn.open_table(SEGMENTS).map_err(db_err)?;
        scan_prefix(&t, &keys::session(ns, session))?
            .iter()
            .map(|(_, v)| from_json(v, "segment"))
            .collect()
    }

    fn usage_log(&self, ns: &Namespace) -> Result<Vec<TokenUsage>> {
        let txn = self.read()?;
        let t = txn.open_table(USAGE).map_err(db_err)?;
        scan_prefix(&t, &keys::ns(ns))?
            .iter()
            .map(|(_, v)| from_json(v, "usage"))
            .collect()
    }

    fn stats(&self, ns: &Namespace) -> Result<NamespaceStats> {
        self.commit_text_if_dirty()?;
        let txn = self.read()?;
        let prefix = keys::ns(ns);
        let mut stats = NamespaceStats {
            sessions: count_prefix(&txn.open_table(SESSIONS).map_err(db_err)?, &prefix)?,
            turns: count_prefix(&txn.open_table(TURNS).map_err(db_err)?, &prefix)?,
            records: count_prefix(&txn.open_table(RECORDS).map_err(db_err)?, &prefix)?,
            pending_vectors: count_prefix(&txn.open_table(PENDING).map_err(db_err)?, &prefix)?,
            ..NamespaceStats::default()
        };
        let segments = txn.open_table(SEGMENTS).map_err(db_err)?;
        for (_, v) in scan_prefix(&segments, &prefix)? {
            stats.segments += 1;
            let row: SegmentRow = from_json(&v, "segment")?;
            if matches!(row.outcome, SegmentOutcome::Failed { .. }) {
                stats.failed_segments += 1;
            }
        }
        let nodes = txn.open_table(NODES).map_err(db_err)?;
        for kind in NodeKind::ALL {
            let p = keys::ns_str(ns, &format!("{}:", kind.as_str()));
            stats
                .nodes
                .insert(kind.as_str().to_string(), count_prefix(&nodes, &p)?);
        }
        let vector_table = txn.open_table(VECTORS).map_err(db_err)?;
        let vectors = self.vectors.read().unwrap_or_else(lock_poisoned);
        let text = self.text.read().unwrap_or_else(lock_poisoned);
        for target in Target::ALL {
            let mut p = keys::ns(ns);
            p.push(target.code());
            let name = target.as_str().to_string();
            stats
                .vectors
                .insert(name.clone(), count_prefix(&vector_table, &p)?);
            stats
                .indexed_vectors
                .insert(name.clone(), vectors.len(ns.as_str(), target) as u64);
            stats
                .text_rows
                .insert(name, text.count(ns.as_str(), target)?);
        }
        let mut usage = UsageTotals::default();
        for u in self.usage_log(ns)? {
            usage.add(&u);
        }
        stats.usage = usage;
        Ok(stats)
    }

    fn vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>> {
        let txn = self.read()?;
        let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
        let vectors = txn.open_table(VECTORS).map_err(db_err)?;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let id = item.id();
            let target = item_target(item);
            let key = id_keys
                .get(keys::pending(ns, target, &id).as_slice())
                .map_err(db_err)?
                .map(|k| k.value());
            out.push(match key {
                Some(key) => vectors
                    .get(keys::vector(ns, target, key).as_slice())
                    .map_err(db_err)?
                    .map(|v| vector_from_bytes(v.value())),
                None => None,
            });
        }
        Ok(out)
    }

    fn pending_vectors(&self, ns: &Namespace, limit: usize) -> Result<Vec<(ItemRef, String)>> {
        let txn = self.read()?;
        let pending = txn.open_table(PENDING).map_err(db_err)?;
        let prefix = keys::ns(ns);
        let mut out = Vec::new();
        for k in scan_keys(&pending, &prefix)?.into_iter().take(limit) {
            let rest = keys::suffix(&k, &prefix);
            let target = Target::ALL[usize::from(rest[0]).min(Target::ALL.len() - 1)];
            let id = String::from_utf8_lossy(&rest[1..]).into_owned();
            let item = ItemRef::from_id(target, &id)?;
            let text = match &item {
                ItemRef::Record(id) => self
                    .records(ns, std::slice::from_ref(id))?
                    .pop()
                    .map(|r| r.normalized_text),
                ItemRef::Node(id) => self
                    .nodes(ns, std::slice::from_ref(id))?
                    .pop()
                    .map(|n| n.search_text),
                ItemRef::Turn(t) => self
                    .turn_range(ns, &t.session, t.index, t.index)?
                    .pop()
                    .map(|t| turn_text(&t)),
            };
            if let Some(text) = text {
                out.push((item, text));
            }
        }
        Ok(out)
    }
}

impl StoreWrite for Store {
    fn put_session(&self, ns: &Namespace, info: SessionInfo) -> Result<WriteReceipt> {
        self.write(|w| {
            let turn_count = w.session(ns, &info.id)?.map_or(0, |s| s.turn_count);
            w.put_session(ns, &SessionInfo { turn_count, ..info })
        })
        .map(|(_, r)| r)
    }

    fn add_turns(
        &self,
        ns: &Namespace,
        turns: Vec<(Turn, Option<Vec<f32>>)>,
    ) -> Result<WriteReceipt> {
        self.write(|w| {
            for (turn, vector) in turns {
                w.add_turn(ns, turn, vector.as_deref())?;
            }
            Ok(())
        })
        .map(|(_, r)| r)
    }

    fn commit_segment(&self, ns: &Namespace, write: SegmentWrite) -> Result<WriteReceipt> {
        self.write(|w| w.commit_segment(ns, write)).map(|(_, r)| r)
    }

    fn put_state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<WriteReceipt> {
        self.write(|w| w.put_state(ns, session, name, value))
            .map(|(_, r)| r)
    }

    fn log_usage(&self, ns: &Namespace, usage: &[TokenUsage]) -> Result<WriteReceipt> {
        self.write(|w| usage.iter().try_for_each(|u| w.log_usage(ns, u)))
            .map(|(_, r)| r)
    }

    fn set_vectors(&self, ns: &Namespace, items: &[(ItemRef, Vec<f32>)]) -> Result<usize> {
        self.write(|w| {
            let mut found = 0;
            for (item, v) in items {
                if w.set_item_vector(ns, item, v)? {
                    found += 1;
                }
            }
            Ok(found)
        })
        .map(|(n, _)| n)
    }
}

impl StoreAdmin for Store {
    fn export(
        &self,
        ns: &Namespace,
        out: &mut dyn std::io::Write,
        opts: crate::transfer::ExportOptions,
    ) -> Result<u64> {
        self.export_lines(ns, out, opts)
    }

    fn import(
        &self,
        ns: &Namespace,
        input: &mut dyn std::io::BufRead,
        embed: Option<&crate::transfer::EmbedFn>,
    ) -> Result<crate::transfer::ImportReceipt> {
        self.import_lines(ns, input, embed)
    }

    fn delete_record(&self, ns: &Namespace, record_id: &str) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_record(ns, record_id))
            .map(|(r, _)| r)
    }

    fn delete_session(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_session(ns, session))
            .map(|(r, _)| r)
    }

    fn clear_session_derived(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| w.clear_session_derived(ns, session))
            .map(|(r, _)| r)
    }

    fn delete_namespace(&self, ns: &Namespace) -> Result<DeleteReceipt> {
        self.write(|w| w.delete_namespace(ns)).map(|(r, _)| r)
    }

    fn checkpoint(&self) -> Result<()> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        let mut vectors = self.vectors.write().unwrap_or_else(lock_poisoned);
        let mut text = self.text.write().unwrap_or_else(lock_poisoned);
        self.checkpoint_locked(&mut vectors, &mut text)
    }
}
