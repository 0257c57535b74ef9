//! FluxFillPipeline: (image, mask, prompt) to an edited image, as diffusers computes
//! it, plus template capture and mask-aware edits.
//!
//! The stages are separate methods because the serving runtime runs them in different
//! processes: [`FluxFill::prepare`] (tokenize, encode text, VAE-encode the masked image,
//! draw the noise) in preprocess workers, the denoise loop ([`crate::flux::edit`]) in the
//! denoise worker, and [`FluxFill::finish`] (VAE decode, paste-back) in postprocess
//! workers. `denoised edit` runs them in one process, timing each.

use std::time::Instant;

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::fill::{
    concat_rows, masked_image, normalize_and_pack, pack_mask, unpack_and_denormalize,
};
use super::image::{from_model_space, to_model_space, ImageLimits, Mask, Rgb8};
use super::paste::paste_back;
use crate::flux::edit::DenoiseInputs;
use crate::flux::embed::image_ids;
use crate::flux::weights::SplitMix;
use crate::flux::FluxTransformer;
use crate::scheduler::{FlowMatchEuler, SchedulerConfig};
use crate::source::{ModelSource, BUILTIN_SEED};
use crate::text::{ClipTextConfig, ClipTextModel, ClipTokenizer, T5Config, T5Encoder, T5Tokenizer};
use crate::vae::{AutoencoderKL, VaeConfig};

/// Per-request options, with FluxFillPipeline's defaults.
#[derive(Clone, Debug)]
pub struct EditOptions {
    pub steps: usize,
    pub guidance: f32,
    pub seed: u64,
    /// T5 sequence length (FluxFillPipeline's `max_sequence_length`; 512 for FLUX.1).
    pub max_sequence_length: usize,
    /// Keep the original pixels outside the mask (on by default).
    pub paste_back: bool,
    /// Feather width at the seam, in pixels, inside the mask.
    pub feather: usize,
    /// Extra ring of active tokens around the mask for mask-aware edits.
    pub dilation: usize,
}

impl Default for EditOptions {
    fn default() -> Self {
        EditOptions {
            steps: 28,
            guidance: 30.0,
            seed: 0,
            max_sequence_length: 512,
            paste_back: true,
            feather: 3,
            dilation: 0,
        }
    }
}

/// Noise given from outside instead of drawn from the seed: the tensors of the
/// reference e2e case, so a run can be compared with diffusers exactly.
#[derive(Clone, Debug, Default)]
pub struct Noise {
    /// `[N, 4C]` packed initial latents.
    pub initial_latents: Option<Tensor>,
    /// `[C, h, w]` standard normal draw used to sample the masked image's posterior.
    pub posterior_eps: Option<Tensor>,
}

/// Seconds spent in each stage of one request.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Timings {
    pub tokenize_s: f64,
    pub encode_text_s: f64,
    pub vae_encode_s: f64,
    pub denoise_s: f64,
    pub vae_decode_s: f64,
    pub png_encode_s: f64,
}

/// A request after preprocessing: what the denoiser needs, and what postprocessing
/// needs to finish the image.
pub struct Prepared {
    pub inputs: DenoiseInputs,
    pub image: Rgb8,
    pub mask: Mask,
    /// Whether the prompt was cut to the encoders' maximum length.
    pub prompt_truncated: bool,
}

pub struct FluxFill<B: Backend<Tensor = Tensor>> {
    pub transformer: FluxTransformer<B>,
    pub vae: AutoencoderKL,
    pub clip_tokenizer: ClipTokenizer,
    pub clip: ClipTextModel,
    pub t5_tokenizer: T5Tokenizer,
    pub t5: T5Encoder,
    pub scheduler: SchedulerConfig,
    /// Identity of the weights, recorded in template caches.
    pub fingerprint: String,
    pub limits: ImageLimits,
}

type Parts = (
    AutoencoderKL,
    ClipTokenizer,
    ClipTextModel,
    T5Tokenizer,
    T5Encoder,
    SchedulerConfig,
);

