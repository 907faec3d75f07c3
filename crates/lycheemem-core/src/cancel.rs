//! Cancellation of work done on behalf of a caller that may go away (an HTTP client that
//! disconnects or times out). The caller raises the flag; long steps check it — the local LLM
//! between decoding steps, the remote client before each attempt, retrieval between its plan
//! and its routes — and stop with [`Error::Cancelled`].

use crate::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A shared cancellation flag. [`Cancel::default`] is never raised (nothing to check).
#[derive(Debug, Clone, Default)]
pub struct Cancel(Option<Arc<AtomicBool>>);

impl Cancel {
    /// A flag that can be raised.
    pub fn new() -> Self {
        Cancel(Some(Arc::new(AtomicBool::new(false))))
    }

    /// Raises the flag for every clone.
    pub fn cancel(&self) {
        if let Some(flag) = &self.0 {
            flag.store(true, Ordering::Relaxed);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// `Err(Error::Cancelled)` naming `what` was stopped, once the flag is raised.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Cancelled(format!(
                "{what} stopped: its caller went away"
            )));
        }
        Ok(())
    }

    /// A guard that raises the flag when dropped unless [`CancelOnDrop::disarm`]ed: held by a
    /// request handler, it cancels the work when the handler is dropped before finishing.
    pub fn on_drop(&self) -> CancelOnDrop {
        CancelOnDrop {
            cancel: self.clone(),
            armed: true,
        }
    }
}

/// Two flags are equal when they are the same flag (or both never raised).
impl PartialEq for Cancel {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// See [`Cancel::on_drop`].
#[derive(Debug)]
pub struct CancelOnDrop {
    cancel: Cancel,
    armed: bool,
}

impl CancelOnDrop {
    /// The work finished: dropping the guard cancels nothing.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.cancel.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_guard_cancels_every_clone_and_a_disarmed_one_does_not() {
        let c = Cancel::new();
        let seen_by_worker = c.clone();
        c.on_drop().disarm();
        assert!(seen_by_worker.check("x").is_ok());
        drop(c.on_drop());
        assert!(matches!(
            seen_by_worker.check("x"),
            Err(Error::Cancelled(_))
        ));
        assert!(!Cancel::default().is_cancelled());
        Cancel::default().cancel();
        assert_ne!(Cancel::new(), Cancel::new());
        assert_eq!(Cancel::default(), Cancel::default());
    }
}
