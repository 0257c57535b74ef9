//! The OpenAI-compatible Images API, so that clients written for OpenAI (the official
//! `openai` package included) edit and generate images here unchanged. Errors are in
//! OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
//!
//! `POST /v1/images/generations` maps onto the native generation flow: `prompt`, `n`
//! (1-10: that many images, seeds `seed`, `seed + 1`, ...), `size` (`WIDTHxHEIGHT` or
//! `auto`, the model's default), `response_format` (`b64_json`, or `url`: the router's
//! image store, `GET /v1/images/{id}`), `output_format` (`png`, `jpeg`, `webp`) and
//! `output_compression` (0-100, their quality), and `model` (one model is served: any
//! name is accepted and the reply names the served model); extensions: `seed`, `steps`, `guidance`,
//! `max_sequence_length`, `approx_cache`, `loras`, `controlnets`, true CFG.
//!
//! `POST /v1/images/edits` maps onto the native edit flow (`/v1/edits`):
//! - multipart `image` (or `image[]`, one image), `mask`, `prompt`, `n` (1-10: that
//!   many edits, seeds `seed`, `seed + 1`, ...), `size` (`auto`, or the image's own
//!   size: an edit comes back at its image's size, whatever size it was computed
//!   at), `response_format`, `output_format`, `output_compression` (as generations
//!   take them), `model` (one model is served: any name is accepted and the reply
//!   names the served model);
//! - the mask in OpenAI's convention: its fully transparent pixels (alpha 0) are the
//!   area to edit; without a mask, the image's own transparency is the mask, and an
//!   image without any is an instruction edit of the whole image (a FLUX.1 Kontext
//!   model; a Fill model answers that it needs a mask);
//! - extensions as extra form fields: `seed`, `steps`, `guidance`,
//!   `max_sequence_length`, `template_id` (a mask-aware edit of that template: the
//!   template's image is the source, and the uploaded image only carries the mask
//!   when there is no `mask`), and `use_auto_template` (`false`: a full run whatever
//!   `[templates] auto` would do).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use denoised_models::pipeline::image::{
    decode_alpha_mask, decode_image, encode_mask_png, ImageLimits,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ApiResult, ErrorBody, ErrorClass};
use super::events::{events, Flavour};
use super::extract::{body, parse, read_multipart};
use super::generations::{check, start};
use super::images::{base_url, Output};
use super::inputs::{
    check_cfg, check_guidance, check_seq_len, check_steps, default_seq_len, no_cfg,
    resolve_controlnets, resolve_loras, ControlNetRef, LoraRef,
};
use super::respond::{joined, with_id};
use crate::daemon::job_name;
use crate::router::flow::auto::edit_auto;
use crate::router::flow::defaults;
use crate::router::flow::edit::{Auto, EditInput, MaskIn, Source};
use crate::router::flow::generate::{ApproxMode, ApproxOutcome, GenerateInput};
use crate::router::service::{admit, submit, units, EditReply, Submitted};
use crate::router::state::admission::RETRY_AFTER_S;
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::{ImageFormat, JobId, MaskChannel, StageTimings, WireError};

/// The most images one request asks for (OpenAI's limit).
pub(crate) const MAX_N: u32 = 10;

/// An error in OpenAI's shape (their clients parse `error.message`).
#[derive(Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always null.
    pub param: Option<String>,
    /// The native API's code (`bad_request`, `overloaded`, ...).
    pub code: String,
}

/// OpenAI's images reply.
#[derive(Serialize, ToSchema)]
pub struct ImagesReply {
    /// Unix seconds.
    pub created: u64,
    /// One entry per image (`n`).
    pub data: Vec<ImageData>,
    /// The served model's fingerprint (whatever `model` the request named).
    pub model: String,
    /// `png`, `jpeg` or `webp` (the request's `output_format`).
    pub output_format: String,
    /// `WIDTHxHEIGHT`.
    pub size: String,
}

/// One image of an [`ImagesReply`], with denoised's extensions.
#[derive(Serialize, ToSchema)]
pub struct ImageData {
    /// The image, base64 (`response_format: "b64_json"`, the default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b64_json: Option<String>,
    /// Where to get the image (`response_format: "url"`): `GET /v1/images/{id}`, with
    /// the API's bearer token, for `[server] image_url_ttl_seconds`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The image's request id (a job name).
    pub id: String,
    /// What the approximate cache did (generations only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approx_cache: Option<ApproxOutcome>,
    pub timings: StageTimings,
    /// The pod that ran it (in a cluster of pods; docs/cluster.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// An edit of an uploaded image under `[templates] auto`: the image's template, and
    /// whether this edit read it or captured it (edits only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_template: Option<crate::wire::pods::AutoTemplate>,
}

