//! A generation's or an edit's `controlnets: [{id, image, scale}]` (docs/design.md
//! §Adapters): checked here, run by the ControlNet service (`crate::controlnet`), whose
//! residual stream the request's denoise worker reads.

use serde::Deserialize;

use super::flow::Ctx;
use super::http::{b64, ApiError};
use crate::node;
use crate::wire::{
    groups, ControlNetMsg, ControlStart, ControlStreamRef, JobId, PreparedRefs, Wire,
    WireControlNet, WireError,
};

/// One entry of a request's `controlnets`.
#[derive(Clone, Debug, Deserialize)]
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

fn one() -> f64 {
    1.0
}

/// A checked ControlNet of a request: its name, control image bytes and scale.
#[derive(Clone, Debug)]
pub struct ControlNetInput {
    pub name: String,
    pub image: Vec<u8>,
    pub scale: f64,
}

/// Checks a request's ControlNets against the configuration (the service checks the
/// files and images when it loads them).
pub fn resolve(ctx: &Ctx, refs: &[ControlNetRef]) -> Result<Vec<ControlNetInput>, ApiError> {
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
            crate::denoise::adapters::check_name(&r.id)
                .map_err(|e| ApiError::bad(format!("controlnets: {e}")))?;
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

/// A started stream and the ControlNet process serving it.
pub struct Started {
    pub stream: Option<ControlStreamRef>,
    pub worker: ractor::ActorCell,
}

/// Opens a request's residual stream on a ControlNet process (after preprocessing:
/// the service reads its text embeddings). The control images travel through this
/// process's arena and are released once the service has read them. `active`: an
/// edit's active tokens, the rows its residuals carry (`None`: every row).
pub async fn start(
    ctx: &Ctx,
    job: JobId,
    nets: &[ControlNetInput],
    prepared: &PreparedRefs,
    (steps, seed): (u32, u64),
    active: Option<Vec<u32>>,
) -> Result<Started, WireError> {
    let members = ctx.members(groups::CONTROLNET);
    if members.is_empty() {
        return Err(WireError::new(
            crate::wire::ErrorKind::Unavailable,
            "no ControlNet process is up",
        ));
    }
    let worker = members[job as usize % members.len()].clone();
    let mut images = Vec::with_capacity(nets.len());
    for n in nets {
        match ctx.shm.write_bytes(&n.image) {
            Ok(h) => images.push(h),
            Err(e) => {
                ctx.shm.release(&images);
                return Err(e);
            }
        }
    }
    let req = ControlStart {
        job,
        nets: nets
            .iter()
            .zip(&images)
            .map(|(n, h)| WireControlNet {
                name: n.name.clone(),
                image: h.clone(),
                scale: n.scale,
            })
            .collect(),
        inputs: prepared.inputs.clone(),
        steps,
        width: prepared.width,
        height: prepared.height,
        seed,
        active,
    };
    let r = ctx
        .ask(&worker, |p| ControlNetMsg::Start(Wire(req), p))
        .await;
    ctx.shm.release(&images);
    Ok(Started { stream: r?, worker })
}

/// Closes a stream (the request is over, however it ended).
pub fn stop(s: &Started, job: JobId) {
    node::tell(&s.worker, ControlNetMsg::Stop(Wire(job)));
}
