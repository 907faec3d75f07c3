//! Token accounting (docs/algorithm.md, "Cost and token accounting"): every generative call is
//! logged with its purpose.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why an LLM call was made. Construction cost = `Encode`; query cost = `Plan` + `Answer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    Encode,
    Plan,
    Answer,
    Judge,
    Other,
}

/// One metered LLM call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub purpose: Purpose,
    pub model: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub latency_ms: u64,
    /// True when the backend did not report usage and the counts were estimated.
    pub estimated: bool,
}

/// Totals per purpose.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageTotals {
    pub by_purpose: BTreeMap<Purpose, PurposeTotals>,
}

/// Totals of one purpose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurposeTotals {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl UsageTotals {
    pub fn add(&mut self, usage: &TokenUsage) {
        let t = self.by_purpose.entry(usage.purpose).or_default();
        t.calls += 1;
        t.prompt_tokens += usage.prompt_tokens;
        t.completion_tokens += usage.completion_tokens;
    }

    /// Prompt + completion tokens of one purpose.
    pub fn tokens(&self, purpose: Purpose) -> u64 {
        self.by_purpose
            .get(&purpose)
            .map_or(0, |t| t.prompt_tokens + t.completion_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_accumulate_per_purpose() {
        let mut totals = UsageTotals::default();
        for (purpose, p, c) in [
            (Purpose::Encode, 100, 20),
            (Purpose::Encode, 50, 5),
            (Purpose::Plan, 7, 3),
        ] {
            totals.add(&TokenUsage {
                purpose,
                model: "m".into(),
                prompt_tokens: p,
                completion_tokens: c,
                latency_ms: 1,
                estimated: false,
            });
        }
        assert_eq!(totals.tokens(Purpose::Encode), 175);
        assert_eq!(totals.by_purpose[&Purpose::Encode].calls, 2);
        assert_eq!(totals.tokens(Purpose::Plan), 10);
        assert_eq!(totals.tokens(Purpose::Answer), 0);
    }
}
