//! Executing one route (docs/algorithm.md, "Routes and channels" and "Route scoring"): query
//! variants, the channels, scoring and the route-local final score.
//!
//! Channels and their field scores (a candidate hit several times keeps its maximum):
//! * temporal — temporal nodes overlapping the route's [since, until] → their records; field =
//!   .42 for `day:` nodes, .28 for `month:` nodes;
//! * evidence nodes — ANN per variant over entity / topic / entity_topic / event_frame nodes,
//!   expanded to their records; field = node weight + `record_scale·r` where r is the record's
//!   own similarity to the variant (the SPEC gives the node weights but not how they combine
//!   with similarity; we use them as the base in place of the record channel's 0.30);
//! * records — ANN per variant over record vectors; field = `0.30 + 0.30·r`;
//! * raw turns — ANN per variant over turn vectors; field = `(0.34 + 0.42·r)·raw_mult + role
//!   bonus`;
//! * lexical (lycheemem's addition, switchable) — BM25 per variant over records and turns;
//!   field = `0.30 + 0.30·bm25/max_bm25` (turns: times `raw_mult`).
//!
//! Then type bonuses, the temporal boost (a boost, never a filter), source windows around the
//! best anchors (a window absorbs raw-turn hits inside it; off with the raw-turn channel), the optional cross-encoder rerank
//! of the top of the pool, and `route_score = (rerank or field) + 0.03·r + min(0.03,
//! 0.01·#matched variants)`.

use lycheemem_core::config::{RetrievalConfig, TypeProfile};
use lycheemem_core::date::parse_date;
use lycheemem_core::vector::cosine;
use lycheemem_core::{
    CandidateTarget, Channel, MemoryType, Namespace, NodeKind, QuestionType, Result, Role, Route,
    SessionId, SourceRole, TemporalFilter, TurnRef,
};
use lycheemem_embed::Reranker;
use lycheemem_store::rules::turn_search_text;
use lycheemem_store::{Hit, ItemRef, RetrievalStore, Target, VectorQuery};
use std::collections::{BTreeMap, HashMap};

use crate::candidate::{ItemInfo, Scored, r_of};

/// Everything a route needs besides the route itself.
pub struct RouteContext<'a> {
    pub store: &'a dyn RetrievalStore,
    pub ns: &'a Namespace,
    pub reranker: Option<&'a dyn Reranker>,
    pub cfg: &'a RetrievalConfig,
    pub question: &'a str,
    pub question_type: QuestionType,
    pub k: usize,
}

/// Query variants: dedup([question, goal, route queries])[:max_variants].
pub fn variants(question: &str, route: &Route, max: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for q in std::iter::once(question)
        .chain(std::iter::once(route.goal.as_str()))
        .chain(route.queries.iter().map(String::as_str))
    {
        let q = q.trim();
        if !q.is_empty() && !out.iter().any(|o| o.eq_ignore_ascii_case(q)) && out.len() < max {
            out.push(q.to_string());
        }
    }
    out
}

/// How many of a route's variants (see [`variants`]) are the question and the route's goal,
/// the ones relevance is measured against when the planner's queries only widen recall.
pub fn leading_variants(question: &str, route: &Route, variant_count: usize) -> usize {
    let (q, g) = (question.trim(), route.goal.trim());
    let lead =
        usize::from(!q.is_empty()) + usize::from(!g.is_empty() && !g.eq_ignore_ascii_case(q));
    lead.clamp(1, variant_count.max(1))
}

/// What recall found about one candidate, kept compact (a route's pool at 100k records holds
/// thousands, of which a few hundred are ever resolved): provenance becomes a [`Scored`]'s only
/// when the candidate is resolved ([`Found::into_scored`]).
struct Found {
    target: CandidateTarget,
    /// Best channel score over every hit (at least 0).
    field: f32,
    /// Best channel score from the leading variants and the variant-free channels (temporal);
    /// `None`: found by the route's queries only.
    lead_field: Option<f32>,
    /// Bit `i`: channel [`CHANNELS`]`[i]` hit it.
    channels: u8,
    /// Query variants that hit it, in the order they did.
    variants: Vec<usize>,
    /// Nodes that led to it (indices into the pool's `node_ids`).
    nodes: Vec<u32>,
    /// Its best cosine to each variant that found it by similarity (what bounds its
    /// similarity to the leading variants before it is resolved).
    cos: Vec<(usize, f32)>,
    /// Its best cosine to the leading variants, when a channel computed it from the record's
    /// own vector (the same cosine resolving it computes, so its similarity bound is exact).
    lead_cos: Option<f32>,
}

/// Every channel, by bit position in [`Found::channels`].
const CHANNELS: [Channel; 6] = [
    Channel::Temporal,
    Channel::EvidenceNode,
    Channel::Record,
    Channel::RawTurn,
    Channel::SourceWindow,
    Channel::Lexical,
];

fn channel_bit(channel: Channel) -> u8 {
    1 << match channel {
        Channel::Temporal => 0,
        Channel::EvidenceNode => 1,
        Channel::Record => 2,
        Channel::RawTurn => 3,
        Channel::SourceWindow => 4,
        Channel::Lexical => 5,
    }
}

/// A route's candidates as recall finds them.
struct Pool {
    found: Vec<Found>,
    at: HashMap<CandidateTarget, u32>,
    node_ids: Vec<String>,
    node_at: HashMap<String, u32>,
    /// Variants `0..lead` are leading.
    lead: usize,
}

impl Pool {
    fn new(lead: usize) -> Self {
        Pool {
            found: Vec::new(),
            at: HashMap::new(),
            node_ids: Vec::new(),
            node_at: HashMap::new(),
            lead,
        }
    }

    fn entry(&mut self, target: CandidateTarget) -> &mut Found {
        let next = self.found.len() as u32;
        let i = *self.at.entry(target).or_insert_with_key(|target| {
            self.found.push(Found {
                target: target.clone(),
                field: 0.0,
                lead_field: None,
                channels: 0,
                variants: Vec::new(),
                nodes: Vec::new(),
                cos: Vec::new(),
                lead_cos: None,
            });
            next
        });
        &mut self.found[i as usize]
    }

    /// Notes a record's best cosine to the leading variants, computed from its own vector.
    fn lead_cos(&mut self, target: CandidateTarget, cos: f32) {
        let c = self.entry(target);
        c.lead_cos = Some(c.lead_cos.map_or(cos, |known| known.max(cos)));
    }

    /// Notes a hit: its field score, channel, variant and node, and (`cos`) the candidate's
    /// cosine to that variant when the hit was by similarity to it.
    fn hit(
        &mut self,
        target: CandidateTarget,
        field: f32,
        channel: Channel,
        variant: Option<usize>,
        node: Option<&str>,
        cos: Option<f32>,
    ) {
        let node = node.map(|n| match self.node_at.get(n) {
            Some(&i) => i,
            None => {
                let i = self.node_ids.len() as u32;
                self.node_ids.push(n.to_string());
                self.node_at.insert(n.to_string(), i);
                i
            }
        });
        let lead = self.lead;
        let c = self.entry(target);
        if variant.is_none_or(|v| v < lead) {
            c.lead_field = Some(c.lead_field.map_or(field, |l| l.max(field)));
        }
        c.field = c.field.max(field);
        c.channels |= channel_bit(channel);
        if let Some(v) = variant
            && !c.variants.contains(&v)
        {
            c.variants.push(v);
        }
        if let Some(n) = node
            && !c.nodes.contains(&n)
        {
            c.nodes.push(n);
        }
        if let (Some(v), Some(cos)) = (variant, cos) {
            match c.cos.iter_mut().find(|(known, _)| *known == v) {
                Some((_, c)) => *c = c.max(cos),
                None => c.cos.push((v, cos)),
            }
        }
    }
}

