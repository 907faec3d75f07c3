//! The reference context ρ (docs/algorithm.md, "Reference context ρ"): `Resolved references:` +
//! the previous disambiguation note (≤ 1,200 chars) + the last 12 record texts of the session,
//! the whole ≤ 2,400 chars. It only helps resolve references; it is never a source of facts.
//! Persisted per (namespace, session).

use lycheemem_core::config::EncodeConfig;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The per-session state behind ρ.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReferenceContext {
    /// The last disambiguation note the encoder produced.
    pub note: String,
    /// Texts of the most recent records of the session, oldest first.
    pub recent_records: VecDeque<String>,
}

fn truncate_chars(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl ReferenceContext {
    /// ρ as it goes into the prompt; empty when there is nothing to say.
    pub fn render(&self, cfg: &EncodeConfig) -> String {
        if self.note.trim().is_empty() && self.recent_records.is_empty() {
            return String::new();
        }
        let mut out = String::from("Resolved references:\n");
        let note = truncate_chars(self.note.trim(), cfg.reference_note_chars);
        if !note.is_empty() {
            out.push_str(note);
            out.push('\n');
        }
        // Newest records are the most useful: add from newest back while the budget allows.
        let mut lines: Vec<String> = Vec::new();
        let mut used = out.chars().count();
        for text in self.recent_records.iter().rev().take(cfg.reference_records) {
            let line = format!("- {text}\n");
            let n = line.chars().count();
            if used + n > cfg.reference_context_chars {
                break;
            }
            used += n;
            lines.push(line);
        }
        for line in lines.iter().rev() {
            out.push_str(line);
        }
        truncate_chars(&out, cfg.reference_context_chars).to_string()
    }

    /// Records a finished segment's note and record texts.
    pub fn update(
        &mut self,
        note: &str,
        record_texts: impl IntoIterator<Item = String>,
        cfg: &EncodeConfig,
    ) {
        if !note.trim().is_empty() {
            self.note = truncate_chars(note.trim(), cfg.reference_note_chars).to_string();
        }
        for text in record_texts {
            self.recent_records.push_back(text);
        }
        while self.recent_records.len() > cfg.reference_records {
            self.recent_records.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_budgets_and_keeps_the_newest() {
        let cfg = EncodeConfig {
            reference_records: 12,
            ..Default::default()
        };
        let mut rho = ReferenceContext::default();
        assert_eq!(rho.render(&cfg), "");
        let texts: Vec<String> = (0..30)
            .map(|i| format!("record number {i} {}", "x".repeat(150)))
            .collect();
        rho.update(&"n".repeat(5000), texts, &cfg);
        assert_eq!(rho.note.chars().count(), 1200);
        assert_eq!(rho.recent_records.len(), 12);
        let text = rho.render(&cfg);
        assert!(text.starts_with("Resolved references:\n"));
        assert!(text.chars().count() <= 2400);
        assert!(text.contains("record number 29"), "newest kept");
        assert!(!text.contains("record number 17 "), "oldest dropped first");
    }
}
