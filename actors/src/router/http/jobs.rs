//! The job routes: `GET /v1/jobs/{id}` (a request's stage, progress, and an async
//! request's result), `DELETE /v1/jobs/{id}` (cancel).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::binary::Body;
use super::error::{ApiError, ApiResult, ErrorBody, ErrorDetail};
use crate::daemon::parse_job_name;
use crate::router::service::cancel;
use crate::router::state::jobs::JobStatus;
use crate::router::state::Ctx;
use crate::wire::{ErrorKind, ImageFormat, WireError};

pub(crate) fn job_id(s: &str) -> ApiResult<u64> {
    parse_job_name(s).ok_or_else(|| unknown(s))
}

/// 404 for the job named `s`.
pub(crate) fn unknown(s: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("unknown job `{s}`"),
    )
}

/// A job: its stage and progress, and once it ends its result (an async request's
/// reply, with the image) or its error.
#[derive(Serialize, ToSchema)]
pub struct JobReply {
    pub id: String,
    pub status: JobStatus,
    /// `edit`, `template` or `generation` (absent for a job lost with a router).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Steps done so far, of `steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_unix: Option<f64>,
    /// The request's reply once it succeeded: an `EditReply`, a `GenerationReply` or a
    /// `TemplateInfo`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
}

/// A cancelled job, stopping at its next step.
#[derive(Serialize, ToSchema)]
pub struct Cancelling {
    pub id: String,
    /// `cancelling`.
    pub status: String,
}

/// The stage and progress of a job; once it ends, its result or error.
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id (`job_...`).")),
    responses(
        (status = 200, description = "The job. With `Accept: image/png`, `image/jpeg`, `image/webp` or `image/*`, a job that succeeded with an image (an async or streamed request's) answers its image's bytes in the format it was made in, the result's other fields in `x-denoised-*` headers (`406` while it has none).",
            content((JobReply = "application/json"), (Vec<u8> = "image/*"))),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown job (or its result expired).", body = ErrorBody),
        (status = 406, description = "An image was asked for and the job has none (yet).", body = ErrorBody),
    ))]
pub(crate) async fn get_job(
    State(ctx): State<Arc<Ctx>>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
) -> ApiResult {
    let job = job_id(&id)?;
    match Body::of(&headers) {
        Body::Json => describe(&ctx, job).await,
        asked => image(&ctx, job, &id, asked).await,
    }
}

/// A finished job's image as the binary reply `asked` (its own format: the image was
/// encoded when the job ran).
async fn image(ctx: &Ctx, job: u64, id: &str, asked: Body) -> ApiResult {
    let view = ctx.jobs.get(job).await.ok_or_else(|| unknown(id))?;
    let none = || {
        ApiError::new(
            StatusCode::NOT_ACCEPTABLE,
            "not_acceptable",
            format!(
                "job `{id}` has no image (yet): it is {}; ask for application/json",
                json!(view.status).as_str().unwrap_or("?")
            ),
        )
    };
    let mut result = view.result.clone().ok_or_else(none)?;
    let bytes = result["image"]
        .as_str()
        .map(|s| super::extract::b64("image", s))
        .transpose()?;
    let bytes = bytes.ok_or_else(none)?;
    let format: ImageFormat = serde_json::from_value(result["format"].clone()).unwrap_or_default();
    if let Some(o) = result.as_object_mut() {
        o.remove("image");
    }
    Ok(asked.reply(&result, &bytes, format))
}

/// Job `job` as `GET /v1/jobs/{id}` shows it (also an idempotent request's replay when
/// its first reply was not kept).
pub(crate) async fn describe(ctx: &Ctx, job: u64) -> ApiResult {
    let id = crate::daemon::job_name(job);
    let Some(view) = ctx.jobs.get(job).await else {
        if ctx.lost_jobs.as_ref().is_some_and(|r| r.contains(&job)) {
            // A job of a router that died: whatever it was doing is gone.
            let e = ApiError::from(WireError::new(
                ErrorKind::Unavailable,
                "the router restarted while this job ran (or after it ended), and the job was lost with it: submit it again",
            ));
            let lost = JobReply {
                id,
                status: JobStatus::Failed,
                kind: None,
                step: None,
                steps: None,
                created_unix: None,
                result: None,
                error: Some(e.detail()),
            };
            return Ok(Json(lost).into_response());
        }
        return Err(unknown(&id));
    };
    let reply = JobReply {
        id: view.id,
        status: view.status,
        kind: Some(view.kind.to_string()),
        step: Some(view.step),
        steps: Some(view.steps),
        created_unix: Some(view.created_unix),
        result: view.result,
        error: view.error.map(|e| ApiError::from(e).detail()),
    };
    Ok(Json(reply).into_response())
}

/// Cancels a running job: it stops at its next step boundary.
#[utoipa::path(delete, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id (`job_...`).")),
    responses(
        (status = 202, body = Cancelling),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown job.", body = ErrorBody),
        (status = 409, description = "The job already ended.", body = ErrorBody),
    ))]
pub(crate) async fn cancel_job(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    let before = cancel(&ctx, job).await.ok_or_else(|| unknown(&id))?;
    if before.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "job `{id}` already {}",
                json!(before).as_str().unwrap_or("finished")
            ),
        ));
    }
    let status = "cancelling".to_string();
    Ok((StatusCode::ACCEPTED, Json(Cancelling { id, status })).into_response())
}
