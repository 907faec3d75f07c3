//! LiCoMemory's scores as pure functions (docs/licomemory.md, "Read path"; SPEC-licomemory §3):
//! the anchor score, the pool pre-score, session relevance, the Weibull decay, CogniRank and
//! SimpleRank.

use lycheemem_core::config::LicoMemoryConfig;
use lycheemem_core::date::parse_date;

/// Anchor score of a graph entity for one query entity:
/// `entity_cosine_weight · cos + entity_type_weight · [same type]`.
pub fn anchor_score(cos: f32, same_type: bool, cfg: &LicoMemoryConfig) -> f32 {
    cfg.entity_cosine_weight * cos
        + if same_type {
            cfg.entity_type_weight
        } else {
            0.0
        }
}

/// Pool pre-score of a triple: `cos(question, triple) + rank_bonus · max(1/(r_src+1),
/// 1/(r_tgt+1))`, with `r` the anchor rank of each end (`anchor_entities` when it is not an
/// anchor).
pub fn pre_score(cos: f32, rank_src: usize, rank_tgt: usize, cfg: &LicoMemoryConfig) -> f32 {
    let bonus = |r: usize| 1.0 / (r as f32 + 1.0);
    cos + cfg.rank_bonus * bonus(rank_src).max(bonus(rank_tgt))
}

/// Session relevance `Ss`: the mean of the `top` highest query × key cosines (of all there are
/// when fewer); 0 for none.
pub fn session_score(mut cosines: Vec<f32>, top: usize) -> f32 {
    cosines.retain(|c| c.is_finite());
    if cosines.is_empty() || top == 0 {
        return 0.0;
    }
    cosines.sort_by(|a, b| b.total_cmp(a));
    cosines.truncate(top);
    cosines.iter().sum::<f32>() / cosines.len() as f32
}

/// Days between two dates, absolute (a date after the question counts like one before it);
/// `None` when either is missing or unreadable.
pub fn day_gap(question_date: Option<&str>, date: Option<&str>) -> Option<f64> {
    let q = parse_date(question_date?)?.date.first_day();
    let d = parse_date(date?)?.date.first_day();
    Some((q - d).num_days().unsigned_abs() as f64)
}

