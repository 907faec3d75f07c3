//! Moving a namespace from one store to another: an embedded store directory and a PostgreSQL
//! schema, in either direction (or between two of a kind), through the export stream with
//! every vector, so nothing is re-embedded and the destination searches like the source.

use lycheemem_core::config::Config;
use lycheemem_core::{Error, Namespace, Result};
use lycheemem_store::prelude::*;
use lycheemem_store::{ExportOptions, ImportReceipt};
use serde::Serialize;
use std::io::{BufReader, BufWriter, Seek, Write};
use std::path::Path;

use crate::memory::{Memory, is_postgres_location, open_backend};

/// How [`migrate_namespace`] loads the destination.
#[derive(Clone, Debug, Default)]
pub struct MigrateOptions {
    /// The namespace's name in the destination (default: the same name).
    pub to_namespace: Option<Namespace>,
    /// A PostgreSQL destination's schema, when it differs from the configuration's
    /// `store.postgres_schema` (which names the source's).
    pub to_postgres_schema: Option<String>,
    /// A PostgreSQL destination only: drop the schema's HNSW indexes for the load and build
    /// them once afterwards with this much `maintenance_work_mem` (MiB). Much faster for a
    /// large namespace; while it runs, vector searches of the schema's other namespaces are
    /// exact scans (correct, slower) and their writes wait during the index builds.
    pub rebuild_vector_indexes: Option<usize>,
}

/// What [`migrate_namespace`] moved.
#[derive(Clone, Debug, Serialize)]
pub struct MigrateReport {
    /// Lines of the export stream (header and footer included).
    pub lines: u64,
    /// What the destination imported (checked against its own counts afterwards).
    pub imported: ImportReceipt,
    /// Seconds each HNSW index took to build (with `rebuild_vector_indexes`), by target.
    pub index_build_seconds: Vec<(String, f64)>,
}

/// Copies namespace `ns` of the store at `from` into the store at `to` (created when absent,
/// with the source's vector dimension). The destination namespace must not exist; the source
/// is left as it is (delete it afterwards to make it a move). The export is one consistent
/// snapshot of the source, so writers may keep using it; what they add after the snapshot is
/// not copied. Verified: the destination's counts must equal what was imported.
pub fn migrate_namespace(
    from: &Path,
    to: &Path,
    ns: &Namespace,
    config: &Config,
    options: &MigrateOptions,
) -> Result<MigrateReport> {
    let mut to_config = config.clone();
    if let Some(schema) = &options.to_postgres_schema {
        to_config.store.postgres_schema = schema.clone();
    }
    let same_schema = !is_postgres_location(to)
        || to_config.store.postgres_schema == config.store.postgres_schema;
    if from == to && same_schema {
        return Err(Error::InvalidInput(
            "the source and the destination are the same store; export and import to copy \
             a namespace within one store"
                .into(),
        ));
    }
    let source = Memory::open_store(from, config)?;
    if !source.has_namespace(ns)? {
        return Err(Error::NotFound(format!(
            "namespace {ns} has no memory in {}",
            shown(from)
        )));
    }
    let dims = source.vector_dims();
    let to_ns = options.to_namespace.clone().unwrap_or_else(|| ns.clone());
    let rebuild = options.rebuild_vector_indexes;
    if rebuild.is_some() && !is_postgres_location(to) {
        return Err(Error::InvalidInput(
            "rebuilding vector indexes applies to a PostgreSQL destination only (the embedded \
             store indexes as it loads)"
                .into(),
        ));
    }
    let destination = open_destination(to, &to_config, dims, rebuild.is_some())?;
    let dest = destination.store();
    if dest.has_namespace(&to_ns)? {
        return Err(Error::InvalidInput(format!(
            "{} already holds namespace {to_ns}; delete it there first or choose another name",
            shown(to)
        )));
    }
    let spool = tempfile::tempfile().map_err(|e| Error::Store(format!("spool file: {e}")))?;
    let mut writer = BufWriter::new(spool);
    let lines = source.export(
        ns,
        &mut writer,
        ExportOptions {
            include_vectors: true,
        },
    )?;
    let mut spool = writer
        .into_inner()
        .map_err(|e| Error::Store(format!("spool file: {e}")))?;
    spool
        .flush()
        .and_then(|()| spool.rewind())
        .map_err(|e| Error::Store(format!("spool file: {e}")))?;
    drop(source);
    let (imported, index_build_seconds) =
        destination.load(&to_ns, &mut BufReader::new(spool), rebuild)?;
    let stats = dest.stats(&to_ns)?;
    let nodes: u64 = stats.nodes.values().sum();
    let found = [
        stats.sessions,
        stats.turns,
        stats.segments,
        stats.records,
        nodes,
    ];
    let wanted = [
        imported.sessions,
        imported.turns,
        imported.segments,
        imported.records,
        imported.nodes,
    ];
    if found != wanted {
        return Err(Error::Store(format!(
            "the destination holds sessions/turns/segments/records/nodes {found:?} after \
             importing {wanted:?}"
        )));
    }
    Ok(MigrateReport {
        lines,
        imported,
        index_build_seconds,
    })
}

