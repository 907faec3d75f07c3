//! One write transaction: rows, vectors, the change log, and cascading deletes.

use super::*;

/// The redb tables of one write transaction plus the counters it advances.
pub(crate) struct Writer<'t> {
    sessions: Table<'t, &'static [u8], &'static [u8]>,
    turns: Table<'t, &'static [u8], &'static [u8]>,
    segments: Table<'t, &'static [u8], &'static [u8]>,
    records: Table<'t, &'static [u8], &'static [u8]>,
    nodes: Table<'t, &'static [u8], &'static [u8]>,
    node_members: Table<'t, &'static [u8], &'static [u8]>,
    record_nodes: Table<'t, &'static [u8], ()>,
    session_records: Table<'t, &'static [u8], ()>,
    state: Table<'t, &'static [u8], &'static [u8]>,
    usage: Table<'t, &'static [u8], &'static [u8]>,
    vectors: Table<'t, &'static [u8], &'static [u8]>,
    keys: Table<'t, &'static [u8], &'static str>,
    id_keys: Table<'t, &'static [u8], u64>,
    pending: Table<'t, &'static [u8], ()>,
    changes: Table<'t, u64, &'static [u8]>,
    pub(super) counters: Table<'t, &'static str, u64>,
    seq: u64,
    next_key: u64,
    dims: usize,
    node_text_chars: usize,
}

impl<'t> Writer<'t> {
    pub(super) fn open(
        txn: &'t redb::WriteTransaction,
        dims: usize,
        node_text_chars: usize,
    ) -> Result<Self> {
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
            node_members: txn.open_table(NODE_MEMBERS).map_err(db_err)?,
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

    pub(super) fn finish(mut self) -> Result<u64> {
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
        crate::rules::check_vector(v, self.dims)
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
        // A record whose id is stored is a restatement: `rules::merge_restatement`
        // (docs/algorithm.md, "Storage rules").
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
        let members = self.member_keys(ns, &nkey, &node.record_ids)?;
        self.node_members
            .insert(
                nkey.as_slice(),
                encode_members(node.record_ids.iter().map(String::as_str).zip(members)).as_slice(),
            )
            .map_err(db_err)?;
        let id = node.node_id.clone();
        let target = Target::Node(node.kind);
        self.set_vector(ns, target, key, &id, vector)?;
        let row = NodeRow { node, key };
        self.nodes
            .insert(nkey.as_slice(), to_json(&row)?.as_slice())
            .map_err(db_err)?;
        self.log_item(ns, target, &id, key)
    }

    /// The index keys of a node's records, in order: a record the node's members row already
    /// lists with a key keeps it (a record's key never changes while it exists, and deleting
    /// it rewrites its nodes), the others are looked up (0 for one without a key).
    fn member_keys(
        &self,
        ns: &Namespace,
        nkey: &[u8],
        record_ids: &BTreeSet<String>,
    ) -> Result<Vec<u64>> {
        let old = match self.node_members.get(nkey).map_err(db_err)? {
            Some(v) => decode_members(v.value())?,
            None => Members::default(),
        };
        let mut known = old.ids.iter().map(String::as_str).zip(old.keys).peekable();
        let mut out = Vec::with_capacity(record_ids.len());
        for id in record_ids {
            while known.next_if(|(k, _)| *k < id.as_str()).is_some() {}
            let key = match known.next_if(|(k, _)| *k == id.as_str()) {
                Some((_, key)) if key != 0 => key,
                _ => self
                    .id_keys
                    .get(keys::pending(ns, Target::Record, id).as_slice())
                    .map_err(db_err)?
                    .map_or(0, |k| k.value()),
            };
            out.push(key);
        }
        Ok(out)
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
        crate::rules::check_segment_write(&write, &mut Facts { writer: self, ns })?;
        let row = crate::rules::segment_row(&write, self.seq + 1);
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
        let nkey = keys::ns_str(ns, id);
        self.nodes.remove(nkey.as_slice()).map_err(db_err)?;
        self.node_members.remove(nkey.as_slice()).map_err(db_err)?;
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
        drain(&mut self.node_members, range.clone())?;
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

/// A writer's answers to the segment checks of `rules`.
struct Facts<'w, 't> {
    writer: &'w Writer<'t>,
    ns: &'w Namespace,
}

impl crate::rules::StoredFacts for Facts<'_, '_> {
    fn turn_count(&mut self, session: &SessionId) -> Result<Option<u32>> {
        Ok(self.writer.session(self.ns, session)?.map(|s| s.turn_count))
    }

    fn record_stored(&mut self, id: &str) -> Result<bool> {
        Ok(self.writer.record(self.ns, id)?.is_some())
    }
}
