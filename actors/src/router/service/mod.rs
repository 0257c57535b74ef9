//! The service layer: the one way a request starts work, for every route that does (edits, template
//! registrations, generations sync and async, the OpenAI images routes, the bus):
//!
//! 1. [`admit`] at the door, before the body is read: one unit of admission, or 429
//!    at once;
//! 2. once the body is checked, a request of `n` images grows its permit to `n` units
//!    ([`units`]: `n` above `[server] max_queued_requests` is a 400, never a hang);
//! 3. [`submit`] creates each flow's job and runs the flow on its own task, which owns
//!    the flow's unit: the unit is released when the flow ends, not when the HTTP
//!    handler returns. A client that disconnects, or a request of `n` images whose
//!    first image failed, does not free the slots of flows still running, so
//!    `max_queued_requests` bounds the flows in the daemon (and every queue behind the
//!    router), not the handlers.

use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use tokio::task::JoinHandle;

use crate::daemon::job_name;
use crate::router::state::admission::Permit;
use crate::router::state::jobs::{JobStatus, Previews};
use crate::router::state::Ctx;
use crate::wire::pods::EditOutput;
use crate::wire::{DenoiseMsg, ImageFormat, JobId, Wire, WireError};

mod views;
pub mod webhooks;

pub use views::{encode_b64, BatchSizes, EditReply, GenerationReply};

/// A request's first unit, taken before its body is read (429 when the server is full,
/// 503 while it drains).
pub fn admit(ctx: &Ctx) -> Result<Permit, WireError> {
    ctx.admission.try_admit()
}

/// `permit` grown to one unit per image of a request of `n`, each to be moved into its
/// flow by [`submit`].
pub fn units(permit: Permit, n: u32) -> Result<Vec<Permit>, WireError> {
    permit.into_units(n as usize)
}

/// A flow started by [`submit`]: its job, and its task (awaiting it is optional: the
/// flow runs to its end either way).
pub struct Submitted<T> {
    pub job: JobId,
    pub task: JoinHandle<Result<T, WireError>>,
}

/// Starts one flow as a job of the job table (`kind`, `steps` as far as known, the
/// `previews` its request asked for), on its own task that owns `permit` until the
/// flow ends. `flow` runs the work; `describe`
/// makes what the job table keeps of a success (the description; the image only for
/// an async request, whose client reads it there).
pub fn submit<T, D, Fut>(
    ctx: &Arc<Ctx>,
    permit: Permit,
    kind: &'static str,
    steps: u32,
    previews: Previews,
    flow: impl FnOnce(Arc<Ctx>, JobId) -> Fut,
    describe: impl FnOnce(JobId, &T) -> D + Send + 'static,
) -> Submitted<T>
where
    T: Send + 'static,
    D: Serialize,
    Fut: Future<Output = Result<T, WireError>> + Send + 'static,
{
    let job = ctx.next_job();
    ctx.jobs.create(job, kind, steps, previews);
    let run = flow(ctx.clone(), job);
    let ctx = ctx.clone();
    let task = spawn_request(job, async move {
        // Released when this task ends, whatever became of the request's handler.
        let _permit = permit;
        let r = run.await;
        ctx.jobs.finish(
            job,
            r.as_ref()
                .map(|o| serde_json::to_value(describe(job, o)).unwrap_or_default())
                .map_err(Clone::clone),
        );
        r
    });
    Submitted { job, task }
}

/// Work from a peer in the cluster (an edit from another service on the bus, an edit
/// or a generation another pod forwarded): one unit of admission or its refusal at
/// once, the flow run as a job like an HTTP request's (`kind`, the `previews` it asked
/// for; the job table keeps `describe`'s description, not the image), and `answer`
/// called with its end, on a task of its own so that the calling actor keeps taking
/// messages.
pub fn submit_peer<T, D, Fut>(
    ctx: &Arc<Ctx>,
    (kind, previews): (&'static str, Previews),
    flow: impl FnOnce(Arc<Ctx>, JobId) -> Fut,
    describe: impl FnOnce(JobId, &T) -> D + Send + 'static,
    answer: impl FnOnce(Result<(JobId, T), WireError>) + Send + 'static,
) where
    T: Send + 'static,
    D: Serialize,
    Fut: Future<Output = Result<T, WireError>> + Send + 'static,
{
    let permit = match admit(ctx) {
        Ok(p) => p,
        Err(e) => return answer(Err(e)),
    };
    let Submitted { job, task } = submit(ctx, permit, kind, 0, previews, flow, describe);
    tokio::spawn(async move {
        let r = task
            .await
            .unwrap_or_else(|e| Err(WireError::internal(format!("request task failed: {e}"))));
        answer(r.map(|o| (job, o)));
    });
}

/// An edit from a peer ([`submit_peer`]), its description an edit's reply's.
pub fn submit_peer_edit<Fut>(
    ctx: &Arc<Ctx>,
    format: ImageFormat,
    previews: Previews,
    flow: impl FnOnce(Arc<Ctx>, JobId) -> Fut,
    answer: impl FnOnce(Result<(JobId, EditOutput), WireError>) + Send + 'static,
) where
    Fut: Future<Output = Result<EditOutput, WireError>> + Send + 'static,
{
    let describe = move |job, o: &EditOutput| EditReply::new(job, o, format, false);
    submit_peer(ctx, ("edit", previews), flow, describe, answer);
}

/// Cancels job `job` (`DELETE /v1/jobs/{id}`, or the pod a forwarded edit came from):
/// it stops at its next step boundary. Its status before; `None` for an unknown job.
pub async fn cancel(ctx: &Ctx, job: JobId) -> Option<JobStatus> {
    let (before, worker) = ctx.jobs.cancel(job).await?;
    if let (JobStatus::Denoising, Some(w)) = (before, worker) {
        crate::node::tell(&w, DenoiseMsg::Cancel(Wire(job)));
    }
    Some(before)
}

/// Runs a request's flow on its own task, inside its span (so every log line of it
/// names the request), and sets the request id header on what `respond` makes of it.
fn spawn_request<T: Send + 'static>(
    job: u64,
    run: impl std::future::Future<Output = Result<T, WireError>> + Send + 'static,
) -> tokio::task::JoinHandle<Result<T, WireError>> {
    use tracing::Instrument;
    let worker = crate::logging::worker();
    tokio::spawn(run.instrument(tracing::info_span!("request", id = %job_name(job), %worker)))
}
