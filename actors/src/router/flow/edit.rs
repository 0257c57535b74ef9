//! The life of an edit: of a template (mask-aware: only the masked tokens are
//! computed against the template's cache) or of an inline image (a full FLUX.1 Fill
//! run). Two ways to run one: the disaggregated flow (preprocess, denoise and
//! postprocess workers, [`super::stages`]) and the in-process baseline
//! (`[denoise] disaggregate = false`: one denoise worker does all three).

use std::time::Instant;

use denoised_models::pipeline::sparse_vae::VaePass;
use denoised_runtime::shm::Handle;

use super::controlnets::ControlNetInput;
use super::defaults;
use super::generate::{true_cfg_of, TrueCfgOutcome};
use super::pod::on_pod;
use super::stages::{
    denoise, finish_req, postprocess, preprocess, stage_timings, with_retries, Held,
};
use crate::router::state::jobs::JobStatus;
use crate::router::state::pods::Need;
use crate::router::state::Ctx;
use crate::wire::pods::{FromPeer, PodEdit, PodMask, PodMsg};
use crate::wire::*;

/// Where an edit's image comes from.
pub enum Source {
    Template(String),
    Image(Vec<u8>),
}

/// What an edit of an uploaded image does under `[templates] auto` (flow/auto.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auto {
    /// Nothing: it runs in full.
    Off,
    /// Reads the image's template when there is one, without counting a sighting (the
    /// second and later images of one OpenAI request, which is one sighting).
    Use,
    /// Counts a sighting, captures the template when that sighting is admitted, and
    /// reads it when there is one.
    See,
}

#[derive(Clone)]
pub enum MaskIn {
    Image(Vec<u8>, MaskChannel),
    Boxes(Vec<[u32; 4]>),
    Polygons(Vec<Vec<[f32; 2]>>),
    /// None given: an instruction edit of the whole image (a FLUX.1 Kontext model; a
    /// Fill model refuses it).
    Whole,
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
    pub controlnets: Vec<ControlNetInput>,
    /// True CFG (runs with a negative prompt and a scale above 1); a template edit's
    /// negative branch reads the same template.
    pub negative_prompt: Option<String>,
    pub true_cfg_scale: f32,
    /// What `[templates] auto` does with an upload (flow/auto.rs).
    pub auto: Auto,
}

impl EditInput {
    /// This edit of another source (an upload's edit as an edit of its template:
    /// without ControlNets, which flow/auto.rs leaves to full runs).
    pub fn of(&self, source: Source) -> Self {
        EditInput {
            source,
            mask: self.mask.clone(),
            steps: self.steps,
            guidance: self.guidance,
            prompt: self.prompt.clone(),
            seed: self.seed,
            dilation: self.dilation,
            max_sequence_length: self.max_sequence_length,
            finish: self.finish.clone(),
            loras: self.loras.clone(),
            controlnets: vec![],
            negative_prompt: self.negative_prompt.clone(),
            true_cfg_scale: self.true_cfg_scale,
            auto: Auto::Off,
        }
    }

    /// An edit of template `id` with every other field at its default (the bus's
    /// edits, which give only these).
    pub fn of_template(id: String, mask_png: Vec<u8>, prompt: String, seed: u64) -> Self {
        EditInput {
            source: Source::Template(id),
            mask: MaskIn::Image(mask_png, MaskChannel::Auto),
            steps: None,
            guidance: None,
            prompt,
            seed,
            dilation: 0,
            max_sequence_length: defaults::MAX_SEQUENCE_LENGTH,
            finish: defaults::finish(ImageFormat::Png, None),
            // A template edit runs with its template's LoRAs.
            loras: vec![],
            controlnets: vec![],
            negative_prompt: None,
            true_cfg_scale: defaults::TRUE_CFG_SCALE,
            auto: Auto::Off,
        }
    }

