//! Realistic benchmark text: LoCoMo turns as `speaker: text` (image captions appended as the
//! benchmark README describes). Read from a path; never copied into the repository.

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::Path;

/// The first `limit` turns of the LoCoMo file at `path`, in conversation order.
pub fn turns(path: &Path, limit: usize) -> Result<Vec<String>> {
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", path.display()))?;
    let mut texts = Vec::new();
    for conv in data.as_array().context("LoCoMo file must be a JSON list")? {
        let c = &conv["conversation"];
        for n in 1.. {
            let Some(session) = c.get(format!("session_{n}")).and_then(Value::as_array) else {
                break;
            };
            for t in session {
                let speaker = t["speaker"].as_str().unwrap_or("speaker");
                let mut text = t["text"].as_str().unwrap_or("").to_string();
                if let Some(caption) = t.get("blip_caption").and_then(Value::as_str) {
                    text.push_str(&format!(" [shares a photo of {caption}]"));
                }
                texts.push(format!("{speaker}: {text}"));
                if texts.len() == limit {
                    return Ok(texts);
                }
            }
        }
    }
    Ok(texts)
}
