//! The life of a request, as the router drives it: preprocess → (router learns the
//! active tokens) → denoise worker → postprocess → client (docs/design.md §Edit request
//! flow), and the same flow for a template capture, whose cache goes to the cache actor.
//!
//! The router owns each request's lifetime: it holds every shared-memory handle the
//! request produced and releases them (a `Release` message to each owner) when it is
//! done, whether the request succeeded or not. When a worker process dies under a
//! request (`ErrorKind::WorkerLost`), the flow starts over on the surviving or
//! restarted workers from the bytes it still holds, so a crash loses nothing.

use std::time::Instant;

use denoised_models::flux::cost::StepShape;
use denoised_models::pipeline::sparse_vae::{SparseVaeSetting, VaePass};
use denoised_models::planner::CacheMode;
use denoised_runtime::shm::Handle;
use ractor::ActorCell;

pub use super::ctx::Ctx;
use super::jobs::Status;
use crate::denoise::actor::unix_now;
use crate::node::{self, Shm};
use crate::wire::*;

/// Attempts of a request when workers die under it.
const ATTEMPTS: usize = 3;

/// Where an edit's image comes from.
pub enum Source {
    Template(String),
    Image(Vec<u8>),
}

pub enum MaskIn {
    Image(Vec<u8>),
    Boxes(Vec<[u32; 4]>),
    Polygons(Vec<Vec<[f32; 2]>>),
}

pub struct EditInput {
    pub source: Source,
    pub mask: MaskIn,
    pub steps: Option<u32>,
    pub guidance: Option<f32>,
    pub prompt: String,
    pub seed: u64,
    pub dilation: u32,
    pub max_sequence_length: u32,
    pub finish: FinishParams,
    /// Its LoRAs (resolved); a template edit runs with its template's instead.
    pub loras: Vec<WireLora>,
    /// Its ControlNets (checked); on a template edit they condition the active tokens.
    pub controlnets: Vec<super::controlnets::ControlNetInput>,
    /// True CFG (runs with a negative prompt and a scale above 1); a template edit's
    /// negative branch reads the same template.
    pub negative_prompt: Option<String>,
    pub true_cfg_scale: f32,
}

impl EditInput {
    /// The negative prompt and scale when true CFG runs.
    pub fn true_cfg(&self) -> Option<(&str, f32)> {
        super::generate::true_cfg_of(self.negative_prompt.as_deref(), self.true_cfg_scale)
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Timings {
    pub queue_s: f64,
    pub preprocess_s: f64,
    pub denoise_s: f64,
    pub postprocess_s: f64,
    pub total_s: f64,
    /// Which VAE passes ran (sparse only for template edits, `[pipeline] sparse_vae`).
    pub vae_encode: VaePass,
    pub vae_decode: VaePass,
    /// `hit` when the prompt's embeddings came from the preprocess worker's prompt
    /// cache (the text encoders did not run), else `miss`.
    pub prompt_cache: &'static str,
}

pub struct EditOutput {
    pub image: Vec<u8>,
    pub width: u32,
    pub height: u32,
    pub tokens: u32,
    pub active: u32,
    pub pixel_ratio: f64,
    pub prompt_truncated: bool,
    pub timings: Timings,
    pub stats: DenoiseStats,
    pub attempts: usize,
    /// The LoRAs it ran with, and the step they applied from.
    pub loras: Vec<super::adapters::LoraApplied>,
    /// How true CFG ran, when it did (always batched in one worker for an edit).
    pub true_cfg: Option<super::generate::TrueCfgOutcome>,
}

pub struct TemplateInput {
    pub id: String,
    pub image: Vec<u8>,
    pub prompt: String,
    pub steps: u32,
    pub guidance: f32,
    pub seed: u64,
    pub max_sequence_length: u32,
    /// Replace a template of the same id instead of refusing (409).
    pub replace: bool,
    /// What the template caches per block.
    pub cache_mode: CacheMode,
    /// Its slabs are stored every this many steps (`[cache] kv_step_stride`).
    pub step_stride: u32,
    /// The LoRAs it is captured with (every edit of it runs with them).
    pub loras: Vec<WireLora>,
}

/// The error of registering an id that is taken.
pub fn exists(id: &str) -> WireError {
    WireError::new(
        ErrorKind::Conflict,
        format!(
            "template `{id}` already exists; DELETE it first, or register with \"replace\": true"
        ),
    )
}

/// Handles a request holds, by owner; released when the request is done.
#[derive(Default)]
pub(super) struct Held {
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
pub(super) async fn with_retries<T, F, Fut>(
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
                ctx.jobs.stage(job, Status::Queued, None);
                last = Some(e);
            }
            r => return r.map(|t| (t, n)),
        }
    }
    Err(last.unwrap_or_else(|| WireError::internal("no attempt ran")))
}

