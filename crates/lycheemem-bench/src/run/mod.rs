//! One benchmark run: select questions, build or reuse each item's memories, evaluate every
//! variant on every selected question, and checkpoint each prediction as one JSON line, so a
//! rerun (or a killed run) skips what is finished. `steps` holds the steps of [`run`], `plans`
//! the plan cache and planning, `parallel` the worker pool.

use crate::baseline::{self, ChunkIndex};
use crate::construct::{self, ConstructionReport};
use crate::dataset::{Dataset, DatasetKind, Item, Question, TurnAt};
use crate::jsonl::{append_line, read_lines};
use crate::metrics;
use crate::variant::{Variant, VariantKind};
use anyhow::{Context, Result};
use lycheemem::{Components, EvidenceItem, Memory};
use lycheemem_core::{
    CandidateTarget, Config, Namespace, Plan, Purpose, TokenUsage, estimate_tokens,
};
use lycheemem_llm::Llm;
use lycheemem_retrieve::{Retriever, SearchRequest, SearchResult};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

mod parallel;
mod plans;
mod steps;

use parallel::*;
use plans::*;
use steps::*;

/// What to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    pub dataset: PathBuf,
    pub variants: Vec<String>,
    /// Results folder (checkpoints and reports).
    pub out: PathBuf,
    /// Built memories and cached plans, shared between runs.
    pub cache: PathBuf,
    /// Memories live in this PostgreSQL database (one schema each) instead of directories under
    /// `cache` (which keeps their build markers, under `postgres/`).
    #[serde(default)]
    pub postgres: Option<String>,
    /// Item ids to run (empty = all).
    pub items: Vec<String>,
    /// Category names or LoCoMo numbers (empty = LoCoMo 1–4, every LongMemEval type).
    pub categories: Vec<String>,
    /// At most this many questions, stratified by category with `seed`.
    pub limit: Option<usize>,
    pub seed: u64,
    /// Retrieval and evidence recall only: no answer or judge calls.
    pub retrieval_only: bool,
    /// Evidence items per question (the same k for every variant).
    pub top_k: usize,
    /// Turns per `naive_rag` chunk.
    pub naive_chunk_turns: usize,
    /// Tokens reserved for instructions, question and answer in `full_context`.
    pub full_context_reserve: usize,
    /// Only each item's first N sessions, and only questions whose evidence lies in them (a
    /// cheap slice; the memory built is a prefix of the full one, so the cache is shared).
    #[serde(default)]
    pub max_sessions: Option<usize>,
    /// Questions (and item constructions) worked on at the same time; a local LLM decodes their
    /// calls together (continuous batching). 0 or 1 = one at a time. Results do not depend on
    /// it, except that LLM outputs can differ in float rounding (cache reuse and batched
    /// kernels), which greedy decoding occasionally turns into a different token; wall times do.
    #[serde(default)]
    pub jobs: usize,
    /// Sessions of an item encoded ahead of its build at the same time
    /// ([`crate::construct::BuildOptions::session_lookahead`]); the memory built does not depend
    /// on it.
    #[serde(default)]
    pub session_lookahead: usize,
    /// Variants restricted to some items (e.g. `eager` → `["conv-26"]`: eager costs one encoder
    /// call per turn); variants not listed run on every selected item.
    #[serde(default)]
    pub variant_items: BTreeMap<String, Vec<String>>,
    /// Only make (and log) the plans the selected questions lack: no memory is built and no
    /// question is evaluated. Plans need no memory, so a machine can spend its LLM time on
    /// them alone while the memories are built elsewhere or later.
    #[serde(default)]
    pub plans_only: bool,
    /// The python of the peer venv (`mem0`); `None` = `~/.cache/lycheemem/peer-venv/bin/python`.
    #[serde(default)]
    pub peer_python: Option<PathBuf>,
}

impl RunSpec {
    /// Where the run's memories live.
    pub fn memories(&self) -> crate::construct::MemoryHome {
        crate::construct::MemoryHome {
            cache: self.cache.clone(),
            postgres: self.postgres.clone(),
        }
    }
}

