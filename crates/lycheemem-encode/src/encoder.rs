//! The segment encoder (docs/algorithm.md, "Encoding"): exactly one LLM call per finalized
//! segment (plus at most `repair_retries` repair calls showing the parse error), never a panic.
//! On final failure the segment yields no records — its raw turns stay stored and searchable —
//! and the failure is returned for logging.

use chrono::NaiveDate;
use lycheemem_core::config::{EncodeConfig, RecordStyle};
use lycheemem_core::text::head_and_tail;
use lycheemem_core::{Namespace, Purpose, Record, Segment, TokenUsage, Turn};
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm};
use std::sync::Arc;

use crate::parse::{ParseContext, Parsed, parse_records, parse_summary};
use crate::reference::ReferenceContext;
use crate::schema::{records_schema, summary_schema};

/// The encoder's standing instructions: the same text for every segment, so local models reuse
/// its KV cache across calls.
pub const INSTRUCTIONS: &str = "You turn one segment of a conversation into long-term memory records.

Input: the session date, resolved references from earlier segments (only to resolve names and pronouns, never a source of new facts), and the segment's turns, each tagged [index] with its speaker.

For every atomic statement worth remembering, write one record:
- memory_type: fact, preference, event, constraint, procedure, failure_pattern or tool_affordance.
- semantic_text: one self-contained sentence. Name people instead of using pronouns, resolve aliases and ellipsis, attribute the statement to the right speaker, and write relative times (yesterday, last week, next month) as absolute dates computed from the session date.
- entities: people, places, organisations and things the statement mentions.
- tags: a few short topic words.
- temporal: t_ref (when it happened or was said), t_valid_from, t_valid_to as ISO dates (YYYY-MM-DD or YYYY-MM), or null when unknown.
- evidence_turns: the [index] numbers of the turns that support the statement.
- source_role: user, assistant or both.
Keep distinct statements separate, even when they conflict. Do not invent anything.
Finally, disambiguation_context: a short note of who is who and what pronouns referred to, for the next segment.
Reply with one JSON object only.";

const SUMMARY_INSTRUCTIONS: &str = "You summarize one segment of a conversation for long-term memory. Input: the session date, resolved references from earlier segments (only to resolve names), and the segment's turns tagged [index] with their speaker. Write `summary`: a self-contained summary that names people and turns relative times into absolute dates using the session date; and `disambiguation_context`: a short note of who is who. Reply with one JSON object only.";

/// One segment to encode.
#[derive(Debug, Clone)]
pub struct SegmentInput<'a> {
    pub namespace: &'a Namespace,
    pub segment: &'a Segment,
    /// The segment's turns, in order (`segment.first_turn..=segment.last_turn`).
    pub turns: &'a [Turn],
    /// The session's date or date-time as stored (any accepted format), if known.
    pub session_date: Option<&'a str>,
}

/// The result of encoding one segment.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodeOutcome {
    pub records: Vec<Record>,
    pub disambiguation: String,
    /// LLM calls made (1, or more with repairs).
    pub calls: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Records or fields dropped while validating.
    pub dropped: usize,
    /// The accepted reply was cut off by the output budget; only its complete records were kept.
    pub truncated: bool,
    /// One entry per LLM call that returned (purpose `encode`).
    pub usage: Vec<TokenUsage>,
    /// Why the segment produced no records, when it failed.
    pub failure: Option<String>,
}

impl EncodeOutcome {
    /// Nothing encoded yet: no records, no calls, no failure.
    pub fn empty() -> Self {
        EncodeOutcome {
            records: Vec::new(),
            disambiguation: String::new(),
            calls: 0,
            prompt_tokens: 0,
            completion_tokens: 0,
            dropped: 0,
            truncated: false,
            usage: Vec::new(),
            failure: None,
        }
    }

    /// A segment that produced nothing, for this reason.
    pub fn failed(why: impl Into<String>) -> Self {
        EncodeOutcome {
            failure: Some(why.into()),
            ..EncodeOutcome::empty()
        }
    }
}

/// Encodes segments with one LLM.
pub struct SegmentEncoder {
    llm: Arc<dyn Llm>,
    cfg: EncodeConfig,
}

impl SegmentEncoder {
    pub fn new(llm: Arc<dyn Llm>, cfg: EncodeConfig) -> Self {
        SegmentEncoder { llm, cfg }
    }

    pub fn config(&self) -> &EncodeConfig {
        &self.cfg
    }

