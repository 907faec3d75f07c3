//! The redb tables (the source of truth) and typed access helpers.
//!
//! Values are JSON except vectors (little-endian f32). Keys are built in [`crate::keys`].

use lycheemem_core::{Error, EvidenceNode, Record, Result, Turn};
use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::types::Target;

/// Counters: `seq` (last write sequence), `next_key` (next index key), `log_floor` (changes at
/// or below it have been trimmed), `dims`, `format` (the store format, `STORE_FORMAT`), and
/// `id_keys_filled` / `node_members_filled` (tables of a later format filled on first open).
pub(crate) const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
/// Store identity (`store_id`), so an index folder from another store is never trusted.
pub(crate) const INFO: TableDefinition<&str, &str> = TableDefinition::new("info");
pub(crate) const SESSIONS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("sessions");
pub(crate) const TURNS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("turns");
pub(crate) const SEGMENTS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("segments");
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
pub(crate) const NODES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("nodes");
/// `ns \0 record \0 node` → (): which nodes link a record.
pub(crate) const RECORD_NODES: TableDefinition<&[u8], ()> = TableDefinition::new("record_nodes");
/// `ns \0 session \0 record` → (): which records came from a session.
pub(crate) const SESSION_RECORDS: TableDefinition<&[u8], ()> =
    TableDefinition::new("session_records");
pub(crate) const STATE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("state");
pub(crate) const USAGE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("usage");
/// `ns \0 target key` → f32 LE bytes.
pub(crate) const VECTORS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("vectors");
/// `ns \0 target key` → item id: turns index keys back into items.
pub(crate) const KEYS: TableDefinition<&[u8], &str> = TableDefinition::new("keys");
/// `ns \0 target id` → index key: finds an item's vector without decoding its row.
pub(crate) const ID_KEYS: TableDefinition<&[u8], u64> = TableDefinition::new("id_keys");
/// `ns \0 node id` → the node's member records with their index keys, in the binary layout of
/// [`encode_members`]. Derived from the node row in the same transaction; retrieval reads it
/// instead of decoding the node's JSON row and looking each member's key up.
pub(crate) const NODE_MEMBERS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("node_members");
/// `ns \0 target id` → (): items without a current vector.
pub(crate) const PENDING: TableDefinition<&[u8], ()> = TableDefinition::new("pending_vectors");
/// seq → [`Change`]: what the derived indexes must apply.
pub(crate) const CHANGES: TableDefinition<u64, &[u8]> = TableDefinition::new("changes");

/// A stored raw turn with its index key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TurnRow {
    pub turn: Turn,
    pub key: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RecordRow {
    pub record: Record,
    pub key: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct NodeRow {
    pub node: EvidenceNode,
    pub key: u64,
}

/// One entry of the change log. Applying a change is idempotent: an `Item` change makes the
/// indexes match the item's current row (present with this key → indexed, otherwise removed).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Change {
    Item {
        ns: String,
        target: Target,
        id: String,
        key: u64,
    },
    DropNamespace {
        ns: String,
    },
}

/// A node's members as stored in [`NODE_MEMBERS`]: record ids in the node's (sorted) order and
/// each one's index key, 0 where the record had none when the row was written.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Members {
    pub ids: Vec<String>,
    pub keys: Vec<u64>,
}

/// Bytes of the count at the head of a members row.
const MEMBERS_HEAD: usize = 4;

/// `u32` count, then every key (`u64`), then every id's byte length (`u32`), then the ids'
/// bytes back to back; all little-endian.
pub(crate) fn encode_members<'a>(members: impl Iterator<Item = (&'a str, u64)>) -> Vec<u8> {
    let members: Vec<(&str, u64)> = members.collect();
    let text: usize = members.iter().map(|(id, _)| id.len()).sum();
    let mut out = Vec::with_capacity(MEMBERS_HEAD + members.len() * 12 + text);
    out.extend_from_slice(&(members.len() as u32).to_le_bytes());
    for (_, key) in &members {
        out.extend_from_slice(&key.to_le_bytes());
    }
    for (id, _) in &members {
        out.extend_from_slice(&(id.len() as u32).to_le_bytes());
    }
    for (id, _) in &members {
        out.extend_from_slice(id.as_bytes());
    }
    out
}

fn corrupt_members() -> Error {
    Error::Store("corrupt node members row".into())
}

/// How many members a members row lists (its head only).
pub(crate) fn member_count(bytes: &[u8]) -> Result<usize> {
    let head = bytes.get(..MEMBERS_HEAD).ok_or_else(corrupt_members)?;
    Ok(u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize)
}