impl Found {
    /// The candidate as scoring sees it: its field (from the leading variants when any found
    /// it) and its provenance.
    fn into_scored(self, node_ids: &[String], route_id: &str) -> Scored {
        let f = self;
        let mut c = Scored::new(f.target);
        c.field = f.lead_field.unwrap_or(f.field);
        c.queries_only = f.lead_field.is_none();
        let p = &mut c.provenance;
        p.channels = CHANNELS
            .iter()
            .enumerate()
            .filter(|(i, _)| f.channels & (1 << i) != 0)
            .map(|(_, ch)| *ch)
            .collect();
        p.variants = f.variants.into_iter().collect();
        p.nodes = f
            .nodes
            .iter()
            .map(|&n| node_ids[n as usize].clone())
            .collect();
        p.routes.insert(route_id.to_string());
        c
    }
}

fn record_target(id: &str) -> CandidateTarget {
    CandidateTarget::Record {
        record_id: id.to_string(),
    }
}

fn turn_target(t: &TurnRef) -> CandidateTarget {
    CandidateTarget::Turns {
        first: t.clone(),
        last_index: t.index,
    }
}

fn node_weight(kind: NodeKind, cfg: &RetrievalConfig) -> f64 {
    match kind {
        NodeKind::Entity => cfg.node_weight_entity,
        NodeKind::Topic => cfg.node_weight_topic,
        NodeKind::EntityTopic => cfg.node_weight_entity_topic,
        NodeKind::EventFrame => cfg.node_weight_event_frame,
        NodeKind::Temporal => cfg.node_weight_temporal,
    }
}

/// The record channel's field score of a record at similarity `r`.
fn record_field(cfg: &RetrievalConfig, r: f32) -> f64 {
    cfg.record_base + cfg.record_scale * f64::from(r)
}

/// The raw-turn channel's field score of a turn (or window) at similarity `r`, before any role
/// bonus.
fn turn_field(cfg: &RetrievalConfig, profile: &TypeProfile, r: f32) -> f64 {
    (cfg.turn_base + cfg.turn_scale * f64::from(r)) * profile.raw_mult
}

fn role_bonus(role: Role, profile: &TypeProfile) -> f64 {
    match role {
        Role::Assistant => profile.assistant_bonus,
        Role::User => profile.user_bonus,
        Role::System => 0.0,
    }
}

/// `[first, last]` calendar bounds of an ISO date string (day or month).
fn date_span(s: &str) -> Option<(String, String)> {
    let d = parse_date(s)?.date;
    Some((d.first_day().to_string(), d.last_day().to_string()))
}

/// Whether `[a, b]` overlaps the filter (open bounds match everything).
fn overlaps(a: &str, b: &str, f: &TemporalFilter) -> bool {
    f.since.as_deref().is_none_or(|s| b >= s) && f.until.as_deref().is_none_or(|u| a <= u)
}

/// Milliseconds spent in a route's recall (channels, node expansion) and scoring (resolving,
/// bonuses, windows, rerank).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RouteTimings {
    pub recall_ms: f64,
    pub score_ms: f64,
}

/// Added to every upper bound of a similarity (cosine) before it becomes a score bound: the
/// store's search kernel and [`cosine`] compute the same similarity in different code, and an
/// f16 index stores rounded vectors.
const COS_MARGIN: f64 = 2e-3;

/// Added to every score bound: f32 sums rounded differently.
const SCORE_MARGIN: f32 = 1e-5;

/// The records one search has resolved, shared by its routes: each record's item info and
/// scoring vector are read once, however many routes found it.
#[derive(Default)]
pub struct ResolveCache {
    /// `None`: the record no longer exists.
    records: HashMap<String, Option<ItemInfo>>,
    vectors: HashMap<String, Vec<f32>>,
    session_dates: HashMap<String, Option<String>>,
}

impl ResolveCache {
    /// How many distinct records have been resolved.
    pub fn resolved(&self) -> usize {
        self.records.len()
    }

    fn session_date(&mut self, ctx: &RouteContext<'_>, s: &SessionId) -> Result<Option<String>> {
        if let Some(d) = self.session_dates.get(s.as_str()) {
            return Ok(d.clone());
        }
        let d = ctx
            .store
            .session(ctx.ns, s)?
            .and_then(|i| i.date)
            .and_then(|d| lycheemem_core::date::normalize_date(&d).or(Some(d)));
        self.session_dates.insert(s.to_string(), d.clone());
        Ok(d)
    }

    /// Reads the records (and their vectors) not resolved yet, in one batch each.
    fn fetch(&mut self, ctx: &RouteContext<'_>, ids: &[&str]) -> Result<()> {
        let mut missing: Vec<String> = ids
            .iter()
            .filter(|id| !self.records.contains_key(**id))
            .map(|id| id.to_string())
            .collect();
        missing.sort();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        let mut records: HashMap<String, lycheemem_core::Record> = ctx
            .store
            .records(ctx.ns, &missing)?
            .into_iter()
            .map(|r| (r.record_id.clone(), r))
            .collect();
        let unscored: Vec<ItemRef> = missing
            .iter()
            .filter(|id| records.contains_key(*id) && !self.vectors.contains_key(*id))
            .map(|id| ItemRef::Record(id.clone()))
            .collect();
        for (item, v) in unscored
            .iter()
            .zip(ctx.store.scoring_vectors(ctx.ns, &unscored)?)
        {
            if let (ItemRef::Record(id), Some(v)) = (item, v) {
                self.vectors.insert(id.clone(), v);
            }
        }
        for id in missing {
            let info = match records.remove(&id) {
                Some(r) => Some(ItemInfo {
                    session_date: self.session_date(ctx, &r.source_session)?,
                    session: r.source_session.to_string(),
                    text: r.semantic_text,
                    memory_type: Some(r.memory_type),
                    role: Some(r.source_role),
                    entities: r.entities,
                    turns: r.evidence_turns,
                    temporal: r.temporal,
                    ..ItemInfo::default()
                }),
                None => None,
            };
            self.records.insert(id, info);
        }
        Ok(())
    }
}

/// A record candidate not resolved yet, with upper bounds of what resolving it can give.
struct Pending {
    candidate: Found,
    /// Upper bound of its field score once resolved and given its bonuses.
    field_ub: f32,
    /// When its field is known before resolving (a leading variant or a variant-free channel
    /// found it) and only its bonuses are not: the largest field it can have, computed as
    /// [`apply_bonuses`] adds them (so a resolved field can equal it exactly; window anchors
    /// tied on it are then told apart by target, as [`add_windows`] orders them).
    field_max: Option<f32>,
    /// Upper bound of its route score (no rerank: an unresolved record is never in the rerank
    /// pool, see [`RouteCandidates::settle`]).
    score_ub: f32,
    /// With `field_max`: the largest route score it can have, computed as [`set_route_score`]
    /// does from `field_max` and the bound of its similarity. Many records tie exactly (a
    /// similarity under the `r` floor scores 0), and ties are told apart by target.
    score_max: Option<f32>,
}

