//! Lookups and the catalog ([`StoreLookup`], [`StoreCatalog`]).

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{
    EvidenceNode, Namespace, NodeKind, Record, Result, SessionId, Turn, TurnRef, UsageTotals,
};
use lycheemem_store::{
    ItemRef, NamespaceStats, SegmentRow, SessionInfo, StoreCatalog, StoreLookup, Target,
};
use std::collections::HashMap;

use crate::{PgStore, from_json, pg_err};

impl PgStore {
    /// Rows of `table` with these ids, in the order asked (missing ones left out).
    fn bodies_by_id<T: serde::de::DeserializeOwned>(
        &self,
        table: &str,
        ns: &Namespace,
        ids: &[String],
        what: &str,
    ) -> Result<Vec<T>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn()?;
        let rows = conn
            .query(
                &format!("SELECT id, body FROM {table} WHERE ns = $1 AND id = ANY($2)"),
                &[&ns.as_str(), &ids],
            )
            .map_err(pg_err)?;
        let by_id: HashMap<String, Vec<u8>> = rows
            .into_iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, Vec<u8>>(1)))
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(body) = by_id.get(id) {
                out.push(from_json(body, what)?);
            }
        }
        Ok(out)
    }

    fn all_bodies<T: serde::de::DeserializeOwned>(
        &self,
        sql: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
        what: &str,
    ) -> Result<Vec<T>> {
        let mut conn = self.conn()?;
        conn.query(sql, params)
            .map_err(pg_err)?
            .into_iter()
            .map(|r| from_json(r.get(0), what))
            .collect()
    }

    /// Stored vectors of items, `None` where the item or its vector is missing.
    pub(crate) fn item_vectors(
        &self,
        ns: &Namespace,
        items: &[ItemRef],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let targets: Vec<&str> = items.iter().map(|i| i.target().as_str()).collect();
        let ids: Vec<String> = items.iter().map(ItemRef::id).collect();
        let mut conn = self.conn()?;
        let rows = conn
            .query(
                "SELECT i.target, i.id, i.embedding::vector FROM lm_items i \
                 JOIN unnest($2::text[], $3::text[]) AS q(target, id) \
                 ON i.target = q.target AND i.id = q.id \
                 WHERE i.ns = $1 AND i.embedding IS NOT NULL",
                &[&ns.as_str(), &targets, &ids],
            )
            .map_err(pg_err)?;
        let found: HashMap<(String, String), Vec<f32>> = rows
            .into_iter()
            .map(|r| {
                (
                    (r.get::<_, String>(0), r.get::<_, String>(1)),
                    r.get::<_, pgvector::Vector>(2).to_vec(),
                )
            })
            .collect();
        Ok(targets
            .iter()
            .zip(&ids)
            .map(|(t, id)| found.get(&(t.to_string(), id.clone())).cloned())
            .collect())
    }
}

impl StoreLookup for PgStore {
    fn session(&self, ns: &Namespace, id: &SessionId) -> Result<Option<SessionInfo>> {
        let mut conn = self.conn()?;
        crate::tx::read_session(&mut *conn, ns, id, false)
    }

    fn turn_range(
        &self,
        ns: &Namespace,
        session: &SessionId,
        first: u32,
        last: u32,
    ) -> Result<Vec<Turn>> {
        let first = i32::try_from(first).unwrap_or(i32::MAX);
        let last = i32::try_from(last).unwrap_or(i32::MAX);
        self.all_bodies(
            "SELECT body FROM lm_turns WHERE ns = $1 AND session = $2 \
             AND idx >= $3 AND idx <= $4 ORDER BY idx",
            &[&ns.as_str(), &session.as_str(), &first, &last],
            "turn",
        )
    }

