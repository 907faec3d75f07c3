//! Typed API errors: an HTTP status, a machine-readable code and a message, rendered as
//! `{"error": {"code": "...", "message": "..."}}`.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorBody {
    /// Stable code: `unauthorized`, `invalid_json`, `invalid_body`, `invalid_input`,
    /// `unsupported_media_type`, `payload_too_large`, `not_found`, `conflict`, `queue_full`, `busy`,
    /// `shutting_down`, `timeout`, `cancelled`, `model_error`, `internal`.
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

/// An error a handler returns.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_input", message)
    }
    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid API key is required (Authorization: Bearer <key> or x-api-key)",
        )
    }
    pub fn queue_full() -> Self {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            "the encoding queue is full; retry shortly (nothing was stored)",
        )
    }
    pub fn busy(limit: usize) -> Self {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "busy",
            format!("{limit} searches and answers are running; retry shortly"),
        )
    }
    pub fn shutting_down() -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down (nothing was stored)",
        )
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl From<lycheemem_core::Error> for ApiError {
    fn from(e: lycheemem_core::Error) -> Self {
        use lycheemem_core::Error as E;
        match &e {
            E::InvalidInput(m) => ApiError::invalid(m.clone()),
            E::NotFound(m) => ApiError::new(StatusCode::NOT_FOUND, "not_found", m.clone()),
            E::Conflict(m) => ApiError::new(StatusCode::CONFLICT, "conflict", m.clone()),
            // Only seen by a client still waiting (e.g. when the server timed the work out).
            E::Cancelled(m) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "cancelled", m.clone())
            }
            E::Model(m) => ApiError::new(StatusCode::BAD_GATEWAY, "model_error", m.clone()),
            E::Locked(m) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "locked", m.clone()),
            E::Budget(m) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "over_budget", m.clone())
            }
            _ => ApiError::internal(e.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match &r {
            JsonRejection::JsonDataError(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", r.body_text())
            }
            JsonRejection::JsonSyntaxError(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("{} (the body must be UTF-8 JSON)", r.body_text()),
            ),
            JsonRejection::MissingJsonContentType(_) => ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send Content-Type: application/json",
            ),
            _ if r.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "the request body is larger than the configured limit",
            ),
            _ => ApiError::new(r.status(), "invalid_body", r.body_text()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorResponse {
                error: ErrorBody {
                    code: self.code.to_string(),
                    message: self.message,
                },
            }),
        )
            .into_response()
    }
}
