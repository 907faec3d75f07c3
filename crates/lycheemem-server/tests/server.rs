//! The server over real loopback HTTP with a real client (reqwest) and the MCP SDK's client:
//! happy paths, authentication, namespace isolation, malformed input, backpressure, shutdown
//! during ingestion, and MCP tool calls over streamable HTTP and stdio. Models are doubles
//! (scripted LLM, bag-of-words embedder); everything else is real.

use lycheemem::{Components, Memory, NewTurn};
use lycheemem_bench::synthetic::rss_mib;
use lycheemem_core::{Config, Namespace, SessionId};
use lycheemem_server::keys::KeyStore;
use lycheemem_server::{ServerConfig, serve_listener};
use lycheemem_testkit::{HashEmbedder, ScriptedLlm, echo_encoder_reply};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Holds encoder calls while closed.
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    cv: Condvar,
    /// Encoder calls held at the gate right now.
    waiting: AtomicUsize,
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.cv.notify_all();
    }
    fn wait(&self) {
        let mut closed = self.closed.lock().unwrap();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while *closed {
            closed = self.cv.wait(closed).unwrap();
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Polls `done` every 20 ms for up to 30 s (events, not fixed sleeps, so a slow machine
/// cannot reorder the test's steps).
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

fn memory(dir: &std::path::Path, gate: Arc<Gate>) -> Arc<Memory> {
    let llm = Arc::new(ScriptedLlm::responding(move |m| {
        let system = m.first().map_or("", |m| m.content.as_str());
        let user = m.last().map_or("", |m| m.content.as_str());
        if user.contains("Segment turns:") {
            gate.wait();
            echo_encoder_reply(user)
        } else if system.contains("You plan memory retrieval") {
            r#"{"question_type": "single", "semantic_queries": [], "temporal_filter": null, "routes": [{"route_id": "r1", "goal": "find it", "queries": [], "constraints": [], "temporal_filter": null}]}"#.into()
        } else {
            "Your cat is called Miso.".into()
        }
    }));
    let components = Components::with_llm(Arc::new(HashEmbedder::new(64)), llm);
    Arc::new(Memory::with_components(dir, Config::default(), components).unwrap())
}

fn keys() -> KeyStore {
    let mut k = KeyStore::in_memory();
    k.insert_key("key-alice", &Namespace::new("alice").unwrap());
    k.insert_key("key-bob", &Namespace::new("bob").unwrap());
    k
}

struct Running {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle.await.unwrap().unwrap();
    }
}

async fn start(memory: Arc<Memory>, cfg: ServerConfig) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(serve_listener(listener, memory, keys(), cfg, async {
        let _ = rx.await;
    }));
    Running {
        base,
        stop: Some(tx),
        handle,
    }
}

fn turns() -> Value {
    json!({"date": "2024-05-01", "turns": [
        {"role": "user", "text": "I adopted a tabby cat named Miso last week."},
        {"role": "assistant", "text": "Congratulations on adopting Miso!"},
        {"role": "user", "text": "I also started learning the cello."},
        {"role": "assistant", "text": "The cello is a wonderful instrument."}
    ]})
}

async fn code_of(resp: reqwest::Response) -> (u16, String) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_string(),
    )
}

/// A client for one server.
struct Api {
    c: reqwest::Client,
    base: String,
}

