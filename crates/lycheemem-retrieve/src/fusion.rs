//! Fusion across routes and the final selection (docs/algorithm.md, "Read path: selection"), as
//! pure functions over scored candidates:
//!
//! 1. [`fuse`]: reciprocal-rank fusion `Σ 1/(κ + rank)` over each route's top
//!    `max(4k, 4·quota)`; `final = 0.82·best_route_score + 0.18·rrf/max_rrf`.
//! 2. [`select`]: the route quota `max(1, min(4, k / routes))` is filled route by route, then the
//!    rest by score — both greedily by MMR `0.75·final − 0.25·max_sim` over a pool larger than
//!    k, so a near-duplicate loses to a diverse item — while the raw-turn limiter admits at most
//!    `max(2, round(0.40·k))` raw/window items scoring at least `max(0.35, 0.72·best record)`,
//!    except one that covers an otherwise uncovered route.
//! 3. [`raw_field_top_k`]: the `no_fusion` ablation — raw field scores, top k.

use lycheemem_core::config::RetrievalConfig;
use lycheemem_core::{CandidateTarget, QuestionType, estimate_tokens};
use std::collections::{BTreeSet, HashMap};

use crate::candidate::Scored;
use crate::similarity::{Signature, similarity};

/// A candidate after fusion.
#[derive(Debug, Clone, PartialEq)]
pub struct Fused {
    /// The candidate as scored by its best route, with provenance merged over all routes.
    pub candidate: Scored,
    pub best: f32,
    pub rrf: f32,
    pub final_score: f32,
    /// Routes whose lists contain the candidate.
    pub routes: BTreeSet<String>,
}

/// A selected candidate with the MMR objective it was chosen with.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    pub fused: Fused,
    pub mmr_score: f32,
}

/// The route quota for `routes` routes and final size `k`.
pub fn route_quota(k: usize, routes: usize, cfg: &RetrievalConfig) -> usize {
    (k / routes.max(1)).min(cfg.quota_cap).max(1)
}

/// How deep into each route's list RRF counts ranks: `max(rrf_depth_factor·k, 4·quota)`.
pub fn rrf_depth(k: usize, routes: usize, cfg: &RetrievalConfig) -> usize {
    (cfg.rrf_depth_factor * k).max(4 * route_quota(k, routes, cfg))
}

/// RRF over the routes' ranked lists (each sorted here by route score, best first). Takes the
/// lists by value: candidates move into the fused list (a large store's routes hand over
/// thousands).
pub fn fuse(routes: Vec<(String, Vec<Scored>)>, k: usize, cfg: &RetrievalConfig) -> Vec<Fused> {
    let depth = rrf_depth(k, routes.len(), cfg);
    // Fused entries in first-seen order, and where each target's entry is.
    let mut fused: Vec<Fused> = Vec::new();
    let mut at: HashMap<CandidateTarget, usize> = HashMap::new();
    for (route_id, mut list) in routes {
        list.sort_by(|a, b| {
            b.route_score
                .total_cmp(&a.route_score)
                .then(a.target.cmp(&b.target))
        });
        for (rank, c) in list.into_iter().enumerate() {
            let contribution = if rank < depth {
                1.0 / (cfg.rrf_kappa as f32 + (rank + 1) as f32)
            } else {
                0.0
            };
            let i = match at.get(&c.target) {
                Some(&i) => {
                    let entry = &mut fused[i];
                    if c.route_score > entry.best {
                        let provenance = std::mem::take(&mut entry.candidate.provenance);
                        entry.best = c.route_score;
                        entry.candidate = c;
                        entry.candidate.provenance.merge(&provenance);
                    } else {
                        entry.candidate.provenance.merge(&c.provenance);
                    }
                    i
                }
                None => {
                    at.insert(c.target.clone(), fused.len());
                    fused.push(Fused {
                        best: c.route_score,
                        candidate: c,
                        rrf: 0.0,
                        final_score: 0.0,
                        routes: BTreeSet::new(),
                    });
                    fused.len() - 1
                }
            };
            let entry = &mut fused[i];
            entry.rrf += contribution;
            if !entry.routes.contains(&route_id) {
                entry.routes.insert(route_id.clone());
            }
        }
    }
    let max_rrf = fused
        .iter()
        .map(|f| f.rrf)
        .fold(0.0f32, f32::max)
        .max(f32::MIN_POSITIVE);
    let mut out: Vec<Fused> = fused
        .into_iter()
        .map(|mut f| {
            f.final_score = cfg.fusion_best_weight as f32 * f.best
                + cfg.fusion_rrf_weight as f32 * f.rrf / max_rrf;
            f
        })
        .collect();
    out.sort_by(|a, b| {
        b.final_score
            .total_cmp(&a.final_score)
            .then(a.candidate.target.cmp(&b.candidate.target))
    });
    out
}

