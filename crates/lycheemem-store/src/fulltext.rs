//! The tantivy BM25 index over records, nodes and raw turns, derived from redb.
//!
//! One index for the whole store; every document carries its namespace, target and sessions,
//! and every query is confined by them. The last change applied travels in the commit payload,
//! so index contents and the recorded position are committed atomically. Text is analysed
//! with tantivy's English stemmer; queries are tokenized with the same analyzer and OR-ed as
//! term queries, so no query syntax can fail to parse.
//!
//! BM25 statistics (document count, document frequencies, average length) are taken over the
//! live documents only ([`LiveStats`]). Tantivy's own statistics still count a replaced or
//! deleted document until a merge purges it, so the same contents would score differently
//! depending on their history: how often a record was restated, where a build was resumed.
//! Ties are broken by document id, so equal contents also rank equally.

use lycheemem_core::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use tantivy::collector::{Count, TopDocs};
use tantivy::query::{
    Bm25StatisticsProvider, BooleanQuery, ConstScoreQuery, Occur, Query, TermQuery,
};
use tantivy::schema::{
    Field, IndexRecordOption, NumericOptions, STRING, Schema, TextFieldIndexing, TextOptions, Value,
};
use tantivy::tokenizer::TextAnalyzer;
use tantivy::{
    DocSet, Index, IndexReader, IndexWriter, ReloadPolicy, Searcher, TERMINATED, TantivyDocument,
    Term,
};

use crate::types::Target;

#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    store_id: String,
    applied: u64,
}

#[derive(Clone, Copy)]
struct Fields {
    uid: Field,
    ns: Field,
    target: Field,
    session: Field,
    id: Field,
    text: Field,
}

/// One document to index.
pub(crate) struct TextDoc<'a> {
    pub key: u64,
    pub ns: &'a str,
    pub target: Target,
    pub sessions: Vec<&'a str>,
    pub id: &'a str,
    pub text: &'a str,
}

pub(crate) struct FullText {
    fields: Fields,
    writer: Mutex<IndexWriter>,
    reader: IndexReader,
    analyzer: Mutex<TextAnalyzer>,
    /// Documents were added or deleted since the last commit.
    dirty: AtomicBool,
    /// The live documents' text length, by searcher generation (see [`LiveStats`]).
    live_tokens: Mutex<Option<(u64, u64)>>,
    /// The last change applied to the writer (guarded by the store's write lock).
    pub applied: u64,
    /// The last change included in a commit.
    pub committed: u64,
}

fn text_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Store(format!("full-text index {what}: {e}"))
}

fn schema() -> (Schema, Fields) {
    let mut b = Schema::builder();
    let uid = b.add_u64_field("uid", NumericOptions::default().set_indexed());
    let ns = b.add_text_field("ns", STRING);
    let target = b.add_text_field("target", STRING);
    let session = b.add_text_field("session", STRING);
    let id = b.add_text_field("id", TextOptions::default().set_stored());
    let text = b.add_text_field(
        "text",
        TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer("en_stem")
                .set_index_option(IndexRecordOption::WithFreqs),
        ),
    );
    let fields = Fields {
        uid,
        ns,
        target,
        session,
        id,
        text,
    };
    (b.build(), fields)
}

impl FullText {
    /// Opens the index in `dir`; when it is missing, unreadable or belongs to another store it
    /// is recreated empty with `applied = 0` and the caller rebuilds it.
    pub fn open(dir: &Path, store_id: &str) -> Result<Self> {
        match Self::try_open(dir, store_id) {
            Ok(Some(ft)) => Ok(ft),
            Ok(None) => Self::create(dir),
            Err(e) => {
                tracing::warn!("full-text index unreadable, rebuilding: {e}");
                Self::create(dir)
            }
        }
    }

    fn try_open(dir: &Path, store_id: &str) -> Result<Option<Self>> {
        if !dir.join("meta.json").exists() {
            return Ok(None);
        }
        let index = Index::open_in_dir(dir).map_err(|e| text_err("open", e))?;
        let (expected, fields) = schema();
        if index.schema() != expected {
            return Ok(None);
        }
        let metas = index.load_metas().map_err(|e| text_err("open", e))?;
        let applied = match metas
            .payload
            .as_deref()
            .and_then(|p| serde_json::from_str::<Payload>(p).ok())
        {
            Some(p) if p.store_id == store_id => p.applied,
            Some(_) => return Ok(None),
            None => 0,
        };
        Self::from_index(index, fields, applied).map(Some)
    }

