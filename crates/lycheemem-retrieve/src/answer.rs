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

/// Bounds a dialogue snippet to `max` characters by dropping whole turns from its ends, keeping
/// the turns it was retrieved for: `focus` holds their positions in `parts` (one part per turn).
/// Each step drops the end turn farther from the focus, and when only focus turns are left,
/// later ones go first. With no focus, turns go from both ends in turn, the first from the front
/// (a source window's cited turns sit in its middle). A single turn longer than `max` is cut.
fn trim_turns(parts: &[&str], focus: &[usize], max: usize) -> String {
    let (mut lo, mut hi) = (0usize, parts.len());
    let size = |lo: usize, hi: usize| -> usize {
        parts[lo..hi]
            .iter()
            .map(|l| l.chars().count() + 1)
            .sum::<usize>()
    };
    let span = focus.iter().min().zip(focus.iter().max());
    let mut from_front = true;
    while hi - lo > 1 && size(lo, hi) > max {
        let drop_front = match span {
            // Distance of each end turn from the focus span (0 once inside it).
            Some((&f_lo, &f_hi)) => f_lo.saturating_sub(lo) > (hi - 1).saturating_sub(f_hi),
            None => from_front,
        };
        if drop_front {
            lo += 1;
        } else {
            hi -= 1;
        }
        from_front = !from_front;
    }
    let body = cut(&parts[lo..hi].join("\n"), max);
    format!(
        "{}{body}{}",
        if lo > 0 { "…\n" } else { "" },
        if hi < parts.len() { "\n…" } else { "" }
    )
}

/// A snippet's text for the prompt, bounded by [`trim_turns`]: turn by turn when the item
/// carries its turns' lines, else line by line of its text (the middle kept).
fn trim_snippet(e: &EvidenceItem, max: usize) -> String {
    if !e.dialogue.is_empty() && e.dialogue.len() == e.turns.len() {
        let parts: Vec<&str> = e.dialogue.iter().map(String::as_str).collect();
        let focus: Vec<usize> = e
            .turns
            .iter()
            .enumerate()
            .filter(|(_, t)| e.focus_turns.contains(t))
            .map(|(i, _)| i)
            .collect();
        trim_turns(&parts, &focus, max)
    } else {
        trim_dialogue(&e.evidence.text, max)
    }
}

/// [`trim_turns`] over the lines of a text, keeping the middle.
fn trim_dialogue(text: &str, max: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return String::new();
    }
    trim_turns(&lines, &[], max)
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
                    trim_snippet(e, cfg.evidence_item_chars)
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
    complete_answer(llm, &messages, cfg, cancel)
}

/// Makes the answer call on prepared messages (greedy, `cfg.max_output_tokens`): the one call
/// every memory strategy answers with.
pub fn complete_answer(
    llm: &dyn Llm,
    messages: &[ChatMessage],
    cfg: &AnswerConfig,
    cancel: &lycheemem_core::Cancel,
) -> Result<AnswerText> {
    let options = GenerateOptions {
        max_tokens: cfg.max_output_tokens,
        temperature: 0.0,
        cancel: cancel.clone(),
        ..Default::default()
    };
    let reply = llm.complete(messages, &options)?;
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
    use lycheemem_core::{CandidateTarget, Evidence};

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

    fn snippet(turns: Vec<u32>, dialogue: Vec<String>, focus: Vec<u32>) -> EvidenceItem {
        EvidenceItem {
            evidence: Evidence {
                target: CandidateTarget::Turns {
                    first: lycheemem_core::TurnRef {
                        session: lycheemem_core::SessionId::new("s1").unwrap(),
                        index: turns[0],
                    },
                    last_index: *turns.last().unwrap(),
                },
                text: dialogue.join("\n"),
                best_route_score: 0.5,
                rrf: 0.0,
                final_score: 0.5,
                mmr_score: 0.5,
                provenance: Default::default(),
            },
            session: "s1".into(),
            session_date: None,
            memory_type: None,
            temporal: Default::default(),
            entities: Vec::new(),
            turns,
            dialogue,
            focus_turns: focus,
        }
    }

    #[test]
    fn a_long_reply_is_cut_before_the_hit_it_answers() {
        // A user's turn that matched, then a long multi-line assistant reply.
        let reply = format!("assistant: {}", "Here is a long list item.\n".repeat(80));
        let e = snippet(
            vec![4, 5],
            vec!["user: my dog is called Biscuit".into(), reply],
            vec![4],
        );
        let out = trim_snippet(&e, 300);
        assert!(out.starts_with("user: my dog is called Biscuit"), "{out}");
        assert!(out.ends_with("\n…"), "{out}");
        // Without its turns the same text loses the hit first.
        let mut plain = e.clone();
        plain.dialogue.clear();
        assert!(!trim_snippet(&plain, 300).contains("Biscuit"));
    }

    #[test]
    fn a_window_is_trimmed_around_its_anchor_turns() {
        let dialogue: Vec<String> = (10..19)
            .map(|i| format!("A: turn number {i} of the window"))
            .collect();
        // The anchor cited turns 11 and 12, near the window's start.
        let e = snippet((10..19).collect(), dialogue, vec![11, 12]);
        let out = trim_snippet(&e, 100);
        assert!(
            out.contains("turn number 11") && out.contains("turn number 12"),
            "{out}"
        );
        assert!(!out.contains("turn number 18"), "{out}");
        // A single focus turn longer than the bound is cut, never dropped.
        let e = snippet(vec![3], vec![format!("A: {}", "x".repeat(500))], vec![3]);
        let out = trim_snippet(&e, 50);
        assert_eq!(out.chars().count(), 51, "{out}");
    }
}