/// `POST /v1/images/edits`' multipart form (read part by part, not by serde: this
/// type describes it).
#[allow(dead_code)]
#[derive(ToSchema)]
pub struct ImagesEditForm {
    /// The image to edit (PNG or JPEG); `image[]` is accepted too (one image).
    #[schema(value_type = String, format = Binary)]
    image: Vec<u8>,
    /// OpenAI's mask: its fully transparent pixels are the area to edit. Without it,
    /// the image's own transparency is the mask.
    #[schema(value_type = Option<String>, format = Binary)]
    mask: Option<Vec<u8>>,
    prompt: String,
    /// 1-10 images, seeds `seed`, `seed + 1`, ...
    n: Option<u32>,
    /// `auto` or the image's own `WIDTHxHEIGHT` (an edit comes back at its image's size).
    size: Option<String>,
    /// `b64_json` (the default) or `url` (`GET /v1/images/{id}`).
    response_format: Option<String>,
    /// `png` (the default), `jpeg` or `webp`.
    output_format: Option<String>,
    /// 0-100: the quality of a `jpeg` or `webp` (lower is smaller).
    output_compression: Option<u8>,
    /// Any name: one model is served.
    model: Option<String>,
    seed: Option<u64>,
    steps: Option<u32>,
    guidance: Option<f32>,
    max_sequence_length: Option<u32>,
    /// A mask-aware edit of this template: its image is the source, and the uploaded
    /// image only carries the mask when there is no `mask`.
    template_id: Option<String>,
    /// `false`: the edit runs in full, whatever `[templates] auto` would do with its
    /// image, and counts no sighting.
    use_auto_template: Option<bool>,
    /// `true`: stream `image_edit.partial_image` events (`partial_images` of them, 0-3)
    /// and `image_edit.completed` (`text/event-stream`; one image a request).
    stream: Option<bool>,
    partial_images: Option<u32>,
}

/// The error reply of the OpenAI routes.
pub(crate) fn openai_error(e: ApiError) -> Response {
    let kind = if e.status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = OpenAiError {
        error: OpenAiErrorDetail {
            message: e.message,
            kind: kind.to_string(),
            param: None,
            code: e.code.to_string(),
        },
    };
    let mut r = (e.status, Json(body)).into_response();
    r.extensions_mut().insert(ErrorClass(e.code));
    if e.status == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(RETRY_AFTER_S),
        );
    }
    r
}

/// OpenAI's image edit (multipart), onto the native edit flow.
#[utoipa::path(post, path = "/v1/images/edits", tag = "openai",
    request_body(content = ImagesEditForm, content_type = "multipart/form-data"),
    responses(
        (status = 200, description = "The images; with `stream`, OpenAI's image events instead.",
            content((ImagesReply = "application/json"), (String = "text/event-stream"))),
        (status = 400, body = OpenAiError), (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown template.", body = OpenAiError),
        (status = 413, body = OpenAiError), (status = 429, body = OpenAiError),
        (status = 500, body = OpenAiError), (status = 503, body = OpenAiError),
        (status = 504, body = OpenAiError),
    ))]
pub(crate) async fn images_edits(State(ctx): State<Arc<Ctx>>, req: Request) -> Response {
    edits(ctx, req).await.unwrap_or_else(openai_error)
}

/// The request's form, parsed and checked.
struct Form {
    image: Vec<u8>,
    mask: Option<Vec<u8>>,
    prompt: String,
    n: u32,
    size: Option<(usize, usize)>,
    seed: u64,
    steps: Option<u32>,
    guidance: Option<f32>,
    max_sequence_length: u32,
    template_id: Option<String>,
    /// `use_auto_template` (default true).
    auto: bool,
    stream: Option<Streamed>,
    output: Output,
}

/// OpenAI's `stream: true`, with its `partial_images` (0-3).
#[derive(Clone, Copy)]
struct Streamed {
    partials: u32,
}

