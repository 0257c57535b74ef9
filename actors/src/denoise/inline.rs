//! The non-disaggregated baseline (`[denoise] disaggregate = false`): the denoise
//! process prepares and finishes its requests itself, on the loop thread, between
//! steps. Every preparation and every VAE decode then stalls the whole running batch,
//! which is the cost that disaggregation removes; this mode exists so that the cost is
//! measured side by side (`denoised bench serve`, docs/performance.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use denoised_models::flux::edit::Mode;
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::pipeline::flux_fill::Prepared;
use denoised_models::FlowMatchEuler;
use denoised_runtime::shm::Handle;
use denoised_runtime::{DType, Tensor};

use super::events::EventCtx;
use super::{DenoiseRequest, LoopCommand, LoopSender};
use crate::daemon::unix_now;
use crate::node::Shm;
use crate::stages::{self, MaskInput, Pipeline};
use crate::wire::{
    DenoiseStats, DenoiseWork, FinishParams, InlineDone, InlineReq, JobId, PrepareInput, Reply,
    Wire, WireError,
};
use crate::workers::preprocess::read_request;

/// A request between its preparation and its reply.
pub struct InlineJob {
    pub reply: Reply<InlineDone>,
    prepared: Prepared,
    /// The input's image and mask when computed at another size.
    source: Option<stages::Source>,
    finish: Option<FinishParams>,
    tokens: u32,
    active: u32,
    pixel_ratio: f64,
    prompt_cache_hit: bool,
    preprocess_s: f64,
    submitted_unix: f64,
}

pub type InlineJobs = Arc<Mutex<HashMap<JobId, InlineJob>>>;

pub fn take(jobs: &InlineJobs, id: JobId) -> Option<InlineJob> {
    jobs.lock().unwrap_or_else(|p| p.into_inner()).remove(&id)
}

/// What the baseline's preparations need of their worker.
pub struct InlineCtx {
    pub loop_tx: LoopSender,
    pub pipeline: Arc<Pipeline>,
    pub shm: Arc<Shm>,
    pub jobs: InlineJobs,
    /// The storage dtype of a capture's template (the device's).
    pub template_dtype: DType,
}

