//! One benchmark run: select questions, build or reuse each item's memories, evaluate every
//! variant on every selected question, and checkpoint each prediction as one JSON line, so a
//! rerun (or a killed run) skips what is finished.

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
use lycheemem_retrieve::{Retriever, SearchRequest};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    pub dataset: PathBuf,
    pub variants: Vec<String>,
    /// Results folder (checkpoints and reports).
    pub out: PathBuf,
    /// Built memories and cached plans, shared between runs.
    pub cache: PathBuf,
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
    /// Variants restricted to some items (e.g. `eager` → `["conv-26"]`: eager costs one encoder
    /// call per turn); variants not listed run on every selected item.
    #[serde(default)]
    pub variant_items: BTreeMap<String, Vec<String>>,
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

#[derive(Debug, Clone, Serialize, Deserialize)]
struct CachedPlan {
    key: String,
    plan: Plan,
    fallback: Option<String>,
    usage: Option<TokenUsage>,
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
    let variants: Vec<Variant> = spec
        .variants
        .iter()
        .map(|v| Variant::new(v, base))
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
    // together by a local LLM), without waiting for questions. A wave's questions are planned
    // while its memories are being built (plans need no memory), and evaluated (`jobs` at a time
    // across its items and variants) while the next waves' memories are being built, so the
    // LLM's batch stays full when a wave's last memories or questions are few. A run over many
    // small items (LongMemEval: one question each) so checkpoints predictions wave by wave
    // instead of after every memory is built. With one job, each memory is built when its wave
    // comes.
    let items: Vec<(usize, &Vec<usize>)> = by_item.iter().map(|(&i, qs)| (i, qs)).collect();
    let waves: Vec<&Wave> = items.chunks(spec.jobs.max(1) * WAVE_PER_JOB).collect();
    let (build_tasks, mut unbuilt) = if spec.jobs > 1 {
        ctx.build_tasks(&waves, &ck)
    } else {
        (Vec::new(), vec![0; waves.len()])
    };
    let stop_building = AtomicBool::new(false);
    let builder_finished = AtomicBool::new(false);
    let (lines_tx, lines_rx) = mpsc::channel::<String>();
    let (built_tx, built_rx) = mpsc::channel::<Result<BuiltMemory>>();
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
            spawn_builder(scope, &ctx, builder);
        }
        // The builder's progress lines are passed on with the run's own.
        let mut say = |line: String| {
            for earlier in lines_rx.try_iter() {
                progress(earlier);
            }
            progress(line);
        };
        let progress: &mut dyn FnMut(String) = &mut say;
        // Memories the builder made in this run (the calling thread then opens them cached).
        let mut fresh: HashSet<(usize, String)> = HashSet::new();
        let mut run_waves = || -> Result<()> {
            for (w, &wave) in waves.iter().enumerate() {
                plan_wave(&ctx, wave, &mut ck, progress)?;
                wait_for_wave(w, &mut unbuilt, &built_rx, &lines_rx, &mut fresh, progress)?;
                let opened = open_wave(&ctx, wave, &mut ck, &fresh, progress)?;
                evaluate_wave(&ctx, wave, &opened, &mut ck, progress)?;
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
        result
    })?;
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

/// Items of one wave: each item's index with the indexes of its selected questions.
type Wave<'a> = [(usize, &'a Vec<usize>)];

/// A memory the background builder made: (wave, item, construction hash).
type BuiltMemory = (usize, usize, String);

/// `spec.variant_items` may only name variants of the run and items of the dataset.
fn check_variant_items(dataset: &Dataset, spec: &RunSpec) -> Result<()> {
    for (variant, items) in &spec.variant_items {
        if !spec.variants.contains(variant) {
            anyhow::bail!("variant_items names {variant:?}, which is not among the run's variants");
        }
        for id in items {
            if !dataset.items.iter().any(|i| i.id == *id) {
                anyhow::bail!(
                    "variant_items: {variant} on {id:?}, which is not an item of the dataset"
                );
            }
        }
    }
    Ok(())
}

/// What a run does not change: its data, settings, variants and backends (the encoder
/// replaying logged calls).
struct RunContext<'a> {
    dataset: &'a Dataset,
    spec: &'a RunSpec,
    base: &'a Config,
    backends: &'a Backends,
    variants: Vec<Variant>,
    comps: Components,
    /// Parallel to `variants`.
    construction_hashes: Vec<String>,
}