/// The dataset cut to each item's first `n` sessions, keeping the questions whose gold
/// evidence is non-empty and entirely inside them.
pub fn first_sessions(dataset: &Dataset, n: usize) -> Dataset {
    let mut out = dataset.clone();
    for item in &mut out.items {
        item.sessions.truncate(n);
        let kept: HashSet<String> = item.sessions.iter().map(|s| s.id.clone()).collect();
        item.questions.retain(|q| {
            !q.evidence.is_empty() && q.evidence.iter().all(|t| kept.contains(&t.session))
        });
    }
    out
}

/// The models a run uses (the judge is only needed when answers are judged).
#[derive(Clone)]
pub struct Backends {
    pub components: Components,
    pub judge: Option<Arc<dyn Llm>>,
}

/// A cited piece of evidence.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvidenceRef {
    /// `record:<id>` or `turns:<session>#<first>-<last>`.
    pub id: String,
    pub session: String,
    pub turns: Vec<u32>,
    pub score: f32,
}

/// One checkpointed prediction.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Prediction {
    pub variant: String,
    pub item: String,
    pub question_id: String,
    pub category: String,
    /// Questions and gold answers are not copied (benchmark data stays in its file).
    pub abstention: bool,
    pub prediction: Option<String>,
    pub evidence: Vec<EvidenceRef>,
    /// Share of the gold evidence turns among the retrieved items' turns.
    pub recall: Option<f64>,
    pub session_recall: Option<f64>,
    pub f1: Option<f64>,
    pub judge_correct: Option<bool>,
    pub judge_raw: Option<String>,
    pub plan_tokens: u64,
    pub answer_tokens: u64,
    pub judge_tokens: u64,
    /// Estimated tokens of the evidence text handed to the answerer.
    pub context_tokens: u64,
    pub llm_calls: u32,
    pub retrieval_ms: f64,
    pub answer_ms: f64,
    pub plan_fallback: Option<String>,
    /// The plan's question type (variants that plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question_type: Option<String>,
    /// e.g. full_context's truncation.
    pub note: Option<String>,
    /// Memory variants: gold-evidence recall and evidence tokens after each retrieval stage
    /// (the waterfall; see `lycheemem_retrieve::Stage`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageScore>,
}

/// Recall and tokens of the items alive after one retrieval stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageScore {
    pub stage: String,
    pub items: usize,
    /// Share of the gold evidence turns among the stage's items' turns (`None`: no gold turns).
    pub recall: Option<f64>,
    /// Estimated tokens of all the stage's items' texts.
    pub tokens: u64,
}

/// Scores each traced stage against a question's gold evidence.
pub fn stage_scores(q: &Question, stages: &[lycheemem_retrieve::Stage]) -> Vec<StageScore> {
    stages
        .iter()
        .map(|st| {
            let turns: BTreeSet<TurnAt> = st
                .items
                .iter()
                .flat_map(|i| {
                    i.turns.iter().map(|&index| TurnAt {
                        session: i.session.clone(),
                        index,
                    })
                })
                .collect();
            StageScore {
                stage: st.name.clone(),
                items: st.items.len(),
                recall: metrics::turn_recall(&q.evidence, &turns),
                tokens: st.items.iter().map(|i| u64::from(i.tokens)).sum(),
            }
        })
        .collect()
}

impl Prediction {
    /// Tokens the system spent on this question (planner + answer; the judge excluded).
    pub fn query_tokens(&self) -> u64 {
        self.plan_tokens + self.answer_tokens
    }
}

/// A variant's construction of one item as checkpointed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConstructionLine {
    pub variant: String,
    pub report: ConstructionReport,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The selected questions as `(item index, question index)`, in dataset order.