impl Api {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut r = self.c.request(method, format!("{}{path}", self.base));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        if let Some(b) = body {
            r = r.json(&b);
        }
        r.send().await.unwrap()
    }
    async fn get(&self, path: &str, key: &str) -> reqwest::Response {
        self.send(reqwest::Method::GET, path, Some(key), None).await
    }
    async fn get_json(&self, path: &str, key: &str) -> Value {
        self.get(path, key).await.json().await.unwrap()
    }
    async fn post(&self, path: &str, key: &str, body: Value) -> reqwest::Response {
        self.send(reqwest::Method::POST, path, Some(key), Some(body))
            .await
    }
    async fn delete(&self, path: &str, key: &str) -> reqwest::Response {
        self.send(reqwest::Method::DELETE, path, Some(key), None)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_happy_paths_auth_isolation_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let cfg = ServerConfig {
        max_body_bytes: 64 * 1024,
        ..ServerConfig::default()
    };
    let server = start(memory(dir.path(), gate), cfg).await;
    let api = Api {
        // A fresh connection per request: the server closes a connection after refusing an
        // oversized body unread, and a pooled client could reuse it (IncompleteMessage).
        c: reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap(),
        base: server.base.clone(),
    };
    const A: &str = "key-alice";
    const B: &str = "key-bob";

    // Public routes.
    let health = api.send(reqwest::Method::GET, "/health", None, None).await;
    assert_eq!(health.status(), 200);
    let doc: Value = api
        .send(reqwest::Method::GET, "/openapi.json", None, None)
        .await
        .json()
        .await
        .unwrap();
    for p in [
        "/v1/search",
        "/v1/answer",
        "/v1/sessions/{session}/turns",
        "/v1/records/{id}",
    ] {
        assert!(doc["paths"][p].is_object(), "{p} missing from OpenAPI");
    }

    // Authentication.
    let r = api
        .send(reqwest::Method::GET, "/v1/stats", None, None)
        .await;
    assert_eq!(code_of(r).await, (401, "unauthorized".into()));
    assert_eq!(
        code_of(api.get("/v1/stats", "wrong").await).await,
        (401, "unauthorized".into())
    );
    // The scheme name is case-insensitive; another scheme is not a key.
    // (Alice has stored nothing yet, so an accepted key gets 404 "no memory", not 401.)
    for (header, status) in [
        ("bearer key-alice", 404),
        ("BEARER   key-alice", 404),
        ("Basic key-alice", 401),
        ("Bearer", 401),
    ] {
        let r = api
            .c
            .get(format!("{}/v1/stats", api.base))
            .header("authorization", header)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{header}");
    }
    // A wrong method gets the JSON error format like every other error.
    let r = api
        .c
        .put(format!("{}/health", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(code_of(r).await, (405, "method_not_allowed".into()));

    // Alice stores, flushes, searches, answers.
    let r = api.post("/v1/sessions/s1/turns", A, turns()).await;
    assert_eq!(r.status(), 202);
    let added: Value = r.json().await.unwrap();
    assert_eq!(added["stored"], 4);
    let r = api
        .c
        .post(format!("{}/v1/sessions/s1/flush", api.base))
        .header("x-api-key", A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let receipt: Value = r.json().await.unwrap();
    assert!(receipt["records"].as_u64().unwrap() >= 2, "{receipt}");
    let question = json!({"question": "What is my cat called?", "date": "2024-06-01"});
    let r = api.post("/v1/search", A, question.clone()).await;
    assert_eq!(r.status(), 200);
    let found: Value = r.json().await.unwrap();
    let evidence = found["evidence"].as_array().unwrap();
    assert!(
        evidence
            .iter()
            .any(|e| e["evidence"]["text"].as_str().unwrap().contains("Miso")),
        "{found}"
    );
    let a: Value = api
        .post("/v1/answer", A, question.clone())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(a["answer"], "Your cat is called Miso.");
    assert!(a["tokens"].as_u64().unwrap() > 0);
    let page = api.get_json("/v1/records?session=s1&limit=1", A).await;
    assert!(page["total"].as_u64().unwrap() >= 2);
    assert_eq!(page["records"].as_array().unwrap().len(), 1);
    let record_id = page["records"][0]["record_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        api.get(&format!("/v1/records/{record_id}"), A)
            .await
            .status(),
        200
    );
    assert_eq!(
        api.get_json("/v1/sessions", A)
            .await
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let detail = api.get_json("/v1/sessions/s1", A).await;
    assert!(!detail["segments"].as_array().unwrap().is_empty());
    let stats = api.get_json("/v1/stats", A).await;
    assert_eq!(stats["turns"], 4);
    let usage = api.get_json("/v1/usage", A).await;
    assert!(usage["by_purpose"]["encode"].is_object(), "{usage}");
    let export = api.get("/v1/export", A).await.text().await.unwrap();
    assert!(export.lines().count() > 5);

    // Bob sees none of it and cannot touch it.
    let r = api.post("/v1/search", B, question.clone()).await;
    assert_eq!(code_of(r).await, (404, "not_found".into()));
    let record = format!("/v1/records/{record_id}");
    assert_eq!(api.get(&record, B).await.status(), 404);
    assert_eq!(api.delete(&record, B).await.status(), 404);
    assert_eq!(api.get("/v1/sessions/s1", B).await.status(), 404);
    assert_eq!(api.delete("/v1/sessions/s1", B).await.status(), 404);
    assert_eq!(api.get_json("/v1/records", B).await["total"], 0);
    assert_eq!(
        api.get_json("/v1/stats", A).await,
        stats,
        "Bob's attempts changed nothing"
    );

    // Bad input: typed errors, nothing stored.
    let post = |body: reqwest::Body, ct: Option<&str>| {
        let mut r = api
            .c
            .post(format!("{}/v1/sessions/s2/turns", api.base))
            .bearer_auth(A)
            .body(body);
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        r.send()
    };
    let json_ct = Some("application/json");
    let huge = json!({"turns": [{"text": "x".repeat(100_000)}]}).to_string();
    let cases: Vec<(Vec<u8>, Option<&str>, u16, &str)> = vec![
        (b"{not json".to_vec(), json_ct, 400, "invalid_json"),
        (
            vec![b'{', b'"', 0xff, 0xfe, b'"', b'}'],
            json_ct,
            400,
            "invalid_json",
        ),
        (
            br#"{"turns": [{"text": "hi"}], "colour": "red"}"#.to_vec(),
            json_ct,
            400,
            "invalid_body",
        ),
        (
            br#"{"turns": [{"text": "hi", "role": "robot"}]}"#.to_vec(),
            json_ct,
            400,
            "invalid_input",
        ),
        (br#"{"turns": []}"#.to_vec(), json_ct, 400, "invalid_input"),
        (
            br#"{"date": "someday", "turns": [{"text": "hi"}]}"#.to_vec(),
            json_ct,
            400,
            "invalid_input",
        ),
        (
            br#"{"turns": [{"text": "hi"}]}"#.to_vec(),
            None,
            415,
            "unsupported_media_type",
        ),
        (huge.into_bytes(), json_ct, 413, "payload_too_large"),
    ];
    for (body, ct, status, code) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).to_string();
        let got = code_of(post(body.into(), ct).await.unwrap()).await;
        assert_eq!(got, (status, code.to_string()), "{shown}");
    }
    let r = api.post("/v1/search", A, json!({"question": "  "})).await;
    assert_eq!(code_of(r).await, (400, "invalid_input".into()));
    let r = api
        .post("/v1/search", A, json!({"question": "x", "top_k": 100000}))
        .await;
    assert_eq!(code_of(r).await, (400, "invalid_input".into()));
    assert_eq!(
        code_of(api.delete("/v1/namespace", A).await).await,
        (400, "invalid_input".into())
    );
    assert_eq!(api.get("/v1/nope", A).await.status(), 404);
    let big_mcp = api
        .c
        .post(format!("{}/mcp", api.base))
        .bearer_auth(A)
        .header("content-type", "application/json")
        .body(vec![b' '; 100_000])
        .send()
        .await
        .unwrap();
    assert_eq!(
        big_mcp.status(),
        413,
        "the MCP endpoint has the same body limit"
    );
    assert_eq!(
        api.get_json("/v1/stats", A).await["turns"],
        4,
        "rejected requests stored nothing"
    );

    // Metrics count what happened.
    let m = api
        .send(reqwest::Method::GET, "/metrics", None, None)
        .await
        .text()
        .await
        .unwrap();
    assert!(m.contains("route=\"/v1/search\",status=\"200\""), "{m}");
    assert!(m.contains("lycheemem_turns_stored_total 4"), "{m}");

    // Deletes work for the owner.
    assert_eq!(
        api.delete("/v1/namespace?confirm=true", A).await.status(),
        200
    );
    assert_eq!(api.get("/v1/stats", A).await.status(), 404);
    server.stop().await;
}

/// A server over a fresh memory whose encoder calls wait at the returned gate while it is closed.
async fn gated_server(cfg: ServerConfig) -> (tempfile::TempDir, Arc<Gate>, Arc<Memory>, Running) {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let mem = memory(dir.path(), gate.clone());
    let server = start(mem.clone(), cfg).await;
    (dir, gate, mem, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_turns_before_storing_them_and_a_session_waits_once() {
    let (_dir, gate, mem, server) = gated_server(ServerConfig {
        queue_capacity: 1,
        encode_workers: 1,
        ..ServerConfig::default()
    })
    .await;
    let c = reqwest::Client::new();
    let url = |p: &str| format!("{}{p}", server.base);
    let add = |session: &str| {
        c.post(url(&format!("/v1/sessions/{session}/turns")))
            .bearer_auth("key-alice")
            .json(&turns())
            .send()
    };
    let ns = Namespace::new("alice").unwrap();
    assert_eq!(add("s1").await.unwrap().status(), 202);
    // Wait until the worker has processed s1, then hold the encoder and flush: the worker is
    // busy inside the LLM call with an empty queue.
    wait_until("the worker processed s1", || {
        mem.unprocessed_sessions(&ns).unwrap().is_empty()
    })
    .await;
    gate.set(true);
    let flush = tokio::spawn({
        let c = c.clone();
        let u = url("/v1/sessions/s1/flush");
        async move {
            c.post(u)
                .bearer_auth("key-alice")
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    wait_until("the flush is held inside the encoder", || {
        gate.waiting.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(add("s2").await.unwrap().status(), 202, "fills the one slot");
    // More turns for s2 ride on its waiting job instead of needing a slot of their own.
    for _ in 0..3 {
        assert_eq!(
            add("s2").await.unwrap().status(),
            202,
            "s2's job already waits"
        );
    }
    let r = add("s3").await.unwrap();
    assert_eq!(code_of(r).await, (429, "queue_full".into()));
    assert!(
        mem.store()
            .session(&ns, &SessionId::new("s3").unwrap())
            .unwrap()
            .is_none(),
        "a refused request stores nothing"
    );
    gate.set(false);
    assert_eq!(flush.await.unwrap(), 200);
    server.stop().await;
    assert!(mem.unprocessed_sessions(&ns).unwrap().is_empty());
}

/// A session held inside the encoder ties up one worker, not all: more turns for it are folded
/// into that worker's run, and another session's flush is served by the second worker meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_session_ties_up_one_worker() {
    let (_dir, gate, mem, server) = gated_server(ServerConfig {
        encode_workers: 2,
        ..ServerConfig::default()
    })
    .await;
    let ns = Namespace::new("alice").unwrap();
    let c = reqwest::Client::new();
    let post = |path: String, body: Option<Value>| {
        let mut r = c
            .post(format!("{}{path}", server.base))
            .bearer_auth("key-alice");
        if let Some(b) = body {
            r = r.json(&b);
        }
        tokio::spawn(async move { r.send().await.unwrap().status().as_u16() })
    };
    gate.set(true);
    let s1 = post("/v1/sessions/s1/turns".into(), Some(turns()));
    assert_eq!(s1.await.unwrap(), 202);
    let flush1 = post("/v1/sessions/s1/flush".into(), None);
    wait_until("s1's flush is held inside the encoder", || {
        gate.waiting.load(Ordering::SeqCst) == 1
    })
    .await;
    for _ in 0..3 {
        let more = post("/v1/sessions/s1/turns".into(), Some(turns()));
        assert_eq!(more.await.unwrap(), 202);
    }
    let s2 = post("/v1/sessions/s2/turns".into(), Some(turns()));
    assert_eq!(s2.await.unwrap(), 202);
    let flush2 = post("/v1/sessions/s2/flush".into(), None);
    wait_until("s2's flush reaches the encoder beside s1's", || {
        gate.waiting.load(Ordering::SeqCst) == 2
    })
    .await;
    gate.set(false);
    assert_eq!(flush1.await.unwrap(), 200);
    assert_eq!(flush2.await.unwrap(), 200);
    wait_until("the folded turns of s1 are processed", || {
        mem.unprocessed_sessions(&ns).unwrap().is_empty()
    })
    .await;
    assert_eq!(mem.stats(&ns).unwrap().turns, 4 * 5);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_ingestion_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ns = Namespace::new("alice").unwrap();
    // 1. Acknowledged turns the worker never reached (a crash after the 202): stored, not
    //    processed. A new server picks them up on start.
    {
        let mem = memory(dir.path(), Arc::new(Gate::default()));
        mem.append_turns(
            &ns,
            &SessionId::new("left").unwrap(),
            Some("2024-05-01"),
            vec![
                NewTurn::user("I adopted a tabby cat named Miso."),
                NewTurn::assistant("Lovely!"),
            ],
        )
        .unwrap();
        assert_eq!(mem.unprocessed_sessions(&ns).unwrap().len(), 1);
    }
    let gate = Arc::new(Gate::default());
    let mem = memory(dir.path(), gate.clone());
    let server = start(mem.clone(), ServerConfig::default()).await;
    let c = reqwest::Client::new();
    for _ in 0..100 {
        if mem.unprocessed_sessions(&ns).unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        mem.unprocessed_sessions(&ns).unwrap().is_empty(),
        "re-queued at start"
    );
    // 2. Shut down while the encoder is busy with queued work: shutdown waits for the queue.
    gate.set(true);
    for s in ["a", "b"] {
        let r = c
            .post(format!("{}/v1/sessions/{s}/turns", server.base))
            .bearer_auth("key-alice")
            .json(&turns())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    let flush = tokio::spawn({
        let c = c.clone();
        let u = format!("{}/v1/sessions/a/flush", server.base);
        async move {
            c.post(u)
                .bearer_auth("key-alice")
                .send()
                .await
                .map(|r| r.status())
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stopping = tokio::spawn(server.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.set(false);
    stopping.await.unwrap();
    let _ = flush.await;
    let stats = mem.stats(&ns).unwrap();
    assert_eq!(stats.turns, 2 + 4 + 4, "every acknowledged turn is stored");
    assert!(
        mem.unprocessed_sessions(&ns).unwrap().is_empty(),
        "and processed"
    );
    drop(mem);
    // 3. Reopen: everything is there.
    let mem = memory(dir.path(), Arc::new(Gate::default()));
    assert_eq!(mem.stats(&ns).unwrap().turns, 10);
    assert!(mem.stats(&ns).unwrap().records >= 2);
}

/// The text blocks of a tool result, one per line.
fn tool_text(r: rmcp::model::CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text())
        .map(|t| t.text.clone())
        .collect::<Vec<_>>()
        .join("\n")
}

/// An MCP client over streamable HTTP with an API key.
async fn mcp_client(
    base: &str,
    key: &str,
) -> Result<rmcp::service::RunningService<rmcp::RoleClient, ()>, rmcp::service::ClientInitializeError>
{
    use rmcp::ServiceExt;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    let cfg = StreamableHttpClientTransportConfig::with_uri(format!("{base}/mcp"))
        .auth_header(key.to_string());
    ().serve(StreamableHttpClientTransport::from_config(cfg))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tools_over_streamable_http_with_keys() {
    use rmcp::model::CallToolRequestParams;

    let dir = tempfile::tempdir().unwrap();
    let server = start(
        memory(dir.path(), Arc::new(Gate::default())),
        ServerConfig::default(),
    )
    .await;
    let connect = |key: &'static str| mcp_client(&server.base, key);
    assert!(connect("wrong").await.is_err(), "a bad key cannot connect");
    let client = connect("key-alice").await.unwrap();
    let tools = client.list_all_tools().await.unwrap();
    let mut names: Vec<String> = tools.iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "memory_add",
            "memory_answer",
            "memory_delete",
            "memory_search",
            "memory_stats"
        ]
    );
    let call = |name: &'static str, args: Value| {
        let args = args.as_object().cloned().unwrap_or_default();
        client.call_tool(CallToolRequestParams::new(name).with_arguments(args))
    };
    let text = tool_text;
    let r = call("memory_add", json!({"session": "m1", "date": "2024-05-01", "turns": [
        {"text": "My sister Ana lives in Lisbon."}, {"role": "assistant", "text": "Lisbon is lovely."}]}))
    .await
    .unwrap();
    let failed = r.is_error == Some(true);
    assert!(!failed, "{}", text(r));
    let r = call(
        "memory_add",
        json!({"session": "m1", "turns": [{"text": "x", "role": "robot"}]}),
    )
    .await
    .unwrap();
    assert_eq!(r.is_error, Some(true), "bad arguments are a tool error");
    // The HTTP API's limits hold over MCP: turns per call, question length, top_k.
    let many: Vec<Value> = (0..513).map(|_| json!({"text": "x"})).collect();
    let r = call("memory_add", json!({"session": "m2", "turns": many}))
        .await
        .unwrap();
    let refused = r.is_error == Some(true);
    let message = text(r);
    assert!(refused && message.contains("limited to"), "{message}");
    for args in [
        json!({"question": "q".repeat(8_001)}),
        json!({"question": "Where does Ana live?", "top_k": 101}),
    ] {
        let r = call("memory_search", args).await.unwrap();
        let refused = r.is_error == Some(true);
        let message = text(r);
        assert!(refused && message.contains("limited to"), "{message}");
    }
    // Adds are encoded in the background: wait until the turns are processed, then search.
    let mut stats = String::new();
    for _ in 0..50 {
        stats = text(call("memory_stats", json!({})).await.unwrap());
        if stats.contains("\"turns\": 2") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stats.contains("\"turns\": 2"), "{stats}");
    let found = text(
        call("memory_search", json!({"question": "Where does Ana live?"}))
            .await
            .unwrap(),
    );
    assert!(found.contains("Lisbon"), "{found}");
    let answer = text(
        call("memory_answer", json!({"question": "Where does Ana live?"}))
            .await
            .unwrap(),
    );
    assert_eq!(answer, "Your cat is called Miso.");
    // Bob's key sees another namespace.
    let bob = connect("key-bob").await.unwrap();
    let r = bob
        .call_tool(
            CallToolRequestParams::new("memory_search").with_arguments(
                json!({"question": "Where does Ana live?"})
                    .as_object()
                    .cloned()
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(true));
    let _ = bob.cancel().await;
    let _ = client.cancel().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tools_over_stdio() {
    use rmcp::ServiceExt;
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};

    // The example `mcp_stdio_scripted` serves one namespace over stdio with the same doubles.
    let exe = std::env::current_exe().unwrap();
    let examples = exe.parent().unwrap().parent().unwrap().join("examples");
    let bin = examples.join(format!(
        "mcp_stdio_scripted{}",
        std::env::consts::EXE_SUFFIX
    ));
    assert!(bin.exists(), "{} (built by cargo test)", bin.display());
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_path_buf();
    let t = TokioChildProcess::new(tokio::process::Command::new(&bin).configure(|c| {
        c.arg(&store);
    }))
    .unwrap();
    let client = ().serve(t).await.unwrap();
    assert_eq!(client.list_all_tools().await.unwrap().len(), 5);
    let args = |v: Value| v.as_object().cloned().unwrap();
    let r = client
        .call_tool(CallToolRequestParams::new("memory_add").with_arguments(args(json!({
            "session": "s", "turns": [{"text": "I play the cello every Sunday."}, {"role": "assistant", "text": "Nice."}]
        }))))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true));
    let r = client
        .call_tool(
            CallToolRequestParams::new("memory_search")
                .with_arguments(args(json!({"question": "What instrument do I play?"}))),
        )
        .await
        .unwrap();
    let text: String = r
        .content
        .iter()
        .filter_map(|c| c.as_text())
        .map(|t| t.text.clone())
        .collect();
    assert!(text.contains("cello"), "{text}");
    let r = client
        .call_tool(
            CallToolRequestParams::new("memory_delete")
                .with_arguments(args(json!({"session": "s"}))),
        )
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true));
    let _ = client.cancel().await;
}

/// A server over a fresh memory with the default config, and a client for it.
async fn plain_server() -> (tempfile::TempDir, Running, Api) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        memory(dir.path(), Arc::new(Gate::default())),
        ServerConfig::default(),
    )
    .await;
    let api = Api {
        c: reqwest::Client::new(),
        base: server.base.clone(),
    };
    (dir, server, api)
}

/// Both namespaces hold near-identical memory (same session names, the same sentences but for
/// one name): every route and MCP tool used with the other namespace's ids, session names and
/// questions returns, counts, exports and deletes nothing across the boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_full_namespaces_share_nothing() {
    use rmcp::model::CallToolRequestParams;

    let (_dir, server, api) = plain_server().await;
    const A: &str = "key-alice";
    const B: &str = "key-bob";
    let conversation = |pet: &str| {
        json!({"date": "2024-05-01", "first_index": 0, "turns": [
            {"role": "user", "text": format!("I adopted a tabby cat named {pet} last week.")},
            {"role": "assistant", "text": format!("Congratulations on adopting {pet}!")},
            {"role": "user", "text": "I also started learning the cello."},
            {"role": "assistant", "text": "The cello is a wonderful instrument."}
        ]})
    };
    for (key, pet) in [(A, "Miso"), (B, "Mochi")] {
        for session in ["s1", "s2"] {
            let r = api
                .post(
                    &format!("/v1/sessions/{session}/turns"),
                    key,
                    conversation(pet),
                )
                .await;
            assert_eq!(r.status(), 202);
            // A retry of the same request (same first_index) stores nothing again.
            let retry: Value = api
                .post(
                    &format!("/v1/sessions/{session}/turns"),
                    key,
                    conversation(pet),
                )
                .await
                .json()
                .await
                .unwrap();
            assert_eq!(
                (retry["stored"].as_u64(), retry["already_stored"].as_u64()),
                (Some(0), Some(4)),
                "{retry}"
            );
            let r = api
                .post(&format!("/v1/sessions/{session}/flush"), key, json!({}))
                .await;
            assert_eq!(r.status(), 200);
        }
    }
    // The same request with other content at a stored index is a conflict; nothing is stored.
    let mut changed = conversation("Miso");
    changed["turns"][0]["text"] = json!("I adopted a dog.");
    let r = api.post("/v1/sessions/s1/turns", A, changed).await;
    assert_eq!(code_of(r).await, (409, "conflict".into()));

    let records = |key: &'static str| {
        let api = &api;
        async move {
            let page = api.get_json("/v1/records?limit=1000", key).await;
            page["records"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r["record_id"].as_str().unwrap().to_string(),
                        r["semantic_text"].to_string(),
                    )
                })
                .collect::<std::collections::BTreeMap<String, String>>()
        }
    };
    let (alice, bob) = (records(A).await, records(B).await);
    assert!(
        !alice.is_empty() && alice.len() == bob.len(),
        "{alice:?} {bob:?}"
    );
    assert!(alice.values().all(|t| !t.contains("Mochi")), "{alice:?}");
    assert!(bob.values().all(|t| !t.contains("Miso")), "{bob:?}");
    let alice_only: Vec<&String> = alice.keys().filter(|id| !bob.contains_key(*id)).collect();
    assert!(
        !alice_only.is_empty(),
        "some records differ by the pet's name"
    );
    let stats_a = api.get_json("/v1/stats", A).await;
    let stats_b = api.get_json("/v1/stats", B).await;
    assert_eq!(stats_a["turns"], 8);
    let without_usage = |mut v: Value| {
        // Token counts differ with the names' lengths.
        v.as_object_mut().unwrap().remove("usage");
        v
    };
    assert_eq!(
        without_usage(stats_a.clone()),
        without_usage(stats_b),
        "the same shape, counted per namespace"
    );

    // Searches return only the caller's memory, whatever they ask.
    for (key, own, other) in [(A, "Miso", "Mochi"), (B, "Mochi", "Miso")] {
        for question in ["What is my cat called?", &format!("Tell me about {other}")] {
            let found: Value = api
                .post("/v1/search", key, json!({"question": question}))
                .await
                .json()
                .await
                .unwrap();
            let texts = found["evidence"].to_string();
            assert!(texts.contains(own), "{key}: {texts}");
            assert!(!texts.contains(other), "{key} saw {other}: {texts}");
        }
        let export = api.get("/v1/export", key).await.text().await.unwrap();
        assert!(
            export.contains(own) && !export.contains(other),
            "{key}'s export"
        );
    }

    // Bob uses Alice's ids and session names: nothing of Alice's is read or removed.
    // (Alice's searches above logged her plan calls: her stats are taken again.)
    let stats_a = api.get_json("/v1/stats", A).await;
    for id in &alice_only {
        let path = format!("/v1/records/{id}");
        assert_eq!(api.get(&path, B).await.status(), 404);
        assert_eq!(api.delete(&path, B).await.status(), 404);
    }
    let shared: Vec<&String> = alice.keys().filter(|id| bob.contains_key(*id)).collect();
    for id in &shared {
        // The same id in both namespaces (the same sentence): each caller gets their own.
        let mine = api.get_json(&format!("/v1/records/{id}"), B).await;
        assert!(!mine.to_string().contains("Miso"), "{mine}");
    }
    assert_eq!(api.delete("/v1/sessions/s1", B).await.status(), 200);
    assert_eq!(api.get("/v1/sessions/s1", B).await.status(), 404);
    assert_eq!(
        api.get_json("/v1/stats", A).await,
        stats_a,
        "Alice's memory is untouched"
    );
    assert_eq!(records(A).await, alice);

    // The same over MCP with Bob's key.
    let bob_mcp = mcp_client(&server.base, B).await.unwrap();
    let call = |name: &'static str, args: Value| {
        bob_mcp.call_tool(
            CallToolRequestParams::new(name).with_arguments(args.as_object().cloned().unwrap()),
        )
    };
    let text = tool_text;
    let found = text(
        call("memory_search", json!({"question": "Tell me about Miso"}))
            .await
            .unwrap(),
    );
    assert!(
        found.contains("Mochi") && !found.contains("Miso"),
        "{found}"
    );
    for id in &alice_only {
        let r = call("memory_delete", json!({"record_id": id}))
            .await
            .unwrap();
        assert_eq!(r.is_error, Some(true), "Bob cannot delete Alice's {id}");
    }
    let stats = text(call("memory_stats", json!({})).await.unwrap());
    assert!(
        stats.contains("\"turns\": 4"),
        "Bob's stats count only his: {stats}"
    );
    let _ = bob_mcp.cancel().await;
    assert_eq!(
        api.get_json("/v1/stats", A).await,
        stats_a,
        "Alice's memory is untouched"
    );
    server.stop().await;
}

/// A bounded load run over loopback: 8 clients for `LYCHEEMEM_LOAD_SECONDS` (default 20) mix
/// idempotent adds (a quarter) with searches. Asserts no error (a 429 is backpressure: the
/// client waits and retries the same request, which `first_index` makes safe), every
/// acknowledged turn stored with its text afterwards, and bounded growth of resident memory.
/// The full run (16 clients, 60 s, 100k records, real embeddings) is the `server_load` bench.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_clients_under_load_lose_nothing() {
    const CLIENTS: usize = 8;
    /// Resident growth allowed over the run (the store's caches, the indexes of the added turns).
    const RSS_GROWTH_LIMIT_MIB: f64 = 300.0;
    let seconds: u64 = std::env::var("LYCHEEMEM_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let mem = memory(dir.path(), Arc::new(Gate::default()));
    let server = start(mem.clone(), ServerConfig::default()).await;
    let rss_before = rss_mib();
    let deadline = std::time::Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let base = server.base.clone();
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let mut acknowledged: Vec<String> = Vec::new();
            let (mut searches, mut retries, mut errors) = (0u64, 0u64, Vec::<String>::new());
            let mut step = 0u64;
            while std::time::Instant::now() < deadline {
                step += 1;
                let (path, body) = if step.is_multiple_of(4) {
                    let i = acknowledged.len();
                    let text =
                        format!("client {client} turn {i}: I visited museum number {i} today.");
                    let body = json!({"first_index": i, "turns": [{"role": "user", "text": text}]});
                    (format!("/v1/sessions/c{client}/turns"), body)
                } else {
                    let q = format!("Which museum did client {client} visit on step {step}?");
                    ("/v1/search".to_string(), json!({"question": q}))
                };
                loop {
                    let r = c
                        .post(format!("{base}{path}"))
                        .bearer_auth("key-alice")
                        .json(&body)
                        .send()
                        .await;
                    match r {
                        Ok(r) if r.status() == 429 => {
                            retries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        // Before the first add, a search meets an empty namespace (404).
                        Ok(r) if r.status() == 404 && path == "/v1/search" => break,
                        Ok(r) if r.status().is_success() => {
                            if path == "/v1/search" {
                                searches += 1;
                            } else {
                                acknowledged
                                    .push(body["turns"][0]["text"].as_str().unwrap().to_string());
                            }
                            break;
                        }
                        Ok(r) => {
                            errors.push(format!("{path}: {}", r.status()));
                            break;
                        }
                        Err(e) => {
                            errors.push(format!("{path}: {e}"));
                            break;
                        }
                    }
                }
            }
            (acknowledged, searches, retries, errors)
        }));
    }
    let (mut total_searches, mut total_retries) = (0, 0);
    let mut results = Vec::new();
    for t in tasks {
        let (acked, searches, retries, errors) = t.await.unwrap();
        assert!(
            errors.is_empty(),
            "{} errors: {:?}",
            errors.len(),
            &errors[..errors.len().min(5)]
        );
        total_searches += searches;
        total_retries += retries;
        results.push(acked);
    }
    let rss_after = rss_mib();
    assert!(
        total_searches > CLIENTS as u64,
        "the clients searched ({total_searches})"
    );
    // Every acknowledged turn is stored, in order, with its text, and gets processed.
    let ns = Namespace::new("alice").unwrap();
    for (client, acked) in results.iter().enumerate() {
        assert!(!acked.is_empty(), "client {client} stored nothing");
        let sid = SessionId::new(format!("c{client}")).unwrap();
        let turns = mem.store().turn_range(&ns, &sid, 0, u32::MAX).unwrap();
        let texts: Vec<&str> = turns.iter().map(|t| t.text.as_str()).collect();
        assert_eq!(
            texts,
            acked.iter().map(String::as_str).collect::<Vec<_>>(),
            "client {client}"
        );
    }
    wait_until("every added turn is processed", || {
        mem.unprocessed_sessions(&ns).unwrap().is_empty()
    })
    .await;
    eprintln!(
        "{CLIENTS} clients, {seconds} s: {total_searches} searches, {} turns, {total_retries} retries after 429; RSS {rss_before:.0} → {rss_after:.0} MiB",
        results.iter().map(Vec::len).sum::<usize>()
    );
    assert!(
        rss_after - rss_before < RSS_GROWTH_LIMIT_MIB,
        "resident memory grew from {rss_before:.0} to {rss_after:.0} MiB"
    );
    server.stop().await;
}

