//! LoCoMo and LongMemEval loaders. Both become [`Item`]s: dated sessions of turns to ingest and
//! the questions asked about them, with the gold evidence mapped onto stored turn positions.
//! Parsing is defensive: integer answers, empty or malformed evidence ids, adversarial items,
//! image captions and abstention ids are handled, and everything skipped is reported.

use anyhow::{Context, Result, bail};
use lycheemem::formats;
use lycheemem_core::date::normalize_date;
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    Locomo,
    LongMemEval,
}

impl DatasetKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetKind::Locomo => "locomo",
            DatasetKind::LongMemEval => "longmemeval",
        }
    }
}

/// A loaded benchmark file.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub kind: DatasetKind,
    pub path: PathBuf,
    /// SHA-256 of the file's bytes as read (compressed if it is `.zst`).
    pub sha256: String,
    pub items: Vec<Item>,
    /// What was skipped or repaired while parsing, one line each.
    pub skipped: Vec<String>,
}

/// One memory to build (a LoCoMo conversation, a LongMemEval haystack) and its questions.
#[derive(Debug, Clone)]
pub struct Item {
    pub id: String,
    pub sessions: Vec<Session>,
    pub questions: Vec<Question>,
}

/// A dated session of turns, as [`lycheemem::formats`] reads it.
pub use lycheemem::formats::Session;

/// A stored turn position: session id and index (turns are stored in order from 0).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TurnAt {
    pub session: String,
    pub index: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Question {
    pub id: String,
    /// LoCoMo: `multi_hop`, `temporal`, `open_domain`, `single_hop`, `adversarial`;
    /// LongMemEval: the `question_type`.
    pub category: String,
    /// LoCoMo's numeric category (0 for LongMemEval).
    pub category_number: u32,
    pub question: String,
    pub answer: String,
    /// Turns holding the answer (LoCoMo evidence dia_ids; LongMemEval `has_answer` turns).
    pub evidence: Vec<TurnAt>,
    /// Sessions holding the answer (LongMemEval `answer_session_ids`; LoCoMo: the evidence
    /// turns' sessions).
    pub evidence_sessions: Vec<String>,
    /// The question's reference date (ISO when it parses).
    pub date: Option<String>,
    /// LongMemEval `_abs`: the right answer is that the information is not available.
    pub abstention: bool,
}

/// LoCoMo category names by the official numbering.
pub fn locomo_category(n: u64) -> Option<&'static str> {
    Some(match n {
        1 => "multi_hop",
        2 => "temporal",
        3 => "open_domain",
        4 => "single_hop",
        5 => "adversarial",
        _ => return None,
    })
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Loads a LoCoMo or LongMemEval file, detecting which from its content.
pub fn load(path: &Path) -> Result<Dataset> {
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let sha256 = sha256_hex(&raw);
    let text = formats::utf8(path, formats::decompress(path, raw)?)?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", path.display()))?;
    let first = value
        .as_array()
        .and_then(|a| a.first())
        .with_context(|| format!("{} is not a non-empty JSON list", path.display()))?;
    let (kind, (items, skipped)) = if first.get("conversation").is_some() {
        (DatasetKind::Locomo, locomo_items(&value)?)
    } else if first.get("haystack_sessions").is_some() {
        (DatasetKind::LongMemEval, longmemeval_items(&value)?)
    } else {
        bail!(
            "{} is neither LoCoMo (items with \"conversation\") nor LongMemEval (items with \"haystack_sessions\")",
            path.display()
        );
    };
    Ok(Dataset {
        kind,
        path: path.to_path_buf(),
        sha256,
        items,
        skipped,
    })
}

fn answer_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

static DIA_ID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"D(\d+)\s*:\s*(\d+)").expect("valid regex"));