pub fn select(dataset: &Dataset, spec: &RunSpec) -> Vec<(usize, usize)> {
    let wanted = |q: &Question| -> bool {
        if spec.categories.is_empty() {
            return dataset.kind != DatasetKind::Locomo || (1..=4).contains(&q.category_number);
        }
        spec.categories
            .iter()
            .any(|c| *c == q.category || *c == q.category_number.to_string())
    };
    let mut by_category: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
    for (i, item) in dataset.items.iter().enumerate() {
        if !spec.items.is_empty() && !spec.items.contains(&item.id) {
            continue;
        }
        for (j, q) in item.questions.iter().enumerate() {
            if wanted(q) {
                by_category
                    .entry(q.category.clone())
                    .or_default()
                    .push((i, j));
            }
        }
    }
    let total: usize = by_category.values().map(Vec::len).sum();
    let mut chosen: Vec<(usize, usize)> = Vec::new();
    match spec.limit {
        Some(limit) if limit < total => {
            // Largest-remainder allocation of `limit` over categories, then a seeded shuffle
            // inside each category.
            let mut shares: Vec<(String, usize, f64)> = by_category
                .iter()
                .map(|(c, v)| {
                    let exact = limit as f64 * v.len() as f64 / total as f64;
                    (c.clone(), exact.floor() as usize, exact - exact.floor())
                })
                .collect();
            let mut left = limit - shares.iter().map(|s| s.1).sum::<usize>();
            let mut order: Vec<usize> = (0..shares.len()).collect();
            order.sort_by(|&a, &b| shares[b].2.total_cmp(&shares[a].2).then(a.cmp(&b)));
            for i in order {
                if left == 0 {
                    break;
                }
                shares[i].1 += 1;
                left -= 1;
            }
            let mut state = spec.seed;
            for (c, n, _) in shares {
                let mut v = by_category[&c].clone();
                for i in (1..v.len()).rev() {
                    let j = (splitmix(&mut state) % (i as u64 + 1)) as usize;
                    v.swap(i, j);
                }
                chosen.extend(v.into_iter().take(n));
            }
        }
        _ => chosen = by_category.into_values().flatten().collect(),
    }
    chosen.sort_unstable();
    chosen
}

/// Checkpointed predictions of a results folder.
pub fn predictions(out: &Path) -> Result<Vec<Prediction>> {
    let mut all = Vec::new();
    let dir = out.join("predictions");
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(all),
        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", dir.display())),
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    for f in files {
        if f.extension().is_some_and(|e| e == "jsonl") {
            all.extend(read_lines::<Prediction>(&f)?);
        }
    }
    Ok(all)
}

/// Checkpointed construction reports of a results folder.
pub fn constructions(out: &Path) -> Result<Vec<ConstructionLine>> {
    read_lines(&out.join("construction.jsonl"))
}

fn retrieved_turns(evidence: &[EvidenceItem]) -> BTreeSet<TurnAt> {
    evidence
        .iter()
        .flat_map(|e| {
            e.turns.iter().map(|&index| TurnAt {
                session: e.session.clone(),
                index,
            })
        })
        .collect()
}

fn evidence_refs(evidence: &[EvidenceItem]) -> Vec<EvidenceRef> {
    evidence
        .iter()
        .map(|e| EvidenceRef {
            id: match &e.evidence.target {
                CandidateTarget::Record { record_id } => format!("record:{record_id}"),
                CandidateTarget::Turns { first, last_index } => {
                    format!("turns:{}#{}-{last_index}", first.session, first.index)
                }
            },
            session: e.session.clone(),
            turns: e.turns.clone(),
            score: e.evidence.final_score,
        })
        .collect()
}

fn tokens(u: &TokenUsage) -> u64 {
    u.prompt_tokens + u.completion_tokens
}

/// Progress of the whole run, for the ETA.
struct Clock {
    started: Instant,
    last_report: Option<Instant>,
    done: usize,
    total: usize,
}

impl Clock {
    /// Counts one prediction; returns a progress line at most every 10 seconds (and at the end).
    fn tick(&mut self) -> Option<String> {
        self.done += 1;
        if self.done < self.total
            && self
                .last_report
                .is_some_and(|t| t.elapsed().as_secs_f64() < 10.0)
        {
            return None;
        }
        self.last_report = Some(Instant::now());
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = elapsed / self.done as f64 * (self.total - self.done) as f64;
        Some(format!(
            "{}/{} predictions, {:.0}s elapsed, eta {:.0}s",
            self.done, self.total, elapsed, eta
        ))
    }
}

