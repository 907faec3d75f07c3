//! Bringing the derived indexes (vectors, full text) up to date with redb: on open, after a
//! crash, and at checkpoints.

use super::*;

impl Store {
    /// Brings both derived indexes up to redb's write sequence: replays the change log when it
    /// still covers their position, otherwise rebuilds them from the tables.
    pub(super) fn recover(&self) -> Result<()> {
        let _w = self.write.lock().unwrap_or_else(lock_poisoned);
        self.backfill_id_keys()?;
        self.backfill_node_members()?;
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
    pub(super) fn backfill_id_keys(&self) -> Result<()> {
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

    /// Stores written before the node members table existed get it filled from the node rows
    /// and the id → key table.
    pub(super) fn backfill_node_members(&self) -> Result<()> {
        if self.counter("node_members_filled")? == 1 {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let nodes = txn.open_table(NODES).map_err(db_err)?;
            let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
            let mut members = txn.open_table(NODE_MEMBERS).map_err(db_err)?;
            for entry in nodes.iter().map_err(db_err)? {
                let (k, v) = entry.map_err(db_err)?;
                let k = k.value();
                let Some(ns) = key_namespace(k) else { continue };
                let ns = Namespace::new(ns)?;
                let row: NodeRow = from_json(v.value(), "node")?;
                let mut found = Vec::with_capacity(row.node.record_ids.len());
                for id in &row.node.record_ids {
                    found.push(
                        id_keys
                            .get(keys::pending(&ns, Target::Record, id).as_slice())
                            .map_err(db_err)?
                            .map_or(0, |key| key.value()),
                    );
                }
                let ids = row.node.record_ids.iter().map(String::as_str);
                members
                    .insert(k, encode_members(ids.zip(found)).as_slice())
                    .map_err(db_err)?;
            }
            let mut counters = txn.open_table(COUNTERS).map_err(db_err)?;
            counters.insert("node_members_filled", 1).map_err(db_err)?;
        }
        txn.commit().map_err(db_err)
    }

    pub(super) fn rebuild_vectors(&self, vectors: &mut VectorIndexes, seq: u64) -> Result<()> {
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

    pub(super) fn rebuild_text(&self, text: &mut FullText, seq: u64) -> Result<()> {
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
    pub(super) fn apply_changes(
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

    pub(super) fn checkpoint_locked(
        &self,
        vectors: &mut VectorIndexes,
        text: &mut FullText,
    ) -> Result<()> {
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
