//! The lycheemem memory server: an HTTP API (axum) with a generated OpenAPI document, MCP over
//! streamable HTTP (at `/mcp`) and stdio, API keys that each confine a caller to one namespace,
//! a bounded background queue for segment encoding, and Prometheus metrics.
//!
//! Nothing binds to a non-loopback address unless [`ServerConfig::allow_remote`] is set.

pub mod api;
pub mod error;
pub mod keys;
pub mod mcp;
pub mod metrics;
pub mod worker;

use anyhow::{Context, Result, bail};
use api::{AppState, Caller, Limits};
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use error::ApiError;
use keys::{KeyStore, LiveKeys};
use lycheemem::Memory;
use metrics::Metrics;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub bind: SocketAddr,
    /// Allow binding to a non-loopback address.
    pub allow_remote: bool,
    pub max_body_bytes: usize,
    /// Per-request limit for `/v1` routes (504 past it).
    pub request_timeout: Duration,
    /// Jobs the encoding queue holds before new turns are refused with 429.
    pub queue_capacity: usize,
    /// Encoding worker threads: sessions encoded at the same time (at least 1). A local LLM
    /// decodes their calls together up to its batch size.
    pub encode_workers: usize,
    /// How long shutdown waits for queued encoding before leaving it for the next start.
    pub drain_timeout: Duration,
    /// How often to queue every session holding stored but unprocessed turns (beyond the sweep
    /// at start): the work a replica sharing the store left when it died. Zero: only at start.
    pub sweep_interval: Duration,
    pub limits: Limits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 7411)),
            allow_remote: false,
            max_body_bytes: 4 << 20,
            request_timeout: Duration::from_secs(300),
            queue_capacity: 256,
            encode_workers: 4,
            drain_timeout: Duration::from_secs(600),
            sweep_interval: Duration::from_secs(30),
            limits: Limits::default(),
        }
    }
}

/// The most encoding jobs that may queue, and searches that may run at once (each a permit of
/// a bounded channel or a semaphore, which refuse counts near `usize::MAX`).
pub const MAX_QUEUE: usize = 1 << 20;
/// The most encoding worker threads (each holds a session's LLM work; the local LLM decodes at
/// most `models.llm_batch` calls together anyway).
pub const MAX_ENCODE_WORKERS: usize = 256;

impl ServerConfig {
    /// Refuses settings the server cannot start with, naming the flag's setting.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_QUEUE).contains(&self.queue_capacity) {
            bail!(
                "the encoding queue (--queue) holds 1 to {MAX_QUEUE} jobs, not {}",
                self.queue_capacity
            );
        }
        if !(1..=MAX_ENCODE_WORKERS).contains(&self.encode_workers) {
            bail!(
                "--encode-workers must be 1 to {MAX_ENCODE_WORKERS} encoding workers, not {}",
                self.encode_workers
            );
        }
        if !(1..=MAX_QUEUE).contains(&self.limits.max_queries_in_flight) {
            bail!(
                "--max-queries must be 1 to {MAX_QUEUE} searches at once, not {}",
                self.limits.max_queries_in_flight
            );
        }
        Ok(())
    }
}

fn presented_key(req: &Request) -> Option<&str> {
    let h = req.headers();
    if let Some(v) = h
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        // The scheme name is case-insensitive (RFC 9110 §11.1).
        let (scheme, key) = v.trim_start().split_once(char::is_whitespace)?;
        return scheme.eq_ignore_ascii_case("bearer").then(|| key.trim());
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

async fn authenticate(State(keys): State<Arc<LiveKeys>>, mut req: Request, next: Next) -> Response {
    let Some(ns) = presented_key(&req).and_then(|k| keys.namespace_of(k)) else {
        return ApiError::unauthorized().into_response();
    };
    req.extensions_mut().insert(Caller(ns));
    next.run(req).await
}

async fn time_limit(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::new(
            http::StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!("the request took longer than {limit:?}"),
        )
        .into_response(),
    }
}

/// Caps the body of requests that bypass axum's extractors (the MCP service reads its own).
async fn limit_body(State(max): State<usize>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max) {
        return ApiError::new(
            http::StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "the request body is larger than the configured limit",
        )
        .into_response();
    }
    let (parts, body) = req.into_parts();
    let body = axum::body::Body::new(http_body_util::Limited::new(body, max));
    next.run(Request::from_parts(parts, body)).await
}

