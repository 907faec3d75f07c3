//! Peer memory systems in the harness (variants `mem0` and `amem`): the real package, pinned in a Python
//! venv (`cargo xtask peer-venv`, [`REQUIREMENTS`]), fed each item by [`DRIVER`] and asked for
//! each question's top-k memories, which go to the same answer prompt and judge as every other
//! variant.
//!
//! The peer's LLM and embedder are the run's own models, served on a loopback
//! OpenAI-compatible [`OpenAiEndpoint`]: the same weights and decoder as lycheemem's encoder,
//! and every token the peer spends is metered there (construction = the `build` phase; query
//! = the `search` phase, spread over the questions). A peer's build of an item persists under
//! `<cache>/peers/` and resumes unit by unit; after each unit the endpoint writes the driver's
//! progress and the build's cumulative cost to `progress.json` beside it, so a resumed or cached
//! build reports what its finished units cost ([`endpoint::BuildCost`]), however often it was
//! stopped.

pub mod endpoint;

pub use endpoint::{BuildCost, OpenAiEndpoint, PhaseUsage};

use crate::construct::{ConstructionReport, namespace};
use crate::dataset::{DatasetKind, Item, Question};
use anyhow::{Context, Result, bail};
use lycheemem::EvidenceItem;
use lycheemem_core::date::normalize_date;
use lycheemem_core::{CandidateTarget, Evidence, Provenance, Role, TemporalScope};
use lycheemem_embed::Embedder;
use lycheemem_llm::Llm;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The driver the peer venv runs (written into the cache before each run).
pub const DRIVER: &str = include_str!("driver.py");
/// The peer venv's pinned packages; `cargo xtask peer-venv` installs exactly these.
pub const REQUIREMENTS: &str = include_str!("requirements.txt");
/// Pinned packages installed without their declared dependencies, after [`REQUIREMENTS`].
pub const REQUIREMENTS_NO_DEPS: &str = include_str!("requirements-no-deps.txt");
/// Bumped whenever the way an item is fed to a peer changes (part of the build's hash).
pub const PEER_PROTOCOL: u32 = 2;
/// Where `cargo xtask peer-venv` writes the requirements it installed, inside the venv.
pub const VENV_STAMP: &str = ".lycheemem-requirements";

/// A peer system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerKind {
    /// mem0 (`mem0ai`), open-source `Memory` with its default on-disk Qdrant store.
    Mem0,
    /// A-Mem (`a-mem`), `AgenticMemorySystem` with its default on-disk Chroma store.
    Amem,
}

impl PeerKind {
    pub const ALL: [PeerKind; 2] = [PeerKind::Mem0, PeerKind::Amem];

    pub fn from_name(name: &str) -> Option<PeerKind> {
        PeerKind::ALL.into_iter().find(|k| k.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Mem0 => "mem0",
            PeerKind::Amem => "amem",
        }
    }

    /// The pinned package line of [`REQUIREMENTS`] this peer runs.
    pub fn package(self) -> &'static str {
        let wanted = match self {
            PeerKind::Mem0 => "mem0ai==",
            PeerKind::Amem => "a-mem==",
        };
        REQUIREMENTS
            .lines()
            .chain(REQUIREMENTS_NO_DEPS.lines())
            .map(str::trim)
            .find(|l| l.starts_with(wanted))
            .unwrap_or(wanted)
    }
}

/// What `cargo xtask peer-venv` writes to [`VENV_STAMP`]: both requirement files, in order.
pub fn venv_stamp() -> String {
    format!("{REQUIREMENTS}{REQUIREMENTS_NO_DEPS}")
}

/// The peer venv's python: `~/.cache/lycheemem/peer-venv/bin/python`.
pub fn default_python() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    Some(PathBuf::from(home).join(".cache/lycheemem/peer-venv/bin/python"))
}

/// Checks that `python` is a venv made by `cargo xtask peer-venv` for these requirements
/// (a venv's `bin/python` sits two folders below the stamp).
pub fn check_python(python: &Path) -> Result<()> {
    if !python.exists() {
        bail!(
            "no peer venv at {} (create it with `cargo xtask peer-venv`)",
            python.display()
        );
    }
    let stamp = python
        .parent()
        .and_then(Path::parent)
        .map(|venv| venv.join(VENV_STAMP));
    if let Some(stamp) = stamp.filter(|s| s.exists()) {
        let installed = std::fs::read_to_string(&stamp).unwrap_or_default();
        if installed != venv_stamp() {
            bail!(
                "the peer venv of {} was made for other requirements than this harness pins \
                 (run `cargo xtask peer-venv` again)",
                python.display()
            );
        }
    }
    Ok(())
}