/// `(budget, ratio)` of the raw-turn count limiter for a question type.
fn limiter(qt: QuestionType, k: usize, cfg: &RetrievalConfig) -> (usize, f32) {
    let (ratio, score_ratio) = if cfg.per_type_limiter {
        let p = cfg.types.get(qt);
        (p.raw_ratio, p.raw_score_ratio)
    } else {
        (cfg.raw_ratio, cfg.raw_score_ratio)
    };
    let budget = cfg.raw_min.max((k as f64 * ratio).round() as usize);
    (budget, score_ratio as f32)
}

/// The candidates selection chooses from: the best `mmr_pool_factor·k` by final score, plus
/// each route's best `quota` so quotas can be met. Returns indices into `fused` (sorted).
pub fn pool_indices(
    fused: &[Fused],
    route_ids: &[String],
    k: usize,
    cfg: &RetrievalConfig,
) -> Vec<usize> {
    let quota = route_quota(k, route_ids.len(), cfg);
    let pool_size = (cfg.mmr_pool_factor * k).max(k);
    let mut in_pool = vec![false; fused.len()];
    for flag in in_pool.iter_mut().take(pool_size) {
        *flag = true;
    }
    for route in route_ids {
        for (i, _) in fused
            .iter()
            .enumerate()
            .filter(|(_, f)| f.routes.contains(route))
            .take(quota)
        {
            in_pool[i] = true;
        }
    }
    (0..fused.len()).filter(|&i| in_pool[i]).collect()
}

/// Why a candidate of the pool was not chosen (for `explain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Below the pool cut (`mmr_pool_factor·k` by final score) and never needed for a refill.
    BelowPool,
    /// Every turn it shows is already shown by a chosen raw-turn or window item.
    Covered,
    /// It did not fit in what was left of `evidence_token_budget`.
    TokenBudget,
    /// The raw-turn count limiter (`raw_count_limiter`) refused it.
    RawLimiter,
    /// Other items won the k seats on the MMR objective.
    Outscored,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::BelowPool => "below the pool cut",
            DropReason::Covered => "its turns were already shown",
            DropReason::TokenBudget => "over the evidence token budget",
            DropReason::RawLimiter => "raw-turn limiter",
            DropReason::Outscored => "outscored on relevance minus redundancy",
        }
    }
}

/// The outcome of selection: the chosen items in pick order, and every fused candidate that was
/// not chosen with the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub chosen: Vec<Selected>,
    pub dropped: Vec<(Fused, DropReason)>,
    /// How many fused candidates were in the pool when selection ended (after any refills).
    pub pool_size: usize,
}

impl Selection {
    /// The candidates that were in the pool when selection ended: the chosen ones and those
    /// dropped for any reason but [`DropReason::BelowPool`].
    pub fn pool_members(&self) -> impl Iterator<Item = &Fused> {
        self.chosen.iter().map(|s| &s.fused).chain(
            self.dropped
                .iter()
                .filter(|(_, r)| *r != DropReason::BelowPool)
                .map(|(f, _)| f),
        )
    }
}

/// A window's or raw turn's turns as (session, index) pairs (empty for records).
fn shown_turns(f: &Fused) -> Vec<(String, u32)> {
    if !f.candidate.is_raw() {
        return Vec::new();
    }
    f.candidate
        .info
        .turns
        .iter()
        .map(|t| (f.candidate.info.session.clone(), *t))
        .collect()
}

/// Whether a raw item's turns (non-empty) all lie inside another item's: the window replaces it.
fn shown_inside(inner: &[(String, u32)], outer: &[(String, u32)]) -> bool {
    !inner.is_empty() && inner.iter().all(|t| outer.contains(t))
}

/// Chooses `k` candidates: route quotas first, then the best of the rest, each pick by MMR
/// (`mmr_relevance·relevance − mmr_redundancy·max_sim`) over a pool of `mmr_pool_factor·k`,
/// refilled from the rest of the fused list when it runs dry before k items are chosen.
///
/// Relevance is the final score, min-max normalized within the pool when
/// `mmr_normalize_relevance` is on, so the MMR weights trade the same amounts of relevance and
/// redundancy whether or not a cross-encoder spread the scores. A raw-turn or window item whose
/// turns are all shown already is skipped; a window chosen after raw turns it contains replaces
/// them (their seats and tokens are freed). With `evidence_token_budget` > 0, an item whose text
/// would take the chosen evidence past the budget is skipped (the first item always fits). The
/// published count limiter for raw items (`raw_count_limiter`) is optional.
pub fn select(
    fused: Vec<Fused>,
    route_ids: &[String],
    k: usize,
    qt: QuestionType,
    cfg: &RetrievalConfig,
) -> Vec<Selected> {
    select_explained(fused, route_ids, k, qt, cfg).chosen
}

