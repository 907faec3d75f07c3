//! Evidence nodes' members resolved once and packed: a main speaker's entity node can link tens
//! of thousands of records, and node expansion searches within it for most questions. Decoding
//! its row, looking every member's index key up and copying every member's vector out of the
//! index on each search cost far more than the search itself, so the store keeps each node with
//! at least [`CACHED_FROM`] records that a search touched resolved in memory — its member ids,
//! their index keys and their vectors packed row-major in one matrix, searched by an exact scan
//! — until the next write commits (every write clears the cache, before and after the derived
//! indexes apply it, so a read never sees a node or a vector as it was before a write that
//! returned). `StoreConfig::node_cache_mb` bounds the memory held.

use super::*;
use lycheemem_core::vector::{dot, norm};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Nodes with at least this many records are kept resolved.
pub(super) const CACHED_FROM: usize = 64;

/// One node's members: their ids (sorted), and for those with a vector their position, index
/// key, vector and norm.
pub(super) struct ResolvedNode {
    pub ids: Vec<String>,
    /// The vectors' dimension.
    pub dims: usize,
    /// Members with a vector: position in `ids` and index key.
    pub rows: Vec<(u32, u64)>,
    /// The rows' vectors in the same order (the in-memory indexed vector, else the stored
    /// one), `rows.len()` × dims, row-major.
    pub matrix: Vec<f32>,
    /// Each row's Euclidean norm (what [`lycheemem_core::vector::cosine`] divides by).
    pub norms: Vec<f32>,
}

impl ResolvedNode {
    /// Bytes held (ids, rows and vectors).
    fn bytes(&self) -> usize {
        self.ids.iter().map(|id| id.len() + 24).sum::<usize>()
            + self.rows.len() * 12
            + (self.matrix.len() + self.norms.len()) * 4
    }

    /// The `k` members nearest to each query by cosine similarity, best first (ties by index
    /// key, as the exact search orders them): `(position in ids, cosine)`. Exactly the cosines
    /// of [`lycheemem_core::vector::cosine`] (same operations, norms computed once); the matrix
    /// is read once for all queries.
    pub fn nearest(&self, queries: &[&[f32]], k: usize) -> Vec<Vec<(u32, f32)>> {
        let query_norms: Vec<f32> = queries.iter().map(|q| norm(q)).collect();
        let mut scores: Vec<Vec<(f32, u32)>> = queries
            .iter()
            .map(|_| Vec::with_capacity(self.rows.len()))
            .collect();
        for (i, (row, &n)) in self
            .matrix
            .chunks_exact(self.dims.max(1))
            .zip(&self.norms)
            .enumerate()
        {
            for ((q, &qn), out) in queries.iter().zip(&query_norms).zip(scores.iter_mut()) {
                let d = n * qn;
                let cos = if d > 0.0 { dot(row, q) / d } else { 0.0 };
                out.push((cos, i as u32));
            }
        }
        let order = |a: &(f32, u32), b: &(f32, u32)| {
            b.0.total_cmp(&a.0)
                .then(self.rows[a.1 as usize].1.cmp(&self.rows[b.1 as usize].1))
        };
        scores
            .into_iter()
            .map(|mut s| {
                if s.len() > k && k > 0 {
                    s.select_nth_unstable_by(k - 1, order);
                }
                s.truncate(k);
                s.sort_by(order);
                s.into_iter()
                    .map(|(cos, i)| (self.rows[i as usize].0, cos))
                    .collect()
            })
            .collect()
    }
}

#[derive(Default)]
pub(super) struct NodeCache {
    /// Bumped by every committed write; an entry computed under an older generation is not
    /// stored.
    generation: u64,
    /// By node key (`ns \0 node_id`): the node and when it was last used (a `clock` reading).
    entries: HashMap<Vec<u8>, (Arc<ResolvedNode>, AtomicU64)>,
    /// Bytes held by `entries`.
    held: usize,
    /// Ticks on every use (under the read lock too).
    clock: AtomicU64,
}

