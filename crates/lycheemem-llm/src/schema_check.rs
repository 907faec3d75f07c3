//! A small JSON Schema checker for the subset lycheemem's schemas use (`type`, `properties`,
//! `required`, `additionalProperties: false`, `items`, `enum`, `minItems`/`maxItems`,
//! `minLength`/`maxLength`, `minimum`/`maximum`, `anyOf`), used to validate output from backends
//! that cannot enforce a schema themselves.

use serde_json::Value;

/// `Ok(())` when `value` satisfies `schema`, else the first violation with its JSON path.
pub fn validate(value: &Value, schema: &Value) -> Result<(), String> {
    check(value, schema, "$")
}

fn type_matches(value: &Value, ty: &str) -> bool {
    match ty {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "integer" => value.as_i64().is_some() || value.as_u64().is_some(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        _ => true,
    }
}

fn check(value: &Value, schema: &Value, path: &str) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        return Ok(());
    };
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array)
        && !any.iter().any(|s| check(value, s, path).is_ok())
    {
        return Err(format!("{path}: matches none of anyOf"));
    }
    match schema.get("type") {
        Some(Value::String(ty)) if !type_matches(value, ty) => {
            return Err(format!("{path}: expected {ty}"));
        }
        Some(Value::Array(types))
            if !types
                .iter()
                .filter_map(Value::as_str)
                .any(|t| type_matches(value, t)) =>
        {
            return Err(format!("{path}: expected one of {types:?}"));
        }
        _ => {}
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        return Err(format!("{path}: {value} is not one of {allowed:?}"));
    }
    if let Some(text) = value.as_str() {
        let chars = text.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && chars < min
        {
            return Err(format!("{path}: shorter than {min} characters"));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && chars > max
        {
            return Err(format!("{path}: longer than {max} characters"));
        }
    }
    if let Some(x) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && x < min
        {
            return Err(format!("{path}: {value} is below the minimum {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && x > max
        {
            return Err(format!("{path}: {value} is above the maximum {max}"));
        }
    }
    if let Some(obj) = value.as_object() {
        for key in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !obj.contains_key(key) {
                return Err(format!("{path}: missing required field {key:?}"));
            }
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (key, sub) in props {
                if let Some(v) = obj.get(key) {
                    check(v, sub, &format!("{path}.{key}"))?;
                }
            }
            if schema.get("additionalProperties") == Some(&Value::Bool(false))
                && let Some(extra) = obj.keys().find(|k| !props.contains_key(*k))
            {
                return Err(format!("{path}: unexpected field {extra:?}"));
            }
        }
    }
    if let Some(items) = value.as_array() {
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
            && (items.len() as u64) < min
        {
            return Err(format!("{path}: fewer than {min} items"));
        }
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && items.len() as u64 > max
        {
            return Err(format!("{path}: more than {max} items"));
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                check(item, item_schema, &format!("{path}[{i}]"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn checks_the_supported_subset() {
        let schema = json!({
            "type": "object",
            "required": ["records"],
            "properties": {"records": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "required": ["memory_type", "text"],
                "properties": {"memory_type": {"enum": ["fact", "event"]}, "text": {"type": "string"}, "turns": {"type": "array", "items": {"type": "integer"}}}
            }}}
        });
        assert!(
            validate(
                &json!({"records": [{"memory_type": "fact", "text": "x", "turns": [1, 2]}]}),
                &schema
            )
            .is_ok()
        );
        assert_eq!(
            validate(&json!({}), &schema).unwrap_err(),
            "$: missing required field \"records\""
        );
        assert!(
            validate(
                &json!({"records": [{"memory_type": "opinion", "text": "x"}]}),
                &schema
            )
            .unwrap_err()
            .contains("$.records[0].memory_type")
        );
        assert!(
            validate(
                &json!({"records": [{"memory_type": "fact", "text": "x", "turns": ["a"]}]}),
                &schema
            )
            .unwrap_err()
            .contains("turns[0]")
        );
        assert!(
            validate(
                &json!({"records": [{"memory_type": "fact", "text": 1}]}),
                &schema
            )
            .is_err()
        );
        let three = json!({"records": [{"memory_type": "fact", "text": "a"}, {"memory_type": "fact", "text": "b"}, {"memory_type": "fact", "text": "c"}]});
        assert!(
            validate(&three, &schema)
                .unwrap_err()
                .contains("more than 2")
        );
    }

    #[test]
    fn bounds_on_strings_and_numbers_are_enforced() {
        let schema = json!({"type": "object", "properties": {
            "turn": {"type": "integer", "minimum": 0, "maximum": 5},
            "name": {"type": "string", "minLength": 1, "maxLength": 4}
        }});
        assert!(validate(&json!({"turn": 5, "name": "Anna"}), &schema).is_ok());
        assert!(
            validate(&json!({"turn": 6}), &schema)
                .unwrap_err()
                .contains("above the maximum")
        );
        assert!(
            validate(&json!({"turn": -1}), &schema)
                .unwrap_err()
                .contains("below the minimum")
        );
        assert!(
            validate(&json!({"name": ""}), &schema)
                .unwrap_err()
                .contains("shorter")
        );
        // Characters, not bytes.
        assert!(validate(&json!({"name": "Zoë!"}), &schema).is_ok());
        assert!(
            validate(&json!({"name": "Zoë!!"}), &schema)
                .unwrap_err()
                .contains("longer")
        );
    }
}
