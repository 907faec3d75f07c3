//! Building (or reusing) the memory of one benchmark item under one construction config.
//!
//! Memories are cached under `<cache>/<namespace>-<construction hash>/`, where the namespace is
//! `<dataset>.<item id>` (see [`namespace`] for ids that are not path-safe); a finished one has
//! a `<same name>.json` marker next to it holding its [`ConstructionReport`]. An unfinished one
//! (a killed run) is resumed: each session continues after the turns already stored, and the
//! memory's own persisted segmenter state carries on where it stopped.
//!
//! Sessions are built in order. With [`BuildOptions::session_lookahead`], later sessions are
//! encoded ahead at the same time into a scratch memory beside the real one, so a local LLM
//! decodes several sessions' encoder calls in one batch while the built memory stays exactly the
//! one a sequential build makes (see [`BuildOptions::session_lookahead`]).

use crate::dataset::{DatasetKind, Item};
use anyhow::{Context, Result};
use lycheemem::{Components, Memory};
use lycheemem_core::{Config, MemoryStrategy, Namespace, Purpose, SessionId};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

/// What building one memory cost (docs/algorithm.md, "Cost and token accounting").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConstructionReport {
    pub item: String,
    pub hash: String,
    /// Leading sessions of the item built (a `--sessions` slice builds a prefix).
    #[serde(default)]
    pub sessions: usize,
    pub turns: u64,
    pub exchanges: u64,
    pub segments: u64,
    pub failed_segments: u64,
    pub records: u64,
    pub encode_calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Sum of the encode calls' latencies.
    pub llm_seconds: f64,
    /// Wall time of construction (embedding, segmentation, encoding, storage), summed over the
    /// resumed runs on this machine (kept in the cache: a build continued elsewhere from a
    /// results folder's encoder log starts from 0 there). Time spent in a session a kill cut
    /// short is not counted.
    pub seconds: f64,
    pub encode_llm: String,
    pub embedder: String,
    /// LLM calls of this run's build answered from the call log instead of the model (then
    /// `seconds` is not the time the calls took; `llm_seconds` still is). Known for peer builds;
    /// `None` for lycheemem's, whose builds share one log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_calls: Option<u64>,
}

