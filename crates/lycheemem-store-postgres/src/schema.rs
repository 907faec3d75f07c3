//! The database schema and its versioned migrations, applied under a session advisory lock so
//! that replicas starting together migrate once.

use lycheemem_core::config::VectorPrecision;
use lycheemem_core::{Error, Result};
use lycheemem_store::Target;

use crate::{PgStore, pg_err};

/// The schema version this build writes and reads.
pub const SCHEMA_VERSION: i32 = 2;

/// The advisory lock key migrations run under (one per database; cheap and rare).
const MIGRATION_LOCK: i64 = 0x6c79_6368_6565_6d01;

pub(crate) fn check_schema_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid PostgreSQL schema name {name:?}: use lowercase letters, digits and _ \
             (starting with a letter or _), at most 63 bytes"
        )))
    }
}

/// The first version of the schema, for `dims`-dimensional vectors of column type `vt`.
fn version_1(dims: usize, vt: &str, m: usize, ef_construction: usize) -> String {
    let mut sql = format!(
        r#"
CREATE TABLE lm_sessions (
    ns text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL,
    turn_count integer NOT NULL, body bytea NOT NULL,
    PRIMARY KEY (ns, id));
CREATE TABLE lm_turns (
    ns text COLLATE "C" NOT NULL, session text COLLATE "C" NOT NULL, idx integer NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (ns, session, idx));
CREATE TABLE lm_segments (
    ns text COLLATE "C" NOT NULL, session text COLLATE "C" NOT NULL, first_turn integer NOT NULL,
    failed boolean NOT NULL, body bytea NOT NULL,
    PRIMARY KEY (ns, session, first_turn));
CREATE TABLE lm_records (
    ns text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL,
    session text COLLATE "C" NOT NULL, body bytea NOT NULL,
    PRIMARY KEY (ns, id));
CREATE INDEX lm_records_session ON lm_records (ns, session, id);
CREATE TABLE lm_nodes (
    ns text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL, kind text NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (ns, id));
CREATE TABLE lm_record_nodes (
    ns text COLLATE "C" NOT NULL, record_id text COLLATE "C" NOT NULL,
    node_id text COLLATE "C" NOT NULL,
    PRIMARY KEY (ns, record_id, node_id));
CREATE INDEX lm_record_nodes_node ON lm_record_nodes (ns, node_id);
CREATE TABLE lm_state (
    ns text COLLATE "C" NOT NULL, session text COLLATE "C" NOT NULL, name text COLLATE "C" NOT NULL,
    value bytea NOT NULL,
    PRIMARY KEY (ns, session, name));
CREATE SEQUENCE lm_usage_seq;
CREATE TABLE lm_usage (
    ns text COLLATE "C" NOT NULL, seq bigint NOT NULL DEFAULT nextval('lm_usage_seq'),
    body bytea NOT NULL,
    PRIMARY KEY (ns, seq));
CREATE SEQUENCE lm_item_key;
CREATE TABLE lm_items (
    ns text COLLATE "C" NOT NULL, target text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL,
    key bigint NOT NULL DEFAULT nextval('lm_item_key'),
    sessions text[] NOT NULL, norm_id smallint NOT NULL, pending boolean NOT NULL,
    embedding {vt}({dims}),
    PRIMARY KEY (ns, target, id));
CREATE INDEX lm_items_pending ON lm_items (ns, target, id) WHERE pending;
CREATE INDEX lm_items_vectors ON lm_items (ns, target) WHERE embedding IS NOT NULL;
CREATE TABLE lm_postings (
    ns text COLLATE "C" NOT NULL, term text COLLATE "C" NOT NULL,
    target text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL, tf integer NOT NULL,
    PRIMARY KEY (ns, term, target, id),
    FOREIGN KEY (ns, target, id) REFERENCES lm_items ON DELETE CASCADE);
CREATE INDEX lm_postings_item ON lm_postings (ns, target, id);
CREATE TABLE lm_text_stats (
    ns text COLLATE "C" PRIMARY KEY, docs bigint NOT NULL, tokens bigint NOT NULL);
CREATE SEQUENCE lm_write_seq;
CREATE TABLE lm_settings (
    name text COLLATE "C" PRIMARY KEY, version bigint NOT NULL, value bytea NOT NULL);
"#
    );
    for target in Target::ALL {
        sql.push_str(&hnsw_index_sql(target, vt, m, ef_construction));
        sql.push_str(";\n");
    }
    sql
}

/// Version 2: full-text search without a join or a posting-list count per query. Each posting
/// carries its document's length id (and the primary key includes it and the term frequency, so
/// scoring reads the index only), and `lm_term_df` holds each term's document frequency per
/// namespace (kept at commit). Existing rows are filled in.
const VERSION_2: &str = r#"
ALTER TABLE lm_postings ADD COLUMN norm_id smallint;
UPDATE lm_postings p SET norm_id = i.norm_id FROM lm_items i
    WHERE i.ns = p.ns AND i.target = p.target AND i.id = p.id;
ALTER TABLE lm_postings ALTER COLUMN norm_id SET NOT NULL;
ALTER TABLE lm_postings DROP CONSTRAINT lm_postings_pkey;
ALTER TABLE lm_postings ADD CONSTRAINT lm_postings_pkey
    PRIMARY KEY (ns, term, target, id) INCLUDE (tf, norm_id);