/// What the results folder already holds, kept up to date as the run checkpoints.
struct Checkpoints {
    /// (variant, question id) of every prediction made.
    done: HashSet<(String, String)>,
    /// (variant, item id) of every construction report written.
    built: HashSet<(String, String)>,
    plans: HashMap<String, CachedPlan>,
    plan_logs: PlanLogs,
    clock: Clock,
}

impl Checkpoints {
    fn load(spec: &RunSpec) -> Result<Checkpoints> {
        let done = predictions(&spec.out)?
            .into_iter()
            .map(|p| (p.variant, p.question_id))
            .collect();
        let built = constructions(&spec.out)?
            .into_iter()
            .map(|c| (c.variant, c.report.item))
            .collect();
        // Plans are cached on the machine and kept in the results folder (see `PlanLogs`).
        let mut plan_logs = PlanLogs {
            shared: spec.cache.join("plans.jsonl"),
            kept: spec.out.join("plans.jsonl"),
            kept_keys: HashSet::new(),
        };
        let mut plans: HashMap<String, CachedPlan> = HashMap::new();
        for p in read_lines::<CachedPlan>(&plan_logs.shared)? {
            plans.insert(p.key.clone(), p);
        }
        for p in read_lines::<CachedPlan>(&plan_logs.kept)? {
            plan_logs.kept_keys.insert(p.key.clone());
            plans.insert(p.key.clone(), p);
        }
        Ok(Checkpoints {
            done,
            built,
            plans,
            plan_logs,
            clock: Clock {
                started: Instant::now(),
                last_report: None,
                done: 0,
                total: 0,
            },
        })
    }

    /// Writes a construction report line for (variant, item) unless the folder has one.
    fn report_construction(
        &mut self,
        spec: &RunSpec,
        variant: &str,
        report: &ConstructionReport,
    ) -> Result<()> {
        if self
            .built
            .insert((variant.to_string(), report.item.clone()))
        {
            append_line(
                &spec.out.join("construction.jsonl"),
                &ConstructionLine {
                    variant: variant.to_string(),
                    report: report.clone(),
                },
            )?;
        }
        Ok(())
    }
}

impl RunContext<'_> {
    /// Whether variant `v` runs on `item` (`spec.variant_items`).
    fn allowed(&self, v: &Variant, item: &Item) -> bool {
        self.spec
            .variant_items
            .get(&v.name)
            .is_none_or(|items| items.contains(&item.id))
    }

    /// The selected questions `qs` of item `i` that variant `v` has yet to answer.
    fn pending(
        &self,
        v: &Variant,
        i: usize,
        qs: &[usize],
        done: &HashSet<(String, String)>,
    ) -> Vec<usize> {
        let item = &self.dataset.items[i];
        if !self.allowed(v, item) {
            return Vec::new();
        }
        qs.iter()
            .filter(|&&j| !done.contains(&(v.name.clone(), item.questions[j].id.clone())))
            .copied()
            .collect()
    }

    /// Whether variant `v` still needs a construction report for item `i`.
    fn needs_report(&self, v: &Variant, i: usize, ck: &Checkpoints) -> bool {
        let item = &self.dataset.items[i];
        self.allowed(v, item) && !ck.built.contains(&(v.name.clone(), item.id.clone()))
    }

    /// The memories missing from the cache that the waves need, with how many each wave waits
    /// for.
    fn build_tasks(&self, waves: &[&Wave], ck: &Checkpoints) -> (Vec<BuildTask<'_>>, Vec<usize>) {
        let mut tasks = Vec::new();
        let mut unbuilt = vec![0usize; waves.len()];
        for (w, wave) in waves.iter().enumerate() {
            for &(i, qs) in *wave {
                let item = &self.dataset.items[i];
                for (hash, group) in construction_groups(&self.variants) {
                    let needed = group.iter().any(|v| {
                        !self.pending(v, i, qs, &ck.done).is_empty() || self.needs_report(v, i, ck)
                    });
                    if needed
                        && !construct::is_built(&self.spec.cache, self.dataset.kind, item, &hash)
                    {
                        tasks.push(BuildTask {
                            wave: w,
                            item: i,
                            hash,
                            config: &group[0].config,
                        });
                        unbuilt[w] += 1;
                    }
                }
            }
        }
        (tasks, unbuilt)
    }
}

