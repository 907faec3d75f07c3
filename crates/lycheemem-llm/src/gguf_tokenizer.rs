//! Builds the tokenizer of a GGUF model from its own metadata: gpt2-style byte-level BPE with the
//! vocabulary (`tokenizer.ggml.tokens`), merges, token types (control and user-defined tokens
//! become added tokens), and the pre-tokenizer regexes that `tokenizer.ggml.pre` selects — the
//! same regexes llama.cpp uses for each pre-tokenizer name.

use candle_core::quantized::gguf_file::{Content, Value};
use lycheemem_core::{Error, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SMOLLM_DIGITS: &str = r"\p{N}";
const SMOLLM_REST: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// The regexes applied in order for a `tokenizer.ggml.pre` name.
fn pre_tokenizer_regexes(pre: &str) -> Result<&'static [&'static str]> {
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => &[GPT2],
        "qwen2" | "deepseek-r1-qwen" => &[QWEN2],
        "llama3" | "llama-bpe" | "llama-v3" => &[LLAMA3],
        "smollm" => &[SMOLLM_DIGITS, SMOLLM_REST],
        other => {
            return Err(Error::Model(format!(
                "GGUF pre-tokenizer {other:?} is not supported (supported: gpt2, qwen2, llama-bpe, smollm)"
            )));
        }
    })
}

/// Special token ids and flags of a GGUF tokenizer.
#[derive(Debug, Clone)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: u32,
    /// Extra end-of-generation tokens (control tokens such as `<|im_end|>`, `<|endoftext|>`).
    pub stop: Vec<u32>,
    pub add_bos: bool,
    pub bos_text: String,
    pub eos_text: String,
}

fn meta<'a>(ct: &'a Content, key: &str) -> Result<&'a Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| Error::Model(format!("GGUF metadata lacks {key}")))
}

fn as_u32(v: &Value, key: &str) -> Result<u32> {
    v.to_u32()
        .map_err(|e| Error::Model(format!("GGUF {key}: {e}")))
}

/// Builds the tokenizer and reads the special tokens.
pub fn tokenizer_from_gguf(ct: &Content) -> Result<(Tokenizer, SpecialTokens)> {
    let model = meta(ct, "tokenizer.ggml.model")?
        .to_string()
        .map_err(|e| Error::Model(e.to_string()))?;
    if model != "gpt2" {
        return Err(Error::Model(format!(
            "GGUF tokenizer model {model:?} is not supported (only gpt2-style BPE)"
        )));
    }
    let tokens: Vec<String> = match meta(ct, "tokenizer.ggml.tokens")? {
        Value::Array(items) => items
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::Model(e.to_string()))?,
        _ => return Err(Error::Model("tokenizer.ggml.tokens is not an array".into())),
    };
    let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let merges: Vec<(String, String)> = match meta(ct, "tokenizer.ggml.merges")? {
        Value::Array(items) => items
            .iter()
            .filter_map(|v| v.to_string().ok())
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect(),
        _ => return Err(Error::Model("tokenizer.ggml.merges is not an array".into())),
    };
    let pre = ct
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map_or("default", String::as_str);

    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Model(format!("cannot build BPE from GGUF: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for re in pre_tokenizer_regexes(pre)? {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Model(format!("bad pre-tokenizer regex: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    tok.with_pre_tokenizer(Some(Sequence::new(steps)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));

    let mut specials = Vec::new();
    let mut user_defined = Vec::new();
    for (t, ty) in tokens.iter().zip(&types) {
        match *ty {
            TOKEN_TYPE_CONTROL => {
                specials.push(AddedToken::from(t.clone(), true).normalized(false))
            }
            TOKEN_TYPE_USER_DEFINED => {
                user_defined.push(AddedToken::from(t.clone(), false).normalized(false))
            }
            _ => {}
        }
    }
    tok.add_special_tokens(specials)
        .map_err(|e| Error::Model(e.to_string()))?;
    tok.add_tokens(user_defined)
        .map_err(|e| Error::Model(e.to_string()))?;

    let eos = as_u32(meta(ct, "tokenizer.ggml.eos_token_id")?, "eos_token_id")?;
    let bos = ct
        .metadata
        .get("tokenizer.ggml.bos_token_id")
        .and_then(|v| v.to_u32().ok());
    let add_bos = ct
        .metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    let text_of = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .cloned()
            .unwrap_or_default()
    };
    // End-of-generation tokens, as llama.cpp's `llama_vocab::is_eog` collects them.
    let stop: Vec<u32> = tokens
        .iter()
        .enumerate()
        .filter(|(i, t)| {
            types.get(*i) == Some(&TOKEN_TYPE_CONTROL)
                && matches!(
                    t.as_str(),
                    "<|im_end|>"
                        | "<|endoftext|>"
                        | "<|eot_id|>"
                        | "<|end|>"
                        | "<end_of_turn>"
                        | "<|end_of_text|>"
                )
        })
        .map(|(i, _)| i as u32)
        .chain(std::iter::once(eos))
        .collect();
    let specials = SpecialTokens {
        bos,
        eos,
        stop,
        add_bos,
        bos_text: text_of(bos),
        eos_text: text_of(Some(eos)),
    };
    Ok((tok, specials))
}
