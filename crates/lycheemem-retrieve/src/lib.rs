//! The read path of LycheeMemory V2 (docs/algorithm.md, "Read path"): one planning LLM call,
//! deterministic multi-route recall over the store, optional cross-encoder reranking, fusion
//! across routes, diversity-aware selection, and the answer prompt.
//!
//! * [`planner`]: the plan prompt, schema and lenient parsing (fallback: one route with the
//!   question).
//! * [`route`]: query variants, channels (temporal, evidence nodes, records, raw turns, BM25),
//!   bonuses, source windows, rerank, route-local scores.
//! * [`fusion`]: RRF, route quotas, MMR over a pool larger than k, the raw-turn limiter; the
//!   `no_fusion` ablation.
//! * [`answer`]: the answer prompt and call.
//!
//! [`Retriever::search`] ties them together and returns [`SearchResult`]: the plan, the chosen
//! evidence with full provenance and scores ([`SearchResult::explain`] renders why each item was
//! chosen), and the planner's token usage.

pub mod answer;
pub mod candidate;
pub mod fusion;
pub mod planner;
pub mod route;
pub mod similarity;

use lycheemem_core::config::RetrievalConfig;
use lycheemem_core::{
    CandidateTarget, Channel, Error, Evidence, MemoryType, Namespace, Plan, Result, TemporalScope,
    TokenUsage,
};
use lycheemem_embed::{Embedder, Reranker};
use lycheemem_llm::Llm;
use lycheemem_store::RetrievalStore;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub use answer::{AnswerText, answer, answer_messages, complete_answer};
pub use planner::PlanOutcome;

/// A chosen piece of evidence with what the answer prompt shows about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvidenceItem {
    pub evidence: Evidence,
    pub session: String,
    pub session_date: Option<String>,
    /// `None` for raw dialogue snippets.
    pub memory_type: Option<MemoryType>,
    pub temporal: TemporalScope,
    pub entities: Vec<String>,
    /// Turn indices (records: evidence turns; snippets: the turns shown).
    pub turns: Vec<u32>,
    /// Snippets: each shown turn's `speaker: text`, parallel to `turns`. Empty for records.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dialogue: Vec<String>,
    /// Snippets: the turns the item was retrieved for (a raw-turn hit, a window's anchor turns);
    /// the answer prompt keeps them whole when it has to shorten the snippet. May be empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub focus_turns: Vec<u32>,
}

/// What retrieval returns.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchResult {
    pub plan: Plan,
    /// Why the fallback plan was used (planner disabled, failed, or unparseable).
    pub plan_fallback: Option<String>,
    pub evidence: Vec<EvidenceItem>,
    /// The planner call's usage (empty with `no_planner`).
    pub usage: Vec<TokenUsage>,
    /// The final k.
    pub k: usize,
    /// Milliseconds per stage: `plan`, `embed`, `recall`, `score`, `fusion`.
    pub timings: std::collections::BTreeMap<&'static str, f64>,
    /// With [`SearchRequest::trace`]: the items alive after each stage, in pipeline order (see
    /// [`Stage`]); empty otherwise.
    pub stages: Vec<Stage>,
    /// With [`SearchRequest::trace`]: the candidates selection did not choose, best final score
    /// first, with the reason; empty otherwise.
    pub dropped: Vec<DroppedItem>,
    /// Context a memory strategy shows the answerer besides the evidence items (LiCoMemory:
    /// its session summaries and triples); empty for LycheeMemory.
    pub context: Vec<ContextBlock>,
    /// How many candidates recall found and how many records had to be read to settle the
    /// selection (zero where a strategy does not count them).
    pub candidates: CandidateCounts,
}

/// Recall's candidates and the records resolved among them: records are read lazily, best
/// bound first, until the selection is settled ([`route::RouteCandidates`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateCounts {
    /// Candidates over all routes (a candidate found by two routes counts twice).
    pub found: usize,
    /// Distinct records read.
    pub resolved: usize,
}

/// Where the resolved part of the fused list ends: no unresolved record can reach a final score
/// above `bound` (it is outside every route's RRF depth, so its final score is at most
/// `fusion_best_weight` times its best route-score bound). Entries above it are in the same
/// order as in the list with every record resolved.
struct Frontier {
    bound: Option<f32>,
    /// Routes with unresolved records, and how many fused entries above the bound each holds.
    open_routes: Vec<usize>,
    quota: usize,
}

