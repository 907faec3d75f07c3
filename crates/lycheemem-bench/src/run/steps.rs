//! The steps of a run: select and load checkpoints, build memories in the background, and per
//! wave plan, wait, open and evaluate.

use super::*;

/// Items of one wave: each item's index with the indexes of its selected questions.
pub(super) type Wave<'a> = [(usize, &'a Vec<usize>)];

/// What the background builder made for one task of wave `wave`.
pub(super) struct Built {
    pub(super) wave: usize,
    pub(super) item: usize,
    pub(super) what: BuiltWhat,
}

/// A memory (by construction hash) or a peer's build and search (by variant index).
pub(super) enum BuiltWhat {
    Memory(String),
    Peer(usize, Box<crate::peer::PeerRun>),
}

/// What the builder made in this run and the waves have not taken yet.
#[derive(Default)]
pub(super) struct Made {
    /// (item, construction hash) of the memories built (the calling thread opens them cached).
    pub(super) memories: HashSet<(usize, String)>,
    /// (item, variant) → the peer's build and hits, taken by the wave that evaluates them.
    pub(super) peers: HashMap<(usize, usize), crate::peer::PeerRun>,
}

/// `spec.variant_items` may only name variants of the run and items of the dataset.
pub(super) fn check_variant_items(dataset: &Dataset, spec: &RunSpec) -> Result<()> {
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
pub(super) struct RunContext<'a> {
    pub(super) dataset: &'a Dataset,
    pub(super) spec: &'a RunSpec,
    pub(super) base: &'a Config,
    pub(super) backends: &'a Backends,
    pub(super) variants: Vec<Variant>,
    pub(super) comps: Components,
    /// Parallel to `variants`.
    pub(super) construction_hashes: Vec<String>,
}

/// What the results folder already holds, kept up to date as the run checkpoints.
pub(super) struct Checkpoints {
    /// (variant, question id) of every prediction made.
    pub(super) done: HashSet<(String, String)>,
    /// (variant, item id) of every construction report written.
    pub(super) built: HashSet<(String, String)>,
    pub(super) plans: HashMap<String, CachedPlan>,
    pub(super) plan_logs: PlanLogs,
    pub(super) clock: Clock,
}

