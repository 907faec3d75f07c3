//! [`StoreLocks`] on PostgreSQL advisory locks, held on one dedicated connection per store
//! handle. Only non-blocking calls (`pg_try_advisory_lock[_shared]`) run on it, retried with a
//! short backoff, so a lock one thread waits for never holds up another thread's release. A
//! process that dies closes the connection, and the database releases its locks.
//!
//! Advisory locks are re-entrant per connection and a connection's locks never conflict with
//! each other: exclusion between threads of one process is the caller's in-process lock, which
//! it takes first (see [`StoreLocks`]).

use lycheemem_core::{Error, Result};
use lycheemem_store::{LockGuard, LockScope, StoreLocks};
use postgres::NoTls;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{PgStore, pg_err};

/// The connection holding this handle's advisory locks, and how many it holds.
pub(crate) struct LockConnection {
    url: String,
    state: Mutex<LockState>,
}

struct LockState {
    client: Option<postgres::Client>,
    held: usize,
}

impl LockConnection {
    pub fn new(url: &str) -> Arc<Self> {
        Arc::new(LockConnection {
            url: url.to_string(),
            state: Mutex::new(LockState {
                client: None,
                held: 0,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LockState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One attempt; true when the lock is now held.
    fn try_acquire(&self, key: i64, shared: bool) -> Result<bool> {
        let mut state = self.state();
        if state.client.as_ref().is_none_or(|c| c.is_closed()) {
            if state.held > 0 {
                // The connection died while holding locks: the database released them, so the
                // guards still alive no longer exclude anyone. Refuse rather than pretend.
                return Err(Error::Store(
                    "the PostgreSQL connection holding this process's locks was lost; \
                     retry the operation"
                        .into(),
                ));
            }
            let client = postgres::Client::connect(&self.url, NoTls).map_err(pg_err)?;
            state.client = Some(client);
        }
        let sql = if shared {
            "SELECT pg_try_advisory_lock_shared($1)"
        } else {
            "SELECT pg_try_advisory_lock($1)"
        };
        let Some(client) = state.client.as_mut() else {
            return Err(Error::Store("no lock connection".into()));
        };
        let got: bool = client.query_one(sql, &[&key]).map_err(pg_err)?.get(0);
        if got {
            state.held += 1;
        }
        Ok(got)
    }

    fn release(&self, key: i64, shared: bool) {
        let mut state = self.state();
        state.held = state.held.saturating_sub(1);
        let sql = if shared {
            "SELECT pg_advisory_unlock_shared($1)"
        } else {
            "SELECT pg_advisory_unlock($1)"
        };
        if let Some(client) = state.client.as_mut()
            && let Err(e) = client.query_one(sql, &[&key])
        {
            // A lost connection released everything already.
            tracing::warn!("releasing a PostgreSQL advisory lock failed: {e}");
        }
    }
}

/// Releases its lock when dropped.
struct Held {
    connection: Arc<LockConnection>,
    key: i64,
    shared: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.connection.release(self.key, self.shared);
    }
}

/// The advisory-lock key of a scope in this schema: FNV-1a over the schema and the scope's key.
fn lock_key(schema: &str, scope: &LockScope<'_>) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in schema.bytes().chain([0]).chain(scope.key().bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h as i64
}

impl PgStore {
    fn try_lock_once(&self, scope: &LockScope<'_>) -> Result<Option<LockGuard>> {
        let key = lock_key(&self.schema, scope);
        let shared = scope.shared();
        if self.locks.try_acquire(key, shared)? {
            Ok(Some(LockGuard::new(Box::new(Held {
                connection: self.locks.clone(),
                key,
                shared,
            }))))
        } else {
            Ok(None)
        }
    }
}

impl StoreLocks for PgStore {
    fn lock(&self, scope: LockScope<'_>) -> Result<LockGuard> {
        let mut wait = Duration::from_millis(2);
        loop {
            if let Some(guard) = self.try_lock_once(&scope)? {
                return Ok(guard);
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(50));
        }
    }

    fn try_lock(&self, scope: LockScope<'_>) -> Result<Option<LockGuard>> {
        self.try_lock_once(&scope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_core::{Namespace, SessionId};

    #[test]
    fn lock_keys_differ_by_scope_schema_and_names() {
        let (a, b) = (Namespace::new("a").unwrap(), Namespace::new("b").unwrap());
        let s = SessionId::new("s").unwrap();
        let keys = [
            lock_key("x", &LockScope::Append(&a, &s)),
            lock_key("x", &LockScope::Session(&a, &s)),
            lock_key("x", &LockScope::Commit(&a)),
            lock_key("x", &LockScope::Commit(&b)),
            lock_key("y", &LockScope::Commit(&a)),
            lock_key(
                "x",
                &LockScope::Derived {
                    ns: &a,
                    exclusive: true,
                },
            ),
        ];
        let unique: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(unique.len(), keys.len());
        // Shared and exclusive forms of one lock are one key.
        assert_eq!(
            lock_key(
                "x",
                &LockScope::Derived {
                    ns: &a,
                    exclusive: false
                }
            ),
            keys[5]
        );
    }
}