CREATE TABLE lm_term_df (
    ns text COLLATE "C" NOT NULL, term text COLLATE "C" NOT NULL, df bigint NOT NULL,
    PRIMARY KEY (ns, term));
INSERT INTO lm_term_df (ns, term, df) SELECT ns, term, count(*) FROM lm_postings GROUP BY ns, term;
"#;

/// The HNSW index of one target's vectors (a partial index over `lm_items`, shared by every
/// namespace of the schema).
pub(crate) fn hnsw_index_sql(target: Target, vt: &str, m: usize, ef_construction: usize) -> String {
    let t = target.as_str();
    format!(
        "CREATE INDEX IF NOT EXISTS lm_items_hnsw_{t} ON lm_items USING hnsw \
         (embedding {vt}_cosine_ops) WITH (m = {m}, ef_construction = {ef_construction}) \
         WHERE target = '{t}'"
    )
}

/// Creates or upgrades the store's schema; returns the stored dimension and vector type.
pub(crate) fn migrate(store: &PgStore) -> Result<(usize, &'static str)> {
    let mut conn = store.conn()?;
    let schema = &store.schema;
    conn.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .map_err(pg_err)?;
    let result = (|| {
        let has_vector: bool = conn
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'vector')",
                &[],
            )
            .map_err(pg_err)?
            .get(0);
        if !has_vector {
            conn.batch_execute("CREATE EXTENSION IF NOT EXISTS vector SCHEMA public")
                .map_err(|e| {
                    Error::Store(format!(
                        "the pgvector extension is not installed in this database and could \
                         not be created ({}); run `CREATE EXTENSION vector` as a superuser \
                         (scripts/postgres.sh install builds it)",
                        pg_err(e)
                    ))
                })?;
        }
        conn.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
             CREATE TABLE IF NOT EXISTS \"{schema}\".lm_meta (
                 key text PRIMARY KEY, value text NOT NULL);"
        ))
        .map_err(pg_err)?;
        let meta = |conn: &mut crate::Conn, key: &str| -> Result<Option<String>> {
            Ok(conn
                .query_opt("SELECT value FROM lm_meta WHERE key = $1", &[&key])
                .map_err(pg_err)?
                .map(|r| r.get(0)))
        };
        let version: i32 = meta(&mut conn, "schema_version")?
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if version > SCHEMA_VERSION {
            return Err(Error::Store(format!(
                "the store in schema {schema} has schema version {version}; this build knows \
                 up to {SCHEMA_VERSION} (upgrade lycheemem)"
            )));
        }
        let opts = &store.options;
        let (dims, precision) = match meta(&mut conn, "dims")? {
            Some(d) => {
                let stored: usize = d
                    .parse()
                    .map_err(|_| Error::Store(format!("corrupt lm_meta dims {d:?}")))?;
                if opts.dims != 0 && opts.dims != stored {
                    return Err(Error::InvalidInput(format!(
                        "the store holds {stored}-dimensional vectors, not {}",
                        opts.dims
                    )));
                }
                let precision = meta(&mut conn, "vector_type")?.unwrap_or("vector".into());
                (stored, precision)
            }
            None => {
                if opts.dims == 0 {
                    return Err(Error::NotFound(format!(
                        "no lycheemem store in schema {schema} (open it with a vector \
                         dimension to create one)"
                    )));
                }
                let vt = match opts.index.vector_precision {
                    VectorPrecision::F32 => "vector",
                    VectorPrecision::F16 => "halfvec",
                };
                (opts.dims, vt.to_string())
            }
        };
        let vector_type: &'static str = if precision == "halfvec" {
            "halfvec"
        } else {
            "vector"
        };
        if version < 1 {
            let mut tx = conn.transaction().map_err(pg_err)?;
            tx.batch_execute(&version_1(
                dims,
                vector_type,
                opts.index.hnsw_connectivity.clamp(2, 100),
                opts.index.hnsw_expansion_add.clamp(4, 1000),
            ))
            .map_err(pg_err)?;
            for (k, v) in [
                ("dims", dims.to_string()),
                ("vector_type", vector_type.to_string()),
                ("schema_version", "1".to_string()),
            ] {
                tx.execute(
                    "INSERT INTO lm_meta (key, value) VALUES ($1, $2) \
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    &[&k, &v],
                )
                .map_err(pg_err)?;
            }
            tx.commit().map_err(pg_err)?;
        }
        if version < 2 {
            let mut tx = conn.transaction().map_err(pg_err)?;
            tx.batch_execute(VERSION_2).map_err(pg_err)?;
            tx.execute(
                "UPDATE lm_meta SET value = '2' WHERE key = 'schema_version'",
                &[],
            )
            .map_err(pg_err)?;
            tx.commit().map_err(pg_err)?;
        }
        Ok((dims, vector_type))
    })();
    let unlock = conn.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]);
    let out = result?;
    unlock.map_err(pg_err)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_checked() {
        assert!(check_schema_name("lycheemem").is_ok());
        assert!(check_schema_name("_t1").is_ok());
        for bad in ["", "1a", "a-b", "A", "a\"b", &"x".repeat(64)] {
            assert!(check_schema_name(bad).is_err(), "{bad}");
        }
    }
}
