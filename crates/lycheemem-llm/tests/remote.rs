//! The OpenAI-compatible backend against an in-process HTTP server on loopback that replays
//! scripted answers: success, 429-then-success, persistent 500s, timeouts, malformed bodies,
//! missing usage, json_schema rejection with JSON-mode fallback, and the repair round.

use lycheemem_llm::{ChatMessage, FinishReason, GenerateOptions, Llm, RemoteLlm, RemoteOptions};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Scripted {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    delay: Duration,
}

fn reply(status: u16, body: impl Into<String>) -> Scripted {
    Scripted {
        status,
        headers: Vec::new(),
        body: body.into(),
        delay: Duration::ZERO,
    }
}

fn ok(content: &str, usage: bool) -> Scripted {
    let mut v = json!({"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]});
    if usage {
        v["usage"] = json!({"prompt_tokens": 11, "completion_tokens": 7});
    }
    reply(200, v.to_string())
}

/// A recorded request: headers (lower-cased names) and the JSON body.
#[derive(Debug, Clone)]
struct Seen {
    headers: Vec<(String, String)>,
    body: Value,
}

/// Serves the scripted answers in order, one connection each, then stops.
fn server(script: Vec<Scripted>) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for answer in script {
            let Ok((stream, _)) = listener.accept() else {
                return;
            };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut headers = Vec::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.trim_end().split_once(':') {
                    let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
                    if k == "content-length" {
                        length = v.parse().unwrap_or(0);
                    }
                    headers.push((k, v));
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            log.lock().unwrap().push(Seen {
                headers,
                body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            });
            std::thread::sleep(answer.delay);
            let mut stream = stream;
            let extra: String = answer
                .headers
                .iter()
                .map(|(k, v)| format!("{k}: {v}\r\n"))
                .collect();
            let _ = write!(
                stream,
                "HTTP/1.1 {} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{}",
                answer.status,
                answer.body.len(),
                answer.body
            );
        }
    });
    (url, seen)
}

fn client(url: &str) -> RemoteLlm {
    let mut opts = RemoteOptions::new(url, "test-model");
    opts.backoff = Duration::from_millis(10);
    opts.max_retries = 2;
    opts.timeout = Duration::from_secs(5);
    opts.api_key_env = Some("LYCHEEMEM_TEST_REMOTE_KEY".into());
    RemoteLlm::new(opts).unwrap()
}

fn hello() -> Vec<ChatMessage> {
    vec![ChatMessage::system("be brief"), ChatMessage::user("hello")]
}

#[test]
fn success_reads_text_and_usage() {
    let (url, seen) = server(vec![ok("Hi there.", true)]);
    let out = client(&url)
        .complete(
            &hello(),
            &GenerateOptions {
                max_tokens: 9,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(out.text, "Hi there.");
    assert_eq!(
        (
            out.prompt_tokens,
            out.completion_tokens,
            out.usage_estimated
        ),
        (11, 7, false)
    );
    assert_eq!(out.finish_reason, FinishReason::Stop);
    let req = &seen.lock().unwrap()[0];
    assert_eq!(req.body["model"], "test-model");
    assert_eq!(req.body["max_tokens"], 9);
    assert_eq!(req.body["messages"][1]["role"], "user");
    assert!(req.body.get("response_format").is_none());
}

#[test]
fn retries_429_then_succeeds() {
    let mut busy = reply(429, r#"{"error": "slow down"}"#);
    busy.headers.push(("retry-after", "0".into()));
    let (url, seen) = server(vec![busy, ok("done", true)]);
    assert_eq!(
        client(&url)
            .complete(&hello(), &GenerateOptions::default())
            .unwrap()
            .text,
        "done"
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[test]
fn persistent_500s_fail_after_the_retry_budget() {
    let (url, seen) = server(vec![
        reply(500, "boom"),
        reply(502, "boom"),
        reply(503, "still down"),
    ]);
    let err = client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HTTP 503") && err.contains("still down"),
        "{err}"
    );
    assert_eq!(seen.lock().unwrap().len(), 3);
}

/// A body over the limit is an error, not held in memory (a few bytes past it suffice).
#[test]
fn an_oversized_reply_is_refused() {
    let huge = "x".repeat(lycheemem_llm::MAX_REPLY_BYTES as usize + 16);
    let (url, _seen) = server(vec![reply(200, huge)]);
    let err = client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("over {} bytes", lycheemem_llm::MAX_REPLY_BYTES)),
        "{err}"
    );
}

#[test]
fn client_errors_are_not_retried() {
    let (url, seen) = server(vec![reply(401, r#"{"error": "bad key"}"#)]);
    let err = client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("HTTP 401") && err.contains("bad key"), "{err}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[test]
fn timeouts_are_reported() {
    let slow = || Scripted {
        delay: Duration::from_millis(800),
        ..ok("late", true)
    };
    let (url, _) = server(vec![slow(), slow(), slow()]);
    let mut opts = RemoteOptions::new(&url, "m");
    opts.timeout = Duration::from_millis(200);
    opts.max_retries = 1;
    opts.backoff = Duration::from_millis(1);
    let err = RemoteLlm::new(opts)
        .unwrap()
        .complete(&hello(), &GenerateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("timed out after 2 attempts"), "{err}");
}

#[test]
fn malformed_body_is_a_clear_error() {
    let (url, _) = server(vec![reply(200, "{not json")]);
    let err = client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not JSON") && err.contains("{not json"),
        "{err}"
    );
}

#[test]
fn missing_usage_is_estimated_and_flagged() {
    let (url, _) = server(vec![ok("a reply of several words", false)]);
    let out = client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap();
    assert!(out.usage_estimated);
    assert!(out.prompt_tokens > 0 && out.completion_tokens > 0);
}

#[test]
fn api_key_comes_from_the_named_env_var() {
    // SAFETY: only this test reads or writes this variable.
    unsafe { std::env::set_var("LYCHEEMEM_TEST_REMOTE_KEY", "sk-test-123") };
    let (url, seen) = server(vec![ok("x", true)]);
    client(&url)
        .complete(&hello(), &GenerateOptions::default())
        .unwrap();
    let auth = seen.lock().unwrap()[0]
        .headers
        .iter()
        .find(|(k, _)| k == "authorization")
        .map(|(_, v)| v.clone());
    assert_eq!(auth.as_deref(), Some("Bearer sk-test-123"));
}

#[test]
fn schema_rejection_falls_back_to_json_mode_and_repairs_invalid_output() {
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]});
    let (url, seen) = server(vec![
        reply(
            400,
            r#"{"error": "response_format json_schema is not supported"}"#,
        ),
        ok("```json\n{\"wrong\": 1}\n```", true),
        ok("{\"answer\": \"Paris\"}", true),
        ok("{\"answer\": \"Rome\"}", true),
    ]);
    let llm = client(&url);
    let opts = GenerateOptions {
        json_schema: Some(schema),
        ..Default::default()
    };
    let out = llm.complete(&hello(), &opts).unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&out.text).unwrap()["answer"],
        "Paris"
    );
    assert_eq!(
        (out.prompt_tokens, out.completion_tokens),
        (22, 14),
        "usage of both calls is summed"
    );
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0].body["response_format"]["type"], "json_schema");
        assert_eq!(seen[1].body["response_format"]["type"], "json_object");
        let repair = seen[2].body["messages"].as_array().unwrap();
        assert!(
            repair.last().unwrap()["content"]
                .as_str()
                .unwrap()
                .contains("missing required field \"answer\"")
        );
    }
    // The rejection is remembered: the next call goes straight to JSON mode.
    llm.complete(&hello(), &opts).unwrap();
    assert_eq!(
        seen.lock().unwrap()[3].body["response_format"]["type"],
        "json_object"
    );
}

