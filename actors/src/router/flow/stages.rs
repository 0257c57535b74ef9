//! The stages every flow goes through: preprocess → (router learns the active tokens)
//! → denoise worker → postprocess (docs/design.md §Edit request flow), with the
//! bookkeeping they share: the handles a request holds, retries after a lost worker,
//! cancellation checks, and the stage timings.
//!
//! The router owns each request's lifetime: it holds every shared-memory handle the
//! request produced and releases them (a `Release` message to each owner) when it is
//! done, whether the request succeeded or not. When a worker process dies under a
//! request (`ErrorKind::WorkerLost`), the flow starts over on the surviving or
//! restarted workers from the bytes it still holds, so a crash loses nothing.

use std::time::Instant;

use denoised_models::flux::cost::StepShape;
use denoised_runtime::shm::Handle;
use ractor::ActorCell;

use crate::node::{self, Shm};
use crate::router::state::jobs::JobStatus;
use crate::router::state::Ctx;
use crate::wire::*;

/// Attempts of a request when workers die under it.
const ATTEMPTS: usize = 3;

/// Handles a request holds, by owner; released when the request is done.
#[derive(Default)]
pub(crate) struct Held {
    pub own: Vec<Handle>,
    pub pre: Vec<(ActorCell, Vec<Handle>)>,
    pub den: Vec<(ActorCell, Vec<Handle>)>,
    pub post: Vec<(ActorCell, Vec<Handle>)>,
}

impl Held {
    pub fn release(self, shm: &Shm) {
        shm.release(&self.own);
        for (c, h) in self.pre {
            node::tell(&c, PreprocessMsg::Release(Wire(h)));
        }
        for (c, h) in self.den {
            node::tell(&c, DenoiseMsg::Release(Wire(h)));
        }
        for (c, h) in self.post {
            node::tell(&c, PostprocessMsg::Release(Wire(h)));
        }
    }
}

/// Runs `attempt` until it succeeds or fails for a reason other than a lost worker.
pub(crate) async fn with_retries<T, F, Fut>(
    ctx: &Ctx,
    job: JobId,
    mut attempt: F,
) -> Result<(T, usize), WireError>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T, WireError>>,
{
    let mut last = None;
    for n in 1..=ATTEMPTS {
        match attempt(n).await {
            Err(e) if e.kind == ErrorKind::WorkerLost => {
                tracing::warn!(
                    "job {job:x}: {}; retrying (attempt {n} of {ATTEMPTS})",
                    e.message
                );
                ctx.jobs.stage(job, JobStatus::Queued, None);
                last = Some(e);
            }
            r => return r.map(|t| (t, n)),
        }
    }
    Err(last.unwrap_or_else(|| WireError::internal("no attempt ran")))
}

/// The preprocess stage on a picked worker; its tensors stay held until the request
/// ends.
pub(crate) async fn preprocess(
    ctx: &Ctx,
    job: JobId,
    prepare: PrepareReq,
    held: &mut Held,
) -> Result<PreparedRefs, WireError> {
    // A cancel is checked before every stage as well as after, so a cancelled request
    // starts no further work, whatever state the cancel found it in.
    ctx.check_cancel(job).await?;
    ctx.jobs.stage(job, JobStatus::Preprocessing, None);
    let pre = ctx.pick(groups::PREPROCESS, 0).await?;
    let prepared = ctx
        .ask(&pre, |p| PreprocessMsg::Prepare(Wire(prepare), p))
        .await?;
    held.pre.push((pre, prepared.handles()));
    ctx.check_cancel(job).await?;
    Ok(prepared)
}

/// The denoise stage on a picked worker: the request joins its running batch. The
/// final latent (and a capture's cache) stay held until the request ends.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn denoise(
    ctx: &Ctx,
    job: JobId,
    prepared: &PreparedRefs,
    steps: u32,
    active: Vec<u32>,
    work: DenoiseWork,
    loras: Vec<WireLora>,
    held: &mut Held,
) -> Result<Denoised, WireError> {
    ctx.check_cancel(job).await?;
    let shape = step_shape(prepared, &work, active.len());
    let template = match &work {
        DenoiseWork::Edit { template, .. } => Some(template),
        _ => None,
    };
    let t_route = Instant::now();
    let den = ctx
        .pick_denoise(job, shape, run_steps(&work, steps), template)
        .await?;
    // Time waiting here for a worker with room is queueing too.
    let routed_s = t_route.elapsed().as_secs_f64();
    ctx.jobs.stage(job, JobStatus::Denoising, Some(den.clone()));
    let req = DenoiseReq {
        job,
        inputs: prepared.inputs.clone(),
        steps,
        rows: prepared.rows,
        cols: prepared.cols,
        active,
        work,
        loras,
        preview_every: ctx.jobs.preview_every(job).await,
    };
    let d = send_denoise(ctx, &den, routed_s, req).await?;
    held.den.push((den, d.handles()));
    ctx.check_cancel(job).await?;
    Ok(d)
}

