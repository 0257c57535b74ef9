//! FluxFillPipeline: (image, mask, prompt) to an edited image, as diffusers computes
//! it, plus template capture and mask-aware edits.
//!
//! The stages are separate methods because the serving runtime runs them in different
//! processes: [`FluxFill::prepare`] (tokenize, encode text, VAE-encode the masked image,
//! draw the noise) in preprocess workers, the denoise loop ([`crate::flux::edit`]) in the
//! denoise worker, and [`FluxFill::finish`] (VAE decode, paste-back) in postprocess
//! workers. `denoised edit` runs them in one process, timing each.

use std::sync::Arc;
use std::time::Instant;

use denoised_runtime::{Backend, Error, HostSlice, Result, Tensor};

use super::fill::{
    concat_rows, masked_image, normalize_and_pack, pack_mask, posterior_sample,
    unpack_and_denormalize,
};
use super::image::{from_model_space, to_model_space, ImageLimits, Mask, Rgb8};
use super::paste::paste_back;
use super::prompts::{PromptCache, PromptEmbedding};
use super::sparse_vae::{token_latent_pixels, SparseVae, VaePass};
use crate::flux::edit::DenoiseInputs;
use crate::flux::embed::image_ids;
use crate::flux::weights::SplitMix;
use crate::flux::{FluxConfig, FluxTransformer};
use crate::mask::TokenMask;
use crate::scheduler::{FlowMatchEuler, SchedulerConfig};
use crate::source::{ModelSource, BUILTIN_SEED};
use crate::text::device::PromptEncoder;
use crate::text::{ClipTextConfig, ClipTextModel, ClipTokenizer, T5Config, T5Encoder, T5Tokenizer};
use crate::vae::sparse::{Half, SparsePlan, VaeTrace};
use crate::vae::{AutoencoderKL, DenseCoder, VaeConfig, VaeHalves};

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
    /// A mask-aware edit of a template (whose image is the edit's image): the VAE may
    /// run sparse against the template's traces (see [`super::sparse_vae`]).
    pub template_edit: bool,
    /// A template edit's template's stored VAE traces, when it has them in memory.
    pub vae_traces: Option<HostSlice>,
    /// A template capture: record the encoder's trace ([`Prepared::vae_trace`]).
    pub record_vae_trace: bool,
    /// A masked Kontext edit: how much of the schedule runs (diffusers' `strength`;
    /// 1 starts from noise).
    pub strength: f32,
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
            template_edit: false,
            vae_traces: None,
            record_vae_trace: false,
            strength: 1.0,
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

/// A request's initial packed latents `[n, c]`: `given` (diffusers' `latents`, to
/// reproduce its run) when it has that many values, else drawn from `rng`.
pub(crate) fn initial_latents_or(
    given: Option<&Tensor>,
    [n, c]: [usize; 2],
    rng: &mut SplitMix,
) -> Result<Tensor> {
    match given {
        Some(l) if l.len() == n * c => Tensor::new([n, c], l.data().to_vec()),
        Some(l) => Err(Error::Invalid(format!(
            "initial_latents has shape {:?}, expected [{n}, {c}]",
            l.shape()
        ))),
        None => Tensor::new([n, c], (0..n * c).map(|_| rng.normal()).collect()),
    }
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
    /// Whether the prompt's embeddings came from the prompt cache (the text encoders
    /// did not run).
    pub prompt_cache_hit: bool,
    /// Which VAE passes ran: dense, or sparse against a template's trace.
    pub vae_encode_pass: VaePass,
    pub vae_decode_pass: VaePass,
}

/// A request after preprocessing: what the denoiser needs, and what postprocessing
/// needs to finish the image.
pub struct Prepared {
    pub inputs: DenoiseInputs,
    pub image: Rgb8,
    pub mask: Mask,
    /// Whether the prompt was cut to the encoders' maximum length.
    pub prompt_truncated: bool,
    /// A capture's encoder trace, as stored (`EditOptions::record_vae_trace`).
    pub vae_trace: Option<Vec<u8>>,
}