    fn records(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<Record>> {
        self.bodies_by_id("lm_records", ns, ids, "record")
    }

    fn nodes(&self, ns: &Namespace, ids: &[String]) -> Result<Vec<EvidenceNode>> {
        self.bodies_by_id("lm_nodes", ns, ids, "node")
    }

    fn state(
        &self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
    ) -> Result<Option<serde_json::Value>> {
        let mut conn = self.conn()?;
        conn.query_opt(
            "SELECT value FROM lm_state WHERE ns = $1 AND session = $2 AND name = $3",
            &[&ns.as_str(), &session.as_str(), &name],
        )
        .map_err(pg_err)?
        .map(|r| from_json(r.get(0), "state"))
        .transpose()
    }
}

impl StoreCatalog for PgStore {
    fn vector_dims(&self) -> usize {
        self.options.dims
    }

    fn namespaces(&self) -> Result<Vec<Namespace>> {
        let mut conn = self.conn()?;
        conn.query("SELECT DISTINCT ns FROM lm_sessions ORDER BY ns", &[])
            .map_err(pg_err)?
            .into_iter()
            .map(|r| Namespace::new(r.get::<_, String>(0)))
            .collect()
    }

    fn has_namespace(&self, ns: &Namespace) -> Result<bool> {
        let mut conn = self.conn()?;
        PgStore::ns_exists(&mut *conn, ns)
    }

    fn sessions(&self, ns: &Namespace) -> Result<Vec<SessionInfo>> {
        let mut conn = self.conn()?;
        conn.query(
            "SELECT turn_count, body FROM lm_sessions WHERE ns = $1 ORDER BY id",
            &[&ns.as_str()],
        )
        .map_err(pg_err)?
        .into_iter()
        .map(|r| {
            let mut info: SessionInfo = from_json(r.get(1), "session")?;
            info.turn_count = r.get::<_, i32>(0).max(0) as u32;
            Ok(info)
        })
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
        self.all_bodies(
            "SELECT body FROM lm_records WHERE ns = $1 ORDER BY id",
            &[&ns.as_str()],
            "record",
        )
    }

    fn records_page(
        &self,
        ns: &Namespace,
        session: Option<&SessionId>,
        offset: usize,
        limit: usize,
    ) -> Result<(usize, Vec<Record>)> {
        let offset = i64::try_from(offset).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.conn()?;
        let (total, rows) = match session {
            None => (
                conn.query_one(
                    "SELECT count(*) FROM lm_records WHERE ns = $1",
                    &[&ns.as_str()],
                )
                .map_err(pg_err)?
                .get::<_, i64>(0),
                conn.query(
                    "SELECT body FROM lm_records WHERE ns = $1 ORDER BY id OFFSET $2 LIMIT $3",
                    &[&ns.as_str(), &offset, &limit],
                )
                .map_err(pg_err)?,
            ),
            Some(s) => (
                conn.query_one(
                    "SELECT count(*) FROM lm_records WHERE ns = $1 AND session = $2",
                    &[&ns.as_str(), &s.as_str()],
                )
                .map_err(pg_err)?
                .get::<_, i64>(0),
                conn.query(
                    "SELECT body FROM lm_records WHERE ns = $1 AND session = $2 \
                     ORDER BY id OFFSET $3 LIMIT $4",
                    &[&ns.as_str(), &s.as_str(), &offset, &limit],
                )
                .map_err(pg_err)?,
            ),
        };
        let page = rows
            .into_iter()
            .map(|r| from_json(r.get(0), "record"))
            .collect::<Result<Vec<Record>>>()?;
        Ok((total.max(0) as usize, page))
    }

    fn all_nodes(&self, ns: &Namespace) -> Result<Vec<EvidenceNode>> {
        self.all_bodies(
            "SELECT body FROM lm_nodes WHERE ns = $1 ORDER BY id",
            &[&ns.as_str()],
            "node",
        )
    }

    fn segments(&self, ns: &Namespace, session: &SessionId) -> Result<Vec<SegmentRow>> {
        self.all_bodies(
            "SELECT body FROM lm_segments WHERE ns = $1 AND session = $2 ORDER BY first_turn",
            &[&ns.as_str(), &session.as_str()],
            "segment",
        )
    }

    fn usage_log(&self, ns: &Namespace) -> Result<Vec<TokenUsage>> {
        self.all_bodies(
            "SELECT body FROM lm_usage WHERE ns = $1 ORDER BY seq",
            &[&ns.as_str()],
            "usage",
        )
    }