impl ConstructionReport {
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// The namespace an item's memory lives in (and its cache folder's name): the item id, with any
/// character other than ASCII letters, digits, `.`, `_` and `-` replaced by `_` and then a short
/// hash of the id added, so two ids never share a memory. An id too long for a namespace is cut
/// and gets the hash too.
pub fn namespace(kind: DatasetKind, item: &str) -> Result<Namespace> {
    use sha2::{Digest, Sha256};
    let safe: String = item
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    // Room for the id in a namespace of at most 128 characters after `<dataset>.`.
    let room = 128 - kind.as_str().len() - 1;
    let name = if safe == item && safe.len() <= room {
        safe
    } else {
        let digest = Sha256::digest(item.as_bytes());
        let short: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        // `safe` is ASCII, so cutting it at a byte count keeps whole characters.
        let keep = safe.len().min(room - short.len() - 1);
        format!("{}-{short}", &safe[..keep])
    };
    Ok(Namespace::new(format!("{}.{name}", kind.as_str()))?)
}

/// Where built memories live: store directories under `cache`, or schemas of a PostgreSQL
/// database (their build markers then under `cache/postgres`).
#[derive(Debug, Clone)]
pub struct MemoryHome {
    pub cache: PathBuf,
    pub postgres: Option<String>,
}

impl MemoryHome {
    /// The folder holding the build markers (and the store directories, without PostgreSQL).
    pub fn markers(&self) -> PathBuf {
        match self.postgres {
            None => self.cache.clone(),
            Some(_) => self.cache.join("postgres"),
        }
    }
}

/// Where an item's memory and its marker live (named after its [`namespace`]).
pub fn paths(
    cache: &Path,
    kind: DatasetKind,
    item: &str,
    hash: &str,
) -> Result<(PathBuf, PathBuf)> {
    let name = format!("{}-{hash}", namespace(kind, item)?);
    Ok((cache.join(&name), cache.join(format!("{name}.json"))))
}

/// Whether the item's memory under `hash` is finished for all of its sessions.
pub fn is_built(cache: &Path, kind: DatasetKind, item: &Item, hash: &str) -> bool {
    let Ok((_, marker)) = paths(cache, kind, &item.id, hash) else {
        return false;
    };
    std::fs::read(&marker)
        .ok()
        .and_then(|b| serde_json::from_slice::<ConstructionReport>(&b).ok())
        .is_some_and(|r| r.sessions >= item.sessions.len())
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Partial {
    seconds: f64,
}

/// How a build runs beside the rest of a benchmark run.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuildOptions<'a> {
    /// Raised to stop the build before its next session.
    pub stop: Option<&'a AtomicBool>,
    /// Sessions after the one being built that are encoded ahead at the same time (0 = none;
    /// the `lycheemem` strategy only). Each runs through the build's own components into a
    /// scratch memory beside the real one (`<memory>.lookahead`, removed when the build ends, or
    /// by the next build of the memory after a kill); a session that fails there is reported
    /// and left to the build.
    /// A session's encoder prompts depend on that session alone (its turns, date and reference
    /// context ρ, docs/algorithm.md), and the run's encode LLM replays logged calls and joins
    /// identical calls in flight ([`crate::replay::ReplayLlm`]); so when the build reaches a
    /// session encoded ahead, it replays that session's answers, and the memory is the one a
    /// sequential build makes, while a local LLM decodes up to `1 + session_lookahead` of the
    /// item's calls in one batch. Construction tokens are unchanged (a replayed call counts
    /// its tokens); the build's wall time is what shrinks.
    pub session_lookahead: usize,
}

/// Opens the item's memory, building what is missing first. `progress` receives one line per
/// session built. When `opts.stop` is raised, the build stops (with an error) before its next
/// session; what it built so far stays and a later call continues from there.
#[allow(clippy::too_many_arguments)]
pub fn build_or_open(
    cache: &MemoryHome,
    kind: DatasetKind,
    item: &Item,
    config: &Config,
    hash: &str,
    components: Components,
    opts: BuildOptions<'_>,
    progress: &mut dyn FnMut(String),
) -> Result<(Memory, ConstructionReport, bool)> {
    let stop = opts.stop;
    let markers = cache.markers();
    std::fs::create_dir_all(&markers).with_context(|| format!("creating {}", markers.display()))?;
    let (dir, marker) = paths(&markers, kind, &item.id, hash)?;
    let scratch_config = config.clone();
    let mut config = config.clone();
    let location = match &cache.postgres {
        None => dir.clone(),
        Some(url) => {
            // One schema per memory, named after its folder name.
            let name = dir.file_name().map(|n| n.to_string_lossy().to_lowercase());
            let schema: String = format!("bench_{}", name.unwrap_or_default())
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .take(63)
                .collect();
            config.store.postgres_schema = schema;
            PathBuf::from(url)
        }
    };
    let memory = Memory::with_components(&location, config.clone(), components.clone())
        .with_context(|| format!("opening {}", dir.display()))?;
    let partial_path = marker.with_extension("partial.json");
    let mut previous: Partial = std::fs::read(&partial_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if let Ok(bytes) = std::fs::read(&marker)
        && let Ok(report) = serde_json::from_slice::<ConstructionReport>(&bytes)
    {
        // A memory built for at least these sessions is reused as is (a slice of fewer
        // sessions then searches the larger memory; the report says how many were built).
        if report.sessions >= item.sessions.len() {
            return Ok((memory, report, true));
        }
        previous.seconds = report.seconds;
    }
    let ns = namespace(kind, &item.id)?;
    let stored: std::collections::HashMap<String, u32> = if memory.store().has_namespace(&ns)? {
        memory
            .store()
            .sessions(&ns)?
            .into_iter()
            .map(|s| (s.id.to_string(), s.turn_count))
            .collect()
    } else {
        Default::default()
    };
    let started = Instant::now();
    let unbuilt = item
        .sessions
        .iter()
        .filter(|s| !fully_stored(&stored, s))
        .count();
    let lookahead = if config.strategy == MemoryStrategy::Lycheemem && unbuilt > 1 {
        opts.session_lookahead.min(unbuilt - 1)
    } else {
        0
    };
    let ahead = Ahead {
        reached: AtomicUsize::new(0),
        next: AtomicUsize::new(1),
        over: AtomicBool::new(false),
        encoded: AtomicUsize::new(0),
    };
    let scratch_dir = scratch_dir(&dir);
    // One a killed build left behind goes first.
    remove_scratch(&scratch_dir)?;
    let scratch = if lookahead > 0 {
        Some(
            Memory::with_components(&scratch_dir, scratch_config, components)
                .with_context(|| format!("opening {}", scratch_dir.display()))?,
        )
    } else {
        None
    };
    let built = std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = scratch
            .iter()
            .flat_map(|scratch| std::iter::repeat_n(scratch, lookahead))
            .map(|scratch| {
                let (ahead, ns, stored) = (&ahead, &ns, &stored);
                scope.spawn(move || encode_ahead(scratch, ns, item, stored, ahead, stop))
            })
            .collect();
        let build = SessionsBuild {
            memory: &memory,
            ns: &ns,
            item,
            hash,
            stored: &stored,
            partial_path: &partial_path,
            previous_seconds: previous.seconds,
            started,
        };
        let result = build_sessions(&build, &ahead, stop, progress);
        ahead.over.store(true, Ordering::SeqCst);
        // Encoding ahead only saves the build time: a thread that failed (its scratch store,
        // say) is reported, and the build, which made any call it needed itself, stands.
        for w in workers {
            let outcome = w
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread panicked")));
            if let Err(e) = outcome {
                progress(format!(
                    "construct {} {hash}: encoding a session ahead failed (the build made its calls itself): {e:#}",
                    item.id
                ));
            }
        }
        result
    });
    drop(scratch);
    if lookahead > 0 {
        progress(format!(
            "construct {} {hash}: {} sessions encoded ahead ({lookahead} at a time)",
            item.id,
            ahead.encoded.load(Ordering::SeqCst)
        ));
        // Left behind, it is removed by the next build of this memory; the build stands.
        if let Err(e) = remove_scratch(&scratch_dir) {
            progress(format!("construct {} {hash}: {e:#}", item.id));
        }
    }
    built?;
    let mut report = summarize(
        &memory,
        &ns,
        item,
        hash,
        previous.seconds + started.elapsed().as_secs_f64(),
    )?;
    report.sessions = item.sessions.len();
    std::fs::write(&marker, serde_json::to_vec_pretty(&report)?)?;
    let _ = std::fs::remove_file(&partial_path);
    Ok((memory, report, false))
}

