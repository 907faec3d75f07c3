//! JSON-Schema-constrained decoding with llguidance: before each sampling step, every token that
//! cannot continue a JSON value valid under the schema gets logit -inf, so the output always
//! parses and validates. The token environment is built from the same tokenizer the model uses
//! (the GGUF's), once per model.

use candle_core::Tensor;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use lycheemem_core::{Error, Result};
use std::sync::Arc;

fn llg_err(e: impl std::fmt::Display) -> Error {
    Error::Model(format!("constrained decoding: {e}"))
}

/// llguidance's view of our tokenizer: token bytes in a trie, and tokenization of byte strings.
struct TokenizerView {
    tokenizer: tokenizers::Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for TokenizerView {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s: &str| {
            match self.tokenizer.encode(s, false) {
                Ok(e) => e.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s.as_bytes()),
            }
        })
    }
}

/// Per-model constraint machinery (the parser factory is built once and shared).
pub(crate) struct SchemaConstraints {
    factory: Arc<ParserFactory>,
}

impl SchemaConstraints {
    /// `stop_ids`: end-of-generation tokens (the first is the primary EOS); `n_vocab`: the
    /// length of the model's logits.
    pub(crate) fn new(
        tokenizer: &tokenizers::Tokenizer,
        stop_ids: &[u32],
        n_vocab: usize,
    ) -> Result<Self> {
        let json = serde_json::to_value(tokenizer).map_err(llg_err)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(llg_err)?;
        if words.len() > n_vocab
            || stop_ids.is_empty()
            || stop_ids.iter().any(|&t| t as usize >= n_vocab)
        {
            return Err(Error::Model(format!(
                "vocabulary of {} tokens and stop ids {stop_ids:?} do not fit logits of {n_vocab}",
                words.len()
            )));
        }
        // Ids past the tokenizer's vocabulary (embedding padding) become never-allowed specials.
        while words.len() < n_vocab {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let trie = TokTrie::from(&TokRxInfo::new(n_vocab as u32, stop_ids[0]), &words)
            .with_eos_tokens(stop_ids);
        let env: TokEnv = Arc::new(TokenizerView {
            tokenizer: tokenizer.clone(),
            trie,
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(llg_err)?;
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(SchemaConstraints {
            factory: Arc::new(factory),
        })
    }

    /// A fresh constraint for one generation. The JSON is compact (", " and ": " separators,
    /// no free whitespace) so small models cannot stall in whitespace.
    pub(crate) fn start(&self, schema: &serde_json::Value) -> Result<ActiveConstraint> {
        let mut schema = schema.clone();
        if schema.is_object() && schema.get("x-guidance").is_none() {
            JsonCompileOptions {
                whitespace_flexible: false,
                item_separator: ", ".into(),
                key_separator: ": ".into(),
                ..Default::default()
            }
            .apply_to(&mut schema);
        }
        let matcher = Matcher::new(
            self.factory
                .create_parser(TopLevelGrammar::from_json_schema(schema)),
        );
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidInput(format!(
                "JSON schema not supported for constrained decoding: {e}"
            )));
        }
        Ok(ActiveConstraint { matcher })
    }
}

/// The grammar state of one generation.
pub(crate) struct ActiveConstraint {
    matcher: Matcher,
}

impl ActiveConstraint {
    /// The logits with every disallowed token set to -inf.
    pub(crate) fn mask_logits(&mut self, logits: &Tensor) -> Result<Tensor> {
        let mask = self.matcher.compute_mask().map_err(llg_err)?;
        let mut values = logits.to_vec1::<f32>().map_err(llg_err)?;
        for (i, v) in values.iter_mut().enumerate() {
            if i >= mask.len() || !mask.is_allowed(i as TokenId) {
                *v = f32::NEG_INFINITY;
            }
        }
        Tensor::from_vec(values, logits.shape(), logits.device()).map_err(llg_err)
    }

    /// The tokens the grammar forces next (at most `limit`), consumed: the caller must emit them.
    /// Empty when the next token is a choice, or when the parser cannot tell.
    pub(crate) fn fast_forward(&mut self, limit: usize) -> Result<Vec<u32>> {
        let mut forced = self.matcher.compute_ff_tokens();
        forced.truncate(limit);
        if !forced.is_empty() {
            self.matcher.consume_tokens(&forced).map_err(llg_err)?;
        }
        Ok(forced)
    }

    pub(crate) fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(llg_err)
    }

    /// The output so far is a complete value (end-of-sequence would be allowed).
    pub(crate) fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Nothing can follow: the value is complete.
    pub(crate) fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}