pub(super) async fn check_cancel(ctx: &Ctx, job: JobId) -> Result<(), WireError> {
    if ctx.jobs.is_cancelled(job).await {
        return Err(WireError::new(
            ErrorKind::Cancelled,
            "the request was cancelled",
        ));
    }
    Ok(())
}

/// The preprocess stage on a picked worker; its tensors stay held until the request
/// ends.
pub(super) async fn preprocess(
    ctx: &Ctx,
    job: JobId,
    prepare: PrepareReq,
    held: &mut Held,
) -> Result<PreparedRefs, WireError> {
    // A cancel is checked before every stage as well as after, so a cancelled request
    // starts no further work, whatever state the cancel found it in.
    check_cancel(ctx, job).await?;
    ctx.jobs.stage(job, Status::Preprocessing, None);
    let pre = ctx.pick(groups::PREPROCESS, 0).await?;
    let prepared = ctx
        .ask(&pre, |p| PreprocessMsg::Prepare(Wire(prepare), p))
        .await?;
    held.pre.push((pre, prepared.handles()));
    check_cancel(ctx, job).await?;
    Ok(prepared)
}

/// The denoise stage on a picked worker: the request joins its running batch. The
/// final latent (and a capture's cache) stay held until the request ends.
#[allow(clippy::too_many_arguments)]
pub(super) async fn denoise(
    ctx: &Ctx,
    job: JobId,
    prepared: &PreparedRefs,
    steps: u32,
    active: Vec<u32>,
    work: DenoiseWork,
    loras: Vec<WireLora>,
    held: &mut Held,
) -> Result<Denoised, WireError> {
    check_cancel(ctx, job).await?;
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
    ctx.jobs.stage(job, Status::Denoising, Some(den.clone()));
    let req = DenoiseReq {
        job,
        inputs: prepared.inputs.clone(),
        steps,
        rows: prepared.rows,
        cols: prepared.cols,
        active,
        work,
        loras,
    };
    let d = send_denoise(ctx, &den, routed_s, req).await?;
    held.den.push((den, d.handles()));
    check_cancel(ctx, job).await?;
    Ok(d)
}

/// What a request costs a step, as the router prices it.
pub(super) fn step_shape(prepared: &PreparedRefs, work: &DenoiseWork, active: usize) -> StepShape {
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
pub(super) fn run_steps(work: &DenoiseWork, steps: u32) -> u32 {
    match work {
        DenoiseWork::Generate { start_at, .. } => steps.saturating_sub(*start_at),
        _ => steps,
    }
}

/// Sends a request to the denoise worker it was placed on and waits for it; the worker
/// is settled in the balancer whatever the outcome.
pub(super) async fn send_denoise(
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

impl Timings {
    /// A disaggregated request's stage timings (`total_s` is set by the caller).
    pub(super) fn of_stages(prepared: &PreparedRefs, d: &Denoised, f: &Finished) -> Self {
        Timings {
            queue_s: d.stats.queue_s,
            preprocess_s: prepared.seconds,
            denoise_s: d.stats.denoise_s,
            postprocess_s: f.seconds,
            total_s: 0.0,
            vae_encode: prepared.vae_pass,
            vae_decode: f.vae_pass,
            prompt_cache: hit_or_miss(prepared.prompt_cache_hit),
        }
    }
}

fn hit_or_miss(hit: bool) -> &'static str {
    if hit {
        "hit"
    } else {
        "miss"
    }
}

/// The postprocess request of a denoised request: its final latent and its prepared
/// image and mask, with no template (callers set `template` and `vae` where they have
/// them).
pub(super) fn finish_req(
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
    }
}

/// The postprocess stage on a picked worker; its image (and trace) stay held until
/// the request ends.
pub(super) async fn postprocess(
    ctx: &Ctx,
    job: JobId,
    fin: FinishReq,
    held: &mut Held,
) -> Result<Finished, WireError> {
    check_cancel(ctx, job).await?;
    ctx.jobs.stage(job, Status::Postprocessing, None);
    let post = ctx.pick(groups::POSTPROCESS, 2).await?;
    let f = ctx
        .ask(&post, |p| PostprocessMsg::Finish(Wire(fin), p))
        .await?;
    held.post.push((post, f.handles()));
    check_cancel(ctx, job).await?;
    Ok(f)
}