impl Pending {
    /// Whether, once resolved, it could come before `anchor` in window-anchor order (by
    /// [`anchor_order`]; a record without turns never does, but that is not known yet).
    fn may_precede(&self, anchor: &Scored) -> bool {
        self.may_beat(self.field_max, self.field_ub, anchor.field, &anchor.target)
    }

    /// Whether, once resolved, it could come before `last` in route order
    /// ([`by_route_score`]).
    fn may_outrank(&self, last: &Scored) -> bool {
        self.may_beat(
            self.score_max,
            self.score_ub,
            last.route_score,
            &last.target,
        )
    }

    /// Whether a score of at most `max` (exact: a tie goes by target) or, without it, below
    /// `ub` could come before `value` of `target` (higher first, ties by target).
    fn may_beat(&self, max: Option<f32>, ub: f32, value: f32, target: &CandidateTarget) -> bool {
        match max {
            Some(max) => max > value || (max == value && self.candidate.target < *target),
            None => ub >= value,
        }
    }

    fn record_id(&self) -> Option<&str> {
        match &self.candidate.target {
            CandidateTarget::Record { record_id } => Some(record_id),
            CandidateTarget::Turns { .. } => None,
        }
    }
}

/// What bounds an unresolved record's scores: its similarity to the leading variants can be no
/// higher than the angle to a variant that found it allows, and a bonus no higher than the
/// largest one the question type and the route's time filter can give.
struct Bounds {
    lead: usize,
    /// `cross[v][l]`: the cosine of variant `v` and leading variant `l`.
    cross: Vec<Vec<f64>>,
    bonus_ub: f64,
    r_weight: f64,
}

impl Bounds {
    fn new(ctx: &RouteContext<'_>, route: &Route, vectors: &[Vec<f32>], lead: usize) -> Self {
        let cfg = ctx.cfg;
        let lead = lead.min(vectors.len());
        let cos64 = |a: &[f32], b: &[f32]| {
            let (mut d, mut na, mut nb) = (0f64, 0f64, 0f64);
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (f64::from(*x), f64::from(*y));
                d += x * y;
                na += x * x;
                nb += y * y;
            }
            let n = (na * nb).sqrt();
            if n > 0.0 { d / n } else { 0.0 }
        };
        let cross = vectors
            .iter()
            .map(|v| vectors[..lead].iter().map(|l| cos64(v, l)).collect())
            .collect();
        let type_bonus = match ctx.question_type {
            QuestionType::PriorAssistantResponse => cfg.bonus_prior_assistant,
            QuestionType::PersonalizedAdvice => cfg.bonus_personalized,
            QuestionType::Temporal => cfg.bonus_temporal_fields,
            QuestionType::Aggregate | QuestionType::Comparison => cfg.bonus_aggregate_event,
            _ => 0.0,
        };
        let time_bonus = if route.temporal_filter.is_open() {
            0.0
        } else {
            cfg.temporal_boost_record.max(cfg.temporal_boost_session)
        };
        Bounds {
            lead,
            cross,
            bonus_ub: type_bonus.max(0.0) + time_bonus.max(0.0),
            r_weight: cfg.route_r_weight.max(0.0),
        }
    }

    /// Upper bound of `r` (the best similarity to a leading variant) of an item whose cosine to
    /// some variants is known: on the unit sphere the angle to a leading variant is at least
    /// the angle to the variant that found it minus the angle between the two variants.
    fn r_ub(&self, known: &[(usize, f32)]) -> f32 {
        let bound = |c: f32, between: f64| {
            let a = f64::from(c).clamp(-1.0, 1.0).acos();
            let b = between.clamp(-1.0, 1.0).acos();
            if a <= b { 1.0 } else { (a - b).cos() }
        };
        (0..self.lead)
            .map(|l| {
                known
                    .iter()
                    .filter_map(|&(v, c)| self.cross.get(v).map(|x| bound(c, x[l])))
                    .fold(1.0f64, f64::min)
            })
            .map(|c| r_of((c + COS_MARGIN).min(1.0) as f32))
            .fold(0.0f32, f32::max)
    }

    fn pending(&self, cfg: &RetrievalConfig, candidate: Found) -> Pending {
        let mut r_ub = self.r_ub(&candidate.cos);
        if let Some(cos) = candidate.lead_cos {
            r_ub = r_ub.min(r_of((f64::from(cos) + COS_MARGIN).min(1.0) as f32));
        }
        let field = match candidate.lead_field {
            Some(f) => f64::from(f),
            None => record_field(cfg, r_ub),
        };
        let variants = variants_bonus_of(cfg, candidate.variants.len());
        let field_ub = (field + self.bonus_ub) as f32 + SCORE_MARGIN;
        let field_max = candidate.lead_field.map(|f| f + self.bonus_ub as f32);
        let score_ub =
            field_ub + (self.r_weight * f64::from(r_ub) + variants) as f32 + SCORE_MARGIN;
        // As `set_route_score` adds: field, weighted similarity, variant bonus (a negative
        // weight is at most 0 times the similarity).
        let weight = cfg.route_r_weight as f32;
        let r_term = if weight >= 0.0 { weight * r_ub } else { 0.0 };
        let score_max = field_max.map(|f| f + r_term + variants as f32);
        Pending {
            candidate,
            field_ub,
            field_max,
            score_ub,
            score_max,
        }
    }
}

fn variants_bonus(cfg: &RetrievalConfig, c: &Scored) -> f64 {
    variants_bonus_of(cfg, c.provenance.variants.len())
}

/// `min(cap, step·#variants)`.
fn variants_bonus_of(cfg: &RetrievalConfig, variants: usize) -> f64 {
    (cfg.route_variant_step * variants as f64).min(cfg.route_variant_cap)
}

/// `route_score = (rerank or field) + route_r_weight·r + min(cap, step·#variants)`.
fn set_route_score(cfg: &RetrievalConfig, c: &mut Scored) {
    let base = c.rerank.unwrap_or(c.field);
    c.route_score = base + (cfg.route_r_weight as f32) * c.r + variants_bonus(cfg, c) as f32;
}

fn by_route_score(a: &Scored, b: &Scored) -> std::cmp::Ordering {
    b.route_score
        .total_cmp(&a.route_score)
        .then(a.target.cmp(&b.target))
}

/// The `n`-th largest of `values` (1-based), if there are that many.
fn nth_largest(mut values: Vec<f32>, n: usize) -> Option<f32> {
    if n == 0 || values.len() < n {
        return None;
    }
    values.select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a));
    Some(values[n - 1])
}

/// One route's candidates between recall and fusion. Raw turns are resolved at once (they are
/// few); records are resolved lazily, best upper bound of their route score first, until what
/// fusion and selection read is settled: the window anchors, the rerank pool, the route's top
/// `depth` (its RRF ranks), and whatever selection reaches ([`RouteCandidates::resolve_more`]).
/// Resolving every record gives the same list with the unresolved tail filled in.
pub struct RouteCandidates<'r> {
    route: &'r Route,
    lead_vectors: Vec<Vec<f32>>,
    /// Resolved and scored: raw turns, records as they are resolved, windows once built.
    exact: Vec<Scored>,
    /// Unresolved records, best `score_ub` first.
    pending: std::collections::VecDeque<Pending>,
    /// The nodes unresolved records were found through (their [`Found::nodes`] index it).
    node_ids: Vec<String>,
    windows_built: bool,
    /// Reranked (when there is a reranker) and route scores set.
    scored: bool,
    /// Candidates recall found (records and raw turns, before windows).
    pub found: usize,
    pub timings: RouteTimings,
}

