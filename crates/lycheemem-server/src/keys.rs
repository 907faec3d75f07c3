//! API keys. Each key maps to one namespace; only its SHA-256 is stored (keys are 160 random
//! bits, so a plain hash cannot be brute-forced). Lookups hash the presented key and compare it
//! with every stored hash in constant time.

use anyhow::{Context, Result, bail};
use lycheemem::store::MemoryStore;
use lycheemem_core::Namespace;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One key as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    /// Public identifier (for listing and revoking).
    pub id: String,
    pub namespace: String,
    /// Hex SHA-256 of the key.
    pub sha256: String,
    pub created: String,
    #[serde(default)]
    pub label: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    keys: Vec<KeyEntry>,
}

/// Where keys are kept.
#[derive(Clone, Default)]
enum Backing {
    /// Nowhere (tests, keys passed programmatically).
    #[default]
    Memory,
    /// A JSON key file.
    File(PathBuf),
    /// The store-wide setting `api_keys` of a store every replica shares, at this version.
    Store {
        store: Arc<dyn MemoryStore>,
        version: u64,
    },
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backing::Memory => f.write_str("Memory"),
            Backing::File(p) => write!(f, "File({})", p.display()),
            Backing::Store { version, .. } => write!(f, "Store(version {version})"),
        }
    }
}

/// The store setting holding the keys of a shared store.
const KEYS_SETTING: &str = "api_keys";

/// The keys (a key file, or a shared store's `api_keys` setting) and their entries.
#[derive(Debug, Clone, Default)]
pub struct KeyStore {
    backing: Backing,
    entries: Vec<KeyEntry>,
}