/// [`select`], also returning what was dropped and why.
pub fn select_explained(
    fused: Vec<Fused>,
    route_ids: &[String],
    k: usize,
    qt: QuestionType,
    cfg: &RetrievalConfig,
) -> Selection {
    let quota = route_quota(k, route_ids.len(), cfg);
    let refill_step = (cfg.mmr_pool_factor * k).max(k).max(1);
    let mut s = Selector::new(&fused, route_ids, k, qt, cfg);
    loop {
        let pass = s.pass();
        // Route quotas, route by route (first pass only: they count what is already chosen).
        if s.chosen.is_empty() {
            for route in route_ids {
                for _ in 0..quota {
                    if s.chosen.len() >= k || !s.pick(Some(route), &pass) {
                        break;
                    }
                }
            }
        }
        // Then the rest.
        while s.chosen.len() < k && s.pick(None, &pass) {}
        if s.chosen.len() >= k || !s.refill(refill_step) {
            break;
        }
    }
    let Selector {
        chosen,
        mmr_scores,
        reasons,
        in_pool,
        ..
    } = s;
    let pool_size = in_pool.iter().filter(|&&p| p).count();
    let chosen_set: BTreeSet<usize> = chosen.iter().copied().collect();
    let mut dropped: Vec<(Fused, DropReason)> = Vec::new();
    let mut picked: Vec<Option<Selected>> = vec![None; fused.len()];
    for (i, f) in fused.into_iter().enumerate() {
        if chosen_set.contains(&i) {
            let at = chosen.iter().position(|&c| c == i).unwrap_or(0);
            picked[i] = Some(Selected {
                fused: f,
                mmr_score: mmr_scores[at],
            });
        } else {
            let reason = if !in_pool[i] {
                DropReason::BelowPool
            } else {
                reasons.get(&i).copied().unwrap_or(DropReason::Outscored)
            };
            dropped.push((f, reason));
        }
    }
    Selection {
        chosen: chosen.iter().filter_map(|&i| picked[i].take()).collect(),
        dropped,
        pool_size,
    }
}

/// The state of one selection: the candidates with what selection needs to know of each, the
/// pool, and what has been chosen or dropped so far.
struct Selector<'a> {
    fused: &'a [Fused],
    cfg: &'a RetrievalConfig,
    /// Filled when a candidate joins the pool ([`Selector::admit`]): only pool members are
    /// compared, and a large fused list leaves most candidates below the pool.
    signatures: Vec<Option<Signature>>,
    /// Estimated tokens: every raw item's (the budget's turn floor reads them) and every pool
    /// member's; 0 for the others until they join the pool.
    tokens: Vec<usize>,
    turns: Vec<Vec<(String, u32)>>,
    in_pool: Vec<bool>,
    chosen: Vec<usize>,
    /// Parallel to `chosen`.
    mmr_scores: Vec<f32>,
    reasons: HashMap<usize, DropReason>,
    /// Raw turns a window chosen later replaced.
    replaced: BTreeSet<usize>,
    /// Each candidate's similarity to its nearest chosen item.
    max_sim: Vec<f64>,
    raw_budget: usize,
    score_ratio: f32,
    /// The evidence token budget in force (0 = none): [`token_budget`].
    token_budget: usize,
}

/// The evidence token budget for one selection: `evidence_token_budget`, raised to k raw-turn
/// items (a hit with its `raw_turn_context_before` / `_after` turns) of the median turn length
/// among the raw candidates when `evidence_budget_turn_floor` is on (a window counts its tokens
/// per turn). 0 means no budget.
fn token_budget(
    tokens: &[usize],
    turns: &[Vec<(String, u32)>],
    k: usize,
    cfg: &RetrievalConfig,
) -> usize {
    if cfg.evidence_token_budget == 0 {
        return 0;
    }
    if !cfg.evidence_budget_turn_floor {
        return cfg.evidence_token_budget;
    }
    let mut per_turn: Vec<usize> = tokens
        .iter()
        .zip(turns)
        .filter(|(_, t)| !t.is_empty())
        .map(|(&n, t)| n / t.len())
        .collect();
    if per_turn.is_empty() {
        return cfg.evidence_token_budget;
    }
    per_turn.sort_unstable();
    let median = per_turn[per_turn.len() / 2];
    let item_turns = 1 + cfg.raw_turn_context_before as usize + cfg.raw_turn_context_after as usize;
    cfg.evidence_token_budget
        .max(k.saturating_mul(item_turns).saturating_mul(median))
}

/// What the chosen items hold when a pick starts: the turns they show, how many are raw, the
/// routes they cover, their tokens.
struct Chosen<'a> {
    shown: BTreeSet<&'a (String, u32)>,
    raw_count: usize,
    covered: BTreeSet<&'a String>,
    spent: usize,
}

/// What the picks of one pass over the pool hold fixed: the pool, its relevance scale and the
/// raw-score floor of the count limiter.
struct Pass {
    pool: Vec<usize>,
    lo: f32,
    hi: f32,
    raw_floor: f32,
}

