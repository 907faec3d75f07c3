//! The `lycheemem` binary's success and error paths: user mistakes end in one clear line and a
//! non-zero exit, never a panic.

use assert_cmd::Command;
use std::path::Path;

fn lycheemem() -> Command {
    let mut cmd = Command::cargo_bin("lycheemem").unwrap();
    cmd.env("LYCHEEMEM_MODELS", lycheemem_testkit::models_root());
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
        lycheemem_testkit::models_root().join("manifest.toml"),
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

#[test]
fn device_choices_are_checked_before_any_model_loads() {
    let stderr = stderr_of(lycheemem().args(["demo", "--device", "tpu:0"]));
    assert!(
        stderr.contains("expected auto, cpu, cuda or cuda:N"),
        "{stderr}"
    );
    let stderr = stderr_of(lycheemem().env("LYCHEEMEM_DEVICE", "cuda:x").args([
        "search",
        "--store",
        "/nonexistent/store",
        "anything",
    ]));
    assert!(
        stderr.contains("the CUDA ordinal must be a number"),
        "{stderr}"
    );
    // A build without the feature names the fix instead of failing somewhere in a kernel.
    if !lycheemem::CUDA_SUPPORT {
        let tmp = tempfile::tempdir().unwrap();
        let stderr = stderr_of(
            lycheemem()
                .args(["demo", "--device", "cuda:1", "--store"])
                .arg(tmp.path()),
        );
        assert!(
            stderr.contains("device cuda:1: this binary was built without CUDA support")
                && stderr.contains("--features cuda"),
            "{stderr}"
        );
    }
}

/// A memory command against a store in `dir`, with every LLM purpose served by a fake
/// OpenAI-compatible server (echo encoder, one-route plans, a fixed answer) and real MiniLM.
fn memory_cmd(dir: &Path, url: &str) -> Command {
    memory_cmd_at(&StoreAt::Dir(dir.join("store")), url)
}

/// Where a test's memory lives: a store directory, or a PostgreSQL schema (the location is the
/// connection URL; a config file names the schema).
enum StoreAt {
    Dir(std::path::PathBuf),
    Postgres {
        url: String,
        config: std::path::PathBuf,
    },
}

impl StoreAt {
    /// A fresh schema in the test database (`LYCHEEMEM_TEST_POSTGRES_URL`), configured in a
    /// file under `dir`.
    fn postgres(dir: &Path) -> StoreAt {
        let url = lycheemem_testkit::postgres_test_url();
        let schema = lycheemem_testkit::unique_schema("cli");
        let config = dir.join("postgres.toml");
        std::fs::write(
            &config,
            format!("[store]\npostgres_schema = \"{schema}\"\n"),
        )
        .unwrap();
        StoreAt::Postgres { url, config }
    }
}

fn memory_cmd_at(store: &StoreAt, url: &str) -> Command {
    let mut cmd = lycheemem();
    cmd.env("LYCHEEMEM_LLM", format!("openai:fake@{url}"))
        .env_remove("LYCHEEMEM_NAMESPACE");
    match store {
        StoreAt::Dir(dir) => cmd
            .env("LYCHEEMEM_STORE", dir)
            .env_remove("LYCHEEMEM_CONFIG"),
        StoreAt::Postgres { url, config } => cmd
            .env("LYCHEEMEM_STORE", url)
            .env("LYCHEEMEM_CONFIG", config),
    };
    cmd
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    String::from_utf8(out.stdout).unwrap()
}

const CONVERSATION: &str = r#"{"sessions": [
 {"id": "s1", "date": "2024-03-02", "turns": [
   {"role": "user", "text": "I adopted a beagle called Rex."},
   {"role": "assistant", "text": "Congratulations!"},
   {"role": "user", "text": "I am vegetarian."},
   {"role": "assistant", "text": "Noted."}]},
 {"id": "s2", "date": "2024-04-01", "turns": [
   {"role": "user", "text": "I moved to Lisbon."},
   {"role": "assistant", "text": "Exciting!"}]}]}"#;