/// One memory for the background builder to make.
struct BuildTask<'a> {
    wave: usize,
    item: usize,
    hash: String,
    config: &'a Config,
}

/// The background builder's inputs and its ways of reporting.
struct Builder<'a> {
    tasks: &'a [BuildTask<'a>],
    /// Raised by the calling thread when it leaves: no new memory is started and the ones in
    /// progress stop at their next session.
    stop: &'a AtomicBool,
    finished: &'a AtomicBool,
    lines: mpsc::Sender<String>,
    built: mpsc::Sender<Result<BuiltMemory>>,
}

/// Builds every task's memory, `jobs` at a time, on a thread of `scope`; sends each built memory
/// (or the error that stopped the builder) and its progress lines.
fn spawn_builder<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    ctx: &'env RunContext<'env>,
    builder: Builder<'env>,
) {
    scope.spawn(move || {
        let Builder {
            tasks,
            stop,
            finished,
            lines,
            built,
        } = builder;
        let mut say = |line: String| {
            let _ = lines.send(line);
        };
        let result = for_each_parallel(
            ctx.spec.jobs,
            tasks,
            |task, say| {
                if stop.load(Ordering::SeqCst) {
                    anyhow::bail!("the run stopped");
                }
                construct::build_or_open(
                    &ctx.spec.cache,
                    ctx.dataset.kind,
                    &ctx.dataset.items[task.item],
                    task.config,
                    &task.hash,
                    ctx.comps.clone(),
                    Some(stop),
                    say,
                )
                .map(|_| (task.wave, task.item, task.hash.clone()))
            },
            &mut say,
            |memory, _| {
                let _ = built.send(Ok(memory));
                Ok(())
            },
        );
        finished.store(true, Ordering::SeqCst);
        if let Err(e) = result {
            // Shown at once: the calling thread sees the error only when it next waits for a
            // memory (after the wave's plans).
            say(format!("the memory builder stopped: {e:#}"));
            let _ = built.send(Err(e));
        }
    });
}

/// Plans the wave's pending questions for every planning variant (plans need no memory, so
/// this runs while the wave's memories are still being built, and plan and encoder calls share
/// the LLM's batch).
fn plan_wave(
    ctx: &RunContext,
    wave: &Wave,
    ck: &mut Checkpoints,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    for v in ctx.variants.iter().filter(|v| v.plans()) {
        let questions: Vec<&Question> = wave
            .iter()
            .flat_map(|&(i, qs)| {
                let item = &ctx.dataset.items[i];
                ctx.pending(v, i, qs, &ck.done)
                    .into_iter()
                    .map(move |j| &item.questions[j])
            })
            .collect();
        prefetch_plans(
            &questions,
            v,
            &ctx.comps,
            &mut ck.plan_logs,
            &mut ck.plans,
            ctx.spec.jobs,
            progress,
        )?;
    }
    Ok(())
}

/// Waits until the builder has made every memory wave `w` needs, passing its progress lines on.
fn wait_for_wave(
    w: usize,
    unbuilt: &mut [usize],
    built: &mpsc::Receiver<Result<BuiltMemory>>,
    lines: &mpsc::Receiver<String>,
    fresh: &mut HashSet<(usize, String)>,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    while unbuilt[w] > 0 {
        match built.try_recv() {
            Ok(Ok((x, i, hash))) => {
                unbuilt[x] -= 1;
                fresh.insert((i, hash));
            }
            Ok(Err(e)) => return Err(e),
            Err(mpsc::TryRecvError::Disconnected) => {
                anyhow::bail!("the memory builder stopped before wave {w}'s memories")
            }
            Err(mpsc::TryRecvError::Empty) => {
                if let Ok(line) = lines.recv_timeout(Duration::from_millis(200)) {
                    progress(line);
                }
            }
        }
    }
    Ok(())
}

/// A wave's memories (by item and construction hash) and naive-RAG chunk indexes (by item).
struct OpenWave {
    memories: HashMap<(usize, String), (Memory, Namespace)>,
    indexes: HashMap<usize, ChunkIndex>,
}