/// LoCoMo conversations as items (image captions appended to the turn text, speakers kept;
/// empty turns dropped). The question date is the last session's date.
pub fn locomo_items(value: &Value) -> Result<(Vec<Item>, Vec<String>)> {
    let parsed = formats::locomo(value)?;
    let mut skipped = parsed.notes;
    let mut items = Vec::new();
    let list = value.as_array().context("LoCoMo must be a JSON list")?;
    for (conv, parsed) in list.iter().zip(parsed.conversations) {
        let id = parsed.name.unwrap_or_default();
        let sessions = parsed.sessions;
        let mut by_dia: HashMap<String, TurnAt> = HashMap::new();
        for s in &sessions {
            for (index, origin) in s.origins.iter().enumerate() {
                if let Some(d) = &origin.id {
                    let norm = DIA_ID
                        .captures(d)
                        .map_or_else(|| d.clone(), |m| format!("D{}:{}", &m[1], &m[2]));
                    by_dia.insert(
                        norm,
                        TurnAt {
                            session: s.id.clone(),
                            index: index as u32,
                        },
                    );
                }
            }
        }
        let question_date = sessions
            .iter()
            .rev()
            .find_map(|s| s.date.as_deref().and_then(normalize_date));
        let mut questions = Vec::new();
        for (q, qa) in conv
            .get("qa")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let qid = format!("{id}-q{}", q + 1);
            let Some(number) = qa.get("category").and_then(Value::as_u64) else {
                skipped.push(format!("{qid}: no category"));
                continue;
            };
            let Some(category) = locomo_category(number) else {
                skipped.push(format!("{qid}: unknown category {number}"));
                continue;
            };
            let Some(question) = qa.get("question").and_then(Value::as_str) else {
                skipped.push(format!("{qid}: no question"));
                continue;
            };
            let answer =
                answer_text(qa.get("answer")).or_else(|| answer_text(qa.get("adversarial_answer")));
            let Some(answer) = answer else {
                skipped.push(format!("{qid}: no answer"));
                continue;
            };
            let mut evidence = Vec::new();
            for e in qa
                .get("evidence")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                let mut any = false;
                for m in DIA_ID.captures_iter(e) {
                    any = true;
                    let key = format!("D{}:{}", &m[1], &m[2]);
                    match by_dia.get(&key) {
                        Some(at) if !evidence.contains(at) => evidence.push(at.clone()),
                        Some(_) => {}
                        None => skipped.push(format!("{qid}: evidence {key} is not a turn")),
                    }
                }
                if !any {
                    skipped.push(format!("{qid}: malformed evidence {e:?}"));
                }
            }
            let mut evidence_sessions: Vec<String> =
                evidence.iter().map(|t| t.session.clone()).collect();
            evidence_sessions.dedup();
            questions.push(Question {
                id: qid,
                category: category.to_string(),
                category_number: number as u32,
                question: question.to_string(),
                answer,
                evidence,
                evidence_sessions,
                date: question_date.clone(),
                abstention: number == 5,
            });
        }
        items.push(Item {
            id,
            sessions,
            questions,
        });
    }
    Ok((items, skipped))
}