impl Frontier {
    fn new(
        fused: &[fusion::Fused],
        routes: &[route::RouteCandidates<'_>],
        route_ids: &[String],
        k: usize,
        cfg: &RetrievalConfig,
    ) -> Self {
        let bound = routes
            .iter()
            .filter_map(route::RouteCandidates::pending_bound)
            .reduce(f32::max)
            .map(|b| cfg.fusion_best_weight as f32 * b);
        let open_routes = match bound {
            None => Vec::new(),
            Some(bound) => route_ids
                .iter()
                .zip(routes)
                .filter(|(_, r)| r.pending_bound().is_some())
                .map(|(id, _)| {
                    fused
                        .iter()
                        .take_while(|f| f.final_score > bound)
                        .filter(|f| f.routes.contains(id))
                        .count()
                })
                .collect(),
        };
        Frontier {
            bound,
            open_routes,
            quota: fusion::route_quota(k, route_ids.len(), cfg),
        }
    }

    /// Whether `selection` (made over the resolved candidates) is the selection over all of
    /// them: it chose k, every candidate it admitted to its pool lies above the bound, and
    /// every route with unresolved records has its quota's worth above it.
    fn settles(&self, selection: &fusion::Selection, k: usize) -> bool {
        let Some(bound) = self.bound else {
            return true;
        };
        selection.chosen.len() >= k
            && self.open_routes.iter().all(|&n| n >= self.quota)
            && selection.pool_members().all(|f| f.final_score > bound)
    }
}

/// A titled block of context lines (e.g. a session summary, or the ranked triples).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextBlock {
    pub title: String,
    pub lines: Vec<String>,
}

/// What the stage accounting counts of an item: the turns it shows or cites and its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageItem {
    pub session: String,
    pub turns: Vec<u32>,
    /// Estimated tokens of the item's text.
    pub tokens: u32,
}

/// The items alive after one stage of retrieval. Names, in order: `channel:<channel>` (every
/// candidate a channel hit, over all routes — a window counts for the raw-turn and lexical hits
/// it absorbed), `union` (every route's candidates after windows), `pool` (the candidates
/// selection chose from, after any refill; absent without fusion) and `final`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub name: String,
    pub items: Vec<StageItem>,
}

/// A candidate that was not chosen, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct DroppedItem {
    pub target: CandidateTarget,
    pub text: String,
    pub final_score: f32,
    pub reason: fusion::DropReason,
}

fn stage_item(c: &candidate::Scored) -> StageItem {
    StageItem {
        session: c.info.session.clone(),
        turns: c.info.turns.clone(),
        tokens: lycheemem_core::estimate_tokens(&c.info.text),
    }
}

/// The channel and union stages of the route lists.
fn candidate_stages(lists: &[(String, Vec<candidate::Scored>)]) -> Vec<Stage> {
    let mut union: std::collections::BTreeMap<&CandidateTarget, &candidate::Scored> =
        std::collections::BTreeMap::new();
    for (_, list) in lists {
        for c in list {
            union.entry(&c.target).or_insert(c);
        }
    }
    let mut stages = Vec::new();
    for channel in [
        Channel::Temporal,
        Channel::EvidenceNode,
        Channel::Record,
        Channel::RawTurn,
        Channel::Lexical,
        Channel::SourceWindow,
    ] {
        let mut seen: std::collections::BTreeSet<&CandidateTarget> = Default::default();
        let items: Vec<StageItem> = lists
            .iter()
            .flat_map(|(_, l)| l)
            .filter(|c| c.provenance.channels.contains(&channel) && seen.insert(&c.target))
            .map(stage_item)
            .collect();
        let name = serde_json::to_value(channel)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        stages.push(Stage {
            name: format!("channel:{name}"),
            items,
        });
    }
    stages.push(Stage {
        name: "union".into(),
        items: union.values().map(|c| stage_item(c)).collect(),
    });
    stages
}

impl SearchResult {
    /// Milliseconds spent after planning (the sum of every timed stage but `plan`).
    pub fn retrieval_ms(&self) -> f64 {
        self.timings
            .iter()
            .filter(|(k, _)| **k != "plan")
            .map(|(_, v)| v)
            .sum()
    }