impl NodeCache {
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    pub(super) fn get(&self, key: &[u8]) -> Option<Arc<ResolvedNode>> {
        let (node, used) = self.entries.get(key)?;
        used.store(
            self.clock.fetch_add(1, Ordering::Relaxed),
            Ordering::Relaxed,
        );
        Some(node.clone())
    }

    /// Called with the write lock held, after a write transaction committed and again after
    /// the derived indexes applied it.
    pub(super) fn invalidate(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        self.entries.clear();
        self.held = 0;
    }

    /// Keeps `node`, read under `generation`, unless a write committed since. Past `max_bytes`
    /// in all, the least recently used nodes go until a quarter of the budget is free (a node
    /// larger than the budget is not kept): a main speaker's node, used by most questions,
    /// stays while the many small nodes one question touched make room.
    pub(super) fn insert(
        &mut self,
        generation: u64,
        key: Vec<u8>,
        node: Arc<ResolvedNode>,
        max_bytes: usize,
    ) {
        let bytes = node.bytes();
        if generation != self.generation || node.ids.len() < CACHED_FROM || bytes > max_bytes {
            return;
        }
        if let Some((old, _)) = self.entries.remove(&key) {
            self.held -= old.bytes();
        }
        if self.held + bytes > max_bytes {
            let mut by_use: Vec<(u64, Vec<u8>)> = self
                .entries
                .iter()
                .map(|(k, (_, used))| (used.load(Ordering::Relaxed), k.clone()))
                .collect();
            by_use.sort_unstable();
            let target = (max_bytes - max_bytes / 4).saturating_sub(bytes);
            for (_, k) in by_use {
                if self.held <= target {
                    break;
                }
                if let Some((old, _)) = self.entries.remove(&k) {
                    self.held -= old.bytes();
                }
            }
        }
        self.held += bytes;
        let used = AtomicU64::new(self.clock.fetch_add(1, Ordering::Relaxed));
        self.entries.insert(key, (node, used));
    }
}

impl Store {
    /// The members of node `node_id` resolved and packed: from the cache, else read in `txn`
    /// (and cached when large and no write committed since `generation`). `None` when the node
    /// does not exist. `members` is the node's members row when the caller already read it.
    pub(super) fn resolved_node(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        node_id: &str,
        generation: u64,
        members: Option<Members>,
    ) -> Result<Option<Arc<ResolvedNode>>> {
        let key = keys::ns_str(ns, node_id);
        if let Some(hit) = self
            .node_cache
            .read()
            .unwrap_or_else(lock_poisoned)
            .get(&key)
        {
            return Ok(Some(hit));
        }
        let members = match members {
            Some(members) => members,
            None => {
                let table = txn.open_table(NODE_MEMBERS).map_err(db_err)?;
                let Some(row) = table.get(key.as_slice()).map_err(db_err)? else {
                    return Ok(None);
                };
                decode_members(row.value())?
            }
        };
        let Members {
            ids,
            keys: member_keys,
        } = members;
        let mut keyed = Vec::with_capacity(ids.len());
        let mut id_keys = None;
        for (i, (id, &k)) in ids.iter().zip(&member_keys).enumerate() {
            if k != 0 {
                keyed.push((i as u32, k));
                continue;
            }
            // A record without a key when the row was written (none is expected: a node's
            // records are stored first) is looked up now.
            if id_keys.is_none() {
                id_keys = Some(txn.open_table(ID_KEYS).map_err(db_err)?);
            }
            if let Some(table) = &id_keys
                && let Some(k) = table
                    .get(keys::pending(ns, Target::Record, id).as_slice())
                    .map_err(db_err)?
            {
                keyed.push((i as u32, k.value()));
            }
        }
        let dims = self.options.dims;
        let record_keys: Vec<u64> = keyed.iter().map(|(_, k)| *k).collect();
        let mut matrix = Vec::new();
        // In-memory indexed vectors first; the stored rows of vectors not indexed yet after.
        let indexed = self
            .vectors
            .read()
            .unwrap_or_else(lock_poisoned)
            .append_many(ns.as_str(), Target::Record, &record_keys, &mut matrix);
        let (found, missing): (Vec<_>, Vec<_>) = keyed
            .into_iter()
            .zip(indexed)
            .partition(|&(_, found)| found);
        let mut rows: Vec<(u32, u64)> = found.into_iter().map(|(row, _)| row).collect();
        if !missing.is_empty() {
            let vectors = txn.open_table(VECTORS).map_err(db_err)?;
            for ((i, k), _) in missing {
                if let Some(v) = search::stored_vector(&vectors, ns, Target::Record, k)?
                    && v.len() == dims
                {
                    rows.push((i, k));
                    matrix.extend_from_slice(&v);
                }
            }
        }
        let norms: Vec<f32> = matrix.chunks_exact(dims.max(1)).map(norm).collect();
        let node = Arc::new(ResolvedNode {
            ids,
            dims,
            rows,
            matrix,
            norms,
        });
        self.node_cache
            .write()
            .unwrap_or_else(lock_poisoned)
            .insert(
                generation,
                key,
                node.clone(),
                self.options.index.node_cache_mb.saturating_mul(1 << 20),
            );
        Ok(Some(node))
    }

