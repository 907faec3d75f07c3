//! Prometheus metrics: requests and latencies by route and status, LLM tokens by purpose,
//! turns stored, segments encoded, and the encoding queue's depth. Aggregates only: no
//! namespace appears in a label.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Latency histogram bucket bounds, seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
    latency: Mutex<BTreeMap<String, Histogram>>,
    tokens: Mutex<BTreeMap<(String, &'static str), u64>>,
    pub turns_stored: AtomicU64,
    pub segments_encoded: AtomicU64,
    pub segments_failed: AtomicU64,
    pub queue_depth: AtomicI64,
    pub worker_errors: AtomicU64,
    /// Searches and answers running now (admitted, work not yet ended).
    pub queries_in_flight: AtomicI64,
    /// Searches and answers refused because `max_queries_in_flight` were running.
    pub queries_refused: AtomicU64,
    /// Searches and answers stopped because their client went away or timed out.
    pub queries_cancelled: AtomicU64,
}

impl Metrics {
    pub fn record_request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let mut r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *r.entry((method.to_string(), route.to_string(), status))
            .or_default() += 1;
        drop(r);
        let mut l = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        let h = l.entry(route.to_string()).or_default();
        for (i, b) in BUCKETS.iter().enumerate() {
            if seconds <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += seconds;
        h.count += 1;
    }

    /// Adds tokens of a purpose; `kind` is `prompt`, `completion` or `total` (encoding
    /// receipts only report totals).
    pub fn record_tokens(&self, purpose: &str, kind: &'static str, n: u64) {
        let mut t = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let total = t.entry((purpose.to_string(), kind)).or_default();
        *total = total.saturating_add(n);
    }

    pub fn record_usage(&self, usage: &[lycheemem_core::TokenUsage]) {
        for u in usage {
            let purpose = format!("{:?}", u.purpose).to_lowercase();
            self.record_tokens(&purpose, "prompt", u.prompt_tokens);
            self.record_tokens(&purpose, "completion", u.completion_tokens);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP lycheemem_http_requests_total HTTP requests by method, route and status.\n# TYPE lycheemem_http_requests_total counter"
        );
        for ((m, r, s), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "lycheemem_http_requests_total{{method=\"{m}\",route=\"{r}\",status=\"{s}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP lycheemem_http_request_duration_seconds Request latency by route.\n# TYPE lycheemem_http_request_duration_seconds histogram"
        );
        for (route, h) in self
            .latency
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "lycheemem_http_request_duration_seconds_bucket{{route=\"{route}\",le=\"{b}\"}} {}",
                    h.counts[i]
                );
            }
            let _ = writeln!(
                out,
                "lycheemem_http_request_duration_seconds_bucket{{route=\"{route}\",le=\"+Inf\"}} {}\nlycheemem_http_request_duration_seconds_sum{{route=\"{route}\"}} {}\nlycheemem_http_request_duration_seconds_count{{route=\"{route}\"}} {}",
                h.count, h.sum, h.count
            );
        }
        let _ = writeln!(
            out,
            "# HELP lycheemem_llm_tokens_total LLM tokens by purpose and kind.\n# TYPE lycheemem_llm_tokens_total counter"
        );
        for ((p, k), n) in self.tokens.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(
                out,
                "lycheemem_llm_tokens_total{{purpose=\"{p}\",kind=\"{k}\"}} {n}"
            );
        }
        for (name, help, kind, v) in [
            (
                "lycheemem_turns_stored_total",
                "Turns stored durably.",
                "counter",
                self.turns_stored.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_segments_encoded_total",
                "Segments finalized and encoded.",
                "counter",
                self.segments_encoded.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_segments_failed_total",
                "Segments whose encoding failed (raw turns kept).",
                "counter",
                self.segments_failed.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_queries_in_flight",
                "Searches and answers running now.",
                "gauge",
                self.queries_in_flight.load(Ordering::Relaxed),
            ),
            (
                "lycheemem_queries_refused_total",
                "Searches and answers refused with 429 (too many in flight).",
                "counter",
                self.queries_refused.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_queries_cancelled_total",
                "Searches and answers stopped because their client went away or timed out.",
                "counter",
                self.queries_cancelled.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_worker_errors_total",
                "Background processing jobs that returned an error.",
                "counter",
                self.worker_errors.load(Ordering::Relaxed) as i64,
            ),
            (
                "lycheemem_encode_queue_depth",
                "Jobs waiting in the background encoding queue.",
                "gauge",
                self.queue_depth.load(Ordering::Relaxed),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.record_request("POST", "/v1/search", 200, 0.02);
        m.record_request("POST", "/v1/search", 200, 3.0);
        m.record_tokens("plan", "prompt", 100);
        m.queue_depth.store(3, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains(
            "lycheemem_http_requests_total{method=\"POST\",route=\"/v1/search\",status=\"200\"} 2"
        ));
        assert!(text.contains(
            "lycheemem_http_request_duration_seconds_bucket{route=\"/v1/search\",le=\"0.025\"} 1"
        ));
        assert!(text.contains("lycheemem_llm_tokens_total{purpose=\"plan\",kind=\"prompt\"} 100"));
        assert!(text.contains("lycheemem_encode_queue_depth 3"));
    }
}