    fn create(dir: &Path) -> Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let (schema, fields) = schema();
        let index = Index::create_in_dir(dir, schema).map_err(|e| text_err("create", e))?;
        Self::from_index(index, fields, 0)
    }

    fn from_index(index: Index, fields: Fields, applied: u64) -> Result<Self> {
        let writer = index
            .writer_with_num_threads(1, 50_000_000)
            .map_err(|e| text_err("writer", e))?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(|e| text_err("reader", e))?;
        let analyzer = index
            .tokenizer_for_field(fields.text)
            .map_err(|e| text_err("analyzer", e))?;
        Ok(FullText {
            fields,
            writer: Mutex::new(writer),
            reader,
            analyzer: Mutex::new(analyzer),
            dirty: AtomicBool::new(false),
            live_tokens: Mutex::new(None),
            applied,
            committed: applied,
        })
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, IndexWriter> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the document with `key` (if any) and adds `doc` in its place.
    pub fn upsert(&self, doc: &TextDoc) -> Result<()> {
        let f = self.fields;
        let writer = self.writer();
        writer.delete_term(Term::from_field_u64(f.uid, doc.key));
        let mut d = TantivyDocument::default();
        d.add_u64(f.uid, doc.key);
        d.add_text(f.ns, doc.ns);
        d.add_text(f.target, doc.target.as_str());
        for s in &doc.sessions {
            d.add_text(f.session, s);
        }
        d.add_text(f.id, doc.id);
        d.add_text(f.text, doc.text);
        writer.add_document(d).map_err(|e| text_err("add", e))?;
        self.dirty.store(true, Ordering::Release);
        Ok(())
    }

    pub fn remove(&self, key: u64) {
        self.writer()
            .delete_term(Term::from_field_u64(self.fields.uid, key));
        self.dirty.store(true, Ordering::Release);
    }

    pub fn drop_namespace(&self, ns: &str) {
        self.writer()
            .delete_term(Term::from_field_text(self.fields.ns, ns));
        self.dirty.store(true, Ordering::Release);
    }

    pub fn clear(&mut self) -> Result<()> {
        self.writer()
            .delete_all_documents()
            .map_err(|e| text_err("clear", e))?;
        self.applied = 0;
        self.dirty.store(true, Ordering::Release);
        Ok(())
    }

    /// Commits pending changes with the applied position and makes them visible to searches.
    pub fn commit(&mut self, store_id: &str) -> Result<()> {
        let payload = serde_json::to_string(&Payload {
            store_id: store_id.to_string(),
            applied: self.applied,
        })
        .map_err(|e| text_err("commit", e))?;
        {
            let mut writer = self.writer();
            let mut prepared = writer.prepare_commit().map_err(|e| text_err("commit", e))?;
            prepared.set_payload(&payload);
            prepared.commit().map_err(|e| text_err("commit", e))?;
        }
        self.reader.reload().map_err(|e| text_err("reload", e))?;
        self.dirty.store(false, Ordering::Release);
        self.committed = self.applied;
        Ok(())
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }

    fn filter(
        &self,
        ns: &str,
        target: Target,
        session: Option<&str>,
    ) -> Vec<(Occur, Box<dyn Query>)> {
        let f = self.fields;
        let term = |field: Field, value: &str| -> (Occur, Box<dyn Query>) {
            let q = TermQuery::new(
                Term::from_field_text(field, value),
                IndexRecordOption::Basic,
            );
            (
                Occur::Must,
                Box::new(ConstScoreQuery::new(Box::new(q), 0.0)),
            )
        };
        let mut clauses = vec![term(f.ns, ns), term(f.target, target.as_str())];
        if let Some(s) = session {
            clauses.push(term(f.session, s));
        }
        clauses
    }

    /// BM25 top-`k` as `(id, score)`, best first. Only committed documents are visible.
    pub fn search(
        &self,
        ns: &str,
        target: Target,
        query: &str,
        k: usize,
        session: Option<&str>,
    ) -> Result<Vec<(String, f32)>> {
        let mut terms: Vec<String> = Vec::new();
        {
            let mut analyzer = self.analyzer.lock().unwrap_or_else(|p| p.into_inner());
            let mut stream = analyzer.token_stream(query);
            while let Some(token) = stream.next() {
                if !terms.contains(&token.text) {
                    terms.push(token.text.clone());
                }
            }
        }
        if terms.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let text_clauses: Vec<(Occur, Box<dyn Query>)> = terms
            .iter()
            .map(|t| {
                let q: Box<dyn Query> = Box::new(TermQuery::new(
                    Term::from_field_text(self.fields.text, t),
                    IndexRecordOption::WithFreqs,
                ));
                (Occur::Should, q)
            })
            .collect();
        let mut clauses = self.filter(ns, target, session);
        clauses.push((Occur::Must, Box::new(BooleanQuery::new(text_clauses))));
        let query = BooleanQuery::new(clauses);
        let searcher = self.reader.searcher();
        let stats = LiveStats {
            searcher: &searcher,
            text: self.fields.text,
            text_tokens: self.live_tokens(&searcher)?,
        };
        // Documents tied with the k-th are collected too (up to `TIE_MARGIN` of them), so that
        // which of them make the cut is decided by id, not by their place in the index.
        let top = searcher
            .search_with_statistics_provider(
                &query,
                &TopDocs::with_limit(k.saturating_add(TIE_MARGIN)).order_by_score(),
                &stats,
            )
            .map_err(|e| text_err("search", e))?;
        let mut out = Vec::with_capacity(top.len());
        for (score, addr) in top {
            let doc: TantivyDocument = searcher.doc(addr).map_err(|e| text_err("read", e))?;
            if let Some(id) = doc.get_first(self.fields.id).and_then(|v| v.as_str()) {
                out.push((id.to_string(), score));
            }
        }
        out.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out.truncate(k);
        Ok(out)
    }

    /// Tokens in the text field of the live documents seen by `searcher` (computed once per
    /// searcher generation).
    fn live_tokens(&self, searcher: &Searcher) -> Result<u64> {
        let generation = searcher.generation().generation_id();
        let mut cached = self.live_tokens.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((g, tokens)) = *cached
            && g == generation
        {
            return Ok(tokens);
        }
        let mut tokens = 0u64;
        for segment in searcher.segment_readers() {
            let norms = segment
                .get_fieldnorms_reader(self.fields.text)
                .map_err(|e| text_err("field norms", e))?;
            tokens += segment
                .doc_ids_alive()
                .map(|doc| u64::from(norms.fieldnorm(doc)))
                .sum::<u64>();
        }
        *cached = Some((generation, tokens));
        Ok(tokens)
    }

    /// Committed documents of `(ns, target)`.
    pub fn count(&self, ns: &str, target: Target) -> Result<u64> {
        let query = BooleanQuery::new(self.filter(ns, target, None));
        let n = self
            .reader
            .searcher()
            .search(&query, &Count)
            .map_err(|e| text_err("count", e))?;
        Ok(n as u64)
    }
}

