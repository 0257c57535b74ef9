//! Which diffusers pipeline a checkpoint is for, and what each one refuses.

use denoised_runtime::{Error, Result};

/// Which diffusers pipeline a checkpoint is for, from its transformer's input
/// channels: FluxFillPipeline conditions each token on the masked image and the mask
/// (`2 * 4c + 4 f^2` inputs), FluxPipeline only on the noisy latents (`4c`). A
/// FLUX.1 Kontext checkpoint has FLUX.1-dev's channels: its directory's
/// `model_index.json` names `FluxKontextPipeline`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PipelineKind {
    /// FLUX.1 Fill: edits (image, mask, prompt) and template captures.
    Fill,
    /// FLUX.1-dev or -schnell: text-to-image generations.
    TextToImage,
    /// FLUX.1 Kontext: instruction edits (an image and a prompt) and masked edits
    /// (`FluxKontextInpaintPipeline`), of an image or of a template.
    Kontext,
}

impl PipelineKind {
    /// An edit's or a template's default guidance: FluxKontextPipeline's on a Kontext
    /// model, else FluxFillPipeline's.
    pub fn edit_guidance(self) -> f32 {
        match self {
            PipelineKind::Kontext => super::defaults::KONTEXT_GUIDANCE,
            _ => super::defaults::EDIT_GUIDANCE,
        }
    }

    /// Rows of a template's grid for an image of `tokens` tokens: a Kontext
    /// template's cache holds the reference tokens (the image itself, at its size)
    /// after the noisy ones.
    pub fn template_tokens(self, tokens: usize) -> usize {
        match self {
            PipelineKind::Kontext => 2 * tokens,
            _ => tokens,
        }
    }

    /// What a request of another kind is told.
    pub fn require(self, want: PipelineKind) -> Result<()> {
        match (self, want) {
            (a, b) if a == b => Ok(()),
            (PipelineKind::TextToImage, _) => Err(Error::Invalid(
                "the loaded model is a text-to-image model (FluxPipeline): it generates images from prompts and does not edit them; serve a FLUX.1 Fill checkpoint for masked edits, or FLUX.1 Kontext for instruction edits".into(),
            )),
            (PipelineKind::Fill, PipelineKind::Kontext) => Err(Error::Invalid(
                "the loaded model is a FLUX.1 Fill model: an edit needs a mask (the area to repaint); instruction edits without one need a FLUX.1 Kontext model".into(),
            )),
            (PipelineKind::Fill, _) => Err(Error::Invalid(
                "the loaded model is a FLUX.1 Fill model: it edits images and does not generate from a prompt alone; serve a FLUX.1-dev or -schnell checkpoint for generations".into(),
            )),
            (PipelineKind::Kontext, _) => Err(Error::Invalid(
                "the loaded model is a FLUX.1 Kontext model: it edits images by instruction (an image and a prompt) and does not generate from a prompt alone; serve a FLUX.1-dev or -schnell checkpoint for generations".into(),
            )),
        }
    }
}
