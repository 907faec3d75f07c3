//! Running a reference implementation's Python script for a same-run comparison: the script
//! (embedded in the binary) is written to a private temporary folder together with its inputs,
//! run with the given interpreter, and its last stdout line is read as JSON. The folder is
//! removed when the run is dropped.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct ReferenceRun {
    dir: PathBuf,
    script: PathBuf,
}

impl ReferenceRun {
    /// Writes `source` as `<tag>.py` into a fresh temporary folder.
    pub fn new(tag: &str, source: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("lycheemem-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let script = dir.join(format!("{tag}.py"));
        std::fs::write(&script, source)?;
        Ok(ReferenceRun { dir, script })
    }

    /// A path inside the run's folder (for inputs and outputs of the script).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Runs the script with `args` on `threads` threads and returns its last stdout line as JSON.
    pub fn run<I: AsRef<OsStr>>(
        &self,
        python: &Path,
        args: impl IntoIterator<Item = I>,
        threads: usize,
    ) -> Result<Value> {
        let output = Command::new(python)
            .arg(&self.script)
            .args(args)
            .env("OMP_NUM_THREADS", threads.to_string())
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            bail!(
                "reference run failed: {}",
                stderr.lines().last().unwrap_or("")
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout
            .lines()
            .last()
            .context("the reference printed nothing")?;
        serde_json::from_str(line).context("the reference output is not JSON")
    }
}

impl Drop for ReferenceRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
