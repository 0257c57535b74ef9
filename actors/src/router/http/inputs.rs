//! The pieces of request bodies that several routes share, checked and turned into a
//! flow's inputs here at the edge: the schedule's bounds, true CFG's scale, a
//! request's `loras` (resolved against `[adapters] dir`) and `controlnets`, its
//! `output_compression` and its `webhook`.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::b64;
use crate::denoise::adapters::{adapter_path, check_name};
use crate::router::flow::controlnets::ControlNetInput;
use std::sync::Arc;

use crate::router::flow::defaults;
use crate::router::service::webhooks::{self, Hook};
use crate::router::state::Ctx;
use crate::wire::{JobId, WireLora};

type ApiResult<T> = Result<T, ApiError>;

pub(crate) fn check_steps(ctx: &Ctx, steps: Option<u32>) -> ApiResult<()> {
    let max = ctx.config.server.max_steps as u32;
    match steps {
        Some(s) if s == 0 || s > max => {
            Err(ApiError::bad(format!("steps {s} out of range 1..={max}")))
        }
        _ => Ok(()),
    }
}

pub(crate) fn check_guidance(g: Option<f32>) -> ApiResult<()> {
    match g {
        Some(g) if !(g.is_finite() && (0.0..=100.0).contains(&g)) => {
            Err(ApiError::bad(format!("guidance {g} out of range 0..=100")))
        }
        _ => Ok(()),
    }
}

pub(crate) fn check_seq_len(n: u32) -> ApiResult<()> {
    if n == 0 || n > 512 {
        return Err(ApiError::bad(format!(
            "max_sequence_length {n} out of range 1..=512"
        )));
    }
    Ok(())
}

/// A request's `webhook`: only on an async request (a synchronous one has its reply),
/// to a host of `[webhooks] allowed_hosts` (`crate::router::service::webhooks`).
pub(crate) fn webhook(ctx: &Ctx, url: Option<&str>, run_async: bool) -> ApiResult<Option<Hook>> {
    match (url, run_async) {
        (None, _) => Ok(None),
        (Some(_), false) => Err(ApiError::bad(
            "`webhook` needs `async: true` (a synchronous request has its reply)",
        )),
        (Some(u), true) => webhooks::check(ctx, u).map(Some).map_err(ApiError::from),
    }
}

/// Calls `hook` (if any) when `job` ends.
pub(crate) fn call_back(ctx: &Arc<Ctx>, job: JobId, hook: Option<Hook>) {
    if let Some(h) = hook {
        webhooks::deliver_when_done(ctx.clone(), job, h);
    }
}

/// OpenAI's `output_compression`: a percentage, the quality of a JPEG or WebP.
pub(crate) fn check_compression(c: Option<u8>) -> ApiResult<()> {
    match c {
        Some(c) if c > 100 => Err(ApiError::bad(format!(
            "`output_compression` {c} out of range 0..=100"
        ))),
        _ => Ok(()),
    }
}

/// Checks true CFG's scale (one that is not a finite number is refused).
pub(crate) fn check_cfg(scale: f32) -> ApiResult<()> {
    if !scale.is_finite() {
        return Err(ApiError::bad("`true_cfg_scale` must be a finite number"));
    }
    Ok(())
}

/// The serde default of `max_sequence_length`.
pub(crate) fn default_seq_len() -> u32 {
    defaults::MAX_SEQUENCE_LENGTH
}

/// The serde default of `true_cfg_scale` (off).
pub(crate) fn no_cfg() -> f32 {
    defaults::TRUE_CFG_SCALE
}

/// The serde default of an adapter's scale.
fn one() -> f64 {
    1.0
}

/// One entry of a request's `loras`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraRef {
    /// The adapter's name (see `GET /v1/adapters`).
    pub id: String,
    /// diffusers' adapter weight: the delta is scaled by it (default 1).
    #[serde(default = "one")]
    pub scale: f64,
}

/// Resolves a request's `loras`: each names an adapter of `[adapters] dir` with a
/// finite scale, at most `[adapters] max_per_request` of them. `synchronous` (template
/// captures and edits, whose cached activations are the adapted model's at every step)
/// makes K 0; otherwise K is the adapter's profiled value for this model
/// (`bal.json`) or `[adapters] patch_by_step`.
pub fn resolve_loras(
    ctx: &Ctx,
    refs: &[LoraRef],
    synchronous: bool,
) -> Result<Vec<WireLora>, ApiError> {
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

/// One entry of a request's `controlnets`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ControlNetRef {
    /// The ControlNet's directory name under `[adapters] controlnets_dir`.
    pub id: String,
    /// The control image: base64 PNG or JPEG (a data URL too), of the output's size.
    pub image: String,
    /// diffusers' `controlnet_conditioning_scale` (default 1).
    #[serde(default = "one")]
    pub scale: f64,
}

/// Checks a request's ControlNets against the configuration (the service checks the
/// files and images when it loads them).
pub fn resolve_controlnets(
    ctx: &Ctx,
    refs: &[ControlNetRef],
) -> Result<Vec<ControlNetInput>, ApiError> {
    if refs.is_empty() {
        return Ok(Vec::new());
    }
    if ctx.config.workers.controlnet == 0 {
        return Err(ApiError::bad(
            "this daemon runs no ControlNet service ([workers] controlnet = 0)",
        ));
    }
    let max = ctx.config.adapters.max_per_request;
    if refs.len() > max {
        return Err(ApiError::bad(format!(
            "{} ControlNets: at most {max} per request ([adapters] max_per_request)",
            refs.len()
        )));
    }
    refs.iter()
        .map(|r| {
            check_name(&r.id).map_err(|e| ApiError::bad(format!("controlnets: {e}")))?;
            if !r.scale.is_finite() || r.scale.abs() > f32::MAX as f64 {
                return Err(ApiError::bad(format!(
                    "controlnets: `{}`: the scale must be a finite number",
                    r.id
                )));
            }
            Ok(ControlNetInput {
                name: r.id.clone(),
                image: b64(&format!("controlnets `{}` image", r.id), &r.image)?,
                scale: r.scale,
            })
        })
        .collect()
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
