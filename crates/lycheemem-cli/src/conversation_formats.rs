//! Input formats `lycheemem ingest` reads, all turned into [`Conversation`]s: dated sessions of
//! turns, each bound for a namespace.
//!
//! * `lycheemem` — the project's own JSON:
//!   `{"sessions": [{"id": "s1", "date": "2024-03-01", "turns": [{"role": "user", "text": "…"},
//!   {"role": "assistant", "text": "…"}, {"speaker": "Caroline", "text": "…"}]}]}`
//!   (`role` defaults to `user`; `speaker` names a participant of a multi-party log).
//! * `jsonl` — one turn per line: `{"session": "s1", "date": "2024-03-01", "role": "user",
//!   "speaker": null, "text": "…"}` (`date` may appear on any line of the session).
//! * `chat` — OpenAI-style messages, `[{"role": "user", "content": "…"}, …]` or
//!   `{"messages": [...]}`: one session (`--session`, `--date`); `system` messages are skipped.
//! * `locomo` — the LoCoMo JSON list; each conversation goes to namespace `<ns>.<sample_id>`,
//!   speakers kept, image captions appended as text.
//! * `longmemeval` — LongMemEval items; each item's haystack goes to `<ns>.<question_id>`.
//!
//! `.zst` files are decompressed first.

use anyhow::{Context, Result, bail};
use lycheemem::NewTurn;
use lycheemem_core::Role;
use serde_json::Value;
use std::path::Path;

/// One dated session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    pub date: Option<String>,
    pub turns: Vec<NewTurn>,
}

/// Sessions bound for one namespace suffix (`None` = the namespace given on the command line).
#[derive(Debug, Clone)]
pub struct Conversation {
    pub namespace_suffix: Option<String>,
    pub sessions: Vec<Session>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Auto,
    Lycheemem,
    Jsonl,
    Chat,
    Locomo,
    Longmemeval,
}

fn role(v: Option<&Value>) -> Result<Role> {
    Ok(match v.and_then(Value::as_str).unwrap_or("user") {
        "user" | "human" => Role::User,
        "assistant" | "ai" | "bot" => Role::Assistant,
        "system" => Role::System,
        other => bail!("unknown role {other:?} (use user, assistant or system)"),
    })
}

use lycheemem_bench::dataset::content_of as text_of;

fn detect(value: &Value, raw: &str) -> Format {
    if let Some(list) = value.as_array() {
        let first = list.first();
        if first.is_some_and(|f| f.get("conversation").is_some()) {
            return Format::Locomo;
        }
        if first.is_some_and(|f| f.get("haystack_sessions").is_some()) {
            return Format::Longmemeval;
        }
        return Format::Chat;
    }
    if value.get("sessions").is_some() {
        return Format::Lycheemem;
    }
    if value.get("messages").is_some() {
        return Format::Chat;
    }
    if raw.lines().filter(|l| !l.trim().is_empty()).count() > 1 {
        return Format::Jsonl;
    }
    Format::Lycheemem
}

/// Reads `path` in `format` (detected from the content with `Auto`).
pub fn read(
    path: &Path,
    format: Format,
    session: Option<&str>,
    date: Option<&str>,
) -> Result<Vec<Conversation>> {
    let (bytes, _) = lycheemem_bench::dataset::read_maybe_zst(path)?;
    let raw = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("session")
        .to_string();
    let format = match format {
        Format::Auto => match serde_json::from_str::<Value>(&raw) {
            Ok(v) => detect(&v, &raw),
            Err(_) => Format::Jsonl,
        },
        f => f,
    };
    if format == Format::Jsonl {
        return read_jsonl(&raw);
    }
    let value: Value = serde_json::from_str(&raw)
        .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", path.display()))?;
    match format {
        Format::Lycheemem => read_own(&value),
        Format::Chat => read_chat(&value, session.unwrap_or(&stem), date),
        Format::Locomo => read_locomo(&value),
        Format::Longmemeval => read_longmemeval(&value),
        Format::Auto | Format::Jsonl => unreachable!("resolved above"),
    }
}

fn read_own(value: &Value) -> Result<Vec<Conversation>> {
    let sessions = value
        .get("sessions")
        .and_then(Value::as_array)
        .context("expected {\"sessions\": [...]}")?;
    let mut out = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        let id = s
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| format!("session-{}", i + 1), str::to_string);
        let mut turns = Vec::new();
        for (j, t) in s
            .get("turns")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let text = t
                .get("text")
                .and_then(text_of)
                .with_context(|| format!("session {id}, turn {j}: missing \"text\""))?;
            turns.push(NewTurn {
                role: role(t.get("role")).with_context(|| format!("session {id}, turn {j}"))?,
                speaker: t.get("speaker").and_then(Value::as_str).map(str::to_string),
                text,
                time: t.get("time").and_then(Value::as_str).map(str::to_string),
            });
        }
        out.push(Session {
            id,
            date: s.get("date").and_then(Value::as_str).map(str::to_string),
            turns,
        });
    }
    Ok(vec![Conversation {
        namespace_suffix: None,
        sessions: out,
    }])
}

