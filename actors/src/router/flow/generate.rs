//! The life of a text-to-image generation (a FLUX.1-dev or -schnell model): preprocess
//! (prompt, noise) → approximate-cache lookup → denoise worker → postprocess → client,
//! with the flow's retries and handle bookkeeping ([`super::stages`]).
//!
//! The approximate cache (NIRVANA; `crate::approx`, its states in the cache process):
//! after preprocessing, the prompt's CLIP pooled embedding is looked up among cached
//! prompts with the same exact fields. A hit's job starts after step K from the cached
//! state, with the rest of its own schedule, in the continuous batch like any other; a
//! miss runs in full and hands its latents after the stored steps to the cache.

use std::hash::{Hash, Hasher};
use std::time::Instant;

use super::controlnets::ControlNetInput;
use super::defaults;
use super::pod::on_pod;
use super::stages::{
    denoise, finish_req, postprocess, preprocess, stage_timings, with_retries, Held,
};
use crate::approx::{store_steps, STORE_FRACTIONS};
use crate::metrics::router::ApproxResult;
use crate::node;
use crate::router::state::pods::Need;
use crate::router::state::Ctx;
use crate::wire::pods::{FromPeer, PodGenerate, PodMsg, PodRun};
use crate::wire::*;

pub struct GenerateInput {
    pub prompt: String,
    pub steps: Option<u32>,
    pub guidance: Option<f32>,
    pub seed: u64,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub max_sequence_length: u32,
    pub approx: ApproxMode,
    pub format: ImageFormat,
    /// The quality of a JPEG or WebP (`FinishParams::compression`).
    pub compression: Option<u8>,
    pub loras: Vec<WireLora>,
    /// True CFG: FluxPipeline's `negative_prompt` and `true_cfg_scale` (it runs when
    /// both are given and the scale is above 1).
    pub negative_prompt: Option<String>,
    pub true_cfg_scale: f32,
    /// Its ControlNets (run by the ControlNet service).
    pub controlnets: Vec<ControlNetInput>,
}

impl GenerateInput {
    /// The generation as it is forwarded to another pod: one without LoRAs or
    /// ControlNets of its own (`None` for others, which run where they arrive).
    pub fn to_pod(&self) -> Option<PodGenerate> {
        if !self.loras.is_empty() || !self.controlnets.is_empty() {
            return None;
        }
        Some(PodGenerate {
            prompt: self.prompt.clone(),
            steps: self.steps,
            guidance: self.guidance,
            seed: self.seed,
            width: self.width,
            height: self.height,
            max_sequence_length: self.max_sequence_length,
            approx: self.approx,
            format: self.format,
            compression: self.compression,
            negative_prompt: self.negative_prompt.clone(),
            true_cfg_scale: self.true_cfg_scale,
            origin: None,
        })
    }

    /// A forwarded generation as the pod that runs it takes it.
    pub fn from_pod(g: PodGenerate) -> Self {
        GenerateInput {
            prompt: g.prompt,
            steps: g.steps,
            guidance: g.guidance,
            seed: g.seed,
            width: g.width,
            height: g.height,
            max_sequence_length: g.max_sequence_length,
            approx: g.approx,
            format: g.format,
            compression: g.compression,
            loras: vec![],
            negative_prompt: g.negative_prompt,
            true_cfg_scale: g.true_cfg_scale,
            controlnets: vec![],
        }
    }

    /// The negative prompt and scale when true CFG runs.
    pub fn true_cfg(&self) -> Option<(&str, f32)> {
        true_cfg_of(self.negative_prompt.as_deref(), self.true_cfg_scale)
    }
}

/// The negative prompt and scale when true CFG runs: with a negative prompt and a
/// scale above 1 (FluxPipeline's rule).
pub fn true_cfg_of(negative_prompt: Option<&str>, scale: f32) -> Option<(&str, f32)> {
    let n = negative_prompt?;
    (scale > 1.0).then_some((n, scale))
}

pub use crate::wire::pods::TrueCfgOutcome;
pub use crate::wire::pods::{ApproxMode, ApproxOutcome, GenerateOutput};

