//! `lycheemem bench store`: the store at 10k–1M records. Synthetic clustered unit vectors
//! (embedding-like: many topics, near neighbours with cosine ≈ 0.6–0.9) and Zipf-distributed
//! texts, inserted through the public API; then vector search latency and recall@10 against
//! exact brute-force search over the same vectors in the same run, BM25 latency, reopen time,
//! RSS and disk bytes per record. Everything is seeded.

use anyhow::{Context, Result};
use clap::Args;
use lycheemem_core::config::VectorPrecision;
use lycheemem_core::{
    FinalizeReason, MemoryType, Namespace, Record, Role, Segment, SessionId, SourceRole,
    TemporalScope, Turn,
};
use lycheemem_store::prelude::*;
use lycheemem_store::{
    SegmentOutcome, SegmentWrite, SessionInfo, Store, StoreOptions, Target, VectorQuery,
};
use rayon::prelude::*;

use lycheemem_bench::synthetic::{
    Rng, clustered_vectors, normalize, percentile, rss_mib, sentence, word,
};
use lycheemem_core::vector::dot;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct BenchStoreArgs {
    /// Record counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 384)]
    dims: usize,
    /// Queries per measurement.
    #[arg(long, default_value_t = 200)]
    queries: usize,
    /// HNSW search beam widths to measure.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    ef: Vec<usize>,
    /// Vector index precision: f32 or f16.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Where to build the stores (default: a temporary folder, removed afterwards).
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Exact top-k indices by dot product (vectors are unit length).
fn exact_top_k(data: &[Vec<f32>], q: &[f32], k: usize) -> Vec<usize> {
    let mut scored: Vec<(f32, usize)> = data
        .iter()
        .enumerate()
        .map(|(i, v)| (dot(v, q), i))
        .collect();
    let k = k.min(scored.len());
    scored.select_nth_unstable_by(k.saturating_sub(1), |a, b| b.0.total_cmp(&a.0));
    scored.truncate(k);
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    scored.into_iter().map(|(_, i)| i).collect()
}

struct Row {
    label: String,
    value: String,
}

pub fn run(args: BenchStoreArgs) -> Result<()> {
    let precision = match args.precision.as_str() {
        "f32" => VectorPrecision::F32,
        "f16" => VectorPrecision::F16,
        other => anyhow::bail!("--precision must be f32 or f16, not {other:?}"),
    };
    let temp;
    let root = match &args.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_path_buf()
        }
    };
    println!(
        "store benchmark: {} dims, {:?} index, {} queries, seed {}, {} threads available",
        args.dims,
        precision,
        args.queries,
        args.seed,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    for &n in &args.sizes {
        let rows = run_size(&args, n, precision, &root.join(format!("n{n}")))?;
        println!("\n### {n} records\n");
        println!("| measure | value |\n|---|---|");
        for r in rows {
            println!("| {} | {} |", r.label, r.value);
        }
    }
    Ok(())
}