/// The entries of a key file's JSON, each checked.
fn parse_entries(json: &[u8], source: &str) -> Result<Vec<KeyEntry>> {
    let file: KeyFile =
        serde_json::from_slice(json).with_context(|| format!("{source} is not valid"))?;
    for e in &file.keys {
        Namespace::new(e.namespace.clone()).with_context(|| format!("key {} in {source}", e.id))?;
        if hex::decode(&e.sha256).map_or(true, |h| h.len() != 32) {
            bail!("key {} in {source}: sha256 must be 64 hex digits", e.id);
        }
    }
    Ok(file.keys)
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Equality without an early exit.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl KeyStore {
    /// Loads `path` (a missing file is an empty store that `add` will create).
    pub fn load(path: &Path) -> Result<KeyStore> {
        let entries = match std::fs::read(path) {
            Ok(bytes) => parse_entries(&bytes, &format!("key file {}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        Ok(KeyStore {
            backing: Backing::File(path.to_path_buf()),
            entries,
        })
    }

    /// The keys kept in a store's `api_keys` setting, which every replica sharing the store
    /// (a PostgreSQL database) reads: `lycheemem keys add` on one machine takes effect on all.
    pub fn in_store(store: Arc<dyn MemoryStore>) -> Result<KeyStore> {
        let (entries, version) = match store.setting(KEYS_SETTING)? {
            Some((value, version)) => (
                parse_entries(&serde_json::to_vec(&value)?, "the store's api_keys setting")?,
                version,
            ),
            None => (Vec::new(), 0),
        };
        Ok(KeyStore {
            backing: Backing::Store { store, version },
            entries,
        })
    }

    /// Where the keys are kept, for messages.
    pub fn location(&self) -> String {
        match &self.backing {
            Backing::Memory => "memory".into(),
            Backing::File(p) => p.display().to_string(),
            Backing::Store { .. } => "the store (setting api_keys)".into(),
        }
    }

    /// Applies `change` to the entries and saves them. With a shared store the change is
    /// applied to the latest stored keys and retried if another writer saved meanwhile.
    fn update<T>(&mut self, change: impl Fn(&mut Vec<KeyEntry>) -> T) -> Result<T> {
        let Backing::Store { store, version } = &mut self.backing else {
            let out = change(&mut self.entries);
            self.save()?;
            return Ok(out);
        };
        for _ in 0..16 {
            let (mut entries, current) = match store.setting(KEYS_SETTING)? {
                Some((value, v)) => (
                    parse_entries(&serde_json::to_vec(&value)?, "the store's api_keys setting")?,
                    v,
                ),
                None => (Vec::new(), 0),
            };
            let out = change(&mut entries);
            let value = serde_json::to_value(KeyFile {
                keys: entries.clone(),
            })?;
            match store.put_setting(KEYS_SETTING, &value, Some(current)) {
                Ok(v) => {
                    *version = v;
                    self.entries = entries;
                    return Ok(out);
                }
                Err(lycheemem_core::Error::Conflict(_)) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        bail!("the keys kept changing while saving; try again")
    }

    /// A store held only in memory (tests, or keys passed programmatically).
    pub fn in_memory() -> KeyStore {
        KeyStore::default()
    }

    pub fn entries(&self) -> &[KeyEntry] {
        &self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Creates a key for `namespace`, saves the file, and returns the key (shown once).
    pub fn add(
        &mut self,
        namespace: &Namespace,
        label: Option<String>,
    ) -> Result<(KeyEntry, String)> {
        let mut raw = [0u8; 20];
        rand::rng().fill_bytes(&mut raw);
        let key = format!("lmk_{}", hex::encode(raw));
        let entry = KeyEntry {
            id: format!("key_{}", &hex::encode(digest(&key))[..8]),
            namespace: namespace.to_string(),
            sha256: hex::encode(digest(&key)),
            created: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            label,
        };
        self.update(|entries| entries.push(entry.clone()))?;
        Ok((entry, key))
    }

    /// Removes the key with this id; false when there is none.
    pub fn revoke(&mut self, id: &str) -> Result<bool> {
        if !self.entries.iter().any(|e| e.id == id) && matches!(self.backing, Backing::File(_)) {
            return Ok(false);
        }
        self.update(|entries| {
            let before = entries.len();
            entries.retain(|e| e.id != id);
            entries.len() != before
        })
    }

    fn save(&self) -> Result<()> {
        let Backing::File(path) = &self.backing else {
            return Ok(());
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&KeyFile {
                keys: self.entries.clone(),
            })?,
        )?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        }
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Adds an entry for a known key without saving (tests, embedding).
    pub fn insert_key(&mut self, key: &str, namespace: &Namespace) {
        self.entries.push(KeyEntry {
            id: format!("key_{}", &hex::encode(digest(key))[..8]),
            namespace: namespace.to_string(),
            sha256: hex::encode(digest(key)),
            created: String::new(),
            label: None,
        });
    }

    /// The namespace of a presented key. Every entry is compared, in constant time each.
    pub fn namespace_of(&self, key: &str) -> Option<Namespace> {
        let presented = digest(key);
        let mut found: Option<&KeyEntry> = None;
        for e in &self.entries {
            let stored = hex::decode(&e.sha256).unwrap_or_default();
            if constant_time_eq(&stored, &presented) && found.is_none() {
                found = Some(e);
            }
        }
        found.and_then(|e| Namespace::new(e.namespace.clone()).ok())
    }
}

/// What identifies one version of the key file on disk (a save writes a new file and renames
/// it over the old one, so the inode changes with every save).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    modified: Option<std::time::SystemTime>,
    len: u64,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    Some(FileStamp {
        inode,
        modified: m.modified().ok(),
        len: m.len(),
    })
}

/// The keys a running server checks: the key file is looked at (one `stat`) on every lookup
/// and re-read when it changed, so `lycheemem keys add` / `revoke` take effect at once, without
/// a restart. A file that cannot be parsed keeps the keys last read (and says so in the log); a
/// deleted file means no keys.
pub struct LiveKeys {
    current: std::sync::RwLock<(KeyStore, Option<FileStamp>)>,
}

impl LiveKeys {
    pub fn new(store: KeyStore) -> LiveKeys {
        let seen = match &store.backing {
            Backing::File(path) => stamp(path),
            _ => None,
        };
        LiveKeys {
            current: std::sync::RwLock::new((store, seen)),
        }
    }

    /// For keys kept in a store: a thread that looks at them once a second (a store read
    /// blocks, so it must not run on the server's async workers) while the keys are in use.
    pub fn watch(self: &Arc<Self>) {
        let is_store = matches!(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .backing,
            Backing::Store { .. }
        );
        if !is_store {
            return;
        }
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("lycheemem-keys".into())
            .spawn(move || {
                while let Some(keys) = weak.upgrade() {
                    keys.refresh_store();
                    drop(keys);
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!("cannot start the API key watcher: {e}"));
    }

    /// Re-reads a key file if it changed since the last look (cheap: one `stat`).
    fn refresh(&self) {
        let backing = {
            let current = self.current.read().unwrap_or_else(|p| p.into_inner());
            match &current.0.backing {
                Backing::File(path) if stamp(path) != current.1 => current.0.backing.clone(),
                _ => return,
            }
        };
        match backing {
            Backing::File(path) => {
                let now = stamp(&path);
                match KeyStore::load(&path) {
                    Ok(store) => {
                        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
                        tracing::info!(
                            "key file {} changed: {} keys",
                            path.display(),
                            store.entries.len()
                        );
                        *current = (store, now);
                    }
                    Err(e) => tracing::warn!("key file changed but was not reloaded: {e:#}"),
                }
            }
            Backing::Store { .. } | Backing::Memory => {}
        }
    }

    /// Re-reads a store's keys if their version changed (blocking: see [`LiveKeys::watch`]).
    fn refresh_store(&self) {
        let backing = self
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .backing
            .clone();
        let Backing::Store { store, version } = backing else {
            return;
        };
        let latest = match store.setting(KEYS_SETTING) {
            Ok(found) => found.map_or(0, |(_, v)| v),
            Err(e) => {
                tracing::warn!("reading the store's API keys failed: {e}");
                return;
            }
        };
        if latest == version {
            return;
        }
        match KeyStore::in_store(store) {
            Ok(keys) => {
                tracing::info!("the store's API keys changed: {} keys", keys.entries.len());
                let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
                *current = (keys, None);
            }
            Err(e) => tracing::warn!("the store's API keys changed but were not reloaded: {e:#}"),
        }
    }

    /// The namespace of a presented key, from the key file as it is now.
    pub fn namespace_of(&self, key: &str) -> Option<Namespace> {
        self.refresh();
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current.0.namespace_of(key)
    }

    pub fn is_empty(&self) -> bool {
        self.refresh();
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stored_hashed_and_map_to_their_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let mut store = KeyStore::load(&path).unwrap();
        let (a, key_a) = store.add(&Namespace::new("alice").unwrap(), None).unwrap();
        let (_, key_b) = store
            .add(&Namespace::new("bob").unwrap(), Some("ci".into()))
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&key_a), "the key itself is never stored");
        let reloaded = KeyStore::load(&path).unwrap();
        assert_eq!(reloaded.namespace_of(&key_a).unwrap().as_str(), "alice");
        assert_eq!(reloaded.namespace_of(&key_b).unwrap().as_str(), "bob");
        assert!(reloaded.namespace_of("lmk_wrong").is_none());
        assert!(reloaded.namespace_of("").is_none());
        let mut store = reloaded;
        assert!(store.revoke(&a.id).unwrap());
        assert!(!store.revoke(&a.id).unwrap());
        assert!(
            KeyStore::load(&path)
                .unwrap()
                .namespace_of(&key_a)
                .is_none()
        );
        std::fs::write(
            &path,
            r#"{"keys": [{"id": "x", "namespace": ".bad", "sha256": "00", "created": ""}]}"#,
        )
        .unwrap();
        assert!(KeyStore::load(&path).is_err());
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn a_running_server_sees_added_and_revoked_keys_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let alice = Namespace::new("alice").unwrap();
        let mut file = KeyStore::load(&path).unwrap();
        let (first, key1) = file.add(&alice, None).unwrap();
        let live = LiveKeys::new(KeyStore::load(&path).unwrap());
        assert_eq!(live.namespace_of(&key1), Some(alice.clone()));
        // Another process (the `keys` command) adds a key and revokes the first.
        let mut other = KeyStore::load(&path).unwrap();
        let (_, key2) = other.add(&alice, None).unwrap();
        assert_eq!(live.namespace_of(&key2), Some(alice.clone()));
        assert!(other.revoke(&first.id).unwrap());
        assert_eq!(live.namespace_of(&key1), None);
        assert_eq!(live.namespace_of(&key2), Some(alice.clone()));
        // A broken file keeps the keys last read; a deleted one means none.
        std::fs::write(&path, b"{ not json").unwrap();
        assert_eq!(live.namespace_of(&key2), Some(alice));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(live.namespace_of(&key2), None);
        assert!(live.is_empty());
    }
}
