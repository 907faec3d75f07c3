//! One write transaction: rows, item index entries (vector, pending mark, postings, text
//! statistics) and cascading deletes — the PostgreSQL counterpart of the embedded store's
//! `Writer`, applying the same rules (`lycheemem_store::rules`).

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{Error, EvidenceNode, Namespace, Record, Result, SessionId, Turn};
use lycheemem_store::text::{self, AnalyzedDoc};
use lycheemem_store::{
    DeleteReceipt, ItemRef, SegmentOutcome, SegmentRow, SegmentWrite, SessionInfo, Target,
};
use pgvector::Vector;
use postgres::types::ToSql;
use postgres::{Row, Statement, Transaction};
use std::collections::{BTreeSet, HashMap};
use tantivy::tokenizer::TextAnalyzer;

use crate::{from_json, json, pg_err};

/// A write transaction on the store's tables.
pub(crate) struct Tx<'c> {
    pub tx: Transaction<'c>,
    pub seq: i64,
    dims: usize,
    node_text_chars: usize,
    vector_type: &'static str,
    analyzer: TextAnalyzer,
    /// Statements prepared in this transaction, by SQL text: one used again (per item of a
    /// segment or an import) costs one round trip instead of two.
    statements: HashMap<String, Statement>,
    /// Full-text statistics changes per namespace (documents, tokens), written once at commit
    /// rather than as one update of the same row per item.
    text_stats: HashMap<String, (i64, i64)>,
    /// Document-frequency changes per (namespace, term), written once at commit.
    term_df: HashMap<(String, String), i64>,
}

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

impl<'c> Tx<'c> {
    pub fn begin(
        conn: &'c mut postgres::Client,
        dims: usize,
        node_text_chars: usize,
        vector_type: &'static str,
    ) -> Result<Self> {
        let mut tx = conn.transaction().map_err(pg_err)?;
        let seq: i64 = tx
            .query_one("SELECT nextval('lm_write_seq')", &[])
            .map_err(pg_err)?
            .get(0);
        Ok(Tx {
            tx,
            seq,
            dims,
            node_text_chars,
            vector_type,
            analyzer: text::analyzer(),
            statements: HashMap::new(),
            text_stats: HashMap::new(),
            term_df: HashMap::new(),
        })
    }

    pub fn commit(mut self) -> Result<u64> {
        let seq = self.seq;
        let mut stats: Vec<(String, (i64, i64))> = self.text_stats.drain().collect();
        // In key order, so concurrent writers of several namespaces lock rows in one order.
        stats.sort();
        for (ns, (docs, tokens)) in stats {
            if docs == 0 && tokens == 0 {
                continue;
            }
            self.exec(
                "INSERT INTO lm_text_stats (ns, docs, tokens) VALUES ($1, $2, $3) \
                 ON CONFLICT (ns) DO UPDATE SET docs = lm_text_stats.docs + excluded.docs, \
                 tokens = lm_text_stats.tokens + excluded.tokens",
                &[&ns, &docs, &tokens],
            )
            .map_err(pg_err)?;
        }
        // Then the terms' document frequencies, in key order, in one statement.
        let mut df: Vec<((String, String), i64)> =
            self.term_df.drain().filter(|(_, d)| *d != 0).collect();
        df.sort();
        if !df.is_empty() {
            let (keys, deltas): (Vec<(String, String)>, Vec<i64>) = df.into_iter().unzip();
            let (nss, terms): (Vec<String>, Vec<String>) = keys.into_iter().unzip();
            self.exec(
                "INSERT INTO lm_term_df (ns, term, df) \
                 SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) \
                 ON CONFLICT (ns, term) DO UPDATE SET df = lm_term_df.df + excluded.df",
                &[&nss, &terms, &deltas],
            )
            .map_err(pg_err)?;
        }
        self.statements.clear();
        self.tx.commit().map_err(pg_err)?;
        Ok(seq.max(0) as u64)
    }

