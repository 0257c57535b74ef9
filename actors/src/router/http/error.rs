//! The native API's errors: JSON, `{"error": {"code", "message"}}`, with the matching
//! status: bad input 400, unknown template or job 404, cancelled 409, too large 413,
//! overloaded 429 (with `Retry-After`), workers not up 503, past a deadline 504. A
//! flow's [`WireError`] maps here, at the edge. (The OpenAI-compatible routes answer in
//! OpenAI's shape instead: `super::openai`.)

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::router::state::admission::RETRY_AFTER_S;
use crate::wire::{ErrorKind, WireError};

/// The body of every error of the native API.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// `bad_request`, `unauthorized`, `forbidden`, `not_found`, `method_not_allowed`,
    /// `conflict`, `cancelled`, `too_large`, `overloaded`, `internal`, `unavailable`
    /// or `timeout`.
    pub code: String,
    pub message: String,
}

/// A JSON error response.
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    /// What the error's body says.
    pub(crate) fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code.to_string(),
            message: self.message.clone(),
        }
    }
}

impl From<WireError> for ApiError {
    fn from(e: WireError) -> Self {
        let (status, code) = match e.kind {
            ErrorKind::BadInput => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Cancelled => (StatusCode::CONFLICT, "cancelled"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::WorkerLost | ErrorKind::Unavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ErrorKind::Overloaded => (StatusCode::TOO_MANY_REQUESTS, "overloaded"),
            ErrorKind::Timeout => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        };
        ApiError::new(status, code, e.message)
    }
}

/// An error response's class, for the metrics (`super::routes`' observe layer).
#[derive(Clone, Copy)]
pub(crate) struct ErrorClass(pub(crate) &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.detail(),
        };
        let mut r = (self.status, Json(body)).into_response();
        r.extensions_mut().insert(ErrorClass(self.code));
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(RETRY_AFTER_S),
            );
        }
        r
    }
}

pub(crate) type ApiResult<T = Response> = Result<T, ApiError>;