/// Checks the spec, creates the folders, and wraps the encoder so its calls are logged (in the
/// results folder and the cache) and replayed when a memory is rebuilt.
fn prepare<'a>(
    dataset: &'a Dataset,
    spec: &'a RunSpec,
    base: &'a Config,
    backends: &'a Backends,
    progress: &mut dyn FnMut(String),
) -> Result<(RunContext<'a>, Arc<crate::replay::ReplayLlm>)> {
    let calibration = backends.components.embedder.segment_calibration();
    let variants: Vec<Variant> = spec
        .variants
        .iter()
        .map(|v| {
            // Segmentation constants as the memory will use them, so the construction hash
            // follows the embedder's calibration.
            Variant::new(v, base).map(|v| v.resolved(calibration.as_ref()))
        })
        .collect::<Result<_>>()?;
    check_variant_items(dataset, spec)?;
    std::fs::create_dir_all(spec.out.join("predictions"))
        .with_context(|| format!("creating {}", spec.out.display()))?;
    std::fs::create_dir_all(&spec.cache)
        .with_context(|| format!("creating {}", spec.cache.display()))?;
    for v in variants.iter().filter(|v| v.kind == VariantKind::Memory) {
        progress(format!(
            "{}: memories under {}/{}.<item>-{}",
            v.name,
            spec.cache.display(),
            dataset.kind.as_str(),
            v.construction_hash()
        ));
    }
    // The encoder's calls are logged (in the results folder and the cache) and replayed when a
    // memory is rebuilt.
    let replay = Arc::new(crate::replay::ReplayLlm::with_shared_log(
        backends.components.encode_llm.clone(),
        &spec.out.join(ENCODER_CALLS),
        &spec.cache.join("encode-calls.jsonl"),
    )?);
    let mut comps = backends.components.clone();
    comps.encode_llm = replay.clone();
    let construction_hashes = variants.iter().map(Variant::construction_hash).collect();
    let ctx = RunContext {
        dataset,
        spec,
        base,
        backends,
        variants,
        comps,
        construction_hashes,
    };
    Ok((ctx, replay))
}

/// The waves in order, with a background builder making the memories later waves need when the
/// run has several jobs (see [`run`]).
fn run_waves(
    ctx: &RunContext,
    waves: &[&Wave],
    ck: &mut Checkpoints,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    let spec = ctx.spec;
    let (build_tasks, mut unbuilt) = if spec.jobs > 1 {
        ctx.build_tasks(waves, ck)
    } else {
        (Vec::new(), vec![0; waves.len()])
    };
    let stop_building = AtomicBool::new(false);
    let builder_finished = AtomicBool::new(false);
    let (lines_tx, lines_rx) = mpsc::channel::<String>();
    let (built_tx, built_rx) = mpsc::channel::<Result<Built>>();
    std::thread::scope(|scope| -> Result<()> {
        // However the calling thread leaves (an error, a panic), the builder starts no new
        // memory and stops the ones in progress at their next session.
        let _stop = SetOnDrop(&stop_building);
        if build_tasks.is_empty() {
            drop((lines_tx, built_tx));
        } else {
            progress(format!(
                "building {} memories, {} at a time, ahead of their questions",
                build_tasks.len(),
                spec.jobs.min(build_tasks.len())
            ));
            let builder = Builder {
                tasks: &build_tasks,
                stop: &stop_building,
                finished: &builder_finished,
                lines: lines_tx,
                built: built_tx,
            };
            spawn_builder(scope, ctx, builder);
        }
        // The builder's progress lines are passed on with the run's own.
        let mut say = |line: String| {
            for earlier in lines_rx.try_iter() {
                progress(earlier);
            }
            progress(line);
        };
        let progress: &mut dyn FnMut(String) = &mut say;
        // What the builder made in this run: memories (the calling thread then opens them
        // cached) and peer runs (taken by their wave).
        let mut made = Made::default();
        let mut run_waves = || -> Result<()> {
            for (w, &wave) in waves.iter().enumerate() {
                plan_wave(ctx, wave, ck, progress)?;
                wait_for_wave(w, &mut unbuilt, &built_rx, &lines_rx, &mut made, progress)?;
                let opened = open_wave(ctx, wave, ck, &mut made, progress)?;
                evaluate_wave(ctx, wave, &opened, ck, progress)?;
            }
            Ok(())
        };
        let result = run_waves();
        stop_building.store(true, Ordering::SeqCst);
        if result.is_err() && !build_tasks.is_empty() && !builder_finished.load(Ordering::SeqCst) {
            progress(
                "stopping: memory builds in progress stop at their next session (what they built stays cached)"
                    .into(),
            );
        }
        // Every line the builder reports until it ends (it holds the only sender).
        for line in lines_rx.iter() {
            progress(line);
        }
        if result.is_err() {
            // The failure is the run's error; a report that cannot be written is only shown.
            if let Err(e) = report_untaken_peers(ctx, ck, &mut made, &built_rx) {
                progress(format!("could not report the finished peer runs: {e:#}"));
            }
        }
        result
    })
}