fn read_jsonl(raw: &str) -> Result<Vec<Conversation>> {
    let mut sessions: Vec<Session> = Vec::new();
    for (n, line) in raw.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", n + 1))?;
        let id = v
            .get("session")
            .and_then(Value::as_str)
            .with_context(|| format!("line {}: missing \"session\"", n + 1))?;
        let text = v
            .get("text")
            .and_then(text_of)
            .with_context(|| format!("line {}: missing \"text\"", n + 1))?;
        let turn = NewTurn {
            role: role(v.get("role")).with_context(|| format!("line {}", n + 1))?,
            speaker: v.get("speaker").and_then(Value::as_str).map(str::to_string),
            text,
            time: v.get("time").and_then(Value::as_str).map(str::to_string),
        };
        let date = v.get("date").and_then(Value::as_str).map(str::to_string);
        match sessions.iter_mut().find(|s| s.id == id) {
            Some(s) => {
                s.date = s.date.take().or(date);
                s.turns.push(turn);
            }
            None => sessions.push(Session {
                id: id.to_string(),
                date,
                turns: vec![turn],
            }),
        }
    }
    Ok(vec![Conversation {
        namespace_suffix: None,
        sessions,
    }])
}

fn read_chat(value: &Value, session: &str, date: Option<&str>) -> Result<Vec<Conversation>> {
    let messages = value
        .as_array()
        .or_else(|| value.get("messages").and_then(Value::as_array))
        .context("expected a list of {role, content} messages")?;
    let mut turns = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let r = role(m.get("role")).with_context(|| format!("message {i}"))?;
        if r == Role::System {
            continue;
        }
        let text = m
            .get("content")
            .and_then(text_of)
            .with_context(|| format!("message {i}: missing \"content\""))?;
        turns.push(NewTurn {
            role: r,
            speaker: m.get("name").and_then(Value::as_str).map(str::to_string),
            text,
            time: None,
        });
    }
    Ok(vec![Conversation {
        namespace_suffix: None,
        sessions: vec![Session {
            id: session.to_string(),
            date: date.map(str::to_string),
            turns,
        }],
    }])
}

/// LoCoMo and LongMemEval files are read by the benchmark loaders, so `ingest` feeds a memory
/// exactly the turns a benchmark run does.
fn from_items(items: Vec<lycheemem_bench::Item>) -> Vec<Conversation> {
    items
        .into_iter()
        .map(|item| Conversation {
            namespace_suffix: Some(item.id),
            sessions: item
                .sessions
                .into_iter()
                .map(|s| Session {
                    id: s.id,
                    date: s.date,
                    turns: s.turns,
                })
                .collect(),
        })
        .collect()
}

fn read_locomo(value: &Value) -> Result<Vec<Conversation>> {
    Ok(from_items(lycheemem_bench::dataset::locomo_items(value)?.0))
}

fn read_longmemeval(value: &Value) -> Result<Vec<Conversation>> {
    Ok(from_items(
        lycheemem_bench::dataset::longmemeval_items(value)?.0,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_and_reads_each_format() {
        let own = serde_json::json!({"sessions": [{"id": "a", "date": "2024-01-01", "turns": [{"text": "hi"}, {"role": "assistant", "text": "hello"}]}]});
        assert_eq!(detect(&own, ""), Format::Lycheemem);
        let c = read_own(&own).unwrap();
        assert_eq!(c[0].sessions[0].turns.len(), 2);
        let chat = serde_json::json!([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]);
        assert_eq!(detect(&chat, ""), Format::Chat);
        assert_eq!(
            read_chat(&chat, "s", None).unwrap()[0].sessions[0]
                .turns
                .len(),
            1
        );
        let jsonl = "{\"session\": \"a\", \"text\": \"x\"}\n{\"session\": \"b\", \"text\": \"y\", \"date\": \"2024-02-02\"}\n";
        let c = read_jsonl(jsonl).unwrap();
        assert_eq!(c[0].sessions.len(), 2);
        assert_eq!(c[0].sessions[1].date.as_deref(), Some("2024-02-02"));
        assert!(read_jsonl("{\"text\": \"no session\"}").is_err());
        assert!(
            read_own(
                &serde_json::json!({"sessions": [{"turns": [{"role": "robot", "text": "x"}]}]})
            )
            .is_err()
        );
    }

    fn hostile() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| serde_json::json!(f)),
            any::<String>().prop_map(Value::from),
            Just(serde_json::json!("user")),
            Just(serde_json::json!("9999999-12-31")),
        ];
        leaf.prop_recursive(4, 48, 5, |inner| {
            let keys = prop_oneof![
                Just("sessions".to_string()),
                Just("turns".to_string()),
                Just("text".to_string()),
                Just("role".to_string()),
                Just("id".to_string()),
                Just("date".to_string()),
                Just("conversation".to_string()),
                Just("haystack_sessions".to_string()),
                "[a-z_]{1,10}",
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map(keys, inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Every format's reader gives conversations or a clear error for any JSON, and the
        /// line reader for any text; none panics.
        #[test]
        fn no_input_panics_a_reader(value in hostile(), text in proptest::prelude::any::<String>()) {
            let _ = detect(&value, &text);
            let _ = read_own(&value);
            let _ = read_chat(&value, "s", Some("2024-01-01"));
            let _ = read_locomo(&value);
            let _ = read_longmemeval(&value);
            let _ = read_jsonl(&text);
            let _ = read_jsonl(&format!("{value}\n{value}"));
        }
    }
}