    /// The statement for `sql`, prepared once per transaction.
    fn prepared(&mut self, sql: &str) -> std::result::Result<Statement, postgres::Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let statement = self.tx.prepare(sql)?;
        self.statements.insert(sql.to_string(), statement.clone());
        Ok(statement)
    }

    fn exec(&mut self, sql: &str, params: Params<'_>) -> std::result::Result<u64, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.execute(&statement, params)
    }

    fn fetch_opt(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> std::result::Result<Option<Row>, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.query_opt(&statement, params)
    }

    fn fetch(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> std::result::Result<Vec<Row>, postgres::Error> {
        let statement = self.prepared(sql)?;
        self.tx.query(&statement, params)
    }

    /// Serializes this transaction with the namespace's other segment commits, deletes and
    /// imports, in every process.
    pub fn lock_namespace(&mut self, ns: &Namespace) -> Result<()> {
        self.exec(crate::namespace_lock_sql(), &[&ns.as_str()])
            .map_err(pg_err)?;
        Ok(())
    }

    fn check_vector(&self, v: &[f32]) -> Result<()> {
        lycheemem_store::rules::check_vector(v, self.dims)
    }

    // ---- items: vector, pending mark, full-text document ----

    /// Creates or replaces an item's index entry: its full-text document (postings and the
    /// namespace's statistics) and its vector (`None`: cleared and marked pending).
    fn put_item(
        &mut self,
        ns: &Namespace,
        target: Target,
        id: &str,
        sessions: &[String],
        text: &str,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        if let Some(v) = vector {
            self.check_vector(v)?;
        }
        let doc = text::analyze(&mut self.analyzer, text);
        let ns_s = ns.as_str();
        let t = target.as_str();
        let old: Option<i16> = self
            .fetch_opt(
                "SELECT norm_id FROM lm_items WHERE ns = $1 AND target = $2 AND id = $3 FOR UPDATE",
                &[&ns_s, &t, &id],
            )
            .map_err(pg_err)?
            .map(|r| r.get(0));
        let embedding = vector.map(|v| Vector::from(v.to_vec()));
        let vt = self.vector_type;
        // The key (insertion order, the exact search's tie-break) is kept on replacement.
        self.exec(
            &format!(
                "INSERT INTO lm_items (ns, target, id, sessions, norm_id, pending, embedding) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7::vector::{vt}) \
                     ON CONFLICT (ns, target, id) DO UPDATE SET sessions = excluded.sessions, \
                     norm_id = excluded.norm_id, pending = excluded.pending, \
                     embedding = excluded.embedding"
            ),
            &[
                &ns_s,
                &t,
                &id,
                &sessions,
                &i16::from(doc.norm_id),
                &embedding.is_none(),
                &embedding,
            ],
        )
        .map_err(pg_err)?;
        if old.is_some() {
            self.delete_postings(ns, target, id)?;
        }
        self.insert_postings(ns, target, id, &doc)?;
        let old_tokens = old.map_or(0, |n| i64::from(text::norm_of(n as u8)));
        self.add_text_stats(
            ns,
            i64::from(old.is_none()),
            i64::from(doc.norm()) - old_tokens,
        )
    }

    fn insert_postings(
        &mut self,
        ns: &Namespace,
        target: Target,
        id: &str,
        doc: &AnalyzedDoc,
    ) -> Result<()> {
        if doc.terms.is_empty() {
            return Ok(());
        }
        let terms: Vec<&str> = doc.terms.iter().map(|(t, _)| t.as_str()).collect();
        let tfs: Vec<i32> = doc
            .terms
            .iter()
            .map(|(_, f)| i32::try_from(*f).unwrap_or(i32::MAX))
            .collect();
        self.exec(
            "INSERT INTO lm_postings (ns, term, target, id, tf, norm_id) \
                 SELECT $1, t.term, $3, $4, t.tf, $6 \
                 FROM unnest($2::text[], $5::int[]) AS t(term, tf)",
            &[
                &ns.as_str(),
                &terms,
                &target.as_str(),
                &id,
                &tfs,
                &i16::from(doc.norm_id),
            ],
        )
        .map_err(pg_err)?;
        for term in terms {
            *self
                .term_df
                .entry((ns.to_string(), term.to_string()))
                .or_default() += 1;
        }
        Ok(())
    }

    /// Removes an item's postings, counting its terms out of the document frequencies.
    fn delete_postings(&mut self, ns: &Namespace, target: Target, id: &str) -> Result<()> {
        let rows = self
            .fetch(
                "DELETE FROM lm_postings WHERE ns = $1 AND target = $2 AND id = $3 RETURNING term",
                &[&ns.as_str(), &target.as_str(), &id],
            )
            .map_err(pg_err)?;
        for r in rows {
            *self.term_df.entry((ns.to_string(), r.get(0))).or_default() -= 1;
        }
        Ok(())
    }

    /// Counts a change of the namespace's full-text statistics, written at commit.
    fn add_text_stats(&mut self, ns: &Namespace, docs: i64, tokens: i64) -> Result<()> {
        let entry = self.text_stats.entry(ns.to_string()).or_default();
        entry.0 += docs;
        entry.1 += tokens;
        Ok(())
    }

    /// Sets (or clears, marking pending) the vector of an existing item; false when absent.
    fn set_item_vector_raw(
        &mut self,
        ns: &Namespace,
        target: Target,
        id: &str,
        vector: Option<&[f32]>,
    ) -> Result<bool> {
        if let Some(v) = vector {
            self.check_vector(v)?;
        }
        let embedding = vector.map(|v| Vector::from(v.to_vec()));
        let vt = self.vector_type;
        let n = self
            .exec(
                &format!(
                    "UPDATE lm_items SET pending = $4, embedding = $5::vector::{vt} \
                     WHERE ns = $1 AND target = $2 AND id = $3"
                ),
                &[
                    &ns.as_str(),
                    &target.as_str(),
                    &id,
                    &embedding.is_none(),
                    &embedding,
                ],
            )
            .map_err(pg_err)?;
        Ok(n > 0)
    }

    /// Removes an item's index entry; true when it had a vector.
    fn drop_item(&mut self, ns: &Namespace, target: Target, id: &str) -> Result<bool> {
        self.delete_postings(ns, target, id)?;
        let row = self
            .fetch_opt(
                "DELETE FROM lm_items WHERE ns = $1 AND target = $2 AND id = $3 \
                 RETURNING norm_id, embedding IS NOT NULL",
                &[&ns.as_str(), &target.as_str(), &id],
            )
            .map_err(pg_err)?;
        match row {
            Some(r) => {
                let norm_id: i16 = r.get(0);
                self.add_text_stats(ns, -1, -i64::from(text::norm_of(norm_id as u8)))?;
                Ok(r.get(1))
            }
            None => Ok(false),
        }
    }

    // ---- rows ----

    pub fn session(&mut self, ns: &Namespace, id: &SessionId) -> Result<Option<SessionInfo>> {
        read_session(&mut self.tx, ns, id, false)
    }

    pub fn put_session(&mut self, ns: &Namespace, info: &SessionInfo) -> Result<()> {
        let turn_count = i32::try_from(info.turn_count)
            .map_err(|_| Error::InvalidInput("turn count out of range".into()))?;
        self.exec(
            "INSERT INTO lm_sessions (ns, id, turn_count, body) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (ns, id) DO UPDATE SET turn_count = excluded.turn_count, \
                 body = excluded.body",
            &[&ns.as_str(), &info.id.as_str(), &turn_count, &json(info)?],
        )
        .map_err(pg_err)?;
        Ok(())
    }

    /// Appends a turn (its index must be the session's next) or accepts an identical retry.
    /// The session row is locked first, so concurrent appenders to one session serialize.
    pub fn add_turn(&mut self, ns: &Namespace, turn: Turn, vector: Option<&[f32]>) -> Result<bool> {
        let mut session = match read_session(&mut self.tx, ns, &turn.session, true)? {
            Some(s) => s,
            None => {
                self.exec(
                    "INSERT INTO lm_sessions (ns, id, turn_count, body) VALUES ($1, $2, 0, $3) \
                         ON CONFLICT (ns, id) DO NOTHING",
                    &[
                        &ns.as_str(),
                        &turn.session.as_str(),
                        &json(&SessionInfo::new(turn.session.clone(), None))?,
                    ],
                )
                .map_err(pg_err)?;
                read_session(&mut self.tx, ns, &turn.session, true)?.ok_or_else(|| {
                    Error::Store(format!("session {} vanished while locked", turn.session))
                })?
            }
        };
        if turn.index < session.turn_count {
            let existing = self
                .fetch_opt(
                    "SELECT body FROM lm_turns WHERE ns = $1 AND session = $2 AND idx = $3",
                    &[&ns.as_str(), &turn.session.as_str(), &(turn.index as i32)],
                )
                .map_err(pg_err)?;
            let same = match existing {
                Some(r) => from_json::<Turn>(r.get(0), "turn")? == turn,
                None => false,
            };
            return if same {
                Ok(false)
            } else {
                Err(Error::InvalidInput(format!(
                    "turn {}#{} already exists with different content (turns are append-only)",
                    turn.session, turn.index
                )))
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
        let index = i32::try_from(turn.index)
            .map_err(|_| Error::InvalidInput("turn index out of range".into()))?;
        session.turn_count += 1;
        self.put_session(ns, &session)?;
        self.exec(
            "INSERT INTO lm_turns (ns, session, idx, body) VALUES ($1, $2, $3, $4)",
            &[&ns.as_str(), &turn.session.as_str(), &index, &json(&turn)?],
        )
        .map_err(pg_err)?;
        let id = ItemRef::Turn(turn.turn_ref()).id();
        let text = lycheemem_store::rules::turn_search_text(&turn);
        self.put_item(
            ns,
            Target::Turn,
            &id,
            &[turn.session.to_string()],
            &text,
            vector,
        )?;
        Ok(true)
    }

    pub fn record(&mut self, ns: &Namespace, id: &str) -> Result<Option<Record>> {
        self.fetch_opt(
            "SELECT body FROM lm_records WHERE ns = $1 AND id = $2",
            &[&ns.as_str(), &id],
        )
        .map_err(pg_err)?
        .map(|r| from_json(r.get(0), "record"))
        .transpose()
    }

    pub fn put_record(
        &mut self,
        ns: &Namespace,
        record: Record,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        // A record whose id is stored is a restatement: `rules::merge_restatement`
        // (docs/algorithm.md, "Storage rules"). Its indexed text and session are the first
        // statement's, so the index entry stays unless its vector is still pending.
        let (record, indexed) = match self.record(ns, &record.record_id)? {
            Some(old) => {
                let has_vector: bool = self
                    .fetch_opt(
                        "SELECT embedding IS NOT NULL FROM lm_items \
                         WHERE ns = $1 AND target = 'record' AND id = $2",
                        &[&ns.as_str(), &record.record_id],
                    )
                    .map_err(pg_err)?
                    .is_some_and(|r| r.get(0));
                (
                    lycheemem_store::rules::merge_restatement(old, record),
                    has_vector,
                )
            }
            None => (record, false),
        };
        self.exec(
            "INSERT INTO lm_records (ns, id, session, body) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (ns, id) DO UPDATE SET body = excluded.body",
            &[
                &ns.as_str(),
                &record.record_id,
                &record.source_session.as_str(),
                &json(&record)?,
            ],
        )
        .map_err(pg_err)?;
        if !indexed {
            let text = lycheemem_store::rules::record_search_text(&record);
            self.put_item(
                ns,
                Target::Record,
                &record.record_id,
                &[record.source_session.to_string()],
                &text,
                vector,
            )?;
        }
        Ok(())
    }

    pub fn node(&mut self, ns: &Namespace, id: &str) -> Result<Option<EvidenceNode>> {
        self.fetch_opt(
            "SELECT body FROM lm_nodes WHERE ns = $1 AND id = $2",
            &[&ns.as_str(), &id],
        )
        .map_err(pg_err)?
        .map(|r| from_json(r.get(0), "node"))
        .transpose()
    }

    pub fn put_node(
        &mut self,
        ns: &Namespace,
        node: EvidenceNode,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        let old_links = match self.node(ns, &node.node_id)? {
            Some(old) => old.record_ids,
            None => BTreeSet::new(),
        };
        let gone: Vec<&str> = old_links
            .difference(&node.record_ids)
            .map(String::as_str)
            .collect();
        let new: Vec<&str> = node
            .record_ids
            .difference(&old_links)
            .map(String::as_str)
            .collect();
        if !gone.is_empty() {
            self.exec(
                "DELETE FROM lm_record_nodes WHERE ns = $1 AND node_id = $2 \
                     AND record_id = ANY($3)",
                &[&ns.as_str(), &node.node_id, &gone],
            )
            .map_err(pg_err)?;
        }
        if !new.is_empty() {
            self.exec(
                "INSERT INTO lm_record_nodes (ns, record_id, node_id) \
                     SELECT $1, r, $2 FROM unnest($3::text[]) AS r ON CONFLICT DO NOTHING",
                &[&ns.as_str(), &node.node_id, &new],
            )
            .map_err(pg_err)?;
        }
        self.exec(
            "INSERT INTO lm_nodes (ns, id, kind, body) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (ns, id) DO UPDATE SET kind = excluded.kind, body = excluded.body",
            &[
                &ns.as_str(),
                &node.node_id,
                &node.kind.as_str(),
                &json(&node)?,
            ],
        )
        .map_err(pg_err)?;
        let sessions: Vec<String> = node.sessions.iter().cloned().collect();
        self.put_item(
            ns,
            Target::Node(node.kind),
            &node.node_id,
            &sessions,
            &node.search_text,
            vector,
        )
    }

    pub fn put_segment(&mut self, ns: &Namespace, row: &SegmentRow) -> Result<()> {
        self.exec(
            "INSERT INTO lm_segments (ns, session, first_turn, failed, body) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (ns, session, first_turn) \
                 DO UPDATE SET failed = excluded.failed, body = excluded.body",
            &[
                &ns.as_str(),
                &row.segment.session.as_str(),
                &(row.segment.first_turn as i32),
                &matches!(row.outcome, SegmentOutcome::Failed { .. }),
                &json(row)?,
            ],
        )
        .map_err(pg_err)?;
        Ok(())
    }

    pub fn put_state(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<()> {
        self.exec(
            "INSERT INTO lm_state (ns, session, name, value) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (ns, session, name) DO UPDATE SET value = excluded.value",
            &[&ns.as_str(), &session.as_str(), &name, &json(value)?],
        )
        .map_err(pg_err)?;
        Ok(())
    }

    pub fn log_usage(&mut self, ns: &Namespace, usage: &TokenUsage) -> Result<()> {
        self.exec(
            "INSERT INTO lm_usage (ns, body) VALUES ($1, $2)",
            &[&ns.as_str(), &json(usage)?],
        )
        .map_err(pg_err)?;
        Ok(())
    }

    /// Applies one finalized segment's write after validating that everything it references
    /// exists: its turns, every record's evidence turns, and every node's records.
    pub fn commit_segment(&mut self, ns: &Namespace, write: SegmentWrite) -> Result<()> {
        lycheemem_store::rules::check_segment_write(&write, &mut Facts { tx: self, ns })?;
        let row = lycheemem_store::rules::segment_row(&write, self.seq.max(0) as u64);
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
    pub fn delete_record(&mut self, ns: &Namespace, id: &str) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let Some(record) = self.record(ns, id)? else {
            return Ok(receipt);
        };
        self.exec(
            "DELETE FROM lm_records WHERE ns = $1 AND id = $2",
            &[&ns.as_str(), &id],
        )
        .map_err(pg_err)?;
        if self.drop_item(ns, Target::Record, id)? {
            receipt.vectors += 1;
        }
        receipt.records += 1;
        // Every segment of the session that stated the record stops listing it.
        let rows = self
            .fetch(
                "SELECT first_turn, body FROM lm_segments WHERE ns = $1 AND session = $2",
                &[&ns.as_str(), &record.source_session.as_str()],
            )
            .map_err(pg_err)?;
        for r in rows {
            let mut seg: SegmentRow = from_json(r.get(1), "segment")?;
            if seg.record_ids.iter().any(|x| x == id) {
                seg.record_ids.retain(|x| x != id);
                self.put_segment(ns, &seg)?;
            }
        }
        let links: Vec<String> = self
            .fetch(
                "DELETE FROM lm_record_nodes WHERE ns = $1 AND record_id = $2 RETURNING node_id",
                &[&ns.as_str(), &id],
            )
            .map_err(pg_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        let mut links = links;
        links.sort_unstable();
        for node_id in links {
            let Some(mut node) = self.node(ns, &node_id)? else {
                continue;
            };
            node.record_ids.remove(id);
            if node.record_ids.is_empty() {
                receipt.add(&self.delete_node(ns, &node_id)?);
            } else {
                let node = self.rebuild_node(ns, node)?;
                self.put_node(ns, node, None)?;
                receipt.nodes_updated += 1;
            }
        }
        Ok(receipt)
    }

    fn rebuild_node(&mut self, ns: &Namespace, node: EvidenceNode) -> Result<EvidenceNode> {
        let mut records = Vec::with_capacity(node.record_ids.len());
        for rid in &node.record_ids {
            if let Some(r) = self.record(ns, rid)? {
                records.push(r);
            }
        }
        Ok(lycheemem_store::rules::rebuild_node(
            node,
            &records,
            self.node_text_chars,
        ))
    }

    fn delete_node(&mut self, ns: &Namespace, id: &str) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let Some(node) = self.node(ns, id)? else {
            return Ok(receipt);
        };
        self.exec(
            "DELETE FROM lm_nodes WHERE ns = $1 AND id = $2",
            &[&ns.as_str(), &id],
        )
        .map_err(pg_err)?;
        self.exec(
            "DELETE FROM lm_record_nodes WHERE ns = $1 AND node_id = $2",
            &[&ns.as_str(), &id],
        )
        .map_err(pg_err)?;
        if self.drop_item(ns, Target::Node(node.kind), id)? {
            receipt.vectors += 1;
        }
        receipt.nodes_removed += 1;
        Ok(receipt)
    }

    /// Deletes what was derived from a session's turns — its records (cascading to nodes),
    /// segments and state — keeping the session and its raw turns.
    pub fn clear_session_derived(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
    ) -> Result<DeleteReceipt> {
        let mut receipt = DeleteReceipt::default();
        let ids: Vec<String> = self
            .fetch(
                "SELECT id FROM lm_records WHERE ns = $1 AND session = $2 ORDER BY id",
                &[&ns.as_str(), &session.as_str()],
            )
            .map_err(pg_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        for rid in ids {
            receipt.add(&self.delete_record(ns, &rid)?);
        }
        receipt.segments += self
            .exec(
                "DELETE FROM lm_segments WHERE ns = $1 AND session = $2",
                &[&ns.as_str(), &session.as_str()],
            )
            .map_err(pg_err)?;
        receipt.state_entries += self
            .exec(
                "DELETE FROM lm_state WHERE ns = $1 AND session = $2",
                &[&ns.as_str(), &session.as_str()],
            )
            .map_err(pg_err)?;
        Ok(receipt)
    }

    pub fn delete_session(&mut self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        let mut receipt = self.clear_session_derived(ns, session)?;
        let turns = self
            .fetch(
                "DELETE FROM lm_turns WHERE ns = $1 AND session = $2 RETURNING idx",
                &[&ns.as_str(), &session.as_str()],
            )
            .map_err(pg_err)?;
        for r in turns {
            let idx: i32 = r.get(0);
            if self.drop_item(ns, Target::Turn, &format!("{session}#{idx}"))? {
                receipt.vectors += 1;
            }
            receipt.turns += 1;
        }
        receipt.sessions += self
            .exec(
                "DELETE FROM lm_sessions WHERE ns = $1 AND id = $2",
                &[&ns.as_str(), &session.as_str()],
            )
            .map_err(pg_err)?;
        Ok(receipt)
    }

    pub fn delete_namespace(&mut self, ns: &Namespace) -> Result<DeleteReceipt> {
        let n = ns.as_str();
        let mut receipt = DeleteReceipt::default();
        let del = |tx: &mut Transaction<'_>, table: &str| -> Result<u64> {
            tx.execute(&format!("DELETE FROM {table} WHERE ns = $1"), &[&n])
                .map_err(pg_err)
        };
        receipt.vectors = self
            .tx
            .query_one(
                "SELECT count(*) FROM lm_items WHERE ns = $1 AND embedding IS NOT NULL",
                &[&n],
            )
            .map_err(pg_err)?
            .get::<_, i64>(0) as u64;
        del(&mut self.tx, "lm_postings")?;
        del(&mut self.tx, "lm_items")?;
        del(&mut self.tx, "lm_record_nodes")?;
        receipt.sessions = del(&mut self.tx, "lm_sessions")?;
        receipt.turns = del(&mut self.tx, "lm_turns")?;
        receipt.segments = del(&mut self.tx, "lm_segments")?;
        receipt.records = del(&mut self.tx, "lm_records")?;
        receipt.nodes_removed = del(&mut self.tx, "lm_nodes")?;
        receipt.state_entries = del(&mut self.tx, "lm_state")?;
        receipt.usage_entries = del(&mut self.tx, "lm_usage")?;
        // Last, in commit's order: appends lock their session row before the statistics row,
        // and that row before the document frequencies.
        del(&mut self.tx, "lm_text_stats")?;
        del(&mut self.tx, "lm_term_df")?;
        self.text_stats.remove(n);
        self.term_df.retain(|(ns, _), _| ns != n);
        Ok(receipt)
    }

    /// Replaces the vector of an existing item; false when the item does not exist.
    pub fn set_item_vector(
        &mut self,
        ns: &Namespace,
        item: &ItemRef,
        vector: &[f32],
    ) -> Result<bool> {
        self.set_item_vector_raw(ns, item.target(), &item.id(), Some(vector))
    }
}

/// A session row (its turn count from the row's column), optionally locked for update.
pub(crate) fn read_session(
    client: &mut impl postgres::GenericClient,
    ns: &Namespace,
    id: &SessionId,
    lock: bool,
) -> Result<Option<SessionInfo>> {
    let sql = if lock {
        "SELECT turn_count, body FROM lm_sessions WHERE ns = $1 AND id = $2 FOR UPDATE"
    } else {
        "SELECT turn_count, body FROM lm_sessions WHERE ns = $1 AND id = $2"
    };
    let row = client
        .query_opt(sql, &[&ns.as_str(), &id.as_str()])
        .map_err(pg_err)?;
    row.map(|r| {
        let mut info: SessionInfo = from_json(r.get(1), "session")?;
        info.turn_count = r.get::<_, i32>(0).max(0) as u32;
        Ok(info)
    })
    .transpose()
}

/// A transaction's answers to the segment checks of `lycheemem_store::rules`.
struct Facts<'a, 'c> {
    tx: &'a mut Tx<'c>,
    ns: &'a Namespace,
}

impl lycheemem_store::rules::StoredFacts for Facts<'_, '_> {
    fn turn_count(&mut self, session: &SessionId) -> Result<Option<u32>> {
        Ok(self.tx.session(self.ns, session)?.map(|s| s.turn_count))
    }

    fn record_stored(&mut self, id: &str) -> Result<bool> {
        Ok(self.tx.record(self.ns, id)?.is_some())
    }
}

impl lycheemem_store::ImportSink for Tx<'_> {
    fn put_session(&mut self, ns: &Namespace, info: &SessionInfo) -> Result<()> {
        Tx::put_session(self, ns, info)
    }
    fn add_turn(&mut self, ns: &Namespace, turn: Turn, vector: Option<&[f32]>) -> Result<bool> {
        Tx::add_turn(self, ns, turn, vector)
    }
    fn put_record(&mut self, ns: &Namespace, record: Record, vector: Option<&[f32]>) -> Result<()> {
        Tx::put_record(self, ns, record, vector)
    }
    fn put_node(
        &mut self,
        ns: &Namespace,
        node: EvidenceNode,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        Tx::put_node(self, ns, node, vector)
    }
    fn put_segment(&mut self, ns: &Namespace, row: &SegmentRow) -> Result<()> {
        Tx::put_segment(self, ns, row)
    }
    fn put_state(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<()> {
        Tx::put_state(self, ns, session, name, value)
    }
    fn log_usage(&mut self, ns: &Namespace, usage: &TokenUsage) -> Result<()> {
        Tx::log_usage(self, ns, usage)
    }
}