impl Checkpoints {
    pub(super) fn load(spec: &RunSpec) -> Result<Checkpoints> {
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
    pub(super) fn report_construction(
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
    /// Memory variants grouped by construction hash (variants of one group share one memory).
    fn construction_groups(&self) -> BTreeMap<String, Vec<&Variant>> {
        let mut groups: BTreeMap<String, Vec<&Variant>> = BTreeMap::new();
        for (v, hash) in self.variants.iter().zip(&self.construction_hashes) {
            if v.kind == VariantKind::Memory {
                groups.entry(hash.clone()).or_default().push(v);
            }
        }
        groups
    }

    /// Whether variant `v` runs on `item` (`spec.variant_items`).
    pub(super) fn allowed(&self, v: &Variant, item: &Item) -> bool {
        self.spec
            .variant_items
            .get(&v.name)
            .is_none_or(|items| items.contains(&item.id))
    }

    /// The selected questions `qs` of item `i` that variant `v` has yet to answer.
    pub(super) fn pending(
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
    pub(super) fn needs_report(&self, v: &Variant, i: usize, ck: &Checkpoints) -> bool {
        let item = &self.dataset.items[i];
        self.allowed(v, item) && !ck.built.contains(&(v.name.clone(), item.id.clone()))
    }

    /// The memories missing from the cache that the waves need, with how many each wave waits
    /// for.
    pub(super) fn build_tasks(
        &self,
        waves: &[&Wave],
        ck: &Checkpoints,
    ) -> (Vec<BuildTask<'_>>, Vec<usize>) {
        let mut tasks = Vec::new();
        let mut unbuilt = vec![0usize; waves.len()];
        for (w, wave) in waves.iter().enumerate() {
            for &(i, qs) in *wave {
                let item = &self.dataset.items[i];
                for (hash, group) in self.construction_groups() {
                    let needed = group.iter().any(|v| {
                        !self.pending(v, i, qs, &ck.done).is_empty() || self.needs_report(v, i, ck)
                    });
                    if needed
                        && !construct::is_built(
                            &self.spec.memories().markers(),
                            self.dataset.kind,
                            item,
                            &hash,
                        )
                    {
                        tasks.push(BuildTask {
                            wave: w,
                            item: i,
                            what: BuildWhat::Memory {
                                hash,
                                config: &group[0].config,
                            },
                        });
                        unbuilt[w] += 1;
                    }
                }
                for (variant, peer, questions) in self.peer_work(i, qs, ck) {
                    tasks.push(BuildTask {
                        wave: w,
                        item: i,
                        what: BuildWhat::Peer {
                            variant,
                            peer,
                            questions,
                        },
                    });
                    unbuilt[w] += 1;
                }
            }
        }
        (tasks, unbuilt)
    }

    /// The peer variants with work left on item `i` (questions `qs`): (variant index, peer,
    /// the pending questions); a peer with no question left still runs to write its report.
    pub(super) fn peer_work(
        &self,
        i: usize,
        qs: &[usize],
        ck: &Checkpoints,
    ) -> Vec<(usize, crate::peer::PeerKind, Vec<usize>)> {
        let mut work = Vec::new();
        for (vi, v) in self.variants.iter().enumerate() {
            let VariantKind::Peer(peer) = v.kind else {
                continue;
            };
            let pending = self.pending(v, i, qs, &ck.done);
            if !pending.is_empty() || self.needs_report(v, i, ck) {
                work.push((vi, peer, pending));
            }
        }
        work
    }
}

/// One memory for the background builder to make.
pub(super) struct BuildTask<'a> {
    pub(super) wave: usize,
    pub(super) item: usize,
    pub(super) what: BuildWhat<'a>,
}

/// A memory of lycheemem's (by construction hash and config), or a peer's build of the item
/// followed by its search of the pending questions (which the driver does in one process).
pub(super) enum BuildWhat<'a> {
    Memory {
        hash: String,
        config: &'a Config,
    },
    Peer {
        variant: usize,
        peer: crate::peer::PeerKind,
        questions: Vec<usize>,
    },
}

/// The background builder's inputs and its ways of reporting.
pub(super) struct Builder<'a> {
    pub(super) tasks: &'a [BuildTask<'a>],
    /// Raised by the calling thread when it leaves: no new memory is started and the ones in
    /// progress stop at their next session.
    pub(super) stop: &'a AtomicBool,
    pub(super) finished: &'a AtomicBool,
    pub(super) lines: mpsc::Sender<String>,
    pub(super) built: mpsc::Sender<Result<Built>>,
}

