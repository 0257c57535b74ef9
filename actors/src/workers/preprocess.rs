//! The preprocess actor: decode the image and mask, build the token mask, encode the
//! prompt, VAE-encode the masked image and draw the noise (a generation: encode the
//! prompt and draw the noise); the tensors go into this
//! process's arena and only their handles go back to the router.

use denoised_runtime::shm::Handle;
use denoised_runtime::Tensor;

use super::{ComputeActor, Stage, StageCommand};
use crate::node::Shm;
use crate::stages::{self, MaskInput, Pipeline, TemplateVae};
use crate::wire::{
    InputHandles, MaskSpec, NegativeHandles, PrepareInput, PrepareReq, PreparedRefs, PreprocessMsg,
    ReferenceHandles, SourceRefs, VaeTraces, Wire, WireError,
};

/// The preprocess group's stage.
pub struct Preprocess;

pub type PreprocessActor = ComputeActor<Preprocess>;

impl Stage for Preprocess {
    type Msg = PreprocessMsg;
    type Req = PrepareReq;
    type Rep = PreparedRefs;
    const THREAD: &'static str = "preprocess";

    fn command(msg: PreprocessMsg) -> StageCommand<PrepareReq, PreparedRefs> {
        match msg {
            PreprocessMsg::Prepare(Wire(req), reply) => StageCommand::Work(req, reply),
            PreprocessMsg::Release(Wire(handles)) => StageCommand::Release(handles),
        }
    }

    fn run(p: &Pipeline, shm: &Shm, req: &PrepareReq) -> Result<PreparedRefs, WireError> {
        prepare_to_shm(p, shm, req)
    }

    fn job(req: &PrepareReq) -> crate::wire::JobId {
        req.job
    }

    fn handles(rep: &PreparedRefs) -> Vec<Handle> {
        rep.handles()
    }
}

/// The encoded image and (for an image mask) mask bytes of an edit, read out of the
/// router's arena.
pub(crate) fn read_request(
    shm: &Shm,
    image: &Handle,
    mask: &MaskSpec,
) -> Result<(Vec<u8>, Option<Vec<u8>>), WireError> {
    let image = shm.read_bytes(image)?;
    let mask = match mask {
        MaskSpec::Image(h, _) => Some(shm.read_bytes(h)?),
        _ => None,
    };
    Ok((image, mask))
}

/// Runs the preparation and writes its tensors to shared memory.
pub fn prepare_to_shm(
    p: &Pipeline,
    shm: &Shm,
    req: &PrepareReq,
) -> Result<PreparedRefs, WireError> {
    let max_pixels = req.max_pixels as usize;
    let s1 = match &req.input {
        PrepareInput::Edit {
            image,
            mask,
            vae,
            negative_prompt,
        } => {
            let (image, mask_bytes) = read_request(shm, image, mask)?;
            let mask = MaskInput::new(mask, mask_bytes.as_deref());
            // The template's traces are read in place from the cache's arena (the edit
            // pinned the template, so they stay while this runs).
            let vae = match vae {
                VaeTraces::Edit(h) => {
                    TemplateVae::Edit(h.as_ref().map(|h| shm.host_slice(h)).transpose()?)
                }
                VaeTraces::Capture => TemplateVae::Capture,
                VaeTraces::None => TemplateVae::None,
            };
            let negative = negative_prompt.as_deref();
            let sizes = stages::Sizes {
                max_pixels,
                max_tokens: req.max_tokens as usize,
            };
            stages::prepare(p, &image, mask, &req.params, sizes, (vae, negative))?
        }
        PrepareInput::Generate {
            width,
            height,
            negative_prompt,
        } => stages::prepare_generate(
            p,
            &req.params,
            (*width, *height),
            negative_prompt.as_deref(),
            max_pixels,
        )?,
    };
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
            reference: match &i.reference {
                Some(r) => Some(ReferenceHandles {
                    latents: put(&r.latents)?,
                    ids: put(&r.ids)?,
                    inpaint: match &r.inpaint {
                        Some(ip) => Some([put(&ip.mask)?, put(&ip.image)?, put(&ip.noise)?]),
                        None => None,
                    },
                }),
                None => None,
            },
        };
        let negative = match &s1.negative {
            Some((txt, pooled)) => Some(NegativeHandles {
                txt: put(txt)?,
                pooled: put(&Tensor::new([pooled.len()], pooled.clone())
                    .map_err(|e| WireError::internal(e.to_string()))?)?,
            }),
            None => None,
        };
        let image = shm.write_bytes(&s1.prepared.image.data)?;
        written.push(image.clone());
        let mask = shm.write_bytes(&stages::mask_to_bytes(&s1.prepared.mask))?;
        written.push(mask.clone());
        let vae_trace = s1.prepared.vae_trace.as_deref().and_then(|t| {
            let h = stages::trace_to_shm(shm, t, "encoder")?;
            written.push(h.clone());
            Some(h)
        });
        let source = match &s1.source {
            Some(src) => {
                let image = shm.write_bytes(&src.image.data)?;
                written.push(image.clone());
                let mask = shm.write_bytes(&stages::mask_to_bytes(&src.mask))?;
                written.push(mask.clone());
                Some(SourceRefs {
                    image,
                    mask,
                    width: src.image.width as u32,
                    height: src.image.height as u32,
                })
            }
            None => None,
        };
        let tm = &s1.token_mask;
        Ok(PreparedRefs {
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
            vae_pass: s1.vae_pass,
            prompt_cache_hit: s1.prompt_cache_hit,
            vae_trace,
            negative,
            source,
        })
    })();
    if result.is_err() {
        shm.release(&written);
    }
    result
}
