//! Export of a namespace to JSON Lines and import back, possibly into another store or name.
//!
//! The first line is a header (`format`, `version`, `namespace`, `dims`); then one object per
//! line tagged by `kind`: `session`, `turn`, `segment`, `record`, `node`, `state`, `usage`; the
//! last line (`end`, since version 2) counts the lines of each kind, so a truncated file is
//! refused. Before anything is written, an import checks the whole file: the header, the
//! counts, and every reference (turns, segments, records and state name sessions of the file;
//! records cite turns the file holds; nodes link records of the file).
//! Vectors are included on request; on import, missing vectors are recomputed by the caller's
//! embedding function, or left pending (see [`Store::pending_vectors`]) when there is none.
//! An import is one transaction: it lands completely or not at all.

use lycheemem_core::usage::TokenUsage;
use lycheemem_core::{Error, EvidenceNode, Namespace, Record, Result, SessionId, Turn};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};

use crate::backend::StoreCatalog;
use crate::keys;
use crate::store::Store;
use crate::tables::*;
use crate::types::{SegmentRow, SessionInfo, Target};

/// Computes unit vectors for texts (the caller's embedder).
pub type EmbedFn = dyn Fn(&[String]) -> Result<Vec<Vec<f32>>>;

const FORMAT: &str = "lycheemem-export";
const VERSION: u32 = 2;
/// Files of this version have no `end` line; they are imported without the count check.
const VERSION_WITHOUT_END: u32 = 1;

/// What goes into an export.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExportOptions {
    pub include_vectors: bool,
}

/// What an import stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportReceipt {
    pub sessions: u64,
    pub turns: u64,
    pub segments: u64,
    pub records: u64,
    pub nodes: u64,
    pub state_entries: u64,
    pub usage_entries: u64,
    /// Vectors taken from the file.
    pub vectors_imported: u64,
    /// Vectors computed by the embedding function.
    pub vectors_computed: u64,
    /// Items left without a vector.
    pub vectors_pending: u64,
}

/// One line of an export file. Backends write these through [`ExportWriter`] and read them
/// back with [`read_import`]; `Header` and `End` are the file's framing.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    Header {
        format: String,
        version: u32,
        namespace: String,
        dims: usize,
    },
    Session(SessionInfo),
    Turn {
        turn: Turn,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vector: Option<Vec<f32>>,
    },
    Segment(SegmentRow),
    Record {
        record: Record,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vector: Option<Vec<f32>>,
    },
    Node {
        node: EvidenceNode,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vector: Option<Vec<f32>>,
    },
    State {
        session: SessionId,
        name: String,
        value: serde_json::Value,
    },
    Usage(TokenUsage),
    End(LineCounts),
}

/// Lines of each kind in an export (its `end` line).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineCounts {
    sessions: u64,
    turns: u64,
    segments: u64,
    records: u64,
    nodes: u64,
    state: u64,
    usage: u64,
}

impl LineCounts {
    fn count(&mut self, line: &Line) {
        match line {
            Line::Session(_) => self.sessions += 1,
            Line::Turn { .. } => self.turns += 1,
            Line::Segment(_) => self.segments += 1,
            Line::Record { .. } => self.records += 1,
            Line::Node { .. } => self.nodes += 1,
            Line::State { .. } => self.state += 1,
            Line::Usage(_) => self.usage += 1,
            Line::Header { .. } | Line::End(_) => {}
        }
    }
}