#[test]
fn memory_commands_work_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    memory_commands_end_to_end(tmp.path(), &StoreAt::Dir(tmp.path().join("store")));
}

#[test]
fn memory_commands_work_end_to_end_on_postgres() {
    let tmp = tempfile::tempdir().unwrap();
    memory_commands_end_to_end(tmp.path(), &StoreAt::postgres(tmp.path()));
}

/// The evidence a `search --json` shows: target and text of each item, in order (scores left
/// out: pgvector computes cosine with other float rounding than the embedded store).
fn evidence_of(store: &StoreAt, url: &str, ns: &str) -> Vec<(String, String)> {
    let out = stdout_of(memory_cmd_at(store, url).args(["search", "Rex", "--json", "-n", ns]));
    let items: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!(!items.is_empty(), "{out}");
    items
        .iter()
        .map(|i| {
            (
                i["evidence"]["target"].to_string(),
                i["evidence"]["text"].to_string(),
            )
        })
        .collect()
}

/// `migrate` copies a namespace from a store directory into PostgreSQL (loaded without the
/// HNSW indexes, which are built afterwards) and from there into a fresh directory: the same
/// evidence on all three, and the round trip's export equal to the original's line for line.
#[test]
fn migrate_copies_a_namespace_to_postgres_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let url = lycheemem_testkit::fake_openai_server(lycheemem_testkit::pipeline_reply(
        "Rex is a beagle.",
    ));
    let dir = StoreAt::Dir(tmp.path().join("store"));
    let pg = StoreAt::postgres(tmp.path());
    let back = StoreAt::Dir(tmp.path().join("back"));
    let file = tmp.path().join("conv.json");
    std::fs::write(&file, CONVERSATION).unwrap();
    stdout_of(memory_cmd_at(&dir, &url).args(["ingest", file.to_str().unwrap(), "-n", "alice"]));
    let export = |store: &StoreAt, name: &str| {
        let path = tmp.path().join(name);
        stdout_of(memory_cmd_at(store, &url).args([
            "export",
            path.to_str().unwrap(),
            "--vectors",
            "-n",
            "alice",
        ]));
        std::fs::read_to_string(path).unwrap()
    };
    let original = export(&dir, "original.jsonl");
    let StoreAt::Postgres {
        url: pg_url,
        config: pg_config,
    } = &pg
    else {
        unreachable!()
    };
    let out = stdout_of(
        memory_cmd_at(&dir, &url)
            .env("LYCHEEMEM_CONFIG", pg_config)
            .args([
                "migrate",
                "-n",
                "alice",
                "--to",
                pg_url,
                "--rebuild-vector-index",
            ]),
    );
    assert!(
        out.contains("6 turns") && out.contains("6 records"),
        "{out}"
    );
    assert!(out.contains("built the record vector index"), "{out}");
    // A second copy into the same place is refused, and nothing is changed.
    let stderr = stderr_of(
        memory_cmd_at(&dir, &url)
            .env("LYCHEEMEM_CONFIG", pg_config)
            .args(["migrate", "-n", "alice", "--to", pg_url]),
    );
    assert!(stderr.contains("already holds namespace alice"), "{stderr}");
    let StoreAt::Dir(back_dir) = &back else {
        unreachable!()
    };
    let out = stdout_of(memory_cmd_at(&pg, &url).args([
        "migrate",
        "-n",
        "alice",
        "--to",
        back_dir.to_str().unwrap(),
    ]));
    assert!(out.contains("6 records"), "{out}");
    // Exports are compared before any search: a search logs its own planning call (with its
    // own latency) into the store it runs on.
    let round_trip = export(&back, "round-trip.jsonl");
    assert_eq!(original.lines().count(), round_trip.lines().count());
    for (a, b) in original.lines().zip(round_trip.lines()) {
        assert_eq!(a, b);
    }
    let expected = evidence_of(&dir, &url, "alice");
    assert_eq!(evidence_of(&pg, &url, "alice"), expected);
    assert_eq!(evidence_of(&back, &url, "alice"), expected);
    // Index rebuilding is a PostgreSQL load option.
    let stderr = stderr_of(memory_cmd_at(&dir, &url).args([
        "migrate",
        "-n",
        "alice",
        "--to",
        tmp.path().join("third").to_str().unwrap(),
        "--rebuild-vector-index",
    ]));
    assert!(stderr.contains("PostgreSQL destination only"), "{stderr}");
}