async fn track(State(metrics): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let method = req.method().to_string();
    let started = Instant::now();
    let resp = next.run(req).await;
    metrics.record_request(
        &method,
        &route,
        resp.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    resp
}

/// The full router: public `/health`, `/metrics`, `/openapi.json`; keyed `/v1/...` and `/mcp`.
pub fn router(state: AppState, keys: Arc<LiveKeys>, cfg: &ServerConfig) -> Router {
    let v1 = Router::new()
        .route("/v1/sessions", get(api::list_sessions))
        .route(
            "/v1/sessions/{session}",
            get(api::get_session).delete(api::delete_session),
        )
        .route("/v1/sessions/{session}/turns", post(api::add_turns))
        .route("/v1/sessions/{session}/flush", post(api::flush))
        .route("/v1/search", post(api::search))
        .route("/v1/answer", post(api::answer))
        .route("/v1/records", get(api::list_records))
        .route(
            "/v1/records/{id}",
            get(api::get_record).delete(api::delete_record),
        )
        .route("/v1/namespace", delete(api::delete_namespace))
        .route("/v1/export", get(api::export))
        .route("/v1/stats", get(api::stats))
        .route("/v1/usage", get(api::usage))
        .layer(middleware::from_fn_with_state(
            cfg.request_timeout,
            time_limit,
        ));
    let mcp = Router::new()
        .nest_service("/mcp", mcp::http_service(state.clone(), cfg))
        .layer(middleware::from_fn_with_state(
            cfg.max_body_bytes,
            limit_body,
        ));
    let keyed = v1
        .merge(mcp)
        .layer(middleware::from_fn_with_state(keys, authenticate));
    Router::new()
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .route("/openapi.json", get(api::openapi))
        .merge(keyed)
        .fallback(|| async {
            ApiError::new(http::StatusCode::NOT_FOUND, "not_found", "no such route")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                http::StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this route does not accept that method",
            )
        })
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.metrics.clone(), track))
        .with_state(state)
}

/// Queues every session (of every namespace) holding turns that were stored but never
/// processed — work a previous shutdown left behind.
async fn requeue_unprocessed(
    memory: &Arc<Memory>,
    queue: &mpsc::Sender<worker::Job>,
    waiting: &worker::Waiting,
    metrics: &Metrics,
) -> Result<usize> {
    let m = memory.clone();
    let pending = tokio::task::spawn_blocking(move || -> lycheemem_core::Result<Vec<_>> {
        let mut out = Vec::new();
        for ns in m.store().namespaces()? {
            for (session, _) in m.unprocessed_sessions(&ns)? {
                out.push((ns.clone(), session));
            }
        }
        Ok(out)
    })
    .await??;
    let mut n = 0;
    for (ns, session) in pending {
        // A session whose job already waits needs no second one.
        if !waiting.mark(&ns, &session) {
            continue;
        }
        metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        n += 1;
        if queue
            .send(worker::Job::Process {
                ns: ns.clone(),
                session: session.clone(),
            })
            .await
            .is_err()
        {
            waiting.unmark(&ns, &session);
            bail!("the worker stopped");
        }
    }
    Ok(n)
}

/// Re-queues unprocessed sessions every `every` until shutdown: with a store that several
/// replicas share, a replica that died leaves stored turns that nobody has queued.
fn spawn_sweeper(
    memory: Arc<Memory>,
    queue: mpsc::Sender<worker::Job>,
    waiting: Arc<worker::Waiting>,
    metrics: Arc<Metrics>,
    every: Duration,
    mut down: tokio::sync::watch::Receiver<bool>,
) {
    if every.is_zero() {
        return;
    }
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = down.changed() => return,
            }
            if *down.borrow() {
                return;
            }
            match requeue_unprocessed(&memory, &queue, &waiting, &metrics).await {
                Ok(0) => {}
                Ok(n) => tracing::info!("sweep: queued {n} session(s) with unprocessed turns"),
                Err(e) => tracing::warn!("sweep for unprocessed turns failed: {e:#}"),
            }
        }
    });
}

