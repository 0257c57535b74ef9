//! `POST /v1/edits`: an edit of a template (mask-aware: only the masked tokens are
//! computed against the template's cache) or of an inline image (a full FLUX.1 Fill
//! run), with LoRAs, ControlNets and true CFG.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::binary::Body;
use super::error::{ApiError, ApiResult, ErrorBody};
use super::extract::{b64, body, parse};
use super::inputs::{
    call_back, check_cfg, check_compression, check_guidance, check_seq_len, check_steps,
    default_seq_len, no_cfg, resolve_controlnets, resolve_loras, webhook, ControlNetRef, LoraRef,
};
use super::respond::{respond, JobAccepted, Reply};
use crate::router::flow::auto::edit_auto;
use crate::router::flow::defaults;
use crate::router::flow::edit::{Auto, EditInput, MaskIn, Source};
use crate::router::flow::generate::true_cfg_of;
use crate::router::service::{admit, submit, EditReply, Submitted};
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::{FinishParams, ImageFormat};

/// Which channel of a mask image marks the pixels to repaint (`wire::MaskChannel`).
#[derive(Clone, Copy, Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum MaskChannelBody {
    /// Alpha where the mask has transparent pixels, else luma.
    #[default]
    Auto,
    /// White (luminance 128 and up) is repaint.
    Luma,
    /// Opaque (alpha 128 and up) is repaint.
    Alpha,
}

impl From<MaskChannelBody> for crate::wire::MaskChannel {
    fn from(c: MaskChannelBody) -> Self {
        match c {
            MaskChannelBody::Auto => crate::wire::MaskChannel::Auto,
            MaskChannelBody::Luma => crate::wire::MaskChannel::Luma,
            MaskChannelBody::Alpha => crate::wire::MaskChannel::Alpha,
        }
    }
}

/// An edit: of a template (`template_id`) or of an inline `image`, with exactly one
/// of `mask`, `boxes` and `polygons`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct EditBody {
    /// A registered template: a mask-aware edit (only the masked tokens are computed).
    template_id: Option<String>,
    /// An image to edit in full: base64 PNG or JPEG (a data URL too).
    image: Option<String>,
    /// The mask: base64 PNG or JPEG of the image's size (or its aspect: resized to
    /// it), white where the image changes; a PNG whose alpha is not opaque everywhere
    /// (strokes painted on a transparent layer) is read from its alpha, opaque where
    /// the image changes (see `mask_channel`). Omitted (with no `boxes` or `polygons`)
    /// on an image: an instruction edit of the whole image, which needs a FLUX.1
    /// Kontext model (a Fill model answers 400).
    mask: Option<String>,
    /// Which channel of `mask` marks the pixels to repaint: `auto` (the default: alpha
    /// where the mask has transparent pixels, else luma), `luma` (white) or `alpha`
    /// (opaque).
    #[serde(default)]
    mask_channel: MaskChannelBody,
    /// The mask as pixel rectangles `[x, y, width, height]`.
    boxes: Option<Vec<[u32; 4]>>,
    /// The mask as polygons of `[x, y]` pixel points.
    polygons: Option<Vec<Vec<[f32; 2]>>>,
    #[serde(default)]
    prompt: String,
    /// Default 28; a template edit runs its template's (giving another is a 400).
    steps: Option<u32>,
    /// Default 30; a template edit runs its template's.
    guidance: Option<f32>,
    #[serde(default)]
    seed: u64,
    /// Pixels the mask grows by (0-64).
    #[serde(default)]
    dilation: u32,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    /// Paste the edit back over the source outside the mask.
    #[serde(default = "paste_back")]
    paste_back: bool,
    /// The soft edge of the paste, in pixels (0-64).
    #[serde(default = "feather")]
    feather: u32,
    /// `png` (the default), `jpeg` or `webp`.
    #[serde(default)]
    format: ImageFormat,
    /// The quality of a `jpeg` or `webp` image, 0-100 (OpenAI's `output_compression`:
    /// lower is smaller; default JPEG 92, WebP 90); PNG ignores it.
    output_compression: Option<u8>,
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
    #[serde(default)]
    controlnets: Vec<ControlNetRef>,
    /// True CFG (FluxPipeline's fields; FluxFillPipeline has none): runs with a
    /// negative prompt and a scale above 1.
    negative_prompt: Option<String>,
    #[serde(default = "no_cfg")]
    true_cfg_scale: f32,
    /// `false`: this edit of an uploaded image runs in full, whatever `[templates]
    /// auto` would do with it, and counts no sighting (for a run that must be the
    /// dense one).
    #[serde(default = "auto_on")]
    use_auto_template: bool,
}

fn auto_on() -> bool {
    true
}

fn paste_back() -> bool {
    defaults::PASTE_BACK
}
fn feather() -> u32 {
    defaults::FEATHER
}