/// Ingest, ask, search, inspect, stats, export / import, rederive and deletes through the
/// binary, against the store `store`.
fn memory_commands_end_to_end(tmp: &Path, store: &StoreAt) {
    let url = lycheemem_testkit::fake_openai_server(lycheemem_testkit::pipeline_reply(
        "Rex is a beagle.",
    ));
    let file = tmp.join("conv.json");
    std::fs::write(&file, CONVERSATION).unwrap();
    let out = stdout_of(memory_cmd_at(store, &url).args([
        "ingest",
        file.to_str().unwrap(),
        "-n",
        "alice",
    ]));
    assert!(
        out.contains("ingested 6 turns (6 new, 0 already stored)"),
        "{out}"
    );
    // Running the same file again (by mistake, or after a crash) adds nothing twice, and says
    // so per session.
    let again = memory_cmd_at(store, &url)
        .args(["ingest", file.to_str().unwrap(), "-n", "alice"])
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&again.stdout),
        String::from_utf8_lossy(&again.stderr),
    );
    assert!(again.status.success(), "{err}");
    assert!(out.contains("(0 new, 6 already stored)"), "{out}");
    assert!(
        err.contains("alice/s1: 0 new turns, 4 already stored"),
        "{err}"
    );
    let out =
        stdout_of(memory_cmd_at(store, &url).args(["ask", "What breed is Rex?", "-n", "alice"]));
    assert!(out.starts_with("Rex is a beagle."), "{out}");
    assert!(out.contains("beagle called Rex"), "{out}");
    let out =
        stdout_of(memory_cmd_at(store, &url).args(["search", "Rex", "--explain", "-n", "alice"]));
    assert!(out.contains("final") && out.contains("channels"), "{out}");
    let out = stdout_of(memory_cmd_at(store, &url).args(["inspect", "-n", "alice", "sessions"]));
    assert!(out.contains("s1\t2024-03-02\t4 turns"), "{out}");
    let out =
        stdout_of(memory_cmd_at(store, &url).args(["inspect", "-n", "alice", "segments", "s1"]));
    assert!(out.contains("encoded"), "{out}");
    let records = stdout_of(memory_cmd_at(store, &url).args(["inspect", "-n", "alice", "records"]));
    assert_eq!(records.lines().count(), 6, "{records}");
    // An unknown session is an error, not an empty listing.
    for what in ["turns", "segments"] {
        let out = memory_cmd_at(store, &url)
            .args(["inspect", "-n", "alice", what, "nope"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "inspect {what} nope");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("no session \"nope\""), "{stderr}");
    }
    // A reader that goes away (`| head -1`) ends the listing quietly, without a panic.
    let mut inspect = std::process::Command::new(assert_cmd::cargo::cargo_bin("lycheemem"));
    match store {
        StoreAt::Dir(dir) => inspect
            .env("LYCHEEMEM_STORE", dir)
            .env_remove("LYCHEEMEM_CONFIG"),
        StoreAt::Postgres { url, config } => inspect
            .env("LYCHEEMEM_STORE", url)
            .env("LYCHEEMEM_CONFIG", config),
    };
    let mut child = inspect
        .env("LYCHEEMEM_MODELS", lycheemem_testkit::models_root())
        .env_remove("LYCHEEMEM_NAMESPACE")
        .args(["inspect", "-n", "alice", "records"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stdout_of(
        memory_cmd_at(store, &url).args(["stats", "--json", "-n", "alice"]),
    ))
    .unwrap();
    assert_eq!(stats["records"], 6);
    let export = tmp.join("alice.jsonl");
    stdout_of(memory_cmd_at(store, &url).args(["export", export.to_str().unwrap(), "-n", "alice"]));
    let out = stdout_of(memory_cmd_at(store, &url).args([
        "import",
        export.to_str().unwrap(),
        "-n",
        "alice-copy",
    ]));
    assert!(out.contains("\"records\": 6"), "{out}");
    // A truncated export (cut at a line end, so every line parses) is refused whole.
    let text = std::fs::read_to_string(&export).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let cut = tmp.join("cut.jsonl");
    std::fs::write(&cut, lines[..lines.len() / 2].join("\n") + "\n").unwrap();
    let stderr = stderr_of(memory_cmd_at(store, &url).args([
        "import",
        cut.to_str().unwrap(),
        "-n",
        "alice-cut",
    ]));
    assert!(stderr.contains("truncated"), "{stderr}");
    let stderr = stderr_of(memory_cmd_at(store, &url).args(["stats", "-n", "alice-cut"]));
    assert!(
        stderr.contains("has no memory"),
        "nothing was imported: {stderr}"
    );
    let out = stdout_of(memory_cmd_at(store, &url).args(["rederive", "-n", "alice"]));
    assert!(out.contains("0 added, 0 removed"), "{out}");
    let id = records.split('\t').next().unwrap();
    let out = stdout_of(memory_cmd_at(store, &url).args(["delete", "-n", "alice", "record", id]));
    assert!(out.contains("\"records\": 1"), "{out}");
    let stderr = stderr_of(memory_cmd_at(store, &url).args(["delete", "-n", "alice", "namespace"]));
    assert!(stderr.contains("--yes"), "{stderr}");
    stdout_of(memory_cmd_at(store, &url).args(["delete", "-n", "alice", "namespace", "--yes"]));
}

