//! LoRA adapters at the router (docs/design.md §Adapters): a request's `loras`, resolved
//! against `[adapters] dir`, and the adapter routes: `GET /v1/adapters` lists them,
//! `POST /v1/adapters?name=NAME` uploads one (the `.safetensors` bytes as the body).
//!
//! An upload is checked as the denoise workers will read it (every tensor a LoRA factor
//! of a Linear of the served transformer, shapes matching) before it is renamed into
//! place, so a name only ever resolves to a usable file. Names are immutable: a worker
//! keeps an adapter on its device by name, so an upload never replaces one.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use denoised_models::flux::lora::LoraFile;
use denoised_models::FluxConfig;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::flow::Ctx;
use super::http::{ApiError, ApiResult};
use crate::denoise::adapters::{adapter_path, check_name};
use crate::wire::WireLora;

/// What the router knows of the served adapters.
pub struct AdapterDir {
    pub dir: PathBuf,
    /// The served transformer's config: uploads are checked against it.
    pub transformer: FluxConfig,
}

/// One entry of a request's `loras`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraRef {
    /// The adapter's name (see `GET /v1/adapters`).
    pub id: String,
    /// diffusers' adapter weight: the delta is scaled by it (default 1).
    #[serde(default = "one")]
    pub scale: f64,
}

fn one() -> f64 {
    1.0
}

/// A LoRA as a reply reports it: the step of the request's schedule it applied from.
#[derive(Clone, Debug, Serialize)]
pub struct LoraApplied {
    pub id: String,
    pub scale: f64,
    pub applied_at_step: Option<u32>,
}

/// The reply's `loras` of a request that ran with `loras`, whose set applied at `at`.
pub fn applied(loras: &[WireLora], at: Option<u32>) -> Vec<LoraApplied> {
    loras
        .iter()
        .map(|l| LoraApplied {
            id: l.name.clone(),
            scale: l.scale,
            // A merged set is in the weights from the first step.
            applied_at_step: if l.merged { Some(0) } else { at },
        })
        .collect()
}

/// Resolves a request's `loras`: each names an adapter of `[adapters] dir` with a
/// finite scale, at most `[adapters] max_per_request` of them. `synchronous` (template
/// captures and edits, whose cached activations are the adapted model's at every step)
/// makes K 0; otherwise K is the adapter's profiled value for this model
/// (`bal.json`) or `[adapters] patch_by_step`.
pub fn resolve(ctx: &Ctx, refs: &[LoraRef], synchronous: bool) -> Result<Vec<WireLora>, ApiError> {
    // A daemon with a merged set serves that adapted model only: a request runs with
    // it (named or not), and one naming another set is refused.
    let merged = ctx
        .config
        .adapters
        .merged_set()
        .map_err(ApiError::internal)?;
    if !merged.is_empty() {
        let same = refs.len() == merged.len()
            && refs
                .iter()
                .zip(&merged)
                .all(|(r, (n, s))| r.id == *n && r.scale == *s);
        if !refs.is_empty() && !same {
            return Err(ApiError::bad(format!(
                "this daemon serves the LoRA set {:?} merged into its weights ([adapters] merged): a request runs with it, and names no other",
                ctx.config.adapters.merged
            )));
        }
        return Ok(merged
            .into_iter()
            .map(|(name, scale)| WireLora {
                name,
                scale,
                patch_by: 0,
                merged: true,
            })
            .collect());
    }
    if refs.is_empty() {
        return Ok(vec![]);
    }
    let a = ctx
        .adapters
        .as_ref()
        .ok_or_else(|| ApiError::bad("this daemon serves no adapters"))?;
    if !ctx.config.denoise.disaggregate {
        return Err(ApiError::bad(
            "LoRAs run on the disaggregated workers only ([denoise] disaggregate = true)",
        ));
    }
    let max = ctx.config.adapters.max_per_request;
    if refs.len() > max {
        return Err(ApiError::bad(format!(
            "`loras`: {} adapters, at most {max} ([adapters] max_per_request)",
            refs.len()
        )));
    }
    refs.iter()
        .map(|r| {
            if !r.scale.is_finite() || r.scale.abs() > f32::MAX as f64 {
                return Err(ApiError::bad(format!(
                    "`loras`: `{}` has a scale that is not a finite number",
                    r.id
                )));
            }
            let path =
                adapter_path(&a.dir, &r.id).map_err(|e| ApiError::bad(format!("`loras`: {e}")))?;
            Ok(WireLora {
                name: r.id.clone(),
                scale: r.scale,
                merged: false,
                patch_by: if synchronous {
                    0
                } else {
                    profiled_k(&path, &ctx.model).unwrap_or(ctx.config.adapters.patch_by_step)
                },
            })
        })
        .collect()
}

/// The file `denoised bench profile-lora --write` leaves in an adapter's directory: K per
/// model fingerprint.
pub const BAL_FILE: &str = "bal.json";

/// An adapter's profiled K for the model `fingerprint`, if any.
fn profiled_k(path: &std::path::Path, fingerprint: &str) -> Option<u32> {
    let file = if path.is_dir() {
        path.join(BAL_FILE)
    } else {
        path.with_extension("bal.json")
    };
    let v: Value = serde_json::from_slice(&std::fs::read(file).ok()?).ok()?;
    v.get(fingerprint)?.get("k")?.as_u64().map(|k| k as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profiled_k_is_read_for_its_model_only() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("a");
        std::fs::create_dir(&dir).unwrap();
        let file = d.path().join("b.safetensors");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(profiled_k(&dir, "m1"), None, "no bal.json");
        std::fs::write(dir.join(BAL_FILE), r#"{"m1": {"k": 3}}"#).unwrap();
        std::fs::write(d.path().join("b.bal.json"), r#"{"m2": {"k": 7}}"#).unwrap();
        assert_eq!(profiled_k(&dir, "m1"), Some(3));
        assert_eq!(profiled_k(&dir, "m2"), None, "another model's K");
        assert_eq!(profiled_k(&file, "m2"), Some(7));
    }
}

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
pub(super) async fn list(State(ctx): State<Arc<Ctx>>) -> ApiResult {
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
pub(super) struct UploadQuery {
    name: String,
}

/// `POST /v1/adapters?name=NAME`.
pub(super) async fn upload(
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

/// The adapters of a template's key in the cache files (`TemplateMeta::adapters`).
pub fn set_key(loras: &[WireLora]) -> String {
    loras
        .iter()
        .map(|l| format!("{}*{}", l.name, l.scale))
        .collect::<Vec<_>>()
        .join("+")
}
