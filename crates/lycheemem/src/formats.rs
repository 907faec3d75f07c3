//! Conversation files a memory can ingest, all read into [`Conversation`]s: dated sessions of
//! turns, each bound for a namespace. `lycheemem ingest` and the benchmark harness both read
//! through this module, so a memory built by either holds the same turns.
//!
//! * [`Format::Lycheemem`] — the project's own JSON:
//!   `{"sessions": [{"id": "s1", "date": "2024-03-01", "turns": [{"role": "user", "text": "…"},
//!   {"role": "assistant", "text": "…"}, {"speaker": "Caroline", "text": "…"}]}]}`
//!   (`role` defaults to `user`; `speaker` names a participant of a multi-party log).
//! * [`Format::Jsonl`] — one turn per line: `{"session": "s1", "date": "2024-03-01",
//!   "role": "user", "speaker": null, "text": "…"}` (`date` may appear on any line of the session).
//! * [`Format::Chat`] — OpenAI-style messages, `[{"role": "user", "content": "…"}, …]` or
//!   `{"messages": [...]}`: one session; `system` messages are skipped.
//! * [`Format::Locomo`] — the LoCoMo JSON list; one conversation per sample (named by its
//!   `sample_id`), speakers kept, image captions appended as `[shares an image: …]`, empty turns
//!   dropped.
//! * [`Format::Longmemeval`] — LongMemEval items; one conversation per item (named by its
//!   `question_id`) holding the item's haystack; `system` turns and empty turns dropped.
//!
//! `.zst` files are decompressed first. Malformed input is an error naming where it is; nothing
//! panics on any input.
//!
//! ```
//! use lycheemem::formats::{Format, parse};
//! let text = r#"{"sessions": [{"id": "s1", "date": "2024-03-01", "turns": [{"text": "hi"}]}]}"#;
//! let parsed = parse(text, Format::Auto, "s", None).unwrap();
//! assert_eq!(parsed.conversations[0].sessions[0].turns[0].text, "hi");
//! ```

use crate::NewTurn;
use lycheemem_core::{Error, Result, Role};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

/// A file format [`read`] understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Detected from the content.
    Auto,
    Lycheemem,
    Jsonl,
    Chat,
    Locomo,
    Longmemeval,
}

impl Format {
    /// Every format by its name, as [`FromStr`] accepts it.
    pub const ALL: [(&'static str, Format); 6] = [
        ("auto", Format::Auto),
        ("lycheemem", Format::Lycheemem),
        ("jsonl", Format::Jsonl),
        ("chat", Format::Chat),
        ("locomo", Format::Locomo),
        ("longmemeval", Format::Longmemeval),
    ];

    /// The format's name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, f)| *f == self)
            .map_or("auto", |(n, _)| n)
    }
}

impl FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Format> {
        Self::ALL
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|(_, f)| *f)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                Error::InvalidInput(format!(
                    "unknown format {s:?} (one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// What the source file said about a turn besides its text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnOrigin {
    /// The file's id of the turn (LoCoMo `dia_id`).
    pub id: Option<String>,
    /// The file marks the turn as holding an answer (LongMemEval `has_answer`).
    pub has_answer: bool,
}

/// One dated session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    /// The date as the file gives it (the memory normalizes it).
    pub date: Option<String>,
    pub turns: Vec<NewTurn>,
    /// Parallel to `turns`.
    pub origins: Vec<TurnOrigin>,
}

impl Session {
    fn new(id: String, date: Option<String>) -> Session {
        Session {
            id,
            date,
            turns: Vec::new(),
            origins: Vec::new(),
        }
    }

    fn push(&mut self, turn: NewTurn, origin: TurnOrigin) {
        self.turns.push(turn);
        self.origins.push(origin);
    }
}

/// Sessions bound for one namespace.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The name the file gives this conversation (LoCoMo `sample_id`, LongMemEval
    /// `question_id`); `None` for formats that hold one unnamed conversation. The CLI stores a
    /// named conversation in namespace `<namespace>.<name>`.
    pub name: Option<String>,
    pub sessions: Vec<Session>,
}

