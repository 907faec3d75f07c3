//! Scoring: LoCoMo's official token F1, evidence recall over retrieved turns, and the LLM judge
//! (our own prompts following each benchmark's official rules).

use crate::dataset::{DatasetKind, Question, TurnAt};
use anyhow::Result;
use lycheemem_core::usage::{Purpose, TokenUsage};
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm};
use rust_stemmers::{Algorithm, Stemmer};
use std::collections::{BTreeSet, HashMap};
use std::sync::LazyLock;

static STEMMER: LazyLock<Stemmer> = LazyLock::new(|| Stemmer::create(Algorithm::English));

/// LoCoMo's `normalize_answer`: drop commas, lowercase, strip punctuation, drop the words
/// a/an/the/and, collapse whitespace.
pub fn normalize_answer(s: &str) -> String {
    let lower = s.replace(',', "").to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the" | "and"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn stems(s: &str) -> Vec<String> {
    normalize_answer(s)
        .split_whitespace()
        .map(|w| STEMMER.stem(w).into_owned())
        .collect()
}

/// Token-level F1 of stemmed, normalized tokens (LoCoMo `f1_score`).
pub fn token_f1(prediction: &str, gold: &str) -> f64 {
    let p = stems(prediction);
    let g = stems(gold);
    if p.is_empty() || g.is_empty() {
        return 0.0;
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for t in &g {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0i64;
    for t in &p {
        if let Some(c) = counts.get_mut(t.as_str())
            && *c > 0
        {
            *c -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / p.len() as f64;
    let recall = same as f64 / g.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// LoCoMo's per-category F1: category 1 scores each comma-separated gold sub-answer by its best
/// match among the prediction's comma-separated parts and averages; category 3 cuts the gold
/// at the first `;`; category 5 is 1 when the prediction says the information is not there.
pub fn locomo_f1(prediction: &str, gold: &str, category: u32) -> f64 {
    match category {
        1 => {
            let preds: Vec<&str> = prediction.split(',').map(str::trim).collect();
            let golds: Vec<&str> = gold.split(',').map(str::trim).collect();
            golds
                .iter()
                .map(|g| preds.iter().map(|p| token_f1(p, g)).fold(0.0f64, f64::max))
                .sum::<f64>()
                / golds.len() as f64
        }
        3 => token_f1(prediction, gold.split(';').next().unwrap_or("").trim()),
        5 => {
            let p = prediction.to_lowercase();
            f64::from(u8::from(
                p.contains("no information available") || p.contains("not mentioned"),
            ))
        }
        _ => token_f1(prediction, gold),
    }
}

/// Share of the question's evidence turns present among `retrieved` (`None` when the question
/// has no evidence).
pub fn turn_recall(evidence: &[TurnAt], retrieved: &BTreeSet<TurnAt>) -> Option<f64> {
    if evidence.is_empty() {
        return None;
    }
    let hit = evidence.iter().filter(|t| retrieved.contains(t)).count();
    Some(hit as f64 / evidence.len() as f64)
}

/// Share of the question's evidence sessions touched by `retrieved`.
pub fn session_recall(sessions: &[String], retrieved: &BTreeSet<TurnAt>) -> Option<f64> {
    if sessions.is_empty() {
        return None;
    }
    let touched: BTreeSet<&str> = retrieved.iter().map(|t| t.session.as_str()).collect();
    let hit = sessions
        .iter()
        .filter(|s| touched.contains(s.as_str()))
        .count();
    Some(hit as f64 / sessions.len() as f64)
}

/// The judge's decision and what it cost (judge tokens are reported apart from the system's).
#[derive(Debug, Clone)]
pub struct Verdict {
    pub correct: bool,
    pub raw: String,
    pub usage: TokenUsage,
}

fn judge_rules(kind: DatasetKind, q: &Question) -> &'static str {
    match kind {
        DatasetKind::Locomo if q.abstention => {
            "The question asks about something the conversation never mentions. The response is \
             CORRECT only if it says the information is not available (or not mentioned)."
        }
        DatasetKind::Locomo => {
            "Be generous about phrasing: the response is CORRECT if it contains the same fact as the \
             gold answer, even if longer or worded differently. For time questions it is CORRECT \
             if it names the same date or period in any format (e.g. \"May 7th\" vs \"7 May\"). It \
             is WRONG if it misses, contradicts or only partly gives the gold answer, or refuses."
        }
        DatasetKind::LongMemEval if q.abstention => {
            "The gold answer explains why the question cannot be answered. The response is CORRECT \
             only if it says the information is not available or cannot be determined."
        }
        DatasetKind::LongMemEval => match q.category.as_str() {
            "temporal-reasoning" => {
                "The response is CORRECT if it contains the gold answer; equivalent wording is fine. \
                 Off-by-one errors in counts of days, weeks or months are tolerated. A response \
                 with only part of the answer is WRONG."
            }
            "knowledge-update" => {
                "The response is CORRECT if it gives the updated (gold) answer, even if it also \
                 mentions older values. A response with only an outdated value is WRONG."
            }
            "single-session-preference" => {
                "The gold answer is a rubric of what a personalized response should use. The \
                 response is CORRECT if it recalls and uses the user's personal information as the \
                 rubric describes; it need not cover every point."
            }
            _ => {
                "The response is CORRECT if it contains the gold answer; equivalent wording is \
                 fine. A response with only part of the answer is WRONG."
            }
        },
    }
}

/// The judge prompt for one prediction.
pub fn judge_messages(kind: DatasetKind, q: &Question, prediction: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::system(
            "You grade answers of a memory system. Reply with JSON {\"verdict\": \"CORRECT\"} or \
             {\"verdict\": \"WRONG\"} and nothing else.",
        ),
        ChatMessage::user(format!(
            "Rule: {}\n\nQuestion: {}\nGold answer: {}\nResponse: {}\n\nVerdict?",
            judge_rules(kind, q),
            q.question,
            q.answer,
            prediction
        )),
    ]
}

fn verdict_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {"verdict": {"type": "string", "enum": ["CORRECT", "WRONG"]}},
        "required": ["verdict"],
        "additionalProperties": false
    })
}

