//! Control images for ControlNets: FluxControlNetPipeline's `prepare_image` then
//! `vae.encode(image).latent_dist.sample(generator)`, shifted, scaled and packed into
//! the `[N, 4c]` rows a ControlNet reads beside the latents.
//!
//! A text-to-image pipeline loads no VAE encoder for itself; whoever runs ControlNets
//! (the CLI, the ControlNet service's processes) loads one with [`ControlEncoder::load`].

use denoised_runtime::{Error, Result, Tensor};

use super::fill::{normalize_and_pack, posterior_sample};
use super::flux_fill::load_vae;
use super::image::{to_model_space, Rgb8};
use crate::flux::weights::SplitMix;
use crate::source::ModelSource;
use crate::vae::model::AutoencoderKL;
use crate::vae::VaeHalves;

/// The generator of a request's control-image posterior draws, from its seed (the
/// CLI's and the ControlNet service's alike): apart from the initial noise's, which
/// `SplitMix::new(seed)` draws.
pub fn control_rng(seed: u64) -> SplitMix {
    SplitMix::new(seed ^ 0xc0_4e_7a_01_c0_4e_7a_01)
}

/// The model's VAE encoder, for control images.
pub struct ControlEncoder {
    vae: AutoencoderKL,
}

impl ControlEncoder {
    /// The VAE encoder of `source` (a diffusers directory's `vae/`, or a built-in's
    /// seeded VAE, as its pipeline builds it).
    pub fn load(source: &ModelSource) -> Result<Self> {
        Ok(ControlEncoder {
            vae: load_vae(source, VaeHalves::ENCODER)?,
        })
    }

    /// `image`'s packed control latents, `[N, 4c]`. The posterior sample takes its
    /// N(0, 1) draws from `eps` when given (to reproduce a diffusers run), else from
    /// `rng`. The image must have the generated image's size (diffusers resizes it;
    /// a server asks for the right size instead of guessing a resampling filter).
    pub fn encode(&self, image: &Rgb8, eps: Option<&Tensor>, rng: &mut SplitMix) -> Result<Tensor> {
        let cfg = self.vae.config();
        let vsf = cfg.vae_scale_factor();
        let (w, h) = (image.width, image.height);
        if w % (2 * vsf) != 0 || h % (2 * vsf) != 0 {
            return Err(Error::Invalid(format!(
                "a control image of {w}x{h}: its sides must be multiples of {}",
                2 * vsf
            )));
        }
        let x = Tensor::new([1, 3, h, w], to_model_space(image))?;
        let (mean, logvar) = self.vae.encode(&x)?;
        let sample = posterior_sample(&mean, &logvar, eps, rng, "control posterior draws")?;
        let (lc, lh, lw) = (cfg.latent_channels, h / vsf, w / vsf);
        normalize_and_pack(&sample, lc, lh, lw, cfg.shift(), cfg.scale())
    }
}
