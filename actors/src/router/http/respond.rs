//! What a route that starts work answers: the request id header, the job's task
//! awaited (synchronous) or a 202 with the job's URL (`async`).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::error::{ApiError, ApiResult};
use crate::daemon::job_name;
use crate::wire::WireError;

/// The header that carries a request's id (its job name), on the responses of the
/// routes that create one; log lines of every process name the request by it.
pub const REQUEST_ID: &str = "x-request-id";

pub(crate) fn with_id(job: u64, mut r: Response) -> Response {
    if let Ok(v) = header::HeaderValue::from_str(&job_name(job)) {
        r.headers_mut().insert(REQUEST_ID, v);
    }
    r
}

/// Awaits a request's task. Requests run on their own task so that a client that
/// disconnects does not cancel the flow half-way (which would strand its job and its
/// shared-memory slices); the flow finishes and cleans up either way.
pub(crate) async fn joined<T>(task: tokio::task::JoinHandle<Result<T, WireError>>) -> ApiResult<T> {
    match task.await {
        Ok(r) => r.map_err(ApiError::from),
        Err(e) => Err(ApiError::from(WireError::internal(format!(
            "request task failed: {e}"
        )))),
    }
}

/// The reply to an `async` request: its job, to poll.
#[derive(Serialize, ToSchema)]
pub struct JobAccepted {
    /// The job's id (also the `x-request-id` header).
    pub id: String,
    /// `queued`.
    pub status: String,
    /// Where to poll it (also the `Location` header).
    pub url: String,
}

/// 202 with the job of an `async` request.
pub(crate) fn accepted(job: u64) -> Response {
    let id = job_name(job);
    let url = format!("/v1/jobs/{id}");
    let body = JobAccepted {
        id,
        status: "queued".into(),
        url: url.clone(),
    };
    let r = (StatusCode::ACCEPTED, [(header::LOCATION, url)], Json(body)).into_response();
    with_id(job, r)
}
