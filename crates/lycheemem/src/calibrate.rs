//! Fitting the segmentation calibration of an embedder from unlabeled conversations
//! (docs/algorithm.md, "Calibration to the embedder"): each session is cut into exchanges the
//! way a memory cuts it, every exchange is embedded as the segmenter embeds it, and
//! [`lycheemem_segment::calibration::fit`] measures the surprise distribution.

use crate::formats::{Conversation, Format, read};
use lycheemem_core::config::SegmentConfig;
use lycheemem_core::{Error, Result, SessionId, Turn};
use lycheemem_embed::Embedder;
use lycheemem_segment::calibration::{CalibrationFit, fit};
use lycheemem_segment::{ExchangeBuilder, ExchangeMode};
use std::path::PathBuf;

/// Exchanges embedded per call, so memory stays bounded on large corpora.
const EMBED_CHUNK: usize = 256;

/// Fewest scored exchanges a calibration is fitted from.
pub const MIN_CALIBRATION_EXCHANGES: usize = 200;

/// The conversations of `files` (any format [`read`] detects) except those named in `skip`, at
/// most `per_file` from each file (in file order).
pub fn read_conversations(
    files: &[PathBuf],
    skip: &[String],
    per_file: Option<usize>,
) -> Result<Vec<Conversation>> {
    let mut out = Vec::new();
    for path in files {
        out.extend(
            read(path, Format::Auto, None, None)?
                .conversations
                .into_iter()
                .filter(|c| c.name.as_ref().is_none_or(|n| !skip.contains(n)))
                .take(per_file.unwrap_or(usize::MAX)),
        );
    }
    Ok(out)
}

/// The embedding texts of each session's exchanges (chat logs: a user message and its replies;
/// logs with named speakers: one turn each, as a memory groups them).
pub fn session_exchange_texts(
    conversations: &[Conversation],
    segment: &SegmentConfig,
) -> Result<Vec<Vec<String>>> {
    let mut out = Vec::new();
    for conversation in conversations {
        for session in &conversation.sessions {
            let Some(first) = session.turns.first() else {
                continue;
            };
            let mode = if first.speaker.is_some() {
                ExchangeMode::PerTurn
            } else {
                ExchangeMode::Chat
            };
            // The id only labels the turns here; any valid one does.
            let id = SessionId::new("calibration")?;
            let mut builder = ExchangeBuilder::new(mode);
            let mut pending = Vec::new();
            for (i, t) in session.turns.iter().enumerate() {
                let turn = Turn {
                    session: id.clone(),
                    index: i as u32,
                    role: t.role,
                    speaker: t.speaker.clone(),
                    text: t.text.clone(),
                    time: t.time.clone(),
                };
                pending.extend(builder.push(&turn));
            }
            pending.extend(builder.finish());
            out.push(
                pending
                    .iter()
                    .map(|p| p.embedding_text(segment.embed_head_tail_chars))
                    .collect(),
            );
        }
    }
    Ok(out)
}

/// Fits the calibration of `embedder` on `conversations`; an error when they hold fewer than
/// [`MIN_CALIBRATION_EXCHANGES`] scored exchanges or nothing to measure.
pub fn fit_segment_calibration(
    embedder: &dyn Embedder,
    conversations: &[Conversation],
    segment: &SegmentConfig,
) -> Result<CalibrationFit> {
    let sessions = session_exchange_texts(conversations, segment)?;
    let mut vectors: Vec<Vec<Vec<f32>>> = Vec::with_capacity(sessions.len());
    for texts in &sessions {
        let mut session = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(EMBED_CHUNK) {
            let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            let embedded = embedder.embed(&refs)?;
            if embedded.len() != refs.len() {
                return Err(Error::Model("the embedder returned too few vectors".into()));
            }
            session.extend(embedded);
        }
        vectors.push(session);
    }
    let scored: usize = vectors.iter().map(|s| s.len().saturating_sub(1)).sum();
    fit(&vectors, segment.previous_window, MIN_CALIBRATION_EXCHANGES).ok_or_else(|| {
        Error::InvalidInput(format!(
            "cannot calibrate from {scored} scored exchanges (need at least \
             {MIN_CALIBRATION_EXCHANGES} in sessions of two or more, not all alike)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{Format, parse};
    use lycheemem_testkit::HashEmbedder;

    fn chat_file(sessions: usize, turns: usize) -> String {
        let words = [
            "beagle", "garden", "violin", "mortgage", "hiking", "recipe", "chess", "tax",
        ];
        let mut out = Vec::new();
        for s in 0..sessions {
            let mut ts = Vec::new();
            for t in 0..turns {
                let w = words[(s * 7 + t * 3) % words.len()];
                let role = if t % 2 == 0 { "user" } else { "assistant" };
                ts.push(format!(
                    r#"{{"role": "{role}", "text": "my {w} and the {w} of {s} {t}"}}"#
                ));
            }
            out.push(format!(
                r#"{{"id": "s{s}", "date": "2024-03-01", "turns": [{}]}}"#,
                ts.join(",")
            ));
        }
        format!(r#"{{"sessions": [{}]}}"#, out.join(","))
    }

    #[test]
    fn fits_from_chat_sessions_grouped_into_exchanges() {
        let parsed = parse(&chat_file(30, 20), Format::Auto, "s", None).unwrap();
        let cfg = SegmentConfig::default();
        let texts = session_exchange_texts(&parsed.conversations, &cfg).unwrap();
        // A user message and its reply make one exchange.
        assert_eq!(texts.len(), 30);
        assert!(texts.iter().all(|s| s.len() == 10));
        assert!(texts[0][0].contains('\n'));
        let fit =
            fit_segment_calibration(&HashEmbedder::new(64), &parsed.conversations, &cfg).unwrap();
        assert_eq!(fit.exchanges, 30 * 9);
        assert!(fit.calibration.is_valid());
        assert!(fit.calibration.surprise_center > 0.0 && fit.calibration.surprise_center < 2.0);
    }

    #[test]
    fn too_little_text_is_a_clear_error() {
        let parsed = parse(&chat_file(2, 4), Format::Auto, "s", None).unwrap();
        let err = fit_segment_calibration(
            &HashEmbedder::new(64),
            &parsed.conversations,
            &SegmentConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("cannot calibrate"), "{err}");
    }
}