/// Runs an edit to its encoded image.
pub async fn edit(ctx: &Ctx, job: JobId, input: &EditInput) -> Result<EditOutput, WireError> {
    let t0 = Instant::now();
    // The template (404 before any work), and the steps and guidance it fixes.
    // Pinned: a DELETE (or replacement) while this edit runs does not pull the
    // template's slices from under it.
    let template = match &input.source {
        Source::Template(id) => Some(ctx.pin_template(id).await?),
        Source::Image(_) => None,
    };
    let r = edit_pinned(ctx, job, input, template.as_ref(), t0).await;
    if let Some(t) = &template {
        ctx.unpin(t).await;
    }
    if let Ok(o) = &r {
        ctx.metrics.observe_edit(o);
    }
    r
}

async fn edit_pinned(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    t0: Instant,
) -> Result<EditOutput, WireError> {
    let (steps, guidance) = match template {
        Some(t) => {
            let i = &t.info;
            if input.steps.is_some_and(|s| s != i.steps)
                || input.guidance.is_some_and(|g| g != i.guidance)
            {
                return Err(WireError::bad_input(format!(
                    "template `{}` was captured with steps {} and guidance {}; an edit of it must use the same",
                    i.id, i.steps, i.guidance
                )));
            }
            let same = input.loras.len() == i.loras.len()
                && input
                    .loras
                    .iter()
                    .zip(&i.loras)
                    .all(|(a, b)| a.name == b.name && a.scale == b.scale);
            if !input.loras.is_empty() && !same {
                return Err(WireError::bad_input(format!(
                    "template `{}` was captured with LoRAs [{}]; an edit of it runs with those (omit `loras`)",
                    i.id,
                    super::adapters::set_key(&i.loras)
                )));
            }
            (i.steps, i.guidance)
        }
        None => (input.steps.unwrap_or(28), input.guidance.unwrap_or(30.0)),
    };
    ctx.jobs.steps(job, steps);
    let params = GenParams {
        prompt: input.prompt.clone(),
        steps,
        guidance,
        seed: input.seed,
        max_sequence_length: input.max_sequence_length,
        dilation: input.dilation,
    };
    let (mut out, attempts) = with_retries(ctx, job, |_| async {
        let mut held = Held::default();
        let r = edit_once(ctx, job, input, template, &params, &mut held).await;
        held.release(&ctx.shm);
        r
    })
    .await?;
    out.attempts = attempts;
    out.timings.total_s = t0.elapsed().as_secs_f64();
    Ok(out)
}