/// Where the build and the sessions encoded ahead of it stand.
struct Ahead {
    /// The session the build is on.
    reached: AtomicUsize,
    /// The next session to encode ahead.
    next: AtomicUsize,
    /// Raised when the build ends (finished, failed or stopped): no session is started ahead.
    over: AtomicBool,
    /// Sessions encoded ahead.
    encoded: AtomicUsize,
}

/// Whether every turn of `session` was stored before this run (`stored`: session id → turns).
fn fully_stored(
    stored: &std::collections::HashMap<String, u32>,
    session: &crate::dataset::Session,
) -> bool {
    stored.get(&session.id).copied().unwrap_or(0) as usize == session.turns.len()
}

/// The scratch memory of a build encoding sessions ahead: `<memory folder>.lookahead`, one per
/// memory (the folder's name holds dots, so not `with_extension`).
fn scratch_dir(memory_dir: &Path) -> PathBuf {
    let mut name = memory_dir.file_name().unwrap_or_default().to_os_string();
    name.push(".lookahead");
    memory_dir.with_file_name(name)
}

fn remove_scratch(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}

/// One thread encoding sessions ahead of the build (see [`BuildOptions::session_lookahead`]):
/// takes the next session the build has not reached, until none is left or the build is over.
fn encode_ahead(
    scratch: &Memory,
    ns: &Namespace,
    item: &Item,
    stored: &std::collections::HashMap<String, u32>,
    ahead: &Ahead,
    stop: Option<&AtomicBool>,
) -> Result<()> {
    loop {
        if ahead.over.load(Ordering::SeqCst) || stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Ok(());
        }
        let n = ahead.next.fetch_add(1, Ordering::SeqCst);
        let Some(s) = item.sessions.get(n) else {
            return Ok(());
        };
        if s.turns.is_empty()
            || fully_stored(stored, s)
            || n <= ahead.reached.load(Ordering::SeqCst)
        {
            continue;
        }
        let sid = SessionId::new(s.id.clone())?;
        scratch
            .add_turns(ns, &sid, s.date.as_deref(), s.turns.clone())
            .with_context(|| format!("{} {}", item.id, s.id))?;
        scratch.flush(ns, &sid)?;
        ahead.encoded.fetch_add(1, Ordering::SeqCst);
    }
}

/// A build in progress: the memory, the item, what was stored before, and where its wall time
/// is kept.
struct SessionsBuild<'a> {
    memory: &'a Memory,
    ns: &'a Namespace,
    item: &'a Item,
    hash: &'a str,
    /// Session id → turns stored before this run.
    stored: &'a std::collections::HashMap<String, u32>,
    partial_path: &'a Path,
    previous_seconds: f64,
    started: Instant,
}