/// `stream` and `partial_images` as OpenAI takes them: one image per streamed request.
fn streamed(stream: bool, partial_images: Option<u32>, n: u32) -> ApiResult<Option<Streamed>> {
    let partials = partial_images.unwrap_or(0);
    if partials > 3 {
        return Err(ApiError::bad("`partial_images` must be 0 to 3"));
    }
    match (stream, n) {
        (false, _) if partial_images.is_some_and(|p| p > 0) => {
            Err(ApiError::bad("`partial_images` needs `stream`"))
        }
        (false, _) => Ok(None),
        (true, 1) => Ok(Some(Streamed { partials })),
        (true, _) => Err(ApiError::bad(
            "`stream` takes one image a request (`n` = 1)",
        )),
    }
}

/// The streamed reply of an OpenAI request's one job.
async fn stream_reply(
    ctx: &Arc<Ctx>,
    job: JobId,
    kind: &'static str,
    s: Streamed,
    size: String,
) -> ApiResult {
    let flavour = Flavour::OpenAi {
        kind,
        partials: s.partials,
        size,
    };
    events(ctx, job, flavour)
        .await
        .map(|r| with_id(job, r))
        .ok_or_else(|| ApiError::from(WireError::internal("the job left the table")))
}

fn number<T: std::str::FromStr>(name: &str, v: &str) -> ApiResult<T> {
    v.trim()
        .parse()
        .map_err(|_| ApiError::bad(format!("`{name}`: {v:?} is not a number")))
}

async fn form(ctx: &Ctx, req: Request) -> ApiResult<Form> {
    let (bin, text) = read_multipart(ctx, req, &["image", "image[]", "mask"]).await?;
    let mut images = bin
        .iter()
        .filter(|(n, _)| n != "mask")
        .map(|(_, b)| b.clone());
    let image = images
        .next()
        .ok_or_else(|| ApiError::bad("`image`: the image to edit is required"))?;
    if images.next().is_some() {
        return Err(ApiError::bad("`image`: one image per request"));
    }
    let mut f = Form {
        image,
        mask: bin.into_iter().find(|(n, _)| n == "mask").map(|(_, b)| b),
        prompt: String::new(),
        n: 1,
        size: None,
        seed: 0,
        steps: None,
        guidance: None,
        max_sequence_length: defaults::MAX_SEQUENCE_LENGTH,
        template_id: None,
        auto: true,
        stream: None,
        output: Output::of(None, None, None)?,
    };
    let (mut prompt, mut stream, mut partials) = (None, false, None);
    let (mut format, mut compression, mut response) = (None, None, None);
    for (name, v) in text {
        match name.as_str() {
            "prompt" => prompt = Some(v),
            "n" => f.n = number("n", &v)?,
            "size" if v == "auto" => {}
            "size" => {
                let (w, h) = v
                    .split_once('x')
                    .ok_or_else(|| ApiError::bad(format!("`size`: {v:?} is not WIDTHxHEIGHT")))?;
                f.size = Some((number("size", w)?, number("size", h)?));
            }
            "response_format" => response = Some(v),
            "output_format" => format = Some(v),
            "output_compression" => compression = Some(number("output_compression", &v)?),
            "seed" => f.seed = number("seed", &v)?,
            "steps" => f.steps = Some(number("steps", &v)?),
            "guidance" => f.guidance = Some(number("guidance", &v)?),
            "max_sequence_length" => f.max_sequence_length = number("max_sequence_length", &v)?,
            "template_id" => f.template_id = Some(v),
            "use_auto_template" => f.auto = v.trim() != "false",
            "stream" => stream = v.trim() == "true",
            "partial_images" => partials = Some(number("partial_images", &v)?),
            // `model` (one model is served), `user`, and OpenAI's rendering options
            // (quality, background, ...) that have no meaning here.
            _ => {}
        }
    }
    f.prompt = prompt.ok_or_else(|| ApiError::bad("`prompt` is required"))?;
    if f.n == 0 || f.n > MAX_N {
        return Err(ApiError::bad(format!("`n` must be 1 to {MAX_N}")));
    }
    f.stream = streamed(stream, partials, f.n)?;
    f.output = Output::of(format.as_deref(), compression, response.as_deref())?;
    Ok(f)
}

