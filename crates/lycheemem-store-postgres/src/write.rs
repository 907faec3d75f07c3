//! [`StoreWrite`] and [`StoreAdmin`]: each call is one transaction.

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{Error, Namespace, Result, SessionId, Turn};
use lycheemem_store::{
    DeleteReceipt, EmbedFn, ExportLine, ExportOptions, ExportWriter, ImportReceipt, ItemRef,
    SegmentRow, SegmentWrite, SessionInfo, StoreAdmin, StoreWrite, WriteReceipt, read_import,
};
use std::io::{BufRead, Write};

use crate::tx::Tx;
use crate::{PgStore, from_json, pg_err};

impl PgStore {
    /// Runs `f` in one write transaction; returns its value and the transaction's write
    /// sequence.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&mut Tx<'_>) -> Result<T>) -> Result<(T, u64)> {
        let mut conn = self.conn()?;
        let mut tx = Tx::begin(
            &mut conn,
            self.options.dims,
            self.options.node_text_chars,
            self.vector_type,
        )?;
        let value = f(&mut tx)?;
        let seq = tx.commit()?;
        Ok((value, seq))
    }
}

impl StoreWrite for PgStore {
    fn put_session(&self, ns: &Namespace, info: SessionInfo) -> Result<WriteReceipt> {
        self.write(|w| {
            let turn_count =
                crate::tx::read_session(&mut w.tx, ns, &info.id, true)?.map_or(0, |s| s.turn_count);
            w.put_session(ns, &SessionInfo { turn_count, ..info })
        })
        .map(|(_, seq)| WriteReceipt { seq })
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
        .map(|(_, seq)| WriteReceipt { seq })
    }

    fn commit_segment(&self, ns: &Namespace, write: SegmentWrite) -> Result<WriteReceipt> {
        self.write(|w| {
            w.lock_namespace(ns)?;
            w.commit_segment(ns, write)
        })
        .map(|(_, seq)| WriteReceipt { seq })
    }

    fn put_state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<WriteReceipt> {
        self.write(|w| w.put_state(ns, session, name, value))
            .map(|(_, seq)| WriteReceipt { seq })
    }