fn run_size(
    args: &BenchStoreArgs,
    n: usize,
    precision: VectorPrecision,
    dir: &std::path::Path,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut row = |label: &str, value: String| {
        eprintln!("  {label}: {value}");
        rows.push(Row {
            label: label.to_string(),
            value,
        })
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    let t = Instant::now();
    let data = clustered_vectors(n, args.dims, args.seed);
    let mut rng = Rng(args.seed.wrapping_mul(7) | 1);
    let vocab = 20_000;
    let texts: Vec<String> = (0..n)
        .map(|i| format!("{} {}", sentence(&mut rng, vocab, 11), word(vocab + i)))
        .collect();
    eprintln!("[{n}] generated data in {:.1}s", t.elapsed().as_secs_f64());

    let options = StoreOptions::new(args.dims).with_precision(precision);
    let ns = Namespace::new("bench")?;
    let rss_before_build = rss_mib();
    let store = Store::open(dir, options.clone())?;

    // Raw turns, one durable transaction each (what a live chat does).
    let turn_count = 1000.min(n);
    let turn_session = SessionId::new("turns")?;
    let t = Instant::now();
    for i in 0..turn_count {
        let turn = Turn {
            session: turn_session.clone(),
            index: i as u32,
            role: Role::User,
            speaker: None,
            text: texts[i].clone(),
            time: None,
        };
        store.add_turns(&ns, vec![(turn, Some(data[i].clone()))])?;
    }
    let turn_secs = t.elapsed().as_secs_f64();
    row(
        "turn insert, 1 per transaction (turns/s)",
        format!("{:.0} ({turn_count} turns)", turn_count as f64 / turn_secs),
    );

    // Records, 500 per segment transaction, through commit_segment.
    let per_segment = 500;
    let t = Instant::now();
    let mut session_index = 0;
    for (chunk_no, chunk) in (0..n).collect::<Vec<_>>().chunks(per_segment).enumerate() {
        if chunk_no % 20 == 0 {
            session_index += 1;
            let s = SessionId::new(format!("s{session_index}"))?;
            store.put_session(&ns, SessionInfo::new(s.clone(), Some("2024-01-01".into())))?;
            let turn = Turn {
                session: s,
                index: 0,
                role: Role::User,
                speaker: None,
                text: "session opener".into(),
                time: None,
            };
            store.add_turns(&ns, vec![(turn, None)])?;
        }
        let session = SessionId::new(format!("s{session_index}"))?;
        let segment = Segment {
            id: Segment::make_id(&session, 0, 0),
            session: session.clone(),
            first_turn: 0,
            last_turn: 0,
            exchanges: 1,
            tokens: 1,
            reason: FinalizeReason::SemanticBoundary,
        };
        let mut write = SegmentWrite::new(segment.clone(), SegmentOutcome::Encoded);
        for &i in chunk {
            let record = Record {
                record_id: Record::make_id(&ns, &texts[i]),
                memory_type: MemoryType::Fact,
                semantic_text: texts[i].clone(),
                normalized_text: Record::make_normalized_text(MemoryType::Fact, &texts[i]),
                entities: Vec::new(),
                tags: Vec::new(),
                temporal: TemporalScope::default(),
                evidence_turns: vec![0],
                source_session: session.clone(),
                source_role: SourceRole::User,
                segment_id: segment.id.clone(),
                created_at: None,
                confidence: 1.0,
            };
            write.records.push((record, Some(data[i].clone())));
        }
        store.commit_segment(&ns, write)?;
        if chunk_no % 200 == 199 {
            eprintln!(
                "[{n}] {} records in {:.0}s",
                (chunk_no + 1) * per_segment,
                t.elapsed().as_secs_f64()
            );
        }
    }
    let insert_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    store.checkpoint()?;
    let checkpoint_secs = t.elapsed().as_secs_f64();
    row(
        "record insert, 500 per transaction (records/s)",
        format!("{:.0} ({insert_secs:.1} s)", n as f64 / insert_secs),
    );
    row(
        "checkpoint after insert (s)",
        format!("{checkpoint_secs:.2}"),
    );
    row(
        "RSS growth while building (MiB)",
        format!("{:.0}", rss_mib() - rss_before_build),
    );

    // Queries: perturbed data points.
    let q_count = args.queries;
    let mut qrng = Rng(args.seed.wrapping_mul(13) | 1);
    let queries: Vec<Vec<f32>> = (0..q_count)
        .map(|_| {
            let base = &data[(qrng.next_u64() % n as u64) as usize];
            let mut q: Vec<f32> = base
                .iter()
                .map(|x| x + 0.5 / (args.dims as f32).sqrt() * qrng.normal())
                .collect();
            normalize(&mut q);
            q
        })
        .collect();
    let record_ids: Vec<String> = texts.iter().map(|t| Record::make_id(&ns, t)).collect();
    // Reference: exact brute-force search, one query at a time, all cores.
    let mut exact_ms = Vec::with_capacity(q_count);
    let mut truth: Vec<Vec<usize>> = Vec::with_capacity(q_count);
    for q in &queries {
        let t = Instant::now();
        let chunk = n.div_ceil(rayon::current_num_threads().max(1));
        let mut merged: Vec<(f32, usize)> = data
            .par_chunks(chunk)
            .enumerate()
            .flat_map_iter(|(c, part)| {
                exact_top_k(part, q, 10)
                    .into_iter()
                    .map(move |i| (dot(&part[i], q), c * chunk + i))
                    .collect::<Vec<_>>()
            })
            .collect();
        merged.sort_by(|a, b| b.0.total_cmp(&a.0));
        merged.truncate(10);
        exact_ms.push(t.elapsed().as_secs_f64() * 1e3);
        truth.push(merged.into_iter().map(|(_, i)| i).collect());
    }
    exact_ms.sort_by(f64::total_cmp);
    let exact_p50 = percentile(&exact_ms, 0.5);
    row(
        "exact search p50 (ms) [reference]",
        format!("{exact_p50:.2}"),
    );
    for &ef in &args.ef {
        store.set_hnsw_expansion_search(ef);
        let mut ms = Vec::with_capacity(q_count);
        let mut found = 0usize;
        for (q, want) in queries.iter().zip(&truth) {
            let t = Instant::now();
            let hits =
                store.vector_search(&ns, &VectorQuery::new(Target::Record, q.clone(), 10))?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            let want: std::collections::HashSet<&str> =
                want.iter().map(|i| record_ids[*i].as_str()).collect();
            found += hits
                .iter()
                .filter(|h| matches!(&h.item, lycheemem_store::ItemRef::Record(id) if want.contains(id.as_str())))
                .count();
        }
        ms.sort_by(f64::total_cmp);
        let p50 = percentile(&ms, 0.5);
        row(
            &format!("HNSW ef={ef}: p50 / p99 ms, recall@10, speed-up vs exact"),
            format!(
                "{p50:.2} / {:.2}, {:.3}, {:.0}x",
                percentile(&ms, 0.99),
                found as f64 / (10 * q_count) as f64,
                exact_p50 / p50
            ),
        );
    }
    store.set_hnsw_expansion_search(options.index.hnsw_expansion_search);

    // BM25 over the record texts, then again once some records are deleted: the deleted
    // documents stay in the index segments, and BM25 statistics then count the live documents
    // of every segment that holds a deleted one (a walk over each query term's postings).
    let text_queries: Vec<String> = (0..q_count)
        .map(|_| sentence(&mut qrng, vocab, 3))
        .collect();
    let bm25 = || -> Result<(f64, f64, usize)> {
        let mut ms = Vec::with_capacity(q_count);
        let mut nonempty = 0;
        for q in &text_queries {
            let t = Instant::now();
            let hits = store.text_search(&ns, Target::Record, q, 10, None)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            nonempty += usize::from(!hits.is_empty());
        }
        ms.sort_by(f64::total_cmp);
        Ok((percentile(&ms, 0.5), percentile(&ms, 0.99), nonempty))
    };
    let (live_p50, live_p99, nonempty) = bm25()?;
    row(
        "BM25 top-10 p50 / p99 ms (3-word queries)",
        format!("{live_p50:.2} / {live_p99:.2} ({nonempty}/{q_count} with hits)"),
    );
    let deleted = (n / 100).clamp(1, 200);
    for i in 0..deleted {
        store.delete_record(&ns, &record_ids[i * (n / deleted)])?;
    }
    store.text_search(&ns, Target::Record, &text_queries[0], 10, None)?; // commit the deletes
    let (p50, p99, _) = bm25()?;
    row(
        &format!("BM25 after deleting {deleted} records: p50 / p99 ms, p50 vs before"),
        format!("{p50:.2} / {p99:.2}, {:.2}x", p50 / live_p50),
    );

    let disk = store.disk_bytes();
    drop(store);
    let rss_closed = rss_mib();
    let t = Instant::now();
    let store = Store::open(dir, options).context("reopening")?;
    let open_secs = t.elapsed().as_secs_f64();
    let hits = store.vector_search(
        &ns,
        &VectorQuery::new(Target::Record, queries[0].clone(), 10),
    )?;
    anyhow::ensure!(hits.len() == 10, "reopened store lost vectors");
    row("reopen (s)", format!("{open_secs:.2}"));
    row(
        "RSS added by the open store (MiB)",
        format!("{:.0}", rss_mib() - rss_closed),
    );
    row(
        "disk bytes per record (all files / records+turns)",
        format!(
            "{:.0} ({:.2} GB total)",
            disk as f64 / n as f64,
            disk as f64 / 1e9
        ),
    );
    drop(store);
    if args.dir.is_none() {
        std::fs::remove_dir_all(dir).ok();
    }
    Ok(rows)
}