/// A store location for messages (a PostgreSQL URL without its password).
fn shown(location: &Path) -> String {
    let text = location.display().to_string();
    #[cfg(feature = "postgres")]
    if is_postgres_location(location) {
        return lycheemem_store_postgres::redact(&text);
    }
    text
}

/// The destination store, concrete where a bulk load needs PostgreSQL's index calls.
enum Destination {
    Any(Box<dyn MemoryStore>),
    #[cfg(feature = "postgres")]
    Postgres(Box<lycheemem_store_postgres::PgStore>),
}

fn open_destination(to: &Path, config: &Config, dims: usize, bulk: bool) -> Result<Destination> {
    if !bulk {
        return Ok(Destination::Any(open_backend(to, config, dims)?));
    }
    #[cfg(feature = "postgres")]
    {
        Ok(Destination::Postgres(Box::new(
            lycheemem_store_postgres::PgStore::open(
                &crate::memory::postgres_config(to, config),
                crate::memory::store_options(config, dims),
            )?,
        )))
    }
    #[cfg(not(feature = "postgres"))]
    Err(Error::Config(
        "this build has no PostgreSQL backend (the `postgres` feature of the lycheemem crate is off)"
            .into(),
    ))
}

impl Destination {
    fn store(&self) -> &dyn MemoryStore {
        match self {
            Destination::Any(s) => s.as_ref(),
            #[cfg(feature = "postgres")]
            Destination::Postgres(s) => s.as_ref(),
        }
    }

    /// Imports the stream; with `rebuild`, between dropping and rebuilding the HNSW indexes
    /// (rebuilt even when the import fails, so the schema is never left without them).
    fn load(
        &self,
        ns: &Namespace,
        input: &mut dyn std::io::BufRead,
        rebuild: Option<usize>,
    ) -> Result<(ImportReceipt, Vec<(String, f64)>)> {
        match (self, rebuild) {
            #[cfg(feature = "postgres")]
            (Destination::Postgres(pg), Some(memory_mib)) => {
                // The indexes are built whatever happened before (a partial drop, a failed
                // import), so the schema is not left without them.
                let imported = pg
                    .drop_vector_indexes()
                    .and_then(|()| pg.import(ns, input, None));
                let built = pg.build_vector_indexes(memory_mib);
                match (imported, built) {
                    (Ok(imported), Ok(built)) => Ok((
                        imported,
                        built
                            .into_iter()
                            .map(|(t, s)| (t.as_str().to_string(), s))
                            .collect(),
                    )),
                    (Err(e), Ok(_)) => Err(e),
                    (Err(e), Err(b)) => Err(Error::Store(format!(
                        "{e}; rebuilding the vector indexes afterwards failed too: {b}"
                    ))),
                    (Ok(_), Err(b)) => Err(Error::Store(format!(
                        "the namespace was imported, but building the schema's HNSW vector \
                         indexes failed ({b}); vector searches scan exactly until they exist \
                         (`PgStore::build_vector_indexes` builds the missing ones)"
                    ))),
                }
            }
            _ => Ok((self.store().import(ns, input, None)?, Vec::new())),
        }
    }
}