/// The text side of the pipeline: both tokenizers and both encoders.
pub struct TextEncoders {
    pub clip_tokenizer: ClipTokenizer,
    /// Shared with a device copy's model ([`FluxFill::place_text`] keeps the
    /// embeddings on the host).
    pub clip: Arc<ClipTextModel>,
    pub t5_tokenizer: T5Tokenizer,
    pub t5: Arc<T5Encoder>,
}

/// Which components a process loads. Each serving role loads only what it computes
/// with (docs/design.md, "Devices and roles"): a FLUX.1 Fill checkpoint is about 33 GB in
/// bf16, and three processes each holding all of it in f32 would need 200 GB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    /// Tokenizers, CLIP and T5.
    pub text: bool,
    pub vae: VaeHalves,
    pub transformer: bool,
}

impl Parts {
    /// Everything: `denoised edit`, template capture, the benchmarks.
    pub const ALL: Parts = Parts {
        text: true,
        vae: VaeHalves::BOTH,
        transformer: true,
    };
    /// Preprocess: tokenizers, text encoders, the VAE encoder.
    pub const PREPROCESS: Parts = Parts {
        text: true,
        vae: VaeHalves::ENCODER,
        transformer: false,
    };
    /// Denoise: the transformer.
    pub const DENOISE: Parts = Parts {
        text: false,
        vae: VaeHalves::NONE,
        transformer: true,
    };
    /// Postprocess: the VAE decoder.
    pub const POSTPROCESS: Parts = Parts {
        text: false,
        vae: VaeHalves::DECODER,
        transformer: false,
    };

    /// What either of two roles uses (the in-process baseline runs several).
    pub fn union(self, o: Parts) -> Parts {
        Parts {
            text: self.text || o.text,
            vae: VaeHalves {
                encoder: self.vae.encoder || o.vae.encoder,
                decoder: self.vae.decoder || o.vae.decoder,
            },
            transformer: self.transformer || o.transformer,
        }
    }

    /// The same parts without the transformer (a process whose transformer lives on
    /// another backend, e.g. a GPU denoise worker's CPU stages).
    pub fn without_transformer(self) -> Parts {
        Parts {
            transformer: false,
            ..self
        }
    }
}

/// A loaded component and the bytes of its weights, as `/readyz` reports them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Component {
    pub name: String,
    pub weight_bytes: u64,
    /// The bytes by the form they are held in (`f32`, `bf16`, `fp8`, `Q4_K`, ...).
    /// Always serialised: components cross the cluster in postcard, which is not
    /// self-describing (a skipped field would shift every field after it).
    pub forms: std::collections::BTreeMap<String, u64>,
}

impl Component {
    /// A component whose weights are held in `forms` (bytes by form).
    pub fn with_forms(name: &str, forms: std::collections::BTreeMap<String, u64>) -> Self {
        Component {
            name: name.into(),
            weight_bytes: forms.values().sum(),
            forms,
        }
    }
}

pub use super::kind::PipelineKind;

pub struct FluxFill<B: Backend<Tensor = Tensor>> {
    /// Fill or text-to-image (one type serves both: they share every component and
    /// every stage but the conditioning).
    pub kind: PipelineKind,
    /// The transformer's config: always loaded (a small JSON), because layouts,
    /// schedules and the checks of the other components need it.
    pub config: FluxConfig,
    transformer: Option<Arc<FluxTransformer<B>>>,
    /// The VAE's config and the halves this process loaded.
    pub vae: AutoencoderKL,
    /// The same halves on a device, when the process has one ([`Self::place_vae`]):
    /// every dense encode and decode runs there.
    vae_device: Option<Arc<dyn DenseCoder>>,
    /// Both text encoders on a device, when the process has one ([`Self::place_text`]).
    text_device: Option<Arc<dyn PromptEncoder>>,
    text: Option<TextEncoders>,
    pub scheduler: SchedulerConfig,
    /// Identity of the weights, recorded in template caches.
    pub fingerprint: String,
    pub limits: ImageLimits,
    /// Sparse VAE passes of template edits, and their traces.
    pub sparse_vae: SparseVae,
    /// Text-encoder outputs of recent prompts.
    pub prompts: PromptCache,
}

