//! The HTTP routes of text-to-image generations: the native `POST /v1/generations`, and
//! OpenAI's `POST /v1/images/generations`, so that OpenAI clients (the official
//! `openai` package included) generate here unchanged.
//!
//! OpenAI's route takes `prompt`, `n` (1-10: that many images, seeds `seed`,
//! `seed + 1`, ...), `size` (`WIDTHxHEIGHT` or `auto`, the model's default),
//! `response_format` (`b64_json`; `url` is refused: nothing here hosts files) and
//! `model` (one model is served: any name is accepted and the reply names the served
//! model); extensions: `seed`, `steps`, `guidance`, `max_sequence_length` and
//! `approx_cache`. Its errors are in OpenAI's shape. Both replies carry what the
//! approximate cache did (`approx_cache: {hit, k, similarity}`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::adapters::{resolve, LoraRef};
use super::admission::Permit;
use super::controlnets::ControlNetRef;
use super::flow::Ctx;
use super::generate::{self, ApproxMode, GenerateInput, GenerateOutput};
use super::http::{
    accepted, body, check_guidance, check_seq_len, check_steps, default_seq_len, encode_b64,
    joined, parse, with_id, ApiError, ApiResult,
};
use super::jobs::job_name;
use super::openai::{openai_error, MAX_N};
use super::submit::{admit, submit, units, Submitted};
use crate::wire::ImageFormat;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationBody {
    prompt: String,
    steps: Option<u32>,
    guidance: Option<f32>,
    #[serde(default)]
    seed: u64,
    width: Option<u32>,
    height: Option<u32>,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    #[serde(default)]
    format: ImageFormat,
    #[serde(default)]
    approx_cache: ApproxMode,
    #[serde(default, rename = "async")]
    run_async: bool,
    #[serde(default)]
    loras: Vec<LoraRef>,
    negative_prompt: Option<String>,
    #[serde(default = "no_cfg")]
    true_cfg_scale: f32,
    #[serde(default)]
    controlnets: Vec<ControlNetRef>,
}

/// `true_cfg_scale`'s default: 1, true CFG off (FluxPipeline's).
fn no_cfg() -> f32 {
    1.0
}

/// Checks true CFG's fields (a scale that is not a finite number is refused).
fn check_cfg(scale: f32) -> ApiResult<()> {
    if !scale.is_finite() {
        return Err(ApiError::bad("`true_cfg_scale` must be a finite number"));
    }
    Ok(())
}

fn check(ctx: &Ctx, steps: Option<u32>, guidance: Option<f32>, seq: u32) -> ApiResult<()> {
    check_steps(ctx, steps)?;
    check_guidance(guidance)?;
    check_seq_len(seq)
}

/// The JSON of a finished generation; `with_image` adds the base64 image.
pub fn generation_json(
    job: u64,
    o: &GenerateOutput,
    format: ImageFormat,
    with_image: bool,
) -> Value {
    let mut v = json!({
        "id": job_name(job),
        "format": format,
        "width": o.width,
        "height": o.height,
        "steps": o.steps,
        "prompt_truncated": o.prompt_truncated,
        "attempts": o.attempts,
        "approx_cache": o.approx,
        "timings": o.timings,
        "loras": o.loras,
        "true_cfg": o.true_cfg,
        "batch": {"sizes": o.stats.batch_sizes},
        "first_step_unix": o.stats.first_step_unix,
        "finished_unix": o.stats.finished_unix,
    });
    if with_image {
        v["image"] = Value::String(encode_b64(&o.image));
    }
    v
}

/// Starts one generation as a job of the job table, holding `permit` until it ends.
fn start(
    ctx: &Arc<Ctx>,
    permit: Permit,
    input: GenerateInput,
    keep_image: bool,
) -> Submitted<GenerateOutput> {
    let steps = input.steps.unwrap_or(0);
    let format = input.format;
    submit(
        ctx,
        permit,
        "generation",
        steps,
        move |c, job| async move { generate::generate(&c, job, &input).await },
        move |job, o| generation_json(job, o, format, keep_image),
    )
}

