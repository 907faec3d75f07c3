//! The durable home of a lycheemem memory.
//!
//! [`Store`] keeps the truth in one redb file — sessions, raw turns, segments, records, evidence
//! nodes with their record links, per-session state (segmenter state, encoder reference
//! context), the token usage log, every item's vector, and a change log numbered by a write
//! sequence. Two derived indexes are rebuilt from it whenever needed:
//!
//! * usearch HNSW vector indexes, one per namespace and target (records, raw turns, and each
//!   evidence-node kind), cosine on the stored vectors, f32 or f16;
//! * one tantivy BM25 index over records, nodes and turns, with namespace, target and session
//!   fields for filtering.
//!
//! Each derived index remembers the last change it applied. Writes commit to redb first and are
//! then applied to the indexes from the change log — the same code path recovery uses — so after
//! a crash, on open, the indexes catch up; if their folders are gone (or unreadable) they are
//! rebuilt from redb. Every call takes a [`Namespace`]; nothing reads or writes across one.
//!
//! One process owns a store directory at a time (a lock file; a second opener gets a clear
//! error). Inside that process a `Store` is `Sync`: many threads read concurrently while writes
//! are serialized.
//!
//! ```
//! use lycheemem_core::{Namespace, Role, SessionId, Turn};
//! use lycheemem_store::prelude::*;
//! use lycheemem_store::{SessionInfo, Store, StoreOptions, Target, VectorQuery};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(dir.path(), StoreOptions::new(2)).unwrap();
//! let ns = Namespace::new("alice").unwrap();
//! let session = SessionId::new("s1").unwrap();
//! store.put_session(&ns, SessionInfo::new(session.clone(), Some("2023-05-08".into()))).unwrap();
//! let turn = Turn {
//!     session: session.clone(),
//!     index: 0,
//!     role: Role::User,
//!     speaker: None,
//!     text: "I adopted a cat named Miso".into(),
//!     time: None,
//! };
//! store.add_turns(&ns, vec![(turn, Some(vec![1.0, 0.0]))]).unwrap();
//! let hits = store.vector_search(&ns, &VectorQuery::new(Target::Turn, vec![0.9, 0.1], 5)).unwrap();
//! assert_eq!(hits.len(), 1);
//! let hits = store.text_search(&ns, Target::Turn, "cat", 5, None).unwrap();
//! assert_eq!(hits[0].item.to_string(), "turn:s1#0");
//! ```

mod backend;
mod fulltext;
mod keys;
pub mod rules;
mod store;
mod tables;
pub mod text;
mod transfer;
mod types;
mod vectors;

pub use backend::{
    LockGuard, LockScope, MemoryStore, RetrievalStore, StoreAdmin, StoreCatalog, StoreLocks,
    StoreLookup, StoreSearch, StoreSettings, StoreWrite, setting_conflict,
};
pub use store::Store;

/// The store traits, for calling a backend's methods: `use lycheemem_store::prelude::*;`.
pub mod prelude {
    pub use crate::backend::{
        MemoryStore, RetrievalStore, StoreAdmin, StoreCatalog, StoreLocks, StoreLookup,
        StoreSearch, StoreSettings, StoreWrite,
    };
}
pub use transfer::{
    EmbedFn, ExportOptions, ExportWriter, ImportReceipt, ImportSink, Line as ExportLine,
    read_import, write_import,
};
pub use types::{
    DeleteReceipt, Hit, ItemRef, NamespaceStats, NodeMembers, SegmentOutcome, SegmentRow,
    SegmentWrite, SessionInfo, StoreOptions, Target, VectorQuery, WriteReceipt, check_query_dims,
};