/// Opens (building if needed) the memories the wave's questions need, writes the construction
/// reports the folder lacks, and builds the naive-RAG chunk indexes.
fn open_wave(
    ctx: &RunContext,
    wave: &Wave,
    ck: &mut Checkpoints,
    fresh: &HashSet<(usize, String)>,
    progress: &mut dyn FnMut(String),
) -> Result<OpenWave> {
    let mut opened = OpenWave {
        memories: HashMap::new(),
        indexes: HashMap::new(),
    };
    for &(i, qs) in wave {
        let item = &ctx.dataset.items[i];
        for (hash, group) in construction_groups(&ctx.variants) {
            let need_questions = group
                .iter()
                .any(|v| !ctx.pending(v, i, qs, &ck.done).is_empty());
            let need_report = group.iter().any(|v| ctx.needs_report(v, i, ck));
            if !need_questions && !need_report {
                continue;
            }
            let (memory, report, cached) = construct::build_or_open(
                &ctx.spec.cache,
                ctx.dataset.kind,
                item,
                &group[0].config,
                &hash,
                ctx.comps.clone(),
                None,
                progress,
            )?;
            let cached = cached && !fresh.contains(&(i, hash.clone()));
            progress(format!(
                "memory {} {hash} ({}): {} segments, {} records, {} encode tokens",
                item.id,
                if cached { "cached" } else { "built" },
                report.segments,
                report.records,
                report.tokens()
            ));
            for v in group.iter().filter(|v| ctx.allowed(v, item)) {
                ck.report_construction(ctx.spec, &v.name, &report)?;
            }
            // A memory opened only for its report line is closed again at once.
            if need_questions {
                let ns = construct::namespace(ctx.dataset.kind, &item.id)?;
                opened.memories.insert((i, hash), (memory, ns));
            }
        }
        let mut naive_pending = false;
        for v in ctx
            .variants
            .iter()
            .filter(|v| v.kind == VariantKind::NaiveRag)
        {
            naive_pending |= !ctx.pending(v, i, qs, &ck.done).is_empty();
            // Naive RAG builds nothing an LLM pays for; its report line records the item's
            // turns, written before its questions so a stopped run never lacks it.
            if ctx.allowed(v, item) {
                let report = ConstructionReport {
                    item: item.id.clone(),
                    hash: "none".into(),
                    turns: item.sessions.iter().map(|s| s.turns.len() as u64).sum(),
                    embedder: ctx.base.models.embedder.clone(),
                    ..Default::default()
                };
                ck.report_construction(ctx.spec, &v.name, &report)?;
            }
        }
        if naive_pending {
            let index = ChunkIndex::build(
                item,
                ctx.spec.naive_chunk_turns,
                ctx.comps.embedder.as_ref(),
            )?;
            opened.indexes.insert(i, index);
        }
    }
    Ok(opened)
}

/// One question to evaluate: (item, variant, question) indexes.
type Task = (usize, usize, usize);

/// Evaluates every pending question of the wave, `jobs` at a time, checkpointing each
/// prediction as it arrives; `full_context` apart, one at a time, so every call reuses the
/// cached history prefix and prefills only its question.
fn evaluate_wave(
    ctx: &RunContext,
    wave: &Wave,
    opened: &OpenWave,
    ck: &mut Checkpoints,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    let mut tasks: Vec<Task> = Vec::new();
    let mut full_context_tasks: Vec<Task> = Vec::new();
    for &(i, qs) in wave {
        for (vi, v) in ctx.variants.iter().enumerate() {
            for j in ctx.pending(v, i, qs, &ck.done) {
                if v.kind == VariantKind::FullContext {
                    full_context_tasks.push((i, vi, j));
                } else {
                    tasks.push((i, vi, j));
                }
            }
        }
    }
    let Checkpoints {
        done, plans, clock, ..
    } = ck;
    let plans = &*plans;
    let work = |&task: &Task, _: &mut dyn FnMut(String)| evaluate(ctx, task, opened, plans);
    let mut save = |p: Prediction, progress: &mut dyn FnMut(String)| {
        let file = ctx
            .spec
            .out
            .join("predictions")
            .join(format!("{}.jsonl", p.variant));
        checkpoint(&file, p, clock, done, progress)
    };
    for_each_parallel(ctx.spec.jobs, &tasks, work, progress, &mut save)?;
    for_each_parallel(1, &full_context_tasks, work, progress, &mut save)
}

