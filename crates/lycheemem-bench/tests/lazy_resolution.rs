//! Retrieval resolves records lazily (best score bound first, until the selection is settled);
//! a traced search resolves every candidate. On a synthetic store large enough that most
//! candidates are never read, both must choose exactly the same evidence with the same scores,
//! for multi-route plans, planner queries, time filters, every question type, and with a
//! reranker.

use lycheemem_bench::synthetic::{Rng, build_store, clustered_vectors, sentence};
use lycheemem_core::config::RetrievalConfig;
use lycheemem_core::{Plan, QuestionType, Result, Route, TemporalFilter};
use lycheemem_embed::{Embedder, Reranker};
use lycheemem_retrieve::{Retriever, SearchRequest, SearchResult};
use std::collections::HashMap;
use std::sync::Mutex;

const DIMS: usize = 32;
const RECORDS: usize = 1500;
const SEED: u64 = 7;

/// Embeds a text as a noisy copy of one of the store's synthetic record vectors (chosen by
/// the text), so questions land among the records like real queries do.
struct NearRecords {
    vectors: Vec<Vec<f32>>,
    cache: Mutex<HashMap<String, Vec<f32>>>,
}

impl Embedder for NearRecords {
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let mut cache = self.cache.lock().unwrap();
        Ok(texts
            .iter()
            .map(|t| {
                cache
                    .entry(t.to_string())
                    .or_insert_with(|| {
                        let h = t.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                        });
                        let mut rng = Rng(h | 1);
                        let base = &self.vectors[(h % self.vectors.len() as u64) as usize];
                        let mut v: Vec<f32> =
                            base.iter().map(|x| x + 0.15 * rng.normal()).collect();
                        lycheemem_core::vector::normalize(&mut v);
                        v
                    })
                    .clone()
            })
            .collect())
    }

    fn dimension(&self) -> usize {
        DIMS
    }

    fn model_id(&self) -> &str {
        "near-records"
    }
}

/// A deterministic cross-encoder double: a score from the passage's words and the query's.
struct WordOverlap;

impl Reranker for WordOverlap {
    fn score(&self, query: &str, passages: &[&str]) -> Result<Vec<f32>> {
        let words: Vec<&str> = query.split_whitespace().collect();
        Ok(passages
            .iter()
            .map(|p| {
                let overlap = p.split_whitespace().filter(|w| words.contains(w)).count();
                overlap as f32 - (p.len() % 7) as f32 * 0.3
            })
            .collect())
    }

    fn model_id(&self) -> &str {
        "word-overlap"
    }
}

fn plan(rng: &mut Rng, i: usize, question: &str) -> Plan {
    let mut plan = Plan::single_route(question);
    plan.question_type = QuestionType::ALL[i % QuestionType::ALL.len()];
    let routes = 1 + i % 3;
    plan.routes = (0..routes)
        .map(|r| {
            let month = 1 + (i + r) % 12;
            Route {
                route_id: format!("r{r}"),
                goal: if r == 0 {
                    question.to_string()
                } else {
                    sentence(rng, 20_000, 5)
                },
                queries: (0..(i + r) % 4).map(|_| sentence(rng, 20_000, 4)).collect(),
                constraints: Vec::new(),
                temporal_filter: if (i + r) % 3 == 1 {
                    TemporalFilter {
                        since: Some(format!("2023-{month:02}-01")),
                        until: Some(format!("2023-{month:02}-28")),
                    }
                } else {
                    TemporalFilter::default()
                },
            }
        })
        .collect();
    plan
}

fn search(
    retriever: &Retriever<'_>,
    ns: &lycheemem_core::Namespace,
    question: &str,
    plan: &Plan,
    trace: bool,
) -> SearchResult {
    let req = SearchRequest {
        question,
        context: "",
        reference_date: None,
        top_k: 15,
        plan: Some(plan),
        trace,
        cancel: Default::default(),
    };
    retriever.search(ns, &req).unwrap()
}

#[test]
fn lazy_resolution_chooses_what_resolving_everything_chooses() {
    let dir = tempfile::tempdir().unwrap();
    let (store, ns) = build_store(dir.path(), RECORDS, DIMS, SEED).unwrap();
    let embedder = NearRecords {
        vectors: clustered_vectors(RECORDS, DIMS, SEED),
        cache: Mutex::default(),
    };
    let mut rng = Rng(99);
    // Candidates found and records read, without and with a time filter on some route.
    let (mut found, mut resolved) = ([0; 2], [0; 2]);
    for (rerank, cfg) in [
        (false, RetrievalConfig::default()),
        (true, RetrievalConfig::default()),
        (false, {
            let mut c = RetrievalConfig::default();
            c.planner_queries_recall_only = !c.planner_queries_recall_only;
            c.mmr_pool_factor = 1;
            c
        }),
    ] {
        let reranker = WordOverlap;
        let retriever = Retriever {
            store: &store,
            embedder: &embedder,
            reranker: rerank.then_some(&reranker as &dyn Reranker),
            planner: None,
            cfg: &cfg,
        };
        for i in 0..8 {
            let question = format!("{}?", sentence(&mut rng, 20_000, 4 + i % 4));
            let plan = plan(&mut rng, i, &question);
            let lazy = search(&retriever, &ns, &question, &plan, false);
            let all = search(&retriever, &ns, &question, &plan, true);
            assert_eq!(
                lazy.evidence, all.evidence,
                "question {i} (rerank {rerank}): lazy and full resolution differ"
            );
            assert!(!lazy.evidence.is_empty(), "question {i}");
            let filtered = usize::from(plan.routes.iter().any(|r| !r.temporal_filter.is_open()));
            found[filtered] += lazy.candidates.found;
            resolved[filtered] += lazy.candidates.resolved;
        }
    }
    // Laziness is real: most candidates are never read, time filters or not (a time-filtered
    // route's temporal hits carry no similarity and many records tie on their scores).
    for (filtered, (resolved, found)) in resolved.into_iter().zip(found).enumerate() {
        eprintln!("time filter {filtered}: resolved {resolved} of {found} candidates");
        assert!(
            resolved * 2 < found,
            "time filter {filtered}: resolved {resolved} of {found} candidates"
        );
    }
}