/// Checks a parsed export before anything is written: one header first, the `end` line last
/// with matching counts (version 2), and references that resolve within the file.
fn validate(lines: &[Line]) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidInput(format!("import: {m}")));
    let version = match lines.first() {
        Some(Line::Header { version, .. }) => *version,
        _ => return bad("the first line must be the export header".into()),
    };
    let mut counts = LineCounts::default();
    let mut end = None;
    for (i, line) in lines.iter().enumerate().skip(1) {
        match line {
            Line::Header { .. } => return bad(format!("a second header at line {}", i + 1)),
            Line::End(c) if i + 1 == lines.len() => end = Some(*c),
            Line::End(_) => return bad(format!("lines after the end line ({})", i + 1)),
            other => counts.count(other),
        }
    }
    if version != VERSION_WITHOUT_END {
        match end {
            None => {
                return bad(
                    "the file ends without its end line: it is truncated (nothing was imported)"
                        .into(),
                );
            }
            Some(c) if c != counts => {
                return bad(format!(
                    "the end line counts {c:?} but the file holds {counts:?}: lines are missing \
                     (nothing was imported)"
                ));
            }
            Some(_) => {}
        }
    }
    let mut sessions: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for line in lines {
        if let Line::Session(info) = line
            && !sessions.insert(info.id.as_str())
        {
            return bad(format!("session {} appears twice", info.id));
        }
    }
    let mut turn_counts: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
    let mut records: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let known = |s: &str, what: &str| -> Result<()> {
        if sessions.contains(s) {
            Ok(())
        } else {
            bad(format!(
                "{what} names session {s}, which the file does not hold"
            ))
        }
    };
    for line in lines {
        match line {
            Line::Turn { turn, .. } => {
                known(
                    turn.session.as_str(),
                    &format!("turn {}#{}", turn.session, turn.index),
                )?;
                let next = turn_counts.entry(turn.session.as_str()).or_default();
                if turn.index != *next {
                    return bad(format!(
                        "turn {}#{} is out of order (expected index {next})",
                        turn.session, turn.index
                    ));
                }
                *next += 1;
            }
            Line::Record { record, .. } => {
                records.insert(record.record_id.as_str());
            }
            _ => {}
        }
    }
    for line in lines {
        match line {
            Line::Record { record, .. } => {
                let session = record.source_session.as_str();
                known(session, &format!("record {}", record.record_id))?;
                let held = turn_counts.get(session).copied().unwrap_or(0);
                if let Some(t) = record.evidence_turns.iter().find(|t| **t >= held) {
                    return bad(format!(
                        "record {} cites turn {session}#{t}, which the file does not hold",
                        record.record_id
                    ));
                }
            }
            Line::Segment(row) => {
                let session = row.segment.session.as_str();
                known(session, &format!("segment {}", row.segment.id))?;
                if row.segment.last_turn >= turn_counts.get(session).copied().unwrap_or(0) {
                    return bad(format!(
                        "segment {} ends at turn {session}#{}, which the file does not hold",
                        row.segment.id, row.segment.last_turn
                    ));
                }
                if row.segment.first_turn > row.segment.last_turn {
                    return bad(format!(
                        "segment {} starts at turn {} after it ends (turn {})",
                        row.segment.id, row.segment.first_turn, row.segment.last_turn
                    ));
                }
            }
            Line::Node { node, .. } => {
                if let Some(r) = node
                    .record_ids
                    .iter()
                    .find(|r| !records.contains(r.as_str()))
                {
                    return bad(format!(
                        "node {} links record {r}, which the file does not hold",
                        node.node_id
                    ));
                }
            }
            Line::State { session, name, .. } => {
                known(session.as_str(), &format!("state {name}"))?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Text embedded for each kind of item, the same text the indexes see.
fn embed_text(line: &Line) -> Option<String> {
    match line {
        Line::Turn { turn, .. } => Some(crate::rules::turn_search_text(turn)),
        Line::Record { record, .. } => Some(crate::rules::record_embed_text(record)),
        Line::Node { node, .. } => Some(node.search_text.clone()),
        _ => None,
    }
}

fn write_line(out: &mut dyn Write, line: &Line) -> Result<()> {
    let json = serde_json::to_string(line).map_err(|e| Error::Store(format!("export: {e}")))?;
    writeln!(out, "{json}").map_err(|e| Error::Store(format!("export write failed: {e}")))
}

/// Writes an export: the header on creation, one line per item, the `end` line with the
/// per-kind counts on [`ExportWriter::finish`].
pub struct ExportWriter<'a> {
    out: &'a mut dyn Write,
    lines: u64,
    counts: LineCounts,
}

impl<'a> ExportWriter<'a> {
    /// Starts an export of namespace `ns` of a store of `dims`-dimensional vectors.
    pub fn new(out: &'a mut dyn Write, ns: &Namespace, dims: usize) -> Result<Self> {
        write_line(
            out,
            &Line::Header {
                format: FORMAT.into(),
                version: VERSION,
                namespace: ns.to_string(),
                dims,
            },
        )?;
        Ok(ExportWriter {
            out,
            lines: 1,
            counts: LineCounts::default(),
        })
    }

    /// Writes one item line (a header or end line passed here is refused).
    pub fn write(&mut self, line: &Line) -> Result<()> {
        if matches!(line, Line::Header { .. } | Line::End(_)) {
            return Err(Error::Store(
                "export: the header and end lines are written by the exporter".into(),
            ));
        }
        self.counts.count(line);
        self.lines += 1;
        write_line(self.out, line)
    }

    /// Writes the end line; returns the number of lines written.
    pub fn finish(self) -> Result<u64> {
        write_line(self.out, &Line::End(self.counts))?;
        Ok(self.lines + 1)
    }
}

/// Reads, checks and completes an export for import into a store of `dims`-dimensional
/// vectors: the whole file is parsed and validated (header, counts, references) before the
/// caller writes anything, and vectors the file lacks (or whose dimension differs) are computed
/// with `embed` or counted as pending. Returns the lines in file order and a receipt holding
/// the vector counts; the caller adds the row counts as it writes.
pub fn read_import(
    input: &mut dyn BufRead,
    dims: usize,
    embed: Option<&EmbedFn>,
) -> Result<(Vec<Line>, ImportReceipt)> {
    let mut lines = read_export(input)?;
    let Some(Line::Header {
        dims: file_dims, ..
    }) = lines.first()
    else {
        return Err(Error::InvalidInput("import: empty file".into()));
    };
    let same_dims = *file_dims == dims;
    validate(&lines)?;
    let mut receipt = ImportReceipt::default();
    fill_vectors(&mut lines, same_dims, embed, &mut receipt)?;
    Ok((lines, receipt))
}

/// The writes of an import, as one backend's write transaction performs them.
pub trait ImportSink {
    fn put_session(&mut self, ns: &Namespace, info: &SessionInfo) -> Result<()>;
    /// Appends a turn; false when an identical turn was already stored.
    fn add_turn(&mut self, ns: &Namespace, turn: Turn, vector: Option<&[f32]>) -> Result<bool>;
    fn put_record(&mut self, ns: &Namespace, record: Record, vector: Option<&[f32]>) -> Result<()>;
    fn put_node(
        &mut self,
        ns: &Namespace,
        node: EvidenceNode,
        vector: Option<&[f32]>,
    ) -> Result<()>;
    fn put_segment(&mut self, ns: &Namespace, row: &SegmentRow) -> Result<()>;
    fn put_state(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<()>;
    fn log_usage(&mut self, ns: &Namespace, usage: &TokenUsage) -> Result<()>;
}

/// Writes the lines of a checked import (see [`read_import`]) into namespace `ns` through
/// `sink`, in file order, counting what it stores into `receipt`. Sessions start with no turns:
/// their turns are appended as they come.
pub fn write_import(
    ns: &Namespace,
    lines: Vec<Line>,
    receipt: &mut ImportReceipt,
    sink: &mut dyn ImportSink,
) -> Result<()> {
    for line in lines {
        match line {
            Line::Header { .. } | Line::End(_) => {}
            Line::Session(info) => {
                sink.put_session(
                    ns,
                    &SessionInfo {
                        turn_count: 0,
                        ..info
                    },
                )?;
                receipt.sessions += 1;
            }
            Line::Turn { turn, vector } => {
                sink.add_turn(ns, turn, vector.as_deref())?;
                receipt.turns += 1;
            }
            Line::Record { record, vector } => {
                sink.put_record(ns, record, vector.as_deref())?;
                receipt.records += 1;
            }
            Line::Node { node, vector } => {
                sink.put_node(ns, node, vector.as_deref())?;
                receipt.nodes += 1;
            }
            Line::Segment(row) => {
                sink.put_segment(ns, &row)?;
                receipt.segments += 1;
            }
            Line::State {
                session,
                name,
                value,
            } => {
                sink.put_state(ns, &session, &name, &value)?;
                receipt.state_entries += 1;
            }
            Line::Usage(u) => {
                sink.log_usage(ns, &u)?;
                receipt.usage_entries += 1;
            }
        }
    }
    Ok(())
}

impl ImportSink for crate::store::Writer<'_> {
    fn put_session(&mut self, ns: &Namespace, info: &SessionInfo) -> Result<()> {
        crate::store::Writer::put_session(self, ns, info)
    }
    fn add_turn(&mut self, ns: &Namespace, turn: Turn, vector: Option<&[f32]>) -> Result<bool> {
        crate::store::Writer::add_turn(self, ns, turn, vector)
    }
    fn put_record(&mut self, ns: &Namespace, record: Record, vector: Option<&[f32]>) -> Result<()> {
        crate::store::Writer::put_record(self, ns, record, vector)
    }
    fn put_node(
        &mut self,
        ns: &Namespace,
        node: EvidenceNode,
        vector: Option<&[f32]>,
    ) -> Result<()> {
        crate::store::Writer::put_node(self, ns, node, vector)
    }
    fn put_segment(&mut self, ns: &Namespace, row: &SegmentRow) -> Result<()> {
        crate::store::Writer::put_segment(self, ns, row)
    }
    fn put_state(
        &mut self,
        ns: &Namespace,
        session: &SessionId,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<()> {
        crate::store::Writer::put_state(self, ns, session, name, value)
    }
    fn log_usage(&mut self, ns: &Namespace, usage: &TokenUsage) -> Result<()> {
        crate::store::Writer::log_usage(self, ns, usage)
    }
}

/// The bodies of [`StoreAdmin::export`] and [`StoreAdmin::import`] for the redb store.
impl Store {
    pub(crate) fn export_lines(
        &self,
        ns: &Namespace,
        out: &mut dyn Write,
        opts: ExportOptions,
    ) -> Result<u64> {
        let txn = self.read_txn()?;
        let prefix = keys::ns(ns);
        let vectors = txn.open_table(VECTORS).map_err(db_err)?;
        let vector = |target: Target, key: u64| -> Result<Option<Vec<f32>>> {
            if !opts.include_vectors {
                return Ok(None);
            }
            Ok(vectors
                .get(keys::vector(ns, target, key).as_slice())
                .map_err(db_err)?
                .map(|v| vector_from_bytes(v.value())))
        };
        let mut export = ExportWriter::new(out, ns, self.options().dims)?;
        let mut emit = |line: Line| export.write(&line);
        for (_, v) in scan_prefix(&txn.open_table(SESSIONS).map_err(db_err)?, &prefix)? {
            emit(Line::Session(from_json(&v, "session")?))?;
        }
        for (_, v) in scan_prefix(&txn.open_table(TURNS).map_err(db_err)?, &prefix)? {
            let row: TurnRow = from_json(&v, "turn")?;
            let vector = vector(Target::Turn, row.key)?;
            emit(Line::Turn {
                turn: row.turn,
                vector,
            })?;
        }
        for (_, v) in scan_prefix(&txn.open_table(RECORDS).map_err(db_err)?, &prefix)? {
            let row: RecordRow = from_json(&v, "record")?;
            let vector = vector(Target::Record, row.key)?;
            emit(Line::Record {
                record: row.record,
                vector,
            })?;
        }
        for (_, v) in scan_prefix(&txn.open_table(NODES).map_err(db_err)?, &prefix)? {
            let row: NodeRow = from_json(&v, "node")?;
            let vector = vector(Target::Node(row.node.kind), row.key)?;
            emit(Line::Node {
                node: row.node,
                vector,
            })?;
        }
        for (_, v) in scan_prefix(&txn.open_table(SEGMENTS).map_err(db_err)?, &prefix)? {
            emit(Line::Segment(from_json(&v, "segment")?))?;
        }
        for (k, v) in scan_prefix(&txn.open_table(STATE).map_err(db_err)?, &prefix)? {
            let rest = keys::suffix(&k, &prefix);
            let Some(split) = rest.iter().position(|b| *b == 0) else {
                continue;
            };
            let session = SessionId::new(String::from_utf8_lossy(&rest[..split]).into_owned())?;
            let name = String::from_utf8_lossy(&rest[split + 1..]).into_owned();
            emit(Line::State {
                session,
                name,
                value: from_json(&v, "state")?,
            })?;
        }
        for (_, v) in scan_prefix(&txn.open_table(USAGE).map_err(db_err)?, &prefix)? {
            emit(Line::Usage(from_json(&v, "usage")?))?;
        }
        export.finish()
    }

    pub(crate) fn import_lines(
        &self,
        ns: &Namespace,
        input: &mut dyn BufRead,
        embed: Option<&EmbedFn>,
    ) -> Result<ImportReceipt> {
        if self.has_namespace(ns)? {
            return Err(Error::InvalidInput(format!(
                "namespace {ns} is not empty; import into a new namespace or delete it first"
            )));
        }
        let (lines, mut receipt) = read_import(input, self.options().dims, embed)?;
        self.write(|w| write_import(ns, lines, &mut receipt, w))?;
        Ok(receipt)
    }
}

/// The lines of an export, parsed, with the header checked (format and version); the file's
/// references are checked by [`validate`].
fn read_export(input: &mut dyn BufRead) -> Result<Vec<Line>> {
    let mut lines: Vec<Line> = Vec::new();
    let mut raw = String::new();
    let mut number = 0usize;
    loop {
        raw.clear();
        let read = input
            .read_line(&mut raw)
            .map_err(|e| Error::InvalidInput(format!("import line {}: {e}", number + 1)))?;
        if read == 0 {
            break;
        }
        number += 1;
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw.trim_end())
            .map_err(|e| Error::InvalidInput(format!("import line {number}: {e}")))?;
        if number == 1 {
            match &line {
                Line::Header {
                    format, version, ..
                } => {
                    if format != FORMAT || !(VERSION_WITHOUT_END..=VERSION).contains(version) {
                        return Err(Error::InvalidInput(format!(
                            "not a {FORMAT} v{VERSION_WITHOUT_END}–v{VERSION} file \
                             (found {format} v{version})"
                        )));
                    }
                }
                _ => {
                    return Err(Error::InvalidInput(
                        "import: the first line must be the export header".into(),
                    ));
                }
            }
        }
        lines.push(line);
    }
    Ok(lines)
}

/// Keeps each line's vector when the file's dimension matches the store's, computes the
/// missing ones with `embed` (in batches of 64), or counts them as pending without it.
fn fill_vectors(
    lines: &mut [Line],
    same_dims: bool,
    embed: Option<&EmbedFn>,
    receipt: &mut ImportReceipt,
) -> Result<()> {
    // Vectors: keep the file's when comparable, otherwise compute what we can.
    let mut missing: Vec<(usize, String)> = Vec::new();
    for (i, line) in lines.iter_mut().enumerate() {
        let slot = match line {
            Line::Turn { vector, .. } | Line::Record { vector, .. } | Line::Node { vector, .. } => {
                vector
            }
            _ => continue,
        };
        if !same_dims {
            *slot = None;
        }
        if slot.is_some() {
            receipt.vectors_imported += 1;
        } else if let Some(text) = embed_text(line) {
            missing.push((i, text));
        }
    }
    if let Some(embed) = embed {
        for chunk in missing.chunks(64) {
            let texts: Vec<String> = chunk.iter().map(|(_, t)| t.clone()).collect();
            let vectors = embed(&texts)?;
            if vectors.len() != texts.len() {
                return Err(Error::Store(format!(
                    "import: the embedder returned {} vectors for {} texts",
                    vectors.len(),
                    texts.len()
                )));
            }
            for ((i, _), v) in chunk.iter().zip(vectors) {
                if let Line::Turn { vector, .. }
                | Line::Record { vector, .. }
                | Line::Node { vector, .. } = &mut lines[*i]
                {
                    *vector = Some(v);
                    receipt.vectors_computed += 1;
                }
            }
        }
    } else {
        receipt.vectors_pending = missing.len() as u64;
    }
    Ok(())
}
