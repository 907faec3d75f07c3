//! A PostgreSQL + pgvector storage backend for lycheemem: the store traits of
//! `lycheemem_store` on a database that many server replicas can share.
//!
//! [`PgStore`] keeps one lycheemem store in one PostgreSQL schema (default `lycheemem`):
//! sessions, raw turns, segments, records, evidence nodes and their record links, per-session
//! state and the usage log as rows (bodies as JSON bytes); every indexed item (record, turn,
//! node) as a row of `lm_items` with its vector (`vector` or `halfvec`, one HNSW index per
//! target), its pending-embedding mark, and its full-text document as term postings. The
//! namespace is a column of every table and every query names one.
//!
//! Everything is transactional, so there is nothing to recover after a crash and no derived
//! index to rebuild: a write call is one transaction, durable when it returns. What the
//! embedded backend keeps in process memory is in the database: concurrent writers are
//! serialized where the rules need it — turn appends by a row lock on their session, segment
//! commits, deletes and imports by a transaction-scoped advisory lock on their namespace — so
//! several processes can write one store.
//!
//! Full text: documents are analysed in Rust with the same analyzer as the embedded backend
//! ([`lycheemem_store::text`]) and scored with the same BM25 arithmetic; statistics (document
//! count, total length, document frequencies) are over the live documents of the namespace,
//! kept exactly in `lm_text_stats` and `lm_term_df`; postings carry their document's length id,
//! so a query is scored from the postings' index alone. Vector search is exact for a
//! namespace (or filter) of at most `exact_search_below` vectors and goes through the HNSW
//! index (iterative scans, strict order) above, with the exact fallback when a filtered
//! search comes back short.

mod locks;
mod reads;
mod schema;
mod search;
mod tx;
mod write;

use lycheemem_core::{Error, Namespace, Result};
use lycheemem_store::StoreOptions;
use postgres::NoTls;
use r2d2_postgres::PostgresConnectionManager;

pub use schema::SCHEMA_VERSION;

type Pool = r2d2::Pool<PostgresConnectionManager<NoTls>>;
type Conn = r2d2::PooledConnection<PostgresConnectionManager<NoTls>>;

/// Where a PostgreSQL store lives and how many connections one process opens to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgConfig {
    /// A `postgresql://` or `postgres://` connection URL (or a key=value connection string).
    pub url: String,
    /// The schema holding the store's tables (letters, digits and `_`, starting with a letter
    /// or `_`; at most 63 bytes).
    pub schema: String,
    /// Connections in this process's pool.
    pub pool_size: u32,
}

impl PgConfig {
    /// The store in schema `lycheemem` of the database at `url`, with a pool of 8 connections.
    pub fn new(url: impl Into<String>) -> Self {
        PgConfig {
            url: url.into(),
            schema: "lycheemem".into(),
            pool_size: 8,
        }
    }

    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }
}

/// Whether `location` names a PostgreSQL database rather than a directory.
pub fn is_postgres_url(location: &str) -> bool {
    location.starts_with("postgres://") || location.starts_with("postgresql://")
}

/// A lycheemem store in a PostgreSQL schema. See the crate docs.
pub struct PgStore {
    pool: Pool,
    options: StoreOptions,
    schema: String,
    /// `vector` or `halfvec`: the column type of the stored vectors.
    vector_type: &'static str,
    /// The connection holding this handle's advisory locks ([`lycheemem_store::StoreLocks`]).
    locks: std::sync::Arc<locks::LockConnection>,
    /// HNSW search beam width (`hnsw.ef_search`), adjustable at run time.
    ef_search: std::sync::atomic::AtomicUsize,
}

/// Sets the schema search path on every new connection.
#[derive(Debug)]
struct SearchPath(String);

impl r2d2::CustomizeConnection<postgres::Client, postgres::Error> for SearchPath {
    fn on_acquire(&self, conn: &mut postgres::Client) -> std::result::Result<(), postgres::Error> {
        conn.batch_execute(&format!(
            "SET search_path TO \"{}\", public; SET client_min_messages TO warning",
            self.0
        ))
    }
}

pub(crate) fn pg_err(e: postgres::Error) -> Error {
    match e.as_db_error() {
        Some(db) => {
            // Bad text from a caller (e.g. a NUL byte) is the caller's input, not a store fault.
            let code = db.code().code();
            if code == "22021" || code == "22P05" || code == "54000" {
                Error::InvalidInput(format!("postgres refused the value: {}", db.message()))
            } else {
                Error::Store(format!(
                    "postgres: {} ({}){}",
                    db.message(),
                    code,
                    db.detail().map(|d| format!(": {d}")).unwrap_or_default()
                ))
            }
        }
        None => Error::Store(format!("postgres: {e}")),
    }
}

pub(crate) fn json<T: serde::Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Store(format!("encode row: {e}")))
}

pub(crate) fn from_json<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Store(format!("corrupt {what} row: {e}")))
}

/// A transaction-scoped lock key for a namespace (serializes segment commits, deletes and
/// imports within it across processes).
pub(crate) fn namespace_lock_sql() -> &'static str {
    "SELECT pg_advisory_xact_lock(hashtextextended($1, 7452))"
}