/// LongMemEval items: each question with its own haystack. Repeated session ids get a `-N`
/// suffix; `answer_session_ids` map to the first session of that id.
pub fn longmemeval_items(value: &Value) -> Result<(Vec<Item>, Vec<String>)> {
    let parsed = formats::longmemeval(value)?;
    let mut skipped = parsed.notes;
    let mut items = Vec::new();
    let list = value
        .as_array()
        .context("LongMemEval must be a JSON list")?;
    for (item, parsed) in list.iter().zip(parsed.conversations) {
        let qid = parsed.name.unwrap_or_default();
        let sessions = parsed.sessions;
        let strings = |key: &str| -> Vec<String> {
            item.get(key)
                .and_then(Value::as_array)
                .map(|d| {
                    d.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        };
        let evidence: Vec<TurnAt> = sessions
            .iter()
            .flat_map(|s| {
                s.origins
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| o.has_answer)
                    .map(|(index, _)| TurnAt {
                        session: s.id.clone(),
                        index: index as u32,
                    })
            })
            .collect();
        let Some(question) = item.get("question").and_then(Value::as_str) else {
            skipped.push(format!("{qid}: no question"));
            continue;
        };
        let Some(answer) = answer_text(item.get("answer")) else {
            skipped.push(format!("{qid}: no answer"));
            continue;
        };
        let evidence_sessions: Vec<String> = strings("answer_session_ids")
            .into_iter()
            .filter(|id| sessions.iter().any(|s| &s.id == id))
            .collect();
        let raw_date = item.get("question_date").and_then(Value::as_str);
        items.push(Item {
            id: qid.clone(),
            sessions,
            questions: vec![Question {
                id: qid.clone(),
                category: item
                    .get("question_type")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown")
                    .to_string(),
                category_number: 0,
                question: question.to_string(),
                answer,
                evidence,
                evidence_sessions,
                date: raw_date.map(|d| normalize_date(d).unwrap_or_else(|| d.to_string())),
                abstention: qid.ends_with("_abs"),
            }],
        });
    }
    Ok((items, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn locomo_parses_defensively() {
        let v = json!([{
            "sample_id": "c1",
            "conversation": {
                "speaker_a": "Ann", "speaker_b": "Bob",
                "session_1_date_time": "1:56 pm on 8 May, 2023",
                "session_1": [
                    {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat."},
                    {"speaker": "Bob", "dia_id": "D1:2", "text": "", "blip_caption": "a cat on a sofa"},
                    {"speaker": "Ann", "dia_id": "D1:3", "text": ""}
                ],
                "session_2_date_time": "10:00 am on 9 June, 2023",
                "session_2": [{"speaker": "Bob", "dia_id": "D2:1", "text": "Nice!"}]
            },
            "qa": [
                {"question": "What did Ann adopt?", "answer": "a cat", "evidence": ["D1:1"], "category": 4},
                {"question": "How many?", "answer": 2, "evidence": ["D1:2; D2:1"], "category": 1},
                {"question": "Trick?", "adversarial_answer": "none", "evidence": [], "category": 5},
                {"question": "Bad", "answer": "x", "evidence": ["nonsense", "D9:9"], "category": 2},
                {"question": "No category", "answer": "x"}
            ]
        }]);
        let (items, skipped) = locomo_items(&v).unwrap();
        let item = &items[0];
        assert_eq!(item.sessions[0].turns.len(), 2, "the empty turn is dropped");
        assert!(item.sessions[0].turns[1].text.contains("a cat on a sofa"));
        let q = &item.questions;
        assert_eq!(q.len(), 4);
        assert_eq!(q[1].answer, "2");
        assert_eq!(
            q[1].evidence,
            vec![
                TurnAt {
                    session: "session_1".into(),
                    index: 1
                },
                TurnAt {
                    session: "session_2".into(),
                    index: 0
                }
            ]
        );
        assert_eq!(q[2].category, "adversarial");
        assert!(q[2].abstention);
        assert!(q[3].evidence.is_empty());
        assert_eq!(
            q[0].date.as_deref(),
            Some("2023-06-09"),
            "last session's date"
        );
        assert!(skipped.iter().any(|s| s.contains("malformed")));
        assert!(skipped.iter().any(|s| s.contains("D9:9")));
        assert!(skipped.iter().any(|s| s.contains("no category")));
    }

    #[test]
    fn longmemeval_maps_has_answer_turns_and_abstention() {
        let v = json!([{
            "question_id": "q1_abs", "question_type": "single-session-user",
            "question": "Where?", "answer": 3, "question_date": "2023/05/30 (Tue) 23:40",
            "haystack_session_ids": ["a", "a", "b"],
            "haystack_dates": ["2023/05/01 (Mon) 10:00", null, "2023/05/02 (Tue) 10:00"],
            "haystack_sessions": [
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "has_answer": true}],
                [{"role": "user", "content": ""}],
                [{"role": "system", "content": "sys"}, {"role": "user", "content": "x", "has_answer": true}]
            ],
            "answer_session_ids": ["b", "zzz"]
        }]);
        let (items, _) = longmemeval_items(&v).unwrap();
        let q = &items[0].questions[0];
        assert!(q.abstention);
        assert_eq!(q.answer, "3");
        assert_eq!(q.date.as_deref(), Some("2023-05-30"));
        assert_eq!(items[0].sessions[1].id, "a-2");
        assert_eq!(
            q.evidence,
            vec![
                TurnAt {
                    session: "a".into(),
                    index: 1
                },
                TurnAt {
                    session: "b".into(),
                    index: 0
                }
            ]
        );
        assert_eq!(q.evidence_sessions, vec!["b".to_string()]);
    }

    #[test]
    fn zst_files_are_decompressed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json.zst");
        let data =
            br#"[{"question_id": "q", "question": "?", "answer": "a", "haystack_sessions": []}]"#;
        std::fs::write(&path, zstd::encode_all(&data[..], 3).unwrap()).unwrap();
        let d = load(&path).unwrap();
        assert_eq!(d.kind, DatasetKind::LongMemEval);
        assert_eq!(d.items.len(), 1);
        std::fs::write(dir.path().join("bad.json"), b"\xff\xfe").unwrap();
        assert!(
            load(&dir.path().join("bad.json"))
                .unwrap_err()
                .to_string()
                .contains("UTF-8")
        );
    }
}