/// Runs a route's recall: the channels, node expansion, and the raw turns resolved.
///
/// `lexical` holds the lexical channel's searches for these variants ([`lexical_searches`],
/// which needs no vectors and so runs while they are embedded; empty with the channel off).
pub fn recall_route<'r>(
    ctx: &RouteContext<'_>,
    route: &'r Route,
    variant_vectors: &[Vec<f32>],
    lexical: LexicalHits,
    cache: &mut ResolveCache,
) -> Result<RouteCandidates<'r>> {
    let started = std::time::Instant::now();
    let cfg = ctx.cfg;
    let profile = cfg.types.get(ctx.question_type);
    let budget = RecallBudget::new(cfg, profile, ctx.k);
    let lead = if cfg.planner_queries_recall_only {
        leading_variants(ctx.question, route, variant_vectors.len())
    } else {
        variant_vectors.len()
    };
    let mut pool = Pool::new(lead);
    let rid = route.route_id.as_str();
    if cfg.channel_temporal && !route.temporal_filter.is_open() {
        let lead_vectors: Vec<&[f32]> = variant_vectors[..lead.min(variant_vectors.len())]
            .iter()
            .map(Vec::as_slice)
            .collect();
        recall_temporal(
            ctx,
            &route.temporal_filter,
            &budget,
            &lead_vectors,
            &mut pool,
        )?;
    }
    // Node hits are expanded to records last, scored by the records' own similarity.
    let node_hits = if cfg.channel_nodes {
        find_nodes(ctx, variant_vectors, &budget)?
    } else {
        Vec::new()
    };
    if cfg.channel_records {
        let field = |r: f32| record_field(cfg, r);
        let what = (Target::Record, budget.rec_n, Channel::Record);
        recall_nearest(ctx, variant_vectors, what, field, &mut pool)?;
    }
    if cfg.channel_turns {
        let field = |r: f32| turn_field(cfg, profile, r);
        let what = (Target::Turn, budget.turn_n, Channel::RawTurn);
        recall_nearest(ctx, variant_vectors, what, field, &mut pool)?;
    }
    recall_lexical(ctx, lexical, profile, &mut pool);
    if !node_hits.is_empty() {
        // Record vectors node expansion read already; resolving reuses them.
        let known = expand_nodes(ctx, &node_hits, variant_vectors, &budget, &mut pool)?;
        for (id, v) in known {
            cache.vectors.entry(id).or_insert(v);
        }
    }
    let lead_vectors = variant_vectors[..lead.min(variant_vectors.len())].to_vec();
    let bounds = Bounds::new(ctx, route, variant_vectors, lead);
    let Pool {
        found, node_ids, ..
    } = pool;
    let mut turns = Vec::new();
    let mut pending = Vec::new();
    for f in found {
        if matches!(f.target, CandidateTarget::Turns { .. }) {
            turns.push(f.into_scored(&node_ids, rid));
        } else {
            pending.push(bounds.pending(cfg, f));
        }
    }
    turns.sort_by(|a, b| a.target.cmp(&b.target));
    pending.sort_by(|a, b| {
        b.score_ub
            .total_cmp(&a.score_ub)
            .then(a.candidate.target.cmp(&b.candidate.target))
    });
    let found = turns.len() + pending.len();
    let recall_ms = started.elapsed().as_secs_f64() * 1e3;
    resolve_turns(ctx, cache, &mut turns, &lead_vectors, profile)?;
    apply_bonuses(ctx, &mut turns, &route.temporal_filter);
    Ok(RouteCandidates {
        route,
        lead_vectors,
        exact: turns,
        pending: pending.into(),
        node_ids,
        windows_built: false,
        scored: false,
        found,
        timings: RouteTimings {
            recall_ms,
            score_ms: started.elapsed().as_secs_f64() * 1e3 - recall_ms,
        },
    })
}

/// Records resolved per step at first; each further step resolves as many as all before it.
const RESOLVE_STEP: usize = 64;