impl PgStore {
    /// Opens (creating and migrating if needed) the store in `config.schema` of the database at
    /// `config.url`. `options.dims == 0` opens an existing store with the dimension it was
    /// created with; another non-zero value than the stored one is an error.
    pub fn open(config: &PgConfig, options: StoreOptions) -> Result<PgStore> {
        schema::check_schema_name(&config.schema)?;
        let pg: postgres::Config = config
            .url
            .parse()
            .map_err(|e| Error::Config(format!("invalid PostgreSQL connection string: {e}")))?;
        let manager = PostgresConnectionManager::new(pg, NoTls);
        let pool = r2d2::Pool::builder()
            .max_size(config.pool_size.max(1))
            // Connections open as they are needed, not all at start.
            .min_idle(Some(1))
            .connection_timeout(std::time::Duration::from_secs(30))
            .connection_customizer(Box::new(SearchPath(config.schema.clone())))
            .build(manager)
            .map_err(|e| {
                Error::Store(format!(
                    "cannot connect to PostgreSQL at {}: {e}",
                    redact(&config.url)
                ))
            })?;
        let mut store = PgStore {
            pool,
            schema: config.schema.clone(),
            vector_type: "vector",
            locks: locks::LockConnection::new(&config.url),
            ef_search: std::sync::atomic::AtomicUsize::new(options.index.hnsw_expansion_search),
            options,
        };
        let (dims, vector_type) = schema::migrate(&store)?;
        store.options.dims = dims;
        store.vector_type = vector_type;
        Ok(store)
    }

    /// Whether the schema of `config` holds a lycheemem store.
    pub fn exists(config: &PgConfig) -> Result<bool> {
        schema::check_schema_name(&config.schema)?;
        let mut client = postgres::Client::connect(&config.url, NoTls).map_err(|e| {
            Error::Store(format!(
                "cannot connect to PostgreSQL at {}: {e}",
                redact(&config.url)
            ))
        })?;
        let row = client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&format!("\"{}\".lm_meta", config.schema)],
            )
            .map_err(pg_err)?;
        Ok(row.get(0))
    }

    /// Changes the HNSW search beam width (`hnsw_expansion_search`) for this handle: higher
    /// trades speed for recall.
    pub fn set_hnsw_expansion_search(&self, ef: usize) {
        self.ef_search
            .store(ef.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Drops the HNSW indexes (one per target) ahead of a bulk load: rows then go in without
    /// a graph insert each (about 6.5 ms a row at 100k rows), and
    /// [`PgStore::build_vector_indexes`] builds each index once from the loaded rows. Until
    /// then vector searches of every namespace in the schema are exact scans: correct, slower.
    pub fn drop_vector_indexes(&self) -> Result<()> {
        let mut conn = self.conn()?;
        for target in lycheemem_store::Target::ALL {
            // Qualified: an unqualified name could resolve to another store's index in
            // `public` once this schema's is gone.
            conn.batch_execute(&format!(
                "DROP INDEX IF EXISTS \"{}\".lm_items_hnsw_{}",
                self.schema,
                target.as_str()
            ))
            .map_err(pg_err)?;
        }
        Ok(())
    }

    /// Builds the HNSW indexes that are missing (after [`PgStore::drop_vector_indexes`]) from
    /// the stored vectors, with the store's `hnsw_connectivity` and `hnsw_expansion_add`, and
    /// `maintenance_work_mem` raised to `memory_mib` for the build (the graph should fit in it,
    /// or the build slows down a lot: about 2.5 KB per 384-dimensional vector). Writes to the
    /// items table wait while an index builds; reads go on. Refreshes the planner statistics.
    /// Returns the seconds each target's build took.
    pub fn build_vector_indexes(
        &self,
        memory_mib: usize,
    ) -> Result<Vec<(lycheemem_store::Target, f64)>> {
        let mut conn = self.conn()?;
        let index = &self.options.index;
        let mut took = Vec::new();
        for target in lycheemem_store::Target::ALL {
            let t = std::time::Instant::now();
            let mut tx = conn.transaction().map_err(pg_err)?;
            tx.batch_execute(&format!(
                "SET LOCAL maintenance_work_mem = '{}MB'; {}",
                memory_mib.clamp(64, 1 << 20),
                schema::hnsw_index_sql(
                    target,
                    self.vector_type,
                    index.hnsw_connectivity.clamp(2, 100),
                    index.hnsw_expansion_add.clamp(4, 1000)
                )
            ))
            .map_err(pg_err)?;
            tx.commit().map_err(pg_err)?;
            took.push((target, t.elapsed().as_secs_f64()));
        }
        conn.batch_execute("ANALYZE lm_items, lm_postings, lm_term_df")
            .map_err(pg_err)?;
        Ok(took)
    }

    /// The options the store runs with (`dims` as stored).
    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    /// The schema holding the store.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Bytes the store's tables and indexes take in the database.
    pub fn disk_bytes(&self) -> Result<u64> {
        let mut conn = self.conn()?;
        let row = conn
            .query_one(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relkind IN ('r', 'S')",
                &[&self.schema],
            )
            .map_err(pg_err)?;
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    pub(crate) fn conn(&self) -> Result<Conn> {
        self.pool
            .get()
            .map_err(|e| Error::Store(format!("no PostgreSQL connection available: {e}")))
    }

    /// Whether `ns` holds a session.
    pub(crate) fn ns_exists(
        conn: &mut impl postgres::GenericClient,
        ns: &Namespace,
    ) -> Result<bool> {
        let row = conn
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM lm_sessions WHERE ns = $1)",
                &[&ns.as_str()],
            )
            .map_err(pg_err)?;
        Ok(row.get(0))
    }
}

/// A connection URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_repeated_in_messages() {
        assert_eq!(
            redact("postgresql://me:secret@db:5432/x"),
            "postgresql://me:***@db:5432/x"
        );
        assert_eq!(redact("postgresql://me@db/x"), "postgresql://me@db/x");
    }

    #[test]
    fn urls_are_told_from_directories() {
        assert!(is_postgres_url("postgres://h/db"));
        assert!(is_postgres_url("postgresql://h/db"));
        assert!(!is_postgres_url("./memory"));
    }
}