fn edit_input(ctx: &Ctx, b: EditBody) -> ApiResult<(EditInput, Reply)> {
    let reply = Reply::of(b.run_async, b.stream)?;
    let loras = resolve_loras(ctx, &b.loras, b.template_id.is_some())?;
    let controlnets = resolve_controlnets(ctx, &b.controlnets)?;
    check_cfg(b.true_cfg_scale)?;
    let true_cfg = true_cfg_of(b.negative_prompt.as_deref(), b.true_cfg_scale);
    if !controlnets.is_empty() && true_cfg.is_some() {
        return Err(ApiError::bad(
            "ControlNets and true CFG do not run together",
        ));
    }
    let source =
        match (b.template_id, b.image) {
            (Some(t), None) => Source::Template(t),
            (None, Some(i)) => Source::Image(b64("image", &i)?),
            _ => return Err(ApiError::bad(
                "give exactly one of `template_id` (a mask-aware edit) and `image` (a full run)",
            )),
        };
    let mask = match (b.mask, b.boxes, b.polygons) {
        (Some(m), None, None) => MaskIn::Image(b64("mask", &m)?, b.mask_channel.into()),
        (None, Some(bx), None) => MaskIn::Boxes(bx),
        (None, None, Some(p)) => MaskIn::Polygons(p),
        // An instruction edit (a FLUX.1 Kontext model); a template edit needs its mask.
        (None, None, None) if matches!(source, Source::Image(_)) => MaskIn::Whole,
        _ => {
            return Err(ApiError::bad(
                "give exactly one of `mask` (base64 image), `boxes` and `polygons` (or none, for an instruction edit of an image on a FLUX.1 Kontext model)",
            ))
        }
    };
    // Hostile boxes and polygons are refused here, before any work is queued.
    let shapes = match &mask {
        MaskIn::Boxes(bx) => crate::stages::MaskInput::Boxes(bx),
        MaskIn::Polygons(p) => crate::stages::MaskInput::Polygons(p),
        MaskIn::Image(..) | MaskIn::Whole => crate::stages::MaskInput::Empty,
    };
    crate::stages::check_shapes(&shapes)?;
    check_compression(b.output_compression)?;
    if b.dilation > 64 || b.feather > 64 {
        return Err(ApiError::bad("dilation and feather must be at most 64"));
    }
    let input = EditInput {
        source,
        mask,
        steps: b.steps,
        guidance: b.guidance,
        prompt: b.prompt,
        seed: b.seed,
        dilation: b.dilation,
        max_sequence_length: b.max_sequence_length,
        finish: FinishParams {
            paste_back: b.paste_back,
            feather: b.feather,
            format: b.format,
            compression: b.output_compression,
        },
        loras,
        controlnets,
        negative_prompt: b.negative_prompt,
        true_cfg_scale: b.true_cfg_scale,
        auto: match b.use_auto_template {
            true => Auto::See,
            false => Auto::Off,
        },
    };
    Ok((input, reply))
}

/// Edits an image: a template's (mask-aware) or an inline one (a full FLUX.1 Fill run).
#[utoipa::path(post, path = "/v1/edits", tag = "edits",
    request_body(content = EditBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The edited image. With `Accept: image/png`, `image/jpeg` or `image/webp` (`image/*`: the request's `format`), the image's bytes, the reply's other fields in `x-denoised-*` headers (a synchronous request's). With `stream`, the job's events instead (`GET /v1/jobs/{id}/events`).",
            content((EditReply = "application/json"), (String = "text/event-stream"), (Vec<u8> = "image/png"), (Vec<u8> = "image/jpeg"), (Vec<u8> = "image/webp")),
            headers(("x-request-id" = String, description = "The request's id."))),
        (status = 202, description = "`async`: the job to poll.", body = JobAccepted),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown template.", body = ErrorBody),
        (status = 409, description = "Cancelled.", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 429, body = ErrorBody),
        (status = 500, body = ErrorBody), (status = 503, body = ErrorBody),
        (status = 504, body = ErrorBody),
    ))]
pub(crate) async fn create_edit(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    // Before reading the body: an overloaded server refuses at once.
    let permit = admit(&ctx)?;
    let accept = Body::of(req.headers());
    let b: EditBody = parse(&body(&ctx, req).await?)?;
    check_steps(&ctx, b.steps)?;
    check_guidance(b.guidance)?;
    check_seq_len(b.max_sequence_length)?;
    let preview_every = b.preview_every;
    let hook = webhook(&ctx, b.webhook.as_deref(), b.run_async)?;
    let (mut input, reply) = edit_input(&ctx, b)?;
    input.finish.format = accept.format(input.finish.format);
    let format = input.finish.format;
    let steps = input.steps.unwrap_or(0);
    // A synchronous client gets the image in its response; the job table keeps only the
    // description then (no second copy of the image for the TTL).
    let keep = reply.keeps_result();
    let Submitted { job, task } = submit(
        &ctx,
        permit,
        "edit",
        steps,
        Previews::Every(preview_every),
        move |ctx, job| async move { edit_auto(&ctx, job, &input).await },
        move |job, o| EditReply::new(job, o, format, keep),
    );
    call_back(&ctx, job, hook);
    respond(&ctx, job, task, reply, move |out| match accept {
        Body::Json => Json(EditReply::new(job, out, format, true)).into_response(),
        image => image.reply(&EditReply::new(job, out, format, false), &out.image, format),
    })
    .await
}