    /// A human-readable account of the plan and of why each item was chosen.
    pub fn explain(&self) -> String {
        let mut out = format!(
            "plan: type {}, {} route(s){}\n",
            self.plan.question_type.as_str(),
            self.plan.routes.len(),
            self.plan_fallback
                .as_ref()
                .map(|f| format!(" (fallback: {f})"))
                .unwrap_or_default()
        );
        for r in &self.plan.routes {
            out.push_str(&format!(
                "  route {}: goal {:?}; queries {:?}; since {:?} until {:?}\n",
                r.route_id, r.goal, r.queries, r.temporal_filter.since, r.temporal_filter.until
            ));
        }
        for (i, e) in self.evidence.iter().enumerate() {
            let ev = &e.evidence;
            let what = match (&ev.target, e.memory_type) {
                (CandidateTarget::Record { record_id }, Some(t)) => {
                    format!("{} {record_id}", t.as_str())
                }
                (target, _) => describe_target(target),
            };
            let channels: Vec<String> = ev
                .provenance
                .channels
                .iter()
                .map(|c| format!("{c:?}").to_lowercase())
                .collect();
            out.push_str(&format!(
                "{:>2}. {what}\n    final {:.3} = best route {:.3} + rrf {:.4}; mmr {:.3}; channels {}; routes {}; variants {:?}; nodes {}\n    {}\n",
                i + 1,
                ev.final_score,
                ev.best_route_score,
                ev.rrf,
                ev.mmr_score,
                channels.join(","),
                ev.provenance.routes.iter().cloned().collect::<Vec<_>>().join(","),
                ev.provenance.variants,
                ev.provenance.nodes.iter().take(4).cloned().collect::<Vec<_>>().join(","),
                ev.text.lines().next().unwrap_or("").chars().take(160).collect::<String>()
            ));
        }
        if !self.dropped.is_empty() {
            out.push_str(&format!(
                "not chosen ({} candidates; the best {} shown):\n",
                self.dropped.len(),
                self.dropped.len().min(EXPLAIN_DROPPED)
            ));
            for d in self.dropped.iter().take(EXPLAIN_DROPPED) {
                out.push_str(&format!(
                    "  - {} final {:.3}: {}\n    {}\n",
                    describe_target(&d.target),
                    d.final_score,
                    d.reason.as_str(),
                    d.text
                        .lines()
                        .next()
                        .unwrap_or("")
                        .chars()
                        .take(120)
                        .collect::<String>()
                ));
            }
        }
        out
    }
}

/// How many dropped candidates `explain` lists.
const EXPLAIN_DROPPED: usize = 20;

fn describe_target(t: &CandidateTarget) -> String {
    match t {
        CandidateTarget::Record { record_id } => format!("record {record_id}"),
        CandidateTarget::Turns { first, last_index } => {
            format!("turns {}#{}-{}", first.session, first.index, last_index)
        }
    }
}

/// A retrieval request.
#[derive(Debug, Clone, Default)]
pub struct SearchRequest<'a> {
    pub question: &'a str,
    /// Recent dialogue shown to the planner (its tail, up to the configured budget).
    pub context: &'a str,
    /// The question's reference time (ISO), used to resolve relative dates.
    pub reference_date: Option<&'a str>,
    /// Requested k; the effective k is `max(top_k, min_top_k)`.
    pub top_k: usize,
    /// A plan made elsewhere (skips the planner call).
    pub plan: Option<&'a Plan>,
    /// Record the stage accounting ([`SearchResult::stages`]) and the dropped candidates
    /// ([`SearchResult::dropped`]).
    pub trace: bool,
    /// Raised when the caller went away: the planner call stops and the search returns
    /// `Error::Cancelled` instead of running its routes.
    pub cancel: lycheemem_core::Cancel,
}

/// The components retrieval runs on; backends are chosen by the caller's config.
pub struct Retriever<'a> {
    pub store: &'a dyn RetrievalStore,
    pub embedder: &'a dyn Embedder,
    pub reranker: Option<&'a dyn Reranker>,
    /// The planning LLM; `None` (or `cfg.planner == false`) uses the single-route plan.
    pub planner: Option<&'a dyn Llm>,
    pub cfg: &'a RetrievalConfig,
}