#[test]
fn ingest_exits_non_zero_when_segments_fail_to_encode_and_keeps_the_turns() {
    let tmp = tempfile::tempdir().unwrap();
    // An encoder that never answers with records: every segment fails.
    let url = lycheemem_testkit::fake_openai_server(|_, _| "I cannot do that.".to_string());
    let file = tmp.path().join("conv.json");
    std::fs::write(&file, CONVERSATION).unwrap();
    let out = memory_cmd(tmp.path(), &url)
        .args(["ingest", file.to_str().unwrap(), "-n", "erin"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("segments failed to encode"), "{stderr}");
    assert!(stderr.contains("erin/s1: 4 new turns"), "{stderr}");
    // The turns are stored, and the failures are visible.
    let sessions =
        stdout_of(memory_cmd(tmp.path(), &url).args(["inspect", "-n", "erin", "sessions"]));
    assert!(sessions.contains("s1\t2024-03-02\t4 turns"), "{sessions}");
    let segments =
        stdout_of(memory_cmd(tmp.path(), &url).args(["inspect", "-n", "erin", "segments", "s1"]));
    assert!(segments.contains("FAILED"), "{segments}");
}

#[test]
fn memory_command_mistakes_are_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let url = lycheemem_testkit::fake_openai_server(lycheemem_testkit::pipeline_reply("x"));
    // Unknown namespace.
    let file = tmp.path().join("conv.json");
    std::fs::write(&file, CONVERSATION).unwrap();
    stdout_of(memory_cmd(tmp.path(), &url).args(["ingest", file.to_str().unwrap()]));
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args(["ask", "anything?", "-n", "nobody"]));
    assert!(
        stderr.contains("has no memory") && stderr.contains("hint:"),
        "{stderr}"
    );
    // Malformed input files.
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "{\"sessions\": [").unwrap();
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args([
        "ingest",
        bad.to_str().unwrap(),
        "--format",
        "lycheemem",
    ]));
    assert!(stderr.contains("not valid JSON"), "{stderr}");
    std::fs::write(&bad, [0xff, 0xfe, b'{']).unwrap();
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args(["ingest", bad.to_str().unwrap()]));
    assert!(stderr.contains("not valid UTF-8"), "{stderr}");
    // Bad config.
    let cfg = tmp.path().join("bad.toml");
    std::fs::write(&cfg, "[segment]\ncut_treshold = 0.6\n").unwrap();
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args([
        "ask",
        "q?",
        "--config",
        cfg.to_str().unwrap(),
    ]));
    assert!(
        stderr.contains("invalid configuration") || stderr.contains("cut_treshold"),
        "{stderr}"
    );
    // Missing model.
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args([
        "ask",
        "q?",
        "--embedder",
        "no-such-embedder",
    ]));
    assert!(stderr.contains("no-such-embedder"), "{stderr}");
    // No store at all.
    let stderr = stderr_of(memory_cmd(&tmp.path().join("elsewhere"), &url).args(["stats"]));
    assert!(
        stderr.contains("no store") && stderr.contains("hint: check --store"),
        "{stderr}"
    );
    // A store another process holds: the hint comes from the error's kind.
    let held = lycheemem::Memory::open_store(
        tmp.path().join("store"),
        &lycheemem::core::Config::default(),
    )
    .unwrap();
    let stderr = stderr_of(memory_cmd(tmp.path(), &url).args(["stats"]));
    assert!(
        stderr.contains("already open in another process")
            && stderr.contains("hint: another lycheemem process uses this store"),
        "{stderr}"
    );
    drop(held);
}

