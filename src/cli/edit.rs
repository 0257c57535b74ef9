//! `denoised edit` and `denoised template capture`: the FLUX.1 Fill pipeline from the
//! command line, in one process. With `--template`, the edit is mask-aware: only the
//! masked tokens are computed, against the template's cached activations.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use denoised_actors::device::{self, Placed};
use denoised_cuda::DeviceSpec;
use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::control_feed::ControlFeed;
use denoised_models::flux::edit::{DenoiseInputs, Mode, TrueCfg};
use denoised_models::flux::stepper::JobKey;
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::flux::template_file::{self, TemplateMeta};
use denoised_models::mask::TokenMask;
use denoised_models::pipeline::defaults;
use denoised_models::pipeline::fill::pack_latents;
use denoised_models::pipeline::flux_fill::{
    EditOptions, FluxFill, Noise, Parts, PipelineKind, Prepared, Timings,
};
use denoised_models::pipeline::image::Rgb8;
use denoised_models::pipeline::image::{
    decode_image, decode_mask, encode_png, from_model_space, Mask,
};
use denoised_models::pipeline::sparse_vae::{SparseVae, SparseVaeSetting};
use denoised_models::pipeline::{kontext, sizing};
use denoised_models::vae::sparse::check_traces;
use denoised_models::{FlowMatchEuler, ModelSource};
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{CpuBackend, HostSlice, Tensor};
use indicatif::{ProgressBar, ProgressStyle};

use super::preview::PreviewFile;

use super::adapters::LoraArgs;
use super::controlnet::ControlNetArgs;
use super::generate::TrueCfgArgs;
use super::{CliResult, ModelDeviceArgs};

/// Options shared by edits and captures.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// Model: a diffusers FLUX.1 Fill directory, or `builtin`.
    #[arg(long, env = "DENOISED_MODEL", default_value = "builtin")]
    pub model: ModelSource,
    #[command(flatten)]
    pub components: super::ComponentArgs,
    /// The prompt. Longer prompts are truncated to the encoders' maximum length, as
    /// diffusers does (with a warning).
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Denoising steps [default: 28, or the template's].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Guidance scale [default: 30, or the template's].
    #[arg(long)]
    pub guidance: Option<f32>,
    /// Seed of the initial noise and the VAE posterior sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// T5 sequence length.
    #[arg(long, default_value_t = defaults::MAX_SEQUENCE_LENGTH as usize)]
    pub max_sequence_length: usize,
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
}

#[derive(clap::Args, Debug)]
pub struct EditArgs {
    #[command(flatten)]
    pub common: Common,
    /// Input image (PNG or JPEG). Optional with --template (the template's image).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Mask image of the same size: white (>= 50% luminance) = repaint. Required on a
    /// FLUX.1 Fill model. On a FLUX.1 Kontext model an edit without one is an
    /// instruction edit (FluxKontextPipeline: `--prompt` says what to change); with one,
    /// a masked edit (FluxKontextInpaintPipeline) pasted back inside it only.
    #[arg(long)]
    pub mask: Option<PathBuf>,
    /// Kontext instruction edits: the output's area in pixels, at the image's aspect
    /// (diffusers' `max_area`).
    #[arg(long, value_name = "PIXELS", default_value_t = kontext::MAX_AREA)]
    pub max_area: usize,
    /// Kontext instruction edits: keep the image's own size as the reference instead of
    /// resizing it to the nearest of Kontext's preferred resolutions (diffusers'
    /// `_auto_resize=False`).
    #[arg(long)]
    pub no_auto_resize: bool,
    /// Kontext masked edits: how much of the schedule runs (diffusers' `strength`: 1
    /// starts from noise, less starts part way from the image's latents).
    #[arg(long, default_value_t = 1.0)]
    pub strength: f32,
    /// Kontext masked edits: a separate reference image the model reads instead of the
    /// image (diffusers' `image_reference`): at Kontext's nearest preferred resolution,
    /// or its own size with --no-auto-resize.
    #[arg(long, value_name = "FILE")]
    pub image_reference: Option<PathBuf>,
    /// A captured template directory: compute only the masked tokens.
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// With --template: run the VAE encoder and decoder only on the tiles the edit
    /// changes (`auto`, when the MAC estimate says it pays) or always dense (`off`).
    #[arg(long, env = "DENOISED_SPARSE_VAE", default_value = "auto")]
    pub sparse_vae: SparseVaeSetting,
    /// Extra ring of computed tokens around the mask (template edits).
    #[arg(long, default_value_t = 0)]
    pub dilation: usize,
    /// Safetensors with `initial_latents` (packed noise) and optionally `posterior_eps`,
    /// e.g. a reference case file, to reproduce a diffusers run exactly.
    #[arg(long)]
    pub noise: Option<PathBuf>,
    /// Return the decoded image as is, without pasting back the original pixels
    /// outside the mask (for comparisons with diffusers).
    #[arg(long)]
    pub no_paste_back: bool,
    /// Feather width at the seam in pixels (inside the mask).
    #[arg(long, default_value_t = 3)]
    pub feather: usize,
    /// Output PNG.
    #[arg(long)]
    pub out: PathBuf,
    /// With --template the ControlNets condition the masked tokens only (the rest
    /// follow the template, captured without them).
    #[command(flatten)]
    pub controlnet: ControlNetArgs,
    /// With --template the negative branch computes the masked tokens against the same
    /// template.
    #[command(flatten)]
    pub true_cfg: TrueCfgArgs,
}

