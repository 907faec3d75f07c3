//! Vector, full-text and temporal search ([`StoreSearch`]).

use super::*;

impl Store {
    /// Calls `row` with the node id and value of every row of `table` (keyed `ns \0 node id`,
    /// like the node rows) whose temporal node overlaps `[since, until]`: days, then months,
    /// each in key order ([`crate::rules::temporal_node_ranges`]).
    fn temporal_rows(
        &self,
        table: redb::TableDefinition<&[u8], &[u8]>,
        ns: &Namespace,
        since: &str,
        until: &str,
        mut row: impl FnMut(&str, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let ranges = crate::rules::temporal_node_ranges(since, until)?;
        if ranges.is_empty() {
            return Ok(());
        }
        let txn = self.read()?;
        let t = txn.open_table(table).map_err(db_err)?;
        let prefix = keys::ns_str(ns, "").len();
        for (lo, hi) in ranges {
            let lo = keys::ns_str(ns, &lo);
            let hi = keys::ns_str(ns, &hi);
            for entry in t.range(lo.as_slice()..=hi.as_slice()).map_err(db_err)? {
                let (k, v) = entry.map_err(db_err)?;
                let node_id = k
                    .value()
                    .get(prefix..)
                    .and_then(|id| std::str::from_utf8(id).ok())
                    .ok_or_else(|| Error::Store("corrupt node key".into()))?;
                row(node_id, v.value())?;
            }
        }
        Ok(())
    }

    /// Top-k among `allowed` keys: exact for small sets, else filtered HNSW, falling back to
    /// exact when the filtered search comes back short.
    pub(super) fn search_allowed(
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
    pub(super) fn session_keys(
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
    pub(super) fn target_keys(
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

    pub(super) fn exact_search(
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
    pub(super) fn commit_text_if_dirty(&self) -> Result<()> {
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
}

/// The stored (database) vector of one key.
pub(super) fn stored_vector(
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

impl StoreSearch for Store {
    fn vector_search(&self, ns: &Namespace, q: &VectorQuery) -> Result<Vec<Hit>> {
        check_query_dims(&q.vector, self.options.dims)?;
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

    /// From the size at which a node is kept resolved with its vectors packed (`node_cache`).
    fn node_search_above(&self) -> usize {
        super::node_cache::CACHED_FROM
    }

    /// An exact scan of the node's packed member vectors (resolved once and kept until the
    /// next write; see `node_cache`), all queries in one pass over the matrix.
    fn vector_search_node_many(
        &self,
        ns: &Namespace,
        node_id: &str,
        vectors: &[&[f32]],
        k: usize,
    ) -> Result<Vec<Vec<Hit>>> {
        for v in vectors {
            check_query_dims(v, self.options.dims)?;
        }
        let generation = self.node_cache_generation();
        let txn = self.read()?;
        let Some(node) = self.resolved_node(&txn, ns, node_id, generation, None)? else {
            return Ok(vectors.iter().map(|_| Vec::new()).collect());
        };
        node.nearest(vectors, k)
            .into_iter()
            .map(|hits| {
                hits.into_iter()
                    .map(|(i, score)| {
                        Ok(Hit {
                            item: ItemRef::from_id(Target::Record, &node.ids[i as usize])?,
                            target: Target::Record,
                            score,
                        })
                    })
                    .collect()
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
        let mut out = Vec::new();
        self.temporal_rows(NODES, ns, since, until, |_, row| {
            out.push(from_json::<NodeRow>(row, "node")?.node);
            Ok(())
        })?;
        Ok(out)
    }

    /// Read from the binary members rows (keyed like the node rows), not the JSON node rows.
    fn temporal_members(
        &self,
        ns: &Namespace,
        since: &str,
        until: &str,
    ) -> Result<Vec<NodeMembers>> {
        let mut out = Vec::new();
        self.temporal_rows(NODE_MEMBERS, ns, since, until, |node_id, row| {
            let ids = decode_members(row)?.ids;
            out.push(NodeMembers {
                node_id: node_id.to_string(),
                records: ids.len(),
                record_ids: Some(ids),
            });
            Ok(())
        })?;
        Ok(out)
    }

    fn scoring_vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>> {
        let txn = self.read()?;
        let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
        let mut keyed = Vec::with_capacity(items.len());
        for item in items {
            let target = item.target();
            let key = id_keys
                .get(keys::pending(ns, target, &item.id()).as_slice())
                .map_err(db_err)?
                .map(|k| k.value());
            keyed.push((target, key));
        }
        // One lookup batch per target (an index's lookup costs a map probe per call).
        let mut indexed: Vec<Option<Vec<f32>>> = vec![None; keyed.len()];
        {
            let vectors = self.vectors.read().unwrap_or_else(lock_poisoned);
            for target in Target::ALL {
                let (at, batch): (Vec<usize>, Vec<u64>) = keyed
                    .iter()
                    .enumerate()
                    .filter_map(|(i, (t, key))| (*t == target).then_some((i, (*key)?)))
                    .unzip();
                if batch.is_empty() {
                    continue;
                }
                for (i, v) in at
                    .into_iter()
                    .zip(vectors.get_many(ns.as_str(), target, &batch))
                {
                    indexed[i] = v;
                }
            }
        }
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
