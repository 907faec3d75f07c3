//! Server load test: concurrent clients mixing adds and searches over loopback HTTP against a
//! store pre-filled with synthetic records. Embeddings are real (MiniLM); the encoder and
//! planner are scripted (instant) so the test measures the server, not the LLM.
//!
//! `cargo bench -p lycheemem-benches --bench server_load -- --records 100000 --clients 16 --seconds 60`
//!
//! Prints throughput, p50/p99 latency per operation, refusals (429, backpressure), errors (any
//! other non-2xx or transport error), acknowledged turns missing afterwards,
//! RSS before and after, and the reference: the same searches called in-process on the memory
//! (no HTTP), sequentially, in the same run.

use lycheemem::{Components, Memory, QueryOptions};
use lycheemem_bench::synthetic::{Rng, build_store, percentile, rss_mib, sentence};
use lycheemem_benches::arg;
use lycheemem_core::{Config, Namespace};
use lycheemem_server::keys::KeyStore;
use lycheemem_server::{ServerConfig, serve_listener};
use lycheemem_testkit::ScriptedLlm;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let records: usize = arg("--records", "100000").parse()?;
    let clients: usize = arg("--clients", "16").parse()?;
    let seconds: u64 = arg("--seconds", "60").parse()?;
    let add_share: f64 = arg("--add-share", "0.25").parse()?;
    let tmp = tempfile::tempdir()?;
    let dir = match std::env::var_os("LOAD_STORE_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => tmp.path().join("store"),
    };
    let t0 = Instant::now();
    if !dir.join("store.redb").exists() {
        let (store, _) = build_store(&dir, records, 384, 42)?;
        drop(store);
        eprintln!("built {records} synthetic records in {:.0?}", t0.elapsed());
    } else {
        let store = lycheemem_store::Store::open(&dir, lycheemem_store::StoreOptions::new(384))?;
        lycheemem::mark_sessions_processed(&store, &Namespace::new("bench")?)?;
    }
    let llm = Arc::new(ScriptedLlm::pipeline("ok"));
    let components = Components::with_llm(Arc::new(lycheemem_testkit::minilm()), llm);
    let memory = Arc::new(Memory::with_components(
        &dir,
        Config::default(),
        components,
    )?);
    let ns = Namespace::new("bench")?;
    let mut rng = Rng(7);
    let questions: Vec<String> = (0..64)
        .map(|i| format!("{}?", sentence(&mut rng, 20_000, 4 + i % 4)))
        .collect();
    // Reference: the same searches in-process, sequential.
    let mut direct = Vec::new();
    for q in &questions {
        let t = Instant::now();
        memory.search(&ns, q, &QueryOptions::default())?;
        direct.push(t.elapsed().as_secs_f64() * 1e3);
    }
    direct.sort_by(f64::total_cmp);
    let rss_before = rss_mib();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let mut keys = KeyStore::in_memory();
        keys.insert_key("load-key", &ns);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_listener(
            listener,
            memory.clone(),
            keys,
            ServerConfig::default(),
            async {
                let _ = stop_rx.await;
            },
        ));
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let questions = Arc::new(questions);
        let mut tasks = Vec::new();
        for c in 0..clients {
            let (http, base, questions) = (http.clone(), base.clone(), questions.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(1000 + c as u64);
                let mut out: Vec<(&'static str, f64, Outcome)> = Vec::new();
                let mut adds = 0usize;
                // Turns acknowledged per session of this client.
                let mut acknowledged: BTreeMap<String, u64> = BTreeMap::new();
                while Instant::now() < deadline {
                    let is_add = (rng.unit() as f64) < add_share;
                    let t = Instant::now();
                    let session = format!("load-{c}-{}", adds / 20);
                    let req = if is_add {
                        adds += 1;
                        let body = serde_json::json!({"turns": [
                            {"role": "user", "text": sentence(&mut rng, 20_000, 12)},
                            {"role": "assistant", "text": sentence(&mut rng, 20_000, 12)}
                        ]});
                        http.post(format!("{base}/v1/sessions/{session}/turns"))
                            .bearer_auth("load-key")
                            .json(&body)
                    } else {
                        let q = &questions[(rng.next_u64() % questions.len() as u64) as usize];
                        http.post(format!("{base}/v1/search"))
                            .bearer_auth("load-key")
                            .json(&serde_json::json!({"question": q}))
                    };
                    let failure = match req.send().await {
                        Ok(r) if r.status().is_success() => match r.bytes().await {
                            Ok(_) => {
                                if is_add {
                                    *acknowledged.entry(session).or_default() += 2;
                                }
                                Outcome::Ok
                            }
                            Err(e) => Outcome::Error(e.to_string()),
                        },
                        // Backpressure (a full queue, too many questions): refused before
                        // anything was stored; a client would retry.
                        Ok(r) if r.status().as_u16() == 429 => Outcome::Refused,
                        Ok(r) => {
                            let status = r.status();
                            Outcome::Error(format!(
                                "{status} {}",
                                r.text().await.unwrap_or_default()
                            ))
                        }
                        Err(e) => Outcome::Error(e.to_string()),
                    };
                    out.push((
                        if is_add { "add" } else { "search" },
                        t.elapsed().as_secs_f64() * 1e3,
                        failure,
                    ));
                }
                (out, acknowledged)
            }));
        }
        let mut all = Vec::new();
        let mut acknowledged = BTreeMap::new();
        for t in tasks {
            let (ops, acked) = t.await?;
            all.extend(ops);
            acknowledged.extend(acked);
        }
        let rss_loaded = rss_mib();
        let drain = Instant::now();
        let _ = stop_tx.send(());
        server.await??;
        anyhow::Ok((all, acknowledged, rss_loaded, drain.elapsed()))
    });
    let (ops, acknowledged, rss_after, drain) = result?;
    // Every acknowledged turn is stored.
    let mut missing = 0u64;
    for (session, acked) in &acknowledged {
        let held = memory
            .store()
            .session(&ns, &lycheemem_core::SessionId::new(session.clone())?)?
            .map_or(0, |s| u64::from(s.turn_count));
        missing += acked.saturating_sub(held);
    }
    let mut by: BTreeMap<&str, (Vec<f64>, usize, usize)> = BTreeMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for (kind, ms, outcome) in &ops {
        let e = by.entry(kind).or_default();
        e.0.push(*ms);
        match outcome {
            Outcome::Ok => {}
            Outcome::Refused => e.2 += 1,
            Outcome::Error(f) => {
                e.1 += 1;
                *failures.entry(f.chars().take(160).collect()).or_default() += 1;
            }
        }
    }
    for (f, n) in &failures {
        eprintln!("{n} × {f}");
    }
    println!(
        "\n{records} records, {clients} clients, {seconds} s, {:.0}% adds (2 turns each); 2 cores, loopback",
        add_share * 100.0
    );
    println!("| operation | requests | req/s | p50 ms | p99 ms | refused (429) | errors |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut total_errors = 0;
    for (kind, (mut lat, errors, refused)) in by {
        lat.sort_by(f64::total_cmp);
        total_errors += errors;
        println!(
            "| {kind} | {} | {:.1} | {:.1} | {:.1} | {refused} | {errors} |",
            lat.len(),
            lat.len() as f64 / seconds as f64,
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        );
    }
    println!(
        "| reference: in-process Memory::search, sequential | {} | — | {:.1} | {:.1} | — | — |",
        direct.len(),
        percentile(&direct, 0.5),
        percentile(&direct, 0.99)
    );
    println!(
        "\ntotal {} requests ({:.1}/s), {total_errors} errors; RSS {:.0} MiB before, {:.0} MiB after the load; shutdown drained the encoding queue in {:.1?}",
        ops.len(),
        ops.len() as f64 / seconds as f64,
        rss_before,
        rss_after,
        drain
    );
    println!(
        "acknowledged turns: {}, missing after the run: {missing}",
        acknowledged.values().sum::<u64>()
    );
    if total_errors > 0 || missing > 0 {
        anyhow::bail!("{total_errors} errors, {missing} acknowledged turns missing");
    }
    Ok(())
}

/// How one request ended.
enum Outcome {
    Ok,
    /// 429: refused before anything was stored (backpressure).
    Refused,
    Error(String),
}
