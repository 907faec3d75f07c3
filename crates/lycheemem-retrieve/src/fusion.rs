//! Fusion across routes and the final selection (SPEC §4), as pure functions over scored
//! candidates:
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
use lycheemem_core::{CandidateTarget, QuestionType};
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

/// RRF over the routes' ranked lists (each sorted by route score, best first).
pub fn fuse(routes: &[(String, Vec<Scored>)], k: usize, cfg: &RetrievalConfig) -> Vec<Fused> {
    let quota = route_quota(k, routes.len(), cfg);
    let depth = (cfg.rrf_depth_factor * k).max(4 * quota);
    let mut by_target: HashMap<CandidateTarget, Fused> = HashMap::new();
    let mut order: Vec<CandidateTarget> = Vec::new();
    for (route_id, list) in routes {
        let mut ranked: Vec<&Scored> = list.iter().collect();
        ranked.sort_by(|a, b| {
            b.route_score
                .total_cmp(&a.route_score)
                .then(a.target.cmp(&b.target))
        });
        for (rank, c) in ranked.into_iter().enumerate() {
            let contribution = if rank < depth {
                1.0 / (cfg.rrf_kappa as f32 + (rank + 1) as f32)
            } else {
                0.0
            };
            let entry = by_target.entry(c.target.clone()).or_insert_with(|| {
                order.push(c.target.clone());
                Fused {
                    candidate: c.clone(),
                    best: c.route_score,
                    rrf: 0.0,
                    final_score: 0.0,
                    routes: BTreeSet::new(),
                }
            });
            entry.rrf += contribution;
            entry.routes.insert(route_id.clone());
            if c.route_score > entry.best {
                let provenance = entry.candidate.provenance.clone();
                entry.candidate = c.clone();
                entry.candidate.provenance.merge(&provenance);
                entry.best = c.route_score;
            } else {
                entry.candidate.provenance.merge(&c.provenance);
            }
        }
    }
    let max_rrf = by_target
        .values()
        .map(|f| f.rrf)
        .fold(0.0f32, f32::max)
        .max(f32::MIN_POSITIVE);
    let mut out: Vec<Fused> = order
        .into_iter()
        .filter_map(|t| by_target.remove(&t))
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

/// `(budget, ratio)` of the raw-turn limiter for a question type.
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

/// Chooses `k` candidates: route quotas first, then the best of the rest, each pick by MMR
/// over a pool of `mmr_pool_factor·k`, under the raw-turn limiter.
pub fn select(
    fused: Vec<Fused>,
    route_ids: &[String],
    k: usize,
    qt: QuestionType,
    cfg: &RetrievalConfig,
) -> Vec<Selected> {
    let quota = route_quota(k, route_ids.len(), cfg);
    let pool_size = (cfg.mmr_pool_factor * k).max(k);
    // The pool: the best by final score, plus each route's best `quota` so quotas can be met.
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
    let pool: Vec<Fused> = fused
        .into_iter()
        .zip(in_pool)
        .filter_map(|(f, keep)| keep.then_some(f))
        .collect();
    let signatures: Vec<Signature> = pool.iter().map(|f| Signature::of(&f.candidate)).collect();
    let best_record = pool
        .iter()
        .filter(|f| !f.candidate.is_raw())
        .map(|f| f.final_score)
        .fold(0.0f32, f32::max);
    let (raw_budget, score_ratio) = limiter(qt, k, cfg);
    let raw_floor = (cfg.raw_score_floor as f32).max(score_ratio * best_record);

    let mut chosen: Vec<usize> = Vec::new();
    let mut mmr_scores: Vec<f32> = Vec::new();
    let mut raw_count = 0usize;
    let mut covered: BTreeSet<String> = BTreeSet::new();
    // Each pool item's similarity to its nearest chosen item, updated after every pick.
    let mut max_sim = vec![0f64; pool.len()];
    let objective = |i: usize, max_sim: &[f64]| -> f32 {
        if cfg.mmr {
            (cfg.mmr_relevance * f64::from(pool[i].final_score) - cfg.mmr_redundancy * max_sim[i])
                as f32
        } else {
            pool[i].final_score
        }
    };
    let admissible = |i: usize, raw_count: usize, covered: &BTreeSet<String>| -> bool {
        let f = &pool[i];
        if !f.candidate.is_raw() {
            return true;
        }
        let covers_new_route = f.routes.iter().any(|r| !covered.contains(r));
        (raw_count < raw_budget && f.final_score >= raw_floor) || covers_new_route
    };
    let mut pick =
        |only_route: Option<&String>, chosen: &mut Vec<usize>, max_sim: &mut Vec<f64>| -> bool {
            let best = (0..pool.len())
                .filter(|i| only_route.is_none_or(|r| pool[*i].routes.contains(r)))
                .filter(|i| !chosen.contains(i) && admissible(*i, raw_count, &covered))
                .map(|i| (i, objective(i, max_sim)))
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
            let Some((i, score)) = best else {
                return false;
            };
            chosen.push(i);
            mmr_scores.push(score);
            if pool[i].candidate.is_raw() {
                raw_count += 1;
            }
            covered.extend(pool[i].routes.iter().cloned());
            if cfg.mmr {
                for (j, m) in max_sim.iter_mut().enumerate() {
                    *m = m.max(similarity(&signatures[j], &signatures[i], &cfg.similarity));
                }
            }
            true
        };
    // Route quotas, route by route.
    for route in route_ids {
        for _ in 0..quota {
            if chosen.len() >= k || !pick(Some(route), &mut chosen, &mut max_sim) {
                break;
            }
        }
    }
    // Then the rest.
    while chosen.len() < k && pick(None, &mut chosen, &mut max_sim) {}
    chosen
        .into_iter()
        .zip(mmr_scores)
        .map(|(i, mmr_score)| Selected {
            fused: pool[i].clone(),
            mmr_score,
        })
        .collect()
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
        let fused = fuse(&routes, 15, &cfg());
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
            fuse(&routes, 4, &cfg()),
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
        let picked = select(
            fuse(&routes, 2, &cfg()),
            &ids,
            2,
            QuestionType::Single,
            &cfg(),
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
        let mut no_mmr = cfg();
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
            fuse(&routes, 2, &no_mmr),
            &ids,
            2,
            QuestionType::Single,
            &no_mmr,
        );
        assert!(
            matches!(&picked[1].fused.candidate.target, CandidateTarget::Record { record_id } if record_id == "dup")
        );
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
        let picked = select(
            fuse(&routes, 5, &cfg()),
            &ids,
            5,
            QuestionType::Single,
            &cfg(),
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
