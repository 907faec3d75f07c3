//! The HTTP API: JSON in and out, every `/v1` route confined to the caller's namespace (from
//! its API key), typed errors, and an OpenAPI document generated from these handlers.

use crate::error::{ApiError, ErrorResponse};
use crate::metrics::Metrics;
use crate::worker::Job;
use axum::Json;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use lycheemem::{Memory, NewTurn, QueryOptions};
use lycheemem_core::{Namespace, Role, SessionId};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, oneshot};
use utoipa::{IntoParams, OpenApi, ToSchema};

/// Request limits beyond the body size.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_turns_per_request: usize,
    pub max_question_chars: usize,
    pub max_top_k: usize,
    pub max_page: usize,
    /// Searches and answers running at once (each holds its slot until its work ends, even
    /// when its client has gone); more are refused with 429 `busy`, so waiting LLM calls stay
    /// bounded and a new question never queues behind abandoned ones.
    pub max_queries_in_flight: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_turns_per_request: 512,
            max_question_chars: 8_000,
            max_top_k: 100,
            max_page: 1_000,
            max_queries_in_flight: 16,
        }
    }
}

/// Shared by every handler.
#[derive(Clone)]
pub struct AppState {
    pub memory: Arc<Memory>,
    pub metrics: Arc<Metrics>,
    pub queue: mpsc::Sender<Job>,
    /// Sessions with a processing job waiting in `queue`.
    pub waiting: Arc<crate::worker::Waiting>,
    pub limits: Limits,
    /// Admission of searches and answers (`limits.max_queries_in_flight` permits).
    pub queries: Arc<tokio::sync::Semaphore>,
    /// Turns true when the server begins to shut down: running questions stop their LLM work.
    pub shutting_down: tokio::sync::watch::Receiver<bool>,
}

/// The namespace an authenticated request is confined to.
#[derive(Debug, Clone)]
pub struct Caller(pub Namespace);

type ApiResult<T> = Result<T, ApiError>;

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> lycheemem_core::Result<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("worker task failed: {e}")))?
        .map_err(ApiError::from)
}

/// Runs a question's work (search or answer) off the async runtime: admitted under
/// `max_queries_in_flight` (429 `busy` past it), stopped when the request is dropped (its
/// client went away, or the request timed out), and its LLM usage counted in the metrics when
/// the work ends, whether or not anyone is still waiting for it.
pub(crate) async fn run_query<T: Send + 'static>(
    s: &AppState,
    mut opts: QueryOptions,
    work: impl FnOnce(&Memory, &QueryOptions) -> lycheemem_core::Result<T> + Send + 'static,
    usage: fn(&T) -> &[lycheemem_core::TokenUsage],
) -> ApiResult<T> {
    let Ok(permit) = s.queries.clone().try_acquire_owned() else {
        s.metrics.queries_refused.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::busy(s.limits.max_queries_in_flight));
    };
    let cancel = lycheemem_core::Cancel::new();
    opts.cancel = cancel.clone();
    let on_drop = cancel.on_drop();
    let memory = s.memory.clone();
    let metrics = s.metrics.clone();
    metrics.queries_in_flight.fetch_add(1, Ordering::Relaxed);
    let work = blocking(move || {
        let _permit = permit;
        let result = work(&memory, &opts);
        match &result {
            Ok(v) => metrics.record_usage(usage(v)),
            Err(lycheemem_core::Error::Cancelled(_)) => {
                metrics.queries_cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
        metrics.queries_in_flight.fetch_sub(1, Ordering::Relaxed);
        result
    });
    tokio::pin!(work);
    let mut shutting_down = s.shutting_down.clone();
    let result = tokio::select! {
        result = &mut work => result,
        // Shutdown does not wait for a question's LLM calls: they stop, and it answers 503.
        _ = async { shutting_down.wait_for(|down| *down).await.map(|_| ()) } => {
            cancel.cancel();
            work.await
        }
    };
    on_drop.disarm();
    result
}

fn session_id(s: &str) -> ApiResult<SessionId> {
    SessionId::new(s).map_err(ApiError::from)
}

fn to_value<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

// ---------------------------------------------------------------- health, metrics, openapi

#[derive(Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub version: String,
}