#[derive(clap::Args, Debug)]
pub struct CaptureArgs {
    #[command(flatten)]
    pub common: Common,
    /// Template image (PNG or JPEG).
    #[arg(long)]
    pub image: PathBuf,
    /// Output directory (template.json, cache.bin, image.png, reconstruction.png).
    #[arg(long)]
    pub out: PathBuf,
    /// What the template caches per block: `kv` (K and V) or `y` (block outputs: about
    /// half the bytes; edits recompute the unmasked tokens' K/V each step).
    #[arg(long, default_value = "kv", value_parser = ["kv", "y"])]
    pub cache_mode: String,
    /// `auto`: also record the VAE encoder's and decoder's traces (`vae.bin`), which
    /// edits with `--sparse-vae auto` run sparse against; `off`: no traces (edits
    /// record them when they need them).
    #[arg(long, env = "DENOISED_SPARSE_VAE", default_value = "auto")]
    pub sparse_vae: SparseVaeSetting,
}

fn read(path: &Path) -> CliResult<Vec<u8>> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

fn progress(steps: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(steps as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} denoising [{bar:30}] step {pos}/{len} {elapsed_precise}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// The CPU stages on the host, and the transformer on the chosen device, placed the
/// way a denoise worker of the daemon places it (so both compute alike).
pub(super) fn load_pipeline(
    model: &ModelSource,
    dev: &ModelDeviceArgs,
    max_pixels: usize,
) -> CliResult<(FluxFill<CpuBackend>, Placed)> {
    let device = dev.spec()?;
    let parts = device::host_parts(device, Parts::ALL);
    let fp8_weights = dev.fp8_weights()?;
    let cpu = device::host_backend(device, fp8_weights);
    let mut p = FluxFill::load_parts(model, cpu, parts)?;
    p.limits.max_pixels = max_pixels;
    // One request at a time: the budget only has to hold the largest one.
    let limits = device::StepLimits {
        max_batch: 1,
        token_budget: 1,
        max_pixels,
        host_template_bytes: u64::MAX,
        resident_template_bytes: 0,
        // The stages go to the same device below.
        stages_on_device: device::StagesOnDevice {
            preprocess: (device != DeviceSpec::Cpu) as usize,
            postprocess: (device != DeviceSpec::Cpu) as usize,
        },
    };
    let placed = device::place(model, device, dev.dtype()?, fp8_weights, &p, limits)?;
    if device != DeviceSpec::Cpu {
        eprintln!("transformer on {} ({})", placed.device, placed.dtype);
        // The VAE and the text encoders too, as the daemon's pre- and postprocess
        // workers place them by default.
        device::place_stages(device, dev.dtype()?, &mut p)?;
        eprintln!("VAE, CLIP and T5 on {}", p.vae_device());
    }
    Ok((p, placed))
}

impl EditArgs {
    /// `--noise`'s tensors, or none (drawn from the seed).
    fn noise(&self) -> CliResult<Noise> {
        Ok(match &self.noise {
            Some(path) => read_noise(path)?,
            None => Noise::default(),
        })
    }
}

pub(super) fn read_noise(path: &Path) -> CliResult<Noise> {
    let f = SafetensorsFile::open(path)?;
    let get = |n: &str| -> CliResult<Option<Tensor>> {
        Ok(if f.contains(n) {
            Some(f.tensor_f32(n)?)
        } else {
            None
        })
    };
    // Packed `initial_latents`, or diffusers' `[1, C, h, w]` noise, packed here.
    let initial_latents = match (get("initial_latents")?, get("noise")?) {
        (Some(l), _) => l,
        (None, Some(n)) if n.shape().len() == 4 => {
            let &[_, c, h, w] = n.shape() else {
                unreachable!()
            };
            pack_latents(n.data(), c, h, w)?
        }
        _ => {
            return Err(format!(
                "{}: no `initial_latents` (packed) or `noise` ([1, C, h, w]) tensor",
                path.display()
            )
            .into())
        }
    };
    Ok(Noise {
        initial_latents: Some(initial_latents),
        posterior_eps: get("posterior_eps")?,
    })
}

/// Runs a request to the end on the placed model with a progress bar (and a preview
/// file rewritten after each step, when asked): its final latent and, for a capture,
/// its template.
/// `start`: the step it starts at (0 but for a masked Kontext edit of strength below 1).
/// `loras`: the unmerged LoRAs it runs with (uploaded by `LoraArgs::apply`); `cfg`:
/// true CFG's negative branch; `control`: ControlNet residuals.
pub(super) fn denoise(
    placed: &mut Placed,
    inputs: &DenoiseInputs,
    (schedule, start): (FlowMatchEuler, usize),
    mode: Mode,
    (loras, cfg, control): (&[LoraUse], Option<&TrueCfg>, Option<Arc<dyn ControlFeed>>),
    preview: Option<&PreviewFile>,
    t: &mut Timings,
) -> CliResult<(Tensor, Option<TemplateCache>)> {
    const ONE: JobKey = 0;
    let pb = progress(schedule.steps());
    let t0 = Instant::now();
    let st = &mut placed.stepper;
    st.admit(ONE, inputs, Arc::new(schedule), mode)?;
    if start > 0 {
        // A masked Kontext edit of strength below 1 starts part way.
        st.skip_to(ONE, start)?;
    }
    st.set_loras(ONE, loras.to_vec())?;
    if let Some(cfg) = cfg {
        st.set_true_cfg(ONE, inputs, cfg)?;
    }
    if let Some(feed) = control {
        st.set_control_feed(ONE, feed)?;
    }
    while !st.done(ONE) {
        let before = preview.map(|_| st.latents(ONE)).transpose()?;
        st.step(&[ONE])?;
        pb.inc(1);
        if let (Some(p), Some(before)) = (preview, before.filter(|_| !st.done(ONE))) {
            p.write(&st.clean_estimate(ONE, &before)?)?;
        }
    }
    let out = st.finish(ONE)?;
    pb.finish_and_clear();
    t.denoise_s += t0.elapsed().as_secs_f64();
    Ok(out)
}

pub(super) fn write_png(
    path: &Path,
    img: &denoised_models::pipeline::image::Rgb8,
    t: &mut Timings,
) -> CliResult {
    let t0 = Instant::now();
    let png = encode_png(img)?;
    t.png_encode_s += t0.elapsed().as_secs_f64();
    std::fs::write(path, png).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

pub(super) fn report(timings: bool, t: &Timings, what: &str, out: &Path) {
    eprintln!("{what}: wrote {}", out.display());
    if timings {
        println!("{}", serde_json::to_string(t).unwrap_or_default());
    }
}

pub fn run_edit(a: EditArgs) -> CliResult {
    let c = &a.common;
    let (mut p, mut placed) = load_pipeline(&c.model, &c.device, c.max_pixels)?;
    let lora = c.lora.apply(&mut placed, &p.config)?;
    // One edit: the traces it records are used once, so any size is kept.
    p.sparse_vae = SparseVae::new(a.sparse_vae, usize::MAX);
    let mut t = Timings::default();
    let template = match &a.template {
        Some(dir) => Some((dir.clone(), template_file::read_meta(dir)?)),
        None => None,
    };
    // The template's stored VAE traces: its sparse passes read them instead of
    // recording them with a dense pass of the template.
    let vae_traces = match &template {
        Some((dir, _)) if a.sparse_vae == SparseVaeSetting::Auto => {
            match template_file::read_vae_traces(dir)? {
                Some(b) => {
                    // Checked once here: the passes read them in place.
                    check_traces(&b).map_err(|e| format!("{}: {e}", dir.display()))?;
                    Some(HostSlice::copy_of(&b)?)
                }
                None => None,
            }
        }
        _ => None,
    };
    let image_path = match (&a.image, &template) {
        (Some(i), _) => i.clone(),
        (None, Some((dir, _))) => dir.join("image.png"),
        (None, None) => return Err("--image is required without --template".into()),
    };
    let image = decode_image(&read(&image_path)?, &p.limits)
        .map_err(|e| format!("{}: {e}", image_path.display()))?;
    let kontext = p.kind == PipelineKind::Kontext;
    if a.image_reference.is_some() && !(kontext && template.is_none() && a.mask.is_some()) {
        return Err("--image-reference is a masked Kontext edit's (--mask, no --template)".into());
    }
    if kontext && template.is_none() {
        return kontext_edit(&a, &p, &mut placed, &lora.uses, image, &mut t);
    }
    let mask_path = match &a.mask {
        Some(m) => m,
        None => return Err("--mask is required: FLUX.1 Fill repaints the masked area (an edit without a mask is an instruction edit, which needs a FLUX.1 Kontext model)".into()),
    };
    let mask = decode_mask(
        &read(mask_path)?,
        image.width,
        image.height,
        &p.limits,
        Default::default(),
    )
    .map_err(|e| format!("{}: {e}", mask_path.display()))?;
    let (steps, guidance) = match &template {
        Some((_, m)) => {
            for (flag, given, have) in [
                ("--steps", c.steps.map(|s| s as f32), m.steps as f32),
                ("--guidance", c.guidance, m.guidance),
            ] {
                if given.is_some_and(|g| g != have) {
                    return Err(format!("{flag} {} differs from the template's {have}: a template serves only the steps and guidance it was captured with", given.unwrap_or_default()).into());
                }
            }
            if m.adapters != lora.key {
                let say = |k: &str| {
                    if k.is_empty() {
                        "no LoRA".to_string()
                    } else {
                        format!("LoRAs {k}")
                    }
                };
                return Err(format!(
                    "the template was captured with {} and this edit runs with {}: a template serves only the adapter set it was captured with",
                    say(&m.adapters),
                    say(&lora.key)
                )
                .into());
            }
            (m.steps, m.guidance)
        }
        None => (
            c.steps.unwrap_or(defaults::STEPS as usize),
            c.guidance.unwrap_or(p.kind.edit_guidance()),
        ),
    };
    let opts = EditOptions {
        steps,
        guidance,
        seed: c.seed,
        max_sequence_length: c.max_sequence_length,
        paste_back: !a.no_paste_back,
        feather: a.feather,
        dilation: a.dilation,
        template_edit: template.is_some(),
        vae_traces,
        record_vae_trace: false,
        strength: a.strength,
    };
    let noise = a.noise()?;
    let prepared = p.prepare(&image, &mask, &c.prompt, &opts, &noise, &mut t)?;
    if prepared.prompt_truncated {
        tracing::warn!(
            "the prompt is longer than the text encoders take (77 CLIP tokens, {} T5 tokens) and was truncated, as diffusers does",
            c.max_sequence_length
        );
    }
    let cfg = a.true_cfg.prepare(&p, c.max_sequence_length, &mut t)?;
    let schedule = p.schedule(steps, image.width, image.height)?;
    let size = (image.width, image.height);
    let preview = PreviewFile::new(c.preview.as_deref(), &c.model, &p.vae, size)?;
    let control = |active: Option<Vec<u32>>| {
        let size = (c.seed, image.width, image.height);
        let cn = &a.controlnet;
        cn.feed(
            &c.model,
            &prepared.inputs,
            &schedule,
            size,
            &p.limits,
            active,
        )
    };
    let mut template_latent = None;
    let latents = match &template {
        None => {
            let mode = Mode::Full;
            let control = control(None)?;
            denoise(
                &mut placed,
                &prepared.inputs,
                (schedule, 0),
                mode,
                (&lora.uses, cfg.as_ref(), control),
                preview.as_ref(),
                &mut t,
            )?
            .0
        }
        Some((dir, _)) => {
            let (rows, cols) = p.tokens(image.width, image.height);
            let grid = p.kind.template_tokens(rows * cols);
            let layout = TemplateLayout::for_model(&p.config, grid, steps, placed.template_dtype());
            let loaded = template_file::load(dir, &p.fingerprint, &layout)?;
            if loaded.kv_dtype != placed.template_dtype() {
                // Exact one way (bf16 values are f32 values) and a rounding the device
                // would have made the other way; either way the numbers differ from a
                // template captured on this device, so say so.
                tracing::warn!(
                    "{}: template K/V stored in {:?}, this device keeps them in {:?}; \
                     results may differ slightly from a template captured here",
                    dir.display(),
                    loaded.kv_dtype,
                    placed.template_dtype()
                );
            }
            let block = 2 * p.vae_scale_factor();
            let tm =
                TokenMask::from_pixels(&mask.data, image.height, image.width, block, a.dilation)?;
            eprintln!(
                "mask-aware edit: {} of {} tokens active ({:.1}% of pixels masked)",
                tm.active().len(),
                tm.len(),
                100.0 * tm.pixel_ratio
            );
            template_latent = Some(loaded.cache.latent(steps - 1)?);
            let control = control(Some(tm.active().to_vec()))?;
            let mode = Mode::Edit {
                mask: Arc::new(tm),
                cache: Arc::new(loaded.cache),
            };
            denoise(
                &mut placed,
                &prepared.inputs,
                (schedule, 0),
                mode,
                (&lora.uses, cfg.as_ref(), control),
                preview.as_ref(),
                &mut t,
            )?
            .0
        }
    };
    let out = p.finish_edit(&prepared, &latents, template_latent.as_ref(), &opts, &mut t)?;
    if template.is_some() {
        eprintln!(
            "VAE: encode {}, decode {} (--sparse-vae {})",
            serde_json::to_value(t.vae_encode_pass)?,
            serde_json::to_value(t.vae_decode_pass)?,
            a.sparse_vae
        );
    }
    write_png(&a.out, &out, &mut t)?;
    report(c.timings, &t, "edit", &a.out);
    Ok(())
}

/// A masked Kontext edit's separate reference image, sized as
/// `FluxKontextInpaintPipeline` sizes `image_reference` (Lanczos, as diffusers resizes).
fn kontext_reference(p: &FluxFill<CpuBackend>, a: &EditArgs, path: &Path) -> CliResult<Rgb8> {
    let image =
        decode_image(&read(path)?, &p.limits).map_err(|e| format!("{}: {e}", path.display()))?;
    let block = 2 * p.vae_scale_factor();
    let (w, h) = (image.width, image.height);
    let ((rw, rh), _) = kontext::kontext_sizes(w, h, a.max_area, block, !a.no_auto_resize);
    eprintln!("reference image: {w}x{h} read at {rw}x{rh}");
    Ok(match (w, h) == (rw, rh) {
        true => image,
        false => sizing::resize_rgb(&image, rw, rh),
    })
}

/// A FLUX.1 Kontext edit. Without a mask, an instruction edit as `FluxKontextPipeline`
/// runs it: the output at `--max-area` with the image's aspect, the image as the
/// reference at its own size or Kontext's nearest preferred one (Lanczos, as diffusers
/// resizes it). With one, `FluxKontextInpaintPipeline`'s masked edit at the image's
/// size (`--strength`), pasted back unless `--no-paste-back`.
fn kontext_edit(
    a: &EditArgs,
    p: &FluxFill<CpuBackend>,
    placed: &mut Placed,
    loras: &[LoraUse],
    image: Rgb8,
    t: &mut Timings,
) -> CliResult {
    let c = &a.common;
    if !a.controlnet.controlnets.is_empty() {
        return Err("ControlNets with a FLUX.1 Kontext model are not built yet".into());
    }
    let steps = c.steps.unwrap_or(defaults::STEPS as usize);
    let noise = a.noise()?;
    let mut opts = EditOptions {
        steps,
        guidance: c.guidance.unwrap_or(p.kind.edit_guidance()),
        seed: c.seed,
        max_sequence_length: c.max_sequence_length,
        paste_back: !a.no_paste_back,
        feather: a.feather,
        strength: a.strength,
        ..Default::default()
    };
    let (prepared, start) = match &a.mask {
        None => {
            let block = 2 * p.vae_scale_factor();
            let (w, h) = (image.width, image.height);
            let auto = !a.no_auto_resize;
            let (reference, output) = kontext::kontext_sizes(w, h, a.max_area, block, auto);
            let image = match (w, h) == reference {
                true => image,
                false => sizing::resize_rgb(&image, reference.0, reference.1),
            };
            eprintln!(
                "instruction edit: reference {}x{}, output {}x{}",
                reference.0, reference.1, output.0, output.1
            );
            // The whole output is generated: nothing to paste back.
            opts.paste_back = false;
            let prepared = p.prepare_kontext(&image, output, &c.prompt, &opts, &noise, t)?;
            (prepared, 0)
        }
        Some(path) => {
            let (w, h) = (image.width, image.height);
            let mask = decode_mask(&read(path)?, w, h, &p.limits, Default::default())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            eprintln!("masked instruction edit: {w}x{h}, strength {}", a.strength);
            let separate = match &a.image_reference {
                Some(path) => Some(kontext_reference(p, a, path)?),
                None => None,
            };
            let images = kontext::InpaintImages {
                image: &image,
                mask: &mask,
                reference: separate.as_ref(),
            };
            p.prepare_kontext_inpaint(images, &c.prompt, &opts, &noise, t)?
        }
    };
    let (w, h) = (prepared.image.width, prepared.image.height);
    let cfg = a.true_cfg.prepare(p, c.max_sequence_length, t)?;
    let schedule = p.schedule(steps, w, h)?;
    let preview = PreviewFile::new(c.preview.as_deref(), &c.model, &p.vae, (w, h))?;
    let (latents, _) = denoise(
        placed,
        &prepared.inputs,
        (schedule, start),
        Mode::Full,
        (loras, cfg.as_ref(), None),
        preview.as_ref(),
        t,
    )?;
    let out = p.finish_edit(&prepared, &latents, None, &opts, t)?;
    write_png(&a.out, &out, t)?;
    report(c.timings, t, "edit", &a.out);
    Ok(())
}

/// A capture's decode of its final latent, recording the decoder's trace: the output (as
/// `finish` decodes it, bit for bit) and the template's stored VAE traces (the encode's,
/// then the decode's), `None` when neither was recorded.
pub(super) fn decode_with_traces(
    p: &FluxFill<CpuBackend>,
    prepared: &Prepared,
    latents: &Tensor,
    width: usize,
    height: usize,
) -> CliResult<(Tensor, Option<Vec<u8>>)> {
    let (raw, dec) = p.decode_recording(latents.data(), latents.cols(), width, height)?;
    let traces: Vec<u8> = prepared
        .vae_trace
        .iter()
        .chain(&dec)
        .flatten()
        .copied()
        .collect();
    Ok((raw, Some(traces).filter(|t| !t.is_empty())))
}

pub fn run_capture(a: CaptureArgs) -> CliResult {
    let c = &a.common;
    let (p, mut placed) = load_pipeline(&c.model, &c.device, c.max_pixels)?;
    let lora = c.lora.apply(&mut placed, &p.config)?;
    let mut t = Timings::default();
    let bytes = read(&a.image)?;
    let image =
        decode_image(&bytes, &p.limits).map_err(|e| format!("{}: {e}", a.image.display()))?;
    // A template is captured with an empty mask: the model reconstructs the whole image.
    let mask = Mask {
        width: image.width,
        height: image.height,
        data: vec![false; image.width * image.height],
    };
    // A Kontext edit's VAE runs dense (its reference is the whole image): no traces.
    let record = a.sparse_vae == SparseVaeSetting::Auto && p.kind != PipelineKind::Kontext;
    let opts = EditOptions {
        steps: c.steps.unwrap_or(defaults::STEPS as usize),
        guidance: c.guidance.unwrap_or(p.kind.edit_guidance()),
        seed: c.seed,
        max_sequence_length: c.max_sequence_length,
        paste_back: false,
        record_vae_trace: record,
        ..Default::default()
    };
    let prepared = p.prepare(&image, &mask, &c.prompt, &opts, &Noise::default(), &mut t)?;
    let schedule = p.schedule(opts.steps, image.width, image.height)?;
    let (rows, cols) = p.tokens(image.width, image.height);
    let grid = p.kind.template_tokens(rows * cols);
    let layout = TemplateLayout::for_model(&p.config, grid, opts.steps, placed.template_dtype())
        .with_mode(a.cache_mode.parse()?);
    let mode = Mode::Capture(TemplateCache::new(layout)?);
    let size = (image.width, image.height);
    let preview = PreviewFile::new(c.preview.as_deref(), &c.model, &p.vae, size)?;
    let (latents, cache) = denoise(
        &mut placed,
        &prepared.inputs,
        (schedule, 0),
        mode,
        (&lora.uses, None, None),
        preview.as_ref(),
        &mut t,
    )?;
    let cache = cache.ok_or("the capture run returned no template cache")?;
    let (recon, traces) = if record {
        // The decode recording its trace: the same ops as `finish`'s, bit for bit.
        let t0 = Instant::now();
        let (w, h) = (image.width, image.height);
        let (raw, traces) = decode_with_traces(&p, &prepared, &latents, w, h)?;
        t.vae_decode_s += t0.elapsed().as_secs_f64();
        (from_model_space(raw.data(), w, h), traces)
    } else {
        (p.finish(&prepared, &latents, &opts, &mut t)?, None)
    };
    let meta = TemplateMeta {
        model: p.fingerprint.clone(),
        height: image.height,
        width: image.width,
        steps: opts.steps,
        guidance: opts.guidance,
        seed: c.seed,
        prompt: c.prompt.clone(),
        adapters: lora.key.clone(),
    };
    template_file::save(&a.out, &cache, &meta, placed.template_dtype())?;
    if let Some(traces) = traces {
        template_file::save_vae_traces(&a.out, &traces)?;
        eprintln!(
            "VAE traces: {:.1} MB beside {:.1} MB of template cache",
            traces.len() as f64 / 1e6,
            cache.layout().total_bytes() as f64 / 1e6
        );
    }
    // Keep the original bytes re-encoded losslessly: edits read the image from here.
    write_png(&a.out.join("image.png"), &image, &mut t)?;
    write_png(&a.out.join("reconstruction.png"), &recon, &mut t)?;
    report(c.timings, &t, "template", &a.out);
    Ok(())
}
