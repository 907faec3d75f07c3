//! The boundary signals (docs/algorithm.md, "Boundary signals") as pure functions of vectors,
//! numbers and the config.

use lycheemem_core::config::SegmentConfig;

/// Dot product of two unit vectors (their cosine).
pub fn cos(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64) * (*y as f64))
        .sum()
}

/// The normalized mean of `vectors` (`None` when empty or when the mean is the zero vector).
pub fn normalized_mean<'a>(vectors: impl IntoIterator<Item = &'a [f32]>) -> Option<Vec<f32>> {
    let mut sum: Vec<f64> = Vec::new();
    for v in vectors {
        if sum.is_empty() {
            sum = vec![0.0; v.len()];
        }
        for (s, x) in sum.iter_mut().zip(v) {
            *s += *x as f64;
        }
    }
    let norm = sum.iter().map(|x| x * x).sum::<f64>().sqrt();
    (norm > 0.0).then(|| sum.iter().map(|x| (x / norm) as f32).collect())
}

/// `Coh(V) = mean_v cos(v, c_V)`, 1.0 for a single vector.
pub fn cohesion(vectors: &[&[f32]]) -> f64 {
    if vectors.len() <= 1 {
        return 1.0;
    }
    let Some(c) = normalized_mean(vectors.iter().copied()) else {
        return 0.0;
    };
    vectors.iter().map(|v| cos(v, &c)).sum::<f64>() / vectors.len() as f64
}

/// `min(cap, max(0, Coh(S) - Coh(S ∪ {e})) / scale)` and the raw drop.
pub fn cohesion_signal(segment: &[&[f32]], e: &[f32], cfg: &SegmentConfig) -> (f64, f64) {
    let before = cohesion(segment);
    let mut with: Vec<&[f32]> = segment.to_vec();
    with.push(e);
    let drop = (before - cohesion(&with)).max(0.0);
    (drop, (drop / cfg.cohesion_scale).min(cfg.cohesion_cap))
}