    /// The cache generation now (read before opening the transaction an entry is built in).
    pub(super) fn node_cache_generation(&self) -> u64 {
        self.node_cache
            .read()
            .unwrap_or_else(lock_poisoned)
            .generation()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node of `n` members in 2 dimensions, member `i` at angle `i` degrees.
    fn node(n: usize) -> Arc<ResolvedNode> {
        let ids: Vec<String> = (0..n).map(|i| format!("r{i:03}")).collect();
        let rows: Vec<(u32, u64)> = (0..n as u32).map(|i| (i, 1000 - u64::from(i))).collect();
        let matrix: Vec<f32> = (0..n)
            .flat_map(|i| {
                let a = (i as f32).to_radians();
                [a.cos(), a.sin()]
            })
            .collect();
        let norms = matrix.chunks_exact(2).map(norm).collect();
        Arc::new(ResolvedNode {
            ids,
            dims: 2,
            rows,
            matrix,
            norms,
        })
    }

    #[test]
    fn nearest_members_are_the_exact_cosine_top_k_for_every_query() {
        let n = node(90);
        let q1 = [1.0f32, 0.0];
        let q2 = [0.0f32, 2.0];
        let lists = n.nearest(&[&q1, &q2], 3);
        let ids = |l: &[(u32, f32)]| l.iter().map(|(i, _)| *i).collect::<Vec<_>>();
        assert_eq!(ids(&lists[0]), vec![0, 1, 2]);
        assert_eq!(ids(&lists[1]), vec![89, 88, 87]);
        for (i, cos) in &lists[1] {
            let row = &n.matrix[*i as usize * 2..*i as usize * 2 + 2];
            assert_eq!(*cos, lycheemem_core::vector::cosine(row, &q2));
        }
        assert_eq!(n.nearest(&[&q1], 500)[0].len(), 90);
        assert!(n.nearest(&[&q1], 0)[0].is_empty());
    }

    #[test]
    fn the_least_recently_used_nodes_make_room_and_a_write_clears_everything() {
        let mut cache = NodeCache::default();
        let size = node(64).bytes();
        let budget = size * 3;
        for key in [b"a", b"b", b"c"] {
            cache.insert(0, key.to_vec(), node(64), budget);
        }
        assert!(cache.get(b"a").is_some()); // `b` is now the least recently used
        cache.insert(0, b"d".to_vec(), node(64), budget);
        assert!(cache.get(b"b").is_none());
        assert!(cache.get(b"a").is_some() && cache.get(b"d").is_some());
        assert!(cache.held <= budget);
        // Too small, too large, or read before a write that committed since: not kept.
        cache.insert(0, b"small".to_vec(), node(10), budget);
        cache.insert(0, b"huge".to_vec(), node(64), size - 1);
        cache.invalidate();
        cache.insert(0, b"stale".to_vec(), node(64), budget);
        for key in [&b"small"[..], b"huge", b"stale", b"a", b"d"] {
            assert!(cache.get(key).is_none());
        }
        assert_eq!(cache.held, 0);
    }
}