impl RouteCandidates<'_> {
    /// Resolves records (best bound first) until the window anchors, the rerank pool and the
    /// route's top `depth` by route score are settled, builds the windows, reranks and scores;
    /// `eager` resolves every record first (the list is then complete).
    pub fn settle(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
        depth: usize,
        eager: bool,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        let cfg = ctx.cfg;
        let profile = cfg.types.get(ctx.question_type);
        loop {
            let done = self.pending.is_empty();
            if !self.windows_built && (done || self.anchors_settled(ctx)) {
                let exact = std::mem::take(&mut self.exact);
                let rid = self.route.route_id.as_str();
                self.exact = add_windows(ctx, exact, &self.lead_vectors, profile, rid)?;
                self.windows_built = true;
            }
            if self.windows_built && !self.scored && (done || self.rerank_settled(ctx)) {
                if cfg.rerank
                    && let Some(reranker) = ctx.reranker
                {
                    rerank(ctx, reranker, self.route, &mut self.exact)?;
                }
                for c in &mut self.exact {
                    set_route_score(cfg, c);
                }
                self.scored = true;
            }
            if self.scored && (done || self.order_settled(depth)) {
                break;
            }
            let step = if eager {
                self.pending.len()
            } else {
                RESOLVE_STEP.max(cache.resolved())
            };
            if self.windows_built {
                self.resolve_next(ctx, cache, step)?;
            } else {
                self.resolve_anchor_candidates(ctx, cache, step)?;
            }
        }
        self.timings.score_ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// Resolves the next `n` records by bound (after [`RouteCandidates::settle`]).
    pub fn resolve_more(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
        n: usize,
    ) -> Result<()> {
        self.timed(|route| route.resolve_next(ctx, cache, n))
    }

    /// Resolves this route's unresolved records that `cache` holds already (another route
    /// resolved them), so every resolved record is scored by every route that found it.
    pub fn resolve_cached(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
    ) -> Result<()> {
        self.timed(|route| {
            let (ready, left): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut route.pending)
                .into_iter()
                .partition(|p| {
                    p.record_id()
                        .is_some_and(|id| cache.records.contains_key(id))
                });
            route.pending = left.into();
            route.resolve_batch(ctx, cache, ready)
        })
    }

    /// Runs `step`, counting its time as scoring.
    fn timed(&mut self, step: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let started = std::time::Instant::now();
        let outcome = step(self);
        self.timings.score_ms += started.elapsed().as_secs_f64() * 1e3;
        outcome
    }

    /// The resolved candidates, best route score first.
    pub fn list(&self) -> Vec<Scored> {
        let mut list = self.exact.clone();
        list.sort_by(by_route_score);
        list
    }

    /// The highest route score an unresolved record could have (`None`: all resolved).
    pub fn pending_bound(&self) -> Option<f32> {
        self.pending.front().map(|p| p.score_ub)
    }

    fn max_field_ub(&self) -> f32 {
        self.pending
            .iter()
            .map(|p| p.field_ub)
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// The window anchors (the best `window_anchors` records with turns, by field, ties by
    /// target as [`add_windows`] orders them) are all resolved: no unresolved record can reach
    /// the last one's place.
    fn anchors_settled(&self, ctx: &RouteContext<'_>) -> bool {
        let cfg = ctx.cfg;
        let profile = cfg.types.get(ctx.question_type);
        if !cfg.channel_turns || profile.window == 0 || cfg.window_anchors == 0 {
            return true;
        }
        let mut anchors: Vec<&Scored> = self
            .exact
            .iter()
            .filter(|c| !c.is_raw() && !c.info.turns.is_empty())
            .collect();
        let n = cfg.window_anchors;
        if anchors.len() < n {
            return false;
        }
        anchors.select_nth_unstable_by(n - 1, anchor_order);
        let last = anchors[n - 1];
        self.pending.iter().all(|p| !p.may_precede(last))
    }

    /// Resolves, out of score order, the `n` unresolved records that could come first as
    /// window anchors (largest possible field, then target).
    fn resolve_anchor_candidates(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
        n: usize,
    ) -> Result<()> {
        let mut order: Vec<usize> = (0..self.pending.len()).collect();
        let key = |p: &Pending| p.field_max.unwrap_or(p.field_ub);
        let n = n.min(order.len());
        if n == 0 {
            return Ok(());
        }
        let by_anchor = |a: &usize, b: &usize| {
            let (pa, pb) = (&self.pending[*a], &self.pending[*b]);
            key(pb)
                .total_cmp(&key(pa))
                .then(pa.candidate.target.cmp(&pb.candidate.target))
        };
        order.select_nth_unstable_by(n - 1, by_anchor);
        let mut take = vec![false; self.pending.len()];
        for &i in &order[..n] {
            take[i] = true;
        }
        let mut batch = Vec::with_capacity(n);
        let mut rest = std::collections::VecDeque::with_capacity(self.pending.len() - n);
        for (p, take) in std::mem::take(&mut self.pending).into_iter().zip(take) {
            if take {
                batch.push(p);
            } else {
                rest.push_back(p);
            }
        }
        self.pending = rest;
        self.resolve_batch(ctx, cache, batch)
    }

    /// The rerank pool (the best `max(rerank_floor, rerank_factor·k)` by field) is resolved.
    fn rerank_settled(&self, ctx: &RouteContext<'_>) -> bool {
        let cfg = ctx.cfg;
        if !cfg.rerank || ctx.reranker.is_none() {
            return true;
        }
        let n = cfg.rerank_floor.max(cfg.rerank_factor * ctx.k);
        let fields = self.exact.iter().map(|c| c.field).collect();
        nth_largest(fields, n).is_some_and(|f| f > self.max_field_ub())
    }

    /// The route's top `depth` by route score is resolved: no unresolved record can come
    /// before the last of them.
    fn order_settled(&self, depth: usize) -> bool {
        let Some(bound) = self.pending_bound() else {
            return true;
        };
        let depth = depth.max(1);
        if self.exact.len() < depth {
            return false;
        }
        let mut order: Vec<&Scored> = self.exact.iter().collect();
        order.select_nth_unstable_by(depth - 1, |a, b| by_route_score(a, b));
        let last = order[depth - 1];
        bound < last.route_score || self.pending.iter().all(|p| !p.may_outrank(last))
    }

    fn resolve_next(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
        n: usize,
    ) -> Result<()> {
        let n = n.min(self.pending.len());
        let batch: Vec<Pending> = self.pending.drain(..n).collect();
        self.resolve_batch(ctx, cache, batch)
    }

    fn resolve_batch(
        &mut self,
        ctx: &RouteContext<'_>,
        cache: &mut ResolveCache,
        batch: Vec<Pending>,
    ) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let cfg = ctx.cfg;
        let profile = cfg.types.get(ctx.question_type);
        let ids: Vec<&str> = batch.iter().filter_map(Pending::record_id).collect();
        cache.fetch(ctx, &ids)?;
        for p in batch {
            let Some(record_id) = p.record_id() else {
                continue;
            };
            let Some(Some(info)) = cache.records.get(record_id) else {
                continue;
            };
            let (info, vector) = (info.clone(), cache.vectors.get(record_id));
            let mut c = p
                .candidate
                .into_scored(&self.node_ids, &self.route.route_id);
            c.info = info;
            let vector = vector.map(Vec::as_slice);
            finish(ctx, &mut c, vector, &self.lead_vectors, profile);
            apply_bonuses(
                ctx,
                std::slice::from_mut(&mut c),
                &self.route.temporal_filter,
            );
            if self.scored {
                set_route_score(cfg, &mut c);
            }
            self.exact.push(c);
        }
        Ok(())
    }
}

/// How many candidates each recall channel asks for (docs/algorithm.md, "Recall budgets and
/// question types": `k` scaled by the question type's multipliers, with floors).
struct RecallBudget {
    node_n: usize,
    rec_n: usize,
    turn_n: usize,
    temporal_n: usize,
}

impl RecallBudget {
    fn new(cfg: &RetrievalConfig, profile: &TypeProfile, k: usize) -> Self {
        RecallBudget {
            node_n: ((cfg.recall_factor * k).max(cfg.recall_floor) as f64 * profile.m_node).ceil()
                as usize,
            rec_n: ((cfg.recall_factor * k).max(cfg.recall_floor) as f64 * profile.m_rec).ceil()
                as usize,
            turn_n: (k.max(cfg.turn_recall_floor) as f64 * profile.m_turn).ceil() as usize,
            temporal_n: (cfg.temporal_factor * k).max(cfg.temporal_floor),
        }
    }
}

/// Temporal channel: the day and month nodes the route's filter overlaps → their records.
fn recall_temporal(
    ctx: &RouteContext<'_>,
    filter: &TemporalFilter,
    budget: &RecallBudget,
    lead_vectors: &[&[f32]],
    pool: &mut Pool,
) -> Result<()> {
    let cfg = ctx.cfg;
    let temporal_n = budget.temporal_n;
    let since = filter.since.clone().unwrap_or_else(|| "0001-01-01".into());
    let until = filter.until.clone().unwrap_or_else(|| "9999-12-31".into());
    let nodes = ctx.store.temporal_members(ctx.ns, &since, &until)?;
    let day_prefix = NodeKind::Temporal.node_id("day:");
    let mut linked = 0usize;
    for n in nodes {
        if linked >= temporal_n {
            break;
        }
        let record_ids = n.record_ids.unwrap_or_default();
        let score = if n.node_id.starts_with(&day_prefix) {
            cfg.temporal_day_score
        } else {
            cfg.temporal_month_score
        } as f32;
        // A temporal hit carries no similarity, so its bound would send every one of them
        // (up to `temporal_n`) to be resolved. A node the store searches (a large one) gives
        // every member's cosine to the leading variants from the same vectors resolving reads:
        // their bounds become exact and only those that can rank are resolved.
        let members = n.records;
        let mut lead_cos: HashMap<String, f32> = HashMap::new();
        if !lead_vectors.is_empty() && members >= ctx.store.node_search_above() {
            let lists =
                ctx.store
                    .vector_search_node_many(ctx.ns, &n.node_id, lead_vectors, members)?;
            for hit in lists.into_iter().flatten() {
                if let ItemRef::Record(id) = hit.item {
                    let best = lead_cos.entry(id).or_insert(hit.score);
                    *best = best.max(hit.score);
                }
            }
        }
        for record_id in &record_ids {
            if linked >= temporal_n {
                break;
            }
            linked += 1;
            pool.hit(
                record_target(record_id),
                score,
                Channel::Temporal,
                None,
                Some(&n.node_id),
                None,
            );
            if let Some(&cos) = lead_cos.get(record_id) {
                pool.lead_cos(record_target(record_id), cos);
            }
        }
    }
    Ok(())
}