/// One memory a peer returned for a question, with the exchange it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerHit {
    pub id: String,
    pub memory: String,
    pub score: f32,
    #[serde(default)]
    pub session: Option<String>,
    #[serde(default)]
    pub session_date: Option<String>,
    #[serde(default)]
    pub turns: Vec<u32>,
}

impl PeerHit {
    /// The hit as an evidence item for the answer prompt and the recall metric.
    pub fn evidence_item(&self) -> EvidenceItem {
        EvidenceItem {
            evidence: Evidence {
                target: CandidateTarget::Record {
                    record_id: self.id.clone(),
                },
                text: self.memory.clone(),
                best_route_score: self.score,
                rrf: 0.0,
                final_score: self.score,
                mmr_score: self.score,
                provenance: Provenance::default(),
            },
            session: self.session.clone().unwrap_or_default(),
            session_date: self.session_date.clone(),
            memory_type: None,
            temporal: TemporalScope::default(),
            entities: Vec::new(),
            turns: self.turns.clone(),
            dialogue: Vec::new(),
            focus_turns: Vec::new(),
        }
    }
}

/// A question's hits as the driver writes them.
#[derive(Debug, Clone, Deserialize)]
struct HitsLine {
    question_id: String,
    hits: Vec<PeerHit>,
    #[serde(default)]
    ms: f64,
}

/// The driver's closing summary line.
#[derive(Debug, Clone, Deserialize)]
struct DriverSummary {
    /// Units whose LLM work the peer gave up on: A-Mem swallows a failed analysis or evolution
    /// call and keeps the note with defaults; mem0 stores nothing from an extraction reply it
    /// cannot parse (or a call that failed for good).
    #[serde(default)]
    failed_units: u64,
    /// Units fed: exchanges (mem0) or turns (A-Mem).
    #[serde(alias = "exchanges")]
    units: u64,
    memories: u64,
}

/// What a peer run gives the harness for one item.
#[derive(Debug, Clone)]
pub struct PeerRun {
    pub report: ConstructionReport,
    /// Question id → its hits and search milliseconds.
    pub hits: HashMap<String, (Vec<PeerHit>, f64)>,
    /// LLM use while searching, over all the questions searched.
    pub search_usage: PhaseUsage,
}

/// What to run.
pub struct PeerJob<'a> {
    pub kind: PeerKind,
    pub dataset_kind: DatasetKind,
    pub item: &'a Item,
    pub questions: Vec<&'a Question>,
    pub top_k: usize,
    /// The run's cache folder (peer state goes under `peers/`).
    pub cache: &'a Path,
    pub python: &'a Path,
    pub llm: Arc<dyn Llm>,
    pub embedder: Arc<dyn Embedder>,
    /// Raised when the run stops: the driver is ended (the build resumes from its checkpoint).
    pub stop: Option<&'a AtomicBool>,
}

/// Hash of what shapes a peer's build: the protocol, the pinned package, the models.
pub fn build_hash(kind: PeerKind, llm: &str, embedder: &str) -> String {
    let key = serde_json::json!({
        "protocol": PEER_PROTOCOL,
        "peer": kind.name(),
        "package": kind.package(),
        "llm": llm,
        "embedder": embedder,
    });
    hex::encode(Sha256::digest(key.to_string().as_bytes()))[..12].to_string()
}

fn job_json(job: &PeerJob, store: &Path, base_url: &str, hits_out: &Path) -> Result<String> {
    let (llm_model, embed_model) = (job.llm.model_id(), job.embedder.model_id());
    let sessions: Vec<serde_json::Value> = job
        .item
        .sessions
        .iter()
        .map(|s| {
            let turns: Vec<serde_json::Value> = s
                .turns
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    serde_json::json!({
                        "index": i,
                        "role": match t.role {
                            Role::User => "user",
                            Role::Assistant => "assistant",
                            Role::System => "system",
                        },
                        "speaker": t.speaker,
                        "text": t.text,
                    })
                })
                .collect();
            serde_json::json!({
                "id": s.id,
                "date": s.date.as_deref().map(|d| normalize_date(d).unwrap_or_else(|| d.to_string())),
                "turns": turns,
            })
        })
        .collect();
    let questions: Vec<serde_json::Value> = job
        .questions
        .iter()
        .map(|q| serde_json::json!({"id": q.id, "question": q.question}))
        .collect();
    let value = serde_json::json!({
        "peer": job.kind.name(),
        "store_dir": store,
        "base_url": base_url,
        "llm_model": llm_model,
        "embed_model": embed_model,
        "embedding_dims": job.embedder.dimension(),
        "user_id": job.item.id,
        "top_k": job.top_k,
        "sessions": sessions,
        "questions": questions,
        "hits_out": hits_out,
    });
    Ok(serde_json::to_string(&value)?)
}

