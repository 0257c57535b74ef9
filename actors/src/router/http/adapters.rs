//! The adapter routes (docs/design.md §Adapters): `GET /v1/adapters` lists the LoRAs of
//! `[adapters] dir`, `POST /v1/adapters?name=NAME` uploads one (the `.safetensors`
//! bytes as the body). A request's `loras` are resolved in [`super::inputs`].
//!
//! An upload is checked as the denoise workers will read it (every tensor a LoRA factor
//! of a Linear of the served transformer, shapes matching) before it is renamed into
//! place, so a name only ever resolves to a usable file. Names are immutable: a worker
//! keeps an adapter on its device by name, so an upload never replaces one.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use denoised_models::flux::lora::LoraFile;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, ApiResult, ErrorBody};
use crate::denoise::adapters::{adapter_path, check_name};
use crate::router::state::Ctx;

/// The served adapters.
#[derive(Serialize, ToSchema)]
pub struct AdapterList {
    pub data: Vec<AdapterEntry>,
}

#[derive(Serialize, ToSchema)]
pub struct AdapterEntry {
    /// The name a request's `loras` give.
    pub id: String,
    pub bytes: u64,
}

/// An uploaded adapter, as the workers will read it.
#[derive(Serialize, ToSchema)]
pub struct AdapterInfo {
    pub id: String,
    pub bytes: u64,
    pub rank: usize,
    /// The Linear layers it adapts.
    pub modules: usize,
    pub params: u64,
    /// The file's content fingerprint.
    pub fingerprint: String,
}

/// The reply's description of an adapter file.
fn describe(name: &str, f: &LoraFile, bytes: u64) -> AdapterInfo {
    AdapterInfo {
        id: name.to_string(),
        bytes,
        rank: f.rank(),
        modules: f.modules.len(),
        params: f.params(),
        fingerprint: f.fingerprint.clone(),
    }
}

/// The LoRA adapters of `[adapters] dir`, by name.
#[utoipa::path(get, path = "/v1/adapters", tag = "adapters",
    responses((status = 200, body = AdapterList), (status = 401, body = ErrorBody)))]
pub(crate) async fn list(State(ctx): State<Arc<Ctx>>) -> ApiResult {
    let Some(a) = ctx.adapters.as_ref() else {
        return Ok(Json(AdapterList { data: vec![] }).into_response());
    };
    let mut names: Vec<String> = std::fs::read_dir(&a.dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().to_string();
                    let n = n
                        .strip_suffix(".safetensors")
                        .map_or(n.clone(), str::to_string);
                    check_name(&n).ok().map(|_| n)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.dedup();
    let data: Vec<AdapterEntry> = names
        .iter()
        .filter_map(|n| {
            let path = adapter_path(&a.dir, n).ok()?;
            let file = if path.is_dir() {
                path.join(denoised_models::flux::lora::LORA_FILE)
            } else {
                path
            };
            let bytes = std::fs::metadata(&file).ok()?.len();
            Some(AdapterEntry {
                id: n.clone(),
                bytes,
            })
        })
        .collect();
    Ok(Json(AdapterList { data }).into_response())
}

#[derive(Deserialize, IntoParams)]
pub(crate) struct UploadQuery {
    /// The adapter's name: 1-64 characters of `[A-Za-z0-9_.-]`, not taken.
    name: String,
}

/// Uploads a LoRA (the `.safetensors` bytes as the body), checked against the served
/// transformer before it is stored. Names are immutable.
#[utoipa::path(post, path = "/v1/adapters", tag = "adapters", params(UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 201, body = AdapterInfo),
        (status = 400, description = "Not a LoRA of the served transformer.", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 409, description = "The name is taken.", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 500, body = ErrorBody),
    ))]
pub(crate) async fn upload(
    State(ctx): State<Arc<Ctx>>,
    Query(q): Query<UploadQuery>,
    req: Request,
) -> ApiResult {
    let a = ctx
        .adapters
        .as_ref()
        .ok_or_else(|| ApiError::bad("this daemon serves no adapters"))?;
    check_name(&q.name).map_err(ApiError::bad)?;
    if adapter_path(&a.dir, &q.name).is_ok() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "adapter `{}` exists; names are immutable (upload under a new name)",
                q.name
            ),
        ));
    }
    let limit = ctx.config.adapters.max_upload_bytes as usize;
    let bytes: Bytes = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("the adapter is larger than {limit} bytes ([adapters] max_upload_bytes)"),
            )
        })?;
    std::fs::create_dir_all(&a.dir)
        .map_err(|e| ApiError::internal(format!("{}: {e}", a.dir.display())))?;
    // Written beside its final place under a name no request can resolve, checked,
    // then renamed: a name never points at a partial or unusable file.
    let tmp = a
        .dir
        .join(format!(".upload-{}-{}.safetensors", q.name, ctx.next_job()));
    let final_path = a.dir.join(format!("{}.safetensors", q.name));
    let n = bytes.len() as u64;
    let checked = (|| -> Result<AdapterInfo, ApiError> {
        std::fs::write(&tmp, &bytes)
            .map_err(|e| ApiError::internal(format!("{}: {e}", tmp.display())))?;
        let f = LoraFile::open(&tmp, &a.transformer)
            .map_err(|e| ApiError::bad(e.to_string().replace(&*tmp.to_string_lossy(), &q.name)))?;
        std::fs::rename(&tmp, &final_path)
            .map_err(|e| ApiError::internal(format!("{}: {e}", final_path.display())))?;
        Ok(describe(&q.name, &f, n))
    })();
    if checked.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    tracing::info!(adapter = %q.name, bytes = n, ok = checked.is_ok(), "adapter upload");
    Ok((StatusCode::CREATED, Json(checked?)).into_response())
}