/// Evidence-node channel, first half: the nodes of every kind nearest to each query variant.
fn find_nodes(
    ctx: &RouteContext<'_>,
    variant_vectors: &[Vec<f32>],
    budget: &RecallBudget,
) -> Result<Vec<(String, NodeKind, usize)>> {
    let node_n = budget.node_n;
    let mut node_hits: Vec<(String, NodeKind, usize)> = Vec::new();
    for kind in [
        NodeKind::Entity,
        NodeKind::Topic,
        NodeKind::EntityTopic,
        NodeKind::EventFrame,
    ] {
        for (vi, v) in variant_vectors.iter().enumerate() {
            let q = VectorQuery::new(Target::Node(kind), v.clone(), node_n);
            for h in ctx.store.vector_search(ctx.ns, &q)? {
                if let ItemRef::Node(id) = h.item {
                    node_hits.push((id, kind, vi));
                }
            }
        }
    }
    Ok(node_hits)
}

/// Record and raw-turn channels: the items of `target` nearest to each query variant, each
/// scored by `field` of its similarity (a turn's role bonus comes once it is resolved).
fn recall_nearest(
    ctx: &RouteContext<'_>,
    variant_vectors: &[Vec<f32>],
    (target, n, channel): (Target, usize, Channel),
    field: impl Fn(f32) -> f64,
    pool: &mut Pool,
) -> Result<()> {
    for (vi, v) in variant_vectors.iter().enumerate() {
        let q = VectorQuery::new(target, v.clone(), n);
        for h in ctx.store.vector_search(ctx.ns, &q)? {
            let t = match &h.item {
                ItemRef::Record(id) => record_target(id),
                ItemRef::Turn(t) => turn_target(t),
                ItemRef::Node(_) => continue,
            };
            // A raw turn's similarity is read when it is resolved.
            let cos = (!matches!(t, CandidateTarget::Turns { .. })).then_some(h.score);
            pool.hit(t, field(r_of(h.score)) as f32, channel, Some(vi), None, cos);
        }
    }
    Ok(())
}

/// The lexical channel's BM25 hits for one route: per variant, its record hits and its raw-turn
/// hits.
#[derive(Default)]
pub struct LexicalHits(Vec<[Vec<Hit>; 2]>);

/// Runs the lexical channel's searches for one route's variants (each variant's top records
/// and raw turns by BM25, as many as the record and raw-turn channels' budgets).
pub fn lexical_searches(
    store: &dyn RetrievalStore,
    ns: &Namespace,
    cfg: &RetrievalConfig,
    question_type: QuestionType,
    k: usize,
    variant_texts: &[String],
) -> Result<LexicalHits> {
    let budget = RecallBudget::new(cfg, cfg.types.get(question_type), k);
    variant_texts
        .iter()
        .map(|text| {
            Ok([
                store.text_search(ns, Target::Record, text, budget.rec_n, None)?,
                store.text_search(ns, Target::Turn, text, budget.turn_n, None)?,
            ])
        })
        .collect::<Result<_>>()
        .map(LexicalHits)
}

/// Lexical channel: BM25 over records and turns for each query variant, each variant's scores
/// normalized by its best.
fn recall_lexical(
    ctx: &RouteContext<'_>,
    hits: LexicalHits,
    profile: &TypeProfile,
    pool: &mut Pool,
) {
    let cfg = ctx.cfg;
    for (vi, lists) in hits.0.into_iter().enumerate() {
        for (hits, mult) in lists.into_iter().zip([1.0, profile.raw_mult]) {
            let max = hits
                .iter()
                .map(|h| h.score)
                .fold(0.0f32, f32::max)
                .max(f32::MIN_POSITIVE);
            for h in hits {
                let field =
                    (cfg.lexical_base + cfg.lexical_scale * f64::from(h.score / max)) * mult;
                let t = match &h.item {
                    ItemRef::Record(id) => record_target(id),
                    ItemRef::Turn(t) => turn_target(t),
                    ItemRef::Node(_) => continue,
                };
                pool.hit(t, field as f32, Channel::Lexical, Some(vi), None, None);
            }
        }
    }
}

/// A node member found for a variant: `(r, cosine, record id)`.
type MemberHit = (f32, f32, String);

/// Evidence-node channel, second half: node hits expanded to their records, scored by the
/// records' own similarity. Small nodes are scored exactly from one batch of vectors; larger
/// ones (a main speaker's entity node can link thousands of records) through the store's node
/// search, once per node for all the variants that found it. Returns the small nodes' record
/// vectors (scoring reuses them).
fn expand_nodes(
    ctx: &RouteContext<'_>,
    node_hits: &[(String, NodeKind, usize)],
    variant_vectors: &[Vec<f32>],
    budget: &RecallBudget,
    pool: &mut Pool,
) -> Result<HashMap<String, Vec<f32>>> {
    let cfg = ctx.cfg;
    let rec_n = budget.rec_n;
    let mut ids: Vec<String> = node_hits.iter().map(|(id, _, _)| id.clone()).collect();
    ids.sort();
    ids.dedup();
    // Large nodes come back unlisted: they are searched, not scored member by member.
    let nodes: HashMap<String, Option<Vec<String>>> = ctx
        .store
        .node_members(ctx.ns, &ids, ctx.store.node_search_above())?
        .into_iter()
        .map(|n| (n.node_id, n.record_ids))
        .collect();
    let mut small: Vec<String> = nodes.values().flatten().flatten().cloned().collect();
    small.sort();
    small.dedup();
    let items: Vec<ItemRef> = small.iter().cloned().map(ItemRef::Record).collect();
    let vectors: HashMap<String, Vec<f32>> = small
        .into_iter()
        .zip(ctx.store.scoring_vectors(ctx.ns, &items)?)
        .filter_map(|(id, v)| v.map(|v| (id, v)))
        .collect();
    // Large nodes: one node search per node for every variant that found it.
    let mut searched: HashMap<(&str, usize), Vec<MemberHit>> = HashMap::new();
    let mut large: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (node_id, _, vi) in node_hits {
        if let Some(None) = nodes.get(node_id) {
            large.entry(node_id.as_str()).or_default().push(*vi);
        }
    }
    for (node_id, mut vis) in large {
        vis.sort_unstable();
        vis.dedup();
        let queries: Vec<&[f32]> = vis
            .iter()
            .map(|&vi| variant_vectors[vi].as_slice())
            .collect();
        let lists = ctx
            .store
            .vector_search_node_many(ctx.ns, node_id, &queries, rec_n)?;
        for (vi, hits) in vis.into_iter().zip(lists) {
            let scored = hits
                .into_iter()
                .filter_map(|h| match h.item {
                    ItemRef::Record(id) => Some((r_of(h.score), h.score, id)),
                    _ => None,
                })
                .collect();
            searched.insert((node_id, vi), scored);
        }
    }
    for (node_id, kind, vi) in node_hits {
        let Some(node) = nodes.get(node_id) else {
            continue;
        };
        let query = &variant_vectors[*vi];
        let scored: Vec<MemberHit> = if let Some(members) = node {
            let mut s: Vec<MemberHit> = members
                .iter()
                .filter_map(|id| {
                    vectors.get(id).map(|v| {
                        let cos = cosine(v, query);
                        (r_of(cos), cos, id.clone())
                    })
                })
                .collect();
            s.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
            s.truncate(rec_n);
            s
        } else {
            // Each (node, variant) is hit once.
            searched
                .remove(&(node_id.as_str(), *vi))
                .unwrap_or_default()
        };
        for (r, cos, id) in scored {
            let field = node_weight(*kind, cfg) + cfg.record_scale * f64::from(r);
            pool.hit(
                record_target(&id),
                field as f32,
                Channel::EvidenceNode,
                Some(*vi),
                Some(node_id),
                Some(cos),
            );
        }
    }
    Ok(vectors)
}