/// Decodes a members row written by [`encode_members`]; a row of any other shape is an error.
pub(crate) fn decode_members(bytes: &[u8]) -> Result<Members> {
    let n = member_count(bytes)?;
    let keys_end = n
        .checked_mul(8)
        .and_then(|k| k.checked_add(MEMBERS_HEAD))
        .ok_or_else(corrupt_members)?;
    let lens_end = n
        .checked_mul(4)
        .and_then(|l| l.checked_add(keys_end))
        .ok_or_else(corrupt_members)?;
    let keys_bytes = bytes
        .get(MEMBERS_HEAD..keys_end)
        .ok_or_else(corrupt_members)?;
    let lens_bytes = bytes.get(keys_end..lens_end).ok_or_else(corrupt_members)?;
    let mut text = &bytes[lens_end..];
    let keys = keys_bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    let mut ids = Vec::with_capacity(n);
    for c in lens_bytes.chunks_exact(4) {
        let len = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        if len > text.len() {
            return Err(corrupt_members());
        }
        let (id, rest) = text.split_at(len);
        ids.push(
            std::str::from_utf8(id)
                .map_err(|_| corrupt_members())?
                .to_string(),
        );
        text = rest;
    }
    if !text.is_empty() {
        return Err(corrupt_members());
    }
    Ok(Members { ids, keys })
}

pub(crate) fn to_json<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Store(format!("cannot serialize: {e}")))
}

pub(crate) fn from_json<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Store(format!("corrupt {what} row: {e}")))
}

/// Reads and decodes one JSON row.
pub(crate) fn get_json<T: DeserializeOwned>(
    table: &impl ReadableTable<&'static [u8], &'static [u8]>,
    key: &[u8],
    what: &str,
) -> Result<Option<T>> {
    match table.get(key).map_err(db_err)? {
        Some(v) => Ok(Some(from_json(v.value(), what)?)),
        None => Ok(None),
    }
}

/// All `(key, value)` pairs whose key starts with `prefix`.
pub(crate) fn scan_prefix(
    table: &impl ReadableTable<&'static [u8], &'static [u8]>,
    prefix: &[u8],
) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let end = crate::keys::prefix_end(prefix);
    let mut out = Vec::new();
    for entry in table.range(prefix..end.as_slice()).map_err(db_err)? {
        let (k, v) = entry.map_err(db_err)?;
        out.push((k.value().to_vec(), v.value().to_vec()));
    }
    Ok(out)
}

/// All keys starting with `prefix` in a table with unit values.
pub(crate) fn scan_keys(
    table: &impl ReadableTable<&'static [u8], ()>,
    prefix: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let end = crate::keys::prefix_end(prefix);
    let mut out = Vec::new();
    for entry in table.range(prefix..end.as_slice()).map_err(db_err)? {
        let (k, _) = entry.map_err(db_err)?;
        out.push(k.value().to_vec());
    }
    Ok(out)
}

/// Number of keys starting with `prefix`.
pub(crate) fn count_prefix<V: redb::Value + 'static>(
    table: &impl ReadableTable<&'static [u8], V>,
    prefix: &[u8],
) -> Result<u64> {
    let end = crate::keys::prefix_end(prefix);
    let mut n = 0;
    for entry in table.range(prefix..end.as_slice()).map_err(db_err)? {
        entry.map_err(db_err)?;
        n += 1;
    }
    Ok(n)
}

pub(crate) fn vector_to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(crate) fn vector_from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Maps any redb error into the store error.
pub(crate) fn db_err(e: impl Into<redb::Error>) -> Error {
    Error::Store(format!("database: {}", e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_rows_round_trip_and_reject_every_truncation() {
        let ids = ["r1", "", "récord-ü", "r3"];
        let keys = [7u64, 0, u64::MAX, 1];
        let row = encode_members(ids.iter().copied().zip(keys));
        assert_eq!(member_count(&row).unwrap(), 4);
        let m = decode_members(&row).unwrap();
        assert_eq!(m.ids, ids);
        assert_eq!(m.keys, keys);
        assert_eq!(
            decode_members(&encode_members(std::iter::empty())).unwrap(),
            Members::default()
        );
        for cut in 0..row.len() {
            assert!(decode_members(&row[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = row.clone();
        longer.push(b'x');
        assert!(decode_members(&longer).is_err());
        // A count far past the row's bytes, and an id that is not UTF-8.
        assert!(decode_members(&[255, 255, 255, 255]).is_err());
        let mut bad = encode_members([("ab", 1u64)].into_iter());
        let last = bad.len() - 1;
        bad[last] = 0xff;
        assert!(decode_members(&bad).is_err());
    }
}
