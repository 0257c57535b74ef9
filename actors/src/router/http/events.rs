//! A job's events as Server-Sent Events: `GET /v1/jobs/{id}/events`, and the reply of
//! `POST /v1/edits` and `/v1/generations` with `"stream": true`.
//!
//! Events, in order: `status` (`{"status"}`: queued, preprocessing, denoising,
//! postprocessing), `step` (`{"step", "steps", "elapsed_s"}` after each denoising
//! step), `preview` (`{"step", "steps", "format": "jpeg", "image"}`, base64, every
//! `preview_every` steps when the request asked), and last `done` (the same JSON as the
//! request's non-streamed reply, as `GET /v1/jobs/{id}` keeps it) or `error`
//! (`{"error": {"code", "message"}}`). The stream ends with the job. A client that goes
//! away drops its end of the job table's channel, which the table forgets at the next
//! event or when the job ends: the job runs on and nothing is kept for it.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures_util::stream::{self, StreamExt};
use serde_json::json;
use tokio::sync::mpsc;

use super::error::{ApiError, ApiResult, ErrorBody};
use super::jobs::job_id;
use super::respond::with_id;
use crate::router::state::jobs::{JobEvent, JobStatus, JobView};
use crate::router::state::Ctx;
use crate::wire::JobId;

/// The events of a job until it ends.
#[utoipa::path(get, path = "/v1/jobs/{id}/events", tag = "jobs",
    params(("id" = String, Path, description = "The job's id (`job_...`).")),
    responses(
        (status = 200, description = "`text/event-stream`: `status`, `step`, `preview` and, last, `done` or `error` (docs/api.md).",
            content_type = "text/event-stream", body = String),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown job (or its result expired).", body = ErrorBody),
    ))]
pub(crate) async fn job_events(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    match events(&ctx, job).await {
        Some(r) => Ok(r),
        None => Err(super::jobs::unknown(&id)),
    }
}

/// The SSE reply of `job` (`None`: no such job).
pub(crate) async fn events(ctx: &Arc<Ctx>, job: JobId) -> Option<Response> {
    let (view, rx) = ctx.jobs.watch(job).await?;
    let first = status(view.status);
    let state = Stream1 {
        ctx: ctx.clone(),
        job,
        rx,
        ended: false,
    };
    let rest = stream::unfold(state, next);
    let all = stream::iter([Ok(first)]).chain(rest);
    let sse = Sse::new(all).keep_alive(KeepAlive::default());
    Some(with_id(job, sse.into_response()))
}

struct Stream1 {
    ctx: Arc<Ctx>,
    job: JobId,
    rx: Option<mpsc::Receiver<JobEvent>>,
    ended: bool,
}

async fn next(mut s: Stream1) -> Option<(Result<Event, Infallible>, Stream1)> {
    if s.ended {
        return None;
    }
    if let Some(rx) = &mut s.rx {
        if let Some(e) = rx.recv().await {
            return Some((Ok(event(e)), s));
        }
    }
    // The job ended (its channel closed, or it had ended before): its last event.
    s.ended = true;
    let view = s.ctx.jobs.get(s.job).await;
    Some((Ok(end(view)), s))
}

fn status(st: JobStatus) -> Event {
    data(Event::default().event("status"), &json!({ "status": st }))
}

fn event(e: JobEvent) -> Event {
    match e {
        JobEvent::Status(st) => status(st),
        JobEvent::Step {
            step,
            steps,
            elapsed_s,
        } => data(
            Event::default().event("step"),
            &json!({ "step": step, "steps": steps, "elapsed_s": elapsed_s }),
        ),
        JobEvent::Preview { step, steps, jpeg } => {
            let image = base64::engine::general_purpose::STANDARD.encode(&*jpeg);
            data(
                Event::default().event("preview"),
                &json!({ "step": step, "steps": steps, "format": "jpeg", "image": image }),
            )
        }
    }
}

/// `done` with the job's reply, or `error`.
fn end(view: Option<JobView>) -> Event {
    match view {
        Some(JobView {
            status: JobStatus::Succeeded,
            result,
            ..
        }) => data(Event::default().event("done"), &result.unwrap_or_default()),
        Some(JobView { error: Some(e), .. }) => {
            let body = ErrorBody {
                error: ApiError::from(e).detail(),
            };
            data(Event::default().event("error"), &body)
        }
        _ => data(
            Event::default().event("error"),
            &json!({"error": {"code": "not_found", "message": "the job's result expired"}}),
        ),
    }
}

fn data(e: Event, v: &impl serde::Serialize) -> Event {
    e.json_data(v)
        .unwrap_or_else(|_| Event::default().event("error"))
}