/// Seeded VAE and text encoders with the built-in tokenizers.
fn seeded_parts(vae: VaeConfig, clip: ClipTextConfig, t5: T5Config, seed: u64) -> Result<Parts> {
    use builtin_files::*;
    Ok((
        AutoencoderKL::seeded(vae, seed ^ 1)?,
        ClipTokenizer::from_parts(CLIP_VOCAB, CLIP_MERGES, Some(CLIP_TOKENIZER_CONFIG))?,
        ClipTextModel::seeded(clip, seed ^ 2)?,
        T5Tokenizer::from_parts(T5_TOKENIZER, Some(T5_TOKENIZER_CONFIG))?,
        T5Encoder::seeded(t5, seed ^ 3)?,
        SchedulerConfig::default(),
    ))
}

/// Files of the built-in model that cannot be generated from a seed: the configs and
/// the two tokenizers of the reference fixture model (trained on a small corpus; 400 KB).
mod builtin_files {
    pub const CLIP_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/text_encoder/config.json");
    pub const T5_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/text_encoder_2/config.json");
    pub const CLIP_VOCAB: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/vocab.json");
    pub const CLIP_MERGES: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/merges.txt");
    pub const CLIP_TOKENIZER_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/tokenizer_config.json");
    pub const T5_TOKENIZER: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer_2/tokenizer.json");
    pub const T5_TOKENIZER_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer_2/tokenizer_config.json");
}

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// Loads every component of a diffusers FLUX.1 Fill directory, or builds the
    /// built-in tiny model.
    pub fn load(source: &ModelSource, backend: B) -> Result<Self> {
        if *source == ModelSource::BuiltinSmall {
            return Self::seeded_small(backend, crate::source::BUILTIN_SEED);
        }
        let transformer = source.load_transformer(backend)?;
        let fingerprint = source.fingerprint()?;
        let (vae, clip_tokenizer, clip, t5_tokenizer, t5, scheduler) = match source {
            ModelSource::Builtin => {
                use builtin_files::*;
                let parse = |what: &str, e: serde_json::Error| {
                    Error::Invalid(format!("built-in {what} config: {e}"))
                };
                let clip_cfg = serde_json::from_str(CLIP_CONFIG).map_err(|e| parse("CLIP", e))?;
                let t5_cfg = serde_json::from_str(T5_CONFIG).map_err(|e| parse("T5", e))?;
                seeded_parts(VaeConfig::tiny(), clip_cfg, t5_cfg, BUILTIN_SEED)?
            }
            ModelSource::BuiltinSmall => unreachable!("handled above"),
            ModelSource::Dir(d) => (
                AutoencoderKL::load(d.join("vae"))?,
                ClipTokenizer::from_dir(d.join("tokenizer"))?,
                ClipTextModel::load(d.join("text_encoder"))?,
                T5Tokenizer::from_dir(d.join("tokenizer_2"))?,
                T5Encoder::load(d.join("text_encoder_2"))?,
                SchedulerConfig::from_file(d.join("scheduler/scheduler_config.json"))?,
            ),
        };
        Self::assemble(
            transformer,
            vae,
            clip_tokenizer,
            clip,
            t5_tokenizer,
            t5,
            scheduler,
            fingerprint,
        )
    }

    /// A pipeline of seeded components at benchmark scale (`flux-small`): the
    /// flux-small transformer, FLUX.1's VAE, CLIP-L and a T5 of width 768 (the
    /// transformer's joint dimension), with the built-in tokenizers. For measuring
    /// stage times without real weights.
    pub fn seeded_small(backend: B, seed: u64) -> Result<Self> {
        let transformer = FluxTransformer::seeded(backend, crate::flux::FluxConfig::small(), seed)?;
        let t5 = T5Config {
            d_model: 768,
            d_kv: 64,
            d_ff: 2048,
            num_layers: 12,
            num_heads: 12,
            ..T5Config::t5_v1_1_xxl()
        };
        let (vae, ct, clip, tt, t5, sched) =
            seeded_parts(VaeConfig::flux1(), ClipTextConfig::clip_l(), t5, seed)?;
        Self::assemble(
            transformer,
            vae,
            ct,
            clip,
            tt,
            t5,
            sched,
            format!("seeded-flux-small-{seed:016x}"),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        transformer: FluxTransformer<B>,
        vae: AutoencoderKL,
        clip_tokenizer: ClipTokenizer,
        clip: ClipTextModel,
        t5_tokenizer: T5Tokenizer,
        t5: T5Encoder,
        scheduler: SchedulerConfig,
        fingerprint: String,
    ) -> Result<Self> {
        let vsf = vae.config().vae_scale_factor();
        let expected_in = 2 * 4 * vae.config().latent_channels + 4 * vsf * vsf;
        let c = &transformer.config;
        if c.in_channels != expected_in || c.out_channels() != 4 * vae.config().latent_channels {
            return Err(Error::Invalid(format!(
                "transformer has {} input / {} output channels, a Fill model with this VAE needs {expected_in} / {} (is this a FLUX.1 Fill checkpoint?)",
                c.in_channels,
                c.out_channels(),
                4 * vae.config().latent_channels
            )));
        }
        if t5.config().d_model != c.joint_attention_dim
            || clip.config().hidden_size != c.pooled_projection_dim
        {
            return Err(Error::Invalid(format!(
                "text encoders (T5 width {}, CLIP width {}) do not fit the transformer (joint {}, pooled {})",
                t5.config().d_model,
                clip.config().hidden_size,
                c.joint_attention_dim,
                c.pooled_projection_dim
            )));
        }
        let limits = ImageLimits {
            max_pixels: 2048 * 2048,
            multiple_of: 2 * vsf,
        };
        Ok(FluxFill {
            transformer,
            vae,
            clip_tokenizer,
            clip,
            t5_tokenizer,
            t5,
            scheduler,
            fingerprint,
            limits,
        })
    }

    pub fn vae_scale_factor(&self) -> usize {
        self.vae.config().vae_scale_factor()
    }

    /// Image tokens for a `width x height` image.
    pub fn tokens(&self, width: usize, height: usize) -> (usize, usize) {
        let t = 2 * self.vae_scale_factor();
        (height / t, width / t)
    }

    /// The schedule of a request: `steps` at the image's token count.
    pub fn schedule(&self, steps: usize, width: usize, height: usize) -> Result<FlowMatchEuler> {
        let (r, c) = self.tokens(width, height);
        FlowMatchEuler::new(&self.scheduler, steps, r * c)
    }

    /// Tokenizes and encodes a prompt: `(prompt_embeds [T, joint], pooled, truncated)`.
    pub fn encode_prompt(
        &self,
        prompt: &str,
        max_sequence_length: usize,
        t: &mut Timings,
    ) -> Result<(Tensor, Vec<f32>, bool)> {
        let t0 = Instant::now();
        let clip_ids = self.clip_tokenizer.encode(prompt)?;
        let t5_ids = self.t5_tokenizer.encode(prompt, max_sequence_length)?;
        t.tokenize_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let (_, pooled) = self.clip.forward(&clip_ids.ids)?;
        let embeds = self.t5.forward(&t5_ids.ids)?;
        t.encode_text_s += t1.elapsed().as_secs_f64();
        Ok((embeds, pooled, clip_ids.truncated() || t5_ids.truncated()))
    }

    /// Preprocessing: text, Fill conditioning from the VAE, and the initial noise.
    pub fn prepare(
        &self,
        image: &Rgb8,
        mask: &Mask,
        prompt: &str,
        opts: &EditOptions,
        noise: &Noise,
        t: &mut Timings,
    ) -> Result<Prepared> {
        if (mask.width, mask.height) != (image.width, image.height) {
            return Err(Error::Invalid(format!(
                "mask is {}x{} but the image is {}x{}",
                mask.width, mask.height, image.width, image.height
            )));
        }
        let (txt, pooled, prompt_truncated) =
            self.encode_prompt(prompt, opts.max_sequence_length, t)?;
        let (w, h) = (image.width, image.height);
        let vsf = self.vae_scale_factor();
        let lc = self.vae.config().latent_channels;
        let (lh, lw) = (h / vsf, w / vsf);
        let (rows, cols) = self.tokens(w, h);
        let n = rows * cols;
        let mut rng = SplitMix::new(opts.seed);

        // Masked image -> VAE posterior sample -> normalised, packed latents.
        let t0 = Instant::now();
        let planar = masked_image(&to_model_space(image), mask);
        let (mean, logvar) = self.vae.encode(&Tensor::new([1, 3, h, w], planar)?)?;
        let std = AutoencoderKL::std_from_logvar(&logvar);
        let eps = match &noise.posterior_eps {
            Some(e) if e.len() == mean.len() => e.data().to_vec(),
            Some(e) => {
                return Err(Error::Invalid(format!(
                    "posterior_eps has shape {:?}, expected {:?}",
                    e.shape(),
                    mean.shape()
                )))
            }
            None => (0..mean.len()).map(|_| rng.normal()).collect(),
        };
        let sample: Vec<f32> = mean
            .data()
            .iter()
            .zip(std.data())
            .zip(&eps)
            .map(|((m, s), e)| m + s * e)
            .collect();
        let cfg = self.vae.config();
        let mil = normalize_and_pack(&sample, lc, lh, lw, cfg.shift(), cfg.scale())?;
        let cond = concat_rows(&mil, &pack_mask(mask, vsf)?)?;
        t.vae_encode_s += t0.elapsed().as_secs_f64();

        let oc = self.transformer.config.out_channels();
        let latents = match &noise.initial_latents {
            Some(l) if l.len() == n * oc => Tensor::new([n, oc], l.data().to_vec())?,
            Some(l) => {
                return Err(Error::Invalid(format!(
                    "initial_latents has shape {:?}, expected [{n}, {oc}]",
                    l.shape()
                )))
            }
            None => Tensor::new([n, oc], (0..n * oc).map(|_| rng.normal()).collect())?,
        };
        let t_len = txt.rows();
        Ok(Prepared {
            inputs: DenoiseInputs {
                latents,
                cond,
                img_ids: Tensor::new([n, 3], image_ids(rows, cols))?,
                txt,
                txt_ids: Tensor::zeros([t_len, 3]),
                pooled,
                guidance: opts.guidance,
            },
            image: image.clone(),
            mask: mask.clone(),
            prompt_truncated,
        })
    }

    /// The raw decoder output `[3, H, W]` of packed latents.
    pub fn decode_raw(&self, latents: &Tensor, width: usize, height: usize) -> Result<Tensor> {
        self.decode_packed(latents.data(), latents.cols(), width, height)
    }

    /// [`decode_raw`](Self::decode_raw) of packed `[L, cols]` latent data.
    pub fn decode_packed(
        &self,
        latents: &[f32],
        cols: usize,
        width: usize,
        height: usize,
    ) -> Result<Tensor> {
        let vsf = self.vae_scale_factor();
        let cfg = self.vae.config();
        let z = unpack_and_denormalize(
            latents,
            cols,
            height / vsf,
            width / vsf,
            cfg.shift(),
            cfg.scale(),
        )?;
        self.vae.decode(&Tensor::new(
            [1, cfg.latent_channels, height / vsf, width / vsf],
            z,
        )?)
    }

    /// Postprocessing: VAE decode, 8-bit conversion, and paste-back.
    pub fn finish(
        &self,
        prepared: &Prepared,
        latents: &Tensor,
        opts: &EditOptions,
        t: &mut Timings,
    ) -> Result<Rgb8> {
        let (w, h) = (prepared.image.width, prepared.image.height);
        let t0 = Instant::now();
        let raw = self.decode_raw(latents, w, h)?;
        let generated = from_model_space(raw.data(), w, h);
        t.vae_decode_s += t0.elapsed().as_secs_f64();
        Ok(if opts.paste_back {
            paste_back(&prepared.image, &generated, &prepared.mask, opts.feather)
        } else {
            generated
        })
    }
}

/// Lets code that runs the transformer (the denoise loop) hold a whole pipeline.
impl<B: Backend<Tensor = Tensor>> std::borrow::Borrow<FluxTransformer<B>> for FluxFill<B> {
    fn borrow(&self) -> &FluxTransformer<B> {
        &self.transformer
    }
}
