//! From the encoder's JSON reply to validated records. Structural problems (not JSON, no
//! `records` list) are errors that trigger the repair round; problems inside a record are
//! coerced or dropped and counted: unknown type → fact, dates → ISO (relative ones resolved
//! against the session date; unresolvable ones dropped), segment-local turn indices → absolute
//! ones (out-of-range ones dropped; none left → the whole segment), identical texts merged.
//! A reply cut off by the output budget keeps the records that were complete before the cut.

use chrono::NaiveDate;
use lycheemem_core::date::resolve_date;
use lycheemem_core::{MemoryType, Namespace, Record, SessionId, SourceRole, TemporalScope};
use serde_json::Value;

/// What the parser needs to know about the segment.
#[derive(Debug, Clone)]
pub struct ParseContext<'a> {
    pub namespace: &'a Namespace,
    pub session: &'a SessionId,
    pub segment_id: &'a str,
    pub first_turn: u32,
    pub turn_count: u32,
    pub session_date: Option<NaiveDate>,
    /// ISO session date stored as `created_at`.
    pub created_at: Option<String>,
}

/// Records parsed from one reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub records: Vec<Record>,
    pub disambiguation: String,
    /// Records or fields that were dropped as unusable.
    pub dropped: usize,
    /// The reply was cut off; `records` are the complete ones before the cut.
    pub truncated: bool,
}

/// The JSON object in `text`: the whole text, a fenced block, or the outermost braces.
pub fn extract_json(text: &str) -> Result<Value, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("the reply is empty".into());
    }
    let err = match serde_json::from_str(t) {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    // Prose or a code fence around the object: try the outermost braces.
    if let (Some(a), Some(b)) = (t.find('{'), t.rfind('}'))
        && a < b
        && let Ok(v) = serde_json::from_str(&t[a..=b])
    {
        return Ok(v);
    }
    if err.is_eof() {
        Err(format!("the JSON is truncated ({err})"))
    } else {
        Err(format!("the reply is not valid JSON ({err})"))
    }
}

fn strings(v: &Value, dropped: &mut usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in v.as_array().into_iter().flatten() {
        match item.as_str().map(str::trim) {
            Some(s) if !s.is_empty() => {
                if !out.iter().any(|o| o.eq_ignore_ascii_case(s)) {
                    out.push(s.to_string());
                }
            }
            _ => *dropped += 1,
        }
    }
    out
}

fn date_field(v: &Value, ctx: &ParseContext<'_>, dropped: &mut usize) -> Option<String> {
    let s = v.as_str()?.trim();
    if s.is_empty() || s.eq_ignore_ascii_case("null") || s.eq_ignore_ascii_case("unknown") {
        return None;
    }
    let anchor = ctx.session_date;
    let resolved = match anchor {
        Some(a) => resolve_date(s, a),
        None => lycheemem_core::date::parse_date(s).map(|p| p.date),
    };
    if resolved.is_none() {
        *dropped += 1;
    }
    resolved.map(|d| d.iso())
}

/// Relative time left in a statement ("... yesterday") is resolved against the session date:
/// the phrase gets its absolute date appended ("yesterday (2023-05-07)") so the text stands
/// alone, and `t_ref` takes that date when it was missing or merely the session date.
fn resolve_relative_mention(
    text: &str,
    t_ref: &mut Option<String>,
    ctx: &ParseContext<'_>,
) -> String {
    let Some(anchor) = ctx.session_date else {
        return text.to_string();
    };
    let Some((span, date)) = lycheemem_core::date::find_relative(text, anchor) else {
        return text.to_string();
    };
    let session_iso = anchor.format("%Y-%m-%d").to_string();
    if t_ref.as_deref().is_none_or(|t| t == session_iso) {
        *t_ref = Some(date.iso());
    }
    // The session date needs no annotation; a text that already carries the date (a model
    // copying an annotated statement) is not annotated twice.
    if date.iso() == session_iso || text.contains(&date.iso()) {
        return text.to_string();
    }
    format!(
        "{} ({}){}",
        &text[..span.end],
        date.iso(),
        &text[span.end..]
    )
}

