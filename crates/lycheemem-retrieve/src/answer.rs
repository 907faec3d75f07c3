//! The answer call (docs/algorithm.md, "Answer prompt"): the question with its reference date
//! and two evidence blocks — memory records (type, time scope, session date) and raw dialogue
//! snippets (speaker lines, session date) — under rules that keep the answer grounded. One LLM
//! call.

use lycheemem_core::config::AnswerConfig;
use lycheemem_core::{Purpose, Result, TokenUsage};
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm};

use crate::EvidenceItem;

pub const ANSWER_INSTRUCTIONS: &str = "You answer questions about past conversations using only the evidence given.
Rules:
- Answer from the evidence only. If no evidence item contains the answer, reply exactly: I don't have that in memory.
- Do not double-count: several evidence items may describe the same thing.
- When the question names a person, answer about that person only; never attribute another person's facts to them.
- If evidence conflicts, prefer the most recent supported information (latest time or session date).
- Give dates as absolute dates. Be concise: a short phrase or one or two sentences.";

fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// Bounds a dialogue snippet (one `speaker: text` line per turn) to `max` characters by dropping
/// whole turns from its two ends in turn, keeping the middle: a source window is its anchor's
/// cited turns with context on both sides, so the cited turns are in the middle. A single turn
/// longer than `max` is cut.
fn trim_dialogue(text: &str, max: usize) -> String {
    let mut lines: std::collections::VecDeque<&str> = text.lines().collect();
    let size = |lines: &std::collections::VecDeque<&str>| -> usize {
        lines.iter().map(|l| l.chars().count() + 1).sum::<usize>()
    };
    let (mut dropped_front, mut dropped_back) = (false, false);
    let mut from_front = true;
    while lines.len() > 1 && size(&lines) > max {
        if from_front {
            lines.pop_front();
            dropped_front = true;
        } else {
            lines.pop_back();
            dropped_back = true;
        }
        from_front = !from_front;
    }
    let body = lines.iter().copied().collect::<Vec<_>>().join("\n");
    let body = cut(&body, max);
    format!(
        "{}{body}{}",
        if dropped_front { "…\n" } else { "" },
        if dropped_back { "\n…" } else { "" }
    )
}

/// The two evidence blocks as they appear in the prompt.
pub fn evidence_blocks(evidence: &[EvidenceItem], cfg: &AnswerConfig) -> (String, String) {
    let mut records = String::new();
    let mut snippets = String::new();
    let (mut ri, mut si) = (0, 0);
    for e in evidence {
        let date = e.session_date.as_deref().unwrap_or("unknown");
        match e.memory_type {
            Some(t) => {
                ri += 1;
                let mut time = Vec::new();
                if let Some(v) = &e.temporal.t_ref {
                    time.push(format!("time {v}"));
                }
                if let Some(v) = &e.temporal.t_valid_from {
                    time.push(format!("valid from {v}"));
                }
                if let Some(v) = &e.temporal.t_valid_to {
                    time.push(format!("valid to {v}"));
                }
                let time = if time.is_empty() {
                    String::new()
                } else {
                    format!("; {}", time.join(", "))
                };
                records.push_str(&format!(
                    "[M{ri}] ({}{time}; session date {date}) {}\n",
                    t.as_str(),
                    cut(&e.evidence.text, cfg.evidence_item_chars)
                ));
            }
            None => {
                si += 1;
                snippets.push_str(&format!(
                    "[D{si}] (session {}, date {date})\n{}\n",
                    e.session,
                    trim_dialogue(&e.evidence.text, cfg.evidence_item_chars)
                ));
            }
        }
    }
    (records, snippets)
}

/// The answer prompt messages.
pub fn answer_messages(
    question: &str,
    reference_date: Option<&str>,
    evidence: &[EvidenceItem],
    cfg: &AnswerConfig,
) -> Vec<ChatMessage> {
    let (records, snippets) = evidence_blocks(evidence, cfg);
    let user = format!(
        "Memory records:\n{}\nDialogue snippets:\n{}\nQuestion date: {}\nQuestion: {}",
        if records.is_empty() {
            "(none)\n".to_string()
        } else {
            records
        },
        if snippets.is_empty() {
            "(none)\n".to_string()
        } else {
            snippets
        },
        reference_date.unwrap_or("unknown"),
        question.trim()
    );
    vec![
        ChatMessage::system(ANSWER_INSTRUCTIONS),
        ChatMessage::user(user),
    ]
}

/// An answer and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerText {
    pub text: String,
    pub usage: TokenUsage,
}

/// Makes the answer call.
pub fn answer(
    llm: &dyn Llm,
    question: &str,
    reference_date: Option<&str>,
    evidence: &[EvidenceItem],
    cfg: &AnswerConfig,
    cancel: &lycheemem_core::Cancel,
) -> Result<AnswerText> {
    let messages = answer_messages(question, reference_date, evidence, cfg);
    let options = GenerateOptions {
        max_tokens: cfg.max_output_tokens,
        temperature: 0.0,
        cancel: cancel.clone(),
        ..Default::default()
    };
    let reply = llm.complete(&messages, &options)?;
    Ok(AnswerText {
        text: reply.text.trim().to_string(),
        usage: TokenUsage {
            purpose: Purpose::Answer,
            model: reply.model,
            prompt_tokens: reply.prompt_tokens,
            completion_tokens: reply.completion_tokens,
            latency_ms: reply.latency_ms,
            estimated: reply.usage_estimated,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_snippet_keeps_its_middle_turns_whole() {
        let text: Vec<String> = (0..9)
            .map(|i| format!("A: turn number {i} of the window"))
            .collect();
        let text = text.join("\n");
        let out = trim_dialogue(&text, 100);
        assert!(out.contains("turn number 4"), "{out}");
        assert!(
            !out.contains("turn number 0") && !out.contains("turn number 8"),
            "{out}"
        );
        assert!(out.starts_with("…\n") && out.ends_with("\n…"), "{out}");
        // Every kept turn is whole.
        for line in out.lines().filter(|l| *l != "…") {
            assert!(line.ends_with("of the window"), "{line}");
        }
        assert_eq!(trim_dialogue("A: short", 100), "A: short");
    }
}
