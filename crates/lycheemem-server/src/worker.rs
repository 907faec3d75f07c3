//! The background encoding worker. Handlers store turns durably and enqueue a job; one worker
//! thread segments and encodes (LLM calls) in arrival order. The queue is bounded: a full queue
//! refuses new turns *before* they are stored (429). On shutdown the queue closes, the worker
//! finishes what is queued (or, past the drain deadline, leaves it: the turns are durable and
//! the next start re-queues every session with unprocessed turns).

use crate::metrics::Metrics;
use lycheemem::{IngestReceipt, Memory};
use lycheemem_core::{Namespace, SessionId};
use std::sync::Arc;
use std::sync::atomic::Ordering;
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

/// Starts the worker thread; it ends when every sender is dropped and the queue is empty.
pub fn spawn(
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    mut rx: mpsc::Receiver<Job>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("lycheemem-encode".into())
        .spawn(move || {
            while let Some(job) = rx.blocking_recv() {
                metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                match job {
                    Job::Process { ns, session } => match memory.process(&ns, &session) {
                        Ok(r) => count(&metrics, &r),
                        Err(e) => {
                            metrics.worker_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!("processing {ns}/{session}: {e}");
                        }
                    },
                    Job::Flush { ns, session, reply } => {
                        let r = memory.flush(&ns, &session);
                        if let Ok(r) = &r {
                            count(&metrics, r);
                        }
                        let _ = reply.send(r);
                    }
                }
            }
        })
        .expect("the worker thread starts")
}
