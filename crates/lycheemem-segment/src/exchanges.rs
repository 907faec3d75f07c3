//! Turns → exchanges, incrementally. An exchange is closed only when the next one starts (a
//! user turn in chat logs; any turn in two-speaker logs) or at `finish`, because more assistant
//! replies may still arrive. The pending exchange is serializable so it survives restarts.

use lycheemem_core::text::head_and_tail;
use lycheemem_core::{Role, Turn, estimate_tokens};
use serde::{Deserialize, Serialize};

/// How turns group into exchanges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeMode {
    /// A user message plus the assistant (and system) turns that follow it.
    Chat,
    /// Every turn is its own exchange, keeping its speaker (LoCoMo-style logs).
    PerTurn,
    /// Two consecutive turns make one exchange, whoever speaks (LiCoMemory's dialogue chunk of
    /// a two-speaker log).
    TurnPairs,
}

/// The turns of one exchange as `(index, author, text)`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingExchange {
    pub turns: Vec<(u32, String, String)>,
}

impl PendingExchange {
    pub fn first_turn(&self) -> Option<u32> {
        self.turns.first().map(|t| t.0)
    }

    /// `author: text` lines; each turn keeps at most `head_tail` chars from its head and from
    /// its tail (docs/algorithm.md, "Turns and exchanges": very long text is truncated for
    /// embedding).
    pub fn embedding_text(&self, head_tail: usize) -> String {
        self.turns
            .iter()
            .map(|(_, author, text)| format!("{author}: {}", head_and_tail(text, head_tail)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `(turn index, estimated tokens of "author: text")` for each turn.
    pub fn turn_tokens(&self) -> Vec<(u32, u32)> {
        self.turns
            .iter()
            .map(|(i, author, text)| (*i, estimate_tokens(author) + estimate_tokens(text)))
            .collect()
    }
}

/// Groups turns into exchanges as they arrive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeBuilder {
    mode: ExchangeMode,
    pending: PendingExchange,
}

impl ExchangeBuilder {
    pub fn new(mode: ExchangeMode) -> Self {
        ExchangeBuilder {
            mode,
            pending: PendingExchange::default(),
        }
    }

    /// Adds a turn; returns the exchange it closed, if any.
    pub fn push(&mut self, turn: &Turn) -> Option<PendingExchange> {
        let starts_new = match self.mode {
            ExchangeMode::PerTurn => true,
            ExchangeMode::TurnPairs => self.pending.turns.len() >= 2,
            ExchangeMode::Chat => turn.role == Role::User,
        };
        let closed = (starts_new && !self.pending.turns.is_empty())
            .then(|| std::mem::take(&mut self.pending));
        self.pending
            .turns
            .push((turn.index, turn.author().to_string(), turn.text.clone()));
        closed
    }

    /// Closes the pending exchange (session end or flush).
    pub fn finish(&mut self) -> Option<PendingExchange> {
        (!self.pending.turns.is_empty()).then(|| std::mem::take(&mut self.pending))
    }

    pub fn pending(&self) -> &PendingExchange {
        &self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lycheemem_core::SessionId;

    fn turn(index: u32, role: Role, speaker: Option<&str>, text: &str) -> Turn {
        Turn {
            session: SessionId::new("s").unwrap(),
            index,
            role,
            speaker: speaker.map(str::to_string),
            text: text.into(),
            time: None,
        }
    }

    #[test]
    fn turn_pairs_close_every_second_turn() {
        let mut b = ExchangeBuilder::new(ExchangeMode::TurnPairs);
        let closed: Vec<Vec<u32>> = (0..5)
            .map(|i| {
                turn(
                    i,
                    Role::User,
                    Some(if i % 2 == 0 { "A" } else { "B" }),
                    "hi",
                )
            })
            .filter_map(|t| b.push(&t))
            .map(|e| e.turns.iter().map(|t| t.0).collect())
            .collect();
        assert_eq!(closed, [vec![0, 1], vec![2, 3]]);
        let rest: Vec<u32> = b.finish().unwrap().turns.iter().map(|t| t.0).collect();
        assert_eq!(rest, [4]);
    }

    #[test]
    fn chat_groups_user_with_following_assistant_turns() {
        let mut b = ExchangeBuilder::new(ExchangeMode::Chat);
        let turns = [
            turn(0, Role::Assistant, None, "Hi, how can I help?"),
            turn(1, Role::User, None, "Book a table"),
            turn(2, Role::Assistant, None, "For how many?"),
            turn(3, Role::Assistant, None, "And when?"),
            turn(4, Role::User, None, "Two, tonight"),
        ];
        let closed: Vec<Vec<u32>> = turns
            .iter()
            .filter_map(|t| b.push(t))
            .map(|e| e.turns.iter().map(|t| t.0).collect())
            .collect();
        assert_eq!(closed, [vec![0], vec![1, 2, 3]]);
        let last = b.finish().unwrap();
        assert_eq!(last.first_turn(), Some(4));
        assert_eq!(last.embedding_text(2000), "user: Two, tonight");
        assert!(b.finish().is_none());
    }

    #[test]
    fn two_speaker_logs_make_each_turn_an_exchange_with_its_speaker() {
        let mut b = ExchangeBuilder::new(ExchangeMode::PerTurn);
        assert!(
            b.push(&turn(0, Role::User, Some("Caroline"), "Hey Mel!"))
                .is_none()
        );
        let first = b
            .push(&turn(1, Role::User, Some("Melanie"), "Hi Caroline"))
            .unwrap();
        assert_eq!(first.embedding_text(2000), "Caroline: Hey Mel!");
        assert_eq!(
            b.finish().unwrap().embedding_text(2000),
            "Melanie: Hi Caroline"
        );
    }

    #[test]
    fn long_text_keeps_head_and_tail() {
        let text = format!("{}{}", "a".repeat(3000), "z".repeat(3000));
        let cut = head_and_tail(&text, 2000);
        assert!(cut.starts_with(&"a".repeat(2000)) && cut.ends_with(&"z".repeat(2000)));
        assert_eq!(cut.chars().count(), 4003);
        assert_eq!(head_and_tail("short", 2000), "short");
    }
}
