//! What a route that starts work answers: the request id header, and the job's task
//! awaited (synchronous), a 202 with the job's URL (`async`) or the job's events
//! (`stream`).

use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::error::{ApiError, ApiResult};
use crate::daemon::job_name;
use crate::router::state::Ctx;
use crate::wire::{JobId, WireError};

/// The header that carries a request's id (its job name), on the responses of the
/// routes that create one; log lines of every process name the request by it.
pub const REQUEST_ID: &str = "x-request-id";

pub(crate) fn with_id(job: u64, mut r: Response) -> Response {
    if let Ok(v) = header::HeaderValue::from_str(&job_name(job)) {
        r.headers_mut().insert(REQUEST_ID, v);
    }
    r
}

/// How the client takes the reply.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The image in the response.
    Sync,
    /// 202 and a job to poll.
    Async,
    /// The job's events, the reply in the last one.
    Stream,
}

impl Reply {
    pub(crate) fn of(run_async: bool, stream: bool) -> ApiResult<Reply> {
        match (run_async, stream) {
            (false, false) => Ok(Reply::Sync),
            (true, false) => Ok(Reply::Async),
            (false, true) => Ok(Reply::Stream),
            (true, true) => Err(ApiError::bad("`async` and `stream` do not go together")),
        }
    }
    /// Whether the job table keeps the whole reply (its client reads it there).
    pub(crate) fn keeps_result(self) -> bool {
        self != Reply::Sync
    }
}

/// The reply to a request that started `job` on `task`, as the client asked: `sync`
/// makes a synchronous reply of the result.
pub(crate) async fn respond<T>(
    ctx: &Arc<Ctx>,
    job: JobId,
    task: tokio::task::JoinHandle<Result<T, WireError>>,
    reply: Reply,
    sync: impl FnOnce(&T) -> Response,
) -> ApiResult {
    match reply {
        Reply::Async => Ok(accepted(job)),
        // The job was just created, so it is in the table.
        Reply::Stream => super::events::events(ctx, job, super::events::Flavour::Native)
            .await
            .map(|r| with_id(job, r))
            .ok_or_else(|| super::jobs::unknown(&job_name(job))),
        Reply::Sync => Ok(with_id(
            job,
            match joined(task).await {
                Ok(out) => sync(&out),
                Err(e) => e.into_response(),
            },
        )),
    }
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
