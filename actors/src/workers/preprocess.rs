//! The preprocess actor: decode the image and mask, build the token mask, encode the
//! prompt, VAE-encode the masked image and draw the noise; the tensors go into this
//! process's arena and only their handles go back to the router.

use std::sync::Arc;

use crossbeam_channel::Sender;
use denoised_runtime::shm::Handle;
use denoised_runtime::Tensor;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::node::Shm;
use crate::stages::{self, MaskInput, Pipeline};
use crate::wire::{
    InputHandles, MaskSpec, PrepareReq, Prepared, PreprocessMsg, Reply, Wire, WireError,
};

pub struct PreprocessActor;

pub struct PreprocessState {
    work: Sender<(PrepareReq, Reply<Prepared>)>,
    shm: Arc<Shm>,
}

impl Actor for PreprocessActor {
    type Msg = PreprocessMsg;
    type State = PreprocessState;
    type Arguments = (Arc<Pipeline>, Arc<Shm>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (pipeline, shm): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let s = shm.clone();
        let work = super::compute_thread(
            "preprocess",
            move |(req, reply): (PrepareReq, Reply<Prepared>)| {
                let _ = reply.send(Wire(prepare_to_shm(&pipeline, &s, &req)));
            },
        );
        Ok(PreprocessState { work, shm })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PreprocessMsg::Prepare(Wire(req), reply) => {
                let _ = st.work.send((req, reply));
            }
            PreprocessMsg::Release(Wire(handles)) => st.shm.release(&handles),
        }
        Ok(())
    }
}

/// Runs the preparation and writes its tensors to shared memory.
pub fn prepare_to_shm(p: &Pipeline, shm: &Shm, req: &PrepareReq) -> Result<Prepared, WireError> {
    let image = shm.read_bytes(&req.image)?;
    let mask_bytes = match &req.mask {
        MaskSpec::Image(h) => Some(shm.read_bytes(h)?),
        _ => None,
    };
    let mask = match (&req.mask, &mask_bytes) {
        (MaskSpec::Image(_), Some(b)) => MaskInput::Image(b),
        (MaskSpec::Boxes(b), _) => MaskInput::Boxes(b),
        (MaskSpec::Polygons(p), _) => MaskInput::Polygons(p),
        _ => MaskInput::Empty,
    };
    let s1 = stages::prepare(p, &image, mask, &req.params, req.max_pixels as usize)?;
    let mut written: Vec<Handle> = Vec::new();
    let result = (|| {
        let mut put = |t: &Tensor| -> Result<Handle, WireError> {
            let h = shm.write_tensor(t)?;
            written.push(h.clone());
            Ok(h)
        };
        let i = &s1.prepared.inputs;
        let pooled = Tensor::new([i.pooled.len()], i.pooled.clone())
            .map_err(|e| WireError::internal(e.to_string()))?;
        let inputs = InputHandles {
            latents: put(&i.latents)?,
            cond: put(&i.cond)?,
            img_ids: put(&i.img_ids)?,
            txt: put(&i.txt)?,
            txt_ids: put(&i.txt_ids)?,
            pooled: put(&pooled)?,
            guidance: i.guidance,
        };
        let image = shm.write_bytes(&s1.prepared.image.data)?;
        written.push(image.clone());
        let mask = shm.write_bytes(&stages::mask_to_bytes(&s1.prepared.mask))?;
        written.push(mask.clone());
        let tm = &s1.token_mask;
        Ok(Prepared {
            inputs,
            image,
            mask,
            width: s1.prepared.image.width as u32,
            height: s1.prepared.image.height as u32,
            rows: tm.rows as u32,
            cols: tm.cols as u32,
            active: tm.active().to_vec(),
            pixel_ratio: tm.pixel_ratio,
            prompt_truncated: s1.prepared.prompt_truncated,
            seconds: s1.seconds,
        })
    })();
    if result.is_err() {
        shm.release(&written);
    }
    result
}
