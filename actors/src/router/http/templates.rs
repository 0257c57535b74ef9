//! The template routes: `POST /v1/templates` registers one (JSON with a base64 image,
//! or multipart), `GET /v1/templates` lists them, `GET`/`DELETE /v1/templates/{id}`.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::{ApiError, ApiResult, ErrorBody};
use super::extract::{b64, body, parse, read_multipart};
use super::inputs::{
    call_back, check_guidance, check_seq_len, check_steps, default_seq_len, resolve_loras, webhook,
    LoraRef,
};
use super::respond::{accepted, joined, with_id, JobAccepted};
use crate::router::flow::capture::{capture, claim, TemplateInput};
use crate::router::flow::defaults;
use crate::router::service::{admit, submit, Submitted};
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::TemplateInfo;

/// A template to register: its image is generated once (a capture run) and its
/// activations cached, so that its edits compute only their masked tokens.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TemplateBody {
    /// The template image: base64 PNG or JPEG (a data URL too); in a multipart body,
    /// the `image` file part.
    image: String,
    /// 1-64 characters of `[A-Za-z0-9_-]`; default a generated `tpl_...` id.
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    prompt: String,
    /// Every edit of the template runs these steps (default 28).
    steps: Option<u32>,
    /// Every edit of the template runs this guidance (default 30).
    guidance: Option<f32>,
    #[serde(default)]
    seed: u64,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    /// Answer 202 at once with a job to poll.
    #[serde(default, rename = "async")]
    run_async: bool,
    /// With `async`: post the job's end to this URL, signed (Standard Webhooks; its
    /// host must be in `[webhooks] allowed_hosts`).
    webhook: Option<String>,
    /// Replace a template of the same id (409 without it).
    #[serde(default)]
    replace: bool,
    /// `kv` or `y`; the default is `[cache] mode`.
    #[serde(default)]
    cache_mode: Option<String>,
    #[serde(default)]
    loras: Vec<LoraRef>,
}

/// Registers a template: JSON with a base64 image, or multipart with an `image` file
/// and the other fields as text parts. The reply comes once the template is durable.
#[utoipa::path(post, path = "/v1/templates", tag = "templates",
    request_body(content(
        (TemplateBody = "application/json"),
        (TemplateBody = "multipart/form-data"),
    )),
    responses(
        (status = 201, description = "Registered.", body = TemplateInfo),
        (status = 202, description = "`async`: the job to poll.", body = JobAccepted),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 409, description = "The id is taken (see `replace`).", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 429, body = ErrorBody),
        (status = 500, body = ErrorBody), (status = 503, body = ErrorBody),
        (status = 504, body = ErrorBody),
    ))]
pub(crate) async fn create_template(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    let permit = admit(&ctx)?;
    let is_multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let (image, b) = if is_multipart {
        multipart_template(&ctx, req).await?
    } else {
        let b: TemplateBody = parse(&body(&ctx, req).await?)?;
        (b64("image", &b.image)?, b)
    };
    check_steps(&ctx, b.steps)?;
    check_guidance(b.guidance)?;
    check_seq_len(b.max_sequence_length)?;
    let id = match b.id {
        Some(id) => {
            crate::wire::check_template_id(&id).map_err(ApiError::bad)?;
            id
        }
        None => format!("tpl_{:016x}", ctx.next_job()),
    };
    let hook = webhook(&ctx, b.webhook.as_deref(), b.run_async)?;
    let identity = claim(&ctx, &id, b.replace).await?;
    let cache_mode = b
        .cache_mode
        .as_deref()
        .unwrap_or(&ctx.config.cache.mode)
        .parse()
        .map_err(ApiError::bad)?;
    let input = TemplateInput {
        id,
        image,
        prompt: b.prompt,
        steps: b.steps.unwrap_or(defaults::STEPS),
        guidance: b.guidance.unwrap_or(ctx.edit_guidance),
        seed: b.seed,
        max_sequence_length: b.max_sequence_length,
        replace: b.replace,
        identity,
        cache_mode,
        step_stride: ctx.config.cache.kv_step_stride,
        loras: resolve_loras(&ctx, &b.loras, true)?,
    };
    let steps = input.steps;
    let Submitted { job, task } = submit(
        &ctx,
        permit,
        "template",
        steps,
        Previews::None,
        move |ctx, job| async move { capture(&ctx, job, &input).await },
        |_, info| info.clone(),
    );
    call_back(&ctx, job, hook);
    if b.run_async {
        return Ok(accepted(job));
    }
    match joined(task).await {
        Ok(info) => Ok(with_id(
            job,
            (StatusCode::CREATED, Json(info)).into_response(),
        )),
        Err(e) => Ok(with_id(job, e.into_response())),
    }
}

async fn multipart_template(ctx: &Ctx, req: Request) -> ApiResult<(Vec<u8>, TemplateBody)> {
    let (bin, text) = read_multipart(ctx, req, &["image"]).await?;
    let mut fields = serde_json::Map::new();
    for (name, text) in text {
        let v = match name.as_str() {
            "prompt" | "id" | "cache_mode" => Value::String(text),
            "async" | "replace" => Value::Bool(text == "true" || text == "1"),
            _ => serde_json::from_str(&text).unwrap_or(Value::String(text)),
        };
        fields.insert(name, v);
    }
    let image = bin
        .into_iter()
        .next()
        .map(|(_, b)| b)
        .ok_or_else(|| ApiError::bad("multipart: no `image` part"))?;
    fields.insert("image".into(), Value::String(String::new()));
    let b: TemplateBody = serde_json::from_value(Value::Object(fields))
        .map_err(|e| ApiError::bad(format!("multipart fields: {e}")))?;
    Ok((image, b))
}

/// The registered templates.
#[derive(Serialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<TemplateInfo>,
}

/// The registered templates, with where each is now (`tiers`).
#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList), (status = 401, body = ErrorBody),
        (status = 503, body = ErrorBody)))]
pub(crate) async fn list_templates(State(ctx): State<Arc<Ctx>>) -> ApiResult {
    let templates = ctx.templates().await?;
    Ok(Json(TemplateList { templates }).into_response())
}

/// One template's description.
#[utoipa::path(get, path = "/v1/templates/{id}", tag = "templates",
    params(("id" = String, Path, description = "The template's id.")),
    responses((status = 200, body = TemplateInfo), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(crate) async fn get_template(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(ctx.template(&id).await?.info).into_response())
}

/// Deletes a template (edits running on it finish first: they pin it).
#[utoipa::path(delete, path = "/v1/templates/{id}", tag = "templates",
    params(("id" = String, Path, description = "The template's id.")),
    responses((status = 200, description = "The deleted template.", body = TemplateInfo),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody)))]
pub(crate) async fn delete_template(
    State(ctx): State<Arc<Ctx>>,
    Path(id): Path<String>,
) -> ApiResult {
    // In a cluster, from every pod (docs/cluster.md).
    let info = crate::router::flow::identity::delete(&ctx, &id).await?;
    Ok(Json(info).into_response())
}