/// The most evidence items a search may ask for (`top_k`, or `retrieval.min_top_k`): recall
/// budgets are multiples of k, so a k far beyond any answer prompt would only ask the indexes
/// for allocations they cannot make.
pub const MAX_TOP_K: usize = 1_000;

impl Retriever<'_> {
    /// Plans, recalls, fuses and selects the evidence for a question.
    pub fn search(&self, ns: &Namespace, req: &SearchRequest<'_>) -> Result<SearchResult> {
        let question = req.question.trim();
        if question.is_empty() {
            return Err(Error::InvalidInput("the question is empty".into()));
        }
        let cfg = self.cfg;
        let k = req.top_k.max(cfg.min_top_k).max(1);
        if k > MAX_TOP_K {
            return Err(Error::InvalidInput(format!(
                "{k} evidence items asked for (top_k {}, retrieval.min_top_k {}): the limit is \
                 {MAX_TOP_K}",
                req.top_k, cfg.min_top_k
            )));
        }
        let mut timings = std::collections::BTreeMap::new();
        let clock = std::time::Instant::now();
        let outcome = match (req.plan, self.planner) {
            (Some(plan), _) => PlanOutcome {
                plan: plan.clone(),
                fallback: None,
                usage: None,
            },
            (None, Some(llm)) if cfg.planner => planner::plan(
                llm,
                question,
                req.context,
                req.reference_date,
                cfg,
                &req.cancel,
            ),
            _ => PlanOutcome {
                plan: Plan::single_route(question),
                fallback: Some("planner disabled".into()),
                usage: None,
            },
        };
        timings.insert("plan", clock.elapsed().as_secs_f64() * 1e3);
        req.cancel.check("the search")?;
        let plan = outcome.plan;
        let ctx = route::RouteContext {
            store: self.store,
            ns,
            reranker: self.reranker,
            cfg,
            question,
            question_type: plan.question_type,
            k,
        };
        // Every route's variants in one batch, each distinct text once (the question leads
        // every route's variants).
        let clock = std::time::Instant::now();
        let route_texts: Vec<Vec<String>> = plan
            .routes
            .iter()
            .map(|r| route::variants(question, r, cfg.max_variants))
            .collect();
        let mut distinct: Vec<&str> = Vec::new();
        for t in route_texts.iter().flatten() {
            if !distinct.contains(&t.as_str()) {
                distinct.push(t);
            }
        }
        // The lexical channel needs only the texts: its searches run on another thread while
        // the variants are embedded (the two take about as long at 100k records).
        let (vectors, lexical) = std::thread::scope(|scope| {
            let lexical = cfg.channel_lexical.then(|| {
                let (store, question_type) = (self.store, plan.question_type);
                let route_texts = &route_texts;
                scope.spawn(move || {
                    route_texts
                        .iter()
                        .map(|texts| {
                            route::lexical_searches(store, ns, cfg, question_type, k, texts)
                        })
                        .collect::<Result<Vec<_>>>()
                })
            });
            let vectors = self.embedder.embed(&distinct);
            let lexical = match lexical {
                Some(handle) => handle.join().map_err(|_| {
                    Error::Store("the lexical searches stopped with a panic".into())
                })?,
                None => Ok(Vec::new()),
            };
            Ok::<_, Error>((vectors?, lexical?))
        })?;
        let mut lexical = lexical.into_iter();
        if vectors.len() != distinct.len() {
            return Err(Error::Model(format!(
                "the embedder returned {} vectors for {} texts",
                vectors.len(),
                distinct.len()
            )));
        }
        let embedded: HashMap<&str, Vec<f32>> = distinct.into_iter().zip(vectors).collect();
        timings.insert("embed", clock.elapsed().as_secs_f64() * 1e3);
        // The stage trace and the `no_fusion` ablation read every candidate: resolve them all.
        let eager = req.trace || !cfg.fusion || cfg.fusion_best_weight < 0.0;
        let depth = fusion::rrf_depth(k, plan.routes.len(), cfg);
        let mut cache = route::ResolveCache::default();
        let mut routes = Vec::with_capacity(plan.routes.len());
        for (r, texts) in plan.routes.iter().zip(&route_texts) {
            // `distinct` holds every text of every route.
            let vectors: Vec<Vec<f32>> =
                texts.iter().map(|t| embedded[t.as_str()].clone()).collect();
            let mut candidates = route::recall_route(
                &ctx,
                r,
                &vectors,
                lexical.next().unwrap_or_default(),
                &mut cache,
            )?;
            candidates.settle(&ctx, &mut cache, depth, eager)?;
            routes.push(candidates);
        }
        let route_ids: Vec<String> = plan.routes.iter().map(|r| r.route_id.clone()).collect();
        let mut stages = Vec::new();
        let mut dropped = Vec::new();
        let mut fusion_ms = 0.0;
        let selected = loop {
            // A record one route resolved is scored by every route that found it.
            for r in &mut routes {
                r.resolve_cached(&ctx, &mut cache)?;
            }
            let lists: Vec<(String, Vec<candidate::Scored>)> = route_ids
                .iter()
                .cloned()
                .zip(routes.iter().map(route::RouteCandidates::list))
                .collect();
            if req.trace {
                stages = candidate_stages(&lists);
            }
            let clock = std::time::Instant::now();
            if !cfg.fusion {
                let selected = fusion::raw_field_top_k(&lists, k);
                fusion_ms += clock.elapsed().as_secs_f64() * 1e3;
                break selected;
            }
            let fused = fusion::fuse(lists, k, cfg);
            let frontier = Frontier::new(&fused, &routes, &route_ids, k, cfg);
            let selection = fusion::select_explained(fused, &route_ids, k, plan.question_type, cfg);
            fusion_ms += clock.elapsed().as_secs_f64() * 1e3;
            if !eager && !frontier.settles(&selection, k) {
                // Selection read past what is resolved: resolve as many records again.
                let more = cache.resolved().max(1);
                for r in &mut routes {
                    r.resolve_more(&ctx, &mut cache, more)?;
                }
                continue;
            }
            if req.trace {
                let pool = selection
                    .pool_members()
                    .map(|f| stage_item(&f.candidate))
                    .collect();
                stages.push(Stage {
                    name: "pool".into(),
                    items: pool,
                });
                dropped = selection
                    .dropped
                    .into_iter()
                    .map(|(f, reason)| DroppedItem {
                        final_score: f.final_score,
                        target: f.candidate.target,
                        text: f.candidate.info.text,
                        reason,
                    })
                    .collect();
            }
            break selection.chosen;
        };
        timings.insert(
            "recall",
            routes.iter().map(|r| r.timings.recall_ms).sum::<f64>(),
        );
        timings.insert(
            "score",
            routes.iter().map(|r| r.timings.score_ms).sum::<f64>(),
        );
        let candidates = CandidateCounts {
            found: routes.iter().map(|r| r.found).sum(),
            resolved: cache.resolved(),
        };
        if req.trace {
            stages.push(Stage {
                name: "final".into(),
                items: selected
                    .iter()
                    .map(|s| stage_item(&s.fused.candidate))
                    .collect(),
            });
        }
        timings.insert("fusion", fusion_ms);
        let evidence = selected
            .into_iter()
            .map(|s| {
                let c = s.fused.candidate;
                let mut provenance = c.provenance.clone();
                provenance.routes.extend(s.fused.routes.iter().cloned());
                EvidenceItem {
                    evidence: Evidence {
                        target: c.target.clone(),
                        text: c.info.text.clone(),
                        best_route_score: s.fused.best,
                        rrf: s.fused.rrf,
                        final_score: s.fused.final_score,
                        mmr_score: s.mmr_score,
                        provenance,
                    },
                    session: c.info.session,
                    session_date: c.info.session_date,
                    memory_type: c.info.memory_type,
                    temporal: c.info.temporal,
                    entities: c.info.entities,
                    turns: c.info.turns,
                    dialogue: c.info.dialogue,
                    focus_turns: c.info.focus,
                }
            })
            .collect();
        Ok(SearchResult {
            plan,
            plan_fallback: outcome.fallback,
            evidence,
            usage: outcome.usage.into_iter().collect(),
            k,
            timings,
            stages,
            dropped,
            context: Vec::new(),
            candidates,
        })
    }
}