#[test]
fn invalid_structured_output_twice_is_an_error() {
    let schema = json!({"type": "object", "required": ["answer"]});
    let (url, _) = server(vec![ok("nope", true), ok("still nope", true)]);
    let err = client(&url)
        .complete(
            &hello(),
            &GenerateOptions {
                json_schema: Some(schema),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid structured output twice"), "{err}");
}

#[test]
fn a_config_spec_selects_the_remote_backend() {
    let (url, _) = server(vec![ok("via spec", true)]);
    let models =
        lycheemem_models::ModelStore::open(lycheemem_models::default_models_dir()).unwrap();
    let llm = lycheemem_llm::open_llm(
        &format!("openai:test-model@{url}"),
        &models,
        Default::default(),
    )
    .unwrap();
    assert_eq!(llm.model_id(), "test-model");
    assert_eq!(
        llm.complete(&hello(), &GenerateOptions::default())
            .unwrap()
            .text,
        "via spec"
    );
}

#[test]
fn metering_records_purpose_and_tokens() {
    use lycheemem_core::Purpose;
    let (url, _) = server(vec![ok("one", true), ok("two", false)]);
    let sink = Arc::new(lycheemem_llm::MemorySink::default());
    let inner: Arc<dyn Llm> = Arc::new(client(&url));
    let encode = lycheemem_llm::Metered::new(inner.clone(), Purpose::Encode, sink.clone());
    let plan = lycheemem_llm::Metered::new(inner, Purpose::Plan, sink.clone());
    encode
        .complete(&hello(), &GenerateOptions::default())
        .unwrap();
    plan.complete(&hello(), &GenerateOptions::default())
        .unwrap();
    let calls = sink.calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (
            calls[0].purpose,
            calls[0].prompt_tokens,
            calls[0].completion_tokens,
            calls[0].estimated
        ),
        (Purpose::Encode, 11, 7, false)
    );
    assert!(calls[1].estimated && calls[1].purpose == Purpose::Plan);
    let totals = sink.totals();
    assert_eq!(totals.tokens(Purpose::Encode), 18);
    assert_eq!(totals.by_purpose[&Purpose::Plan].calls, 1);
}

#[test]
fn a_cancelled_call_sends_nothing() {
    let (url, seen) = server(vec![ok("never", true)]);
    let cancel = lycheemem_core::Cancel::new();
    cancel.cancel();
    let out = client(&url).complete(
        &hello(),
        &GenerateOptions {
            cancel,
            ..GenerateOptions::default()
        },
    );
    assert!(
        matches!(out, Err(lycheemem_core::Error::Cancelled(_))),
        "{out:?}"
    );
    assert!(seen.lock().unwrap().is_empty(), "no request was sent");
}
