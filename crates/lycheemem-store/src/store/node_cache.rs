//! Large evidence nodes' members resolved once: a main speaker's entity node can link tens of
//! thousands of records, and node expansion searches within it for most questions. Decoding
//! its row and looking every member's index key up on each search cost more than the search
//! itself, so the store keeps the resolved member set of nodes with at least
//! [`CACHED_FROM`] records in memory until the next write commits (any write clears it, so
//! a read never sees a node as it was before a write that returned).

use super::*;
use std::sync::Arc;

/// Nodes with at least this many records are kept resolved.
pub(super) const CACHED_FROM: usize = 64;
/// At most this many member records are held in all (about 80 bytes each); past it the cache
/// starts over.
const HELD_MAX: usize = 1_000_000;

/// One node's members: their ids (sorted) and their record-vector index keys.
pub(super) struct ResolvedNode {
    pub ids: Vec<String>,
    /// Index keys of the members that have one (a record's key outlives a missing vector).
    pub keys: HashSet<u64>,
    /// Index key → position in `ids`.
    pub id_at: HashMap<u64, u32>,
}

#[derive(Default)]
pub(super) struct NodeCache {
    /// Bumped by every committed write; an entry computed under an older generation is not
    /// stored.
    generation: u64,
    /// By node key (`ns \0 node_id`).
    entries: HashMap<Vec<u8>, Arc<ResolvedNode>>,
    held: usize,
}

impl NodeCache {
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    pub(super) fn get(&self, key: &[u8]) -> Option<Arc<ResolvedNode>> {
        self.entries.get(key).cloned()
    }

    /// Called with the write lock held, after a write transaction committed.
    pub(super) fn invalidate(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        self.entries.clear();
        self.held = 0;
    }

    /// Keeps `node`, read under `generation`, unless a write committed since.
    pub(super) fn insert(&mut self, generation: u64, key: Vec<u8>, node: Arc<ResolvedNode>) {
        if generation != self.generation || node.ids.len() < CACHED_FROM {
            return;
        }
        if self.held + node.ids.len() > HELD_MAX {
            self.entries.clear();
            self.held = 0;
        }
        self.held += node.ids.len();
        self.entries.insert(key, node);
    }
}

impl Store {
    /// The members of node `node_id` resolved to record index keys: from the cache, else read
    /// in `txn` (and cached when large and no write committed since `generation`). `None` when
    /// the node does not exist.
    pub(super) fn resolved_node(
        &self,
        txn: &redb::ReadTransaction,
        ns: &Namespace,
        node_id: &str,
        generation: u64,
        row: Option<NodeRow>,
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
        let row = match row {
            Some(row) => row,
            None => {
                let nodes = txn.open_table(NODES).map_err(db_err)?;
                match get_json::<NodeRow>(&nodes, &key, "node")? {
                    Some(row) => row,
                    None => return Ok(None),
                }
            }
        };
        let id_keys = txn.open_table(ID_KEYS).map_err(db_err)?;
        let ids: Vec<String> = row.node.record_ids.into_iter().collect();
        let mut keys_of = HashSet::with_capacity(ids.len());
        let mut id_at = HashMap::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if let Some(k) = id_keys
                .get(keys::pending(ns, Target::Record, id).as_slice())
                .map_err(db_err)?
            {
                keys_of.insert(k.value());
                id_at.insert(k.value(), i as u32);
            }
        }
        let node = Arc::new(ResolvedNode {
            ids,
            keys: keys_of,
            id_at,
        });
        self.node_cache
            .write()
            .unwrap_or_else(lock_poisoned)
            .insert(generation, key, node.clone());
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