    /// The edit as it is forwarded to another pod: a template edit without LoRAs or
    /// ControlNets of its own (`None` for others, which run where they arrive).
    pub fn to_pod(&self) -> Option<PodEdit> {
        let Source::Template(template) = &self.source else {
            return None;
        };
        if !self.loras.is_empty() || !self.controlnets.is_empty() {
            return None;
        }
        Some(PodEdit {
            template: template.clone(),
            mask: match &self.mask {
                MaskIn::Image(b, c) => PodMask::Image(b.clone(), *c),
                MaskIn::Boxes(b) => PodMask::Boxes(b.clone()),
                MaskIn::Polygons(p) => PodMask::Polygons(p.clone()),
                MaskIn::Whole => PodMask::Whole,
            },
            steps: self.steps,
            guidance: self.guidance,
            prompt: self.prompt.clone(),
            seed: self.seed,
            dilation: self.dilation,
            max_sequence_length: self.max_sequence_length,
            finish: self.finish.clone(),
            negative_prompt: self.negative_prompt.clone(),
            true_cfg_scale: self.true_cfg_scale,
            origin: None,
        })
    }

    /// A forwarded edit as the pod that runs it takes it.
    pub fn from_pod(e: PodEdit) -> Self {
        EditInput {
            source: Source::Template(e.template),
            mask: match e.mask {
                PodMask::Image(b, c) => MaskIn::Image(b, c),
                PodMask::Boxes(b) => MaskIn::Boxes(b),
                PodMask::Polygons(p) => MaskIn::Polygons(p),
                PodMask::Whole => MaskIn::Whole,
            },
            steps: e.steps,
            guidance: e.guidance,
            prompt: e.prompt,
            seed: e.seed,
            dilation: e.dilation,
            max_sequence_length: e.max_sequence_length,
            finish: e.finish,
            loras: vec![],
            controlnets: vec![],
            negative_prompt: e.negative_prompt,
            true_cfg_scale: e.true_cfg_scale,
            auto: Auto::Off,
        }
    }

    /// The negative prompt and scale when true CFG runs.
    pub fn true_cfg(&self) -> Option<(&str, f32)> {
        true_cfg_of(self.negative_prompt.as_deref(), self.true_cfg_scale)
    }
}

pub use crate::wire::pods::EditOutput;

/// Runs an edit to its encoded image. In a cluster, a template edit goes to the pod the
/// pod policy chooses ([`super::pod::on_pod`]).
pub async fn edit(ctx: &Ctx, job: JobId, input: &EditInput) -> Result<EditOutput, WireError> {
    let (Some(pods), Some(fwd)) = (&ctx.pods, input.to_pod()) else {
        return edit_obtained(ctx, job, input).await;
    };
    // An edit too large to travel between pods (its mask) runs here: its template
    // comes by a copy, which travels in chunks, instead of the edit in one frame.
    if let Err(n) = crate::wire::pods::fits_a_frame(&fwd) {
        tracing::info!("edit of {n} bytes: too large to forward, run here");
        return edit_obtained(ctx, job, input).await;
    }
    let need = Need::Template {
        id: &fwd.template,
        text: fwd.max_sequence_length,
    };
    let forward = |origin, p| {
        let mut e = fwd.clone();
        e.origin = Some(origin);
        PodMsg::Edit(FromPeer::of(e), p)
    };
    on_pod((ctx, pods, job), need, forward, || {
        edit_obtained(ctx, job, input)
    })
    .await
}

/// Runs an edit in this pod (routed here, or forwarded by a peer: never forwarded
/// again), bringing its template in first when this pod lacks it (a copy from a peer,
/// or a capture again from its recipe: [`super::transfer::obtain`]).
pub async fn edit_obtained(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
) -> Result<EditOutput, WireError> {
    match (edit_here(ctx, job, input).await, &input.source) {
        (Err(e), Source::Template(id)) if e.kind == ErrorKind::NotFound && ctx.pods.is_some() => {
            super::transfer::obtain(ctx, job, id, e).await?;
            edit_here(ctx, job, input).await
        }
        (r, _) => r,
    }
}