/// A parsed file: its conversations and what was skipped or repaired, one line each.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub format: Format,
    pub conversations: Vec<Conversation>,
    pub notes: Vec<String>,
}

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidInput(message.into())
}

/// The most bytes a compressed input file may expand to (the largest benchmark file,
/// LongMemEval-M, is about 2.7 GB as JSON): a small file that claims more is refused instead of
/// filling memory.
pub const MAX_DECOMPRESSED_BYTES: u64 = 4 << 30;

/// A file's bytes, decompressed when its name ends in `.zst` (zstd windows up to 2^31, at most
/// [`MAX_DECOMPRESSED_BYTES`]).
pub fn decompress(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>> {
    decompress_at_most(path, raw, MAX_DECOMPRESSED_BYTES)
}

fn decompress_at_most(path: &Path, raw: Vec<u8>, limit: u64) -> Result<Vec<u8>> {
    if path.extension().is_none_or(|e| e != "zst") {
        return Ok(raw);
    }
    let mut decoder = zstd::stream::read::Decoder::new(raw.as_slice())
        .map_err(|e| invalid(format!("{}: not zstd: {e}", path.display())))?;
    decoder
        .window_log_max(31)
        .map_err(|e| invalid(format!("{}: zstd window: {e}", path.display())))?;
    let mut out = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(decoder, limit.saturating_add(1)),
        &mut out,
    )
    .map_err(|e| invalid(format!("decompressing {}: {e}", path.display())))?;
    if out.len() as u64 > limit {
        return Err(invalid(format!(
            "{} expands to more than {limit} bytes",
            path.display()
        )));
    }
    Ok(out)
}