fn hash(parts: impl Hash) -> u64 {
    // SipHash with fixed keys: the same value in every process of one binary (the
    // cache process and the router may restart apart).
    let mut h = std::hash::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// Runs a generation to its encoded image. In a cluster, one without adapters of its
/// own goes to the pod the pod policy chooses ([`super::pod::on_pod`]; it reads no
/// template, so the pods' loads decide).
pub async fn generate(
    ctx: &Ctx,
    job: JobId,
    input: &GenerateInput,
) -> Result<GenerateOutput, WireError> {
    let (Some(pods), Some(fwd), Some(model)) = (&ctx.pods, input.to_pod(), &ctx.generation) else {
        return generate_here(ctx, job, input).await;
    };
    // Its work, priced on every pod alike: all its tokens, every step.
    let side = model.default_side;
    let m = model.multiple_of.max(1);
    let tokens = (input.width.unwrap_or(side) / m) * (input.height.unwrap_or(side) / m);
    let need = Need::Load(PodRun {
        text: input.max_sequence_length,
        active: tokens,
        image: tokens,
        steps_left: input.steps.unwrap_or(defaults::STEPS),
    });
    let forward = |origin, p| {
        let mut g = fwd.clone();
        g.origin = Some(origin);
        PodMsg::Generate(FromPeer::of(g), p)
    };
    on_pod((ctx, pods, job), need, forward, || {
        generate_here(ctx, job, input)
    })
    .await
}

/// Runs a generation in this pod (a forwarded one too: it is never forwarded again).
pub async fn generate_here(
    ctx: &Ctx,
    job: JobId,
    input: &GenerateInput,
) -> Result<GenerateOutput, WireError> {
    let t0 = Instant::now();
    let model = ctx.generation.as_ref().ok_or_else(|| {
        WireError::bad_input(
            "the loaded model is a FLUX.1 Fill model: it edits images and does not generate from a prompt alone; serve a FLUX.1-dev or -schnell checkpoint for generations",
        )
    })?;
    if !ctx.config.denoise.disaggregate {
        return Err(WireError::bad_input(
            "generations run on the disaggregated workers only ([denoise] disaggregate = true)",
        ));
    }
    if !input.controlnets.is_empty() && input.true_cfg().is_some() {
        return Err(WireError::bad_input(
            "ControlNets and true CFG do not run together (FluxControlNetPipeline has no negative prompt)",
        ));
    }
    let side = model.default_side;
    let (width, height) = (input.width.unwrap_or(side), input.height.unwrap_or(side));
    let m = model.multiple_of.max(1);
    if width == 0 || height == 0 || width % m != 0 || height % m != 0 {
        return Err(WireError::bad_input(format!(
            "size {width}x{height}: both sides must be positive multiples of {m} pixels (the model's token size)"
        )));
    }
    let params = GenParams {
        prompt: input.prompt.clone(),
        steps: input.steps.unwrap_or(defaults::STEPS),
        guidance: input.guidance.unwrap_or(defaults::GENERATION_GUIDANCE),
        seed: input.seed,
        max_sequence_length: input.max_sequence_length,
        dilation: 0,
    };
    ctx.jobs.steps(job, params.steps);
    // The fields a state must share with the request exactly: a state is the adapted
    // model's, so the LoRA set too.
    let key = hash((
        &ctx.model,
        &model.scheduler,
        width,
        height,
        params.steps,
        params.guidance.to_bits(),
        params.max_sequence_length,
        WireLora::set_key(&input.loras),
        input.true_cfg().map(|(n, s)| (n.to_string(), s.to_bits())),
    ));
    let (mut out, attempts) = with_retries(ctx, job, |_| async {
        let mut held = Held::default();
        let r = generate_once(ctx, job, input, &params, (width, height, key), &mut held).await;
        held.release(&ctx.shm);
        r
    })
    .await?;
    out.attempts = attempts;
    out.timings.total_s = t0.elapsed().as_secs_f64();
    let approx = match (&out.approx, out.approx_used) {
        (a, _) if a.hit => ApproxResult::Hit { skipped: a.k },
        (_, true) => ApproxResult::Miss,
        (_, false) => ApproxResult::Off,
    };
    ctx.metrics.observe_generation(&out.timings, approx);
    Ok(out)
}

async fn generate_once(
    ctx: &Ctx,
    job: JobId,
    input: &GenerateInput,
    params: &GenParams,
    (width, height, key): (u32, u32, u64),
    held: &mut Held,
) -> Result<GenerateOutput, WireError> {
    let prepare = PrepareReq {
        job,
        input: PrepareInput::Generate {
            width,
            height,
            negative_prompt: input.true_cfg().map(|(n, _)| n.to_string()),
        },
        params: params.clone(),
        max_pixels: ctx.config.server.max_pixels as u64,
        // Its size is the one asked for (within `max_pixels`), never resized.
        max_tokens: 0,
    };
    let mut prepared = preprocess(ctx, job, prepare, held).await?;
    let steps = params.steps;
    // A state of a generation with ControlNets is theirs too (and their images'): such
    // a generation neither reads nor fills the approximate cache.
    let approx = match input.controlnets.is_empty() {
        true => input.approx,
        false => ApproxMode::Off,
    };
    let query = match approx {
        ApproxMode::Off => None,
        mode => Some(ApproxQuery {
            key,
            // An `exact` lookup matches this: the same prompt from the same noise.
            text: hash((&params.prompt, params.max_sequence_length, params.seed)),
            embedding: ctx.shm.read_tensor(&prepared.inputs.pooled)?.into_data(),
            steps,
            exact: mode == ApproxMode::Exact,
        }),
    };
    // The cache only saves work: a generation neither waits for it (a cache process
    // restarting) nor fails with it (it then runs in full).
    let cache = query
        .as_ref()
        .and_then(|_| ctx.members(groups::CACHE).into_iter().next());
    let hit = match (&query, &cache) {
        (Some(q), Some(c)) => {
            let q = q.clone();
            ctx.ask(c, |p| CacheMsg::ApproxLookup(Wire(q), p))
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!("approximate cache: lookup failed, running in full: {e}");
                    None
                })
        }
        _ => None,
    };
    let (start_at, store_at) = match (&hit, &query) {
        (Some(h), _) => {
            // The job's latents are the cached state, read in place in the cache's
            // arena.
            prepared.inputs.latents = h.state.clone();
            (h.k, Vec::new())
        }
        (None, Some(_)) => (
            0,
            store_steps(steps as usize, &STORE_FRACTIONS)
                .into_iter()
                .map(|k| k as u32)
                .collect(),
        ),
        (None, None) => (0, Vec::new()),
    };
    let control = match input.controlnets.is_empty() {
        true => None,
        false => Some(
            super::controlnets::start(
                ctx,
                job,
                &input.controlnets,
                &prepared,
                (steps, params.seed),
                None,
            )
            .await?,
        ),
    };
    let cfg = match (&prepared.negative, input.true_cfg()) {
        (Some(n), Some((_, scale))) => Some((n.clone(), scale)),
        _ => None,
    };
    let mut work = DenoiseWork::Generate {
        start_at,
        store_at,
        true_cfg: None,
        control: control.as_ref().and_then(|c| c.stream.clone()),
        cfg_pair: None,
    };
    let loras = input.loras.clone();
    // True CFG's branches on two workers when two have room now, else batched in one.
    let pair = cfg
        .as_ref()
        .and_then(|(n, _)| super::cfg_split::place(ctx, job, &prepared, n, (&work, steps)));
    let split = pair.is_some();
    let d = match (pair, &cfg) {
        (Some(pair), Some((n, scale))) => {
            let neg = (n, *scale);
            super::cfg_split::run(ctx, job, &prepared, steps, work, neg, loras, pair, held).await
        }
        _ => {
            if let DenoiseWork::Generate { true_cfg, .. } = &mut work {
                *true_cfg = cfg.clone();
            }
            denoise(ctx, job, &prepared, steps, Vec::new(), work, loras, held).await
        }
    };
    if let Some(c) = &control {
        super::controlnets::stop(c, job);
    }
    if let (Some(h), Some(c)) = (&hit, &cache) {
        // The denoise worker read the state when the request arrived.
        node::tell(c, CacheMsg::ApproxUnpin(Wire(h.pin)));
    }
    let d = d?;
    if let (Some(q), Some(c), false) = (query, &cache, d.states.is_empty()) {
        let put = ApproxPut {
            query: q,
            states: d.states.clone(),
        };
        // Waited for: the states are the denoise worker's slices, which this request
        // releases when it ends. A put that fails costs only the cache entry.
        if let Err(e) = ctx.ask(c, |p| CacheMsg::ApproxPut(Wire(put), p)).await {
            tracing::warn!("approximate cache: states not stored: {e}");
        }
    }
    // The whole image is generated: nothing to paste back.
    let fin = finish_req(
        job,
        &prepared,
        &d,
        FinishParams::whole_image(input.format, input.compression),
    );
    let f = postprocess(ctx, job, fin, held).await?;
    Ok(GenerateOutput {
        image: ctx.shm.read_bytes(&f.image)?,
        width: prepared.width,
        height: prepared.height,
        steps,
        prompt_truncated: prepared.prompt_truncated,
        timings: stage_timings(&prepared, &d, &f),
        loras: super::adapters::applied(&input.loras, d.stats.loras_applied_at),
        stats: d.stats,
        attempts: 1,
        approx: ApproxOutcome {
            hit: hit.is_some(),
            k: hit.as_ref().map_or(0, |h| h.k),
            similarity: hit.as_ref().map(|h| h.similarity),
        },
        approx_used: cache.is_some(),
        true_cfg: cfg.map(|(_, scale)| TrueCfgOutcome { scale, split }),
        pod: ctx.pod_name().to_string(),
    })
}
