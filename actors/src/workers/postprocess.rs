//! The postprocess actor: VAE decode of a finished latent, paste-back of the original
//! pixels outside the mask, PNG/JPEG encode; the encoded image goes into this process's
//! arena for the router to read.

use std::time::Instant;

use denoised_runtime::shm::Handle;

use super::{ComputeActor, Stage, StageCommand};
use crate::node::Shm;
use crate::stages::{self, Pipeline};
use crate::wire::{FinishReq, Finished, PostprocessMsg, VaeTraces, Wire, WireError};

/// The postprocess group's stage.
pub struct Postprocess;

pub type PostprocessActor = ComputeActor<Postprocess>;

impl Stage for Postprocess {
    type Msg = PostprocessMsg;
    type Req = FinishReq;
    type Rep = Finished;
    const THREAD: &'static str = "postprocess";

    fn command(msg: PostprocessMsg) -> StageCommand<FinishReq, Finished> {
        match msg {
            PostprocessMsg::Finish(Wire(req), reply) => StageCommand::Work(req, reply),
            PostprocessMsg::Release(Wire(handles)) => StageCommand::Release(handles),
        }
    }

    fn run(p: &Pipeline, shm: &Shm, req: &FinishReq) -> Result<Finished, WireError> {
        finish_to_shm(p, shm, req)
    }

    fn job(req: &FinishReq) -> crate::wire::JobId {
        req.job
    }

    fn handles(rep: &Finished) -> Vec<Handle> {
        rep.handles()
    }
}

fn finish_to_shm(p: &Pipeline, shm: &Shm, req: &FinishReq) -> Result<Finished, WireError> {
    let t0 = Instant::now();
    let (w, h) = (req.width as usize, req.height as usize);
    let image = stages::rgb_from_bytes(shm.read_bytes(&req.image)?, w, h)?;
    let mask = stages::mask_from_bytes(shm.read_bytes(&req.mask)?, w, h)?;
    let source = match &req.source {
        Some(s) => {
            let (sw, sh) = (s.width as usize, s.height as usize);
            Some(stages::Source {
                image: stages::rgb_from_bytes(shm.read_bytes(&s.image)?, sw, sh)?,
                mask: stages::mask_from_bytes(shm.read_bytes(&s.mask)?, sw, sh)?,
            })
        }
        None => None,
    };
    // The finished latent is decoded straight out of the denoise worker's arena, and a
    // template's final latent (the last of its cache) out of the cache's.
    let cols = req.latents.shape.get(1).copied().unwrap_or(0);
    let template = req
        .template
        .as_ref()
        .map(|blob| shm.host_slice(blob))
        .transpose()?;
    // A copy (a latent is small next to the decode) in place of an unaligned cast.
    let final_latent = |latent_bytes: usize| -> Option<Vec<f32>> {
        let t = template.as_ref()?;
        let tail = t.bytes().get(t.len().checked_sub(latent_bytes)?..)?;
        Some(
            tail.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        )
    };
    // Its stored VAE traces are read in place (the edit pinned the template).
    let traces = match &req.vae {
        VaeTraces::Edit(Some(h)) => Some(shm.host_slice(h)?),
        _ => None,
    };
    let f = shm.borrow_f32(&req.latents, |l| {
        let tl = final_latent(std::mem::size_of_val(l));
        let template = tl.as_deref().map(|latent| stages::TemplateDecode {
            latent,
            traces: traces.as_ref(),
        });
        let record = matches!(req.vae, VaeTraces::Capture);
        let pixels = (&image, &mask, source.as_ref());
        stages::finish(p, pixels, l, cols, &req.params, template, record)
    })??;
    let image = shm.write_bytes(&f.bytes)?;
    let vae_trace = f
        .trace
        .as_deref()
        .and_then(|t| stages::trace_to_shm(shm, t, "decoder"));
    Ok(Finished {
        image,
        seconds: t0.elapsed().as_secs_f64(),
        vae_pass: f.pass,
        vae_trace,
    })
}