    /// The two prompt messages for a segment (exposed for inspection and tests).
    pub fn messages(
        &self,
        input: &SegmentInput<'_>,
        reference: &ReferenceContext,
    ) -> Vec<ChatMessage> {
        let date = input
            .session_date
            .and_then(|d| lycheemem_core::date::parse_date(d).map(|p| p.iso()))
            .unwrap_or_else(|| "unknown".into());
        let rho = if self.cfg.cross_segment_context {
            reference.render(&self.cfg)
        } else {
            String::new()
        };
        let mut user = format!("Session date: {date}\n\n");
        if !rho.is_empty() {
            user.push_str(&rho);
            user.push('\n');
        }
        user.push_str("Segment turns:\n");
        for (i, turn) in input.turns.iter().enumerate() {
            let who = match &turn.speaker {
                Some(name) => format!("{name} ({})", turn.role.as_str()),
                None => turn.role.as_str().to_string(),
            };
            user.push_str(&format!(
                "[{i}] {who}: {}\n",
                head_and_tail(&turn.text, self.cfg.turn_chars / 2)
            ));
        }
        let system = match self.cfg.record_style {
            RecordStyle::Typed => INSTRUCTIONS,
            RecordStyle::SummaryRecords => SUMMARY_INSTRUCTIONS,
        };
        vec![ChatMessage::system(system), ChatMessage::user(user)]
    }

    /// Encodes one segment and updates `reference` (ρ) with its note and records.
    pub fn encode(
        &self,
        input: &SegmentInput<'_>,
        reference: &mut ReferenceContext,
    ) -> EncodeOutcome {
        let session_day: Option<NaiveDate> = input.session_date.and_then(|d| {
            lycheemem_core::date::parse_date(d).and_then(|p| match p.date {
                lycheemem_core::date::CalendarDate::Day(day) => Some(day),
                _ => None,
            })
        });
        let ctx = ParseContext {
            namespace: input.namespace,
            session: &input.segment.session,
            segment_id: &input.segment.id,
            first_turn: input.segment.first_turn,
            turn_count: input.turns.len() as u32,
            session_date: session_day,
            created_at: session_day.map(|d| d.format("%Y-%m-%d").to_string()),
        };
        let schema = match self.cfg.record_style {
            RecordStyle::Typed => {
                let cap = self.cfg.max_records.min(
                    self.cfg
                        .max_records_per_turn
                        .saturating_mul(input.turns.len())
                        .max(1),
                );
                records_schema(input.turns.len(), cap)
            }
            RecordStyle::SummaryRecords => summary_schema(),
        };
        let budget = self.cfg.output_tokens_base.saturating_add(
            self.cfg
                .output_tokens_per_turn
                .saturating_mul(input.turns.len() as u32),
        );
        let options = GenerateOptions {
            max_tokens: budget.min(self.cfg.max_output_tokens).max(1),
            repeat_penalty: self.cfg.repeat_penalty,
            json_schema: Some(schema),
            ..Default::default()
        };
        let mut messages = self.messages(input, reference);
        let mut outcome = EncodeOutcome::empty();
        let mut last_error = String::new();
        for attempt in 0..=self.cfg.repair_retries {
            outcome.calls += 1;
            let reply = match self.llm.complete(&messages, &options) {
                Ok(reply) => reply,
                Err(e) => {
                    last_error = format!("LLM call failed: {e}");
                    continue;
                }
            };
            outcome.prompt_tokens += reply.prompt_tokens;
            outcome.completion_tokens += reply.completion_tokens;
            outcome.usage.push(TokenUsage {
                purpose: Purpose::Encode,
                model: reply.model.clone(),
                prompt_tokens: reply.prompt_tokens,
                completion_tokens: reply.completion_tokens,
                latency_ms: reply.latency_ms,
                estimated: reply.usage_estimated,
            });
            let parsed: Result<Parsed, String> = match self.cfg.record_style {
                RecordStyle::Typed => parse_records(&reply.text, &ctx),
                RecordStyle::SummaryRecords => parse_summary(&reply.text, &ctx),
            };
            match parsed {
                Ok(p) => {
                    reference.update(
                        &p.disambiguation,
                        p.records.iter().map(|r| r.semantic_text.clone()),
                        &self.cfg,
                    );
                    outcome.records = p.records;
                    outcome.disambiguation = p.disambiguation;
                    outcome.dropped = p.dropped;
                    outcome.truncated = p.truncated;
                    return outcome;
                }
                Err(problem) => {
                    let shown: String = reply.text.chars().take(300).collect();
                    last_error = format!("{problem}; the reply began {shown:?}");
                    if attempt < self.cfg.repair_retries {
                        messages.push(ChatMessage::assistant(reply.text));
                        messages.push(ChatMessage::user(format!(
                            "Your reply could not be used: {problem}. Reply again with only the complete JSON object."
                        )));
                    }
                }
            }
        }
        outcome.failure = Some(format!(
            "segment {} produced no records after {} call(s): {last_error}",
            input.segment.id, outcome.calls
        ));
        outcome
    }
}
