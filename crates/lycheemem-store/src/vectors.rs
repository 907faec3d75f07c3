//! The usearch HNSW indexes: one per (namespace, target), derived from redb. Vectors are
//! normalized on the way in, so the index uses the inner product (cheaper than cosine, same
//! ranking).
//!
//! Files live at `index/vectors/<namespace>/<target>.usearch`; `index/vectors/STATE` records
//! the store id and the last change applied when they were saved. Files are written to a
//! temporary name and renamed, and `STATE` is written last, so a crash leaves either the old
//! state (replayed forward from the change log) or the new one.

use lycheemem_core::config::{StoreConfig, VectorPrecision};
use lycheemem_core::vector::{dot, normalize};
use lycheemem_core::{Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use usearch::{Index, IndexOptions, MetricKind, ScalarKind};

use crate::types::Target;

#[derive(Debug, Serialize, Deserialize)]
struct SavedState {
    store_id: String,
    applied: u64,
    /// Length and checksum of every index file as saved; a file that differs (cut short,
    /// overwritten) is not trusted and the indexes are rebuilt. States written before these
    /// were recorded have none and are checked by usearch's loader only.
    #[serde(default)]
    files: Vec<FileCheck>,
}

/// What an index file looked like when it was saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileCheck {
    ns: String,
    target: Target,
    len: u64,
    hash: u64,
}

/// A fast 64-bit checksum of a file's bytes (8 bytes at a time; not cryptographic: it detects
/// damage, not tampering).
fn file_check(path: &Path) -> Result<(u64, u64)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(23);
    }
    for b in chunks.remainder() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    Ok((bytes.len() as u64, h))
}

struct VectorIndex {
    index: Index,
    dirty: bool,
}

/// An index smaller than this grows one insert at a time (see `upsert_many`).
const SEQUENTIAL_ADDS_BELOW: usize = 4096;

/// usearch serves each concurrent search from one of a fixed set of per-thread contexts
/// reserved ahead ("Reserve capacity ahead of searches!" when none is free). We reserve this
/// many and let at most this many searches run at once.
const SEARCH_CONTEXTS: usize = 64;

/// A counting semaphore bounding concurrent searches to the reserved contexts.
#[derive(Default)]
struct SearchSlots {
    busy: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

impl SearchSlots {
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while *busy >= SEARCH_CONTEXTS {
            busy = self.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy += 1;
        drop(busy);
        let out = f();
        *self.busy.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        self.freed.notify_one();
        out
    }
}

/// Reserves `capacity` vectors and the search contexts.
fn reserve(index: &Index, capacity: usize) -> Result<()> {
    index
        .reserve_capacity_and_threads(capacity, SEARCH_CONTEXTS)
        .map_err(|e| usearch_err("reserve", e))
}

/// All vector indexes of a store.
pub(crate) struct VectorIndexes {
    dir: PathBuf,
    options: IndexOptions,
    indexes: HashMap<(String, Target), VectorIndex>,
    slots: SearchSlots,
    /// The last change applied.
    pub applied: u64,
    /// The last change included in the files on disk.
    pub saved: u64,
    /// The saved files' checks, written to the state file with every save.
    checks: HashMap<(String, Target), FileCheck>,
}

/// `v / |v|`.
fn unit(v: &[f32]) -> Vec<f32> {
    let mut u = v.to_vec();
    normalize(&mut u);
    u
}

/// Whether `held` (read back from an index) is `new` stored at the index's precision: equal in
/// f32; within one f16 step (an ulp of its 11-bit significand, whatever the rounding; plus the
/// subnormal step): a change below what the index resolves.
fn same_vector(held: &[f32], new: &[f32], half: bool) -> bool {
    held.len() == new.len()
        && held.iter().zip(new).all(|(h, n)| {
            if half {
                (h - n).abs() <= n.abs() * (1.0 / 1024.0) + 6.0e-8
            } else {
                h == n
            }
        })
}

fn usearch_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Store(format!("vector index {what}: {e}"))
}

