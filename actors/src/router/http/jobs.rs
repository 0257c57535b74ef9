//! The job routes: `GET /v1/jobs/{id}` (a request's stage, progress, and an async
//! request's result), `DELETE /v1/jobs/{id}` (cancel).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use super::error::{ApiError, ApiResult};
use crate::daemon::parse_job_name;
use crate::router::state::jobs::JobStatus;
use crate::router::state::Ctx;
use crate::wire::{DenoiseMsg, ErrorKind, Wire, WireError};

fn job_id(s: &str) -> ApiResult<u64> {
    parse_job_name(s).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{s}`"),
        )
    })
}

pub(crate) async fn get_job(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    let Some(view) = ctx.jobs.get(job).await else {
        if ctx.lost_jobs.as_ref().is_some_and(|r| r.contains(&job)) {
            // A job of a router that died: whatever it was doing is gone.
            let e = ApiError::from(WireError::new(
                ErrorKind::Unavailable,
                "the router restarted while this job ran (or after it ended), and the job was lost with it: submit it again",
            ));
            let v = json!({"id": id, "status": "failed", "error": {"code": e.code, "message": e.message}});
            return Ok(Json(v).into_response());
        }
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{id}`"),
        ));
    };
    let mut v = json!(view);
    if let Some(e) = view.error {
        let e = ApiError::from(e);
        v["error"] = json!({"code": e.code, "message": e.message});
    }
    Ok(Json(v).into_response())
}

/// `DELETE /v1/jobs/{id}`: cancels a running job (it stops at the next step boundary).
pub(crate) async fn cancel_job(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    let (before, worker) = ctx.jobs.cancel(job).await.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{id}`"),
        )
    })?;
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
    if let (JobStatus::Denoising, Some(w)) = (before, worker) {
        crate::node::tell(&w, DenoiseMsg::Cancel(Wire(job)));
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"id": id, "status": "cancelling"})),
    )
        .into_response())
}
