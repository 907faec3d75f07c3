//! The online segmenter: one exchange at a time, per (namespace, session) state that survives
//! restarts (serde), three policies behind one interface, and a decision log.
//!
//! Order of decisions for each exchange `x` (docs/algorithm.md, "Order of decisions"): if the
//! active segment S is empty, start S with x; if adding x would exceed `max_tokens`, finalize S
//! (`capacity_limit`) and start S with x; else if `P_cut >= cut_threshold`, finalize S
//! (`semantic_boundary`) and start S with x; else append x, then finalize if S reached
//! `target_tokens` (`target_length`) or `max_exchanges` (`exchange_limit`). An exchange larger
//! than `max_tokens` on its own is split at turn boundaries into `oversized` segments (a single
//! turn larger than the maximum stays whole: turns are the unit of provenance; the encoder bounds
//! its text). `flush` finalizes S (`session_flush`).

use lycheemem_core::config::{SegmentConfig, SegmentPolicy};
use lycheemem_core::{FinalizeReason, Segment, SessionId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

use crate::signals;

/// One exchange as the segmenter sees it: its turn span, the tokens of each of its turns, and
/// its unit embedding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeInput {
    pub first_turn: u32,
    /// `(turn index, estimated tokens)` for each turn, in order.
    pub turn_tokens: Vec<(u32, u32)>,
    pub vector: Vec<f32>,
}

impl ExchangeInput {
    pub fn tokens(&self) -> u32 {
        self.turn_tokens.iter().map(|(_, t)| t).sum()
    }

    fn last_turn(&self) -> u32 {
        self.turn_tokens.last().map_or(self.first_turn, |(i, _)| *i)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ActiveExchange {
    first_turn: u32,
    last_turn: u32,
    tokens: u32,
    vector: Vec<f32>,
}

/// Everything the segmenter remembers about one session; serialize it to survive restarts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmenterState {
    pub session: SessionId,
    active: Vec<ActiveExchange>,
    /// Embeddings of the most recent exchanges (across segments), newest last.
    recent: VecDeque<Vec<f32>>,
    /// Ring of past surprise values (across segments of the session).
    history: VecDeque<f64>,
}

impl SegmenterState {
    pub fn new(session: SessionId) -> Self {
        SegmenterState {
            session,
            active: Vec::new(),
            recent: VecDeque::new(),
            history: VecDeque::new(),
        }
    }

    /// Tokens in the active (unfinished) segment.
    pub fn active_tokens(&self) -> u32 {
        self.active.iter().map(|e| e.tokens).sum()
    }

    /// Exchanges in the active segment.
    pub fn active_exchanges(&self) -> usize {
        self.active.len()
    }
}

/// What the segmenter did with an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Started a new active segment (S was empty).
    Start,
    /// Finalized S for the given reason and started a new one with the exchange.
    CutBefore(FinalizeReason),
    /// Appended to S.
    Append,
    /// Appended to S, then finalized S for the given reason.
    AppendThenFinalize(FinalizeReason),
    /// Emitted as its own segment(s) (`per_exchange`, or an oversized exchange).
    Alone(FinalizeReason),
}

/// Every feature of one decision (docs/algorithm.md, "Boundary signals"), for the decision log.
/// Signals are `None` when S was empty or the policy does not compute them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub first_turn: u32,
    pub exchange_tokens: u32,
    pub segment_tokens_before: u32,
    pub segment_exchanges_before: usize,
    pub surprise: Option<f64>,
    pub cohesion_drop: Option<f64>,
    pub cohesion_signal: Option<f64>,
    pub abs_signal: Option<f64>,
    pub z: Option<f64>,
    pub length_pressure: Option<f64>,
    pub turn_pressure: Option<f64>,
    pub score: Option<f64>,
    pub p_cut: Option<f64>,
    pub action: Action,
}

/// The segmenter for one configuration (stateless itself: state lives in [`SegmenterState`]).
#[derive(Debug, Clone)]
pub struct Segmenter {
    cfg: SegmentConfig,
}

impl Segmenter {
    pub fn new(cfg: SegmentConfig) -> Self {
        Segmenter { cfg }
    }

    pub fn config(&self) -> &SegmentConfig {
        &self.cfg
    }

    /// Feeds one exchange; returns the segments it finalized (in order) and the decision.
    pub fn push(&self, state: &mut SegmenterState, x: ExchangeInput) -> (Vec<Segment>, Decision) {
        let tokens = x.tokens();
        let mut decision = Decision {
            first_turn: x.first_turn,
            exchange_tokens: tokens,
            segment_tokens_before: state.active_tokens(),
            segment_exchanges_before: state.active.len(),
            surprise: None,
            cohesion_drop: None,
            cohesion_signal: None,
            abs_signal: None,
            z: None,
            length_pressure: None,
            turn_pressure: None,
            score: None,
            p_cut: None,
            action: Action::Append,
        };
        let mut out = Vec::new();
        if self.cfg.policy == SegmentPolicy::PerExchange || tokens > self.cfg.max_tokens {
            out.extend(self.finalize(state, FinalizeReason::CapacityLimit));
            let reason = if tokens > self.cfg.max_tokens {
                FinalizeReason::Oversized
            } else {
                FinalizeReason::PerExchange
            };
            out.extend(self.alone(state, &x, reason));
            decision.action = Action::Alone(reason);
            self.remember(state, &x.vector, None);
            return (out, decision);
        }
        if state.active.is_empty() {
            decision.action = Action::Start;
            self.append(state, &x);
            self.remember(state, &x.vector, None);
            return (out, decision);
        }
        let surprise = match self.cfg.policy {
            SegmentPolicy::Semantic => Some(self.score(state, &x.vector, &mut decision)),
            _ => None,
        };
        if state.active_tokens() + tokens > self.cfg.max_tokens {
            out.extend(self.finalize(state, FinalizeReason::CapacityLimit));
            decision.action = Action::CutBefore(FinalizeReason::CapacityLimit);
            self.append(state, &x);
        } else if decision.p_cut.is_some_and(|p| p >= self.cfg.cut_threshold) {
            out.extend(self.finalize(state, FinalizeReason::SemanticBoundary));
            decision.action = Action::CutBefore(FinalizeReason::SemanticBoundary);
            self.append(state, &x);
        } else {
            self.append(state, &x);
            let reason = if state.active_tokens() >= self.cfg.target_tokens {
                Some(FinalizeReason::TargetLength)
            } else if self.cfg.max_exchanges > 0
                && state.active.len() >= self.cfg.max_exchanges as usize
            {
                Some(FinalizeReason::ExchangeLimit)
            } else {
                None
            };
            if let Some(reason) = reason {
                out.extend(self.finalize(state, reason));
                decision.action = Action::AppendThenFinalize(reason);
            }
        }
        self.remember(state, &x.vector, surprise);
        (out, decision)
    }

