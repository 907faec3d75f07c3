//! The symbolic similarity MMR uses between two candidates (docs/algorithm.md, "Read path:
//! selection"):
//! `min(1, .15·same session + .20·J(entities) + .15·J(matched variants) + .15·J(evidence nodes)
//! + .10·J(turns) + .25·J(word tokens))`, with J the Jaccard index.

use lycheemem_core::config::SimilarityWeights;
use std::collections::BTreeSet;

use crate::candidate::Scored;

/// The sets compared for one candidate.
#[derive(Debug, Clone, Default)]
pub struct Signature {
    pub session: String,
    pub entities: BTreeSet<String>,
    pub variants: BTreeSet<usize>,
    pub nodes: BTreeSet<String>,
    pub turns: BTreeSet<(String, u32)>,
    pub words: BTreeSet<String>,
}

impl Signature {
    pub fn of(c: &Scored) -> Signature {
        Signature {
            session: c.info.session.clone(),
            entities: c.info.entities.iter().map(|e| e.to_lowercase()).collect(),
            variants: c.provenance.variants.clone(),
            nodes: c.provenance.nodes.clone(),
            turns: c
                .info
                .turns
                .iter()
                .map(|t| (c.info.session.clone(), *t))
                .collect(),
            words: words(&c.info.text),
        }
    }
}

/// Lower-cased alphanumeric tokens of two or more characters.
pub fn words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().count() >= 2)
        .map(str::to_lowercase)
        .collect()
}

fn jaccard<T: Ord>(a: &BTreeSet<T>, b: &BTreeSet<T>) -> f64 {
    if a.is_empty() && b.is_empty() {
        return 0.0;
    }
    let inter = a.intersection(b).count() as f64;
    inter / (a.len() as f64 + b.len() as f64 - inter)
}

/// The MMR similarity of two candidates' signatures, in [0, 1].
pub fn similarity(a: &Signature, b: &Signature, w: &SimilarityWeights) -> f64 {
    let same_session = if !a.session.is_empty() && a.session == b.session {
        1.0
    } else {
        0.0
    };
    (w.same_session * same_session
        + w.entities * jaccard(&a.entities, &b.entities)
        + w.variants * jaccard(&a.variants, &b.variants)
        + w.nodes * jaccard(&a.nodes, &b.nodes)
        + w.turns * jaccard(&a.turns, &b.turns)
        + w.words * jaccard(&a.words, &b.words))
    .min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(session: &str, text: &str, entities: &[&str]) -> Signature {
        Signature {
            session: session.into(),
            entities: entities.iter().map(|e| e.to_string()).collect(),
            words: words(text),
            ..Signature::default()
        }
    }

    #[test]
    fn jaccard_values() {
        let a: BTreeSet<u32> = [1, 2, 3].into();
        let b: BTreeSet<u32> = [2, 3, 4].into();
        assert!((jaccard(&a, &b) - 0.5).abs() < 1e-12);
        assert_eq!(jaccard(&a, &a), 1.0);
        assert_eq!(jaccard(&BTreeSet::<u32>::new(), &BTreeSet::new()), 0.0);
    }

    #[test]
    fn near_duplicates_are_similar_and_unrelated_items_are_not() {
        let w = SimilarityWeights::default();
        let a = sig(
            "s1",
            "Caroline adopted a dog named Rex",
            &["caroline", "rex"],
        );
        let b = sig(
            "s1",
            "Caroline adopted a dog called Rex",
            &["caroline", "rex"],
        );
        let c = sig("s2", "Melanie painted a sunrise", &["melanie"]);
        assert!(similarity(&a, &b, &w) > 0.5);
        assert!(similarity(&a, &c, &w) < 0.1);
        assert!(similarity(&a, &a, &w) <= 1.0);
    }
}