async fn edits(ctx: Arc<Ctx>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let base = base_url(&ctx, req.headers());
    let f = form(&ctx, req).await?;
    let out = f.output;
    check_steps(&ctx, f.steps)?;
    check_guidance(f.guidance)?;
    check_seq_len(f.max_sequence_length)?;
    // Decoding is CPU work: off the async threads.
    let limits = ImageLimits {
        max_pixels: ctx.config.server.max_input_pixels,
        multiple_of: 1,
    };
    let (image, mask_png, (w, h)) = {
        let (image, mask, size) = (f.image, f.mask, f.size);
        let templated = f.template_id.is_some();
        tokio::task::spawn_blocking(move || -> ApiResult<_> {
            let bad = |e: denoised_runtime::Error| ApiError::bad(e.to_string());
            let img = decode_image(&image, &limits).map_err(bad)?;
            let (w, h) = (img.width, img.height);
            if let Some((sw, sh)) = size.filter(|&s| s != (w, h)) {
                return Err(ApiError::bad(format!(
                    "`size` {sw}x{sh} differs from the image's {w}x{h}: an edit comes back at its image's size (or use \"auto\")"
                )));
            }
            let m = match decode_alpha_mask(mask.as_deref().unwrap_or(&image), w, h, &limits) {
                Ok(m) => Some(m),
                Err(e) if mask.is_some() => return Err(bad(e)),
                // No mask and no transparency: an instruction edit of the whole image
                // (a FLUX.1 Kontext model; a Fill model says it needs a mask).
                Err(_) if !templated => None,
                Err(e) => {
                    return Err(ApiError::bad(format!(
                        "no `mask`, and the image cannot serve as one: {e}"
                    )))
                }
            };
            let png = m.map(|m| encode_mask_png(&m)).transpose().map_err(bad)?;
            Ok((image, png, (w, h)))
        })
        .await
        .map_err(|e| ApiError::from(WireError::internal(format!("decode task: {e}"))))??
    };
    // One unit per image, each held by its own flow until it ends.
    let mut tasks = Vec::new();
    for (permit, i) in units(permit, f.n)?.into_iter().zip(0u32..) {
        let input = EditInput {
            source: match &f.template_id {
                Some(t) => Source::Template(t.clone()),
                None => Source::Image(image.clone()),
            },
            // Made here from OpenAI's alpha rule: white is the area to edit.
            mask: match &mask_png {
                Some(m) => MaskIn::Image(m.clone(), MaskChannel::Luma),
                None => MaskIn::Whole,
            },
            steps: f.steps,
            guidance: f.guidance,
            prompt: f.prompt.clone(),
            seed: f.seed.wrapping_add(i as u64),
            dilation: 0,
            max_sequence_length: f.max_sequence_length,
            finish: defaults::finish(out.format, out.compression),
            // A template edit runs with its template's LoRAs.
            loras: vec![],
            controlnets: vec![],
            negative_prompt: None,
            true_cfg_scale: defaults::TRUE_CFG_SCALE,
            // One request is one sighting of its image, however many images it asks.
            auto: match (f.auto, i) {
                (false, _) => Auto::Off,
                (true, 0) => Auto::See,
                (true, _) => Auto::Use,
            },
        };
        let steps = input.steps.unwrap_or(0);
        let previews = f
            .stream
            .map_or(Previews::None, |s| Previews::Count(s.partials));
        let keep = f.stream.is_some();
        tasks.push(submit(
            &ctx,
            permit,
            "edit",
            steps,
            previews,
            move |c, job| async move { edit_auto(&c, job, &input).await },
            move |job, o| EditReply::new(job, o, out.format, keep),
        ));
    }
    if let Some(s) = f.stream {
        return stream_reply(&ctx, tasks[0].job, "image_edit", s, format!("{w}x{h}")).await;
    }
    let first = tasks[0].job;
    let mut data = Vec::new();
    for Submitted { job, task } in tasks {
        let o = joined(task).await?;
        let (b64_json, url) = out.entry(&ctx, &base, &o.image)?;
        data.push(ImageData {
            b64_json,
            url,
            id: job_name(job),
            approx_cache: None,
            timings: o.timings,
            pod: (!o.pod.is_empty()).then_some(o.pod),
            auto_template: o.auto_template,
        });
    }
    let r = images_reply(&ctx, data, (w as u32, h as u32), out.format);
    Ok(with_id(first, r))
}

