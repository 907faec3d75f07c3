//! Segmenter behaviour over whole streams: partition, caps, determinism, restart equivalence,
//! and boundaries on synthetic streams with clear topic shifts.

use lycheemem_core::config::{SegmentConfig, SegmentPolicy};
use lycheemem_core::{FinalizeReason, Segment, SessionId};
use lycheemem_segment::{Action, ExchangeInput, Segmenter, SegmenterState};
use proptest::prelude::*;

const DIM: usize = 32;

/// A deterministic pseudo-random unit vector near `topic`'s base direction.
fn vector(topic: usize, jitter_seed: u64, noise: f32) -> Vec<f32> {
    let mut x = jitter_seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut v: Vec<f32> = (0..DIM)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let r = (x % 2001) as f32 / 1000.0 - 1.0;
            (if i == topic % DIM { 1.0 } else { 0.0 }) + noise * r
        })
        .collect();
    let n = v.iter().map(|a| a * a).sum::<f32>().sqrt();
    v.iter_mut().for_each(|a| *a /= n);
    v
}

fn exchange(turn: u32, tokens: u32, vector: Vec<f32>) -> ExchangeInput {
    ExchangeInput {
        first_turn: turn,
        turn_tokens: vec![(turn, tokens)],
        vector,
    }
}

/// Feeds the stream, calling `before_each(i, state)` before exchange `i`, then flushes.
fn run_with(
    seg: &Segmenter,
    stream: &[ExchangeInput],
    mut before_each: impl FnMut(usize, &mut SegmenterState),
) -> Vec<Segment> {
    let mut state = SegmenterState::new(SessionId::new("s").unwrap());
    let mut out = Vec::new();
    for (i, x) in stream.iter().enumerate() {
        before_each(i, &mut state);
        out.extend(seg.push(&mut state, x.clone()).0);
    }
    out.extend(seg.flush(&mut state));
    out
}

fn run(seg: &Segmenter, stream: &[ExchangeInput]) -> Vec<Segment> {
    run_with(seg, stream, |_, _| {})
}

/// Topics of `len` exchanges each, `tokens` per exchange.
fn topic_stream(topics: &[usize], len: usize, tokens: u32) -> Vec<ExchangeInput> {
    let mut stream = Vec::new();
    for (t, &topic) in topics.iter().enumerate() {
        for j in 0..len {
            let turn = (t * len + j) as u32;
            stream.push(exchange(turn, tokens, vector(topic, turn as u64 + 1, 0.08)));
        }
    }
    stream
}

#[test]
fn boundaries_fall_at_topic_shifts_and_nowhere_mid_topic() {
    let seg = Segmenter::new(SegmentConfig::default());
    let stream = topic_stream(&[0, 5, 11, 17, 23], 5, 45);
    let segments = run(&seg, &stream);
    let starts: Vec<u32> = segments.iter().map(|s| s.first_turn).collect();
    assert_eq!(starts, [0, 5, 10, 15, 20], "{segments:#?}");
    assert!(
        segments[1..]
            .iter()
            .zip(&segments)
            .all(|(_, prev)| prev.reason == FinalizeReason::SemanticBoundary)
    );
    assert_eq!(
        segments.last().unwrap().reason,
        FinalizeReason::SessionFlush
    );
}

#[test]
fn fixed_window_ignores_topics() {
    let cfg = SegmentConfig {
        policy: SegmentPolicy::FixedWindow,
        ..Default::default()
    };
    let segments = run(&Segmenter::new(cfg), &topic_stream(&[0, 5, 11], 5, 45));
    // 15 exchanges × 45 tokens: windows close at 10 exchanges (450 tokens < 600 target).
    let spans: Vec<(u32, u32, FinalizeReason)> = segments
        .iter()
        .map(|s| (s.first_turn, s.last_turn, s.reason))
        .collect();
    assert_eq!(
        spans,
        [
            (0, 9, FinalizeReason::ExchangeLimit),
            (10, 14, FinalizeReason::SessionFlush)
        ]
    );
}

#[test]
fn per_exchange_makes_every_exchange_a_segment() {
    let cfg = SegmentConfig {
        policy: SegmentPolicy::PerExchange,
        ..Default::default()
    };
    let segments = run(&Segmenter::new(cfg), &topic_stream(&[0, 5], 3, 45));
    assert_eq!(segments.len(), 6);
    assert!(
        segments
            .iter()
            .all(|s| s.reason == FinalizeReason::PerExchange && s.first_turn == s.last_turn)
    );
}