pub use super::components::{load_vae, scheduler_config, vae_config};
use super::components::{seeded_text, small_t5, text_configs};

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// Loads every component of a diffusers FLUX.1 Fill directory, or builds the
    /// built-in tiny model.
    pub fn load(source: &ModelSource, backend: B) -> Result<Self> {
        Self::load_parts(source, backend, Parts::ALL)
    }

    /// Loads only `parts` (the transformer, when asked for, on `backend`). Weight files
    /// of the other components are never opened.
    pub fn load_parts(source: &ModelSource, backend: B, parts: Parts) -> Result<Self> {
        let seed = BUILTIN_SEED;
        let config = source.transformer_config()?;
        let kontext = source.is_kontext()?;
        // A text-to-image pipeline encodes no image: its preprocessing is text and noise.
        let parts = match config.in_channels == config.out_channels() && !kontext {
            true => Parts {
                vae: VaeHalves {
                    encoder: false,
                    ..parts.vae
                },
                ..parts
            },
            false => parts,
        };
        let transformer = if parts.transformer {
            Some(Arc::new(source.load_transformer(backend)?))
        } else {
            None
        };
        let fingerprint = source.fingerprint()?;
        let (vae, text, scheduler) = match source {
            ModelSource::Dir(d) => {
                let text = if parts.text {
                    let t5 = match &d.files.text_encoder_2 {
                        Some(f) => T5Encoder::load_file(
                            f,
                            T5Config::from_file(d.root.join("text_encoder_2/config.json"))?,
                        )?,
                        None => T5Encoder::load(d.root.join("text_encoder_2"))?,
                    };
                    Some(TextEncoders {
                        clip_tokenizer: ClipTokenizer::from_dir(d.root.join("tokenizer"))?,
                        clip: Arc::new(ClipTextModel::load(d.root.join("text_encoder"))?),
                        t5_tokenizer: T5Tokenizer::from_dir(d.root.join("tokenizer_2"))?,
                        t5: Arc::new(t5),
                    })
                } else {
                    None
                };
                (
                    load_vae(source, parts.vae)?,
                    text,
                    scheduler_config(source)?,
                )
            }
            builtin => {
                let text = if parts.text {
                    let (clip, t5) = text_configs(builtin)?;
                    Some(seeded_text(clip, t5, seed)?)
                } else {
                    None
                };
                (
                    load_vae(builtin, parts.vae)?,
                    text,
                    SchedulerConfig::default(),
                )
            }
        };
        let mut p = Self::assemble(config, transformer, vae, text, scheduler, fingerprint)?;
        if kontext {
            if p.kind != PipelineKind::TextToImage {
                return Err(Error::Invalid(format!(
                    "model_index.json names a Kontext pipeline, but its transformer has {} input channels, not FLUX.1-dev's {}",
                    p.config.in_channels,
                    p.config.out_channels()
                )));
            }
            p.kind = PipelineKind::Kontext;
        }
        Ok(p)
    }
    /// A pipeline of seeded components at benchmark scale (`flux-small`): the
    /// flux-small transformer, FLUX.1's VAE, CLIP-L and a T5 of width 768 (the
    /// transformer's joint dimension), with the built-in tokenizers. For measuring
    /// stage times without real weights.
    pub fn seeded_small(backend: B, seed: u64) -> Result<Self> {
        Self::seeded_small_as(backend, FluxConfig::small(), seed, "")
    }

    /// [`seeded_small`](Self::seeded_small) with the transformer's `config`; `tag`
    /// marks the fingerprint.
    pub(crate) fn seeded_small_as(
        backend: B,
        config: FluxConfig,
        seed: u64,
        tag: &str,
    ) -> Result<Self> {
        let transformer = FluxTransformer::seeded(backend, config.clone(), seed)?;
        let vae = AutoencoderKL::seeded(VaeConfig::flux1(), seed ^ 1)?;
        let text = seeded_text(ClipTextConfig::clip_l(), small_t5(), seed)?;
        Self::assemble(
            config,
            Some(Arc::new(transformer)),
            vae,
            Some(text),
            SchedulerConfig::default(),
            format!("seeded-flux-small{tag}-{seed:016x}"),
        )
    }

    fn assemble(
        config: FluxConfig,
        transformer: Option<Arc<FluxTransformer<B>>>,
        vae: AutoencoderKL,
        text: Option<TextEncoders>,
        scheduler: SchedulerConfig,
        fingerprint: String,
    ) -> Result<Self> {
        let vsf = vae.config().vae_scale_factor();
        let packed = 4 * vae.config().latent_channels;
        let fill_in = 2 * packed + 4 * vsf * vsf;
        let c = &config;
        let kind = match (c.in_channels, c.out_channels()) {
            (i, o) if i == fill_in && o == packed => PipelineKind::Fill,
            (i, o) if i == packed && o == packed => PipelineKind::TextToImage,
            (i, o) => {
                return Err(Error::Invalid(format!(
                    "transformer has {i} input / {o} output channels; with this VAE a FLUX.1 Fill model needs {fill_in} / {packed} and a text-to-image model (FLUX.1-dev or -schnell) {packed} / {packed}"
                )))
            }
        };
        if let Some(t) = &text {
            if t.t5.config().d_model != c.joint_attention_dim
                || t.clip.config().hidden_size != c.pooled_projection_dim
            {
                return Err(Error::Invalid(format!(
                    "text encoders (T5 width {}, CLIP width {}) do not fit the transformer (joint {}, pooled {})",
                    t.t5.config().d_model,
                    t.clip.config().hidden_size,
                    c.joint_attention_dim,
                    c.pooled_projection_dim
                )));
            }
        }
        let limits = ImageLimits {
            max_pixels: 2048 * 2048,
            multiple_of: 2 * vsf,
        };
        Ok(FluxFill {
            kind,
            config,
            transformer,
            vae,
            vae_device: None,
            text_device: None,
            text,
            scheduler,
            fingerprint,
            limits,
            sparse_vae: SparseVae::default(),
            prompts: PromptCache::default(),
        })
    }

    /// Runs every VAE pass on `device` from now on (a pre- or postprocess worker on a
    /// GPU): the dense ones, the sparse ones of template edits (against the template's
    /// trace, resident on the device) and the captures' recording ones. The CPU model
    /// stays for the plans of the sparse passes (shapes and regions) and the K and V of
    /// a recorded trace's attention.
    pub fn place_vae(&mut self, device: Arc<dyn DenseCoder>) {
        self.vae_device = Some(device);
    }

    /// Runs both text encoders on `device` from now on (a preprocess worker on a GPU).
    pub fn place_text(&mut self, device: Arc<dyn PromptEncoder>) {
        self.text_device = Some(device);
        // The device copies keep the embeddings they look up; the host layers go (T5-XXL's
        // are 19 GB in f32), so this process holds no second copy of the encoders.
        if let Some(t) = &mut self.text {
            t.clip = Arc::new(t.clip.embeddings_only());
            t.t5 = Arc::new(t.t5.embeddings_only());
        }
    }

    /// Whether template edits may run the VAE sparse: `[pipeline] sparse_vae = "auto"`.
    pub fn sparse_vae_on(&self) -> bool {
        self.sparse_vae.setting == crate::pipeline::sparse_vae::SparseVaeSetting::Auto
    }

    /// Where the dense VAE passes run: the device's name, or `cpu`.
    pub fn vae_device(&self) -> String {
        self.vae_device
            .as_ref()
            .map_or_else(|| "cpu".into(), |d| d.device())
    }

    /// The dense encode, on the device when there is one.
    pub(crate) fn vae_encode(&self, image: &Tensor) -> Result<(Tensor, Tensor)> {
        match &self.vae_device {
            Some(d) => d.encode(image),
            None => self.vae.encode(image),
        }
    }

    /// The dense decode, on the device when there is one.
    pub(crate) fn vae_decode(&self, z: &Tensor) -> Result<Tensor> {
        match &self.vae_device {
            Some(d) => d.decode(z),
            None => self.vae.decode(z),
        }
    }

    /// A template edit's sparse VAE pass, on the device when there is one (the
    /// template's trace resident there under `key`).
    pub(crate) fn vae_sparse(
        &self,
        plan: &SparsePlan,
        input: &Tensor,
        trace: &VaeTrace,
        key: (u64, Half),
    ) -> Result<Tensor> {
        match &self.vae_device {
            Some(d) => d.run_sparse(plan, input, trace, key),
            None => self.vae.run_sparse(plan, input, trace),
        }
    }

    /// The dense pass of `half`, recording a template's trace, on the device when
    /// there is one.
    pub(crate) fn vae_trace(&self, half: Half, input: &Tensor) -> Result<VaeTrace> {
        match (&self.vae_device, half) {
            (Some(d), _) => d.trace(&self.vae, half, input),
            (None, Half::Encoder) => self.vae.trace_encode(input),
            (None, Half::Decoder) => self.vae.trace_decode(input),
        }
    }

    /// The transformer, or an error naming the role split when this process did not
    /// load it.
    pub fn transformer(&self) -> Result<&FluxTransformer<B>> {
        self.transformer
            .as_deref()
            .ok_or_else(|| not_loaded("transformer"))
    }

    /// The transformer, to adjust it before it is shared (tests set reference
    /// constants); `None` once shared or when not loaded.
    pub fn transformer_mut(&mut self) -> Option<&mut FluxTransformer<B>> {
        self.transformer.as_mut().and_then(Arc::get_mut)
    }

    /// The transformer, shared (the denoise loop holds it next to the pipeline).
    pub fn shared_transformer(&self) -> Result<Arc<FluxTransformer<B>>> {
        self.transformer
            .clone()
            .ok_or_else(|| not_loaded("transformer"))
    }

    /// The tokenizers and text encoders, when loaded.
    pub fn text(&self) -> Result<&TextEncoders> {
        self.text
            .as_ref()
            .ok_or_else(|| not_loaded("text encoders"))
    }

    /// The components this process holds, with their weight bytes (f32 on the host;
    /// a transformer on another backend is reported by its owner).
    pub fn components(&self) -> Vec<Component> {
        let mut v = Vec::new();
        let mut add = |name: &str, weight_bytes: u64| {
            v.push(Component {
                name: name.into(),
                weight_bytes,
                forms: match weight_bytes {
                    0 => Default::default(),
                    b => [("f32".to_string(), b)].into(),
                },
            })
        };
        if let Some(t) = &self.text {
            add("tokenizers", 0);
            add("clip", t.clip.weight_bytes());
            add("t5", t.t5.weight_bytes());
        }
        let w = self.vae.weights();
        if w.encoder.is_some() {
            add("vae_encoder", w.encoder_bytes);
        }
        if w.decoder.is_some() {
            add("vae_decoder", w.decoder_bytes);
        }
        if let Some(t) = &self.transformer {
            add("transformer", 4 * t.params());
        }
        v
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
        let text = self.text()?;
        if let Some(e) = self
            .prompts
            .get(&self.fingerprint, prompt, max_sequence_length)
        {
            t.prompt_cache_hit = true;
            return Ok((e.embeds.clone(), e.pooled.clone(), e.truncated));
        }
        let t0 = Instant::now();
        let clip_ids = text.clip_tokenizer.encode(prompt)?;
        let t5_ids = text.t5_tokenizer.encode(prompt, max_sequence_length)?;
        t.tokenize_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let (pooled, embeds) = match &self.text_device {
            Some(d) => (d.clip(&clip_ids.ids)?.1, d.t5(&t5_ids.ids)?),
            None => (
                text.clip.forward(&clip_ids.ids)?.1,
                text.t5.forward(&t5_ids.ids)?,
            ),
        };
        t.encode_text_s += t1.elapsed().as_secs_f64();
        let truncated = clip_ids.truncated() || t5_ids.truncated();
        let e = PromptEmbedding {
            embeds: embeds.clone(),
            pooled: pooled.clone(),
            truncated,
        };
        self.prompts
            .insert(&self.fingerprint, prompt, max_sequence_length, e);
        Ok((embeds, pooled, truncated))
    }

    /// Preprocessing: text, Fill conditioning from the VAE, and the initial noise. On
    /// a Kontext model, an instruction edit of `image` at its size (its reference
    /// image): of the whole image when `mask` is full, else a masked one
    /// (`FluxKontextInpaintPipeline`, strength 1).
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
        if self.kind == PipelineKind::Kontext {
            // A template's capture (an empty mask: every noisy token held to the
            // image's) and its edits prepare as any masked edit does; their VAE runs
            // dense (no sparse traces: the reference is the whole image).
            if !mask.data.iter().all(|&m| m) {
                let opts = EditOptions {
                    strength: 1.0,
                    ..opts.clone()
                };
                let images = super::kontext::InpaintImages {
                    image,
                    mask,
                    reference: None,
                };
                let (p, _) = self.prepare_kontext_inpaint(images, prompt, &opts, noise, t)?;
                return Ok(p);
            }
            let size = (image.width, image.height);
            let p = self.prepare_kontext(image, size, prompt, opts, noise, t)?;
            return Ok(Prepared {
                image: image.clone(),
                mask: mask.clone(),
                ..p
            });
        }
        self.kind.require(PipelineKind::Fill)?;
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
        let full = to_model_space(image);
        let masked = Tensor::new([1, 3, h, w], masked_image(&full, mask))?;
        let mut vae_trace = None;
        let (mean, logvar) = if opts.template_edit {
            let keep = active_latent_pixels(mask, vsf, opts.dilation)?;
            let full = Tensor::new([1, 3, h, w], full)?;
            let stored = opts.vae_traces.as_ref();
            let (dist, pass) = self.encode_edit(&masked, &full, &keep, stored)?;
            t.vae_encode_pass = pass;
            dist
        } else if opts.record_vae_trace && self.sparse_vae_can_pay(Half::Encoder, w, h)? {
            // The same ops as `encode`, bit for bit, keeping every value.
            let trace = self.vae_trace(Half::Encoder, &masked)?;
            vae_trace = Some(trace.to_record(Half::Encoder));
            self.vae.latent_dist(&trace.output().to_tensor())?
        } else {
            self.vae_encode(&masked)?
        };
        let sample = posterior_sample(
            &mean,
            &logvar,
            noise.posterior_eps.as_ref(),
            &mut rng,
            "posterior_eps",
        )?;
        let cfg = self.vae.config();
        let mil = normalize_and_pack(&sample, lc, lh, lw, cfg.shift(), cfg.scale())?;
        let cond = concat_rows(&mil, &pack_mask(mask, vsf)?)?;
        t.vae_encode_s += t0.elapsed().as_secs_f64();

        let oc = self.config.out_channels();
        let latents = initial_latents_or(noise.initial_latents.as_ref(), [n, oc], &mut rng)?;
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
                reference: None,
            },
            image: image.clone(),
            mask: mask.clone(),
            prompt_truncated,
            vae_trace,
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
        self.vae_decode(&Tensor::new(
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
        self.finish_edit(prepared, latents, None, opts, t)
    }

    /// [`finish`](Self::finish) of a template edit, whose template's final packed
    /// latent is `template`: the decoder may run sparse (with paste-back on, since it
    /// keeps only the masked pixels).
    pub fn finish_edit(
        &self,
        prepared: &Prepared,
        latents: &Tensor,
        template: Option<&Tensor>,
        opts: &EditOptions,
        t: &mut Timings,
    ) -> Result<Rgb8> {
        let (w, h) = (prepared.image.width, prepared.image.height);
        let t0 = Instant::now();
        let (raw, pass) = self.decode_edit(
            latents.data(),
            template.map(|t| t.data()),
            latents.cols(),
            &prepared.mask,
            opts.paste_back,
            opts.vae_traces.as_ref(),
        )?;
        t.vae_decode_pass = pass;
        let generated = from_model_space(raw.data(), w, h);
        t.vae_decode_s += t0.elapsed().as_secs_f64();
        Ok(if opts.paste_back {
            paste_back(&prepared.image, &generated, &prepared.mask, opts.feather)
        } else {
            generated
        })
    }
}

/// The latent pixels (`[h/f * w/f]`) of the tokens a mask makes active (each token is
/// 2x2 latent pixels).
fn active_latent_pixels(mask: &Mask, vsf: usize, dilation: usize) -> Result<Vec<bool>> {
    let (h, w) = (mask.height, mask.width);
    let tm = TokenMask::from_pixels(&mask.data, h, w, 2 * vsf, dilation)?;
    let active = tm.active().iter().map(|&t| t as usize);
    Ok(token_latent_pixels(active, tm.rows, tm.cols))
}

fn not_loaded(what: &str) -> Error {
    Error::Invalid(format!(
        "the {what} is not loaded in this process (each worker loads only its role's components)"
    ))
}