    /// Closes the active segment (session end or explicit flush).
    pub fn flush(&self, state: &mut SegmenterState) -> Option<Segment> {
        self.finalize(state, FinalizeReason::SessionFlush)
    }

    /// Computes every signal into `d` and returns the surprise.
    fn score(&self, state: &SegmenterState, e: &[f32], d: &mut Decision) -> f64 {
        let cfg = &self.cfg;
        let vectors: Vec<&[f32]> = state.active.iter().map(|a| a.vector.as_slice()).collect();
        let centroid = signals::normalized_mean(vectors.iter().copied()).unwrap_or_default();
        let previous =
            signals::normalized_mean(state.recent.iter().map(Vec::as_slice)).unwrap_or_default();
        let s = 1.0 - signals::cos(e, &centroid).max(signals::cos(e, &previous));
        let (drop, coh) = signals::cohesion_signal(&vectors, e, cfg);
        let abs = signals::absolute_surprise_signal(s, cfg);
        let history: Vec<f64> = state.history.iter().copied().collect();
        let z = signals::robust_z(s, &history, cfg);
        let length = signals::length_pressure(state.active_tokens(), cfg);
        let turns = signals::turn_pressure(state.active.len(), cfg);
        let score = cfg.w_surprise * abs.max(cfg.z_factor * z)
            + cfg.w_cohesion * coh
            + cfg.w_length * length
            + cfg.w_turns * turns;
        d.surprise = Some(s);
        d.cohesion_drop = Some(drop);
        d.cohesion_signal = Some(coh);
        d.abs_signal = Some(abs);
        d.z = Some(z);
        d.length_pressure = Some(length);
        d.turn_pressure = Some(turns);
        d.score = Some(score);
        d.p_cut = Some(signals::cut_probability(score, cfg));
        s
    }

    fn append(&self, state: &mut SegmenterState, x: &ExchangeInput) {
        state.active.push(ActiveExchange {
            first_turn: x.first_turn,
            last_turn: x.last_turn(),
            tokens: x.tokens(),
            vector: x.vector.clone(),
        });
    }

    /// Updates the recent-exchange window and, after a scored decision, the surprise history.
    fn remember(&self, state: &mut SegmenterState, vector: &[f32], surprise: Option<f64>) {
        state.recent.push_back(vector.to_vec());
        while state.recent.len() > self.cfg.previous_window {
            state.recent.pop_front();
        }
        if let Some(s) = surprise {
            state.history.push_back(s);
            while state.history.len() > self.cfg.surprise_history {
                state.history.pop_front();
            }
        }
    }

    fn finalize(&self, state: &mut SegmenterState, reason: FinalizeReason) -> Option<Segment> {
        if state.active.is_empty() {
            return None;
        }
        let first = state.active[0].first_turn;
        let last = state.active.last().map_or(first, |e| e.last_turn);
        let segment = Segment {
            id: Segment::make_id(&state.session, first, last),
            session: state.session.clone(),
            first_turn: first,
            last_turn: last,
            exchanges: state.active.len() as u32,
            tokens: state.active_tokens(),
            reason,
        };
        state.active.clear();
        Some(segment)
    }

    /// Emits `x` as its own segment, split at turn boundaries when it exceeds `max_tokens`.
    fn alone(
        &self,
        state: &SegmenterState,
        x: &ExchangeInput,
        reason: FinalizeReason,
    ) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut chunk: Vec<(u32, u32)> = Vec::new();
        let emit = |chunk: &mut Vec<(u32, u32)>, out: &mut Vec<Segment>| {
            if let (Some(first), Some(last)) = (chunk.first(), chunk.last()) {
                out.push(Segment {
                    id: Segment::make_id(&state.session, first.0, last.0),
                    session: state.session.clone(),
                    first_turn: first.0,
                    last_turn: last.0,
                    exchanges: 1,
                    tokens: chunk.iter().map(|(_, t)| t).sum(),
                    reason,
                });
                chunk.clear();
            }
        };
        for &(turn, tokens) in &x.turn_tokens {
            let current: u32 = chunk.iter().map(|(_, t)| t).sum();
            if !chunk.is_empty() && current + tokens > self.cfg.max_tokens {
                emit(&mut chunk, &mut out);
            }
            chunk.push((turn, tokens));
        }
        emit(&mut chunk, &mut out);
        out
    }
}