/// Builds the item's sessions in order, resuming each after the turns already stored.
fn build_sessions(
    build: &SessionsBuild<'_>,
    ahead: &Ahead,
    stop: Option<&AtomicBool>,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    let SessionsBuild {
        memory,
        ns,
        item,
        hash,
        stored,
        partial_path,
        previous_seconds,
        started,
    } = *build;
    let total = item.sessions.len();
    for (n, s) in item.sessions.iter().enumerate() {
        ahead.reached.store(n, Ordering::SeqCst);
        if s.turns.is_empty() {
            continue;
        }
        if stop.is_some_and(|stop| stop.load(Ordering::SeqCst)) {
            anyhow::bail!(
                "building {}'s memory stopped before session {} of {total}",
                item.id,
                n + 1
            );
        }
        let sid = SessionId::new(s.id.clone())?;
        let done = stored.get(&s.id).copied().unwrap_or(0) as usize;
        let session_clock = Instant::now();
        let mut receipt = lycheemem::IngestReceipt::default();
        if done < s.turns.len() {
            receipt.merge(
                memory
                    .add_turns(ns, &sid, s.date.as_deref(), s.turns[done..].to_vec())
                    .with_context(|| format!("{} {}", item.id, s.id))?,
            );
        }
        receipt.merge(memory.flush(ns, &sid)?);
        let seconds = previous_seconds + started.elapsed().as_secs_f64();
        std::fs::write(partial_path, serde_json::to_vec(&Partial { seconds })?)?;
        let eta = started.elapsed().as_secs_f64() / (n + 1) as f64 * (total - n - 1) as f64;
        progress(format!(
            "construct {} {}: session {}/{total} ({} turns new) → {} segments, {} records, {} tokens in {:.0}s; eta {:.0}s",
            item.id,
            hash,
            n + 1,
            s.turns.len() - done.min(s.turns.len()),
            receipt.segments.len(),
            receipt.records,
            receipt.encode_tokens,
            session_clock.elapsed().as_secs_f64(),
            eta
        ));
    }
    Ok(())
}

fn summarize(
    memory: &Memory,
    ns: &Namespace,
    item: &Item,
    hash: &str,
    seconds: f64,
) -> Result<ConstructionReport> {
    let stats = memory.stats(ns)?;
    let construction = memory.construction(ns)?;
    let mut report = ConstructionReport {
        item: item.id.clone(),
        hash: hash.to_string(),
        turns: stats.turns,
        exchanges: construction.exchanges,
        segments: stats.segments,
        failed_segments: stats.failed_segments,
        records: stats.records,
        seconds,
        encode_llm: memory.config().models.encode_llm.clone(),
        embedder: memory.config().models.embedder.clone(),
        ..Default::default()
    };
    for u in memory.store().usage_log(ns)? {
        if u.purpose == Purpose::Encode {
            report.encode_calls += 1;
            report.prompt_tokens += u.prompt_tokens;
            report.completion_tokens += u.completion_tokens;
            report.llm_seconds += u.latency_ms as f64 / 1e3;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_memory_has_its_own_scratch_folder() {
        let cache = Path::new("/cache");
        let a = scratch_dir(&cache.join("locomo.conv-26-25edc6160726"));
        let b = scratch_dir(&cache.join("locomo.conv-47-25edc6160726"));
        let c = scratch_dir(&cache.join("locomo.conv-26-aaaaaaaaaaaa"));
        assert_eq!(a, cache.join("locomo.conv-26-25edc6160726.lookahead"));
        assert!(a != b && a != c && b != c);
    }

    #[test]
    fn ids_that_differ_only_in_replaced_characters_get_their_own_namespaces() {
        let ns = |id: &str| namespace(DatasetKind::Locomo, id).unwrap().to_string();
        assert_eq!(
            ns("conv-26"),
            "locomo.conv-26",
            "plain ids are kept as they are"
        );
        assert_ne!(ns("a b"), ns("a_b"));
        assert_ne!(ns("a b"), ns("a/b"));
        assert!(ns("a b").starts_with("locomo.a_b-"));
    }

    #[test]
    fn ids_too_long_for_a_namespace_are_cut_and_kept_apart() {
        let long = "q".repeat(200);
        let other = format!("{}x", "q".repeat(199));
        for kind in [DatasetKind::Locomo, DatasetKind::LongMemEval] {
            let a = namespace(kind, &long).unwrap().to_string();
            let b = namespace(kind, &other).unwrap().to_string();
            assert!(a.len() <= 128 && b.len() <= 128, "{a} / {b}");
            assert_ne!(a, b);
            // The longest id that fits is kept as it is.
            let fits = "q".repeat(128 - kind.as_str().len() - 1);
            assert_eq!(
                namespace(kind, &fits).unwrap().to_string(),
                format!("{}.{fits}", kind.as_str())
            );
        }
        let (dir, marker) = paths(Path::new("cache"), DatasetKind::Locomo, &long, "h").unwrap();
        let name = dir.file_name().unwrap().to_str().unwrap();
        assert!(
            name.len() <= 128 + 2 && name.starts_with("locomo.q"),
            "{name}"
        );
        assert_eq!(marker, Path::new("cache").join(format!("{name}.json")));
    }
}