#[test]
fn demo_runs_to_completion_with_a_small_model() {
    // The README's main job, with SmolLM2-135M instead of the default Qwen 0.5B to keep CI fast.
    let tmp = tempfile::tempdir().unwrap();
    let out = lycheemem()
        .args([
            "demo",
            "--llm",
            "local:smollm2-135m-instruct",
            "--store",
            tmp.path().join("demo").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("\nQ (").count(), 5, "{stdout}");
    assert_eq!(stdout.matches("\nreceipt: ").count(), 5, "{stdout}");
    assert!(stdout.contains("construction: "), "{stdout}");
}

#[test]
fn api_keys_are_created_listed_and_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let key = stdout_of(
        lycheemem()
            .args(["keys", "add", "--namespace", "alice", "--keys"])
            .arg(&keys),
    );
    let key = key.trim();
    assert!(key.starts_with("lmk_") && key.len() > 30, "{key}");
    let stored = std::fs::read_to_string(&keys).unwrap();
    assert!(!stored.contains(key), "only the hash is stored");
    let list = stdout_of(lycheemem().args(["keys", "list", "--keys"]).arg(&keys));
    assert!(list.contains("alice"), "{list}");
    let id = list.split('\t').next().unwrap().to_string();
    stdout_of(
        lycheemem()
            .args(["keys", "revoke", &id, "--keys"])
            .arg(&keys),
    );
    assert!(!stdout_of(lycheemem().args(["keys", "list", "--keys"]).arg(&keys)).contains("alice"));
    let err = stderr_of(
        lycheemem()
            .args(["keys", "revoke", &id, "--keys"])
            .arg(&keys),
    );
    assert!(err.contains("no key"), "{err}");
    let err = stderr_of(
        lycheemem()
            .args(["keys", "add", "--namespace", ".bad", "--keys"])
            .arg(&keys),
    );
    assert!(err.lines().count() <= 2, "{err}");
}

