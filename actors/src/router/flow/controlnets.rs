//! A generation's or an edit's ControlNets (docs/design.md §Adapters): checked at the
//! HTTP edge (`crate::router::http::inputs`), run by the ControlNet service
//! (`crate::controlnet`), whose residual stream the request's denoise worker reads.

use crate::node;
use crate::router::state::Ctx;
use crate::wire::{
    groups, ControlNetMsg, ControlStart, ControlStreamRef, JobId, PreparedRefs, Wire,
    WireControlNet, WireError,
};

/// A checked ControlNet of a request: its name, control image bytes and scale.
#[derive(Clone, Debug)]
pub struct ControlNetInput {
    pub name: String,
    pub image: Vec<u8>,
    pub scale: f64,
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
