//! Conversation vocabulary: namespaces, sessions, turns, exchanges and segments.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::error::{Error, Result};

/// One user's (tenant's) whole memory. Nothing ever crosses namespaces.
///
/// A namespace is 1..=128 characters from `[A-Za-z0-9._-]` not starting with `.`, so it can
/// appear in keys, paths and URLs without escaping (and never names `.` or `..`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Namespace(String);

impl Namespace {
    /// Validates and wraps a namespace name.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if name.is_empty()
            || name.len() > 128
            || name.starts_with('.')
            || !name.chars().all(valid_char)
        {
            return Err(Error::InvalidInput(format!(
                "namespace {name:?} must be 1-128 characters from [A-Za-z0-9._-], not starting with '.'"
            )));
        }
        Ok(Namespace(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Namespace {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        Namespace::new(value)
    }
}

impl From<Namespace> for String {
    fn from(value: Namespace) -> Self {
        value.0
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Identifier of one dated conversation inside a namespace (caller-chosen, non-empty).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

impl SessionId {
    /// Validates and wraps a session id: 1..=256 characters, not all whitespace, no control
    /// characters.
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        if id.trim().is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
            return Err(Error::InvalidInput(format!(
                "session id {id:?} must be 1-256 characters, not blank, without control characters"
            )));
        }
        Ok(SessionId(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for SessionId {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        SessionId::new(value)
    }
}

impl From<SessionId> for String {
    fn from(value: SessionId) -> Self {
        value.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Stable address of a raw turn: its session and its 0-based position in that session.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TurnRef {
    pub session: SessionId,
    pub index: u32,
}

/// Who produced a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
    System,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::System => "system",
        }
    }
}

/// One raw conversation turn as it arrived. Stored before any LLM work touches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub session: SessionId,
    /// 0-based position in the session; stable forever once assigned.
    pub index: u32,
    pub role: Role,
    /// Speaker name in multi-party logs (e.g. LoCoMo's "Caroline"); `None` for plain chat.
    pub speaker: Option<String>,
    pub text: String,
    /// Time of the turn as an ISO-8601 date or date-time, when known.
    pub time: Option<String>,
}

impl Turn {
    pub fn turn_ref(&self) -> TurnRef {
        TurnRef {
            session: self.session.clone(),
            index: self.index,
        }
    }

    /// The label a prompt or an embedding uses for the author: the speaker name, else the role.
    pub fn author(&self) -> &str {
        self.speaker.as_deref().unwrap_or(self.role.as_str())
    }
}

/// The unit the segmenter consumes: one user message plus the assistant replies that follow
/// it, or — in two-speaker logs without an assistant — a single turn with its speaker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exchange {
    pub session: SessionId,
    /// Index of the first turn of the exchange in its session.
    pub first_turn: u32,
    /// Index of the last turn (inclusive).
    pub last_turn: u32,
    /// `author: text` lines of the exchange, the text that is embedded.
    pub text: String,
    /// Estimated tokens of `text`.
    pub tokens: u32,
}

/// Why a segment was closed (docs/algorithm.md, "Order of decisions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinalizeReason {
    /// Adding the next exchange would exceed the maximum token budget.
    CapacityLimit,
    /// The boundary probability crossed the cut threshold.
    SemanticBoundary,
    /// The segment reached its target length.
    TargetLength,
    /// The segment reached its exchange cap.
    ExchangeLimit,
    /// A single exchange larger than the maximum was split.
    Oversized,
    /// The session ended or was flushed explicitly.
    SessionFlush,
    /// The `per_exchange` policy closes every exchange.
    PerExchange,
}

/// A finalized run of consecutive turns of one session, the unit of one encoder call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Stable id: `<session>#<first_turn>-<last_turn>`.
    pub id: String,
    pub session: SessionId,
    pub first_turn: u32,
    /// Inclusive.
    pub last_turn: u32,
    pub exchanges: u32,
    pub tokens: u32,
    pub reason: FinalizeReason,
}

impl Segment {
    /// The canonical id of the segment spanning `first..=last` in `session`.
    pub fn make_id(session: &SessionId, first: u32, last: u32) -> String {
        format!("{session}#{first}-{last}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_validation() {
        assert!(Namespace::new("alice-01.prod_x").is_ok());
        assert!(Namespace::new("").is_err());
        assert!(Namespace::new("a/b").is_err());
        assert!(Namespace::new("x".repeat(129)).is_err());
        let err = serde_json::from_str::<Namespace>("\"no spaces\"").unwrap_err();
        assert!(err.to_string().contains("namespace"));
    }

    #[test]
    fn session_rejects_control_chars() {
        assert!(SessionId::new("session 1").is_ok());
        assert!(SessionId::new("a\nb").is_err());
        assert!(SessionId::new("").is_err());
        assert!(SessionId::new("   ").is_err());
        assert!(SessionId::new("\u{3000}").is_err(), "blank in any script");
    }
}