/// Runs an edit in this pod with the templates it holds.
pub async fn edit_here(ctx: &Ctx, job: JobId, input: &EditInput) -> Result<EditOutput, WireError> {
    let t0 = Instant::now();
    // The template (404 before any work), and the steps and guidance it fixes.
    // Pinned: a DELETE (or replacement) while this edit runs does not pull the
    // template's slices from under it.
    let template = match &input.source {
        Source::Template(id) => Some(ctx.pin_template(id).await?),
        Source::Image(_) => None,
    };
    // With a template registry, only its current version is served.
    let confirmed = match &template {
        Some(t) => super::identity::confirm(ctx, t).await,
        None => Ok(()),
    };
    let r = match confirmed {
        Ok(()) => edit_pinned(ctx, job, input, template.as_ref(), t0).await,
        Err(e) => Err(e),
    };
    if let Some(t) = &template {
        ctx.unpin(t).await;
    }
    r.map(|mut o| {
        ctx.metrics.observe_edit(&o.timings, o.tokens, o.active);
        o.pod = ctx.pod_name().to_string();
        o.template_version = template.as_ref().map_or(0, |t| t.version);
        o
    })
}

async fn edit_pinned(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    t0: Instant,
) -> Result<EditOutput, WireError> {
    let (steps, guidance) = match template {
        Some(t) => template_schedule(input, &t.info)?,
        None => (
            input.steps.unwrap_or(defaults::STEPS),
            input.guidance.unwrap_or(ctx.edit_guidance),
        ),
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

/// The steps and guidance of an edit of template `i`: the template's, which a
/// request may repeat but not change (its cache holds those steps' activations), and
/// a request naming LoRAs must name the template's.
fn template_schedule(input: &EditInput, i: &TemplateInfo) -> Result<(u32, f32), WireError> {
    if input.steps.is_some_and(|s| s != i.steps) || input.guidance.is_some_and(|g| g != i.guidance)
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
            WireLora::set_key(&i.loras)
        )));
    }
    Ok((i.steps, i.guidance))
}

/// One attempt of an edit, on the workers the configuration has.
async fn edit_once(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    params: &GenParams,
    held: &mut Held,
) -> Result<EditOutput, WireError> {
    let prepare = prepare_req(ctx, job, input, template, params, held)?;
    if ctx.config.denoise.disaggregate {
        edit_disaggregated(ctx, job, input, template, prepare, held).await
    } else {
        edit_inline(ctx, job, input, template, prepare, held).await
    }
}

/// The preprocess request of an edit: its image (the template's, or the inline one
/// written to this process's arena) and its mask.
fn prepare_req(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    params: &GenParams,
    held: &mut Held,
) -> Result<PrepareReq, WireError> {
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
        MaskIn::Image(b, channel) => {
            let h = ctx.shm.write_bytes(b)?;
            held.own.push(h.clone());
            MaskSpec::Image(h, *channel)
        }
        MaskIn::Boxes(b) => MaskSpec::Boxes(b.clone()),
        MaskIn::Polygons(p) => MaskSpec::Polygons(p.clone()),
        MaskIn::Whole => MaskSpec::Whole,
    };
    Ok(PrepareReq {
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
        max_pixels: ctx.config.server.max_input_pixels as u64,
        max_tokens: ctx.config.server.max_edit_tokens() as u64,
    })
}

/// The denoise work of an edit: a template edit computes only the active tokens
/// against the template's cache (`blob`, once loaded); an inline image is a full,
/// uncached run.
fn edit_work(
    template: Option<&TemplateEntry>,
    blob: Option<Handle>,
    true_cfg: Option<(NegativeHandles, f32)>,
    control: Option<ControlStreamRef>,
) -> DenoiseWork {
    match (template, blob) {
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
    }
}

/// The pinned template with its cache in the host tier (`None` for an inline image).
/// Asked for only when the denoise stage needs it: a template on disk has been
/// loading since the pin, meanwhile.
async fn loaded(
    ctx: &Ctx,
    template: Option<&TemplateEntry>,
) -> Result<Option<TemplateEntry>, WireError> {
    match template {
        Some(t) => ctx.template_loaded(t).await.map(Some),
        None => Ok(None),
    }
}