/// Fills in each raw-turn candidate's turns (the hit with its context turns), role bonus and
/// best similarity `r` over the variants; drops hits whose turn no longer exists.
fn resolve_turns(
    ctx: &RouteContext<'_>,
    cache: &mut ResolveCache,
    candidates: &mut Vec<Scored>,
    variant_vectors: &[Vec<f32>],
    profile: &TypeProfile,
) -> Result<()> {
    let mut items: Vec<ItemRef> = Vec::with_capacity(candidates.len());
    let mut keep = Vec::with_capacity(candidates.len());
    for c in candidates.iter_mut() {
        let CandidateTarget::Turns { first, .. } = &c.target else {
            keep.push(false);
            continue;
        };
        // The hit with its context turns (`raw_turn_context_before` / `_after`).
        let hit = first.clone();
        let turns = ctx.store.turn_range(
            ctx.ns,
            &hit.session,
            hit.index.saturating_sub(ctx.cfg.raw_turn_context_before),
            hit.index.saturating_add(ctx.cfg.raw_turn_context_after),
        )?;
        let (Some(t), Some(head), Some(tail)) = (
            turns.iter().find(|t| t.index == hit.index),
            turns.first(),
            turns.last(),
        ) else {
            keep.push(false);
            continue;
        };
        c.target = CandidateTarget::Turns {
            first: head.turn_ref(),
            last_index: tail.index,
        };
        c.info.session = t.session.to_string();
        c.info.session_date = cache.session_date(ctx, &t.session)?;
        c.info.dialogue = turns.iter().map(turn_search_text).collect();
        c.info.text = c.info.dialogue.join("\n");
        c.info.focus = vec![hit.index];
        c.info.role = Some(match t.role {
            Role::Assistant => SourceRole::Assistant,
            _ => SourceRole::User,
        });
        c.info.turns = turns.iter().map(|t| t.index).collect();
        c.field += role_bonus(t.role, profile) as f32;
        // Scored on the hit's own vector.
        items.push(ItemRef::Turn(hit));
        keep.push(true);
    }
    let mut flags = keep.into_iter();
    candidates.retain(|_| flags.next().unwrap_or(false));
    let vectors = ctx.store.scoring_vectors(ctx.ns, &items)?;
    for (c, v) in candidates.iter_mut().zip(vectors) {
        finish(ctx, c, v.as_deref(), variant_vectors, profile);
    }
    Ok(())
}

/// A resolved candidate's best similarity `r` over the variants relevance is measured against
/// and, when only the planner's queries found it, its field score from that similarity.
fn finish(
    ctx: &RouteContext<'_>,
    c: &mut Scored,
    vector: Option<&[f32]>,
    variant_vectors: &[Vec<f32>],
    profile: &TypeProfile,
) {
    if let Some(v) = vector {
        c.r = variant_vectors
            .iter()
            .map(|q| r_of(cosine(v, q)))
            .fold(0.0f32, f32::max);
    }
    if c.queries_only {
        // Found by the planner's queries alone: scored as the record or raw-turn channel
        // scores a hit of the question (its similarity to the leading variants).
        c.field = match (&c.target, c.info.role) {
            (CandidateTarget::Record { .. }, _) => record_field(ctx.cfg, c.r),
            (CandidateTarget::Turns { .. }, role) => {
                let bonus = match role {
                    Some(SourceRole::Assistant) => role_bonus(Role::Assistant, profile),
                    _ => role_bonus(Role::User, profile),
                };
                turn_field(ctx.cfg, profile, c.r) + bonus
            }
        } as f32;
    }
}

/// Type bonuses and the temporal boost.
fn apply_bonuses(ctx: &RouteContext<'_>, candidates: &mut [Scored], filter: &TemporalFilter) {
    let cfg = ctx.cfg;
    for c in candidates {
        let mut bonus = 0.0f64;
        if let Some(t) = c.info.memory_type {
            bonus += match ctx.question_type {
                QuestionType::PriorAssistantResponse
                    if matches!(c.info.role, Some(SourceRole::Assistant | SourceRole::Both)) =>
                {
                    cfg.bonus_prior_assistant
                }
                QuestionType::PersonalizedAdvice
                    if matches!(
                        t,
                        MemoryType::Preference
                            | MemoryType::Constraint
                            | MemoryType::Event
                            | MemoryType::FailurePattern
                    ) =>
                {
                    cfg.bonus_personalized
                }
                QuestionType::Temporal if !c.info.temporal.is_empty() => cfg.bonus_temporal_fields,
                QuestionType::Aggregate | QuestionType::Comparison if t == MemoryType::Event => {
                    cfg.bonus_aggregate_event
                }
                _ => 0.0,
            };
        }
        if !filter.is_open() {
            let record_overlap = c
                .info
                .temporal
                .fields()
                .filter_map(date_span)
                .any(|(a, b)| overlaps(&a, &b, filter));
            let session_overlap = c
                .info
                .session_date
                .as_deref()
                .and_then(date_span)
                .is_some_and(|(a, b)| overlaps(&a, &b, filter));
            if record_overlap {
                bonus += cfg.temporal_boost_record;
            } else if session_overlap {
                bonus += cfg.temporal_boost_session;
            }
        }
        c.field += bonus as f32;
    }
}

/// Field scores closer than this are equal: a similarity computed by two kernels (the store's
/// search and [`cosine`]) differs in the last bits.
const FIELD_ROUNDING: f32 = 1e-5;

/// Window anchors' order: field, best first, then target.
fn anchor_order(a: &&Scored, b: &&Scored) -> std::cmp::Ordering {
    b.field.total_cmp(&a.field).then(a.target.cmp(&b.target))
}