/// `POST /v1/generations`.
pub(super) async fn create_generation(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let b: GenerationBody = parse(&body(&ctx, req).await?)?;
    check(&ctx, b.steps, b.guidance, b.max_sequence_length)?;
    check_cfg(b.true_cfg_scale)?;
    let format = b.format;
    let input = GenerateInput {
        prompt: b.prompt,
        steps: b.steps,
        guidance: b.guidance,
        seed: b.seed,
        width: b.width,
        height: b.height,
        max_sequence_length: b.max_sequence_length,
        approx: b.approx_cache,
        format,
        loras: resolve(&ctx, &b.loras, false)?,
        negative_prompt: b.negative_prompt,
        true_cfg_scale: b.true_cfg_scale,
        controlnets: super::controlnets::resolve(&ctx, &b.controlnets)?,
    };
    // A synchronous client gets the image in its response; the job table keeps only
    // the description then.
    let Submitted { job, task } = start(&ctx, permit, input, b.run_async);
    if b.run_async {
        return Ok(accepted(job));
    }
    match joined(task).await {
        Ok(out) => Ok(with_id(
            job,
            Json(generation_json(job, &out, format, true)).into_response(),
        )),
        Err(e) => Ok(with_id(job, e.into_response())),
    }
}

#[derive(Deserialize)]
struct ImagesBody {
    prompt: Option<String>,
    #[serde(default = "one")]
    n: u32,
    size: Option<String>,
    response_format: Option<String>,
    #[serde(default)]
    seed: u64,
    steps: Option<u32>,
    guidance: Option<f32>,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    #[serde(default)]
    approx_cache: ApproxMode,
    #[serde(default)]
    loras: Vec<LoraRef>,
    negative_prompt: Option<String>,
    #[serde(default = "no_cfg")]
    true_cfg_scale: f32,
    #[serde(default)]
    controlnets: Vec<ControlNetRef>,
    // `model` (one model is served), `user`, and OpenAI's rendering options (quality,
    // style, background, ...) that have no meaning here are accepted and ignored.
}

fn one() -> u32 {
    1
}

/// `POST /v1/images/generations`.
pub(super) async fn images_generations(State(ctx): State<Arc<Ctx>>, req: Request) -> Response {
    images(ctx, req).await.unwrap_or_else(openai_error)
}

fn size(s: &str) -> ApiResult<Option<(u32, u32)>> {
    if s == "auto" {
        return Ok(None);
    }
    let bad = || ApiError::bad(format!("`size`: {s:?} is not WIDTHxHEIGHT or auto"));
    let (w, h) = s.split_once('x').ok_or_else(bad)?;
    Ok(Some((
        w.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    )))
}

async fn images(ctx: Arc<Ctx>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let b: ImagesBody = parse(&body(&ctx, req).await?)?;
    let prompt = b
        .prompt
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ApiError::bad("`prompt` is required"))?;
    if b.n == 0 || b.n > MAX_N {
        return Err(ApiError::bad(format!("`n` must be 1 to {MAX_N}")));
    }
    if let Some(f) = b.response_format.as_deref().filter(|f| *f != "b64_json") {
        return Err(ApiError::bad(format!(
            "`response_format`: {f:?} is not supported; images come back as b64_json"
        )));
    }
    check(&ctx, b.steps, b.guidance, b.max_sequence_length)?;
    let wh = b.size.as_deref().map(size).transpose()?.flatten();
    let loras = resolve(&ctx, &b.loras, false)?;
    let controlnets = super::controlnets::resolve(&ctx, &b.controlnets)?;
    check_cfg(b.true_cfg_scale)?;
    // One unit per image, each held by its own flow until it ends.
    let tasks: Vec<_> = units(permit, b.n)?
        .into_iter()
        .zip(0u32..)
        .map(|(permit, i)| {
            let input = GenerateInput {
                prompt: prompt.clone(),
                steps: b.steps,
                guidance: b.guidance,
                seed: b.seed.wrapping_add(i as u64),
                width: wh.map(|s| s.0),
                height: wh.map(|s| s.1),
                max_sequence_length: b.max_sequence_length,
                approx: b.approx_cache,
                format: ImageFormat::Png,
                loras: loras.clone(),
                negative_prompt: b.negative_prompt.clone(),
                true_cfg_scale: b.true_cfg_scale,
                controlnets: controlnets.clone(),
            };
            start(&ctx, permit, input, false)
        })
        .collect();
    let mut data = Vec::new();
    let mut dims = (0, 0);
    for Submitted { job, task } in tasks {
        let o = joined(task).await?;
        dims = (o.width, o.height);
        data.push(json!({
            "b64_json": encode_b64(&o.image),
            "id": job_name(job),
            "approx_cache": o.approx,
            "timings": o.timings,
        }));
    }
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = json!({
        "created": created,
        "data": data,
        "model": ctx.model,
        "output_format": "png",
        "size": format!("{}x{}", dims.0, dims.1),
    });
    Ok((StatusCode::OK, Json(body)).into_response())
}
