//! The background encoding workers. Handlers store turns durably and enqueue a job; worker
//! threads take jobs in arrival order and segment and encode them (LLM calls). Jobs of different
//! sessions run concurrently (a local LLM decodes their calls together); a session's segments
//! are encoded in order. Only one worker works on a session at a time: a job for a session that
//! a worker owns is handed to that worker (one more pass, or a flush after its current work), so
//! one busy session never ties up several workers. A session has at most one processing job
//! waiting in the queue ([`Waiting`]): a job processes everything stored when it runs, so more
//! turns for a session whose job still waits add none, and a few busy sessions cannot fill the
//! queue (nor can the sweeper, run after run). A panic inside a job is caught and counted;
//! the worker keeps serving. The queue is bounded: a full queue refuses new turns *before* they
//! are stored (429). On shutdown the queue closes and the workers finish what is queued (or,
//! past the drain deadline, leave it: the turns are durable and the next start re-queues every
//! session with unprocessed turns).

use crate::metrics::Metrics;
use lycheemem::{IngestReceipt, Memory};
use lycheemem_core::{Namespace, SessionId};
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
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

/// Sessions whose `Process` job waits in the queue (not yet taken by a worker).
#[derive(Default)]
pub struct Waiting(Mutex<HashSet<(Namespace, SessionId)>>);

impl Waiting {
    /// Marks the session as having a job waiting; false when it already had one (then no job
    /// need be sent: the waiting one will see what was stored).
    pub fn mark(&self, ns: &Namespace, session: &SessionId) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((ns.clone(), session.clone()))
    }

    /// Whether the session has a job waiting.
    pub fn contains(&self, ns: &Namespace, session: &SessionId) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(ns.clone(), session.clone()))
    }

    /// The session's job was taken (or could not be sent).
    pub fn unmark(&self, ns: &Namespace, session: &SessionId) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(ns.clone(), session.clone()));
    }
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

type Reply = oneshot::Sender<lycheemem_core::Result<IngestReceipt>>;

/// Work asked for a session while a worker owns it: another processing pass, and flushes.
#[derive(Default)]
struct Claim {
    again: bool,
    flushes: Vec<Reply>,
}

/// Sessions owned by a worker (only the owner works on a session; other jobs for it are handed
/// to the owner, so a busy session never ties up a second worker).
type Running = Mutex<HashMap<(Namespace, SessionId), Claim>>;

enum Work {
    Process,
    Flush(Reply),
}

/// Starts `workers` (at least one) worker threads; they end when every sender is dropped and
/// the queue is empty.
pub fn spawn(
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<Job>,
    waiting: Arc<Waiting>,
    workers: usize,
) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
    let rx = Arc::new(Mutex::new(rx));
    let running: Arc<Running> = Arc::default();
    (0..workers.max(1))
        .map(|i| {
            let (memory, metrics, rx, running, waiting) = (
                memory.clone(),
                metrics.clone(),
                rx.clone(),
                running.clone(),
                waiting.clone(),
            );
            std::thread::Builder::new()
                .name(format!("lycheemem-encode-{i}"))
                .spawn(move || work(&memory, &metrics, &rx, &running, &waiting))
        })
        .collect()
}

fn work(
    memory: &Memory,
    metrics: &Metrics,
    rx: &Mutex<mpsc::Receiver<Job>>,
    running: &Running,
    waiting: &Waiting,
) {
    loop {
        // One worker waits on the queue at a time; the lock is released before the job runs.
        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).blocking_recv();
        let Some(job) = job else {
            return;
        };
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        match job {
            Job::Process { ns, session } => {
                // Unmarked before the pass starts: turns stored from now on queue a new job.
                waiting.unmark(&ns, &session);
                submit(memory, metrics, running, (ns, session), Work::Process)
            }
            Job::Flush { ns, session, reply } => {
                submit(memory, metrics, running, (ns, session), Work::Flush(reply))
            }
        }
    }
}

/// Does `work` on a session if no worker owns it (and then whatever is handed over meanwhile),
/// or hands it to the owner and returns at once.
fn submit(
    memory: &Memory,
    metrics: &Metrics,
    running: &Running,
    key: (Namespace, SessionId),
    work: Work,
) {
    {
        let mut map = running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(claim) = map.get_mut(&key) {
            match work {
                Work::Process => claim.again = true,
                Work::Flush(reply) => claim.flushes.push(reply),
            }
            return;
        }
        map.insert(key.clone(), Claim::default());
    }
    let (ns, session) = &key;
    let mut next = work;
    loop {
        match next {
            Work::Process => match catch_unwind(AssertUnwindSafe(|| memory.process(ns, session))) {
                Ok(Ok(r)) => count(metrics, &r),
                Ok(Err(e)) => {
                    metrics.worker_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("processing {ns}/{session}: {e}");
                }
                Err(_) => {
                    metrics.worker_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        "processing {ns}/{session} panicked; its stored turns are kept"
                    );
                }
            },
            Work::Flush(reply) => {
                let r = catch_unwind(AssertUnwindSafe(|| memory.flush(ns, session)))
                    .unwrap_or_else(|_| {
                        metrics.worker_errors.fetch_add(1, Ordering::Relaxed);
                        Err(lycheemem_core::Error::Store(format!(
                            "flushing {ns}/{session} panicked; its stored turns are kept"
                        )))
                    });
                if let Ok(r) = &r {
                    count(metrics, r);
                }
                let _ = reply.send(r);
            }
        }
        let mut map = running.lock().unwrap_or_else(|p| p.into_inner());
        let Some(claim) = map.get_mut(&key) else {
            return;
        };
        // A flush processes everything stored, so it also serves a pending pass.
        next = if let Some(reply) = claim.flushes.pop() {
            claim.again = false;
            Work::Flush(reply)
        } else if std::mem::take(&mut claim.again) {
            Work::Process
        } else {
            map.remove(&key);
            return;
        };
    }
}