async fn edit_once(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    params: &GenParams,
    held: &mut Held,
) -> Result<EditOutput, WireError> {
    let image = match (&input.source, template) {
        (_, Some(t)) => t.image.clone(),
        (Source::Image(b), None) => {
            let h = ctx.shm.write_bytes(b)?;
            held.own.push(h.clone());
            h
        }
        (Source::Template(_), None) => unreachable!("resolved by the caller"),
    };
    let mask = match &input.mask {
        MaskIn::Image(b) => {
            let h = ctx.shm.write_bytes(b)?;
            held.own.push(h.clone());
            MaskSpec::Image(h)
        }
        MaskIn::Boxes(b) => MaskSpec::Boxes(b.clone()),
        MaskIn::Polygons(p) => MaskSpec::Polygons(p.clone()),
    };
    let prepare = PrepareReq {
        job,
        input: PrepareInput::Edit {
            image,
            mask,
            vae: match template {
                Some(t) => VaeTraces::Edit(t.vae_traces.clone()),
                None => VaeTraces::None,
            },
            negative_prompt: input.true_cfg().map(|(n, _)| n.to_string()),
        },
        params: params.clone(),
        max_pixels: ctx.config.server.max_pixels as u64,
    };
    // A template edit computes only the active tokens against the template's cache;
    // an inline image is a full, uncached run. The template's cache is asked for only
    // when the denoise stage needs it: one on disk loads meanwhile.
    type Extras = (Option<(NegativeHandles, f32)>, Option<ControlStreamRef>);
    let work = |blob: Option<Handle>, (true_cfg, control): Extras| match (template, blob) {
        (Some(t), Some(blob)) => DenoiseWork::Edit {
            template: TemplateRef {
                id: t.info.id.clone(),
                version: t.version,
                blob,
                steps: t.info.steps,
                tokens: t.info.tokens,
                step_stride: t.info.kv_step_stride,
            },
            true_cfg,
            control,
        },
        _ => DenoiseWork::Full { true_cfg, control },
    };
    let loaded = async {
        match template {
            Some(t) => ctx.template_loaded(t).await.map(Some),
            None => Ok(None),
        }
    };

    if !ctx.config.denoise.disaggregate {
        if !input.controlnets.is_empty() || input.true_cfg().is_some() {
            return Err(WireError::bad_input(
                "ControlNets and true CFG run on the disaggregated workers only ([denoise] disaggregate = true)",
            ));
        }
        let work = work(loaded.await?.and_then(|t| t.blob), (None, None));
        let den = ctx.pick(groups::DENOISE, 1).await?;
        ctx.jobs.stage(job, Status::Denoising, Some(den.clone()));
        let req = InlineReq {
            prepare,
            work,
            finish: Some(input.finish.clone()),
        };
        let d = ctx.ask(&den, |p| DenoiseMsg::Inline(Wire(req), p)).await?;
        let img = d
            .image
            .clone()
            .ok_or_else(|| WireError::internal("inline edit returned no image"))?;
        held.den.push((den, vec![img.clone()]));
        let bytes = ctx.shm.read_bytes(&img)?;
        return Ok(EditOutput {
            image: bytes,
            width: d.width,
            height: d.height,
            tokens: d.tokens,
            active: d.active,
            pixel_ratio: d.pixel_ratio,
            prompt_truncated: d.prompt_truncated,
            timings: Timings {
                queue_s: d.stats.queue_s,
                preprocess_s: d.preprocess_s,
                denoise_s: d.stats.denoise_s,
                postprocess_s: d.postprocess_s,
                total_s: 0.0,
                vae_encode: VaePass::Dense,
                vae_decode: VaePass::Dense,
                prompt_cache: hit_or_miss(d.prompt_cache_hit),
            },
            stats: d.stats,
            attempts: 1,
            loras: vec![],
            true_cfg: None,
        });
    }

    let prepared = preprocess(ctx, job, prepare, held).await?;
    let active = match template {
        Some(_) => prepared.active.clone(),
        None => Vec::new(),
    };
    let loaded = loaded.await?;
    let blob = loaded.as_ref().and_then(|t| t.blob.clone());
    // ControlNets on a template edit condition its active tokens only: the rest follow
    // the template, which ran without them.
    let control = match input.controlnets.is_empty() {
        true => None,
        false => {
            let keep = template.map(|_| active.clone());
            let seeded = (params.steps, params.seed);
            let nets = &input.controlnets;
            Some(super::controlnets::start(ctx, job, nets, &prepared, seeded, keep).await?)
        }
    };
    let cfg = match (&prepared.negative, input.true_cfg()) {
        (Some(n), Some((_, scale))) => Some((n.clone(), scale)),
        _ => None,
    };
    let true_cfg = cfg
        .as_ref()
        .map(|&(_, scale)| super::generate::TrueCfgOutcome {
            scale,
            split: false,
        });
    let stream = control.as_ref().and_then(|c| c.stream.clone());
    let work = work(blob.clone(), (cfg, stream));
    // A template edit runs with its template's LoRAs (captured with them at every step).
    let loras = template.map_or_else(|| input.loras.clone(), |t| t.info.loras.clone());
    let d = denoise(
        ctx,
        job,
        &prepared,
        params.steps,
        active,
        work,
        loras.clone(),
        held,
    )
    .await;
    if let Some(c) = &control {
        super::controlnets::stop(c, job);
    }
    let d = d?;

    let fin = FinishReq {
        template: blob,
        vae: match loaded {
            Some(t) => VaeTraces::Edit(t.vae_traces),
            None => VaeTraces::None,
        },
        ..finish_req(job, &prepared, &d, input.finish.clone())
    };
    let f = postprocess(ctx, job, fin, held).await?;
    let bytes = ctx.shm.read_bytes(&f.image)?;
    let tokens = prepared.rows * prepared.cols;
    Ok(EditOutput {
        image: bytes,
        width: prepared.width,
        height: prepared.height,
        tokens,
        active: if template.is_some() {
            prepared.active.len() as u32
        } else {
            tokens
        },
        pixel_ratio: prepared.pixel_ratio,
        prompt_truncated: prepared.prompt_truncated,
        timings: Timings::of_stages(&prepared, &d, &f),
        loras: super::adapters::applied(&loras, d.stats.loras_applied_at),
        stats: d.stats,
        attempts: 1,
        true_cfg,
    })
}