#[test]
fn oversized_exchange_is_split_at_turn_boundaries() {
    let seg = Segmenter::new(SegmentConfig::default());
    let mut state = SegmenterState::new(SessionId::new("s").unwrap());
    seg.push(&mut state, exchange(0, 100, vector(0, 1, 0.05)));
    let big = ExchangeInput {
        first_turn: 1,
        turn_tokens: vec![(1, 500), (2, 500), (3, 300), (4, 2000)],
        vector: vector(0, 2, 0.05),
    };
    let (segments, decision) = seg.push(&mut state, big);
    assert_eq!(decision.action, Action::Alone(FinalizeReason::Oversized));
    let spans: Vec<(u32, u32, FinalizeReason)> = segments
        .iter()
        .map(|s| (s.first_turn, s.last_turn, s.reason))
        .collect();
    assert_eq!(
        spans,
        [
            (0, 0, FinalizeReason::CapacityLimit),
            (1, 1, FinalizeReason::Oversized),
            (2, 3, FinalizeReason::Oversized),
            (4, 4, FinalizeReason::Oversized)
        ]
    );
    assert_eq!(state.active_exchanges(), 0);
}

#[test]
fn decision_log_records_every_feature() {
    let seg = Segmenter::new(SegmentConfig::default());
    let mut state = SegmenterState::new(SessionId::new("s").unwrap());
    let stream = topic_stream(&[0, 9], 3, 45);
    let decisions: Vec<_> = stream
        .iter()
        .map(|x| seg.push(&mut state, x.clone()).1)
        .collect();
    assert_eq!(decisions[0].action, Action::Start);
    assert!(decisions[0].p_cut.is_none());
    let shift = &decisions[3];
    assert_eq!(
        shift.action,
        Action::CutBefore(FinalizeReason::SemanticBoundary)
    );
    for f in [
        shift.surprise,
        shift.cohesion_drop,
        shift.cohesion_signal,
        shift.abs_signal,
        shift.z,
        shift.length_pressure,
        shift.turn_pressure,
        shift.score,
        shift.p_cut,
    ] {
        assert!(f.is_some_and(f64::is_finite));
    }
    assert!(shift.surprise.unwrap() > 0.5 && decisions[1].surprise.unwrap() < 0.2);
}

#[test]
fn a_restart_mid_stream_yields_the_same_segments() {
    let seg = Segmenter::new(SegmentConfig::default());
    let stream = topic_stream(&[0, 5, 11, 17], 6, 70);
    let uninterrupted = run(&seg, &stream);
    let out = run_with(&seg, &stream, |i, state| {
        if i % 7 == 3 {
            // Persist and reload the state as a process restart would.
            let saved = serde_json::to_string(&*state).unwrap();
            *state = serde_json::from_str(&saved).unwrap();
        }
    });
    assert_eq!(out, uninterrupted);
}

fn arbitrary_stream() -> impl Strategy<Value = Vec<(usize, u32)>> {
    prop::collection::vec((0usize..4, 1u32..400), 1..60)
}

fn to_inputs(spec: &[(usize, u32)]) -> Vec<ExchangeInput> {
    spec.iter()
        .enumerate()
        .map(|(i, &(topic, tokens))| {
            exchange(i as u32, tokens, vector(topic * 7, i as u64 + 3, 0.3))
        })
        .collect()
}

proptest! {
    #[test]
    fn segments_partition_the_stream_in_order_within_caps(spec in arbitrary_stream(), policy in 0usize..3) {
        let policy = [SegmentPolicy::Semantic, SegmentPolicy::FixedWindow, SegmentPolicy::PerExchange][policy];
        let cfg = SegmentConfig { policy, ..Default::default() };
        let stream = to_inputs(&spec);
        let segments = run(&Segmenter::new(cfg.clone()), &stream);
        let mut next = 0u32;
        for s in &segments {
            prop_assert_eq!(s.first_turn, next);
            prop_assert!(s.last_turn >= s.first_turn);
            next = s.last_turn + 1;
            prop_assert!(s.tokens <= cfg.max_tokens, "{:?}", s);
            prop_assert!(s.exchanges <= cfg.max_exchanges);
        }
        prop_assert_eq!(next as usize, stream.len());
        prop_assert_eq!(segments.iter().map(|s| s.tokens).sum::<u32>(), spec.iter().map(|s| s.1).sum::<u32>());
        // Same input, same segments.
        prop_assert_eq!(run(&Segmenter::new(cfg), &stream), segments);
    }
}
