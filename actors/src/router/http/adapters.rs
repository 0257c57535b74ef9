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
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use crate::denoise::adapters::{adapter_path, check_name};
use crate::router::state::Ctx;

/// The reply's description of an adapter file.
fn describe(name: &str, f: &LoraFile, bytes: u64) -> Value {
    json!({
        "id": name,
        "bytes": bytes,
        "rank": f.rank(),
        "modules": f.modules.len(),
        "params": f.params(),
        "fingerprint": f.fingerprint,
    })
}

/// `GET /v1/adapters`: the adapters of `[adapters] dir`, by name.
pub(crate) async fn list(State(ctx): State<Arc<Ctx>>) -> ApiResult {
    let Some(a) = ctx.adapters.as_ref() else {
        return Ok(Json(json!({"data": []})).into_response());
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
    let data: Vec<Value> = names
        .iter()
        .filter_map(|n| {
            let path = adapter_path(&a.dir, n).ok()?;
            let file = if path.is_dir() {
                path.join(denoised_models::flux::lora::LORA_FILE)
            } else {
                path
            };
            let bytes = std::fs::metadata(&file).ok()?.len();
            Some(json!({"id": n, "bytes": bytes}))
        })
        .collect();
    Ok(Json(json!({"data": data})).into_response())
}

#[derive(Deserialize)]
pub(crate) struct UploadQuery {
    name: String,
}

/// `POST /v1/adapters?name=NAME`.
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
    let checked = (|| -> Result<Value, ApiError> {
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