/// Registers a template: a capture run, then the cache goes to the cache actor.
pub async fn capture(
    ctx: &Ctx,
    job: JobId,
    input: &TemplateInput,
) -> Result<TemplateInfo, WireError> {
    let t0 = Instant::now();
    let params = GenParams {
        prompt: input.prompt.clone(),
        steps: input.steps,
        guidance: input.guidance,
        seed: input.seed,
        max_sequence_length: input.max_sequence_length,
        dilation: 0,
    };
    let (info, _) = with_retries(ctx, job, |_| async {
        let mut held = Held::default();
        let r = capture_once(ctx, job, input, &params, &mut held).await;
        held.release(&ctx.shm);
        r
    })
    .await?;
    tracing::info!(
        "template {} registered in {:.2} s ({} bytes of cache)",
        info.id,
        t0.elapsed().as_secs_f64(),
        info.cache_bytes
    );
    Ok(info)
}

async fn capture_once(
    ctx: &Ctx,
    job: JobId,
    input: &TemplateInput,
    params: &GenParams,
    held: &mut Held,
) -> Result<TemplateInfo, WireError> {
    let image = ctx.shm.write_bytes(&input.image)?;
    held.own.push(image.clone());
    // The traces the template's sparse VAE passes read: recorded by the
    // disaggregated workers (the inline baseline runs the VAE dense).
    let record = ctx.config.pipeline.sparse_vae == SparseVaeSetting::Auto;
    let prepare = PrepareReq {
        job,
        input: PrepareInput::Edit {
            image: image.clone(),
            mask: MaskSpec::Empty,
            vae: match record {
                true => VaeTraces::Capture,
                false => VaeTraces::None,
            },
            negative_prompt: None,
        },
        params: params.clone(),
        max_pixels: ctx.config.server.max_pixels as u64,
    };
    let mut vae_traces = Vec::new();
    let (blob, width, height, tokens) = if ctx.config.denoise.disaggregate {
        let prepared = preprocess(ctx, job, prepare, held).await?;
        let work = DenoiseWork::Capture {
            mode: input.cache_mode,
            step_stride: input.step_stride,
        };
        let loras = input.loras.clone();
        let d = denoise(
            ctx,
            job,
            &prepared,
            params.steps,
            Vec::new(),
            work,
            loras,
            held,
        )
        .await?;
        let blob = d
            .cache
            .clone()
            .ok_or_else(|| WireError::internal("capture returned no cache"))?;
        if record {
            // The decoder's trace is the dense decode of the final latent, recorded
            // (when sparse decodes of the template's edits can pay).
            let fin = FinishReq {
                vae: VaeTraces::Capture,
                ..finish_req(
                    job,
                    &prepared,
                    &d,
                    FinishParams::whole_image(ImageFormat::Png),
                )
            };
            let f = postprocess(ctx, job, fin, held).await?;
            vae_traces.extend(prepared.vae_trace.clone());
            vae_traces.extend(f.vae_trace);
        }
        (
            blob,
            prepared.width,
            prepared.height,
            prepared.rows * prepared.cols,
        )
    } else {
        let den = ctx.pick(groups::DENOISE, 1).await?;
        ctx.jobs.stage(job, Status::Denoising, Some(den.clone()));
        let req = InlineReq {
            prepare,
            work: DenoiseWork::Capture {
                mode: input.cache_mode,
                step_stride: input.step_stride,
            },
            finish: None,
        };
        let d = ctx.ask(&den, |p| DenoiseMsg::Inline(Wire(req), p)).await?;
        held.den.push((den, d.cache.iter().cloned().collect()));
        let blob = d
            .cache
            .ok_or_else(|| WireError::internal("capture returned no cache"))?;
        (blob, d.width, d.height, d.tokens)
    };
    let info = TemplateInfo {
        id: input.id.clone(),
        model: ctx.model.clone(),
        width,
        height,
        tokens,
        steps: params.steps,
        guidance: params.guidance,
        seed: params.seed,
        prompt: params.prompt.clone(),
        max_sequence_length: params.max_sequence_length,
        cache_bytes: blob.len,
        created_unix: unix_now(),
        // The cache fills these in.
        kv_dtype: String::new(),
        cache_mode: String::new(),
        kv_step_stride: input.step_stride,
        vae_trace_bytes: vae_traces.iter().map(|h| h.len).sum(),
        tiers: TierBytes::default(),
        loras: input.loras.clone(),
    };
    let cache = ctx.cache().await?;
    let put = PutTemplate {
        info,
        blob,
        image,
        vae_traces,
        replace: input.replace,
    };
    let entry = ctx.ask(&cache, |p| CacheMsg::Put(Wire(put), p)).await?;
    Ok(entry.info)
}