/// Builds (or resumes, or reuses) the peer's memory of the item, then searches every question.
pub fn build_and_search(job: &PeerJob, progress: &mut dyn FnMut(String)) -> Result<PeerRun> {
    check_python(job.python)?;
    let hash = build_hash(job.kind, job.llm.model_id(), job.embedder.model_id());
    let peers = job.cache.join("peers");
    let ns = namespace(job.dataset_kind, &job.item.id)?;
    // `ns` already names the dataset (`locomo.conv-26`).
    let store = peers.join(format!("{}.{}-{hash}", job.kind.name(), ns.as_str()));
    std::fs::create_dir_all(&store).with_context(|| format!("creating {}", store.display()))?;
    let driver = peers.join(format!(
        "driver-{}.py",
        &hex::encode(Sha256::digest(DRIVER.as_bytes()))[..12]
    ));
    if !driver.exists() {
        // Builds run side by side: each writes its own copy and renames it into place, so no
        // driver is ever started from a half-written file.
        let tmp = peers.join(format!(
            "driver.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&tmp, DRIVER).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &driver)
            .with_context(|| format!("renaming {} to {}", tmp.display(), driver.display()))?;
    }
    // Every call the peer makes is kept beside its state, to audit what it asked and got.
    let endpoint = OpenAiEndpoint::start_for_build(
        job.llm.clone(),
        job.embedder.clone(),
        Some(store.join("llm-calls.jsonl")),
        &store.join("progress.json"),
    )?;
    let hits_out = store.join("hits.jsonl");
    let job_file = store.join("job.json");
    std::fs::write(
        &job_file,
        job_json(job, &store, &endpoint.base_url(), &hits_out)?,
    )?;
    let _ = std::fs::remove_file(&hits_out);
    progress(format!(
        "{} {}: building or resuming under {}",
        job.kind.name(),
        job.item.id,
        store.display()
    ));
    let mut child = Command::new(job.python)
        .arg(&driver)
        .arg(&job_file)
        .env("MEM0_TELEMETRY", "False")
        .env("ANONYMIZED_TELEMETRY", "False")
        .env("HF_HUB_OFFLINE", "1")
        // litellm (an A-Mem dependency) otherwise fetches a price list from the network
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        // The driver ends when the pipe below closes (driver.py, `exit_with_the_harness`).
        .env("LYCHEEMEM_DRIVER_WATCH", "1")
        // Held until the driver has ended: the driver stops when this pipe closes, so a killed
        // harness leaves no driver behind (driver.py, `exit_with_the_harness`).
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", job.python.display()))?;
    let harness_alive = child.stdin.take();
    // stdout carries one summary line; read it on a thread while stderr streams progress.
    let mut stdout = child.stdout.take().context("driver stdout")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    // The driver's stdin is held until it ends, or dropped when the run stops: the driver then
    // ends by itself (it watches that pipe), whatever it was doing.
    let ended = AtomicBool::new(false);
    let stopped = || job.stop.is_some_and(|s| s.load(Ordering::SeqCst));
    let (status, tail) = std::thread::scope(|scope| {
        let ended = &ended;
        scope.spawn(move || {
            let held = harness_alive;
            while !ended.load(Ordering::SeqCst) && !stopped() {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            drop(held);
        });
        let mut tail: Vec<String> = Vec::new();
        if let Some(stderr) = child.stderr.take() {
            // Read to the end whatever the bytes (a native library may write other than
            // UTF-8): a reader that stopped early would leave the driver blocked on a full pipe.
            let mut stderr = BufReader::new(stderr);
            let mut raw = Vec::new();
            loop {
                raw.clear();
                match stderr.read_until(b'\n', &mut raw) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let line = String::from_utf8_lossy(&raw).trim_end().to_string();
                if line.starts_with(job.kind.name()) {
                    progress(line.clone());
                }
                tail.push(line);
                if tail.len() > 40 {
                    tail.remove(0);
                }
            }
        }
        let status = child.wait();
        ended.store(true, Ordering::SeqCst);
        (status, tail)
    });
    let status = status?;
    let stdout = reader.join().unwrap_or_default();
    if stopped() {
        bail!(
            "the run stopped: the {} build of {} ends here (it resumes from its checkpoint)",
            job.kind.name(),
            job.item.id
        );
    }
    if !status.success() {
        bail!(
            "the {} driver failed ({status}) on {}; its last output:\n{}",
            job.kind.name(),
            job.item.id,
            tail.join("\n")
        );
    }
    // The last line that is a summary (a peer may print after it).
    let summary: DriverSummary = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l.trim()).ok())
        .with_context(|| {
            format!(
                "the {} driver printed no summary: {stdout:?}",
                job.kind.name()
            )
        })?;
    let usage = endpoint.usage();
    let total = endpoint
        .build_cost()
        .context("the build's endpoint keeps no checkpoint")?;
    drop(endpoint);
    let mut hits = HashMap::new();
    for line in crate::jsonl::read_lines::<HitsLine>(&hits_out)? {
        hits.insert(line.question_id, (line.hits, line.ms));
    }
    for q in &job.questions {
        if !hits.contains_key(&q.id) {
            bail!(
                "the {} driver returned no hits line for {}",
                job.kind.name(),
                q.id
            );
        }
    }
    let report = ConstructionReport {
        item: job.item.id.clone(),
        hash,
        sessions: job.item.sessions.len(),
        turns: job.item.sessions.iter().map(|s| s.turns.len() as u64).sum(),
        exchanges: summary.units,
        segments: 0,
        failed_segments: summary.failed_units,
        records: summary.memories,
        encode_calls: total.usage.chat_calls,
        prompt_tokens: total.usage.prompt_tokens,
        completion_tokens: total.usage.completion_tokens,
        llm_seconds: total.usage.llm_seconds,
        seconds: total.seconds,
        encode_llm: job.llm.model_id().to_string(),
        embedder: job.embedder.model_id().to_string(),
        replayed_calls: None,
    };
    Ok(PeerRun {
        report,
        hits,
        search_usage: usage.get("search").cloned().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python that loads the driver given as the first argument as module `d`.
    const DRIVER_LOADER: &str = r#"import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("driver", sys.argv[1])
d = importlib.util.module_from_spec(spec)
spec.loader.exec_module(d)
"#;

    /// Runs `script` with the system python after loading the driver as module `d` (and `json`,
    /// `sys` imported), and parses the JSON it prints.
    fn run_with_driver(script: &str) -> serde_json::Value {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver.py");
        std::fs::write(&driver, DRIVER).unwrap();
        let out = Command::new("python3")
            .arg("-c")
            .arg(format!("{DRIVER_LOADER}{script}"))
            .arg(&driver)
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The driver's feeding units and A-Mem's timestamps, run by the system python (the
    /// driver imports only the standard library until a peer is opened).
    #[test]
    fn the_driver_feeds_mem0_exchanges_and_amem_turns_with_their_dates() {
        let script = r#"
sessions = [{"id": "session_1", "date": "2023-05-08", "turns": [{"index": i} for i in range(3)]}]
print(json.dumps({
    "exchanges": [k for k, _, _ in d.exchanges(sessions)],
    "turns": [k for k, _, _ in d.single_turns(sessions)],
    "times": [d.amem_time(x) for x in ["2023-05-08", "2023-05-08T13:56:00", "8 May 2023", None]],
    "peers": sorted(d.PEERS),
}))
"#;
        let v = run_with_driver(script);
        assert_eq!(
            v["exchanges"],
            serde_json::json!(["session_1#0-1", "session_1#2-2"])
        );
        assert_eq!(
            v["turns"],
            serde_json::json!(["session_1#0", "session_1#1", "session_1#2"])
        );
        assert_eq!(
            v["times"],
            serde_json::json!(["202305080000", "202305081356", null, null])
        );
        // Every peer the harness names is one the driver can run.
        for kind in PeerKind::ALL {
            assert!(
                v["peers"].as_array().unwrap().contains(&kind.name().into()),
                "{}",
                kind.name()
            );
            assert_eq!(PeerKind::from_name(kind.name()), Some(kind));
            assert!(kind.package().contains("=="), "{}", kind.package());
        }
    }

    /// A mem0 unit whose add raised (its call failed for good) or logged an error on mem0's
    /// logger (an extraction reply it could not parse: nothing stored) is failed; the build
    /// goes on.
    #[test]
    fn the_driver_counts_mem0_units_that_failed() {
        let script = r#"
import logging
class ModelFailed(Exception):
    pass
d.MEM0_UNIT_FAILURES = (ModelFailed,)
class Memory:
    def __init__(self, what):
        self.what = what
    def add(self, messages, user_id, metadata):
        if self.what == "raise":
            raise ModelFailed("the model failed")
        if self.what == "bug":
            raise TypeError("add() got an unexpected keyword argument")
        if self.what == "log":
            logging.getLogger("mem0.memory.main").error("Error parsing extraction response: x")
job = {"user_id": "u"}
session = {"id": "session_1", "date": "2023-05-08"}
group = [{"index": 0, "role": "user", "text": "hi"}]
out = [d.mem0_add(Memory(w), job, "k", session, group, None) for w in ["ok", "raise", "log", "ok"]]
try:
    d.mem0_add(Memory("bug"), job, "k", session, group, None)
    out.append("went on")
except TypeError:
    out.append("ended")
print(json.dumps(out))
"#;
        let v = run_with_driver(script);
        // A programming error (any other exception) ends the build instead of failing units.
        assert_eq!(v, serde_json::json!([false, true, true, false, "ended"]));
    }

    /// The driver ends when the pipe on its stdin closes (the harness that holds it is gone),
    /// and does not watch a stdin that is no pipe.
    #[test]
    fn the_driver_stops_when_the_harness_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver.py");
        std::fs::write(&driver, DRIVER).unwrap();
        let script = |seconds: u32| {
            format!(
                "{DRIVER_LOADER}import time\nd.exit_with_the_harness()\nprint('watching', flush=True)\ntime.sleep({seconds})\n"
            )
        };
        let spawn = |stdin: Stdio, seconds: u32, watch: bool| {
            let mut command = Command::new("python3");
            command.arg("-c").arg(script(seconds)).arg(&driver);
            if watch {
                command.env("LYCHEEMEM_DRIVER_WATCH", "1");
            } else {
                command.env_remove("LYCHEEMEM_DRIVER_WATCH");
            }
            command
                .stdin(stdin)
                .stdout(Stdio::piped())
                .spawn()
                .expect("python3 runs")
        };
        // The script's first line, once its watch is set up.
        let watching = |child: &mut std::process::Child| {
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert_eq!(line.trim(), "watching");
        };
        // A driver that ends while watching ends normally (the watching thread, blocked in its
        // read, does not stop the interpreter's shutdown).
        let mut child = spawn(Stdio::piped(), 0, true);
        // Held open (`wait` would close it first, as the harness's does not).
        let stdin = child.stdin.take();
        let status = child.wait().unwrap();
        drop(stdin);
        assert!(status.success(), "{status}");
        let mut child = spawn(Stdio::piped(), 60, true);
        watching(&mut child);
        drop(child.stdin.take());
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > std::time::Duration::from_secs(30) {
                let _ = child.kill();
                panic!("the driver went on after its stdin closed");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert_eq!(status.code(), Some(3));
        // Not a pipe, or not asked to watch (a driver run by hand): nothing is watched, the
        // script runs on (killed here).
        for mut child in [
            spawn(Stdio::null(), 60, true),
            spawn(Stdio::piped(), 60, false),
        ] {
            watching(&mut child);
            drop(child.stdin.take());
            std::thread::sleep(std::time::Duration::from_millis(500));
            assert!(
                child.try_wait().unwrap().is_none(),
                "an unwatched driver ended"
            );
            child.kill().unwrap();
            let _ = child.wait();
        }
    }

    /// The peers' OpenAI clients wait for the endpoint without a read timeout (a timed-out
    /// request is computed anyway and then asked for again), unless a caller names one.
    #[test]
    fn the_driver_lifts_the_openai_clients_timeout() {
        let script = r#"
import types
openai = types.ModuleType("openai")
class OpenAI:
    def __init__(self, api_key=None, base_url=None, timeout="default"):
        self.timeout = timeout
openai.OpenAI = OpenAI
sys.modules["openai"] = openai
d.wait_for_the_endpoint()
from openai import OpenAI as Client
print(json.dumps([Client(api_key="k").timeout, Client(timeout=5).timeout]))
"#;
        let v = run_with_driver(script);
        assert_eq!(v, serde_json::json!([null, 5]));
    }
}
