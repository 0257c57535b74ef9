//! A job's events as Server-Sent Events: `GET /v1/jobs/{id}/events`, and the reply of
//! `POST /v1/edits` and `/v1/generations` with `"stream": true`.
//!
//! Events, in order: `status` (`{"status"}`: queued, preprocessing, denoising,
//! postprocessing; while it waits, with `ahead`: the jobs before it in the queue), `step` (`{"step", "steps", "elapsed_s"}` after each denoising
//! step), `preview` (`{"step", "steps", "format": "jpeg", "image"}`, base64, every
//! `preview_every` steps when the request asked), and last `done` (the same JSON as the
//! request's non-streamed reply, as `GET /v1/jobs/{id}` keeps it) or `error`
//! (`{"error": {"code", "message"}}`). The stream ends with the job. A client that goes
//! away drops its end of the job table's channel, which the table forgets at the next
//! event or when the job ends: the job runs on and nothing is kept for it.
//!
//! OpenAI's streamed images (`stream: true` on `/v1/images/*`) are the same events in
//! OpenAI's shapes ([`Flavour::OpenAi`]): a `*.partial_image` per preview, then
//! `*.completed` with the image.

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
    match events(&ctx, job, Flavour::Native).await {
        Some(r) => Ok(r),
        None => Err(super::jobs::unknown(&id)),
    }
}

/// How a job's events are written.
#[derive(Clone, Debug)]
pub(crate) enum Flavour {
    /// The native API's (module docs).
    Native,
    /// OpenAI's streamed images: `{kind}.partial_image` for each preview (at most
    /// `partials` of them), then `{kind}.completed` with the image of `size`.
    OpenAi {
        kind: &'static str,
        partials: u32,
        size: String,
    },
}

/// The SSE reply of `job` (`None`: no such job). The routes that create the job add
/// its `x-request-id` header (`super::respond`).
pub(crate) async fn events(ctx: &Arc<Ctx>, job: JobId, flavour: Flavour) -> Option<Response> {
    let w = ctx.jobs.watch(job).await?;
    let first = match flavour {
        Flavour::Native => Some(Ok(status(w.view.status, w.ahead))),
        Flavour::OpenAi { .. } => None,
    };
    let state = Watch {
        ctx: ctx.clone(),
        job,
        rx: w.events,
        ended: false,
        flavour,
        partials: 0,
    };
    let rest = stream::unfold(state, next);
    let all = stream::iter(first).chain(rest);
    let sse = Sse::new(all).keep_alive(KeepAlive::default());
    Some(sse.into_response())
}

/// A watcher's stream state.
struct Watch {
    ctx: Arc<Ctx>,
    job: JobId,
    rx: Option<mpsc::Receiver<JobEvent>>,
    ended: bool,
    flavour: Flavour,
    /// OpenAI's partial images sent so far.
    partials: u32,
}

async fn next(mut s: Watch) -> Option<(Result<Event, Infallible>, Watch)> {
    if s.ended {
        return None;
    }
    while let Some(rx) = &mut s.rx {
        let Some(e) = rx.recv().await else { break };
        if let Some(ev) = s.write(e) {
            return Some((Ok(ev), s));
        }
    }
    // The job ended (its channel closed, or it had ended before): its last event.
    s.ended = true;
    let view = s.ctx.jobs.get(s.job).await;
    let last = match &s.flavour {
        Flavour::Native => end(view),
        Flavour::OpenAi { kind, size, .. } => openai_end(kind, size, view),
    };
    Some((Ok(last), s))
}

impl Watch {
    /// `e` as this stream writes it, if it does.
    fn write(&mut self, e: JobEvent) -> Option<Event> {
        let Flavour::OpenAi {
            kind,
            partials,
            size,
        } = &self.flavour
        else {
            return Some(event(e));
        };
        let JobEvent::Preview { jpeg, .. } = e else {
            return None;
        };
        if self.partials >= *partials {
            return None;
        }
        let index = self.partials;
        self.partials += 1;
        let name = format!("{kind}.partial_image");
        let b64 = base64::engine::general_purpose::STANDARD.encode(&*jpeg);
        let mut v = openai_image(&name, size, &b64, "jpeg");
        v["partial_image_index"] = json!(index);
        Some(data(Event::default().event(name), &v))
    }
}

/// `status`, with `ahead` (the jobs in the queue before it) while the job waits.
fn status(st: JobStatus, ahead: Option<u32>) -> Event {
    let mut v = json!({ "status": st });
    if let Some(n) = ahead {
        v["ahead"] = json!(n);
    }
    data(Event::default().event("status"), &v)
}

fn event(e: JobEvent) -> Event {
    match e {
        JobEvent::Status(st, ahead) => status(st, ahead),
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

/// The fields OpenAI's image events share; `quality` and `background` have no meaning
/// here and take the values OpenAI's defaults give.
fn openai_image(kind: &str, size: &str, b64: &str, format: &str) -> serde_json::Value {
    json!({
        "type": kind, "b64_json": b64, "created_at": crate::daemon::unix_now() as u64,
        "size": size, "quality": "auto", "background": "opaque", "output_format": format,
    })
}

/// `{kind}.completed` with the image, or OpenAI's error.
fn openai_end(kind: &str, size: &str, view: Option<JobView>) -> Event {
    let result = view
        .as_ref()
        .filter(|v| v.status == JobStatus::Succeeded)
        .and_then(|v| v.result.as_ref());
    let image = result.and_then(|r| r["image"].as_str());
    match image {
        Some(b64) => {
            let name = format!("{kind}.completed");
            let r = result.expect("an image comes with its result");
            let size = match (r["width"].as_u64(), r["height"].as_u64()) {
                (Some(w), Some(h)) => format!("{w}x{h}"),
                _ => size.to_string(),
            };
            let format = r["format"].as_str().unwrap_or("png");
            let mut v = openai_image(&name, &size, b64, format);
            let none = json!({"image_tokens": 0, "text_tokens": 0});
            v["usage"] = json!({"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                "input_tokens_details": none});
            data(Event::default().event(name), &v)
        }
        None => {
            let e = match view.and_then(|v| v.error) {
                Some(e) => ApiError::from(e),
                None => {
                    ApiError::from(crate::wire::WireError::internal("the job's result expired"))
                }
            };
            let d = e.detail();
            let body = json!({"type": "error", "error": {"message": d.message, "type": d.code, "code": d.code}});
            data(Event::default().event("error"), &body)
        }
    }
}

fn data(e: Event, v: &impl serde::Serialize) -> Event {
    e.json_data(v)
        .unwrap_or_else(|_| Event::default().event("error"))
}