    fn stats(&self, ns: &Namespace) -> Result<NamespaceStats> {
        let mut conn = self.conn()?;
        let n = ns.as_str();
        let count = |conn: &mut crate::Conn, sql: &str| -> Result<u64> {
            Ok(conn
                .query_one(sql, &[&n])
                .map_err(pg_err)?
                .get::<_, i64>(0)
                .max(0) as u64)
        };
        let mut stats = NamespaceStats {
            sessions: count(&mut conn, "SELECT count(*) FROM lm_sessions WHERE ns = $1")?,
            turns: count(&mut conn, "SELECT count(*) FROM lm_turns WHERE ns = $1")?,
            segments: count(&mut conn, "SELECT count(*) FROM lm_segments WHERE ns = $1")?,
            failed_segments: count(
                &mut conn,
                "SELECT count(*) FROM lm_segments WHERE ns = $1 AND failed",
            )?,
            records: count(&mut conn, "SELECT count(*) FROM lm_records WHERE ns = $1")?,
            pending_vectors: count(
                &mut conn,
                "SELECT count(*) FROM lm_items WHERE ns = $1 AND pending",
            )?,
            ..NamespaceStats::default()
        };
        for kind in NodeKind::ALL {
            stats.nodes.insert(kind.as_str().to_string(), 0);
        }
        for r in conn
            .query(
                "SELECT kind, count(*) FROM lm_nodes WHERE ns = $1 GROUP BY kind",
                &[&n],
            )
            .map_err(pg_err)?
        {
            stats
                .nodes
                .insert(r.get(0), r.get::<_, i64>(1).max(0) as u64);
        }
        for target in Target::ALL {
            let name = target.as_str().to_string();
            stats.vectors.insert(name.clone(), 0);
            stats.indexed_vectors.insert(name.clone(), 0);
            stats.text_rows.insert(name, 0);
        }
        for r in conn
            .query(
                "SELECT target, count(*) FILTER (WHERE embedding IS NOT NULL), count(*) \
                 FROM lm_items WHERE ns = $1 GROUP BY target",
                &[&n],
            )
            .map_err(pg_err)?
        {
            let name: String = r.get(0);
            let vectors = r.get::<_, i64>(1).max(0) as u64;
            // The HNSW indexes are part of the table: every stored vector is indexed.
            stats.vectors.insert(name.clone(), vectors);
            stats.indexed_vectors.insert(name.clone(), vectors);
            stats
                .text_rows
                .insert(name, r.get::<_, i64>(2).max(0) as u64);
        }
        drop(conn);
        let mut usage = UsageTotals::default();
        for u in self.usage_log(ns)? {
            usage.add(&u);
        }
        stats.usage = usage;
        Ok(stats)
    }

    fn vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>> {
        self.item_vectors(ns, items)
    }

    fn pending_vectors(&self, ns: &Namespace, limit: usize) -> Result<Vec<(ItemRef, String)>> {
        let order: Vec<&str> = Target::ALL.iter().map(|t| t.as_str()).collect();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.conn()?;
        let rows = conn
            .query(
                "SELECT target, id FROM lm_items WHERE ns = $1 AND pending \
                 ORDER BY array_position($2::text[], target::text), id LIMIT $3",
                &[&ns.as_str(), &order, &limit],
            )
            .map_err(pg_err)?;
        drop(conn);
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let target = Target::parse(r.get(0))?;
            let item = ItemRef::from_id(target, r.get(1))?;
            let text = match &item {
                ItemRef::Record(id) => self
                    .records(ns, std::slice::from_ref(id))?
                    .pop()
                    .map(|r| lycheemem_store::rules::record_embed_text(&r)),
                ItemRef::Node(id) => self
                    .nodes(ns, std::slice::from_ref(id))?
                    .pop()
                    .map(|n| n.search_text),
                ItemRef::Turn(t) => self
                    .turn_range(ns, &t.session, t.index, t.index)?
                    .pop()
                    .map(|t| lycheemem_store::rules::turn_search_text(&t)),
            };
            if let Some(text) = text {
                out.push((item, text));
            }
        }
        Ok(out)
    }
}
