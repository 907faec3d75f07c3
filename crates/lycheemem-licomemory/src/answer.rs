//! LiCoMemory's answer prompt (SPEC-licomemory §3 step 7), in its order: the question time and
//! the question, the session summary, the triples (`(src, rel, tgt)` joined by `; `), the chunks
//! (`Chunk i:` with their session date), then the instructions. One call, made by the engine's
//! `complete_answer` (`answer.max_output_tokens`, greedy), so strategies are compared with the
//! same answerer.

use lycheemem_core::config::{AnswerConfig, LicoMemoryConfig};
use lycheemem_core::text::head_and_tail;
use lycheemem_core::{Cancel, Result};
use lycheemem_llm::{ChatMessage, Llm};
use lycheemem_retrieve::{AnswerText, SearchResult};

use crate::prompts;
use crate::write::slash_date;

/// The answer prompt. Each chunk keeps `answer.evidence_item_chars` characters from its head
/// and from its tail.
pub fn answer_messages(
    question: &str,
    question_date: Option<&str>,
    result: &SearchResult,
    cfg: &LicoMemoryConfig,
    answer: &AnswerConfig,
) -> Vec<ChatMessage> {
    let mut text = format!(
        "Question time: {}\nQuestion: {}\n",
        slash_date(question_date),
        question.trim()
    );
    for block in &result.context {
        if block.title == "Triples" {
            text.push_str(&format!("\nTriples: {}\n", block.lines.join("; ")));
        } else {
            text.push_str(&format!(
                "\nSession summary:\n{}\n{}\n",
                block.title,
                block.lines.join("\n")
            ));
        }
    }
    if !result.evidence.is_empty() {
        text.push_str("\nChunks:\n");
        for (i, e) in result.evidence.iter().enumerate() {
            let body = head_and_tail(&e.evidence.text, answer.evidence_item_chars);
            if cfg.chunk_session_date {
                text.push_str(&format!(
                    "Chunk {}: [{}] {body}\n",
                    i + 1,
                    slash_date(e.session_date.as_deref())
                ));
            } else {
                text.push_str(&format!("Chunk {}: {body}\n", i + 1));
            }
        }
    }
    text.push('\n');
    text.push_str(prompts::ANSWER);
    vec![ChatMessage::user(text)]
}

/// Answers from a LiCoMemory search result (one call).
pub fn answer(
    llm: &dyn Llm,
    question: &str,
    question_date: Option<&str>,
    result: &SearchResult,
    cfg: &LicoMemoryConfig,
    answer: &AnswerConfig,
    cancel: &Cancel,
) -> Result<AnswerText> {
    let messages = answer_messages(question, question_date, result, cfg, answer);
    lycheemem_retrieve::complete_answer(llm, &messages, answer, cancel)
}