/// Source windows: the best `window_anchors` records' evidence turns ± window become window
/// candidates (merged when they touch); raw-turn hits inside a window are folded into it.
fn add_windows(
    ctx: &RouteContext<'_>,
    candidates: Vec<Scored>,
    variant_vectors: &[Vec<f32>],
    profile: &TypeProfile,
    route_id: &str,
) -> Result<Vec<Scored>> {
    let cfg = ctx.cfg;
    // Windows bring raw dialogue, like the raw-turn channel: both go when it is off
    // (`record_vector_only`).
    if !cfg.channel_turns || profile.window == 0 || cfg.window_anchors == 0 {
        return Ok(candidates);
    }
    let mut anchors: Vec<&Scored> = candidates
        .iter()
        .filter(|c| !c.is_raw() && !c.info.turns.is_empty())
        .collect();
    anchors.sort_by(anchor_order);
    anchors.truncate(cfg.window_anchors);
    // Intervals per session, then merged.
    let mut spans: BTreeMap<String, Vec<(u32, u32, Vec<usize>)>> = BTreeMap::new();
    for (ai, a) in anchors.iter().enumerate() {
        for t in &a.info.turns {
            spans.entry(a.info.session.clone()).or_default().push((
                t.saturating_sub(profile.window),
                t.saturating_add(profile.window),
                vec![ai],
            ));
        }
    }
    let mut windows: Vec<Scored> = Vec::new();
    for (session, mut list) in spans {
        list.sort();
        let mut merged: Vec<(u32, u32, Vec<usize>)> = Vec::new();
        for (a, b, who) in list {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => {
                    last.1 = last.1.max(b);
                    last.2.extend(who);
                }
                _ => merged.push((a, b, who)),
            }
        }
        let session_id = SessionId::new(session.clone())?;
        for (a, b, who) in merged {
            let turns = ctx.store.turn_range(ctx.ns, &session_id, a, b)?;
            let (Some(first), Some(last)) = (turns.first(), turns.last()) else {
                continue;
            };
            let refs: Vec<ItemRef> = turns.iter().map(|t| ItemRef::Turn(t.turn_ref())).collect();
            let r = ctx
                .store
                .scoring_vectors(ctx.ns, &refs)?
                .into_iter()
                .flatten()
                .flat_map(|v| variant_vectors.iter().map(move |q| r_of(cosine(&v, q))))
                .fold(0.0f32, f32::max);
            let mut w = Scored::new(CandidateTarget::Turns {
                first: first.turn_ref(),
                last_index: last.index,
            });
            w.field = turn_field(cfg, profile, r) as f32;
            w.r = r;
            w.info.session = session.clone();
            w.info.session_date = anchors[who[0]].info.session_date.clone();
            w.info.dialogue = turns.iter().map(turn_search_text).collect();
            w.info.text = w.info.dialogue.join("\n");
            w.info.turns = turns.iter().map(|t| t.index).collect();
            let mut focus: Vec<u32> = who
                .iter()
                .flat_map(|&ai| anchors[ai].info.turns.iter().copied())
                .filter(|t| (first.index..=last.index).contains(t))
                .collect();
            focus.sort_unstable();
            focus.dedup();
            w.info.focus = focus;
            w.provenance.channels.insert(Channel::SourceWindow);
            w.provenance.routes.insert(route_id.to_string());
            // A window is described by its own turns and text only: inheriting its anchors'
            // variants, nodes and entities made it look like a copy of them to MMR.
            windows.push(w);
        }
    }
    // Fold raw-turn hits inside a window into it, unless the hit outranks the window: then it
    // stays a candidate of its own (selection lets a chosen window replace it, not the reverse).
    let mut out: Vec<Scored> = Vec::with_capacity(candidates.len() + windows.len());
    for c in candidates {
        if let CandidateTarget::Turns { first, last_index } = &c.target
            && let Some(w) = windows.iter_mut().find(|w| match &w.target {
                CandidateTarget::Turns {
                    first: wf,
                    last_index: wl,
                } => wf.session == first.session && wf.index <= first.index && *last_index <= *wl,
                _ => false,
            })
        {
            // The window shows the hit's turn, so it ranks at least as high; a hit that
            // outranked the window also stays a candidate of its own, so dropping the window
            // cannot drop the best lexical or vector hit with it.
            // A hit that is the window's best turn has the window's field up to rounding: the
            // backends compute that similarity in different code (pgvector's distance for the
            // hit, ours for the window), so a margin below rounding is a tie, not a rank.
            let outranks = c.field > w.field + FIELD_ROUNDING;
            w.absorb(&c);
            if !outranks {
                continue;
            }
        }
        out.push(c);
    }
    out.extend(windows);
    Ok(out)
}

/// Cross-encoder rerank of the top of the pool; the score (a logit) passes through a sigmoid.
fn rerank(
    ctx: &RouteContext<'_>,
    reranker: &dyn Reranker,
    route: &Route,
    candidates: &mut [Scored],
) -> Result<()> {
    let n = ctx.cfg.rerank_floor.max(ctx.cfg.rerank_factor * ctx.k);
    candidates.sort_by(|a, b| b.field.total_cmp(&a.field).then(a.target.cmp(&b.target)));
    let len = n.min(candidates.len());
    let top = &mut candidates[..len];
    if top.is_empty() {
        return Ok(());
    }
    let mut query = format!("{} {}", ctx.question, route.goal);
    for c in &route.constraints {
        query.push_str(&format!(" {}: {}", c.kind, c.value));
    }
    let passages: Vec<&str> = top.iter().map(|c| c.info.text.as_str()).collect();
    let scores = reranker.score(&query, &passages)?;
    for (c, s) in top.iter_mut().zip(scores) {
        c.rerank = Some(1.0 / (1.0 + (-s).exp()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_core::Route;

    #[test]
    fn channel_bits_decode_to_their_channels() {
        for (i, channel) in CHANNELS.iter().enumerate() {
            assert_eq!(channel_bit(*channel), 1 << i, "{channel:?}");
        }
    }

    #[test]
    fn variants_dedupe_and_cap() {
        let route = Route {
            route_id: "r".into(),
            goal: "Where does Caroline live?".into(),
            queries: vec![
                "caroline home".into(),
                "WHERE does caroline live?".into(),
                "city".into(),
            ],
            constraints: Vec::new(),
            temporal_filter: TemporalFilter::default(),
        };
        let v = variants("Where does Caroline live?", &route, 8);
        assert_eq!(
            v,
            vec!["Where does Caroline live?", "caroline home", "city"]
        );
        assert_eq!(variants("q", &route, 2).len(), 2);
    }

    #[test]
    fn leading_variants_are_the_question_and_a_distinct_goal() {
        let mut route = Route {
            route_id: "r".into(),
            goal: "where Caroline lives".into(),
            queries: vec!["caroline home".into()],
            constraints: Vec::new(),
            temporal_filter: TemporalFilter::default(),
        };
        assert_eq!(leading_variants("Where does Caroline live?", &route, 3), 2);
        // Capped by how many variants there are.
        assert_eq!(leading_variants("Where does Caroline live?", &route, 1), 1);
        // A goal repeating the question or left empty is not a second leading variant: the
        // first query is then variant 1 and must not count as leading.
        route.goal = "WHERE does caroline live?".into();
        assert_eq!(leading_variants("Where does Caroline live?", &route, 2), 1);
        route.goal = "  ".into();
        assert_eq!(leading_variants("Where does Caroline live?", &route, 2), 1);
    }

    #[test]
    fn temporal_overlap_with_open_bounds() {
        let f = TemporalFilter {
            since: Some("2023-05-01".into()),
            until: None,
        };
        assert!(overlaps("2023-05-07", "2023-05-07", &f));
        assert!(!overlaps("2023-04-01", "2023-04-30", &f));
        let (a, b) = date_span("2023-04").unwrap();
        assert_eq!((a.as_str(), b.as_str()), ("2023-04-01", "2023-04-30"));
        assert!(overlaps(&a, &b, &TemporalFilter::default()));
    }
}
