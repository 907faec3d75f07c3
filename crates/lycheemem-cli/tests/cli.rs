//! The `lycheemem` binary's success and error paths: user mistakes end in one clear line and a
//! non-zero exit, never a panic.

use assert_cmd::Command;
use std::path::Path;

fn lycheemem() -> Command {
    let mut cmd = Command::cargo_bin("lycheemem").unwrap();
    cmd.env(
        "LYCHEEMEM_MODELS",
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    );
    cmd
}

fn stderr_of(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "expected failure");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn models_list_names_every_manifest_model() {
    let out = lycheemem().args(["models", "list"]).output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    for name in [
        "all-minilm-l6-v2",
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ] {
        assert!(stdout.contains(name), "{stdout}");
    }
}

#[test]
fn unknown_model_is_one_clear_line() {
    let stderr = stderr_of(lycheemem().args(["models", "fetch", "gpt-17"]));
    assert!(
        stderr.starts_with("error: unknown model \"gpt-17\"; known models: all-minilm-l6-v2"),
        "{stderr}"
    );
}

#[test]
fn bad_flag_combinations_are_rejected() {
    let stderr =
        stderr_of(lycheemem().args(["models", "fetch", "all-minilm-l6-v2", "--source", "dir"]));
    assert!(stderr.contains("--from-dir"), "{stderr}");
    // A private, empty models folder so the fetch has to read the given source.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/manifest.toml"),
        tmp.path().join("manifest.toml"),
    )
    .unwrap();
    let stderr = stderr_of(lycheemem().env("LYCHEEMEM_MODELS", tmp.path()).args([
        "models",
        "fetch",
        "all-minilm-l6-v2",
        "--source",
        "dir",
        "--from-dir",
        "/nonexistent/lycheemem",
    ]));
    assert!(
        stderr.contains("/nonexistent/lycheemem/config.json"),
        "{stderr}"
    );
}

#[test]
fn missing_manifest_gets_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let stderr = stderr_of(
        lycheemem()
            .env("LYCHEEMEM_MODELS", tmp.path())
            .args(["models", "list"]),
    );
    assert!(
        stderr.contains("manifest.toml") && stderr.contains("hint: "),
        "{stderr}"
    );
}

#[test]
fn demo_with_a_missing_local_model_fails_cleanly() {
    let stderr = stderr_of(lycheemem().args(["demo", "--embedder", "dir:/nonexistent/model"]));
    assert!(stderr.contains("not a directory"), "{stderr}");
}
