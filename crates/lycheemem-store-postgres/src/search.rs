//! Vector, full-text and temporal search ([`StoreSearch`]).
//!
//! Vector search: a namespace (or filter) of at most `exact_search_below` vectors is scanned
//! exactly (ordered by distance, then insertion key — two sort keys, so the HNSW index cannot
//! serve it); a larger one goes through the target's HNSW index with iterative scans in strict
//! order, and falls back to the exact scan when a filtered search returns fewer than `k` hits
//! while more matching vectors exist. Scores are cosine similarities (1 − cosine distance).
//!
//! Full text: BM25 over the namespace's live documents, with the analyzer and arithmetic of
//! [`lycheemem_store::text`]. The database ranks candidates in double precision and returns
//! `k` plus a margin; their scores are then recomputed in single precision exactly as the
//! embedded backend's, and ties are ranked by id.

use lycheemem_core::{EvidenceNode, Namespace, Result, SessionId};
use lycheemem_store::text::{self, Bm25};
use lycheemem_store::{
    Hit, ItemRef, StoreLookup, StoreSearch, Target, VectorQuery, check_query_dims,
};
use pgvector::Vector;
use postgres::types::ToSql;
use std::collections::HashMap;

use crate::{PgStore, from_json, pg_err};

/// Extra candidates fetched past `k` so that ties at the cut are ranked by id.
const TIE_MARGIN: i64 = 16;

/// Which items of a target a vector search may return.
enum Filter<'a> {
    All,
    Session(&'a SessionId),
    Ids(&'a [String]),
}

impl PgStore {
    /// The SQL condition on `lm_items i` (`$1` is the namespace, `$2` the filter's value) and
    /// the filter's parameter, if any.
    fn filter_sql<'a>(
        target: Target,
        filter: &'a Filter<'a>,
        session_param: &'a String,
    ) -> (String, Vec<&'a (dyn ToSql + Sync)>) {
        match filter {
            Filter::All => (String::new(), Vec::new()),
            Filter::Ids(ids) => (
                " AND i.id = ANY($2)".into(),
                vec![ids as &(dyn ToSql + Sync)],
            ),
            Filter::Session(_) => match target {
                Target::Node(_) => (
                    " AND i.id IN (SELECT rn.node_id FROM lm_record_nodes rn \
                     JOIN lm_records r ON r.ns = rn.ns AND r.id = rn.record_id \
                     WHERE rn.ns = $1 AND r.session = $2)"
                        .into(),
                    vec![session_param as &(dyn ToSql + Sync)],
                ),
                _ => (
                    " AND $2 = ANY(i.sessions)".into(),
                    vec![session_param as &(dyn ToSql + Sync)],
                ),
            },
        }
    }

    fn search_vectors(
        &self,
        ns: &Namespace,
        target: Target,
        vector: &[f32],
        k: usize,
        filter: Filter<'_>,
    ) -> Result<Vec<Hit>> {
        check_query_dims(vector, self.options.dims)?;
        if k == 0 {
            return Ok(Vec::new());
        }
        let session_param = match &filter {
            Filter::Session(s) => s.to_string(),
            _ => String::new(),
        };
        let (cond, extra) = Self::filter_sql(target, &filter, &session_param);
        let t = target.as_str();
        let vt = self.vector_type;
        let q = Vector::from(vector.to_vec());
        let k_sql = i64::try_from(k).unwrap_or(i64::MAX);
        let ns_s = ns.as_str();
        // $1 the namespace, [$2 the filter's value], then the query vector and k.
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&ns_s];
        params.extend(extra);
        let (qp, kp) = (params.len() + 1, params.len() + 2);
        let mut conn = self.conn()?;
        let mut tx = conn.transaction().map_err(pg_err)?;
        // Whether the candidates are few enough for exact search, and whether the index found
        // enough: counted up to max(threshold, k) + 1 only (a full count cost ~10 ms per search
        // at 100k items).
        let below = i64::try_from(self.options.index.exact_search_below.max(k))
            .unwrap_or(i64::MAX)
            .saturating_add(1);
        let available: i64 = tx
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT 1 FROM lm_items i WHERE i.ns = $1 \
                     AND i.target = '{t}' AND i.embedding IS NOT NULL{cond} LIMIT {below}) c"
                ),
                &params,
            )
            .map_err(pg_err)?
            .get(0);
        params.extend([&q as &(dyn ToSql + Sync), &k_sql]);
        let available = available.max(0) as usize;
        let exact_sql = format!(
            "SELECT i.id, (i.embedding <=> ${qp}::vector::{vt}) AS d FROM lm_items i \
             WHERE i.ns = $1 AND i.target = '{t}' AND i.embedding IS NOT NULL{cond} \
             ORDER BY d, i.key LIMIT ${kp}"
        );
        let rows = if available <= self.options.index.exact_search_below {
            tx.query(&exact_sql, &params).map_err(pg_err)?
        } else {
            let ef = self
                .ef_search
                .load(std::sync::atomic::Ordering::Relaxed)
                .max(k)
                .clamp(1, 1000);
            tx.batch_execute(&format!(
                "SET LOCAL hnsw.ef_search = {ef}; SET LOCAL hnsw.iterative_scan = strict_order"
            ))
            .map_err(pg_err)?;
            let rows = tx
                .query(
                    &format!(
                        "SELECT i.id, (i.embedding <=> ${qp}::vector::{vt}) AS d FROM lm_items i \
                         WHERE i.ns = $1 AND i.target = '{t}' AND i.embedding IS NOT NULL{cond} \
                         ORDER BY i.embedding <=> ${qp}::vector::{vt} LIMIT ${kp}"
                    ),
                    &params,
                )
                .map_err(pg_err)?;
            if rows.len() >= k.min(available) {
                rows
            } else {
                tx.query(&exact_sql, &params).map_err(pg_err)?
            }
        };
        tx.commit().map_err(pg_err)?;
        rows.into_iter()
            .map(|r| {
                let d: f64 = r.get(1);
                Ok(Hit {
                    item: ItemRef::from_id(target, r.get(0))?,
                    target,
                    score: (1.0 - d) as f32,
                })
            })
            .collect()
    }
}