/// A planner that holds each call until it is released or its caller cancels it (as the local
/// LLM does between decoding steps), counting both.
#[derive(Default)]
struct HeldPlanner {
    waiting: AtomicUsize,
    cancelled: AtomicUsize,
    released: std::sync::atomic::AtomicBool,
}

impl lycheemem_llm::Llm for HeldPlanner {
    fn complete(
        &self,
        _messages: &[lycheemem_llm::ChatMessage],
        options: &lycheemem_llm::GenerateOptions,
    ) -> lycheemem_core::Result<lycheemem_llm::Completion> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let outcome = loop {
            if options.cancel.is_cancelled() {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                break Err(lycheemem_core::Error::Cancelled("planner".into()));
            }
            if self.released.load(Ordering::SeqCst) {
                break Ok(lycheemem_llm::Completion {
                    text: r#"{"question_type": "single", "semantic_queries": [], "temporal_filter": null, "routes": [{"route_id": "r1", "goal": "find it", "queries": [], "constraints": [], "temporal_filter": null}]}"#.into(),
                    finish_reason: lycheemem_llm::FinishReason::Stop,
                    prompt_tokens: 100,
                    completion_tokens: 40,
                    cached_prompt_tokens: 0,
                    latency_ms: 1,
                    usage_estimated: false,
                    model: "held".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        outcome
    }

    fn model_id(&self) -> &str {
        "held"
    }

    fn context_length(&self) -> Option<usize> {
        None
    }
}

/// Questions whose clients are gone stop their LLM work; past `max_queries_in_flight` a new
/// question is refused at once (429 `busy`, not queued behind abandoned ones); metrics count the
/// refused and the cancelled; once the planner answers, questions are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_questions_stop_and_a_full_house_answers_busy() {
    let dir = tempfile::tempdir().unwrap();
    let planner = Arc::new(HeldPlanner::default());
    let mut components = Components::with_llm(
        Arc::new(HashEmbedder::new(64)),
        Arc::new(ScriptedLlm::pipeline("scripted answer")),
    );
    components.plan_llm = planner.clone();
    let mem = Arc::new(Memory::with_components(dir.path(), Config::default(), components).unwrap());
    let ns = Namespace::new("alice").unwrap();
    mem.add_turns(
        &ns,
        &SessionId::new("s1").unwrap(),
        Some("2024-05-01"),
        vec![NewTurn::user("I adopted a tabby cat named Miso.")],
    )
    .unwrap();
    let cfg = ServerConfig {
        limits: lycheemem_server::api::Limits {
            max_queries_in_flight: 2,
            ..Default::default()
        },
        ..ServerConfig::default()
    };
    let server = start(mem.clone(), cfg).await;
    let question = json!({"question": "What is my cat called?"});
    // Two clients ask and give up after 300 ms (their connections close).
    let mut impatient = Vec::new();
    for _ in 0..2 {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let url = format!("{}/v1/search", server.base);
        let body = question.clone();
        impatient.push(tokio::spawn(async move {
            c.post(url)
                .bearer_auth("key-alice")
                .json(&body)
                .send()
                .await
        }));
    }
    let p = planner.clone();
    wait_until("both questions wait for the planner", move || {
        p.waiting.load(Ordering::SeqCst) == 2
    })
    .await;
    // A third question while both run: refused at once, nothing queued.
    let api = Api {
        c: reqwest::Client::new(),
        base: server.base.clone(),
    };
    let r = api.post("/v1/search", "key-alice", question.clone()).await;
    assert_eq!(code_of(r).await, (429, "busy".into()));
    for t in impatient {
        assert!(t.await.unwrap().is_err(), "the impatient client timed out");
    }
    // Their planner calls stop although nobody released them.
    let p = planner.clone();
    wait_until("the abandoned planner calls are cancelled", move || {
        p.cancelled.load(Ordering::SeqCst) == 2 && p.waiting.load(Ordering::SeqCst) == 0
    })
    .await;
    let metrics = || async {
        api.send(reqwest::Method::GET, "/metrics", None, None)
            .await
            .text()
            .await
            .unwrap()
    };
    let mut m = String::new();
    for _ in 0..100 {
        m = metrics().await;
        if m.contains("lycheemem_queries_cancelled_total 2") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(m.contains("lycheemem_queries_cancelled_total 2"), "{m}");
    assert!(m.contains("lycheemem_queries_refused_total 1"), "{m}");
    assert!(m.contains("lycheemem_queries_in_flight 0"), "{m}");
    // Served again once the planner answers; the plan tokens are counted.
    planner.released.store(true, Ordering::SeqCst);
    let r = api.post("/v1/search", "key-alice", question.clone()).await;
    assert_eq!(r.status(), 200);
    let m = metrics().await;
    assert!(
        m.contains("lycheemem_llm_tokens_total{purpose=\"plan\",kind=\"prompt\"} 100"),
        "{m}"
    );
    // Shutdown does not wait for a question held in the planner: it stops it and answers 503.
    planner.released.store(false, Ordering::SeqCst);
    let waiting = tokio::spawn(async move { api.post("/v1/search", "key-alice", question).await });
    let p = planner.clone();
    wait_until("a question waits for the planner", move || {
        p.waiting.load(Ordering::SeqCst) == 1
    })
    .await;
    tokio::time::timeout(Duration::from_secs(10), server.stop())
        .await
        .expect("shutdown waited for a held question");
    assert_eq!(
        code_of(waiting.await.unwrap()).await,
        (503, "cancelled".into())
    );
    assert_eq!(planner.cancelled.load(Ordering::SeqCst), 3);
}

/// Hostile bodies on every POST route and the MCP endpoint: random bytes, random JSON, and
/// near-valid requests with wrong types, huge numbers and absurd dates. Each gets a 2xx or 4xx,
/// never a 5xx; the server stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_get_client_errors_never_server_errors() {
    let (_dir, server, api) = plain_server().await;
    // The namespace exists, so searches get past "no memory".
    let r = api.post("/v1/sessions/s/turns", "key-alice", turns()).await;
    assert_eq!(r.status(), 202);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let hostile_values = [
        json!(null),
        json!(-1),
        json!(1e300),
        json!(u64::MAX),
        json!("200000000000 days ago"),
        json!("9999999-12-31"),
        json!([]),
        json!({}),
        json!("x".repeat(5000)),
        json!([{"text": null}]),
    ];
    let fields = [
        "turns",
        "date",
        "first_index",
        "question",
        "top_k",
        "context",
        "text",
        "role",
    ];
    let routes = [
        "/v1/sessions/s/turns",
        "/v1/search",
        "/v1/answer",
        "/v1/sessions/s/flush",
        "/mcp",
    ];
    for case in 0..300 {
        let body: Vec<u8> = match case % 3 {
            0 => (0..next() % 200).map(|_| next() as u8).collect(),
            1 => {
                let mut obj = serde_json::Map::new();
                for _ in 0..1 + next() % 4 {
                    let f = fields[(next() % fields.len() as u64) as usize];
                    let v = hostile_values[(next() % hostile_values.len() as u64) as usize].clone();
                    obj.insert(f.to_string(), v);
                }
                Value::Object(obj).to_string().into_bytes()
            }
            _ => {
                let v = hostile_values[(next() % hostile_values.len() as u64) as usize].clone();
                json!({"question": "What is my cat called?", "date": v, "top_k": v,
                       "turns": [{"text": "hi", "time": v}], "jsonrpc": "2.0", "id": v, "method": v})
                .to_string()
                .into_bytes()
            }
        };
        let route = routes[case % routes.len()];
        let r = api
            .c
            .post(format!("{}{route}", api.base))
            .bearer_auth("key-alice")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        assert!(
            status < 500,
            "{route} answered {status} to {:?}: {}",
            String::from_utf8_lossy(&body[..body.len().min(120)]),
            r.text().await.unwrap_or_default()
        );
    }
    let health = api.send(reqwest::Method::GET, "/health", None, None).await;
    assert_eq!(health.status(), 200);
    server.stop().await;
}
