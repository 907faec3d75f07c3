//! Plans: one per question and planner, made ahead of the questions' memories, cached on the
//! machine and kept in the results folder.

use super::*;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct CachedPlan {
    pub(super) key: String,
    pub(super) plan: Plan,
    pub(super) fallback: Option<String>,
    pub(super) usage: Option<TokenUsage>,
}

/// The cache key of a question's plan: planner model, limits, revision, instructions, schema
/// and type cross-check, question and date (a changed planner makes new plans; the plan logs of
/// runs before planner revision 2 keyed only model, limits, question and date).
pub(super) fn plan_key(q: &Question, v: &Variant, comps: &Components) -> String {
    use lycheemem_retrieve::planner;
    let r = &v.config.retrieval;
    let key_src = serde_json::json!({
        "llm": comps.plan_llm.model_id(),
        "question": q.question,
        "date": q.date,
        "limits": [r.planner_context_chars, r.max_queries, r.max_routes, r.max_queries_per_route, r.max_constraints],
        "planner": {
            "revision": planner::PLANNER_REVISION,
            "instructions": planner::PLANNER_INSTRUCTIONS,
            "schema": planner::plan_schema(r),
            "type_cues": r.question_type_cues,
        },
    });
    hex::encode(Sha256::digest(key_src.to_string().as_bytes()))
}

/// Where plans are logged: the cache's log, shared by every run on the machine, and the results
/// folder's own, which keeps the plan of every question the folder's predictions used (committed
/// with the report, so a fresh clone re-evaluates without the planner).
pub(super) struct PlanLogs {
    pub(super) shared: PathBuf,
    pub(super) kept: PathBuf,
    pub(super) kept_keys: HashSet<String>,
}

/// Makes the plans the questions lack, `jobs` at a time, and logs each (one plan per key, shared
/// by every variant and later run); copies into the results folder's log the plans it lacks.
pub(super) fn prefetch_plans(
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
