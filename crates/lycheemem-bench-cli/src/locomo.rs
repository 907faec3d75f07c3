//! LoCoMo text for the component benchmarks, read through the harness loader
//! ([`lycheemem_bench::dataset`]) so every command sees the turns a `run` ingests.

use anyhow::{Result, bail};
use lycheemem_bench::{DatasetKind, dataset};
use lycheemem_core::{SessionId, Turn};
use std::path::Path;

/// One LoCoMo conversation as sessions of stored-shape turns.
pub struct Conversation {
    pub id: String,
    pub sessions: Vec<Vec<Turn>>,
    /// `session_N_date_time` of each session, as given.
    pub dates: Vec<Option<String>>,
}

/// The conversations of the LoCoMo file at `path`.
pub fn conversations(path: &Path) -> Result<Vec<Conversation>> {
    let data = dataset::load(path)?;
    if data.kind != DatasetKind::Locomo {
        bail!("{} is not a LoCoMo file", path.display());
    }
    let mut out = Vec::new();
    for item in data.items {
        let mut sessions = Vec::new();
        let mut dates = Vec::new();
        for s in item.sessions {
            let session = SessionId::new(s.id)?;
            sessions.push(
                s.turns
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| Turn {
                        session: session.clone(),
                        index: i as u32,
                        role: t.role,
                        speaker: t.speaker,
                        text: t.text,
                        time: t.time,
                    })
                    .collect(),
            );
            dates.push(s.date);
        }
        out.push(Conversation {
            id: item.id,
            sessions,
            dates,
        });
    }
    Ok(out)
}

/// The first `limit` turns of a LoCoMo file as `speaker: text` lines, in conversation order.
pub fn turn_texts(path: &Path, limit: usize) -> Result<Vec<String>> {
    let mut texts = Vec::new();
    for conv in conversations(path)? {
        for t in conv.sessions.into_iter().flatten() {
            if texts.len() == limit {
                return Ok(texts);
            }
            texts.push(format!(
                "{}: {}",
                t.speaker.as_deref().unwrap_or("speaker"),
                t.text
            ));
        }
    }
    Ok(texts)
}