/// One question under one variant: its evidence, then (unless retrieval-only) its answer and
/// judgement.
fn evaluate(
    ctx: &RunContext,
    (i, vi, j): Task,
    opened: &OpenWave,
    plans: &HashMap<String, CachedPlan>,
) -> Result<Prediction> {
    let (item, v) = (&ctx.dataset.items[i], &ctx.variants[vi]);
    let q = &item.questions[j];
    let started = Instant::now();
    let mut config = v.config.clone();
    let (evidence, mut p) = match v.kind {
        VariantKind::Memory => {
            let (memory, ns) = opened
                .memories
                .get(&(i, ctx.construction_hashes[vi].clone()))
                .ok_or_else(|| anyhow::anyhow!("no memory opened for {}", item.id))?;
            let cached_plan = if v.plans() {
                let key = plan_key(q, v, &ctx.comps);
                Some(
                    plans
                        .get(&key)
                        .cloned()
                        .ok_or_else(|| anyhow::anyhow!("no plan was made for question {}", q.id))?,
                )
            } else {
                None
            };
            search_memory(ctx, v, item, q, memory, ns, cached_plan.as_ref())?
        }
        VariantKind::NaiveRag => {
            let index = opened
                .indexes
                .get(&i)
                .ok_or_else(|| anyhow::anyhow!("no chunk index built for {}", item.id))?;
            let evidence = index.search(
                &q.question,
                ctx.spec.top_k.max(1),
                ctx.comps.embedder.as_ref(),
            )?;
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let p = base_prediction(v, item, q, &evidence, ms);
            (evidence, p)
        }
        VariantKind::FullContext => {
            let context = ctx.comps.answer_llm.context_length().unwrap_or(32_768);
            let budget = context.saturating_sub(ctx.spec.full_context_reserve);
            let (evidence, dropped) = baseline::full_context(item, budget)?;
            config.answer.evidence_item_chars = usize::MAX;
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let mut p = base_prediction(v, item, q, &evidence, ms);
            p.note = (dropped > 0).then(|| {
                format!(
                    "truncated to the newest {} sessions ({dropped} dropped) to fit {context} tokens",
                    evidence.len()
                )
            });
            (evidence, p)
        }
    };
    finish(
        &mut p,
        ctx.dataset.kind,
        q,
        &evidence,
        &config,
        ctx.spec,
        ctx.backends,
    )?;
    Ok(p)
}

/// A memory variant's retrieval for one question, with the logged plan (or none when the
/// variant does not plan), traced for the stage table.
fn search_memory(
    ctx: &RunContext,
    v: &Variant,
    item: &Item,
    q: &Question,
    memory: &Memory,
    ns: &Namespace,
    cached_plan: Option<&CachedPlan>,
) -> Result<(Vec<EvidenceItem>, Prediction)> {
    let retriever = Retriever {
        store: memory.store(),
        embedder: ctx.comps.embedder.as_ref(),
        reranker: ctx.comps.reranker.as_deref(),
        planner: None,
        cfg: &v.config.retrieval,
    };
    let result = retriever.search(
        ns,
        &SearchRequest {
            question: &q.question,
            context: "",
            reference_date: q.date.as_deref(),
            top_k: ctx.spec.top_k,
            plan: cached_plan.map(|p| &p.plan),
            trace: true,
            cancel: Default::default(),
        },
    )?;
    let retrieval_ms: f64 = result
        .timings
        .iter()
        .filter(|(k, _)| **k != "plan")
        .map(|(_, v)| v)
        .sum();
    let mut p = base_prediction(v, item, q, &result.evidence, retrieval_ms);
    p.stages = stage_scores(q, &result.stages);
    if let Some(c) = cached_plan {
        p.plan_tokens = c.usage.as_ref().map_or(0, tokens);
        p.llm_calls += u32::from(c.usage.is_some());
        p.plan_fallback.clone_from(&c.fallback);
    } else {
        p.plan_fallback = Some("planner disabled".into());
    }
    Ok((result.evidence, p))
}

