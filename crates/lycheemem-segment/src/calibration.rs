//! Per-embedder calibration of the similarity-scaled boundary signals (docs/algorithm.md,
//! "Calibration to the embedder").
//!
//! The absolute-surprise signal `clip((s − center) / scale)` and the cohesion signal
//! `drop / cohesion_scale` compare cosines against fixed numbers, but each embedder has its own
//! cosine scale: consecutive turns of a casual chat sit near cosine 0.3 under MiniLM and much
//! higher under other models. A calibration replaces the three constants by statistics of the
//! embedder's own surprise distribution, measured on unlabeled conversations:
//!
//! - `surprise_center` = the median surprise of an exchange against the previous
//!   `previous_window` exchanges of its session;
//! - `surprise_scale` = the robust spread of those surprises (`1.4826 · MAD`);
//! - `cohesion_scale` = the published cohesion scale times `surprise_scale / 0.14` (the
//!   published surprise scale), so both similarity-scaled signals stretch by the same factor.
//!
//! With the published constants read as "(median, robust spread) of the published embedder's
//! surprise", a calibrated absolute-surprise signal means the same on every embedder: how many
//! spreads an exchange's surprise lies above what is ordinary for that embedder.

use crate::signals;
use lycheemem_core::config::SegmentCalibration;
use serde::{Deserialize, Serialize};

/// The published (SPEC §1) absolute-surprise scale and cohesion scale the calibration rescales.
pub const PUBLISHED_SURPRISE_SCALE: f64 = 0.14;
pub const PUBLISHED_COHESION_SCALE: f64 = 0.06;

/// A fitted calibration and the statistics it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationFit {
    pub calibration: SegmentCalibration,
    /// Sessions and scored exchanges (every exchange after a session's first) it saw.
    pub sessions: usize,
    pub exchanges: usize,
    /// Surprise at the 10th, 25th, 50th, 75th and 90th percentiles.
    pub quantiles: [f64; 5],
}

/// The `q`-quantile (nearest rank) of `sorted`; `None` when it is empty.
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let last = sorted.len().checked_sub(1)?;
    let i = (last as f64 * q.clamp(0.0, 1.0)).round() as usize;
    Some(sorted[i.min(last)])
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    nearest_rank(sorted, q).unwrap_or(f64::NAN)
}

impl CalibrationFit {
    /// Three lines for people: what it saw, the surprise quantiles, the fitted constants.
    pub fn describe(&self) -> String {
        let (c, q) = (&self.calibration, &self.quantiles);
        format!(
            "{} sessions, {} scored exchanges\nsurprise quantiles p10 {:.3}  p25 {:.3}  p50 {:.3}  p75 {:.3}  p90 {:.3}\ncalibration: surprise_center {:.6}  surprise_scale {:.6}  cohesion_scale {:.6}",
            self.sessions,
            self.exchanges,
            q[0],
            q[1],
            q[2],
            q[3],
            q[4],
            c.surprise_center,
            c.surprise_scale,
            c.cohesion_scale
        )
    }
}

/// Fits a calibration from sessions of unit exchange vectors (each session in order).
/// `previous_window` is the segmenter's. Returns `None` with fewer than `min_exchanges` scored
/// exchanges or a zero spread (a degenerate corpus cannot calibrate anything).
pub fn fit(
    sessions: &[Vec<Vec<f32>>],
    previous_window: usize,
    min_exchanges: usize,
) -> Option<CalibrationFit> {
    let window = previous_window.max(1);
    let mut surprises = Vec::new();
    let mut used_sessions = 0;
    for session in sessions {
        if session.len() >= 2 {
            used_sessions += 1;
        }
        for i in 1..session.len() {
            let from = i.saturating_sub(window);
            let Some(previous) =
                signals::normalized_mean(session[from..i].iter().map(Vec::as_slice))
            else {
                continue; // zero vectors have no direction to compare
            };
            let s = 1.0 - signals::cos(&session[i], &previous);
            if s.is_finite() {
                surprises.push(s);
            }
        }
    }
    if surprises.len() < min_exchanges.max(2) {
        return None;
    }
    surprises.sort_by(f64::total_cmp);
    let median = quantile(&surprises, 0.5);
    let mut deviations: Vec<f64> = surprises.iter().map(|s| (s - median).abs()).collect();
    deviations.sort_by(f64::total_cmp);
    let spread = 1.4826 * quantile(&deviations, 0.5);
    if spread <= 1e-9 || !spread.is_finite() {
        return None;
    }
    Some(CalibrationFit {
        calibration: SegmentCalibration {
            surprise_center: median,
            surprise_scale: spread,
            cohesion_scale: PUBLISHED_COHESION_SCALE * spread / PUBLISHED_SURPRISE_SCALE,
        },
        sessions: used_sessions,
        exchanges: surprises.len(),
        quantiles: [0.1, 0.25, 0.5, 0.75, 0.9].map(|q| quantile(&surprises, q)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(angle: f64) -> Vec<f32> {
        vec![angle.cos() as f32, angle.sin() as f32]
    }

    #[test]
    fn median_and_spread_of_a_known_distribution() {
        // Consecutive vectors turn by alternating angles, so surprises are 1 − cos(step).
        let steps = [0.2f64, 0.4, 0.6, 0.8, 1.0];
        let mut session = vec![unit(0.0)];
        let mut angle = 0.0;
        for i in 0..50 {
            angle += steps[i % steps.len()];
            session.push(unit(angle));
        }
        let fit = fit(&[session], 1, 10).unwrap();
        assert_eq!(fit.exchanges, 50);
        assert_eq!(fit.sessions, 1);
        let expected_median = 1.0 - 0.6f64.cos();
        assert!((fit.calibration.surprise_center - expected_median).abs() < 1e-6);
        assert!(fit.calibration.surprise_scale > 0.0);
        let ratio = fit.calibration.cohesion_scale / fit.calibration.surprise_scale;
        assert!((ratio - PUBLISHED_COHESION_SCALE / PUBLISHED_SURPRISE_SCALE).abs() < 1e-9);
        assert!(fit.quantiles.windows(2).all(|w| w[0] <= w[1]));
        assert!(fit.describe().contains("50 scored exchanges"));
    }

    #[test]
    fn nearest_rank_quantiles() {
        let v = [1, 2, 3, 4, 5];
        assert_eq!(nearest_rank(&v, 0.0), Some(1));
        assert_eq!(nearest_rank(&v, 0.5), Some(3));
        assert_eq!(nearest_rank(&v, 1.0), Some(5));
        assert_eq!(nearest_rank(&v, 7.0), Some(5));
        assert_eq!(nearest_rank::<u8>(&[], 0.5), None);
    }

    #[test]
    fn too_little_or_degenerate_data_fits_nothing() {
        assert!(fit(&[vec![unit(0.0)]], 1, 1).is_none());
        assert!(fit(&[vec![unit(0.0), unit(0.5)]], 1, 5).is_none());
        // Identical vectors: zero spread.
        let same = vec![unit(0.3); 20];
        assert!(fit(&[same], 1, 5).is_none());
        // Zero vectors never panic.
        assert!(fit(&[vec![vec![0.0, 0.0]; 10]], 1, 2).is_none());
    }
}