impl VectorIndexes {
    /// Loads the saved indexes, or returns `None` (after clearing the folder) when they cannot
    /// be trusted: missing, written by another store, or unreadable. The caller then rebuilds.
    pub fn load(dir: &Path, dims: usize, cfg: &StoreConfig, store_id: &str) -> Result<Self> {
        let options = IndexOptions {
            dimensions: dims,
            metric: MetricKind::IP,
            quantization: match cfg.vector_precision {
                VectorPrecision::F32 => ScalarKind::F32,
                VectorPrecision::F16 => ScalarKind::F16,
            },
            connectivity: cfg.hnsw_connectivity,
            expansion_add: cfg.hnsw_expansion_add,
            expansion_search: cfg.hnsw_expansion_search,
            multi: false,
        };
        let mut set = VectorIndexes {
            dir: dir.to_path_buf(),
            options,
            indexes: HashMap::new(),
            slots: SearchSlots::default(),
            applied: 0,
            saved: 0,
            checks: HashMap::new(),
        };
        match set.try_load(store_id) {
            Ok(Some(applied)) => {
                set.applied = applied;
                set.saved = applied;
            }
            Ok(None) => set.reset()?,
            Err(e) => {
                tracing::warn!("vector indexes unreadable, rebuilding: {e}");
                set.reset()?;
            }
        }
        Ok(set)
    }