impl StoreSearch for PgStore {
    fn vector_search(&self, ns: &Namespace, q: &VectorQuery) -> Result<Vec<Hit>> {
        let filter = match &q.session {
            Some(s) => Filter::Session(s),
            None => Filter::All,
        };
        self.search_vectors(ns, q.target, &q.vector, q.k, filter)
    }

    fn vector_search_within(
        &self,
        ns: &Namespace,
        target: Target,
        vector: &[f32],
        k: usize,
        ids: &[String],
    ) -> Result<Vec<Hit>> {
        self.search_vectors(ns, target, vector, k, Filter::Ids(ids))
    }

    /// The node's row is read once for all the query vectors.
    fn vector_search_node_many(
        &self,
        ns: &Namespace,
        node_id: &str,
        vectors: &[&[f32]],
        k: usize,
    ) -> Result<Vec<Vec<Hit>>> {
        let Some(node) = self.nodes(ns, &[node_id.to_string()])?.into_iter().next() else {
            return Ok(vectors.iter().map(|_| Vec::new()).collect());
        };
        let ids: Vec<String> = node.record_ids.into_iter().collect();
        vectors
            .iter()
            .map(|v| self.vector_search_within(ns, Target::Record, v, k, &ids))
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
        let terms = text::query_terms(&mut text::analyzer(), query);
        if terms.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let n = ns.as_str();
        let mut conn = self.conn()?;
        let mut tx = conn
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(pg_err)?;
        let Some(stats) = tx
            .query_opt(
                "SELECT docs, tokens FROM lm_text_stats WHERE ns = $1",
                &[&n],
            )
            .map_err(pg_err)?
        else {
            return Ok(Vec::new());
        };
        let (docs, tokens): (i64, i64) = (stats.get(0), stats.get(1));
        if docs <= 0 {
            return Ok(Vec::new());
        }
        let bm25 = Bm25::new(docs as u64, tokens.max(0) as u64);
        let df: HashMap<String, i64> = tx
            .query(
                "SELECT term, df FROM lm_term_df WHERE ns = $1 AND term = ANY($2)",
                &[&n, &terms],
            )
            .map_err(pg_err)?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let weights: Vec<f32> = terms
            .iter()
            .map(|t| bm25.term_weight(df.get(t).copied().unwrap_or(0).max(0) as u64))
            .collect();
        let weights_sql: Vec<f64> = weights.iter().map(|w| f64::from(*w)).collect();
        let norms: Vec<i32> = (0..=255u8).map(|id| text::norm_of(id) as i32).collect();
        let avg = f64::from(bm25.average_norm());
        let limit = i64::try_from(k)
            .unwrap_or(i64::MAX)
            .saturating_add(TIE_MARGIN);
        let session_s = session.map(|s| s.to_string());
        let t = target.as_str();
        let score_sql = format!(
            "sum(w.weight * p.tf / (p.tf + {k1} * (1 - {b} + {b} * \
               ($4::int[])[p.norm_id + 1] / $5::float8))) AS s",
            k1 = text::BM25_K1,
            b = text::BM25_B,
        );
        // Top (k + margin) documents by BM25 among those holding at least one of the terms
        // `essential` (indices into `terms`; all of them: no restriction), scored from the
        // postings alone (their primary key includes tf and the length id). Restricted, the
        // candidates are collected first and each is scored by primary-key lookups of its
        // postings. A session filter looks the item up.
        let top = |tx: &mut postgres::Transaction<'_>,
                   essential: &[usize]|
         -> Result<Vec<postgres::Row>> {
            let names: Vec<&str> = essential.iter().map(|&i| terms[i].as_str()).collect();
            let mut params: Vec<&(dyn ToSql + Sync)> =
                vec![&n, &terms, &weights_sql, &norms, &avg, &limit];
            let mut filter = String::new();
            if let Some(s) = &session_s {
                params.push(s);
                // A correlated scalar subquery: always a primary-key lookup per posting, where
                // an EXISTS may be planned as a join that scans `lm_items` per row when the
                // tables have no statistics yet (a fresh store: ~200 ms at 1,000 items).
                filter = format!(
                    " AND (SELECT ${}::text = ANY(i.sessions) FROM lm_items i WHERE i.ns = p.ns \
                       AND i.target = p.target AND i.id = p.id)",
                    params.len()
                );
            }
            let sql = if essential.len() < terms.len() {
                params.push(&names);
                format!(
                    "WITH c AS MATERIALIZED (SELECT DISTINCT p.id FROM lm_postings p \
                       WHERE p.ns = $1 AND p.target = '{t}' AND p.term = ANY(${}::text[]){filter}) \
                     SELECT c.id, min(p.norm_id), array_agg(p.term), array_agg(p.tf), {score_sql} \
                     FROM c CROSS JOIN unnest($2::text[], $3::float8[]) AS w(term, weight) \
                     JOIN lm_postings p ON p.ns = $1 AND p.term = w.term \
                       AND p.target = '{t}' AND p.id = c.id \
                     GROUP BY c.id ORDER BY s DESC, c.id LIMIT $6",
                    params.len()
                )
            } else {
                format!(
                    "SELECT p.id, min(p.norm_id), array_agg(p.term), array_agg(p.tf), {score_sql} \
                     FROM lm_postings p \
                     JOIN unnest($2::text[], $3::float8[]) AS w(term, weight) ON p.term = w.term \
                     WHERE p.ns = $1 AND p.target = '{t}'{filter} \
                     GROUP BY p.id ORDER BY s DESC, p.id LIMIT $6"
                )
            };
            tx.query(&sql, &params).map_err(pg_err)
        };
        // Pruning (exact, after MaxScore): a term adds less than its weight to any document.
        // Score the documents holding the rarest terms first (enough of them to fill the
        // list); its last score θ bounds the answer from below, and a document holding only
        // terms whose weights sum below θ cannot enter it. If every term that can lift a
        // document to θ (the essential ones) was among those scored, the list is the answer;
        // else score again among the documents holding an essential term. A restricted query
        // costs about `PROBE_COST` posting reads per candidate and query term, so it runs only
        // when that is less than reading every query term's posting list; otherwise (and when
        // the rare terms' documents do not fill the list) the whole lists are scored.
        const PROBE_COST: f64 = 4.0;
        let full = usize::try_from(limit).unwrap_or(usize::MAX);
        // Term indices, heaviest (rarest) first.
        let mut by_weight: Vec<usize> = (0..terms.len()).collect();
        by_weight.sort_by(|&a, &b| weights_sql[b].total_cmp(&weights_sql[a]));
        let df_of = |i: usize| df.get(&terms[i]).copied().unwrap_or(0).max(0) as f64;
        let postings_of = |set: &[usize]| set.iter().map(|&i| df_of(i)).sum::<f64>();
        let all_postings = postings_of(&by_weight);
        let worth_restricting = |set: &[usize]| {
            set.len() < terms.len()
                && postings_of(set) * terms.len() as f64 * PROBE_COST < all_postings
        };
        // The rarest terms whose documents can fill the list.
        let mut tried = 0;
        let mut reach = 0.0;
        while tried < by_weight.len() && reach < full as f64 {
            reach += df_of(by_weight[tried]);
            tried += 1;
        }
        let mut rows = None;
        if worth_restricting(&by_weight[..tried]) {
            let first = top(&mut tx, &by_weight[..tried])?;
            if first.len() >= full
                && let Some(theta) = first.last().map(|r| r.get::<_, f64>(4))
            {
                // The lightest terms whose weights sum below θ (with room for rounding) are
                // not essential; the rest are, the heaviest first.
                let mut bound = 0.0f64;
                let mut light = 0;
                for &i in by_weight.iter().rev() {
                    if bound + weights_sql[i] >= theta * (1.0 - 1e-9) {
                        break;
                    }
                    bound += weights_sql[i];
                    light += 1;
                }
                let essential = &by_weight[..by_weight.len() - light];
                if essential.len() <= tried {
                    rows = Some(first);
                } else if worth_restricting(essential) {
                    rows = Some(top(&mut tx, essential)?);
                }
            }
        }
        let rows = match rows {
            Some(rows) => rows,
            None => top(&mut tx, &by_weight)?,
        };
        tx.commit().map_err(pg_err)?;
        let position: HashMap<&str, usize> = terms
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        let mut scored: Vec<(String, f32)> = Vec::with_capacity(rows.len());
        for r in rows {
            let id: String = r.get(0);
            let norm_id = r.get::<_, i16>(1) as u8;
            let doc_terms: Vec<String> = r.get(2);
            let tfs: Vec<i32> = r.get(3);
            let mut matched: Vec<(usize, u32)> = doc_terms
                .iter()
                .zip(tfs)
                .filter_map(|(term, tf)| Some((*position.get(term.as_str())?, tf.max(0) as u32)))
                .collect();
            matched.sort_unstable();
            let score = matched.iter().fold(0.0f32, |acc, (i, tf)| {
                acc + bm25.term_score(weights[*i], *tf, norm_id)
            });
            scored.push((id, score));
        }
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        scored.truncate(k);
        scored
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
        let ranges = lycheemem_store::rules::temporal_node_ranges(since, until)?;
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn()?;
        let mut out = Vec::new();
        for (lo, hi) in ranges {
            for r in conn
                .query(
                    "SELECT body FROM lm_nodes WHERE ns = $1 AND id >= $2 AND id <= $3 ORDER BY id",
                    &[&ns.as_str(), &lo, &hi],
                )
                .map_err(pg_err)?
            {
                out.push(from_json(r.get(0), "node")?);
            }
        }
        Ok(out)
    }

    /// The stored vectors: the database holds one copy, at the index's precision.
    fn scoring_vectors(&self, ns: &Namespace, items: &[ItemRef]) -> Result<Vec<Option<Vec<f32>>>> {
        self.item_vectors(ns, items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_names_are_safe_to_format_into_sql() {
        // Partial-index predicates need the target as a literal.
        for t in Target::ALL {
            assert!(
                t.as_str()
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_')
            );
        }
    }
}
