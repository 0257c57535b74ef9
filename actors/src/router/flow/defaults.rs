//! The values a request gets for what it leaves out, in one place: the HTTP bodies'
//! serde defaults, the OpenAI routes, the internal bus and the flows all read these.

use crate::wire::{FinishParams, ImageFormat};

/// Denoising steps (FluxFillPipeline's and FluxPipeline's `num_inference_steps`).
pub const STEPS: u32 = 28;
/// An edit's or a template's guidance scale (FluxFillPipeline's `guidance_scale`;
/// distilled guidance).
pub const EDIT_GUIDANCE: f32 = 30.0;
/// A generation's guidance scale (FluxPipeline's `guidance_scale`).
pub const GENERATION_GUIDANCE: f32 = 3.5;
/// T5's sequence length (`max_sequence_length`), also the most it can be.
pub const MAX_SEQUENCE_LENGTH: u32 = 512;
/// Pixels of the soft edge where an edit is pasted back over its source.
pub const FEATHER: u32 = 3;
/// An edit's output is pasted back over its source outside the mask.
pub const PASTE_BACK: bool = true;
/// True CFG's scale: 1 is off (FluxPipeline's `true_cfg_scale`).
pub const TRUE_CFG_SCALE: f32 = 1.0;

/// How an edit's image is finished unless the request says otherwise.
pub fn finish(format: ImageFormat) -> FinishParams {
    FinishParams {
        paste_back: PASTE_BACK,
        feather: FEATHER,
        format,
    }
}
