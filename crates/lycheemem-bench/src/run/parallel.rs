//! The run's worker pool: inputs `jobs` at a time, results and progress on the calling thread,
//! a panic counted as its input's error.

use super::*;

/// Sets its flag when dropped (also while a panic unwinds).
pub(super) struct SetOnDrop<'a>(pub(super) &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A message from a worker of [`for_each_parallel`].
pub(super) enum Message<R> {
    Line(String),
    Done(Result<R>),
}

/// Runs the work on input `i` (0-based), a panic in it becoming that input's error: in
/// [`for_each_parallel`] the other workers then start no new input, as after any error,
/// instead of working through the rest while the caller waits for a result that never comes.
pub(super) fn caught<R>(i: usize, work: impl FnOnce() -> Result<R>) -> Result<R> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(anyhow::anyhow!("input {} panicked: {what}", i + 1))
    })
}

/// Runs `work` on every input with up to `jobs` threads (inputs in order, `jobs` ≤ 1 on the
/// calling thread). `done` receives each result on the calling thread as it arrives, and
/// `progress` the lines the workers report. After the first error (a panic in `work` counts as
/// one) no new input is started, the running ones finish, and that error is returned.
pub(super) fn for_each_parallel<T: Sync, R: Send>(
    jobs: usize,
    inputs: &[T],
    work: impl Fn(&T, &mut dyn FnMut(String)) -> Result<R> + Sync,
    progress: &mut dyn FnMut(String),
    mut done: impl FnMut(R, &mut dyn FnMut(String)) -> Result<()>,
) -> Result<()> {
    if jobs <= 1 || inputs.len() <= 1 {
        for (i, input) in inputs.iter().enumerate() {
            let result = caught(i, || work(input, &mut *progress))?;
            done(result, &mut *progress)?;
        }
        return Ok(());
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<Message<R>>();
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(inputs.len()) {
            let tx = tx.clone();
            let (next, failed, work) = (&next, &failed, &work);
            scope.spawn(move || {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(input) = inputs.get(i) else { break };
                    let mut say = |line: String| {
                        let _ = tx.send(Message::Line(line));
                    };
                    let result = caught(i, || work(input, &mut say));
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    if tx.send(Message::Done(result)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut first_error = None;
        for message in rx {
            match message {
                Message::Line(line) => progress(line),
                Message::Done(result) => {
                    if let Err(e) = result.and_then(|r| done(r, &mut *progress)) {
                        failed.store(true, Ordering::SeqCst);
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}
