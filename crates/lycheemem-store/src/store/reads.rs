//! Lookups and the catalog ([`StoreLookup`], [`StoreCatalog`]).

use super::*;

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

    fn node_members(
        &self,
        ns: &Namespace,
        ids: &[String],
        list_up_to: usize,
    ) -> Result<Vec<NodeMembers>> {
        let generation = self.node_cache_generation();
        let txn = self.read()?;
        let table = txn.open_table(NODE_MEMBERS).map_err(db_err)?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let key = keys::ns_str(ns, id);
            let cached = self
                .node_cache
                .read()
                .unwrap_or_else(lock_poisoned)
                .get(&key);
            let unlisted = |records| NodeMembers {
                node_id: id.clone(),
                records,
                record_ids: None,
            };
            if let Some(node) = cached.filter(|n| n.ids.len() > list_up_to) {
                out.push(unlisted(node.ids.len()));
                continue;
            }
            let Some(row) = table.get(key.as_slice()).map_err(db_err)? else {
                continue;
            };
            let records = member_count(row.value())?;
            if records > list_up_to {
                if records >= node_cache::CACHED_FROM {
                    // Resolved now: the node search that follows finds it in the cache.
                    let members = decode_members(row.value())?;
                    self.resolved_node(&txn, ns, id, generation, Some(members))?;
                }
                out.push(unlisted(records));
            } else {
                out.push(NodeMembers {
                    node_id: id.clone(),
                    records,
                    record_ids: Some(decode_members(row.value())?.ids),
                });
            }
        }
        Ok(out)
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

impl StoreCatalog for Store {
    fn vector_dims(&self) -> usize {
        self.options.dims
    }

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
            let target = item.target();
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
            // A key with nothing after its namespace is damaged: skipped, not read past.
            let Some((&tag, id)) = keys::suffix(&k, &prefix).split_first() else {
                continue;
            };
            let target = Target::ALL[usize::from(tag).min(Target::ALL.len() - 1)];
            let id = String::from_utf8_lossy(id).into_owned();
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
