//! `POST /v1/generations`: text-to-image (a FLUX.1-dev or -schnell model), with the
//! approximate cache, LoRAs, ControlNets and true CFG. The reply carries what the
//! approximate cache did (`approx_cache: {hit, k, similarity}`). OpenAI's
//! `/v1/images/generations` starts its images through [`start`] too (`super::openai`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::binary::Body;
use super::error::{ApiResult, ErrorBody};
use super::extract::{body, parse};
use super::inputs::{
    call_back, check_cfg, check_compression, check_guidance, check_seq_len, check_steps,
    default_seq_len, no_cfg, resolve_controlnets, resolve_loras, webhook, ControlNetRef, LoraRef,
};
use super::respond::{respond, JobAccepted, Reply};
use crate::router::flow::generate::{generate, ApproxMode, GenerateInput, GenerateOutput};
use crate::router::service::{admit, submit, GenerationReply, Submitted};
use crate::router::state::admission::Permit;
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::ImageFormat;

/// A text-to-image generation (FluxPipeline's fields).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerationBody {
    prompt: String,
    /// Default 28.
    steps: Option<u32>,
    /// Default 3.5.
    guidance: Option<f32>,
    #[serde(default)]
    seed: u64,
    /// Default the model's side (FluxPipeline's `128 * vae_scale_factor`).
    width: Option<u32>,
    height: Option<u32>,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    /// `png` (the default), `jpeg` or `webp`.
    #[serde(default)]
    format: ImageFormat,
    /// The quality of a `jpeg` or `webp` image, 0-100 (OpenAI's `output_compression`:
    /// lower is smaller; default JPEG 92, WebP 90); PNG ignores it.
    output_compression: Option<u8>,
    /// What the approximate cache (similar prompts' states) may do.
    #[serde(default)]
    approx_cache: ApproxMode,
    /// Answer 202 at once with a job to poll.
    #[serde(default, rename = "async")]
    run_async: bool,
    /// With `async`: post the job's end to this URL, signed (Standard Webhooks; its
    /// host must be in `[webhooks] allowed_hosts`).
    webhook: Option<String>,
    /// Answer with the job's events (`text/event-stream`: `status`, `step`, `preview`,
    /// then `done` with this reply's JSON, or `error`).
    #[serde(default)]
    stream: bool,
    /// A preview of the image every this many steps (`preview` events; 0: none).
    #[serde(default)]
    preview_every: u32,
    #[serde(default)]
    loras: Vec<LoraRef>,
    /// True CFG: runs with a negative prompt and `true_cfg_scale` above 1.
    negative_prompt: Option<String>,
    #[serde(default = "no_cfg")]
    true_cfg_scale: f32,
    #[serde(default)]
    controlnets: Vec<ControlNetRef>,
}

/// The bounds of a generation's schedule and text length.
pub(crate) fn check(
    ctx: &Ctx,
    steps: Option<u32>,
    guidance: Option<f32>,
    seq: u32,
) -> ApiResult<()> {
    check_steps(ctx, steps)?;
    check_guidance(guidance)?;
    check_seq_len(seq)
}

/// Starts one generation as a job of the job table, holding `permit` until it ends
/// (the table keeps its image when `keep_image`).
pub(crate) fn start(
    ctx: &Arc<Ctx>,
    permit: Permit,
    input: GenerateInput,
    keep_image: bool,
    previews: Previews,
) -> Submitted<GenerateOutput> {
    let steps = input.steps.unwrap_or(0);
    let format = input.format;
    submit(
        ctx,
        permit,
        "generation",
        steps,
        previews,
        move |c, job| async move { generate(&c, job, &input).await },
        move |job, o| GenerationReply::new(job, o, format, keep_image),
    )
}

/// Generates an image from a prompt (a FLUX.1-dev or -schnell model).
#[utoipa::path(post, path = "/v1/generations", tag = "generations",
    request_body(content = GenerationBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The generated image. With `Accept: image/png`, `image/jpeg` or `image/webp` (`image/*`: the request's `format`), the image's bytes, the reply's other fields in `x-denoised-*` headers (a synchronous request's). With `stream`, the job's events instead (`GET /v1/jobs/{id}/events`).",
            content((GenerationReply = "application/json"), (String = "text/event-stream"), (Vec<u8> = "image/png"), (Vec<u8> = "image/jpeg"), (Vec<u8> = "image/webp")),
            headers(("x-request-id" = String, description = "The request's id."))),
        (status = 202, description = "`async`: the job to poll.", body = JobAccepted),
        (status = 400, description = "Bad input, or a Fill model (it edits only).", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 409, description = "Cancelled.", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 429, body = ErrorBody),
        (status = 500, body = ErrorBody), (status = 503, body = ErrorBody),
        (status = 504, body = ErrorBody),
    ))]
pub(crate) async fn create_generation(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let accept = Body::of(req.headers());
    let b: GenerationBody = parse(&body(&ctx, req).await?)?;
    check(&ctx, b.steps, b.guidance, b.max_sequence_length)?;
    check_cfg(b.true_cfg_scale)?;
    check_compression(b.output_compression)?;
    let hook = webhook(&ctx, b.webhook.as_deref(), b.run_async)?;
    let format = accept.format(b.format);
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
        compression: b.output_compression,
        loras: resolve_loras(&ctx, &b.loras, false)?,
        negative_prompt: b.negative_prompt,
        true_cfg_scale: b.true_cfg_scale,
        controlnets: resolve_controlnets(&ctx, &b.controlnets)?,
    };
    let reply = Reply::of(b.run_async, b.stream)?;
    // A synchronous client gets the image in its response; the job table keeps only
    // the description then.
    let previews = Previews::Every(b.preview_every);
    let Submitted { job, task } = start(&ctx, permit, input, reply.keeps_result(), previews);
    call_back(&ctx, job, hook);
    respond(&ctx, job, task, reply, move |out| match accept {
        Body::Json => Json(GenerationReply::new(job, out, format, true)).into_response(),
        image => image.reply(
            &GenerationReply::new(job, out, format, false),
            &out.image,
            format,
        ),
    })
    .await
}
