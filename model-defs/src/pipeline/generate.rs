//! FluxPipeline: a prompt to an image, for FLUX.1-dev and FLUX.1-schnell checkpoints
//! ([`PipelineKind::TextToImage`]).
//!
//! It shares everything with the Fill pipeline but the conditioning: the same text
//! encoders, transformer, scheduler and VAE decoder, and the same serving flow. A
//! generation's [`Prepared`] carries no Fill conditioning (`cond` is `[N, 0]`), a blank
//! image and a full mask, so the denoise loop, the stores of the approximate cache and
//! [`FluxFill::finish`] (without paste-back) run on it unchanged.

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::flux_fill::{initial_latents_or, FluxFill, PipelineKind, Prepared, Timings};
use super::image::{check_size, Mask, Rgb8};
use crate::flux::edit::{DenoiseInputs, TrueCfg};
use crate::flux::embed::image_ids;
use crate::flux::weights::SplitMix;

/// Per-request options, with FluxPipeline's defaults.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub steps: usize,
    /// Embedded guidance (FLUX.1-dev); a model without a guidance embedding
    /// (FLUX.1-schnell) ignores it, as diffusers does.
    pub guidance: f32,
    pub seed: u64,
    pub max_sequence_length: usize,
    pub width: usize,
    pub height: usize,
}

impl GenerateOptions {
    /// FluxPipeline's defaults for `p`: 28 steps, guidance 3.5, a T5 sequence of 512,
    /// and its default side, `128 * vae_scale_factor` (1024 for FLUX.1).
    pub fn defaults_for<B: Backend<Tensor = Tensor>>(p: &FluxFill<B>) -> Self {
        let side = p.default_side();
        GenerateOptions {
            steps: 28,
            guidance: 3.5,
            seed: 0,
            max_sequence_length: 512,
            width: side,
            height: side,
        }
    }
}

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// FluxPipeline's default image side: `default_sample_size` (128) latent pixels.
    pub fn default_side(&self) -> usize {
        128 * self.vae_scale_factor()
    }

    /// True CFG's negative branch (FluxPipeline's `negative_prompt`), or `None` when
    /// diffusers would not run it: it needs `true_cfg_scale > 1` and a negative prompt.
    pub fn prepare_true_cfg(
        &self,
        negative_prompt: Option<&str>,
        true_cfg_scale: f32,
        max_sequence_length: usize,
        t: &mut Timings,
    ) -> Result<Option<TrueCfg>> {
        let Some(neg) = negative_prompt.filter(|_| true_cfg_scale > 1.0) else {
            return Ok(None);
        };
        if !true_cfg_scale.is_finite() {
            return Err(Error::Invalid(
                "true_cfg_scale must be a finite number".into(),
            ));
        }
        // Any pipeline: a Fill model's edits take true CFG too (the negative branch of
        // a template edit reads the same template).
        let (txt, pooled, _) = self.encode_prompt(neg, max_sequence_length, t)?;
        let n = txt.rows();
        Ok(Some(TrueCfg {
            txt,
            txt_ids: Tensor::zeros([n, 3]),
            pooled,
            scale: true_cfg_scale,
        }))
    }

    /// Preprocessing of a generation: the prompt's embeddings and the initial noise
    /// (`initial_latents`, packed `[N, 4c]`, when given: diffusers' `latents`, to
    /// reproduce its run; else drawn from the seed).
    pub fn prepare_generate(
        &self,
        prompt: &str,
        opts: &GenerateOptions,
        initial_latents: Option<&Tensor>,
        t: &mut Timings,
    ) -> Result<Prepared> {
        self.kind.require(PipelineKind::TextToImage)?;
        self.prepare_from_noise(prompt, opts, initial_latents, t)
    }

    /// What a generation and a Kontext edit prepare alike: the prompt's embeddings and
    /// the initial noise over the `opts.width x opts.height` grid, conditioned on
    /// nothing else (a Kontext edit adds its reference), and a blank image under a full
    /// mask.
    pub(super) fn prepare_from_noise(
        &self,
        prompt: &str,
        opts: &GenerateOptions,
        initial_latents: Option<&Tensor>,
        t: &mut Timings,
    ) -> Result<Prepared> {
        let (w, h) = (opts.width, opts.height);
        check_size("size", w, h, &self.limits)?;
        let (txt, pooled, prompt_truncated) =
            self.encode_prompt(prompt, opts.max_sequence_length, t)?;
        let (rows, cols) = self.tokens(w, h);
        let n = rows * cols;
        let oc = self.config.out_channels();
        let mut rng = SplitMix::new(opts.seed);
        let latents = initial_latents_or(initial_latents, [n, oc], &mut rng)?;
        let t_len = txt.rows();
        Ok(Prepared {
            inputs: DenoiseInputs {
                latents,
                // FluxPipeline conditions on nothing but the text (Kontext adds its
                // reference tokens).
                cond: Tensor::new([n, 0], Vec::new())?,
                img_ids: Tensor::new([n, 3], image_ids(rows, cols))?,
                txt,
                txt_ids: Tensor::zeros([t_len, 3]),
                pooled,
                guidance: opts.guidance,
                reference: None,
            },
            // The whole image is generated: finishing without paste-back decodes it
            // all, whatever these hold.
            image: Rgb8 {
                width: w,
                height: h,
                data: vec![0; w * h * 3],
            },
            mask: Mask {
                width: w,
                height: h,
                data: vec![true; w * h],
            },
            prompt_truncated,
            vae_trace: None,
        })
    }
}
