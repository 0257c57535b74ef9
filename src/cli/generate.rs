//! `denoised generate`: FluxPipeline text-to-image (FLUX.1-dev, FLUX.1-schnell) from the
//! command line, in one process, with the daemon's stages and denoise loop.

use std::path::PathBuf;

use denoised_models::flux::edit::{Mode, TrueCfg};
use denoised_models::pipeline::defaults;
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::ModelSource;
use denoised_runtime::CpuBackend;

use super::adapters::LoraArgs;
use super::controlnet::ControlNetArgs;
use super::edit::{denoise, load_pipeline, read_noise, report, write_png};
use super::preview::PreviewFile;
use super::{CliResult, ModelDeviceArgs};

/// True classifier-free guidance (FluxPipeline's `negative_prompt` and
/// `true_cfg_scale`), for `generate` and `edit`.
#[derive(clap::Args, Debug)]
pub struct TrueCfgArgs {
    /// True classifier-free guidance's negative prompt (with --true-cfg-scale above 1;
    /// each step then runs the transformer on both prompts, as diffusers does).
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// True CFG's scale: the step follows `neg + scale * (pos - neg)`. 1 (the default)
    /// turns it off.
    #[arg(long, default_value_t = 1.0)]
    pub true_cfg_scale: f32,
}

impl TrueCfgArgs {
    /// The negative branch's embeddings, when true CFG runs.
    pub fn prepare(
        &self,
        p: &FluxFill<CpuBackend>,
        max_sequence_length: usize,
        t: &mut Timings,
    ) -> CliResult<Option<TrueCfg>> {
        Ok(p.prepare_true_cfg(
            self.negative_prompt.as_deref(),
            self.true_cfg_scale,
            max_sequence_length,
            t,
        )?)
    }
}

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Model: a diffusers FLUX.1-dev or -schnell directory (FluxPipeline), or
    /// `builtin:t2i` / `builtin:flux-small-t2i` (seeded, no files).
    #[arg(long, env = "DENOISED_MODEL", default_value = "builtin:t2i")]
    pub model: ModelSource,
    #[command(flatten)]
    pub components: super::ComponentArgs,
    /// The prompt. Longer prompts are truncated to the encoders' maximum length, as
    /// diffusers does (with a warning).
    #[arg(long)]
    pub prompt: String,
    /// Denoising steps (FLUX.1-schnell is distilled for 4).
    #[arg(long, default_value_t = defaults::STEPS as usize)]
    pub steps: usize,
    /// Embedded guidance scale (FLUX.1-dev; schnell has no guidance embedding and
    /// ignores it).
    #[arg(long, default_value_t = defaults::GENERATION_GUIDANCE)]
    pub guidance: f32,
    /// Seed of the initial noise.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Image height in pixels [default: 128 x the VAE's scale factor, as diffusers:
    /// 1024 for FLUX.1].
    #[arg(long)]
    pub height: Option<usize>,
    /// Image width in pixels [default: as the height's].
    #[arg(long)]
    pub width: Option<usize>,
    /// T5 sequence length.
    #[arg(long, default_value_t = defaults::MAX_SEQUENCE_LENGTH as usize)]
    pub max_sequence_length: usize,
    #[command(flatten)]
    pub true_cfg: TrueCfgArgs,
    /// Safetensors with `initial_latents` (packed noise, `[1, N, 64]` as diffusers'
    /// `latents`), to reproduce a diffusers run exactly.
    #[arg(long)]
    pub noise: Option<PathBuf>,
    /// Largest accepted image, in pixels (width x height).
    #[arg(long, env = "DENOISED_MAX_PIXELS", default_value_t = 2048 * 2048)]
    pub max_pixels: usize,
    /// Print per-stage timings as one JSON line on stdout.
    #[arg(long)]
    pub timings: bool,
    /// Write a preview of the image as it denoises to this file (.png or .jpg),
    /// replaced after every step.
    #[arg(long, value_name = "FILE")]
    pub preview: Option<PathBuf>,
    #[command(flatten)]
    pub device: ModelDeviceArgs,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub controlnet: ControlNetArgs,
    /// Output PNG.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: GenerateArgs) -> CliResult {
    let (p, mut placed) = load_pipeline(&a.model, &a.device, a.max_pixels)?;
    let lora = a.lora.apply(&mut placed, &p.config)?;
    let side = p.default_side();
    let opts = GenerateOptions {
        steps: a.steps,
        guidance: a.guidance,
        seed: a.seed,
        max_sequence_length: a.max_sequence_length,
        width: a.width.unwrap_or(side),
        height: a.height.unwrap_or(side),
    };
    let noise = a.noise.as_deref().map(read_noise).transpose()?;
    let mut t = Timings::default();
    let prepared = p.prepare_generate(
        &a.prompt,
        &opts,
        noise.as_ref().and_then(|n| n.initial_latents.as_ref()),
        &mut t,
    )?;
    if prepared.prompt_truncated {
        tracing::warn!(
            "the prompt is longer than the text encoders take (77 CLIP tokens, {} T5 tokens) and was truncated, as diffusers does",
            a.max_sequence_length
        );
    }
    let cfg = a.true_cfg.prepare(&p, a.max_sequence_length, &mut t)?;
    let schedule = p.schedule(opts.steps, opts.width, opts.height)?;
    let size = (a.seed, opts.width, opts.height);
    let control =
        a.controlnet
            .feed(&a.model, &prepared.inputs, &schedule, size, &p.limits, None)?;
    let mode = Mode::Full;
    let extra = (&lora.uses[..], cfg.as_ref(), control);
    let size = (opts.width, opts.height);
    let preview = PreviewFile::new(a.preview.as_deref(), &a.model, &p.vae, size)?;
    let latents = denoise(
        &mut placed,
        &prepared.inputs,
        (schedule, 0),
        mode,
        extra,
        preview.as_ref(),
        &mut t,
    )?
    .0;
    // The whole image is generated: nothing to paste back.
    let finish = EditOptions {
        paste_back: false,
        ..Default::default()
    };
    let out = p.finish(&prepared, &latents, &finish, &mut t)?;
    write_png(&a.out, &out, &mut t)?;
    report(a.timings, &t, "generate", &a.out);
    Ok(())
}