impl<'a> Selector<'a> {
    fn new(
        fused: &'a [Fused],
        route_ids: &[String],
        k: usize,
        qt: QuestionType,
        cfg: &'a RetrievalConfig,
    ) -> Self {
        let (raw_budget, score_ratio) = limiter(qt, k, cfg);
        let tokens: Vec<usize> = fused
            .iter()
            .map(|f| {
                if f.candidate.is_raw() {
                    estimate_tokens(&f.candidate.info.text) as usize
                } else {
                    0
                }
            })
            .collect();
        let turns: Vec<Vec<(String, u32)>> = fused.iter().map(shown_turns).collect();
        let token_budget = token_budget(&tokens, &turns, k, cfg);
        let mut s = Selector {
            fused,
            cfg,
            signatures: vec![None; fused.len()],
            tokens,
            turns,
            token_budget,
            in_pool: vec![false; fused.len()],
            chosen: Vec::new(),
            mmr_scores: Vec::new(),
            reasons: HashMap::new(),
            replaced: BTreeSet::new(),
            max_sim: vec![0f64; fused.len()],
            raw_budget,
            score_ratio,
        };
        for i in pool_indices(fused, route_ids, k, cfg) {
            s.admit(i);
        }
        s
    }

    /// Candidate `i` joins the pool, with what comparing and budgeting it needs.
    fn admit(&mut self, i: usize) {
        let c = &self.fused[i].candidate;
        self.in_pool[i] = true;
        self.signatures[i] = Some(Signature::of(c));
        if !c.is_raw() {
            self.tokens[i] = estimate_tokens(&c.info.text) as usize;
        }
    }

    /// The similarity of two pool members (0 if either has not joined: never the case).
    fn pool_similarity(&self, a: usize, b: usize) -> f64 {
        match (&self.signatures[a], &self.signatures[b]) {
            (Some(x), Some(y)) => similarity(x, y, &self.cfg.similarity),
            _ => 0.0,
        }
    }

    /// The pool as it stands, with relevance on one scale within it.
    fn pass(&self) -> Pass {
        let fused = self.fused;
        let pool: Vec<usize> = (0..fused.len()).filter(|&i| self.in_pool[i]).collect();
        let (lo, hi) = pool
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &i| {
                (lo.min(fused[i].final_score), hi.max(fused[i].final_score))
            });
        let best_record = pool
            .iter()
            .filter(|&&i| !fused[i].candidate.is_raw())
            .map(|&i| fused[i].final_score)
            .fold(0.0f32, f32::max);
        let raw_floor = (self.cfg.raw_score_floor as f32).max(self.score_ratio * best_record);
        Pass {
            pool,
            lo,
            hi,
            raw_floor,
        }
    }

    fn relevance(&self, i: usize, pass: &Pass) -> f64 {
        let f = self.fused[i].final_score;
        if !self.cfg.mmr_normalize_relevance {
            f64::from(f)
        } else if pass.hi > pass.lo {
            f64::from((f - pass.lo) / (pass.hi - pass.lo))
        } else {
            1.0
        }
    }

    /// What the chosen items already hold, for [`Selector::refusal`] (computed once per pick).
    fn chosen_summary(&self) -> Chosen<'_> {
        let fused = self.fused;
        Chosen {
            shown: self.chosen.iter().flat_map(|&c| &self.turns[c]).collect(),
            raw_count: self
                .chosen
                .iter()
                .filter(|&&c| fused[c].candidate.is_raw())
                .count(),
            covered: self.chosen.iter().flat_map(|&c| &fused[c].routes).collect(),
            spent: self.chosen.iter().map(|&c| self.tokens[c]).sum(),
        }
    }

    /// Why candidate `i` cannot be chosen now, if it cannot: its turns are all shown, the count
    /// limiter, or the token budget.
    fn refusal(&self, i: usize, pass: &Pass, held: &Chosen) -> Option<DropReason> {
        let (fused, cfg, chosen) = (self.fused, self.cfg, &self.chosen);
        let f = &fused[i];
        if f.candidate.is_raw() {
            if self.turns[i].iter().all(|t| held.shown.contains(t)) && !self.turns[i].is_empty() {
                return Some(DropReason::Covered);
            }
            if cfg.raw_count_limiter {
                let covers_new_route = f.routes.iter().any(|r| !held.covered.contains(r));
                if !((held.raw_count < self.raw_budget && f.final_score >= pass.raw_floor)
                    || covers_new_route)
                {
                    return Some(DropReason::RawLimiter);
                }
            }
        }
        if self.token_budget > 0 && !chosen.is_empty() {
            // A window frees the tokens of the chosen raw turns it contains.
            let freed: usize = chosen
                .iter()
                .filter(|&&c| f.candidate.is_raw() && shown_inside(&self.turns[c], &self.turns[i]))
                .map(|&c| self.tokens[c])
                .sum();
            if held.spent - freed + self.tokens[i] > self.token_budget {
                return Some(DropReason::TokenBudget);
            }
        }
        None
    }

    /// Picks the best admissible item of the pass's pool (restricted to a route when given);
    /// false when none is admissible.
    fn pick(&mut self, only_route: Option<&String>, pass: &Pass) -> bool {
        let mut best: Option<(usize, f64)> = None;
        let mut refused: Vec<(usize, DropReason)> = Vec::new();
        let held = self.chosen_summary();
        for &i in &pass.pool {
            if self.chosen.contains(&i)
                || self.replaced.contains(&i)
                || only_route.is_some_and(|r| !self.fused[i].routes.contains(r))
            {
                continue;
            }
            if let Some(reason) = self.refusal(i, pass, &held) {
                refused.push((i, reason));
                continue;
            }
            let score = if self.cfg.mmr {
                self.cfg.mmr_relevance * self.relevance(i, pass)
                    - self.cfg.mmr_redundancy * self.max_sim[i]
            } else {
                self.relevance(i, pass)
            };
            if best.is_none_or(|(_, b)| score > b) {
                best = Some((i, score));
            }
        }
        drop(held);
        self.reasons.extend(refused);
        let Some((i, score)) = best else {
            return false;
        };
        self.choose(i, score, &pass.pool);
        true
    }

    /// Adds item `i` (a window replacing the chosen raw turns it contains) and updates the
    /// pool's similarity to the nearest chosen item.
    fn choose(&mut self, i: usize, score: f64, pool: &[usize]) {
        if self.fused[i].candidate.is_raw() {
            let inside: Vec<usize> = self
                .chosen
                .iter()
                .copied()
                .filter(|&c| c != i && shown_inside(&self.turns[c], &self.turns[i]))
                .collect();
            for c in inside {
                let at = self.chosen.iter().position(|&x| x == c).unwrap_or(0);
                self.chosen.remove(at);
                self.mmr_scores.remove(at);
                self.replaced.insert(c);
                self.reasons.insert(c, DropReason::Covered);
            }
        }
        self.chosen.push(i);
        self.mmr_scores.push(score as f32);
        self.reasons.remove(&i);
        if self.cfg.mmr {
            for &j in pool {
                let sim = self.pool_similarity(j, i);
                self.max_sim[j] = self.max_sim[j].max(sim);
            }
        }
    }

    /// The next `step` candidates by final score join the pool; false when none is left.
    fn refill(&mut self, step: usize) -> bool {
        let outside: Vec<usize> = (0..self.fused.len())
            .filter(|&i| !self.in_pool[i])
            .take(step)
            .collect();
        if outside.is_empty() {
            return false;
        }
        for i in outside {
            self.admit(i);
            if self.cfg.mmr {
                for &c in &self.chosen {
                    let sim = self.pool_similarity(i, c);
                    self.max_sim[i] = self.max_sim[i].max(sim);
                }
            }
        }
        true
    }
}