    fn log_usage(&self, ns: &Namespace, usage: &[TokenUsage]) -> Result<WriteReceipt> {
        self.write(|w| usage.iter().try_for_each(|u| w.log_usage(ns, u)))
            .map(|(_, seq)| WriteReceipt { seq })
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

impl StoreAdmin for PgStore {
    fn delete_record(&self, ns: &Namespace, record_id: &str) -> Result<DeleteReceipt> {
        self.write(|w| {
            w.lock_namespace(ns)?;
            w.delete_record(ns, record_id)
        })
        .map(|(r, _)| r)
    }

    fn delete_session(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| {
            w.lock_namespace(ns)?;
            w.delete_session(ns, session)
        })
        .map(|(r, _)| r)
    }

    fn clear_session_derived(&self, ns: &Namespace, session: &SessionId) -> Result<DeleteReceipt> {
        self.write(|w| {
            w.lock_namespace(ns)?;
            w.clear_session_derived(ns, session)
        })
        .map(|(r, _)| r)
    }

    fn delete_namespace(&self, ns: &Namespace) -> Result<DeleteReceipt> {
        self.write(|w| {
            w.lock_namespace(ns)?;
            w.delete_namespace(ns)
        })
        .map(|(r, _)| r)
    }

    fn export(&self, ns: &Namespace, out: &mut dyn Write, opts: ExportOptions) -> Result<u64> {
        let mut conn = self.conn()?;
        // One snapshot for the whole file.
        let mut tx = conn
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(pg_err)?;
        let n = ns.as_str();
        let mut export = ExportWriter::new(out, ns, self.options.dims)?;
        let vector_sql = if opts.include_vectors {
            "i.embedding::vector"
        } else {
            "NULL::vector"
        };
        for r in tx
            .query(
                "SELECT turn_count, body FROM lm_sessions WHERE ns = $1 ORDER BY id",
                &[&n],
            )
            .map_err(pg_err)?
        {
            let mut info: SessionInfo = from_json(r.get(1), "session")?;
            info.turn_count = r.get::<_, i32>(0).max(0) as u32;
            export.write(&ExportLine::Session(info))?;
        }
        for r in tx
            .query(
                &format!(
                    "SELECT t.body, {vector_sql} FROM lm_turns t LEFT JOIN lm_items i \
                     ON i.ns = t.ns AND i.target = 'turn' AND i.id = t.session || '#' || t.idx \
                     WHERE t.ns = $1 ORDER BY t.session, t.idx"
                ),
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::Turn {
                turn: from_json(r.get(0), "turn")?,
                vector: r.get::<_, Option<pgvector::Vector>>(1).map(|v| v.to_vec()),
            })?;
        }
        for r in tx
            .query(
                &format!(
                    "SELECT x.body, {vector_sql} FROM lm_records x LEFT JOIN lm_items i \
                     ON i.ns = x.ns AND i.target = 'record' AND i.id = x.id \
                     WHERE x.ns = $1 ORDER BY x.id"
                ),
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::Record {
                record: from_json(r.get(0), "record")?,
                vector: r.get::<_, Option<pgvector::Vector>>(1).map(|v| v.to_vec()),
            })?;
        }
        for r in tx
            .query(
                &format!(
                    "SELECT x.body, {vector_sql} FROM lm_nodes x LEFT JOIN lm_items i \
                     ON i.ns = x.ns AND i.target = x.kind AND i.id = x.id \
                     WHERE x.ns = $1 ORDER BY x.id"
                ),
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::Node {
                node: from_json(r.get(0), "node")?,
                vector: r.get::<_, Option<pgvector::Vector>>(1).map(|v| v.to_vec()),
            })?;
        }
        for r in tx
            .query(
                "SELECT body FROM lm_segments WHERE ns = $1 ORDER BY session, first_turn",
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::Segment(from_json::<SegmentRow>(
                r.get(0),
                "segment",
            )?))?;
        }
        for r in tx
            .query(
                "SELECT session, name, value FROM lm_state WHERE ns = $1 ORDER BY session, name",
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::State {
                session: SessionId::new(r.get::<_, String>(0))?,
                name: r.get(1),
                value: from_json(r.get(2), "state")?,
            })?;
        }
        for r in tx
            .query(
                "SELECT body FROM lm_usage WHERE ns = $1 ORDER BY seq",
                &[&n],
            )
            .map_err(pg_err)?
        {
            export.write(&ExportLine::Usage(from_json(r.get(0), "usage")?))?;
        }
        tx.commit().map_err(pg_err)?;
        export.finish()
    }

    fn import(
        &self,
        ns: &Namespace,
        input: &mut dyn BufRead,
        embed: Option<&EmbedFn>,
    ) -> Result<ImportReceipt> {
        {
            let mut conn = self.conn()?;
            if PgStore::ns_exists(&mut *conn, ns)? {
                return Err(Error::InvalidInput(format!(
                    "namespace {ns} is not empty; import into a new namespace or delete it first"
                )));
            }
        }
        let (lines, mut receipt) = read_import(input, self.options.dims, embed)?;
        self.write(|w| {
            w.lock_namespace(ns)?;
            // Checked again under the lock: a concurrent import into the same name loses.
            if PgStore::ns_exists(&mut w.tx, ns)? {
                return Err(Error::Conflict(format!(
                    "namespace {ns} was filled by another writer during the import"
                )));
            }
            lycheemem_store::write_import(ns, lines, &mut receipt, w)
        })?;
        // A bulk load: fresh planner statistics, so the next searches are planned for the
        // tables as they now are rather than waiting for autovacuum.
        let mut conn = self.conn()?;
        conn.batch_execute("ANALYZE lm_items, lm_postings, lm_records, lm_nodes, lm_record_nodes")
            .map_err(pg_err)?;
        Ok(receipt)
    }

    /// Nothing to persist: every write is already in the database and its indexes.
    fn checkpoint(&self) -> Result<()> {
        Ok(())
    }
}

impl lycheemem_store::StoreSettings for PgStore {
    fn setting(&self, name: &str) -> Result<Option<(serde_json::Value, u64)>> {
        let mut conn = self.conn()?;
        conn.query_opt(
            "SELECT value, version FROM lm_settings WHERE name = $1",
            &[&name],
        )
        .map_err(pg_err)?
        .map(|r| {
            Ok((
                from_json(r.get(0), "setting")?,
                r.get::<_, i64>(1).max(0) as u64,
            ))
        })
        .transpose()
    }

    fn put_setting(
        &self,
        name: &str,
        value: &serde_json::Value,
        expected: Option<u64>,
    ) -> Result<u64> {
        let mut conn = self.conn()?;
        let mut tx = conn.transaction().map_err(pg_err)?;
        // The row lock (or, for a new name, the primary key) serializes concurrent writers.
        let current: u64 = tx
            .query_opt(
                "SELECT version FROM lm_settings WHERE name = $1 FOR UPDATE",
                &[&name],
            )
            .map_err(pg_err)?
            .map_or(0, |r| r.get::<_, i64>(0).max(0) as u64);
        if let Some(expected) = expected
            && expected != current
        {
            return Err(lycheemem_store::setting_conflict(name, expected, current));
        }
        let version = current + 1;
        let inserted = tx
            .execute(
                "INSERT INTO lm_settings (name, version, value) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO UPDATE SET version = excluded.version, value = excluded.value \
                 WHERE lm_settings.version = $2 - 1",
                &[&name, &(version as i64), &crate::json(value)?],
            )
            .map_err(pg_err)?;
        if inserted == 0 {
            return Err(lycheemem_store::setting_conflict(
                name,
                current,
                current + 1,
            ));
        }
        tx.commit().map_err(pg_err)?;
        Ok(version)
    }
}