/// The median of `gaps` (0 for none).
pub fn median(gaps: &[f64]) -> f64 {
    let mut v: Vec<f64> = gaps.iter().copied().filter(|g| g.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The decay scale τ̂ of a pool: its median gap, at least `decay_scale_floor_days`.
pub fn decay_scale(gaps: &[f64], cfg: &LicoMemoryConfig) -> f64 {
    median(gaps).max(cfg.decay_scale_floor_days)
}

/// Weibull survival `exp(-(gap/scale)^shape)`; 1 at gap 0.
pub fn weibull(gap: f64, scale: f64, shape: f64) -> f64 {
    if gap <= 0.0 || scale <= 0.0 {
        return 1.0;
    }
    (-(gap / scale).powf(shape)).exp()
}

/// The final score of a triple: CogniRank `S_sem · w` with `S_sem = summary_weight · Ss +
/// (1 − summary_weight) · St` (a session relevance of 0 or less counts as
/// `session_score_floor`) and `w` the Weibull decay of the gap (1 with `temporal_decay` off);
/// with `cogni_rank` off the
/// authors' SimpleRank `(1 − summary_weight) · St + summary_weight · Ss`.
pub fn triple_score(st: f32, ss: f32, gap: f64, scale: f64, cfg: &LicoMemoryConfig) -> f32 {
    let w = cfg.summary_weight;
    if !cfg.cogni_rank {
        return (1.0 - w) * st + w * ss;
    }
    let ss = if ss > 0.0 {
        ss
    } else {
        cfg.session_score_floor
    };
    let sem = w * ss + (1.0 - w) * st;
    if !cfg.temporal_decay {
        return sem;
    }
    sem * weibull(gap, scale, cfg.weibull_shape) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3
    }

    #[test]
    fn the_weibull_decay_matches_the_spec_table() {
        // SPEC-licomemory §3 step 5: k = 0.1 → 1, 0.45, 0.37, 0.28; k = 0.5 → 1, 0.73, 0.37, 0.04.
        for (shape, want) in [
            (0.1, [1.0, 0.45, 0.37, 0.28]),
            (0.5, [1.0, 0.73, 0.37, 0.04]),
        ] {
            for (ratio, w) in [0.0, 0.1, 1.0, 10.0].into_iter().zip(want) {
                let got = weibull(ratio * 30.0, 30.0, shape);
                assert!((got - w).abs() < 0.006, "k {shape} ratio {ratio}: {got}");
            }
        }
    }

    #[test]
    fn gaps_are_absolute_days_and_missing_dates_give_none() {
        assert_eq!(day_gap(Some("2023-05-08"), Some("2023-05-01")), Some(7.0));
        // A triple dated after the question is as far as one before it.
        assert_eq!(day_gap(Some("2023-05-08"), Some("2023-05-15")), Some(7.0));
        // LoCoMo's session-date format and a date-time question.
        assert_eq!(
            day_gap(Some("2023-05-08T13:56:00"), Some("1:56 pm on 8 May, 2023")),
            Some(0.0)
        );
        assert_eq!(day_gap(None, Some("2023-05-01")), None);
        assert_eq!(day_gap(Some("2023-05-08"), Some("someday")), None);
    }

    #[test]
    fn the_decay_scale_is_the_median_gap_floored_at_one_day() {
        let cfg = LicoMemoryConfig::default();
        assert_eq!(decay_scale(&[0.0, 0.0, 0.0], &cfg), 1.0);
        assert_eq!(decay_scale(&[2.0, 40.0, 10.0], &cfg), 10.0);
        assert_eq!(decay_scale(&[2.0, 40.0, 10.0, 20.0], &cfg), 15.0);
        assert_eq!(decay_scale(&[], &cfg), 1.0);
    }

    #[test]
    fn cogni_rank_by_hand() {
        let cfg = LicoMemoryConfig::default();
        // St 0.6, Ss 0.5, same day: 0.2·0.5 + 0.8·0.6 = 0.58, w = 1.
        assert!(close(
            f64::from(triple_score(0.6, 0.5, 0.0, 10.0, &cfg)),
            0.58
        ));
        // Gap = scale: w = e^-1 → 0.58 · 0.3679 = 0.2134.
        assert!(close(
            f64::from(triple_score(0.6, 0.5, 10.0, 10.0, &cfg)),
            0.2134
        ));
        // Ss 0 counts as the 0.01 floor: 0.002 + 0.48 = 0.482.
        assert!(close(
            f64::from(triple_score(0.6, 0.0, 0.0, 10.0, &cfg)),
            0.482
        ));
        // SimpleRank: 0.8·0.6 + 0.2·0 = 0.48, no decay, no floor.
        // Without the decay: S_sem alone, floor kept.
        let no_decay = LicoMemoryConfig {
            temporal_decay: false,
            ..LicoMemoryConfig::default()
        };
        assert!(close(
            f64::from(triple_score(0.6, 0.0, 100.0, 1.0, &no_decay)),
            0.482
        ));
        let simple = LicoMemoryConfig::authors_shipped();
        assert!(close(
            f64::from(triple_score(0.6, 0.0, 100.0, 1.0, &simple)),
            0.48
        ));
    }

    #[test]
    fn pre_score_session_score_and_anchor_score_by_hand() {
        let cfg = LicoMemoryConfig::default();
        // Ends ranked 0 and not an anchor (5): bonus 0.2 · max(1, 1/6) = 0.2.
        assert!(close(f64::from(pre_score(0.5, 0, 5, &cfg)), 0.7));
        // Ends ranked 2 and 3: 0.2 · 1/3.
        assert!(close(f64::from(pre_score(0.5, 3, 2, &cfg)), 0.5667));
        assert!(close(
            f64::from(session_score(vec![0.1, 0.9, 0.5, 0.7], 3)),
            0.7
        ));
        assert!(close(f64::from(session_score(vec![0.4], 3)), 0.4));
        assert_eq!(session_score(vec![], 3), 0.0);
        assert!(close(f64::from(anchor_score(0.5, true, &cfg)), 0.65));
        assert!(close(f64::from(anchor_score(0.5, false, &cfg)), 0.35));
        assert_eq!(cfg.pool_size(), 40);
    }
}