/// OpenAI's images reply: `data` (one entry per image) of `size` pixels.
fn images_reply(
    ctx: &Ctx,
    data: Vec<ImageData>,
    (w, h): (u32, u32),
    format: ImageFormat,
) -> Response {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = ImagesReply {
        created,
        data,
        model: ctx.model.clone(),
        output_format: format.name().into(),
        size: format!("{w}x{h}"),
    };
    (StatusCode::OK, Json(body)).into_response()
}

/// OpenAI's image generation, with denoised's extensions. `model`, `user` and
/// OpenAI's rendering options (quality, style, background, ...) that have no meaning
/// here are accepted and ignored.
#[derive(Deserialize, ToSchema)]
pub(crate) struct ImagesBody {
    prompt: Option<String>,
    /// 1-10 images, seeds `seed`, `seed + 1`, ...
    #[serde(default = "one")]
    n: u32,
    /// `WIDTHxHEIGHT` or `auto` (the model's default).
    size: Option<String>,
    /// `b64_json` (the default) or `url` (`GET /v1/images/{id}`).
    response_format: Option<String>,
    /// `png` (the default), `jpeg` or `webp`.
    output_format: Option<String>,
    /// 0-100: the quality of a `jpeg` or `webp` (lower is smaller).
    output_compression: Option<u8>,
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
    /// Streams `image_generation.partial_image` events (`partial_images` of them, 0-3)
    /// and `image_generation.completed` (`text/event-stream`; one image a request).
    #[serde(default)]
    stream: bool,
    partial_images: Option<u32>,
}

fn one() -> u32 {
    1
}

/// OpenAI's image generation, onto the native generation flow.
#[utoipa::path(post, path = "/v1/images/generations", tag = "openai",
    request_body(content = ImagesBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The images; with `stream`, OpenAI's image events instead.",
            content((ImagesReply = "application/json"), (String = "text/event-stream"))),
        (status = 400, body = OpenAiError), (status = 401, body = ErrorBody),
        (status = 413, body = OpenAiError), (status = 429, body = OpenAiError),
        (status = 500, body = OpenAiError), (status = 503, body = OpenAiError),
        (status = 504, body = OpenAiError),
    ))]
pub(crate) async fn images_generations(State(ctx): State<Arc<Ctx>>, req: Request) -> Response {
    generations(ctx, req).await.unwrap_or_else(openai_error)
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

async fn generations(ctx: Arc<Ctx>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let base = base_url(&ctx, req.headers());
    let b: ImagesBody = parse(&body(&ctx, req).await?)?;
    let prompt = b
        .prompt
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ApiError::bad("`prompt` is required"))?;
    if b.n == 0 || b.n > MAX_N {
        return Err(ApiError::bad(format!("`n` must be 1 to {MAX_N}")));
    }
    let out = Output::of(
        b.output_format.as_deref(),
        b.output_compression,
        b.response_format.as_deref(),
    )?;
    check(&ctx, b.steps, b.guidance, b.max_sequence_length)?;
    let wh = b.size.as_deref().map(size).transpose()?.flatten();
    let loras = resolve_loras(&ctx, &b.loras, false)?;
    let controlnets = resolve_controlnets(&ctx, &b.controlnets)?;
    check_cfg(b.true_cfg_scale)?;
    let stream = streamed(b.stream, b.partial_images, b.n)?;
    let previews = stream.map_or(Previews::None, |s| Previews::Count(s.partials));
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
                format: out.format,
                compression: out.compression,
                loras: loras.clone(),
                negative_prompt: b.negative_prompt.clone(),
                true_cfg_scale: b.true_cfg_scale,
                controlnets: controlnets.clone(),
            };
            start(&ctx, permit, input, stream.is_some(), previews)
        })
        .collect();
    if let Some(s) = stream {
        let size = b.size.clone().unwrap_or_else(|| "auto".into());
        return stream_reply(&ctx, tasks[0].job, "image_generation", s, size).await;
    }
    let first = tasks[0].job;
    let mut data = Vec::new();
    let mut dims = (0, 0);
    for Submitted { job, task } in tasks {
        let o = joined(task).await?;
        dims = (o.width, o.height);
        let (b64_json, url) = out.entry(&ctx, &base, &o.image)?;
        data.push(ImageData {
            b64_json,
            url,
            id: job_name(job),
            approx_cache: Some(o.approx),
            timings: o.timings,
            pod: (!o.pod.is_empty()).then_some(o.pod),
            auto_template: None,
        });
    }
    Ok(with_id(first, images_reply(&ctx, data, dims, out.format)))
}