/// Queues the preparation of `req` on the loop thread; it submits the request to the
/// loop when done, or answers the error.
pub fn submit(
    ctx: &InlineCtx,
    req: InlineReq,
    template: Option<Arc<TemplateCache>>,
    reply: Reply<InlineDone>,
) {
    let (loop_tx, template_dtype) = (&ctx.loop_tx, ctx.template_dtype);
    let PrepareInput::Edit { image, mask, .. } = &req.prepare.input else {
        let e = WireError::bad_input(
            "generations run on the disaggregated workers only ([denoise] disaggregate = true)",
        );
        let _ = reply.send(Wire(Err(e)));
        return;
    };
    let (image, mask_bytes) = match read_request(&ctx.shm, image, mask) {
        Ok(r) => r,
        Err(e) => {
            let _ = reply.send(Wire(Err(e)));
            return;
        }
    };
    let mask = mask.clone();
    let (tx, p, jobs) = (loop_tx.clone(), ctx.pipeline.clone(), ctx.jobs.clone());
    loop_tx.send(LoopCommand::Run(Box::new(move || {
        let t0 = Instant::now();
        let mask = MaskInput::new(&mask, mask_bytes.as_deref());
        let params = &req.prepare.params;
        // The baseline runs the VAE dense ([pipeline] sparse_vae is the disaggregated
        // workers').
        let sizes = stages::Sizes {
            max_pixels: req.prepare.max_pixels as usize,
            max_tokens: req.prepare.max_tokens as usize,
        };
        // No template traces (a dense VAE) and no negative prompt (no true CFG).
        let none = (Default::default(), None);
        let built = stages::prepare(&p, &image, mask, params, sizes, none).and_then(|s1| {
            let n = s1.token_mask.len();
            let schedule = FlowMatchEuler::new(&p.scheduler, params.steps as usize, n)
                .map_err(|e| WireError::bad_input(e.to_string()))?;
            let active = s1.token_mask.active().len() as u32;
            let pixel_ratio = s1.token_mask.pixel_ratio;
            let work = match (&req.work, template) {
                (DenoiseWork::Edit { .. }, Some(cache)) => Mode::Edit {
                    mask: Arc::new(s1.token_mask),
                    cache,
                },
                (DenoiseWork::Capture { mode, step_stride }, _) => {
                    let layout = TemplateLayout::for_model(
                        &p.config,
                        p.kind.template_tokens(n),
                        params.steps as usize,
                        template_dtype,
                    )
                    .with_mode(*mode)
                    .with_step_stride(*step_stride as usize);
                    layout
                        .check()
                        .map_err(|e| WireError::bad_input(e.to_string()))?;
                    Mode::Capture(
                        TemplateCache::new(layout)
                            .map_err(|e| WireError::internal(e.to_string()))?,
                    )
                }
                _ => Mode::Full,
            };
            let r = DenoiseRequest {
                id: req.prepare.job,
                inputs: Arc::new(s1.prepared.inputs.clone()),
                schedule: Arc::new(schedule),
                work,
                start_at: 0,
                store_at: Vec::new(),
                preview: None,
                loras: vec![],
                true_cfg: None,
                control: None,
                partner: None,
            };
            let s = (s1.prepared, s1.source);
            Ok((r, s, active, pixel_ratio, s1.prompt_cache_hit))
        });
        match built {
            Ok((r, (prepared, source), active, pixel_ratio, prompt_cache_hit)) => {
                let job = InlineJob {
                    reply,
                    tokens: prepared.inputs.tokens() as u32,
                    prepared,
                    source,
                    finish: req.finish,
                    active,
                    pixel_ratio,
                    prompt_cache_hit,
                    preprocess_s: t0.elapsed().as_secs_f64(),
                    submitted_unix: unix_now(),
                };
                jobs.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(r.id, job);
                tx.send(LoopCommand::Submit(r));
            }
            Err(e) => {
                let _ = reply.send(Wire(Err(e)));
            }
        }
    })));
}

/// A finished inline request: a capture answers at once; an edit queues its decode on
/// the loop thread (between steps, like the preparation).
pub(super) fn finish(
    ctx: &EventCtx,
    job: InlineJob,
    latents: Tensor,
    cache: Option<Handle>,
    mut stats: DenoiseStats,
) {
    stats.queue_s = (stats.first_step_unix - job.submitted_unix).max(0.0);
    let done =
        move |image: Option<Handle>, postprocess_s: f64, job: &InlineJob, stats| InlineDone {
            image,
            cache: cache.clone(),
            width: job.prepared.image.width as u32,
            height: job.prepared.image.height as u32,
            input_size: job
                .source
                .as_ref()
                .map(|s| (s.image.width as u32, s.image.height as u32)),
            tokens: job.tokens,
            active: job.active,
            pixel_ratio: job.pixel_ratio,
            prompt_truncated: job.prepared.prompt_truncated,
            prompt_cache_hit: job.prompt_cache_hit,
            stats,
            preprocess_s: job.preprocess_s,
            postprocess_s,
        };
    let Some(params) = job.finish.clone() else {
        let d = done(None, 0.0, &job, stats);
        let _ = job.reply.send(Wire(Ok(d)));
        return;
    };
    let (p, shm) = (ctx.pipeline.clone(), ctx.shm.clone());
    ctx.loop_tx.send(LoopCommand::Run(Box::new(move || {
        let t0 = Instant::now();
        let r = stages::finish(
            &p,
            (&job.prepared.image, &job.prepared.mask, job.source.as_ref()),
            latents.data(),
            latents.cols(),
            &params,
            None,
            false,
        )
        .and_then(|f| shm.write_bytes(&f.bytes))
        .map(|h| done(Some(h), t0.elapsed().as_secs_f64(), &job, stats));
        let _ = job.reply.send(Wire(r));
    })));
}
