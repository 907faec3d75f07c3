//! The background encoding workers. Handlers store turns durably and enqueue a job; worker
//! threads take jobs in arrival order and segment and encode them (LLM calls). Jobs of different
//! sessions run concurrently (a local LLM decodes their calls together); a session's jobs wait
//! for each other, since its segments are encoded in order. The queue is bounded: a full queue
//! refuses new turns *before* they are stored (429). On shutdown the queue closes, the worker
//! workers finish what is queued (or, past the drain deadline, leaves it: the turns are durable and
//! the next start re-queues every session with unprocessed turns).

use crate::metrics::Metrics;
use lycheemem::{IngestReceipt, Memory};
use lycheemem_core::{Namespace, SessionId};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

pub enum Job {
    /// Segment and encode what was appended.
    Process { ns: Namespace, session: SessionId },
    /// Close the session (final segment encoded) and report.
    Flush {
        ns: Namespace,
        session: SessionId,
        reply: oneshot::Sender<lycheemem_core::Result<IngestReceipt>>,
    },
}

/// Counts a receipt into the metrics.
pub fn count(metrics: &Metrics, r: &IngestReceipt) {
    metrics
        .segments_encoded
        .fetch_add(r.segments.len() as u64, Ordering::Relaxed);
    metrics
        .segments_failed
        .fetch_add(r.failed_segments, Ordering::Relaxed);
    metrics.record_tokens("encode", "total", r.encode_tokens);
}

/// Starts `workers` (at least one) worker threads; they end when every sender is dropped and
/// the queue is empty.
pub fn spawn(
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<Job>,
    workers: usize,
) -> Vec<std::thread::JoinHandle<()>> {
    let rx = Arc::new(Mutex::new(rx));
    (0..workers.max(1))
        .map(|i| {
            let (memory, metrics, rx) = (memory.clone(), metrics.clone(), rx.clone());
            std::thread::Builder::new()
                .name(format!("lycheemem-encode-{i}"))
                .spawn(move || work(&memory, &metrics, &rx))
                .expect("the worker thread starts")
        })
        .collect()
}

fn work(memory: &Memory, metrics: &Metrics, rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        // One worker waits on the queue at a time; the lock is released before the job runs.
        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).blocking_recv();
        let Some(job) = job else {
            return;
        };
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        match job {
            Job::Process { ns, session } => match memory.process(&ns, &session) {
                Ok(r) => count(metrics, &r),
                Err(e) => {
                    metrics.worker_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("processing {ns}/{session}: {e}");
                }
            },
            Job::Flush { ns, session, reply } => {
                let r = memory.flush(&ns, &session);
                if let Ok(r) = &r {
                    count(metrics, r);
                }
                let _ = reply.send(r);
            }
        }
    }
}