    fn try_load(&mut self, store_id: &str) -> Result<Option<u64>> {
        let state_path = self.dir.join("STATE");
        let Ok(bytes) = std::fs::read(&state_path) else {
            return Ok(None);
        };
        let state: SavedState = serde_json::from_slice(&bytes)
            .map_err(|e| usearch_err("state", format!("{}: {e}", state_path.display())))?;
        if state.store_id != store_id {
            return Ok(None);
        }
        let checked = !state.files.is_empty();
        self.checks = state
            .files
            .into_iter()
            .map(|c| ((c.ns.clone(), c.target), c))
            .collect();
        for ns_entry in std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))? {
            let ns_entry = ns_entry.map_err(|e| Error::io(&self.dir, e))?;
            if !ns_entry.path().is_dir() {
                continue;
            }
            let ns = ns_entry.file_name().to_string_lossy().into_owned();
            for file in std::fs::read_dir(ns_entry.path()).map_err(|e| Error::io(&self.dir, e))? {
                let path = file.map_err(|e| Error::io(&self.dir, e))?.path();
                let Some(target) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".usearch"))
                    .and_then(|n| Target::parse(n).ok())
                else {
                    continue;
                };
                if checked {
                    let Some(expected) = self.checks.get(&(ns.clone(), target)) else {
                        return Err(usearch_err(
                            "load",
                            format!("{} is not in the saved state", path.display()),
                        ));
                    };
                    let (len, hash) = file_check(&path)?;
                    if (len, hash) != (expected.len, expected.hash) {
                        return Err(usearch_err(
                            "load",
                            format!(
                                "{} is damaged ({len} bytes, saved {}; or its checksum differs)",
                                path.display(),
                                expected.len
                            ),
                        ));
                    }
                }
                let mut index = self.new_index()?;
                index
                    .load(&path.to_string_lossy())
                    .map_err(|e| usearch_err("load", format!("{}: {e}", path.display())))?;
                self.install_metric(&mut index);
                if index.dimensions() != self.options.dimensions {
                    return Err(usearch_err("load", "dimension mismatch"));
                }
                reserve(&index, index.size().max(64))?;
                self.indexes.insert(
                    (ns.clone(), target),
                    VectorIndex {
                        index,
                        dirty: false,
                    },
                );
            }
        }
        if checked {
            let missing = self.checks.keys().find(|k| !self.indexes.contains_key(*k));
            if let Some((ns, target)) = missing {
                return Err(usearch_err(
                    "load",
                    format!("the index file of {ns}/{target} is missing"),
                ));
            }
        }
        Ok(Some(state.applied))
    }

    /// A new empty index. f32 indexes get our run-time-dispatched SIMD inner product (usearch
    /// is built without its SIMD library to keep the build short; its portable kernel is
    /// several times slower).
    fn new_index(&self) -> Result<Index> {
        let mut index = Index::new(&self.options).map_err(|e| usearch_err("create", e))?;
        self.install_metric(&mut index);
        Ok(index)
    }

    fn install_metric(&self, index: &mut Index) {
        if self.options.quantization == ScalarKind::F32 {
            let dims = self.options.dimensions;
            index.change_metric::<f32>(Box::new(move |a: *const f32, b: *const f32| {
                // SAFETY: usearch passes pointers to two stored vectors of `dims` floats.
                let (a, b) = unsafe {
                    (
                        std::slice::from_raw_parts(a, dims),
                        std::slice::from_raw_parts(b, dims),
                    )
                };
                1.0 - dot(a, b)
            }));
        }
    }

    /// Forgets every index and removes the folder's contents.
    pub fn reset(&mut self) -> Result<()> {
        self.indexes.clear();
        self.checks.clear();
        self.applied = 0;
        self.saved = 0;
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))
    }

    fn get_or_create(&mut self, ns: &str, target: Target) -> Result<&mut VectorIndex> {
        let key = (ns.to_string(), target);
        if !self.indexes.contains_key(&key) {
            let index = self.new_index()?;
            reserve(&index, 64)?;
            self.indexes
                .insert(key.clone(), VectorIndex { index, dirty: true });
        }
        Ok(self.indexes.get_mut(&key).expect("inserted above"))
    }

    /// Adds or replaces many vectors, inserting in parallel. Within the batch the last vector
    /// given for a key wins.
    ///
    /// A key whose indexed vector already equals the new one (at the index's precision) is left
    /// alone: replaying changes that a partly saved checkpoint already holds, or re-storing an
    /// unchanged vector, then costs nothing and does not churn the graph. (A removed key's slot
    /// is reused by usearch's in-place node update, the path of HNSW graphs that loses recall.)
    pub fn upsert_many(&mut self, batch: Vec<(String, Target, u64, Vec<f32>)>) -> Result<()> {
        let mut groups: HashMap<(String, Target), HashMap<u64, Vec<f32>>> = HashMap::new();
        for (ns, target, key, vector) in batch {
            groups
                .entry((ns, target))
                .or_default()
                .insert(key, unit(&vector));
        }
        let dims = self.options.dimensions;
        let half = self.options.quantization == ScalarKind::F16;
        for ((ns, target), mut items) in groups {
            let v = self.get_or_create(&ns, target)?;
            let mut held = vec![0f32; dims];
            // `get` finds nothing (0) for a key not in the index.
            items.retain(|key, vector| {
                !(matches!(v.index.get(*key, &mut held), Ok(1)) && same_vector(&held, vector, half))
            });
            if items.is_empty() {
                continue;
            }
            for key in items.keys() {
                if v.index.contains(*key) {
                    v.index.remove(*key).map_err(|e| usearch_err("remove", e))?;
                }
            }
            let needed = v.index.size() + items.len();
            if needed > v.index.capacity() {
                let capacity = needed.max(v.index.capacity() * 2).max(64);
                reserve(&v.index, capacity)?;
            }
            let index = &v.index;
            // The first vectors go in one at a time: usearch's concurrent inserts into a small
            // graph now and then leave a vector that no search reaches (the faults test found
            // its own exact vector missing from the top 3 in ~5% of rebuilds of 75 vectors;
            // 0 of 90 sequentially). Past that, the upper levels are settled and inserts run in
            // parallel.
            let mut items: Vec<(u64, Vec<f32>)> = items.into_iter().collect();
            let sequential = SEQUENTIAL_ADDS_BELOW
                .saturating_sub(index.size())
                .min(items.len());
            let parallel = items.split_off(sequential);
            items
                .into_iter()
                .try_for_each(|(key, vector)| index.add(key, &vector))
                .map_err(|e| usearch_err("add", e))?;
            parallel
                .into_par_iter()
                .try_for_each(|(key, vector)| index.add(key, &vector))
                .map_err(|e| usearch_err("add", e))?;
            v.dirty = true;
        }
        Ok(())
    }

    pub fn remove(&mut self, ns: &str, target: Target, key: u64) -> Result<()> {
        if let Some(v) = self.indexes.get_mut(&(ns.to_string(), target))
            && v.index.contains(key)
        {
            v.index.remove(key).map_err(|e| usearch_err("remove", e))?;
            v.dirty = true;
        }
        Ok(())
    }

    pub fn drop_namespace(&mut self, ns: &str) -> Result<()> {
        self.indexes.retain(|(n, _), _| n != ns);
        self.checks.retain(|(n, _), _| n != ns);
        let path = self.dir.join(ns);
        if path.exists() {
            std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        }
        Ok(())
    }

    /// Changes the HNSW search beam width of every index, present and future.
    pub fn set_expansion_search(&mut self, n: usize) {
        self.options.expansion_search = n;
        for v in self.indexes.values() {
            v.index.change_expansion_search(n);
        }
    }

    /// Vectors indexed in all indexes.
    pub fn total_len(&self) -> usize {
        self.indexes.values().map(|v| v.index.size()).sum()
    }

    /// Vectors indexed for `(ns, target)`.
    pub fn len(&self, ns: &str, target: Target) -> usize {
        self.indexes
            .get(&(ns.to_string(), target))
            .map_or(0, |v| v.index.size())
    }

    /// The indexed vectors of these keys (unit length, at the index's precision), read from
    /// memory; `None` for keys not in the index.
    pub fn get_many(&self, ns: &str, target: Target, keys: &[u64]) -> Vec<Option<Vec<f32>>> {
        let index = self.indexes.get(&(ns.to_string(), target));
        keys.iter()
            .map(|&key| {
                let mut buf = vec![0f32; self.options.dimensions];
                match index?.index.get(key, &mut buf) {
                    Ok(1) => Some(buf),
                    _ => None,
                }
            })
            .collect()
    }

    /// Appends the indexed vectors of these keys to `out` (`dims` floats each, in order) and
    /// says for each key whether it is in the index (nothing appended for one that is not).
    pub fn append_many(
        &self,
        ns: &str,
        target: Target,
        keys: &[u64],
        out: &mut Vec<f32>,
    ) -> Vec<bool> {
        let dims = self.options.dimensions;
        let Some(v) = self.indexes.get(&(ns.to_string(), target)) else {
            return vec![false; keys.len()];
        };
        out.reserve(keys.len() * dims);
        keys.iter()
            .map(|&key| {
                let start = out.len();
                out.resize(start + dims, 0.0);
                let found = matches!(v.index.get(key, &mut out[start..]), Ok(1));
                if !found {
                    out.truncate(start);
                }
                found
            })
            .collect()
    }

    /// Approximate top-`k` as `(key, cosine similarity)`, best first; with `allowed`, only those
    /// keys are returned.
    pub fn search(
        &self,
        ns: &str,
        target: Target,
        query: &[f32],
        k: usize,
        allowed: Option<&HashSet<u64>>,
    ) -> Result<Vec<(u64, f32)>> {
        let Some(v) = self.indexes.get(&(ns.to_string(), target)) else {
            return Ok(Vec::new());
        };
        if v.index.size() == 0 || k == 0 {
            return Ok(Vec::new());
        }
        let query = unit(query);
        let matches = self
            .slots
            .run(|| match allowed {
                None => v.index.search(&query, k),
                Some(set) => v.index.filtered_search(&query, k, |key| set.contains(&key)),
            })
            .map_err(|e| usearch_err("search", e))?;
        Ok(matches
            .keys
            .into_iter()
            .zip(matches.distances)
            .map(|(key, d)| (key, 1.0 - d))
            .collect())
    }

    /// Writes dirty indexes and then the state file recording `applied`.
    pub fn save(&mut self, store_id: &str) -> Result<()> {
        for ((ns, target), v) in self.indexes.iter_mut() {
            if !v.dirty {
                continue;
            }
            let folder = self.dir.join(ns);
            std::fs::create_dir_all(&folder).map_err(|e| Error::io(&folder, e))?;
            let path = folder.join(format!("{}.usearch", target.as_str()));
            let tmp = folder.join(format!("{}.usearch.tmp", target.as_str()));
            v.index
                .save(&tmp.to_string_lossy())
                .map_err(|e| usearch_err("save", format!("{}: {e}", tmp.display())))?;
            let (len, hash) = file_check(&tmp)?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
            self.checks.insert(
                (ns.clone(), *target),
                FileCheck {
                    ns: ns.clone(),
                    target: *target,
                    len,
                    hash,
                },
            );
            v.dirty = false;
        }
        let mut files: Vec<FileCheck> = self.checks.values().cloned().collect();
        files.sort_by(|a, b| (&a.ns, a.target).cmp(&(&b.ns, b.target)));
        let state = SavedState {
            store_id: store_id.to_string(),
            applied: self.applied,
            files,
        };
        let path = self.dir.join("STATE");
        let tmp = self.dir.join("STATE.tmp");
        let bytes = serde_json::to_vec(&state).map_err(|e| usearch_err("state", e))?;
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        self.saved = self.applied;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indexes(dir: &Path, precision: VectorPrecision) -> VectorIndexes {
        let cfg = StoreConfig {
            vector_precision: precision,
            ..StoreConfig::default()
        };
        VectorIndexes::load(dir, 4, &cfg, "test").unwrap()
    }

    fn dirty(set: &VectorIndexes) -> bool {
        set.indexes.values().any(|v| v.dirty)
    }

    #[test]
    fn an_unchanged_vector_is_not_reinserted_and_a_changed_one_is() {
        for precision in [VectorPrecision::F32, VectorPrecision::F16] {
            let dir = tempfile::tempdir().unwrap();
            let mut set = indexes(dir.path(), precision);
            let batch = |v: [f32; 4]| vec![("ns".to_string(), Target::Turn, 7, v.to_vec())];
            set.upsert_many(batch([0.3, 0.1, -0.7, 0.2])).unwrap();
            set.save("test").unwrap();
            assert!(!dirty(&set));
            // The same vector, scaled (unit length is what is indexed): nothing to do.
            set.upsert_many(batch([0.6, 0.2, -1.4, 0.4])).unwrap();
            assert!(
                !dirty(&set),
                "{precision:?}: an unchanged vector churned the index"
            );
            set.upsert_many(batch([0.3, 0.1, 0.7, 0.2])).unwrap();
            assert!(dirty(&set), "{precision:?}: a changed vector was skipped");
            let held = set.get_many("ns", Target::Turn, &[7]).remove(0).unwrap();
            assert!(held[2] > 0.0, "{precision:?}: the new vector is indexed");
            assert_eq!(set.len("ns", Target::Turn), 1);
        }
    }

    /// A small index built in one batch (what a rebuild does) finds every vector it holds as
    /// its own nearest neighbour: 40 builds of 75 random 8-d vectors.
    #[test]
    fn every_vector_of_a_small_batch_build_is_found() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for build in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            let cfg = StoreConfig::default();
            let mut set = VectorIndexes::load(dir.path(), 8, &cfg, "test").unwrap();
            let vectors: Vec<Vec<f32>> =
                (0..75).map(|_| (0..8).map(|_| next()).collect()).collect();
            let batch = vectors
                .iter()
                .enumerate()
                .map(|(i, v)| ("ns".to_string(), Target::Turn, i as u64, v.clone()))
                .collect();
            set.upsert_many(batch).unwrap();
            for (i, v) in vectors.iter().enumerate() {
                let hits = set.search("ns", Target::Turn, v, 3, None).unwrap();
                assert!(
                    hits.iter().any(|(key, _)| *key == i as u64),
                    "build {build}: vector {i} is not found ({hits:?})"
                );
            }
        }
    }
}
