//! The JSON Schemas of LiCoMemory's three LLM calls (the authors' `##`-delimited text formats
//! with the same fields, as schemas: enforced token by token on local models, sent as
//! `response_format` to remote ones).

use serde_json::{Value, json};

use crate::graph::EntityType;

fn entity_list(max: usize) -> Value {
    let types: Vec<&str> = EntityType::ALL.iter().map(|t| t.as_str()).collect();
    json!({
        "type": "array",
        "maxItems": max,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "type": {"enum": types}
            },
            "required": ["name", "type"],
            "additionalProperties": false
        }
    })
}

/// A session summary: keys and themes (the session id and date are the engine's, not the
/// model's).
pub fn summary_schema(max_keys: usize, max_themes: usize) -> Value {
    json!({
        "type": "object",
        "properties": {
            "keys": {"type": "array", "maxItems": max_keys, "items": {"type": "string", "minLength": 1}},
            "themes": {
                "type": "array",
                "maxItems": max_themes,
                "items": {
                    "type": "object",
                    "properties": {
                        "theme": {"type": "string", "minLength": 1},
                        "summary": {"type": "string", "minLength": 1}
                    },
                    "required": ["theme", "summary"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["keys", "themes"],
        "additionalProperties": false
    })
}

/// Entities with one of the seven types, and relations between them with a 1–10 strength.
pub fn extraction_schema(max_entities: usize, max_relations: usize) -> Value {
    json!({
        "type": "object",
        "properties": {
            "entities": entity_list(max_entities),
            "relations": {
                "type": "array",
                "maxItems": max_relations,
                "items": {
                    "type": "object",
                    "properties": {
                        "source": {"type": "string", "minLength": 1},
                        "target": {"type": "string", "minLength": 1},
                        "relation": {"type": "string", "minLength": 1},
                        "strength": {"type": "integer", "minimum": 1, "maximum": 10}
                    },
                    "required": ["source", "target", "relation", "strength"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["entities", "relations"],
        "additionalProperties": false
    })
}

/// The entities a question is about, typed.
pub fn query_entities_schema(max: usize) -> Value {
    json!({
        "type": "object",
        "properties": {"entities": entity_list(max)},
        "required": ["entities"],
        "additionalProperties": false
    })
}
