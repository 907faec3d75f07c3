//! Usage metering: a wrapper that records every call (purpose, tokens, latency, model) into a
//! sink the store can persist.

use lycheemem_core::{Purpose, Result, TokenUsage, UsageTotals};
use std::sync::{Arc, Mutex};

use crate::{ChatMessage, Completion, GenerateOptions, Llm};

/// Receives one record per metered call.
pub trait UsageSink: Send + Sync {
    fn record(&self, usage: TokenUsage);
}

/// An in-memory sink with totals per purpose.
#[derive(Debug, Default)]
pub struct MemorySink {
    calls: Mutex<Vec<TokenUsage>>,
}

impl MemorySink {
    pub fn calls(&self) -> Vec<TokenUsage> {
        self.calls.lock().expect("usage lock").clone()
    }

    pub fn totals(&self) -> UsageTotals {
        let mut totals = UsageTotals::default();
        for call in self.calls.lock().expect("usage lock").iter() {
            totals.add(call);
        }
        totals
    }
}

impl UsageSink for MemorySink {
    fn record(&self, usage: TokenUsage) {
        self.calls.lock().expect("usage lock").push(usage);
    }
}

/// An [`Llm`] that reports each call to a sink under a fixed purpose.
pub struct Metered {
    inner: Arc<dyn Llm>,
    purpose: Purpose,
    sink: Arc<dyn UsageSink>,
}

impl Metered {
    pub fn new(inner: Arc<dyn Llm>, purpose: Purpose, sink: Arc<dyn UsageSink>) -> Self {
        Metered {
            inner,
            purpose,
            sink,
        }
    }
}

impl Llm for Metered {
    fn complete(&self, messages: &[ChatMessage], options: &GenerateOptions) -> Result<Completion> {
        let completion = self.inner.complete(messages, options)?;
        self.sink.record(TokenUsage {
            purpose: self.purpose,
            model: completion.model.clone(),
            prompt_tokens: completion.prompt_tokens,
            completion_tokens: completion.completion_tokens,
            latency_ms: completion.latency_ms,
            estimated: completion.usage_estimated,
        });
        Ok(completion)
    }

    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn context_length(&self) -> Option<usize> {
        self.inner.context_length()
    }
}