/// `clip((s - center) / scale, lo, hi)`.
pub fn absolute_surprise_signal(s: f64, cfg: &SegmentConfig) -> f64 {
    ((s - cfg.abs_surprise_center) / cfg.abs_surprise_scale)
        .clamp(cfg.abs_surprise_clip.0, cfg.abs_surprise_clip.1)
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Robust z of `s` against the surprise history: 0 with fewer than `z_min_history` values,
/// else `(s - median) / (1.4826 * MAD)` (MAD 0 → 1e-6) clipped to `z_clip`.
pub fn robust_z(s: f64, history: &[f64], cfg: &SegmentConfig) -> f64 {
    if history.len() < cfg.z_min_history {
        return 0.0;
    }
    let mut sorted = history.to_vec();
    sorted.sort_by(f64::total_cmp);
    let med = median(&sorted);
    let mut dev: Vec<f64> = sorted.iter().map(|h| (h - med).abs()).collect();
    dev.sort_by(f64::total_cmp);
    let mad = median(&dev);
    let mad = if mad == 0.0 { cfg.z_mad_floor } else { mad };
    ((s - med) / (cfg.z_mad_scale * mad)).clamp(cfg.z_clip.0, cfg.z_clip.1)
}

fn lerp(a: f64, b: f64, t: f64) -> f64 {
    a + (b - a) * t
}

/// Length pressure on the segment's tokens before adding the exchange.
pub fn length_pressure(tokens: u32, cfg: &SegmentConfig) -> f64 {
    let t = tokens as f64;
    let (min, target, max) = (
        cfg.min_tokens as f64,
        cfg.target_tokens as f64,
        cfg.max_tokens as f64,
    );
    let short = cfg.length_short_fraction * min;
    if t < short {
        cfg.length_very_short
    } else if t < min {
        lerp(
            cfg.length_short.0,
            cfg.length_short.1,
            (t - short) / (min - short),
        )
    } else if t < target {
        lerp(
            cfg.length_mid.0,
            cfg.length_mid.1,
            (t - min) / (target - min),
        )
    } else if t < max {
        lerp(
            cfg.length_long.0,
            cfg.length_long.1,
            (t - target) / (max - target),
        )
    } else {
        cfg.length_over
    }
}

/// Turn pressure on the segment's exchange count.
pub fn turn_pressure(n: usize, cfg: &SegmentConfig) -> f64 {
    match n {
        0 | 1 => cfg.turns_one,
        2 => cfg.turns_two,
        3 => cfg.turns_three,
        n => (cfg.turns_base + cfg.turns_step * (n - 4) as f64).min(cfg.turns_cap),
    }
}

/// `sigmoid(bias + score)`.
pub fn cut_probability(score: f64, cfg: &SegmentConfig) -> f64 {
    1.0 / (1.0 + (-(cfg.bias + score)).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SegmentConfig {
        SegmentConfig::default()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn length_pressure_at_its_boundary_points() {
        let c = cfg(); // min 300, target 600, max 900; 0.7*min = 210
        assert!(close(length_pressure(0, &c), -1.30));
        assert!(close(length_pressure(209, &c), -1.30));
        assert!(close(length_pressure(210, &c), -0.80));
        assert!(close(length_pressure(255, &c), -0.40));
        assert!(close(length_pressure(300, &c), 0.45));
        assert!(close(length_pressure(450, &c), 1.175));
        assert!(close(length_pressure(600, &c), 1.90));
        assert!(close(length_pressure(750, &c), 2.35));
        assert!(close(length_pressure(899, &c), 1.90 + 0.9 * 299.0 / 300.0));
        assert!(close(length_pressure(900, &c), 3.00));
        assert!(close(length_pressure(5000, &c), 3.00));
    }

    #[test]
    fn turn_pressure_for_one_to_six_exchanges() {
        let c = cfg();
        let got: Vec<f64> = (1..=6).map(|n| turn_pressure(n, &c)).collect();
        let want = [-0.85, -0.15, 0.15, 0.30, 0.45, 0.60];
        for (g, w) in got.iter().zip(want) {
            assert!(close(*g, w), "{got:?}");
        }
        assert!(close(turn_pressure(12, &c), 1.0), "capped at 1.0");
    }

    #[test]
    fn robust_z_needs_history_and_floors_mad() {
        let c = cfg();
        assert_eq!(
            robust_z(0.9, &[0.1, 0.1, 0.1, 0.1], &c),
            0.0,
            "fewer than 5 values"
        );
        let h = [0.10, 0.12, 0.14, 0.16, 0.18];
        // median 0.14, MAD 0.02 → z = (0.17 - 0.14) / (1.4826 * 0.02)
        assert!(close(robust_z(0.17, &h, &c), 0.03 / (1.4826 * 0.02)));
        assert!(close(robust_z(0.9, &h, &c), 4.0), "clipped high");
        assert!(close(robust_z(0.0, &h, &c), -2.0), "clipped low");
        // MAD 0 → 1e-6: any deviation saturates, none gives 0.
        assert!(close(robust_z(0.2, &[0.1; 6], &c), 4.0));
        assert!(close(robust_z(0.1, &[0.1; 6], &c), 0.0));
    }

    #[test]
    fn absolute_surprise_and_cut_probability() {
        let c = cfg();
        assert!(close(absolute_surprise_signal(0.20, &c), 0.0));
        assert!(close(absolute_surprise_signal(0.34, &c), 1.0));
        assert!(close(absolute_surprise_signal(0.0, &c), -1.0));
        assert!(close(absolute_surprise_signal(1.0, &c), 2.5));
        assert!(close(cut_probability(1.10, &c), 0.5));
    }

    #[test]
    fn cohesion_of_identical_and_orthogonal_vectors() {
        let c = cfg();
        let a: &[f32] = &[1.0, 0.0];
        let b: &[f32] = &[0.0, 1.0];
        assert!(close(cohesion(&[a]), 1.0));
        assert!(close(cohesion(&[a, a]), 1.0));
        // Centroids are stored as f32, so compare to f32 precision.
        let near = |x: f64, y: f64| (x - y).abs() < 1e-6;
        assert!(near(cohesion(&[a, b]), std::f64::consts::FRAC_1_SQRT_2));
        let (drop, signal) = cohesion_signal(&[a, a], b, &c);
        // Coh({a,a,b}): centroid (2,1)/√5; cos = 2/√5, 2/√5, 1/√5 → mean 5/(3√5) = √5/3
        assert!(near(drop, 1.0 - 5f64.sqrt() / 3.0));
        assert!(close(signal, 2.5), "capped");
        let (drop, signal) = cohesion_signal(&[a], a, &c);
        assert!(close(drop, 0.0) && close(signal, 0.0));
    }
}