/// Asks the judge (temperature 0, a tiny constrained reply).
pub fn judge(llm: &dyn Llm, kind: DatasetKind, q: &Question, prediction: &str) -> Result<Verdict> {
    let options = GenerateOptions {
        max_tokens: 16,
        temperature: 0.0,
        json_schema: Some(verdict_schema()),
        ..Default::default()
    };
    let c = llm.complete(&judge_messages(kind, q, prediction), &options)?;
    let upper = c.text.to_uppercase();
    let correct = upper.contains("CORRECT") && !upper.contains("WRONG");
    Ok(Verdict {
        correct,
        raw: c.text.clone(),
        usage: TokenUsage {
            purpose: Purpose::Judge,
            model: c.model.clone(),
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            latency_ms: c.latency_ms,
            estimated: c.usage_estimated,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f1_follows_the_official_definition() {
        assert_eq!(normalize_answer("The cat, and a Dog!"), "cat dog");
        assert!((token_f1("The cats", "cat") - 1.0).abs() < 1e-9, "stemmed");
        assert_eq!(token_f1("", "cat"), 0.0);
        assert_eq!(token_f1("dog", "cat"), 0.0);
        // 1 shared of 2 predicted and 1 gold: P 0.5, R 1 → 2/3.
        assert!((token_f1("black cat", "cat") - 2.0 / 3.0).abs() < 1e-9);
        // Category 1: gold "Paris, Rome" vs prediction "Rome": (0 + 1) / 2.
        assert!((locomo_f1("Rome", "Paris, Rome", 1) - 0.5).abs() < 1e-9);
        assert!((locomo_f1("hiking", "hiking; also camping", 3) - 1.0).abs() < 1e-9);
        assert_eq!(locomo_f1("That is not mentioned.", "x", 5), 1.0);
        assert_eq!(locomo_f1("Yes, it was.", "x", 5), 0.0);
    }

    #[test]
    fn recall_counts_evidence_turns_and_sessions() {
        let at = |s: &str, i| TurnAt {
            session: s.into(),
            index: i,
        };
        let got: BTreeSet<TurnAt> = [at("a", 1), at("b", 0)].into();
        assert_eq!(turn_recall(&[at("a", 1), at("a", 2)], &got), Some(0.5));
        assert_eq!(turn_recall(&[], &got), None);
        assert_eq!(session_recall(&["b".into(), "c".into()], &got), Some(0.5));
    }

    #[test]
    fn judge_reads_the_constrained_verdict() {
        let q = Question {
            id: "q".into(),
            category: "single_hop".into(),
            category_number: 4,
            question: "What pet?".into(),
            answer: "a cat".into(),
            evidence: vec![],
            evidence_sessions: vec![],
            date: None,
            abstention: false,
        };
        let llm = lycheemem_testkit::ScriptedLlm::new(&[
            r#"{"verdict": "CORRECT"}"#,
            r#"{"verdict": "WRONG"}"#,
        ]);
        assert!(
            judge(&llm, DatasetKind::Locomo, &q, "a cat")
                .unwrap()
                .correct
        );
        assert!(
            !judge(&llm, DatasetKind::Locomo, &q, "a dog")
                .unwrap()
                .correct
        );
        let prompt = &judge_messages(DatasetKind::Locomo, &q, "x")[1].content;
        assert!(prompt.contains("Gold answer: a cat"));
    }
}
