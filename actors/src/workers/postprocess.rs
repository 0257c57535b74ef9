//! The postprocess actor: VAE decode of a finished latent, paste-back of the original
//! pixels outside the mask, PNG/JPEG encode; the encoded image goes into this process's
//! arena for the router to read.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::node::Shm;
use crate::stages::{self, Pipeline};
use crate::wire::{FinishReq, Finished, PostprocessMsg, Reply, Wire, WireError};

pub struct PostprocessActor;

pub struct PostprocessState {
    work: Sender<(FinishReq, Reply<Finished>)>,
    shm: Arc<Shm>,
}

impl Actor for PostprocessActor {
    type Msg = PostprocessMsg;
    type State = PostprocessState;
    type Arguments = (Arc<Pipeline>, Arc<Shm>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (pipeline, shm): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let s = shm.clone();
        let work = super::compute_thread(
            "postprocess",
            move |(req, reply): (FinishReq, Reply<Finished>)| {
                let _ = reply.send(Wire(finish_to_shm(&pipeline, &s, &req)));
            },
        );
        Ok(PostprocessState { work, shm })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PostprocessMsg::Finish(Wire(req), reply) => {
                let _ = st.work.send((req, reply));
            }
            PostprocessMsg::Release(Wire(handles)) => st.shm.release(&handles),
        }
        Ok(())
    }
}

fn finish_to_shm(p: &Pipeline, shm: &Shm, req: &FinishReq) -> Result<Finished, WireError> {
    let t0 = Instant::now();
    let (w, h) = (req.width as usize, req.height as usize);
    let image = stages::rgb_from_bytes(shm.read_bytes(&req.image)?, w, h)?;
    let mask = stages::mask_from_bytes(shm.read_bytes(&req.mask)?, w, h)?;
    // The finished latent is decoded straight out of the denoise worker's arena.
    let cols = req.latents.shape.get(1).copied().unwrap_or(0);
    let bytes = shm.borrow_f32(&req.latents, |l| {
        stages::finish(p, &image, &mask, l, cols, &req.params)
    })??;
    Ok(Finished {
        image: shm.write_bytes(&bytes)?,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