/// Extra documents collected past `k` so that ties at the cut are ranked by id.
const TIE_MARGIN: usize = 16;

/// BM25 statistics over the live documents of a searcher: the document count and document
/// frequencies leave out deleted documents that no merge has purged yet, and the text length
/// is the sum of the live documents' field norms (the same per-document lengths BM25 scores
/// with), so a score depends only on what the index holds.
struct LiveStats<'a> {
    searcher: &'a Searcher,
    text: Field,
    text_tokens: u64,
}

impl Bm25StatisticsProvider for LiveStats<'_> {
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        if field == self.text {
            Ok(self.text_tokens)
        } else {
            self.searcher.total_num_tokens(field)
        }
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        Ok(self.searcher.num_docs())
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        let mut n = 0u64;
        for segment in self.searcher.segment_readers() {
            let index = segment.inverted_index(term.field())?;
            let Some(alive) = segment.alive_bitset() else {
                n += u64::from(index.doc_freq(term)?);
                continue;
            };
            if let Some(mut postings) = index.read_postings(term, IndexRecordOption::Basic)? {
                let mut doc = postings.doc();
                while doc != TERMINATED {
                    n += u64::from(alive.is_alive(doc));
                    doc = postings.advance();
                }
            }
        }
        Ok(n)
    }
}