/// Liveness (no key needed).
#[utoipa::path(get, path = "/health", responses((status = 200, body = Health)))]
pub async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// Prometheus metrics (aggregates; no namespace data).
#[utoipa::path(get, path = "/metrics", responses((status = 200, body = String, content_type = "text/plain")))]
pub async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// This document.
pub async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

// ---------------------------------------------------------------- turns

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnIn {
    /// `user` (default), `assistant` or `system`.
    #[serde(default)]
    pub role: Option<String>,
    /// Speaker name in multi-party logs.
    #[serde(default)]
    pub speaker: Option<String>,
    /// The turn's text (`content` is accepted too).
    #[serde(alias = "content")]
    pub text: String,
    /// ISO date or date-time of the turn.
    #[serde(default)]
    pub time: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddTurnsRequest {
    /// The session's date (relative dates in its turns resolve against it).
    #[serde(default)]
    pub date: Option<String>,
    /// Turns (or chat messages) in order.
    #[serde(alias = "messages")]
    pub turns: Vec<TurnIn>,
    /// The session index the first turn belongs at. With it the request is idempotent: turns
    /// at indexes already stored must match (409 `conflict` otherwise) and are not added again,
    /// so a client can retry safely. Without it the turns are appended.
    #[serde(default)]
    pub first_index: Option<u32>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AddTurnsResponse {
    pub session: String,
    /// Index of the first newly stored turn in the session.
    pub first_index: u32,
    pub stored: u64,
    /// Turns of the request already stored at their indexes (a retry); not added again.
    pub already_stored: u64,
    /// Segmentation and encoding run in the background.
    pub queued: bool,
}

/// A queue slot, reserved before anything is stored so that a full queue refuses cleanly.
fn reserve_slot(s: &AppState) -> ApiResult<mpsc::OwnedPermit<Job>> {
    s.queue.clone().try_reserve_owned().map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => ApiError::queue_full(),
        mpsc::error::TrySendError::Closed(_) => ApiError::shutting_down(),
    })
}

/// Stores turns durably and queues their processing (HTTP and MCP adds).
pub(crate) async fn store_and_queue(
    s: &AppState,
    ns: Namespace,
    sid: SessionId,
    date: Option<String>,
    first_index: Option<u32>,
    turns: Vec<NewTurn>,
) -> ApiResult<lycheemem::AppendReceipt> {
    // A session whose job already waits needs no slot: that job will process these turns too.
    // Otherwise a slot is reserved before anything is stored, so a full queue refuses cleanly.
    let permit = if s.waiting.contains(&ns, &sid) {
        None
    } else {
        Some(reserve_slot(s)?)
    };
    let memory = s.memory.clone();
    let (ns2, sid2) = (ns.clone(), sid.clone());
    let receipt =
        blocking(move || memory.append_turns_at(&ns2, &sid2, date.as_deref(), first_index, turns))
            .await?;
    s.metrics
        .turns_stored
        .fetch_add(receipt.count, Ordering::Relaxed);
    // One waiting job per session: if one waits now, it will process these turns too (a
    // reserved slot is given back).
    if s.waiting.mark(&ns, &sid) {
        let job = Job::Process {
            ns: ns.clone(),
            session: sid.clone(),
        };
        let sent = match permit {
            Some(permit) => {
                permit.send(job);
                true
            }
            // The waiting job was taken while these turns were stored: queue another if a slot
            // is free, else leave them to the sweeper (they are durable either way).
            None => s.queue.try_send(job).is_ok(),
        };
        if sent {
            s.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        } else {
            s.waiting.unmark(&ns, &sid);
        }
    }
    Ok(receipt)
}

pub(crate) fn parse_role(r: Option<&str>) -> ApiResult<Role> {
    Ok(match r.unwrap_or("user") {
        "user" | "human" => Role::User,
        "assistant" | "ai" => Role::Assistant,
        "system" => Role::System,
        other => {
            return Err(ApiError::invalid(format!(
                "unknown role {other:?} (user, assistant or system)"
            )));
        }
    })
}