/// Sets its flag when dropped (also while a panic unwinds).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Appends a prediction to its variant's checkpoint file, counts it, reports progress.
fn checkpoint(
    file: &Path,
    p: Prediction,
    clock: &mut Clock,
    done: &mut HashSet<(String, String)>,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    append_line(file, &p)?;
    if let Some(line) = clock.tick() {
        progress(format!("[{}] {} {line}", p.variant, p.question_id));
    }
    done.insert((p.variant, p.question_id));
    Ok(())
}

/// Memory variants grouped by construction hash (variants of one group share one memory).
fn construction_groups(variants: &[Variant]) -> BTreeMap<String, Vec<&Variant>> {
    let mut groups: BTreeMap<String, Vec<&Variant>> = BTreeMap::new();
    for v in variants {
        if v.kind == VariantKind::Memory {
            groups.entry(v.construction_hash()).or_default().push(v);
        }
    }
    groups
}

/// A message from a worker of [`for_each_parallel`].
enum Message<R> {
    Line(String),
    Done(Result<R>),
}

/// Runs the work on input `i` (0-based), a panic in it becoming that input's error: in
/// [`for_each_parallel`] the other workers then start no new input, as after any error,
/// instead of working through the rest while the caller waits for a result that never comes.
fn caught<R>(i: usize, work: impl FnOnce() -> Result<R>) -> Result<R> {
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
fn for_each_parallel<T: Sync, R: Send>(
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

fn base_prediction(
    v: &Variant,
    item: &Item,
    q: &Question,
    evidence: &[EvidenceItem],
    retrieval_ms: f64,
) -> Prediction {
    let turns = retrieved_turns(evidence);
    Prediction {
        variant: v.name.clone(),
        item: item.id.clone(),
        question_id: q.id.clone(),
        category: q.category.clone(),
        abstention: q.abstention,
        prediction: None,
        evidence: evidence_refs(evidence),
        recall: metrics::turn_recall(&q.evidence, &turns),
        session_recall: metrics::session_recall(&q.evidence_sessions, &turns),
        f1: None,
        judge_correct: None,
        judge_raw: None,
        plan_tokens: 0,
        answer_tokens: 0,
        judge_tokens: 0,
        context_tokens: evidence
            .iter()
            .map(|e| u64::from(estimate_tokens(&e.evidence.text)))
            .sum(),
        llm_calls: 0,
        retrieval_ms,
        answer_ms: 0.0,
        plan_fallback: None,
        note: None,
        stages: Vec::new(),
    }
}

/// Answers and judges (unless retrieval-only).
fn finish(
    p: &mut Prediction,
    kind: DatasetKind,
    q: &Question,
    evidence: &[EvidenceItem],
    config: &Config,
    spec: &RunSpec,
    backends: &Backends,
) -> Result<()> {
    if spec.retrieval_only {
        return Ok(());
    }
    let clock = Instant::now();
    let reply = lycheemem_retrieve::answer(
        backends.components.answer_llm.as_ref(),
        &q.question,
        q.date.as_deref(),
        evidence,
        &config.answer,
        &Default::default(),
    )?;
    p.answer_ms = clock.elapsed().as_secs_f64() * 1e3;
    p.answer_tokens = tokens(&reply.usage);
    p.llm_calls += 1;
    if kind == DatasetKind::Locomo {
        p.f1 = Some(metrics::locomo_f1(
            &reply.text,
            &q.answer,
            q.category_number,
        ));
    }
    if let Some(judge) = &backends.judge {
        let v = metrics::judge(judge.as_ref(), kind, q, &reply.text)?;
        p.judge_correct = Some(v.correct);
        p.judge_raw = Some(v.raw);
        p.judge_tokens = tokens(&v.usage);
    }
    p.prediction = Some(reply.text);
    Ok(())
}

/// The cache key of a question's plan: (planner model, planner limits, question, date).
fn plan_key(q: &Question, v: &Variant, comps: &Components) -> String {
    let r = &v.config.retrieval;
    let key_src = serde_json::json!({
        "llm": comps.plan_llm.model_id(),
        "question": q.question,
        "date": q.date,
        "limits": [r.planner_context_chars, r.max_queries, r.max_routes, r.max_queries_per_route, r.max_constraints],
    });
    hex::encode(Sha256::digest(key_src.to_string().as_bytes()))
}

/// Items per wave of a run, per parallel job (see `run`).
const WAVE_PER_JOB: usize = 2;

/// The results folder's log of the encoder calls its memories were built with (committed with
/// the report; replayed when a memory is rebuilt, on any machine).
pub const ENCODER_CALLS: &str = "encoder-calls.jsonl";

/// Where plans are logged: the cache's log, shared by every run on the machine, and the results
/// folder's own, which keeps the plan of every question the folder's predictions used (committed
/// with the report, so a fresh clone re-evaluates without the planner).
struct PlanLogs {
    shared: PathBuf,
    kept: PathBuf,
    kept_keys: HashSet<String>,
}

/// Makes the plans the questions lack, `jobs` at a time, and logs each (one plan per key, shared
/// by every variant and later run); copies into the results folder's log the plans it lacks.
fn prefetch_plans(
    questions: &[&Question],
    v: &Variant,
    comps: &Components,
    logs: &mut PlanLogs,
    plans: &mut HashMap<String, CachedPlan>,
    jobs: usize,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    let mut missing: Vec<(String, &Question)> = Vec::new();
    for q in questions {
        let key = plan_key(q, v, comps);
        match plans.get(&key) {
            Some(plan) if !logs.kept_keys.contains(&key) => {
                append_line(&logs.kept, plan)?;
                logs.kept_keys.insert(key);
            }
            Some(_) => {}
            None if !missing.iter().any(|(k, _)| *k == key) => missing.push((key, q)),
            None => {}
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let total = missing.len();
    progress(format!(
        "[{}] planning {total} questions, {} at a time",
        v.name,
        jobs.clamp(1, total)
    ));
    let r = &v.config.retrieval;
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut made = 0;
    for_each_parallel(
        jobs,
        &missing,
        |(key, q), _| {
            let outcome = lycheemem_retrieve::planner::plan(
                comps.plan_llm.as_ref(),
                &q.question,
                "",
                q.date.as_deref(),
                r,
                &Default::default(),
            );
            Ok(CachedPlan {
                key: key.clone(),
                plan: outcome.plan,
                fallback: outcome.fallback,
                usage: outcome.usage.map(|mut u| {
                    u.purpose = Purpose::Plan;
                    u
                }),
            })
        },
        progress,
        |cached, progress| {
            append_line(&logs.shared, &cached)?;
            append_line(&logs.kept, &cached)?;
            logs.kept_keys.insert(cached.key.clone());
            plans.insert(cached.key.clone(), cached);
            made += 1;
            if made == total || last_report.elapsed().as_secs_f64() >= 10.0 {
                last_report = Instant::now();
                let elapsed = started.elapsed().as_secs_f64();
                progress(format!(
                    "[{}] plans {made}/{total}, {elapsed:.0}s elapsed, eta {:.0}s",
                    v.name,
                    elapsed / made as f64 * (total - made) as f64
                ));
            }
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_input_is_an_error_and_stops_the_other_workers() {
        let inputs: Vec<usize> = (0..200).collect();
        let panicked = AtomicBool::new(false);
        let started = AtomicUsize::new(0);
        let mut finished = 0;
        let result = for_each_parallel(
            2,
            &inputs,
            |&i, _| {
                started.fetch_add(1, Ordering::SeqCst);
                if i == 0 {
                    panicked.store(true, Ordering::SeqCst);
                    panic!("boom");
                }
                while !panicked.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                // Slow enough that the other worker cannot get through every input while
                // the panic is being reported (its hook may print a backtrace).
                std::thread::sleep(Duration::from_millis(50));
                Ok(i)
            },
            &mut |_| {},
            |_, _| {
                finished += 1;
                Ok(())
            },
        );
        let err = format!("{:#}", result.unwrap_err());
        assert!(err.contains("input 1 panicked: boom"), "{err}");
        // Without the panic caught, the call itself panics once the other worker has worked
        // through every input. With it, that worker finishes what it had started and stops.
        let started = started.load(Ordering::SeqCst);
        assert!(started < inputs.len(), "{started} inputs started");
        assert_eq!(finished, started - 1);
        // On the calling thread (one job) a panic is an error too.
        let one = for_each_parallel(
            1,
            &inputs,
            |&i, _| if i == 1 { panic!("bang") } else { Ok(i) },
            &mut |_| {},
            |_, _| Ok(()),
        );
        let err = format!("{:#}", one.unwrap_err());
        assert!(err.contains("input 2 panicked: bang"), "{err}");
    }
}
