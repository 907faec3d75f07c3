//! The JSON Schemas the encoder asks for: enforced token by token on local models and sent as
//! `response_format` to remote ones.

use lycheemem_core::MemoryType;
use serde_json::{Value, json};

/// The typed-record schema for a segment of `turns` turns (evidence indices `0..turns`), with at
/// most `max_records` records. Strings carry no `maxLength`: counted repetition makes the
/// constraint automaton expensive; `max_tokens` bounds the output instead.
pub fn records_schema(turns: usize, max_records: usize) -> Value {
    let types: Vec<&str> = MemoryType::ALL.iter().map(|t| t.as_str()).collect();
    let date = json!({"type": ["string", "null"]});
    json!({
        "type": "object",
        "properties": {
            "records": {
                "type": "array",
                "maxItems": max_records,
                "items": {
                    "type": "object",
                    "properties": {
                        "memory_type": {"enum": types},
                        "semantic_text": {"type": "string", "minLength": 1},
                        "entities": {"type": "array", "maxItems": 8, "items": {"type": "string"}},
                        "tags": {"type": "array", "maxItems": 6, "items": {"type": "string"}},
                        "temporal": {
                            "type": "object",
                            "properties": {"t_ref": date, "t_valid_from": date, "t_valid_to": date},
                            "required": ["t_ref", "t_valid_from", "t_valid_to"],
                            "additionalProperties": false
                        },
                        "evidence_turns": {
                            "type": "array",
                            "maxItems": 12,
                            "items": {"type": "integer", "minimum": 0, "maximum": turns.saturating_sub(1)}
                        },
                        "source_role": {"enum": ["user", "assistant", "both"]}
                    },
                    "required": ["memory_type", "semantic_text", "entities", "tags", "temporal", "evidence_turns", "source_role"],
                    "additionalProperties": false
                }
            },
            "disambiguation_context": {"type": "string"}
        },
        "required": ["records", "disambiguation_context"],
        "additionalProperties": false
    })
}

/// The `summary_records` ablation: one untyped summary per segment.
pub fn summary_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "summary": {"type": "string", "minLength": 1},
            "disambiguation_context": {"type": "string"}
        },
        "required": ["summary", "disambiguation_context"],
        "additionalProperties": false
    })
}