fn record_from(item: &Value, ctx: &ParseContext<'_>, dropped: &mut usize) -> Option<Record> {
    let obj = item.as_object()?;
    let raw_text = obj
        .get("semantic_text")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|t| !t.is_empty())?;
    let memory_type = MemoryType::parse_lenient(
        obj.get("memory_type")
            .and_then(Value::as_str)
            .unwrap_or("fact"),
    );
    let temporal_v = obj.get("temporal").cloned().unwrap_or(Value::Null);
    let mut temporal = TemporalScope {
        t_ref: date_field(&temporal_v["t_ref"], ctx, dropped),
        t_valid_from: date_field(&temporal_v["t_valid_from"], ctx, dropped),
        t_valid_to: date_field(&temporal_v["t_valid_to"], ctx, dropped),
    };
    let text_owned = resolve_relative_mention(raw_text, &mut temporal.t_ref, ctx);
    let text = text_owned.as_str();
    let mut evidence: Vec<u32> = Vec::new();
    for v in obj
        .get("evidence_turns")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match v.as_u64().filter(|&i| i < ctx.turn_count as u64) {
            Some(i) => {
                let abs = ctx.first_turn + i as u32;
                if !evidence.contains(&abs) {
                    evidence.push(abs);
                }
            }
            None => *dropped += 1,
        }
    }
    if evidence.is_empty() {
        evidence = (ctx.first_turn..ctx.first_turn + ctx.turn_count).collect();
    }
    evidence.sort_unstable();
    let source_role = match obj
        .get("source_role")
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("user") => SourceRole::User,
        Some("assistant") => SourceRole::Assistant,
        _ => SourceRole::Both,
    };
    Some(Record {
        record_id: Record::make_id(ctx.namespace, text),
        memory_type,
        semantic_text: text.to_string(),
        normalized_text: Record::make_normalized_text(memory_type, text),
        entities: strings(obj.get("entities").unwrap_or(&Value::Null), dropped),
        tags: strings(obj.get("tags").unwrap_or(&Value::Null), dropped),
        temporal,
        evidence_turns: evidence,
        source_session: ctx.session.clone(),
        source_role,
        segment_id: ctx.segment_id.to_string(),
        created_at: ctx.created_at.clone(),
        confidence: 1.0,
    })
}

/// Adds `r` unless a record with the same id exists, in which case provenance is unioned.
fn push_merged(records: &mut Vec<Record>, r: Record) {
    match records.iter_mut().find(|x| x.record_id == r.record_id) {
        Some(existing) => {
            for t in r.evidence_turns {
                if !existing.evidence_turns.contains(&t) {
                    existing.evidence_turns.push(t);
                }
            }
            existing.evidence_turns.sort_unstable();
            for e in r.entities {
                if !existing.entities.contains(&e) {
                    existing.entities.push(e);
                }
            }
            for t in r.tags {
                if !existing.tags.contains(&t) {
                    existing.tags.push(t);
                }
            }
        }
        None => records.push(r),
    }
}

/// The reply's disambiguation note (empty when absent or not a string).
fn disambiguation_of(value: &Value) -> String {
    value
        .get("disambiguation_context")
        .and_then(Value::as_str)
        .unwrap_or("")
        .trim()
        .to_string()
}

/// Parses a typed-records reply.
pub fn parse_records(text: &str, ctx: &ParseContext<'_>) -> Result<Parsed, String> {
    let (value, truncated) = match extract_json(text) {
        Ok(v) => (v, false),
        Err(e) if e.contains("truncated") => {
            let complete = salvage_records(text);
            if complete.is_empty() {
                return Err(e);
            }
            (serde_json::json!({ "records": complete }), true)
        }
        Err(e) => return Err(e),
    };
    let list = value
        .get("records")
        .and_then(Value::as_array)
        .ok_or("the reply has no `records` list")?;
    let mut dropped = 0;
    let mut records = Vec::new();
    for item in list {
        match record_from(item, ctx, &mut dropped) {
            Some(r) => push_merged(&mut records, r),
            None => dropped += 1,
        }
    }
    let disambiguation = disambiguation_of(&value);
    Ok(Parsed {
        records,
        disambiguation,
        dropped: dropped + usize::from(truncated),
        truncated,
    })
}

/// The record objects that closed inside the `records` array of a reply cut off mid-way.
fn salvage_records(text: &str) -> Vec<Value> {
    let Some(start) = text.find("\"records\"") else {
        return Vec::new();
    };
    let rest = &text[start..];
    let Some(open) = rest.find('[') else {
        return Vec::new();
    };
    let body = &rest[open + 1..];
    let mut out = Vec::new();
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let mut object_start = None;
    for (i, c) in body.char_indices() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => {
                if depth == 0 {
                    object_start = Some(i);
                }
                depth += 1;
            }
            '}' => {
                if depth == 0 {
                    break;
                }
                depth -= 1;
                if depth == 0
                    && let Some(s) = object_start.take()
                    && let Ok(v) = serde_json::from_str(&body[s..=i])
                {
                    out.push(v);
                }
            }
            ']' if depth == 0 => break,
            _ => {}
        }
    }
    out
}

/// Parses a `summary_records` reply into its single record.
pub fn parse_summary(text: &str, ctx: &ParseContext<'_>) -> Result<Parsed, String> {
    let value = extract_json(text)?;
    let summary = value
        .get("summary")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .ok_or("the reply has no `summary`")?;
    let record = Record {
        record_id: Record::make_id(ctx.namespace, summary),
        memory_type: MemoryType::Fact,
        semantic_text: summary.to_string(),
        normalized_text: Record::make_normalized_text(MemoryType::Fact, summary),
        entities: Vec::new(),
        tags: Vec::new(),
        temporal: TemporalScope::default(),
        evidence_turns: (ctx.first_turn..ctx.first_turn + ctx.turn_count).collect(),
        source_session: ctx.session.clone(),
        source_role: SourceRole::Both,
        segment_id: ctx.segment_id.to_string(),
        created_at: ctx.created_at.clone(),
        confidence: 1.0,
    };
    let disambiguation = disambiguation_of(&value);
    Ok(Parsed {
        records: vec![record],
        disambiguation,
        dropped: 0,
        truncated: false,
    })
}