/// Text from bytes, or an error naming the first invalid byte.
pub fn utf8(path: &Path, bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        invalid(format!(
            "{} is not valid UTF-8 (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Reads `path` in `format`. `session` and `date` name the one session of a [`Format::Chat`]
/// file (default: the file's stem, no date).
pub fn read(
    path: &Path,
    format: Format,
    session: Option<&str>,
    date: Option<&str>,
) -> Result<Parsed> {
    let raw = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = utf8(path, decompress(path, raw)?)?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("session");
    parse(&text, format, session.unwrap_or(stem), date)
        .map_err(|e| invalid(format!("{}: {}", path.display(), detail(&e))))
}

fn detail(e: &Error) -> String {
    match e {
        Error::InvalidInput(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Parses `text` in `format` (detected from the content with [`Format::Auto`]); `chat_session`
/// and `chat_date` name the one session of a chat log.
pub fn parse(
    text: &str,
    format: Format,
    chat_session: &str,
    chat_date: Option<&str>,
) -> Result<Parsed> {
    let format = match format {
        Format::Auto => match serde_json::from_str::<Value>(text) {
            Ok(v) => detect(&v, text),
            Err(_) => Format::Jsonl,
        },
        f => f,
    };
    if format == Format::Jsonl {
        return Ok(one(format, read_jsonl(text)?));
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    parse_value(&value, format, chat_session, chat_date)
}

/// Parses an already-decoded JSON document (any format but [`Format::Jsonl`]).
pub fn parse_value(
    value: &Value,
    format: Format,
    chat_session: &str,
    chat_date: Option<&str>,
) -> Result<Parsed> {
    let format = match format {
        Format::Auto => detect(value, ""),
        f => f,
    };
    match format {
        Format::Lycheemem => Ok(one(format, read_own(value)?)),
        Format::Chat => Ok(one(format, read_chat(value, chat_session, chat_date)?)),
        Format::Locomo => locomo(value),
        Format::Longmemeval => longmemeval(value),
        Format::Jsonl => Err(invalid("JSON Lines is read from text, not a JSON value")),
        Format::Auto => unreachable!("resolved above"),
    }
}

fn one(format: Format, sessions: Vec<Session>) -> Parsed {
    Parsed {
        format,
        conversations: vec![Conversation {
            name: None,
            sessions,
        }],
        notes: Vec::new(),
    }
}

/// The format a document is in, judged from its shape.
pub fn detect(value: &Value, raw: &str) -> Format {
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

fn role(v: Option<&Value>) -> Result<Role> {
    Ok(match v.and_then(Value::as_str).unwrap_or("user") {
        "user" | "human" => Role::User,
        "assistant" | "ai" | "bot" => Role::Assistant,
        "system" => Role::System,
        other => {
            return Err(invalid(format!(
                "unknown role {other:?} (use user, assistant or system)"
            )));
        }
    })
}

/// A message's text: a string, or the text parts of OpenAI-style content parts.
pub fn content_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

fn str_of(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

fn read_own(value: &Value) -> Result<Vec<Session>> {
    let sessions = value
        .get("sessions")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("expected {\"sessions\": [...]}"))?;
    let mut out = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        let id = str_of(s, "id").unwrap_or_else(|| format!("session-{}", i + 1));
        let mut session = Session::new(id, str_of(s, "date"));
        for (j, t) in s
            .get("turns")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = |m: &str| invalid(format!("session {}, turn {j}: {m}", session.id));
            let text = t
                .get("text")
                .and_then(content_of)
                .ok_or_else(|| at("missing \"text\""))?;
            let role = role(t.get("role")).map_err(|e| at(&detail(&e)))?;
            session.push(
                NewTurn {
                    role,
                    speaker: str_of(t, "speaker"),
                    text,
                    time: str_of(t, "time"),
                },
                TurnOrigin::default(),
            );
        }
        out.push(session);
    }
    Ok(out)
}

fn read_jsonl(raw: &str) -> Result<Vec<Session>> {
    let mut sessions: Vec<Session> = Vec::new();
    for (n, line) in raw.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |m: &str| invalid(format!("line {}: {m}", n + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| at(&format!("not JSON: {e}")))?;
        let id = v
            .get("session")
            .and_then(Value::as_str)
            .ok_or_else(|| at("missing \"session\""))?;
        let text = v
            .get("text")
            .and_then(content_of)
            .ok_or_else(|| at("missing \"text\""))?;
        let turn = NewTurn {
            role: role(v.get("role")).map_err(|e| at(&detail(&e)))?,
            speaker: str_of(&v, "speaker"),
            text,
            time: str_of(&v, "time"),
        };
        let date = str_of(&v, "date");
        let index = match sessions.iter().position(|s| s.id == id) {
            Some(i) => i,
            None => {
                sessions.push(Session::new(id.to_string(), None));
                sessions.len() - 1
            }
        };
        let s = &mut sessions[index];
        s.date = s.date.take().or(date);
        s.push(turn, TurnOrigin::default());
    }
    Ok(sessions)
}

fn read_chat(value: &Value, session: &str, date: Option<&str>) -> Result<Vec<Session>> {
    let messages = value
        .as_array()
        .or_else(|| value.get("messages").and_then(Value::as_array))
        .ok_or_else(|| invalid("expected a list of {role, content} messages"))?;
    let mut out = Session::new(session.to_string(), date.map(str::to_string));
    for (i, m) in messages.iter().enumerate() {
        let at = |msg: &str| invalid(format!("message {i}: {msg}"));
        let r = role(m.get("role")).map_err(|e| at(&detail(&e)))?;
        if r == Role::System {
            continue;
        }
        let text = m
            .get("content")
            .and_then(content_of)
            .ok_or_else(|| at("missing \"content\""))?;
        out.push(
            NewTurn {
                role: r,
                speaker: str_of(m, "name"),
                text,
                time: None,
            },
            TurnOrigin::default(),
        );
    }
    Ok(vec![out])
}

/// LoCoMo conversations, one per sample and in file order (the QA of sample `i` belongs to
/// conversation `i`).
pub fn locomo(value: &Value) -> Result<Parsed> {
    let list = value
        .as_array()
        .ok_or_else(|| invalid("LoCoMo must be a JSON list"))?;
    let mut conversations = Vec::new();
    let mut notes = Vec::new();
    for (i, conv) in list.iter().enumerate() {
        let name = str_of(conv, "sample_id").unwrap_or_else(|| format!("conv-{i}"));
        let c = &conv["conversation"];
        let mut sessions = Vec::new();
        for n in 1.. {
            let Some(turns) = c.get(format!("session_{n}")).and_then(Value::as_array) else {
                break;
            };
            let mut session = Session::new(
                format!("session_{n}"),
                str_of(c, &format!("session_{n}_date_time")),
            );
            for t in turns {
                let speaker = t
                    .get("speaker")
                    .and_then(Value::as_str)
                    .unwrap_or("speaker");
                let mut text = str_of(t, "text").unwrap_or_default();
                if let Some(caption) = t.get("blip_caption").and_then(Value::as_str) {
                    text.push_str(&format!(" [shares an image: {caption}]"));
                }
                let id = str_of(t, "dia_id");
                if text.trim().is_empty() {
                    notes.push(format!("{name}: empty turn {id:?} dropped"));
                    continue;
                }
                session.push(
                    NewTurn::spoken(speaker, text),
                    TurnOrigin {
                        id,
                        has_answer: false,
                    },
                );
            }
            sessions.push(session);
        }
        conversations.push(Conversation {
            name: Some(name),
            sessions,
        });
    }
    Ok(Parsed {
        format: Format::Locomo,
        conversations,
        notes,
    })
}

/// LongMemEval items, one conversation per item and in file order, each holding the item's
/// haystack. Repeated session ids get a `-N` suffix.
pub fn longmemeval(value: &Value) -> Result<Parsed> {
    let list = value
        .as_array()
        .ok_or_else(|| invalid("LongMemEval must be a JSON list"))?;
    let mut conversations = Vec::new();
    let mut notes = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let name = str_of(item, "question_id").unwrap_or_else(|| format!("item-{i}"));
        let strings = |key: &str| -> Vec<Option<String>> {
            item.get(key)
                .and_then(Value::as_array)
                .map(|d| d.iter().map(|x| x.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        let dates = strings("haystack_dates");
        let ids = strings("haystack_session_ids");
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut sessions = Vec::new();
        for (n, s) in item
            .get("haystack_sessions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let mut id = ids
                .get(n)
                .cloned()
                .flatten()
                .unwrap_or_else(|| format!("session-{}", n + 1));
            let count = seen.entry(id.clone()).or_insert(0);
            *count += 1;
            if *count > 1 {
                id = format!("{id}-{count}");
            }
            let mut session = Session::new(id, dates.get(n).cloned().flatten());
            for (t_index, t) in s.as_array().into_iter().flatten().enumerate() {
                let Some(text) = t.get("content").and_then(content_of) else {
                    notes.push(format!(
                        "{name}: turn {}/{t_index} has no content",
                        session.id
                    ));
                    continue;
                };
                let role = match t.get("role").and_then(Value::as_str).unwrap_or("user") {
                    "assistant" | "ai" | "bot" => Role::Assistant,
                    "system" => Role::System,
                    _ => Role::User,
                };
                if text.trim().is_empty() || role == Role::System {
                    continue;
                }
                session.push(
                    NewTurn {
                        role,
                        speaker: None,
                        text,
                        time: None,
                    },
                    TurnOrigin {
                        id: None,
                        has_answer: t.get("has_answer").and_then(Value::as_bool) == Some(true),
                    },
                );
            }
            sessions.push(session);
        }
        conversations.push(Conversation {
            name: Some(name),
            sessions,
        });
    }
    Ok(Parsed {
        format: Format::Longmemeval,
        conversations,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_and_reads_each_format() {
        let own = json!({"sessions": [{"id": "a", "date": "2024-01-01", "turns": [{"text": "hi"}, {"role": "assistant", "text": "hello"}]}]});
        assert_eq!(detect(&own, ""), Format::Lycheemem);
        assert_eq!(read_own(&own).unwrap()[0].turns.len(), 2);
        let chat = json!([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]);
        assert_eq!(detect(&chat, ""), Format::Chat);
        assert_eq!(read_chat(&chat, "s", None).unwrap()[0].turns.len(), 1);
        let jsonl = "{\"session\": \"a\", \"text\": \"x\"}\n{\"session\": \"b\", \"text\": \"y\", \"date\": \"2024-02-02\"}\n";
        let c = parse(jsonl, Format::Auto, "s", None).unwrap();
        assert_eq!(c.format, Format::Jsonl);
        let sessions = &c.conversations[0].sessions;
        assert_eq!(sessions.len(), 2);
        assert_eq!(sessions[1].date.as_deref(), Some("2024-02-02"));
        assert!(read_jsonl("{\"text\": \"no session\"}").is_err());
        let err = read_own(&json!({"sessions": [{"turns": [{"role": "robot", "text": "x"}]}]}))
            .unwrap_err();
        assert!(err.to_string().contains("robot"), "{err}");
        assert_eq!("LoCoMo".parse::<Format>().unwrap(), Format::Locomo);
        assert!("xml".parse::<Format>().is_err());
        for (name, f) in Format::ALL {
            assert_eq!(f.name(), name);
        }
    }

    #[test]
    fn locomo_keeps_speakers_and_captions_and_drops_empty_turns() {
        let v = json!([{
            "sample_id": "c1",
            "conversation": {
                "session_1_date_time": "1:56 pm on 8 May, 2023",
                "session_1": [
                    {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat."},
                    {"speaker": "Bob", "dia_id": "D1:2", "text": "", "blip_caption": "a cat on a sofa"},
                    {"speaker": "Ann", "dia_id": "D1:3", "text": ""}
                ]
            }
        }]);
        let p = locomo(&v).unwrap();
        let s = &p.conversations[0].sessions[0];
        assert_eq!(p.conversations[0].name.as_deref(), Some("c1"));
        assert_eq!(s.turns.len(), 2);
        assert_eq!(s.turns[1].speaker.as_deref(), Some("Bob"));
        assert!(
            s.turns[1]
                .text
                .contains("[shares an image: a cat on a sofa]")
        );
        assert_eq!(s.origins[1].id.as_deref(), Some("D1:2"));
        assert!(p.notes.iter().any(|n| n.contains("D1:3")));
    }

    #[test]
    fn zst_and_invalid_utf8_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json.zst");
        let data = br#"{"sessions": [{"id": "a", "turns": [{"text": "hi"}]}]}"#;
        std::fs::write(&path, zstd::encode_all(&data[..], 3).unwrap()).unwrap();
        let p = read(&path, Format::Auto, None, None).unwrap();
        assert_eq!(p.conversations[0].sessions[0].turns[0].text, "hi");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, b"\xff\xfe").unwrap();
        let err = read(&bad, Format::Auto, None, None).unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{err}");
        assert!(matches!(err, Error::InvalidInput(_)));
        // A small file that expands beyond the limit is refused (here a 1 MB limit and 4 MB of
        // zeros in a few hundred bytes); at the limit it is read.
        let zeros = zstd::encode_all(&vec![0u8; 4 << 20][..], 19).unwrap();
        assert!(zeros.len() < 4096);
        let bomb = dir.path().join("bomb.json.zst");
        let err = decompress_at_most(&bomb, zeros.clone(), 1 << 20).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains("expands to more than"), "{err}");
        assert_eq!(
            decompress_at_most(&bomb, zeros, 4 << 20).unwrap().len(),
            4 << 20
        );
    }

    fn hostile() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let strings = prop_oneof![
            any::<String>(),
            Just("user".to_string()),
            Just("9999999-12-31".to_string()),
        ];
        lycheemem_testkit::hostile_json(
            strings.boxed(),
            &[
                "sessions",
                "turns",
                "text",
                "role",
                "id",
                "date",
                "conversation",
                "session_1",
                "haystack_sessions",
            ],
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Every format's reader gives conversations or a clear error for any JSON, and the
        /// line reader for any text; none panics.
        #[test]
        fn no_input_panics_a_reader(value in hostile(), text in proptest::prelude::any::<String>()) {
            for (_, f) in Format::ALL {
                if f != Format::Jsonl {
                    let _ = parse_value(&value, f, "s", Some("2024-01-01"));
                }
            }
            let _ = parse(&text, Format::Auto, "s", None);
            let _ = parse(&format!("{value}\n{value}"), Format::Jsonl, "s", None);
        }
    }
}