/// Serves on an already bound listener until `shutdown` resolves, then drains the queue.
pub async fn serve_listener(
    listener: tokio::net::TcpListener,
    memory: Arc<Memory>,
    keys: KeyStore,
    cfg: ServerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    cfg.check()?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() && !cfg.allow_remote {
        bail!(
            "refusing to listen on {addr}: not a loopback address (pass --allow-remote to expose the server)"
        );
    }
    if keys.is_empty() {
        tracing::warn!("no API keys configured: every /v1 and /mcp request will be refused");
    }
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = mpsc::channel(cfg.queue_capacity);
    let waiting = Arc::new(worker::Waiting::default());
    let workers = worker::spawn(
        memory.clone(),
        metrics.clone(),
        rx,
        waiting.clone(),
        cfg.encode_workers,
    )?;
    let requeued = requeue_unprocessed(&memory, &tx, &waiting, &metrics).await?;
    if requeued > 0 {
        tracing::info!("re-queued {requeued} session(s) with unprocessed turns");
    }
    let (down_tx, down_rx) = tokio::sync::watch::channel(false);
    spawn_sweeper(
        memory.clone(),
        tx.clone(),
        waiting.clone(),
        metrics.clone(),
        cfg.sweep_interval,
        down_rx.clone(),
    );
    let state = AppState {
        memory,
        metrics: metrics.clone(),
        queue: tx,
        waiting,
        limits: cfg.limits.clone(),
        queries: Arc::new(tokio::sync::Semaphore::new(
            cfg.limits.max_queries_in_flight,
        )),
        shutting_down: down_rx,
    };
    let live_keys = Arc::new(LiveKeys::new(keys));
    live_keys.watch();
    let app = router(state, live_keys, &cfg);
    let drain_timeout = cfg.drain_timeout;
    let shutdown = async move {
        shutdown.await;
        tracing::info!(
            "shutting down: stopping {} running search(es)/answer(s); then waiting up to {:?} \
             for {} queued encoding job(s) (what is left is processed at the next start)",
            metrics
                .queries_in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            drain_timeout,
            metrics
                .queue_depth
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        let _ = down_tx.send(true);
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving HTTP")?;
    // The router (and with it every queue sender) is gone: the workers finish the queue.
    // Joined on a plain thread, not the runtime's blocking pool: a runtime being dropped waits
    // for its blocking tasks, which would make the drain deadline moot.
    let (done, drained) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        for w in workers {
            let _ = w.join();
        }
        let _ = done.send(());
    });
    match tokio::time::timeout(cfg.drain_timeout, drained).await {
        Ok(_) => tracing::info!("encoding queue drained"),
        Err(_) => tracing::warn!(
            "encoding did not finish within {:?}; the stored turns are processed at the next start",
            cfg.drain_timeout
        ),
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Binds `cfg.bind` and serves until Ctrl-C / SIGTERM (blocking; builds its own runtime).
pub fn run(memory: Arc<Memory>, keys: KeyStore, cfg: ServerConfig) -> Result<()> {
    if !cfg.bind.ip().is_loopback() && !cfg.allow_remote {
        bail!(
            "refusing to listen on {}: not a loopback address (pass --allow-remote to expose the server)",
            cfg.bind
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.bind)
            .await
            .with_context(|| format!("binding {}", cfg.bind))?;
        eprintln!(
            "lycheemem listening on http://{} (OpenAPI at /openapi.json, MCP at /mcp)",
            listener.local_addr()?
        );
        serve_listener(listener, memory, keys, cfg, shutdown_signal()).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings the server cannot start with are refused with the setting named, before any
    /// channel, semaphore or thread is sized by them.
    #[test]
    fn impossible_server_settings_are_refused() {
        ServerConfig::default().check().unwrap();
        type Damage = fn(&mut ServerConfig);
        let cases: [(&str, Damage); 5] = [
            ("queue", |c| c.queue_capacity = 0),
            ("queue", |c| c.queue_capacity = usize::MAX),
            ("workers", |c| c.encode_workers = 0),
            ("workers", |c| c.encode_workers = 100_000),
            ("searches", |c| c.limits.max_queries_in_flight = usize::MAX),
        ];
        for (what, damage) in cases {
            let mut cfg = ServerConfig::default();
            damage(&mut cfg);
            let err = cfg.check().unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
    }
}
