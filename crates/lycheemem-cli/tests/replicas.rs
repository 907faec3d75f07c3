//! Scale-out under failure: two `lycheemem serve` replicas on one PostgreSQL store, 16 clients
//! on loopback sending turns (idempotent appends with `first_index`, retried on the other
//! replica when one fails) and searches for a while; halfway through one replica is SIGKILLed
//! and started again. Afterwards every acknowledged turn is stored exactly once and in order,
//! every turn lies in exactly one encoded segment, and no search returned evidence from another
//! namespace. `LYCHEEMEM_REPLICA_TEST_SECS` sets the duration (default 20 s); the test prints a
//! summary line. Needs `LYCHEEMEM_TEST_POSTGRES_URL`; the LLM is an in-process fake
//! OpenAI-compatible server, the embedder real MiniLM.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;
const NAMESPACES: usize = 4;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Setup {
    store_url: String,
    config: PathBuf,
    llm: String,
    logs: PathBuf,
}

fn lycheemem_cmd(setup: &Setup) -> Command {
    let mut cmd = Command::new(assert_cmd::cargo::cargo_bin("lycheemem"));
    cmd.env("LYCHEEMEM_MODELS", lycheemem_testkit::models_root())
        .env("LYCHEEMEM_STORE", &setup.store_url)
        .env("LYCHEEMEM_CONFIG", &setup.config)
        .env("LYCHEEMEM_LLM", &setup.llm)
        .env_remove("LYCHEEMEM_NAMESPACE");
    cmd
}