/// The `no_fusion` ablation: every route's candidates by their raw field score, top `k`.
pub fn raw_field_top_k(routes: &[(String, Vec<Scored>)], k: usize) -> Vec<Selected> {
    let mut by_target: HashMap<CandidateTarget, (Scored, BTreeSet<String>)> = HashMap::new();
    for (route_id, list) in routes {
        for c in list {
            let e = by_target
                .entry(c.target.clone())
                .or_insert_with(|| (c.clone(), BTreeSet::new()));
            e.0.absorb(c);
            e.1.insert(route_id.clone());
        }
    }
    let mut all: Vec<(Scored, BTreeSet<String>)> = by_target.into_values().collect();
    all.sort_by(|a, b| {
        b.0.field
            .total_cmp(&a.0.field)
            .then(a.0.target.cmp(&b.0.target))
    });
    all.into_iter()
        .take(k)
        .map(|(c, routes)| Selected {
            mmr_score: c.field,
            fused: Fused {
                best: c.field,
                rrf: 0.0,
                final_score: c.field,
                candidate: c,
                routes,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_core::{Channel, SessionId, TurnRef};

    fn record(id: &str, score: f32, text: &str, session: &str) -> Scored {
        let mut c = Scored::new(CandidateTarget::Record {
            record_id: id.into(),
        });
        c.route_score = score;
        c.field = score;
        c.info.text = text.into();
        c.info.session = session.into();
        c.provenance.channels.insert(Channel::Record);
        c
    }

    fn raw(index: u32, score: f32, text: &str) -> Scored {
        let mut c = Scored::new(CandidateTarget::Turns {
            first: TurnRef {
                session: SessionId::new("s9").unwrap(),
                index,
            },
            last_index: index,
        });
        c.route_score = score;
        c.field = score;
        c.info.text = text.into();
        c.info.session = "s9".into();
        c.info.turns = vec![index];
        c
    }

    fn cfg() -> RetrievalConfig {
        RetrievalConfig::default()
    }

    #[test]
    fn rrf_and_final_score_arithmetic() {
        let a = record("a", 0.9, "alpha", "s1");
        let b = record("b", 0.5, "beta", "s1");
        let routes = vec![
            ("r1".to_string(), vec![a.clone(), b.clone()]),
            ("r2".to_string(), vec![b.clone()]),
        ];
        let fused = fuse(routes.clone(), 15, &cfg());
        let get = |id: &str| {
            fused
                .iter()
                .find(|f| {
                    f.candidate.target
                        == CandidateTarget::Record {
                            record_id: id.into(),
                        }
                })
                .unwrap()
        };
        // a: rank 1 in r1 → 1/61. b: rank 2 in r1 and rank 1 in r2 → 1/62 + 1/61.
        assert!((get("a").rrf - 1.0 / 61.0).abs() < 1e-7);
        assert!((get("b").rrf - (1.0 / 62.0 + 1.0 / 61.0)).abs() < 1e-7);
        let max_rrf = get("b").rrf;
        assert!((get("a").final_score - (0.82 * 0.9 + 0.18 * (1.0 / 61.0) / max_rrf)).abs() < 1e-6);
        assert!((get("b").final_score - (0.82 * 0.5 + 0.18)).abs() < 1e-6);
        assert_eq!(get("b").routes.len(), 2);
    }

    #[test]
    fn quota_gives_every_route_a_seat() {
        assert_eq!(route_quota(15, 1, &cfg()), 4);
        assert_eq!(route_quota(15, 4, &cfg()), 3);
        assert_eq!(route_quota(15, 20, &cfg()), 1);
        // Route r2's only candidate scores far below r1's, yet it is selected.
        let r1: Vec<Scored> = (0..10)
            .map(|i| {
                record(
                    &format!("a{i}"),
                    0.9 - i as f32 * 0.01,
                    &format!("topic {i} words{i}"),
                    "s1",
                )
            })
            .collect();
        let r2 = vec![record("lonely", 0.1, "something else entirely", "s2")];
        let routes = vec![("r1".to_string(), r1), ("r2".to_string(), r2)];
        let ids = vec!["r1".to_string(), "r2".to_string()];
        let picked = select(
            fuse(routes.clone(), 4, &cfg()),
            &ids,
            4,
            QuestionType::Single,
            &cfg(),
        );
        assert_eq!(picked.len(), 4);
        assert!(picked.iter().any(|s| s.fused.candidate.target
            == CandidateTarget::Record {
                record_id: "lonely".into()
            }));
    }

    #[test]
    fn mmr_prefers_a_diverse_item_over_a_near_duplicate() {
        let a = record("a", 0.80, "Caroline adopted a dog named Rex in May", "s1");
        let dup = record("dup", 0.79, "Caroline adopted a dog named Rex in May", "s1");
        let other = record(
            "other",
            0.70,
            "Melanie painted a sunrise over the lake",
            "s2",
        );
        let routes = vec![("r1".to_string(), vec![a, dup, other])];
        let ids = vec!["r1".to_string()];
        // On the SPEC's raw score scale (with a pool this small, normalizing would put `other`
        // at relevance 0).
        let mut spec = cfg();
        spec.mmr_normalize_relevance = false;
        let picked = select(
            fuse(routes.clone(), 2, &spec),
            &ids,
            2,
            QuestionType::Single,
            &spec,
        );
        let names: Vec<String> = picked
            .iter()
            .map(|s| match &s.fused.candidate.target {
                CandidateTarget::Record { record_id } => record_id.clone(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(names, vec!["a", "other"]);
        // Without MMR the duplicate wins the second seat.
        let mut no_mmr = spec.clone();
        no_mmr.mmr = false;
        let routes = vec![(
            "r1".to_string(),
            vec![
                record("a", 0.80, "x y", "s1"),
                record("dup", 0.79, "x y", "s1"),
                record("other", 0.70, "z w", "s2"),
            ],
        )];
        let picked = select(
            fuse(routes.clone(), 2, &no_mmr),
            &ids,
            2,
            QuestionType::Single,
            &no_mmr,
        );
        assert!(
            matches!(&picked[1].fused.candidate.target, CandidateTarget::Record { record_id } if record_id == "dup")
        );
    }

    fn window(first: u32, last: u32, score: f32, words: usize) -> Scored {
        let mut c = raw(first, score, "");
        c.target = CandidateTarget::Turns {
            first: TurnRef {
                session: SessionId::new("s9").unwrap(),
                index: first,
            },
            last_index: last,
        };
        c.info.turns = (first..=last).collect();
        c.info.text = (first..=last)
            .map(|i| format!("A: turn{i} {}", vec!["word"; words].join(" ")))
            .collect::<Vec<_>>()
            .join("\n");
        c
    }

    fn ids(picked: &[Selected]) -> Vec<String> {
        picked
            .iter()
            .map(|s| match &s.fused.candidate.target {
                CandidateTarget::Record { record_id } => record_id.clone(),
                CandidateTarget::Turns { first, last_index } => {
                    format!("{}-{last_index}", first.index)
                }
            })
            .collect()
    }

    #[test]
    fn the_token_budget_skips_what_does_not_fit_and_the_pool_is_refilled_to_k() {
        let mut cfg = cfg();
        cfg.mmr_pool_factor = 1;
        cfg.evidence_token_budget = 250;
        // Three long windows on top, then short records, most below the pool cut of k = 4.
        let mut list: Vec<Scored> = (0..3)
            .map(|i| window(i * 10, i * 10 + 4, 0.9 - i as f32 * 0.01, 30))
            .collect();
        list.extend((0..8).map(|i| {
            record(
                &format!("rec{i}"),
                0.5 - i as f32 * 0.01,
                &format!("fact {i} about thing{i}"),
                &format!("s{i}"),
            )
        }));
        let tokens = |s: &Selected| estimate_tokens(&s.fused.candidate.info.text) as usize;
        assert!(
            estimate_tokens(&list[0].info.text) > 125,
            "two windows exceed the budget"
        );
        let routes = vec![("r1".to_string(), list)];
        let route_ids = vec!["r1".to_string()];
        let selection = select_explained(
            fuse(routes.clone(), 4, &cfg),
            &route_ids,
            4,
            QuestionType::Single,
            &cfg,
        );
        let picked = &selection.chosen;
        assert_eq!(picked.len(), 4, "{:?}", ids(picked));
        assert_eq!(
            picked.iter().filter(|s| s.fused.candidate.is_raw()).count(),
            1
        );
        assert!(picked.iter().map(tokens).sum::<usize>() <= 250);
        assert!(
            selection
                .dropped
                .iter()
                .any(|(f, r)| f.candidate.is_raw() && *r == DropReason::TokenBudget)
        );
        // Without refill the pool (4 items) would have given 2.
        assert!(selection.pool_size > 4);
    }

    #[test]
    fn the_token_budget_holds_at_least_k_raw_turns_of_the_median_length() {
        // Six long single turns (~200 tokens each, as in memories of long assistant answers) and
        // a 250-token budget: the budget alone would admit one of them.
        let list: Vec<Scored> = (0..6)
            .map(|i| {
                raw(
                    i * 3,
                    0.9 - i as f32 * 0.01,
                    &format!("A: turn{i} {}", vec!["word"; 200].join(" ")),
                )
            })
            .collect();
        let per_turn = estimate_tokens(&list[0].info.text) as usize;
        assert!(per_turn >= 200);
        let routes = vec![("r1".to_string(), list)];
        let route_ids = vec!["r1".to_string()];
        let run = |floor: bool| {
            let mut cfg = cfg();
            cfg.raw_turn_context_after = 0;
            cfg.evidence_token_budget = 250;
            cfg.evidence_budget_turn_floor = floor;
            select(
                fuse(routes.clone(), 4, &cfg),
                &route_ids,
                4,
                QuestionType::Single,
                &cfg,
            )
        };
        assert_eq!(run(false).len(), 1);
        let picked = run(true);
        assert_eq!(picked.len(), 4, "{:?}", ids(&picked));
        // k × the median is the budget: a fifth turn would not have fitted either.
        let spent: usize = picked
            .iter()
            .map(|s| estimate_tokens(&s.fused.candidate.info.text) as usize)
            .sum();
        assert!(spent <= 4 * per_turn);
        // Short turns leave the configured budget as it is.
        let tokens = vec![10, 12, 30];
        let turns: Vec<Vec<(String, u32)>> = (0..3).map(|i| vec![("s".to_string(), i)]).collect();
        let mut cfg = cfg();
        cfg.raw_turn_context_after = 0;
        cfg.evidence_token_budget = 250;
        assert_eq!(token_budget(&tokens, &turns, 4, &cfg), 250);
        // A window counts its tokens per turn; records do not count.
        let tokens = vec![400, 90, 5];
        let turns = vec![
            (0..4).map(|i| ("s".to_string(), i)).collect(),
            vec![("s".to_string(), 9)],
            Vec::new(),
        ];
        assert_eq!(token_budget(&tokens, &turns, 4, &cfg), 400);
        // A raw-turn item that shows a context turn holds two turns: k of them fit.
        cfg.raw_turn_context_after = 1;
        assert_eq!(token_budget(&tokens, &turns, 4, &cfg), 800);
        cfg.evidence_token_budget = 0;
        assert_eq!(token_budget(&tokens, &turns, 4, &cfg), 0);
    }

    #[test]
    fn a_window_replaces_the_raw_turns_it_contains_and_covered_turns_are_skipped() {
        let mut cfg = cfg();
        cfg.evidence_token_budget = 0;
        // A strong lexical hit on turn 5, then the window 3–7 around it, then turn 6 alone.
        let hit = raw(5, 0.95, "A: turn5 word");
        let win = window(3, 7, 0.94, 1);
        let inside = raw(6, 0.93, "A: turn6 word");
        let others: Vec<Scored> = (0..4)
            .map(|i| {
                record(
                    &format!("rec{i}"),
                    0.5 - i as f32 * 0.01,
                    &format!("fact{i}"),
                    &format!("s{i}"),
                )
            })
            .collect();
        let mut list = vec![hit, win, inside];
        list.extend(others);
        let routes = vec![("r1".to_string(), list)];
        let route_ids = vec!["r1".to_string()];
        let mut no_mmr = cfg.clone();
        no_mmr.mmr = false;
        let selection = select_explained(
            fuse(routes.clone(), 3, &no_mmr),
            &route_ids,
            3,
            QuestionType::Single,
            &no_mmr,
        );
        let got = ids(&selection.chosen);
        assert_eq!(got, vec!["3-7", "rec0", "rec1"], "{got:?}");
        let reason = |id: &str| {
            selection
                .dropped
                .iter()
                .find(|(f, _)| {
                    ids(&[Selected {
                        fused: f.clone(),
                        mmr_score: 0.0,
                    }])[0]
                        == id
                })
                .map(|(_, r)| *r)
        };
        assert_eq!(reason("5-5"), Some(DropReason::Covered));
        assert_eq!(reason("6-6"), Some(DropReason::Covered));
    }

    #[test]
    fn relevance_is_normalized_within_the_pool_before_mmr() {
        // b is a near-copy of a but clearly more relevant than c; without a cross-encoder the
        // final scores are close, so on raw scores the redundancy term alone would pick c.
        let mut a = record("a", 0.80, "Caroline adopted a dog named Rex in May", "s1");
        let mut b = record("b", 0.78, "Caroline adopted a dog named Rex in May", "s1");
        for x in [&mut a, &mut b] {
            x.info.entities = vec!["Caroline".into(), "Rex".into()];
        }
        let c = record("c", 0.60, "Melanie painted a sunrise over the lake", "s2");
        let d = record("d", 0.59, "John went hiking in the mountains", "s3");
        let routes = vec![("r1".to_string(), vec![a, b, c, d])];
        let route_ids = vec!["r1".to_string()];
        let mut raw_scale = cfg();
        raw_scale.mmr_normalize_relevance = false;
        let picked = select(
            fuse(routes.clone(), 2, &raw_scale),
            &route_ids,
            2,
            QuestionType::Single,
            &raw_scale,
        );
        assert_eq!(ids(&picked), vec!["a", "c"]);
        let picked = select(
            fuse(routes.clone(), 2, &cfg()),
            &route_ids,
            2,
            QuestionType::Single,
            &cfg(),
        );
        assert_eq!(ids(&picked), vec!["a", "b"]);
    }

    #[test]
    fn limiter_caps_raw_turns_but_keeps_one_covering_an_uncovered_route() {
        // k = 5: raw budget max(2, round(2.0)) = 2; floor max(0.35, 0.72·best record).
        let mut r1: Vec<Scored> = (0..6)
            .map(|i| {
                raw(
                    i,
                    0.95 - i as f32 * 0.01,
                    &format!("raw turn number {i} about things{i}"),
                )
            })
            .collect();
        r1.extend((0..6).map(|i| {
            record(
                &format!("rec{i}"),
                0.6 - i as f32 * 0.01,
                &format!("record {i} facts{i}"),
                "s1",
            )
        }));
        let r2 = vec![raw(
            40,
            0.2,
            "a low scoring raw turn that alone answers route two",
        )];
        let routes = vec![("r1".to_string(), r1), ("r2".to_string(), r2)];
        let ids = vec!["r1".to_string(), "r2".to_string()];
        let mut spec = cfg();
        spec.use_spec_selection();
        let picked = select(
            fuse(routes.clone(), 5, &spec),
            &ids,
            5,
            QuestionType::Single,
            &spec,
        );
        let raws: Vec<&Selected> = picked
            .iter()
            .filter(|s| s.fused.candidate.is_raw())
            .collect();
        assert!(
            raws.iter().any(|s| s.fused.routes.contains("r2")),
            "the only r2 item is kept"
        );
        assert!(
            raws.len() <= 3,
            "two within budget plus the route-covering one"
        );
        assert_eq!(picked.len(), 5);
    }

    #[test]
    fn no_fusion_sorts_by_raw_field_score() {
        let routes = vec![
            (
                "r1".to_string(),
                vec![record("a", 0.3, "a", "s"), record("b", 0.6, "b", "s")],
            ),
            ("r2".to_string(), vec![record("a", 0.9, "a", "s")]),
        ];
        let picked = raw_field_top_k(&routes, 1);
        assert_eq!(picked.len(), 1);
        assert_eq!(picked[0].fused.final_score, 0.9);
        assert_eq!(picked[0].fused.routes.len(), 2);
    }
}