/// Store turns durably; they are segmented and encoded in the background.
#[utoipa::path(post, path = "/v1/sessions/{session}/turns", request_body = AddTurnsRequest,
    params(("session" = String, Path, description = "Session id")),
    responses((status = 202, body = AddTurnsResponse), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 409, body = ErrorResponse),
        (status = 413, body = ErrorResponse), (status = 429, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn add_turns(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(session): Path<String>,
    body: Result<Json<AddTurnsRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<AddTurnsResponse>)> {
    let Json(body) = body?;
    let sid = session_id(&session)?;
    s.limits
        .check_turns(body.turns.len())
        .map_err(ApiError::invalid)?;
    let turns = body
        .turns
        .into_iter()
        .map(|t| {
            Ok(NewTurn {
                role: parse_role(t.role.as_deref())?,
                speaker: t.speaker,
                text: t.text,
                time: t.time,
            })
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let receipt = store_and_queue(&s, ns, sid.clone(), body.date, body.first_index, turns).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(AddTurnsResponse {
            session: sid.to_string(),
            first_index: receipt.first_index,
            stored: receipt.count,
            already_stored: receipt.already_stored,
            queued: true,
        }),
    ))
}

/// Close a session: its last segment is encoded now. Waits for the queue.
#[utoipa::path(post, path = "/v1/sessions/{session}/flush",
    params(("session" = String, Path, description = "Session id")),
    responses((status = 200, description = "Ingest receipt", body = Object),
        (status = 404, body = ErrorResponse), (status = 429, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn flush(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(session): Path<String>,
) -> ApiResult<Json<Value>> {
    let sid = session_id(&session)?;
    let permit = reserve_slot(&s)?;
    let (tx, rx) = oneshot::channel();
    s.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    permit.send(Job::Flush {
        ns,
        session: sid,
        reply: tx,
    });
    let receipt = rx
        .await
        .map_err(|_| ApiError::shutting_down())?
        .map_err(ApiError::from)?;
    Ok(Json(to_value(&receipt)))
}

// ---------------------------------------------------------------- search and answer

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QueryRequest {
    pub question: String,
    /// Evidence items (at least the configured minimum, 15 by default).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// The question's date (ISO); relative dates resolve against it.
    #[serde(default)]
    pub date: Option<String>,
    /// Recent dialogue for the planner.
    #[serde(default)]
    pub context: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SearchResponse {
    /// The retrieval plan.
    #[schema(value_type = Object)]
    pub plan: Value,
    pub plan_fallback: Option<String>,
    /// Evidence items with provenance and scores, best first.
    #[schema(value_type = Vec<Object>)]
    pub evidence: Vec<Value>,
    /// Context the answerer sees besides the evidence (LiCoMemory: its session summary and
    /// triples); absent for LycheeMemory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub context: Vec<Value>,
    /// LLM calls made (planner).
    #[schema(value_type = Vec<Object>)]
    pub usage: Vec<Value>,
    /// Milliseconds per stage.
    #[schema(value_type = Object)]
    pub timings_ms: Value,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AnswerResponse {
    pub answer: String,
    #[schema(value_type = Vec<Object>)]
    pub evidence: Vec<Value>,
    /// As in [`SearchResponse`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub context: Vec<Value>,
    /// Planner and answer calls.
    #[schema(value_type = Vec<Object>)]
    pub usage: Vec<Value>,
    pub tokens: u64,
}

impl Limits {
    /// Why a question (with its `top_k`) is refused, if it is: the checks of the HTTP routes
    /// and the MCP tools.
    pub fn check_question(&self, question: &str, top_k: usize) -> Result<(), String> {
        if question.trim().is_empty() {
            return Err("question is empty".into());
        }
        if question.chars().count() > self.max_question_chars {
            return Err(format!(
                "the question is limited to {} characters",
                self.max_question_chars
            ));
        }
        if top_k > self.max_top_k {
            return Err(format!("top_k is limited to {}", self.max_top_k));
        }
        Ok(())
    }

    /// Why a batch of `turns` turns is refused, if it is.
    pub fn check_turns(&self, turns: usize) -> Result<(), String> {
        if turns == 0 {
            return Err("turns is empty".into());
        }
        if turns > self.max_turns_per_request {
            return Err(format!(
                "a request is limited to {} turns ({turns} given)",
                self.max_turns_per_request
            ));
        }
        Ok(())
    }
}

fn query_options(s: &AppState, q: &QueryRequest) -> ApiResult<QueryOptions> {
    let top_k = q.top_k.unwrap_or(0);
    s.limits
        .check_question(&q.question, top_k)
        .map_err(ApiError::invalid)?;
    Ok(QueryOptions {
        top_k,
        context: q.context.clone().unwrap_or_default(),
        reference_date: q.date.clone(),
        ..QueryOptions::default()
    })
}

/// The evidence retrieval picks for a question (one planner call).
#[utoipa::path(post, path = "/v1/search", request_body = QueryRequest,
    responses((status = 200, body = SearchResponse), (status = 400, body = ErrorResponse),
        (status = 404, body = ErrorResponse), (status = 429, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn search(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    body: Result<Json<QueryRequest>, JsonRejection>,
) -> ApiResult<Json<SearchResponse>> {
    let Json(q) = body?;
    let opts = query_options(&s, &q)?;
    let r = run_query(
        &s,
        opts,
        move |m, opts| m.search(&ns, &q.question, opts),
        |r| &r.usage,
    )
    .await?;
    Ok(Json(SearchResponse {
        plan: to_value(&r.plan),
        plan_fallback: r.plan_fallback.clone(),
        evidence: r.evidence.iter().map(to_value).collect(),
        context: r.context.iter().map(to_value).collect(),
        usage: r.usage.iter().map(to_value).collect(),
        timings_ms: to_value(&r.timings),
    }))
}

/// Answer a question from memory (one planner and one answer call).
#[utoipa::path(post, path = "/v1/answer", request_body = QueryRequest,
    responses((status = 200, body = AnswerResponse), (status = 400, body = ErrorResponse),
        (status = 404, body = ErrorResponse), (status = 429, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn answer(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    body: Result<Json<QueryRequest>, JsonRejection>,
) -> ApiResult<Json<AnswerResponse>> {
    let Json(q) = body?;
    let opts = query_options(&s, &q)?;
    let a = run_query(
        &s,
        opts,
        move |m, opts| m.answer(&ns, &q.question, opts),
        |a| &a.usage,
    )
    .await?;
    Ok(Json(AnswerResponse {
        tokens: a.tokens(),
        evidence: a.search.evidence.iter().map(to_value).collect(),
        context: a.search.context.iter().map(to_value).collect(),
        usage: a.usage.iter().map(to_value).collect(),
        answer: a.text,
    }))
}

// ---------------------------------------------------------------- records and sessions

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct RecordQuery {
    /// Only records of this session.
    pub session: Option<String>,
    #[serde(default)]
    pub offset: usize,
    /// Page size (default 100).
    pub limit: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RecordPage {
    pub total: usize,
    #[schema(value_type = Vec<Object>)]
    pub records: Vec<Value>,
}

/// Memory records, paged.
#[utoipa::path(get, path = "/v1/records", params(RecordQuery),
    responses((status = 200, body = RecordPage)), security(("api_key" = [])))]
pub async fn list_records(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> ApiResult<Json<RecordPage>> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let limit = q.limit.unwrap_or(100).min(s.limits.max_page);
    let memory = s.memory.clone();
    let session = q
        .session
        .as_deref()
        .map(SessionId::new)
        .transpose()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let offset = q.offset;
    let (total, records) = blocking(move || {
        memory
            .store()
            .records_page(&ns, session.as_ref(), offset, limit)
    })
    .await?;
    Ok(Json(RecordPage {
        total,
        records: records.iter().map(to_value).collect(),
    }))
}

/// One record.
#[utoipa::path(get, path = "/v1/records/{id}", params(("id" = String, Path, description = "Record id")),
    responses((status = 200, body = Object), (status = 404, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn get_record(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let memory = s.memory.clone();
    let id2 = id.clone();
    let found = blocking(move || memory.store().records(&ns, &[id2])).await?;
    found
        .first()
        .map(|r| Json(to_value(r)))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("record {id}")))
}

/// Delete one record (its node links and vectors go with it).
#[utoipa::path(delete, path = "/v1/records/{id}", params(("id" = String, Path, description = "Record id")),
    responses((status = 200, description = "Delete receipt", body = Object), (status = 404, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn delete_record(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let memory = s.memory.clone();
    let r = blocking(move || memory.delete_record(&ns, &id)).await?;
    Ok(Json(to_value(&r)))
}

/// Sessions with dates and turn counts.
#[utoipa::path(get, path = "/v1/sessions", responses((status = 200, body = Vec<Object>)),
    security(("api_key" = [])))]
pub async fn list_sessions(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
) -> ApiResult<Json<Vec<Value>>> {
    let memory = s.memory.clone();
    let sessions = blocking(move || memory.store().sessions(&ns)).await?;
    Ok(Json(sessions.iter().map(to_value).collect()))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionDetail {
    #[schema(value_type = Object)]
    pub session: Value,
    /// Segments with finalize reasons and outcomes.
    #[schema(value_type = Vec<Object>)]
    pub segments: Vec<Value>,
}

/// One session and its segments.
#[utoipa::path(get, path = "/v1/sessions/{session}", params(("session" = String, Path, description = "Session id")),
    responses((status = 200, body = SessionDetail), (status = 404, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn get_session(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(session): Path<String>,
) -> ApiResult<Json<SessionDetail>> {
    let sid = session_id(&session)?;
    let memory = s.memory.clone();
    let (info, segments) = blocking(move || {
        let info = memory.store().session(&ns, &sid)?;
        let segments = memory.store().segments(&ns, &sid)?;
        Ok((info, segments))
    })
    .await?;
    let info = info.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("session {session}"),
        )
    })?;
    Ok(Json(SessionDetail {
        session: to_value(&info),
        segments: segments.iter().map(to_value).collect(),
    }))
}

/// Delete a session with its turns and everything derived from them.
#[utoipa::path(delete, path = "/v1/sessions/{session}", params(("session" = String, Path, description = "Session id")),
    responses((status = 200, description = "Delete receipt", body = Object), (status = 404, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn delete_session(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    Path(session): Path<String>,
) -> ApiResult<Json<Value>> {
    let sid = session_id(&session)?;
    let memory = s.memory.clone();
    let r = blocking(move || memory.delete_session(&ns, &sid)).await?;
    Ok(Json(to_value(&r)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ConfirmQuery {
    /// Must be `true`.
    #[serde(default)]
    pub confirm: bool,
}

/// Delete the caller's whole namespace (`?confirm=true`).
#[utoipa::path(delete, path = "/v1/namespace", params(ConfirmQuery),
    responses((status = 200, description = "Delete receipt", body = Object), (status = 400, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn delete_namespace(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    query: Result<Query<ConfirmQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    if !q.confirm {
        return Err(ApiError::invalid(
            "deleting a namespace needs ?confirm=true",
        ));
    }
    let memory = s.memory.clone();
    let r = blocking(move || memory.delete_namespace(&ns)).await?;
    Ok(Json(to_value(&r)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ExportQuery {
    /// Include vectors.
    #[serde(default)]
    pub vectors: bool,
}

/// The namespace as JSON Lines (the `lycheemem export` format).
#[utoipa::path(get, path = "/v1/export", params(ExportQuery),
    responses((status = 200, body = String, content_type = "application/x-ndjson")),
    security(("api_key" = [])))]
pub async fn export(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
    query: Result<Query<ExportQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let memory = s.memory.clone();
    let bytes = blocking(move || {
        let mut out = Vec::new();
        memory.export(&ns, &mut out, q.vectors)?;
        Ok(out)
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], bytes).into_response())
}

/// Counts of the namespace.
#[utoipa::path(get, path = "/v1/stats", responses((status = 200, body = Object), (status = 404, body = ErrorResponse)),
    security(("api_key" = [])))]
pub async fn stats(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    let memory = s.memory.clone();
    let r = blocking(move || memory.stats(&ns)).await?;
    Ok(Json(to_value(&r)))
}

/// Token usage of the namespace by purpose.
#[utoipa::path(get, path = "/v1/usage", responses((status = 200, body = Object)),
    security(("api_key" = [])))]
pub async fn usage(
    State(s): State<AppState>,
    Extension(Caller(ns)): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    let memory = s.memory.clone();
    let r = blocking(move || memory.usage(&ns)).await?;
    Ok(Json(to_value(&r)))
}

struct SecurityAddon;

impl utoipa::Modify for SecurityAddon {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                "api_key",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "lycheemem", description = "Long-term memory for LLM agents. Every /v1 route works in the namespace of the caller's API key (Authorization: Bearer <key>)."),
    paths(health, metrics, add_turns, flush, search, answer, list_records, get_record,
        delete_record, list_sessions, get_session, delete_session, delete_namespace, export,
        stats, usage),
    components(schemas(ErrorResponse, Health, TurnIn, AddTurnsRequest, AddTurnsResponse,
        QueryRequest, SearchResponse, AnswerResponse, RecordPage, SessionDetail)),
    modifiers(&SecurityAddon)
)]
pub struct ApiDoc;