#[test]
fn serve_refuses_a_public_address_unless_allowed() {
    let err = stderr_of(lycheemem().args(["serve", "--bind", "0.0.0.0:7411"]));
    assert!(err.contains("--allow-remote"), "{err}");
}

/// The real `lycheemem mcp` over stdio, spoken to line by line: the handshake, a tool listing,
/// a line that is not JSON (answered with the JSON-RPC parse error, and the session goes on),
/// well-formed JSON that is not a message (-32600), an add and a search.
#[test]
fn mcp_over_stdio_answers_tools_and_parse_errors() {
    use std::io::{BufRead, BufReader, Write};
    let tmp = tempfile::tempdir().unwrap();
    let url = lycheemem_testkit::fake_openai_server(lycheemem_testkit::pipeline_reply("x"));
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("lycheemem"))
        .env("LYCHEEMEM_MODELS", lycheemem_testkit::models_root())
        .env("LYCHEEMEM_STORE", tmp.path().join("store"))
        .env("LYCHEEMEM_LLM", format!("openai:fake@{url}"))
        .env_remove("LYCHEEMEM_NAMESPACE")
        .env_remove("LYCHEEMEM_CONFIG")
        .args(["mcp", "-n", "stdio"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut replies = BufReader::new(child.stdout.take().unwrap()).lines();
    // Owns stdin: dropping it closes the session.
    let mut send = move |line: &str| {
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    };
    let mut next = || -> serde_json::Value {
        let line = replies.next().expect("a reply line").unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    };
    send(
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#,
    );
    let init = next();
    assert_eq!(init["id"], 1, "{init}");
    assert!(
        init["result"]["capabilities"]["tools"].is_object(),
        "{init}"
    );
    send(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    send("this is not json {");
    let parse_error = next();
    assert_eq!(parse_error["error"]["code"], -32700, "{parse_error}");
    assert!(parse_error["id"].is_null(), "{parse_error}");
    // A line longer than the transport holds (16 MiB) is answered the same way, and the
    // session goes on.
    send(&"x".repeat((16 << 20) + 1));
    let too_long = next();
    assert_eq!(too_long["error"]["code"], -32700, "{too_long}");
    assert!(too_long.to_string().contains("limited to"), "{too_long}");
    // A line of exactly the limit is read whole (here: not JSON), and the next line, answered
    // below, is not lost.
    send(&"x".repeat(16 << 20));
    let at_limit = next();
    assert_eq!(at_limit["error"]["code"], -32700, "{at_limit}");
    assert!(!at_limit.to_string().contains("limited to"), "{at_limit}");
    send(r#"{"hello": "world"}"#);
    let invalid = next();
    assert_eq!(invalid["error"]["code"], -32600, "{invalid}");
    send(r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#);
    let tools = next();
    assert_eq!(tools["id"], 2, "{tools}");
    assert_eq!(
        tools["result"]["tools"].as_array().unwrap().len(),
        5,
        "{tools}"
    );
    send(
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"memory_add","arguments":{"session":"s","date":"2024-05-01","turns":[{"text":"I play the cello every Sunday."},{"role":"assistant","text":"Nice."}]}}}"#,
    );
    let added = next();
    assert_eq!(added["id"], 3, "{added}");
    assert_ne!(added["result"]["isError"], true, "{added}");
    send(
        r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"memory_search","arguments":{"question":"What instrument do I play?"}}}"#,
    );
    let found = next();
    assert_eq!(found["id"], 4, "{found}");
    assert!(found.to_string().contains("cello"), "{found}");
    // The HTTP API's limits hold over stdio too.
    send(
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"memory_search","arguments":{"question":"What instrument do I play?","top_k":101}}}"#,
    );
    let refused = next();
    assert_eq!(refused["id"], 5, "{refused}");
    assert_eq!(refused["result"]["isError"], true, "{refused}");
    assert!(refused.to_string().contains("top_k"), "{refused}");
    drop(send);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