/// What a request costs a step, as the router prices it.
pub(crate) fn step_shape(prepared: &PreparedRefs, work: &DenoiseWork, active: usize) -> StepShape {
    let image = (prepared.rows * prepared.cols) as usize;
    StepShape {
        // The conditioning's rows (text tokens; the last dimension is its width).
        text: {
            let t = &prepared.inputs.txt;
            t.numel().unwrap_or(0) / t.shape.last().copied().unwrap_or(1).max(1)
        },
        active: match work {
            DenoiseWork::Edit { .. } => active,
            _ => image,
        },
        image,
    }
}

/// The steps a request runs: a generation that starts from a cached state runs only
/// the rest of its steps.
pub(crate) fn run_steps(work: &DenoiseWork, steps: u32) -> u32 {
    match work {
        DenoiseWork::Generate { start_at, .. } => steps.saturating_sub(*start_at),
        _ => steps,
    }
}

/// Sends a request to the denoise worker it was placed on and waits for it; the worker
/// is settled in the balancer whatever the outcome.
pub(crate) async fn send_denoise(
    ctx: &Ctx,
    den: &ActorCell,
    routed_s: f64,
    req: DenoiseReq,
) -> Result<Denoised, WireError> {
    let job = req.job;
    let worker = den.get_name().unwrap_or_default();
    let d = ctx.ask(den, |p| DenoiseMsg::Denoise(Wire(req), p)).await;
    ctx.balancer.settle(&worker, job);
    let mut d = d.inspect_err(|e| {
        if e.kind == ErrorKind::Timeout {
            // Past its deadline: stop computing it.
            node::tell(den, DenoiseMsg::Cancel(Wire(job)));
        }
    })?;
    d.stats.queue_s += routed_s;
    Ok(d)
}

/// A disaggregated request's stage timings (`total_s` is set by the caller).
pub(crate) fn stage_timings(prepared: &PreparedRefs, d: &Denoised, f: &Finished) -> StageTimings {
    StageTimings {
        queue_s: d.stats.queue_s,
        preprocess_s: prepared.seconds,
        denoise_s: d.stats.denoise_s,
        postprocess_s: f.seconds,
        total_s: 0.0,
        vae_encode: prepared.vae_pass,
        vae_decode: f.vae_pass,
        prompt_cache: PromptCache::of(prepared.prompt_cache_hit),
    }
}

/// The postprocess request of a denoised request: its final latent and its prepared
/// image and mask, with no template (callers set `template` and `vae` where they have
/// them).
pub(crate) fn finish_req(
    job: JobId,
    prepared: &PreparedRefs,
    d: &Denoised,
    params: FinishParams,
) -> FinishReq {
    FinishReq {
        job,
        latents: d.latents.clone(),
        image: prepared.image.clone(),
        mask: prepared.mask.clone(),
        width: prepared.width,
        height: prepared.height,
        params,
        template: None,
        vae: VaeTraces::None,
        source: prepared.source.clone(),
    }
}

/// The postprocess stage on a picked worker; its image (and trace) stay held until
/// the request ends.
pub(crate) async fn postprocess(
    ctx: &Ctx,
    job: JobId,
    fin: FinishReq,
    held: &mut Held,
) -> Result<Finished, WireError> {
    ctx.check_cancel(job).await?;
    ctx.jobs.stage(job, JobStatus::Postprocessing, None);
    let post = ctx.pick(groups::POSTPROCESS, 2).await?;
    let f = ctx
        .ask(&post, |p| PostprocessMsg::Finish(Wire(fin), p))
        .await?;
    held.post.push((post, f.handles()));
    ctx.check_cancel(job).await?;
    Ok(f)
}
