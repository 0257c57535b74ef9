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
use crate::wire::{ImageFormat, JobId, WireError};

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

/// What a synchronous reply's body is, by the request's `Accept`: JSON (the default,
/// and for `*/*`), or the image's own bytes (`image/png`, `image/jpeg`, `image/webp`;
/// `image/*`: in the request's `format`). The first range it names that is one of these decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    Json,
    Image(Option<ImageFormat>),
}

impl Body {
    pub(crate) fn of(headers: &header::HeaderMap) -> Body {
        let accept = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|r| {
                r.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        for range in accept {
            match range.as_str() {
                "application/json" | "*/*" => return Body::Json,
                "image/png" => return Body::Image(Some(ImageFormat::Png)),
                "image/jpeg" => return Body::Image(Some(ImageFormat::Jpeg)),
                "image/webp" => return Body::Image(Some(ImageFormat::Webp)),
                "image/*" => return Body::Image(None),
                _ => {}
            }
        }
        Body::Json
    }

    /// The format the image is made in: the one `Accept` names, else the request's.
    pub(crate) fn format(self, asked: ImageFormat) -> ImageFormat {
        match self {
            Body::Image(Some(f)) => f,
            _ => asked,
        }
    }

    /// The reply: `reply` as JSON, or `image` (encoded as `format`) with `reply`'s
    /// fields in `x-denoised-*` headers (a field that is an object or a list, as
    /// compact JSON).
    pub(crate) fn reply<T: Serialize>(
        self,
        reply: &T,
        image: &[u8],
        format: ImageFormat,
    ) -> Response {
        if self == Body::Json {
            return Json(reply).into_response();
        }
        let mut r = (
            StatusCode::OK,
            [(header::CONTENT_TYPE, format.mime())],
            image.to_vec(),
        )
            .into_response();
        let fields = serde_json::to_value(reply).unwrap_or_default();
        for (k, v) in fields.as_object().into_iter().flatten() {
            let value = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => continue,
                other => other.to_string(),
            };
            let name = format!("x-denoised-{}", k.replace('_', "-"));
            if let (Ok(n), Ok(v)) = (
                header::HeaderName::try_from(name),
                header::HeaderValue::from_str(&value),
            ) {
                r.headers_mut().insert(n, v);
            }
        }
        r
    }
}
