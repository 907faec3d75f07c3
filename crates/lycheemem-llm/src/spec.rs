//! Choosing a backend by configuration: `local:<model>` or `openai:<model>@<base_url>`.

use lycheemem_core::{Error, Result};
use lycheemem_models::ModelStore;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{Llm, LocalLlm, LocalOptions, RemoteLlm, RemoteOptions};

/// A parsed LLM spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LlmSpec {
    /// A manifest model name (`local:qwen2.5-coder-0.5b-instruct`) or a GGUF path
    /// (`local:/path/model.gguf`).
    Local { model: String },
    /// `openai:<model>@<base_url>`, e.g. `openai:gpt-4.1-mini@https://api.openai.com/v1`.
    OpenAi { model: String, base_url: String },
}

impl std::str::FromStr for LlmSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "LLM spec {s:?} must be local:<model or .gguf path> or openai:<model>@<base_url>"
            ))
        };
        match s.split_once(':') {
            Some(("local", model)) if !model.is_empty() => Ok(LlmSpec::Local {
                model: model.to_string(),
            }),
            Some(("openai", rest)) => match rest.split_once('@') {
                Some((model, url))
                    if !model.is_empty()
                        && (url.starts_with("http://") || url.starts_with("https://")) =>
                {
                    Ok(LlmSpec::OpenAi {
                        model: model.to_string(),
                        base_url: url.to_string(),
                    })
                }
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

/// Opens the backend a spec names. Local model names are resolved (and verified) through
/// `models`; remote backends read their API key from `OPENAI_API_KEY`.
pub fn open_llm(spec: &str, models: &ModelStore, local: LocalOptions) -> Result<Arc<dyn Llm>> {
    match spec.parse::<LlmSpec>()? {
        LlmSpec::Local { model } => {
            let path = if model.ends_with(".gguf") {
                PathBuf::from(&model)
            } else {
                models.resolve(&model)?.join("model.gguf")
            };
            Ok(Arc::new(LocalLlm::load(
                &path,
                LocalOptions {
                    model_id: Some(model),
                    ..local
                },
            )?))
        }
        LlmSpec::OpenAi { model, base_url } => Ok(Arc::new(RemoteLlm::new(RemoteOptions::new(
            base_url, model,
        ))?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            "local:qwen2.5-coder-0.5b-instruct"
                .parse::<LlmSpec>()
                .unwrap(),
            LlmSpec::Local {
                model: "qwen2.5-coder-0.5b-instruct".into()
            }
        );
        assert_eq!(
            "openai:gpt-4.1-mini@https://api.openai.com/v1"
                .parse::<LlmSpec>()
                .unwrap(),
            LlmSpec::OpenAi {
                model: "gpt-4.1-mini".into(),
                base_url: "https://api.openai.com/v1".into()
            }
        );
        for bad in [
            "",
            "local:",
            "qwen",
            "openai:gpt",
            "openai:@http://x",
            "openai:m@ftp://x",
            "remote:x",
        ] {
            assert!(bad.parse::<LlmSpec>().is_err(), "{bad}");
        }
    }
}