/// Builds every task's memory, `jobs` at a time, on a thread of `scope`; sends each built memory
/// (or the error that stopped the builder) and its progress lines.
pub(super) fn spawn_builder<'scope, 'env>(
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
                let what = match &task.what {
                    BuildWhat::Memory { hash, config } => {
                        construct::build_or_open(
                            &ctx.spec.memories(),
                            ctx.dataset.kind,
                            &ctx.dataset.items[task.item],
                            config,
                            hash,
                            ctx.comps.clone(),
                            construct::BuildOptions {
                                stop: Some(stop),
                                session_lookahead: ctx.spec.session_lookahead,
                            },
                            say,
                        )?;
                        BuiltWhat::Memory(hash.clone())
                    }
                    BuildWhat::Peer {
                        variant,
                        peer,
                        questions,
                    } => BuiltWhat::Peer(
                        *variant,
                        Box::new(run_peer(
                            ctx,
                            task.item,
                            *variant,
                            *peer,
                            questions,
                            Some(stop),
                            say,
                        )?),
                    ),
                };
                Ok(Built {
                    wave: task.wave,
                    item: task.item,
                    what,
                })
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
pub(super) fn plan_wave(
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

/// Waits until the builder has made every memory (and peer run) wave `w` needs, passing its
/// progress lines on.
pub(super) fn wait_for_wave(
    w: usize,
    unbuilt: &mut [usize],
    built: &mpsc::Receiver<Result<Built>>,
    lines: &mpsc::Receiver<String>,
    made: &mut Made,
    progress: &mut dyn FnMut(String),
) -> Result<()> {
    while unbuilt[w] > 0 {
        match built.try_recv() {
            Ok(Ok(Built { wave, item, what })) => {
                unbuilt[wave] -= 1;
                match what {
                    BuiltWhat::Memory(hash) => {
                        made.memories.insert((item, hash));
                    }
                    BuiltWhat::Peer(vi, run) => {
                        made.peers.insert((item, vi), *run);
                    }
                }
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
pub(super) struct OpenWave {
    pub(super) memories: HashMap<(usize, String), (Memory, Namespace)>,
    pub(super) indexes: HashMap<usize, ChunkIndex>,
    /// (item, variant) → the peer's hits for the item's questions.
    pub(super) peers: HashMap<(usize, usize), crate::peer::PeerRun>,
}

/// Opens (building if needed) the memories the wave's questions need, takes (or makes) the peer
/// runs, writes the construction reports the folder lacks, and builds the naive-RAG chunk
/// indexes.
pub(super) fn open_wave(
    ctx: &RunContext,
    wave: &Wave,
    ck: &mut Checkpoints,
    made: &mut Made,
    progress: &mut dyn FnMut(String),
) -> Result<OpenWave> {
    let mut opened = OpenWave {
        memories: HashMap::new(),
        indexes: HashMap::new(),
        peers: HashMap::new(),
    };
    for &(i, qs) in wave {
        let item = &ctx.dataset.items[i];
        for (hash, group) in ctx.construction_groups() {
            let need_questions = group
                .iter()
                .any(|v| !ctx.pending(v, i, qs, &ck.done).is_empty());
            let need_report = group.iter().any(|v| ctx.needs_report(v, i, ck));
            if !need_questions && !need_report {
                continue;
            }
            let (memory, report, cached) = construct::build_or_open(
                &ctx.spec.memories(),
                ctx.dataset.kind,
                item,
                &group[0].config,
                &hash,
                ctx.comps.clone(),
                construct::BuildOptions {
                    stop: None,
                    session_lookahead: ctx.spec.session_lookahead,
                },
                progress,
            )?;
            let cached = cached && !made.memories.contains(&(i, hash.clone()));
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
    // Peers: the runs the builder made ahead; with one job (no builder), every (item, peer
    // variant) of the wave with work left, made here.
    let mut runs = Vec::new();
    let mut peer_tasks: Vec<(usize, usize, crate::peer::PeerKind, Vec<usize>)> = Vec::new();
    for &(i, qs) in wave {
        for (vi, peer, pending) in ctx.peer_work(i, qs, ck) {
            match made.peers.remove(&(i, vi)) {
                Some(run) => runs.push((i, vi, run)),
                None => peer_tasks.push((i, vi, peer, pending)),
            }
        }
    }
    let outcome = for_each_parallel(
        ctx.spec.jobs,
        &peer_tasks,
        |(i, vi, peer, pending), say| {
            Ok((*i, *vi, run_peer(ctx, *i, *vi, *peer, pending, None, say)?))
        },
        progress,
        |run, _| {
            runs.push(run);
            Ok(())
        },
    );
    // Reports in item and variant order, whatever order the builds finished in.
    runs.sort_by_key(|(i, vi, _)| (*i, *vi));
    for (i, vi, run) in runs {
        let (item, v) = (&ctx.dataset.items[i], &ctx.variants[vi]);
        if ctx.allowed(v, item) {
            ck.report_construction(ctx.spec, &v.name, &run.report)?;
        }
        opened.peers.insert((i, vi), run);
    }
    // The builds that finished are reported even when another one failed.
    outcome?;
    Ok(opened)
}

/// After a failed run: writes the construction reports of the peer runs the builder finished
/// that no wave took (those still in `built` included), in item and variant order, so their
/// cost is on record although their questions were not evaluated.
pub(super) fn report_untaken_peers(
    ctx: &RunContext,
    ck: &mut Checkpoints,
    made: &mut Made,
    built: &mpsc::Receiver<Result<Built>>,
) -> Result<()> {
    for b in built.try_iter().flatten() {
        if let BuiltWhat::Peer(vi, run) = b.what {
            made.peers.insert((b.item, vi), *run);
        }
    }
    let mut runs: Vec<_> = made.peers.drain().collect();
    runs.sort_by_key(|(key, _)| *key);
    for ((i, vi), run) in runs {
        let (item, v) = (&ctx.dataset.items[i], &ctx.variants[vi]);
        if ctx.allowed(v, item) {
            ck.report_construction(ctx.spec, &v.name, &run.report)?;
        }
    }
    Ok(())
}

/// Builds (or resumes, or reuses) peer variant `vi`'s memory of item `i` and searches its
/// `pending` questions.
pub(super) fn run_peer(
    ctx: &RunContext,
    i: usize,
    vi: usize,
    peer: crate::peer::PeerKind,
    pending: &[usize],
    stop: Option<&AtomicBool>,
    say: &mut dyn FnMut(String),
) -> Result<crate::peer::PeerRun> {
    let (item, v) = (&ctx.dataset.items[i], &ctx.variants[vi]);
    let python = match &ctx.spec.peer_python {
        Some(p) => p.clone(),
        None => crate::peer::default_python()
            .ok_or_else(|| anyhow::anyhow!("HOME is not set; pass the peer python"))?,
    };
    // The encoder's model, with the peer's calls logged apart from the encoder's (in the
    // results folder and the cache) and replayed when a build is redone.
    let llm = Arc::new(crate::replay::ReplayLlm::with_shared_log(
        ctx.backends.components.encode_llm.clone(),
        &ctx.spec.out.join(PEER_CALLS),
        &ctx.spec.cache.join(PEER_CALLS),
    )?);
    let job = crate::peer::PeerJob {
        kind: peer,
        dataset_kind: ctx.dataset.kind,
        item,
        questions: pending.iter().map(|&j| &item.questions[j]).collect(),
        top_k: ctx.spec.top_k.max(1),
        cache: &ctx.spec.cache,
        python: &python,
        llm: llm.clone(),
        embedder: ctx.comps.embedder.clone(),
        stop,
    };
    let mut run = crate::peer::build_and_search(&job, say)?;
    run.report.replayed_calls = Some(llm.replayed());
    say(format!(
        "{} {}: {} memories from {} units, {} LLM calls, {} construction tokens",
        v.name,
        item.id,
        run.report.records,
        run.report.exchanges,
        run.report.encode_calls,
        run.report.tokens()
    ));
    Ok(run)
}

/// One question to evaluate: (item, variant, question) indexes.
pub(super) type Task = (usize, usize, usize);

/// Evaluates every pending question of the wave, `jobs` at a time, checkpointing each
/// prediction as it arrives; `full_context` apart, one at a time, so every call reuses the
/// cached history prefix and prefills only its question.
pub(super) fn evaluate_wave(
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
pub(super) fn evaluate(
    ctx: &RunContext,
    (i, vi, j): Task,
    opened: &OpenWave,
    plans: &HashMap<String, CachedPlan>,
) -> Result<Prediction> {
    let (item, v) = (&ctx.dataset.items[i], &ctx.variants[vi]);
    let q = &item.questions[j];
    let started = Instant::now();
    let mut config = v.config.clone();
    let mut lico_result: Option<SearchResult> = None;
    let (evidence, mut p) = match v.kind {
        VariantKind::Memory => {
            let (memory, ns) = opened
                .memories
                .get(&(i, ctx.construction_hashes[vi].clone()))
                .ok_or_else(|| anyhow::anyhow!("no memory opened for {}", item.id))?;
            if v.licomemory() {
                let (result, p) = search_licomemory(ctx, v, item, q, memory, ns)?;
                let evidence = result.evidence.clone();
                lico_result = Some(result);
                (evidence, p)
            } else {
                let cached_plan =
                    if v.plans() {
                        let key = plan_key(q, v, &ctx.comps);
                        Some(plans.get(&key).cloned().ok_or_else(|| {
                            anyhow::anyhow!("no plan was made for question {}", q.id)
                        })?)
                    } else {
                        None
                    };
                search_memory(ctx, v, item, q, memory, ns, cached_plan.as_ref())?
            }
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
        VariantKind::Peer(_) => {
            let run = opened
                .peers
                .get(&(i, vi))
                .ok_or_else(|| anyhow::anyhow!("no {} run for {}", v.name, item.id))?;
            let (hits, ms) = run
                .hits
                .get(&q.id)
                .ok_or_else(|| anyhow::anyhow!("{} returned nothing for {}", v.name, q.id))?;
            let evidence: Vec<EvidenceItem> = hits.iter().map(|h| h.evidence_item()).collect();
            let mut p = base_prediction(v, item, q, &evidence, *ms);
            // LLM use while searching (none for mem0), shared evenly by the questions searched.
            let searched = run.hits.len().max(1) as u64;
            p.plan_tokens = run.search_usage.tokens() / searched;
            p.llm_calls += (run.search_usage.chat_calls / searched) as u32;
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
        match &lico_result {
            Some(result) => Retrieved::Licomemory(result),
            None => Retrieved::Evidence(&evidence),
        },
        &config,
        ctx.spec,
        ctx.backends,
    )?;
    Ok(p)
}

/// A LiCoMemory variant's retrieval for one question: its query-entity call (counted as the
/// question's planning tokens), then its chunks, triples and summary.
pub(super) fn search_licomemory(
    ctx: &RunContext,
    v: &Variant,
    item: &Item,
    q: &Question,
    memory: &Memory,
    ns: &Namespace,
) -> Result<(SearchResult, Prediction)> {
    // k chunks, like every variant's k evidence items (the facade does the same with `top_k`).
    let mut cfg = v.config.licomemory.clone();
    if ctx.spec.top_k > 0 {
        cfg.top_chunks = ctx.spec.top_k;
    }
    let retriever = lycheemem_licomemory::LicoRetriever {
        store: memory.store(),
        embedder: ctx.comps.embedder.as_ref(),
        llm: Some(ctx.comps.plan_llm.as_ref()),
        cfg: &cfg,
    };
    let result = retriever.search(
        ns,
        &lycheemem_licomemory::LicoRequest {
            question: &q.question,
            reference_date: q.date.as_deref(),
            analysis: None,
            cancel: Default::default(),
        },
    )?;
    let mut p = base_prediction(v, item, q, &result.evidence, result.retrieval_ms());
    // The summary and triples are in the prompt too.
    p.context_tokens += result
        .context
        .iter()
        .flat_map(|b| &b.lines)
        .map(|l| u64::from(estimate_tokens(l)))
        .sum::<u64>();
    p.plan_tokens = result.usage.iter().map(tokens).sum();
    p.llm_calls += result.usage.len() as u32;
    p.plan_fallback.clone_from(&result.plan_fallback);
    Ok((result, p))
}

/// A memory variant's retrieval for one question, with the logged plan (or none when the
/// variant does not plan): the search users run (records resolved lazily; its evidence and
/// latency are the prediction's), then the same search traced for the stage table, which
/// resolves every candidate — and must choose the same evidence.
pub(super) fn search_memory(
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
    let mut request = SearchRequest {
        question: &q.question,
        context: "",
        reference_date: q.date.as_deref(),
        top_k: ctx.spec.top_k,
        plan: cached_plan.map(|p| &p.plan),
        trace: false,
        cancel: Default::default(),
    };
    let result = retriever.search(ns, &request)?;
    request.trace = true;
    let traced = retriever.search(ns, &request)?;
    if traced.evidence != result.evidence {
        anyhow::bail!(
            "{} / {}: the traced search (every candidate resolved) chose other evidence than \
             the lazy one; lazy resolution is not exact here",
            item.id,
            q.id
        );
    }
    let mut p = base_prediction(v, item, q, &result.evidence, result.retrieval_ms());
    p.stages = stage_scores(q, &traced.stages);
    if let Some(c) = cached_plan {
        p.plan_tokens = c.usage.as_ref().map_or(0, tokens);
        p.llm_calls += u32::from(c.usage.is_some());
        p.plan_fallback.clone_from(&c.fallback);
        p.question_type = Some(c.plan.question_type.as_str().to_string());
    } else {
        p.plan_fallback = Some("planner disabled".into());
    }
    Ok((result.evidence, p))
}

/// Appends a prediction to its variant's checkpoint file, counts it, reports progress.
pub(super) fn checkpoint(
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

pub(super) fn base_prediction(
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
        question_type: None,
        note: None,
        stages: Vec::new(),
    }
}

/// What a question's answer prompt is built from.
pub(super) enum Retrieved<'a> {
    /// Evidence items (LycheeMemory, the baselines).
    Evidence(&'a [EvidenceItem]),
    /// A LiCoMemory result: its chunks, summaries and triples.
    Licomemory(&'a SearchResult),
}

/// Answers and judges (unless retrieval-only).
pub(super) fn finish(
    p: &mut Prediction,
    kind: DatasetKind,
    q: &Question,
    retrieved: Retrieved<'_>,
    config: &Config,
    spec: &RunSpec,
    backends: &Backends,
) -> Result<()> {
    if spec.retrieval_only {
        return Ok(());
    }
    let clock = Instant::now();
    let llm = backends.components.answer_llm.as_ref();
    let reply = match retrieved {
        Retrieved::Licomemory(result) => lycheemem_licomemory::answer(
            llm,
            &q.question,
            q.date.as_deref(),
            result,
            &config.licomemory,
            &config.answer,
            &Default::default(),
        )?,
        Retrieved::Evidence(evidence) => lycheemem_retrieve::answer(
            llm,
            &q.question,
            q.date.as_deref(),
            evidence,
            &config.answer,
            &Default::default(),
        )?,
    };
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