/// The in-process baseline: one denoise worker prepares, denoises and finishes.
async fn edit_inline(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    prepare: PrepareReq,
    held: &mut Held,
) -> Result<EditOutput, WireError> {
    if !input.controlnets.is_empty() || input.true_cfg().is_some() {
        return Err(WireError::bad_input(
            "ControlNets and true CFG run on the disaggregated workers only ([denoise] disaggregate = true)",
        ));
    }
    let blob = loaded(ctx, template).await?.and_then(|t| t.blob);
    let work = edit_work(template, blob, None, None);
    let den = ctx.pick(groups::DENOISE, 1).await?;
    ctx.jobs.stage(job, JobStatus::Denoising, Some(den.clone()));
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
    Ok(EditOutput {
        template_version: 0, // edit_here's to fill in
        auto_template: None,
        image: bytes,
        width: d.input_size.map_or(d.width, |s| s.0),
        height: d.input_size.map_or(d.height, |s| s.1),
        computed: (d.width, d.height),
        tokens: d.tokens,
        active: d.active,
        pixel_ratio: d.pixel_ratio,
        prompt_truncated: d.prompt_truncated,
        timings: StageTimings {
            queue_s: d.stats.queue_s,
            preprocess_s: d.preprocess_s,
            denoise_s: d.stats.denoise_s,
            postprocess_s: d.postprocess_s,
            total_s: 0.0,
            vae_encode: VaePass::Dense,
            vae_decode: VaePass::Dense,
            prompt_cache: PromptCache::of(d.prompt_cache_hit),
        },
        stats: d.stats,
        attempts: 1,
        loras: vec![],
        true_cfg: None,
        pod: String::new(),
    })
}

/// The disaggregated flow: preprocess, then denoise (with the template's cache, its
/// ControlNets' stream and true CFG's negative branch), then postprocess.
async fn edit_disaggregated(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    template: Option<&TemplateEntry>,
    prepare: PrepareReq,
    held: &mut Held,
) -> Result<EditOutput, WireError> {
    let steps = prepare.params.steps;
    let seed = prepare.params.seed;
    let prepared = preprocess(ctx, job, prepare, held).await?;
    let active = match template {
        Some(_) => prepared.active.clone(),
        None => Vec::new(),
    };
    let loaded = loaded(ctx, template).await?;
    let blob = loaded.as_ref().and_then(|t| t.blob.clone());
    // ControlNets on a template edit condition its active tokens only: the rest follow
    // the template, which ran without them.
    let control = match input.controlnets.is_empty() {
        true => None,
        false => {
            let keep = template.map(|_| active.clone());
            let nets = &input.controlnets;
            Some(super::controlnets::start(ctx, job, nets, &prepared, (steps, seed), keep).await?)
        }
    };
    let cfg = match (&prepared.negative, input.true_cfg()) {
        (Some(n), Some((_, scale))) => Some((n.clone(), scale)),
        _ => None,
    };
    let true_cfg = cfg.as_ref().map(|&(_, scale)| TrueCfgOutcome {
        scale,
        split: false,
    });
    let stream = control.as_ref().and_then(|c| c.stream.clone());
    let work = edit_work(template, blob.clone(), cfg, stream);
    // A template edit runs with its template's LoRAs (captured with them at every step).
    let loras = template.map_or_else(|| input.loras.clone(), |t| t.info.loras.clone());
    let d = denoise(
        ctx,
        job,
        &prepared,
        steps,
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
        template_version: 0, // edit_here's to fill in
        auto_template: None,
        image: bytes,
        width: prepared.output_size().0,
        height: prepared.output_size().1,
        computed: (prepared.width, prepared.height),
        tokens,
        active: if template.is_some() {
            prepared.active.len() as u32
        } else {
            tokens
        },
        pixel_ratio: prepared.pixel_ratio,
        prompt_truncated: prepared.prompt_truncated,
        timings: stage_timings(&prepared, &d, &f),
        loras: super::adapters::applied(&loras, d.stats.loras_applied_at),
        stats: d.stats,
        attempts: 1,
        true_cfg,
        pod: String::new(),
    })
}
