//! Byte keys of the redb tables.
//!
//! Every key starts with the namespace followed by a 0 byte, so a namespace's rows form one
//! contiguous key range and no lookup can reach into another namespace. Namespaces and session
//! ids cannot contain control characters, so the 0 separator is unambiguous; numbers are
//! big-endian so that byte order is numeric order.

use lycheemem_core::{Namespace, SessionId};

use crate::types::Target;

/// `ns \0`.
pub(crate) fn ns(ns: &Namespace) -> Vec<u8> {
    let mut k = ns.as_str().as_bytes().to_vec();
    k.push(0);
    k
}

/// `ns \0 part`.
pub(crate) fn ns_str(namespace: &Namespace, part: &str) -> Vec<u8> {
    let mut k = ns(namespace);
    k.extend_from_slice(part.as_bytes());
    k
}

/// `ns \0 session \0`.
pub(crate) fn session(namespace: &Namespace, session: &SessionId) -> Vec<u8> {
    let mut k = ns_str(namespace, session.as_str());
    k.push(0);
    k
}

/// `ns \0 session \0 index(be32)`: a turn or a segment (by its first turn).
pub(crate) fn session_index(namespace: &Namespace, s: &SessionId, index: u32) -> Vec<u8> {
    let mut k = session(namespace, s);
    k.extend_from_slice(&index.to_be_bytes());
    k
}

/// `ns \0 session \0 name`.
pub(crate) fn session_str(namespace: &Namespace, s: &SessionId, name: &str) -> Vec<u8> {
    let mut k = session(namespace, s);
    k.extend_from_slice(name.as_bytes());
    k
}

/// `ns \0 a \0 b` (record → node links).
pub(crate) fn pair(namespace: &Namespace, a: &str, b: &str) -> Vec<u8> {
    let mut k = ns_str(namespace, a);
    k.push(0);
    k.extend_from_slice(b.as_bytes());
    k
}

/// `ns \0 target(u8) key(be64)`: a vector or an index key → item id.
pub(crate) fn vector(namespace: &Namespace, target: Target, key: u64) -> Vec<u8> {
    let mut k = ns(namespace);
    k.push(target.code());
    k.extend_from_slice(&key.to_be_bytes());
    k
}

/// `ns \0 target(u8) id`: an item waiting for a (new) vector.
pub(crate) fn pending(namespace: &Namespace, target: Target, id: &str) -> Vec<u8> {
    let mut k = ns(namespace);
    k.push(target.code());
    k.extend_from_slice(id.as_bytes());
    k
}

/// `ns \0 seq(be64)`: a usage log entry.
pub(crate) fn seq(namespace: &Namespace, seq: u64) -> Vec<u8> {
    let mut k = ns(namespace);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// The exclusive end of the range of keys starting with `prefix`.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    vec![u8::MAX; prefix.len() + 1]
}

/// The part of `key` after `prefix`.
pub(crate) fn suffix<'a>(key: &'a [u8], prefix: &[u8]) -> &'a [u8] {
    &key[prefix.len().min(key.len())..]
}

pub(crate) fn be_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_ranges_do_not_overlap() {
        let a = Namespace::new("a").unwrap();
        let ab = Namespace::new("ab").unwrap();
        let start = ns(&a);
        let end = prefix_end(&start);
        let other = ns_str(&ab, "x");
        assert!(!(start.as_slice() <= other.as_slice() && other.as_slice() < end.as_slice()));
        let own = ns_str(&a, "x");
        assert!(start.as_slice() <= own.as_slice() && own.as_slice() < end.as_slice());
    }

    #[test]
    fn turn_keys_sort_numerically() {
        let n = Namespace::new("n").unwrap();
        let s = SessionId::new("s").unwrap();
        assert!(session_index(&n, &s, 9) < session_index(&n, &s, 10));
        assert!(session_index(&n, &s, 255) < session_index(&n, &s, 256));
    }
}
