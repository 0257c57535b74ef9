//! The values a request gets for what it leaves out: the HTTP bodies' serde defaults,
//! the OpenAI routes, the internal bus and the flows all read these. The pipeline's
//! own (steps, guidance, sequence length) are `denoised_models::pipeline::defaults`,
//! which the command line reads too.

pub use denoised_models::pipeline::defaults::{
    EDIT_GUIDANCE, GENERATION_GUIDANCE, MAX_SEQUENCE_LENGTH, STEPS,
};

use crate::wire::{FinishParams, ImageFormat};
/// Pixels of the soft edge where an edit is pasted back over its source.
pub const FEATHER: u32 = 3;
/// An edit's output is pasted back over its source outside the mask.
pub const PASTE_BACK: bool = true;
/// True CFG's scale: 1 is off (FluxPipeline's `true_cfg_scale`).
pub const TRUE_CFG_SCALE: f32 = 1.0;

/// How an edit's image is finished unless the request says otherwise.
pub fn finish(format: ImageFormat, compression: Option<u8>) -> FinishParams {
    FinishParams {
        paste_back: PASTE_BACK,
        feather: FEATHER,
        format,
        compression,
    }
}