/// Runs `spec` against `dataset`, appending to the checkpoints in `spec.out`. The steps: select
/// the questions and read what the results folder already holds ([`Checkpoints::load`]); start
/// a builder for the memories later waves need ([`spawn_builder`]); then, wave by wave, plan its
/// questions ([`plan_wave`]), wait for its memories ([`wait_for_wave`]), open them
/// ([`open_wave`]) and evaluate and checkpoint its questions ([`evaluate_wave`]).
pub fn run(
    dataset: &Dataset,
    spec: &RunSpec,
    base: &Config,
    backends: &Backends,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    let sliced;
    let dataset = match spec.max_sessions {
        Some(n) => {
            sliced = first_sessions(dataset, n);
            &sliced
        }
        None => dataset,
    };
    let (ctx, replay) = prepare(dataset, spec, base, backends, progress)?;
    let selected = select(dataset, spec);
    let mut by_item: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, j) in &selected {
        by_item.entry(*i).or_default().push(*j);
    }
    let mut ck = Checkpoints::load(spec)?;
    let total = by_item
        .iter()
        .map(|(i, qs)| {
            ctx.variants
                .iter()
                .map(|v| ctx.pending(v, *i, qs, &ck.done).len())
                .sum::<usize>()
        })
        .sum();
    ck.clock.total = total;
    progress(format!(
        "{} questions selected in {} items; {} predictions to make ({} variants)",
        selected.len(),
        by_item.len(),
        total,
        ctx.variants.len()
    ));
    // Items are taken in waves of `WAVE_PER_JOB` × jobs. With several jobs, a builder thread builds
    // every missing memory in item order, `jobs` at a time (their encoder calls are decoded
    // together by a local LLM), without waiting for questions; a peer variant's build and search
    // of an item is one of its tasks like a memory, so a wave's slowest peer build never leaves
    // the other slots idle. A wave's questions are planned
    // while its memories are being built (plans need no memory), and evaluated (`jobs` at a time
    // across its items and variants) while the next waves' memories are being built, so the
    // LLM's batch stays full when a wave's last memories or questions are few. A run over many
    // small items (LongMemEval: one question each) so checkpoints predictions wave by wave
    // instead of after every memory is built. With one job, each memory is built when its wave
    // comes.
    let items: Vec<(usize, &Vec<usize>)> = by_item.iter().map(|(&i, qs)| (i, qs)).collect();
    let waves: Vec<&Wave> = items.chunks(spec.jobs.max(1) * WAVE_PER_JOB).collect();
    if spec.plans_only {
        for &wave in &waves {
            plan_wave(&ctx, wave, &mut ck, progress)?;
        }
        progress("plans only: every selected question of a planning variant has its plan".into());
        return Ok(());
    }
    run_waves(&ctx, &waves, &mut ck, progress)?;
    if replay.made() + replay.replayed() > 0 {
        progress(format!(
            "encoder calls: {} made, {} replayed ({} logged in {} and {})",
            replay.made(),
            replay.replayed(),
            replay.logged(),
            spec.out.join(ENCODER_CALLS).display(),
            spec.cache.join("encode-calls.jsonl").display(),
        ));
    }
    Ok(())
}

/// Items per wave of a run, per parallel job (see `run`).
const WAVE_PER_JOB: usize = 2;

/// The results folder's log of the encoder calls its memories were built with (committed with
/// the report; replayed when a memory is rebuilt, on any machine).
pub const ENCODER_CALLS: &str = "encoder-calls.jsonl";

/// The results folder's log of the calls peer systems made (keys and replies, like
/// [`ENCODER_CALLS`]; replayed when a peer's build is redone).
pub const PEER_CALLS: &str = "peer-calls.jsonl";