fn start_replica(setup: &Setup, port: u16, name: &str) -> Child {
    let log = std::fs::File::create(setup.logs.join(format!("{name}.log"))).unwrap();
    let child = lycheemem_cmd(setup)
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .args([
            "--sweep-secs",
            "2",
            "--encode-workers",
            "2",
            "--drain-secs",
            "5",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let http = reqwest::blocking::Client::new();
    let started = Instant::now();
    while http
        .get(format!("http://127.0.0.1:{port}/health"))
        .send()
        .is_err()
    {
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "replica {name} did not come up; see {}",
            setup.logs.join(format!("{name}.log")).display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    child
}

/// What one client saw.
struct ClientLog {
    ns: usize,
    session: String,
    acked: Vec<String>,
    searches: usize,
    foreign_evidence: usize,
    retries: usize,
}

/// A client's run; `Err` says what it could not get done and what the replicas last answered.
fn client(c: usize, key: &str, ports: [u16; 2], deadline: Instant) -> Result<ClientLog, String> {
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let ns = c % NAMESPACES;
    let session = format!("n{ns}-c{c}");
    let mut log = ClientLog {
        ns,
        session: session.clone(),
        acked: Vec::new(),
        searches: 0,
        foreign_evidence: 0,
        retries: 0,
    };
    let topics = [
        "the garden",
        "Lisbon",
        "cello lessons",
        "a new job",
        "the marathon",
    ];
    let mut i = 0usize;
    while Instant::now() < deadline {
        let topic = topics[(c + i) % topics.len()];
        let turns = [
            format!("client {c} turn {i}: I keep thinking about {topic}"),
            format!("noted, client {c}, turn {i} on {topic}"),
        ];
        let body = json!({
            "date": "2024-05-01",
            "first_index": log.acked.len(),
            "turns": [{"role": "user", "text": turns[0]}, {"role": "assistant", "text": turns[1]}],
        });
        // Until some replica acknowledges it (the same request is safe to repeat).
        let mut attempt = 0usize;
        let first_try = Instant::now();
        loop {
            let port = ports[(c + attempt) % 2];
            let url = format!("http://127.0.0.1:{port}/v1/sessions/{session}/turns");
            let last = match http.post(&url).bearer_auth(key).json(&body).send() {
                Ok(r) if r.status().as_u16() == 202 => break,
                Ok(r) if r.status().is_server_error() || r.status().as_u16() == 429 => {
                    format!("{}: {}", r.status(), r.text().unwrap_or_default())
                }
                Ok(r) => {
                    return Err(format!(
                        "client {c}: {} {}",
                        r.status(),
                        r.text().unwrap_or_default()
                    ));
                }
                Err(e) => e.to_string(),
            };
            attempt += 1;
            log.retries += 1;
            if first_try.elapsed() > Duration::from_secs(90) {
                return Err(format!(
                    "client {c}: no replica accepted turn {i} in 90 s ({attempt} tries); the \
                     last answer (port {port}): {last}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        log.acked.extend(turns);
        if i % 4 == 3 {
            let port = ports[(c + i) % 2];
            let question = json!({"question": format!("What did I say about {topic}?")});
            if let Ok(r) = http
                .post(format!("http://127.0.0.1:{port}/v1/search"))
                .bearer_auth(key)
                .json(&question)
                .send()
                && r.status().is_success()
            {
                let found: Value = r.json().unwrap();
                log.searches += 1;
                for e in found["evidence"].as_array().into_iter().flatten() {
                    let s = e["session"].as_str().unwrap_or("");
                    if !s.starts_with(&format!("n{ns}-")) {
                        log.foreign_evidence += 1;
                    }
                }
            }
        }
        i += 1;
    }
    Ok(log)
}

/// The last lines of each replica's log, for a failure message.
fn log_tails(dir: &Path) -> String {
    let mut out = String::new();
    for name in ["a", "b", "a-restarted"] {
        let text = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!("--- replica {name} (last 15 lines)\n"));
        for line in &lines[lines.len().saturating_sub(15)..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn replicas_on_one_postgres_store_survive_a_killed_replica() {
    let secs: u64 = std::env::var("LYCHEEMEM_REPLICA_TEST_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let tmp = tempfile::tempdir().unwrap();
    let schema = lycheemem_testkit::unique_schema("replicas");
    let config = tmp.path().join("config.toml");
    std::fs::write(
        &config,
        format!("[store]\npostgres_schema = \"{schema}\"\n"),
    )
    .unwrap();
    let fake = lycheemem_testkit::fake_openai_server(lycheemem_testkit::pipeline_reply("ok"));
    let setup = Setup {
        store_url: lycheemem_testkit::postgres_test_url(),
        config,
        llm: format!("openai:fake@{fake}"),
        logs: tmp.path().to_path_buf(),
    };
    let ports = [free_port(), free_port()];
    // The first replica creates the store; the keys go into the store (no key file), where the
    // running replica and the one started next both read them.
    let mut a = start_replica(&setup, ports[0], "a");
    let keys: Vec<String> = (0..NAMESPACES)
        .map(|n| {
            let out = lycheemem_cmd(&setup)
                .args(["keys", "add", "--namespace", &format!("team{n}")])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        })
        .collect();
    let mut b = start_replica(&setup, ports[1], "b");
    // A running replica looks at the store's keys at most once a second.
    std::thread::sleep(Duration::from_millis(1500));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let (logs, killed_at) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let key = keys[c % NAMESPACES].clone();
                s.spawn(move || client(c, &key, ports, deadline))
            })
            .collect();
        std::thread::sleep(Duration::from_secs(secs / 2));
        a.kill().unwrap(); // SIGKILL
        a.wait().unwrap();
        let killed_at = started.elapsed();
        a = start_replica(&setup, ports[0], "a-restarted");
        let logs: Vec<Result<ClientLog, String>> =
            clients.into_iter().map(|h| h.join().unwrap()).collect();
        (logs, killed_at)
    });
    let failures: Vec<&String> = logs.iter().filter_map(|l| l.as_ref().err()).collect();
    if !failures.is_empty() {
        let _ = a.kill();
        let _ = b.kill();
        panic!(
            "{} of {CLIENTS} clients failed, first: {}\n{}",
            failures.len(),
            failures[0],
            log_tails(&setup.logs)
        );
    }
    let logs: Vec<ClientLog> = logs.into_iter().map(Result::unwrap).collect();
    // Close every session (its last segment encoded) through the surviving replica.
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    for log in &logs {
        let r = http
            .post(format!(
                "http://127.0.0.1:{}/v1/sessions/{}/flush",
                ports[1], log.session
            ))
            .bearer_auth(&keys[log.ns])
            .send()
            .unwrap();
        assert!(
            r.status().is_success(),
            "flush {}: {}",
            log.session,
            r.status()
        );
    }
    let _ = a.kill();
    let _ = b.kill();
    let _ = a.wait();
    let _ = b.wait();

    let cfg = lycheemem_core::Config::from_toml_file(&setup.config).unwrap();
    let store = lycheemem::Memory::open_store(Path::new(&setup.store_url), &cfg).unwrap();
    let (mut turns, mut segments, mut records) = (0usize, 0usize, 0usize);
    for log in &logs {
        let ns = lycheemem_core::Namespace::new(format!("team{}", log.ns)).unwrap();
        let sid = lycheemem_core::SessionId::new(log.session.clone()).unwrap();
        let stored: Vec<String> = store
            .turns(&ns, &sid)
            .unwrap()
            .into_iter()
            .map(|t| t.text)
            .collect();
        assert_eq!(
            stored, log.acked,
            "{}: stored turns differ from the acknowledged ones",
            log.session
        );
        let mut next = 0u32;
        for row in store.segments(&ns, &sid).unwrap() {
            assert_eq!(
                row.segment.first_turn, next,
                "{}: a gap or an overlap",
                log.session
            );
            assert!(matches!(
                row.outcome,
                lycheemem::store::SegmentOutcome::Encoded
            ));
            next = row.segment.last_turn + 1;
            segments += 1;
        }
        assert_eq!(
            next as usize,
            stored.len(),
            "{}: not fully segmented",
            log.session
        );
        records += store
            .records_page(&ns, Some(&sid), 0, usize::MAX)
            .unwrap()
            .0;
        turns += stored.len();
    }
    let searches: usize = logs.iter().map(|l| l.searches).sum();
    let foreign: usize = logs.iter().map(|l| l.foreign_evidence).sum();
    let retries: usize = logs.iter().map(|l| l.retries).sum();
    println!(
        "replicas: {secs} s, {CLIENTS} clients, replica a killed at {:.1} s and restarted; \
         {turns} turns acknowledged and stored (0 lost, 0 doubled), {segments} segments (each \
         once), {records} records, {searches} searches, {foreign} foreign evidence items, \
         {retries} retried requests",
        killed_at.as_secs_f64()
    );
    assert_eq!(foreign, 0, "a search returned another namespace's evidence");
    assert!(searches > 0);
    // The echo encoder states one record per turn: every turn was encoded.
    assert_eq!(records, turns);
}
