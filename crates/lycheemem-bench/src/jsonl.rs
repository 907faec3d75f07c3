//! JSON Lines files: the harness's checkpoints (predictions, plans, construction) and the
//! shared LLM call logs. One policy for a torn line everywhere: appends lock the file, remove a
//! last line a kill cut short, and sync; reads ignore a torn *last* line and refuse any other
//! unreadable line (a checkpoint read as empty would make a run redo, and count twice, finished
//! work). A leaf module: it uses nothing else of the crate.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// The values of a JSON Lines checkpoint (none when it does not exist). A last line cut short by
/// a kill mid-write is ignored; any other unreadable line, or a file that cannot be read, is an
/// error (a checkpoint read as empty would make a run redo, and count twice, finished work).
pub fn read_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
    };
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(v) => out.push(v),
            // A line cut by a kill mid-write: ignore it (the question is simply redone).
            Err(_) if n + 1 == text.lines().count() => {}
            Err(e) => {
                return Err(anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1));
            }
        }
    }
    Ok(out)
}

/// Appends one JSON line (synced; see [`append_to_log`]).
pub fn append_line<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut line = serde_json::to_vec(value)?;
    line.push(b'\n');
    append_to_log(path, &line).with_context(|| format!("appending to {}", path.display()))
}

/// Appends `line` (one JSON line with its `\n`) to a JSON Lines file, created if missing, under
/// an exclusive lock on the file (logs in the cache are shared by every run on the machine), and
/// synced. A last line a kill cut short is removed first, so `line` never continues it.
fn append_to_log(path: &Path, line: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    f.lock()?; // released when `f` is closed
    cut_torn_tail(&mut f)?;
    f.write_all(line)?;
    f.sync_data()
}

/// Ends a JSON Lines file opened for reading and appending with its last complete line: a write
/// cut short by a kill leaves a partial last line, which a reader skips as long as it is the
/// last, but a line appended after it would join it and make both unreadable. A last line that
/// is whole JSON but lacks its `\n` (a file written by hand) is kept and given one.
fn cut_torn_tail(f: &mut std::fs::File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let len = f.metadata()?.len();
    let mut end = len;
    let mut buf = [0u8; 4096];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
            end = start + i as u64 + 1;
            break;
        }
        end = start;
    }
    if end == len {
        return Ok(());
    }
    let mut tail = Vec::new();
    f.seek(SeekFrom::Start(end))?;
    f.read_to_end(&mut tail)?;
    if serde_json::from_slice::<serde::de::IgnoredAny>(&tail).is_ok() {
        f.write_all(b"\n")
    } else {
        f.set_len(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_appended_after_a_torn_one_stays_readable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("predictions.jsonl");
        append_line(&path, &serde_json::json!({"n": 1})).unwrap();
        // A kill in the middle of the second write.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"n\": 2, \"te").unwrap();
        drop(f);
        let before: Vec<serde_json::Value> = read_lines(&path).unwrap();
        assert_eq!(before.len(), 1, "a torn last line is skipped");
        append_line(&path, &serde_json::json!({"n": 3})).unwrap();
        append_line(&path, &serde_json::json!({"n": 4})).unwrap();
        let after: Vec<serde_json::Value> = read_lines(&path).unwrap();
        let ns: Vec<i64> = after.iter().map(|v| v["n"].as_i64().unwrap()).collect();
        assert_eq!(ns, [1, 3, 4]);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":3}\n{\"n\":4}\n"
        );
        // A file as left on disk, after one more line is appended.
        let appended = |name: &str, on_disk: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, on_disk).unwrap();
            append_line(&path, &serde_json::json!({"n": 9})).unwrap();
            std::fs::read_to_string(&path).unwrap()
        };
        // A whole last line without its newline is kept.
        assert_eq!(
            appended("hand.jsonl", "{\"n\":6}\n{\"n\":7}"),
            "{\"n\":6}\n{\"n\":7}\n{\"n\":9}\n"
        );
        // A file holding only a torn line is emptied before the append.
        assert_eq!(appended("only.jsonl", "{\"n\""), "{\"n\":9}\n");
    }

    #[test]
    fn an_unreadable_checkpoint_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let missing: Vec<serde_json::Value> = read_lines(&dir.path().join("none.jsonl")).unwrap();
        assert!(missing.is_empty());
        // A folder where the file should be cannot be read as a file.
        let err = read_lines::<serde_json::Value>(dir.path()).unwrap_err();
        assert!(err.to_string().contains("reading"), "{err:#}");
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, [b'{', 0xff, b'}', b'\n']).unwrap();
        assert!(
            read_lines::<serde_json::Value>(&bad).is_err(),
            "invalid UTF-8"
        );
    }
}
