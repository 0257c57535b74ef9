//! `denoised bench cache-quality`: what compressing a template costs an edit.
//!
//! One template is captured in f32 (a full run of a random image), then stored the
//! other ways asked for (`fp8`, step strides): exactly what a capture into those
//! layouts stores (`TemplateCache::converted`). Each mask (token masks at ratios drawn
//! from a mask-ratio trace) is edited against every form, and each result compared
//! with the f32-cache edit: the final latent's relative error, and the decoded image's
//! PSNR inside the mask (outside it, paste-back keeps the input's pixels). One JSON
//! line per (mask, form), then one summary line per form.
//!
//! The weights are seeded, not trained: the figures guard against regressions of the
//! cache formats and bound what they change; they are not image-quality figures of a
//! real model.

use std::path::PathBuf;
use std::sync::Arc;

use denoised_models::flux::edit::{run_to_end, DeviceTemplates, Job, Mode};
use denoised_models::flux::template::{storage_dtype, TemplateCache, TemplateLayout};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::{read_ratio_trace, TokenMask};
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Timings};
use denoised_models::pipeline::image::{Mask, Rgb8};
use denoised_models::ModelSource;
use denoised_runtime::{CpuBackend, DType, Tensor};

use super::bench_pipeline::{pixel_mask, random_image};
use super::{CliResult, DeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// `builtin` (the tiny model), `flux-small` (seeded flux-small transformer,
    /// FLUX.1 VAE, CLIP-L, a 768-wide T5), `flux-small-kontext` (the same as a Kontext
    /// model), or a diffusers directory.
    #[arg(long, default_value = "flux-small")]
    pub pipeline: String,
    /// Image side in pixels (square).
    #[arg(long, default_value_t = 512)]
    pub size: usize,
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    /// T5 sequence length.
    #[arg(long, default_value_t = 128)]
    pub max_sequence_length: usize,
    /// Mask-ratio trace (one ratio per line) the masks' sizes are drawn from.
    #[arg(
        long,
        default_value = "tests/fixtures/traces/production_faceswap_tryon.txt"
    )]
    pub mask_trace: PathBuf,
    /// Masks to edit.
    #[arg(long, default_value_t = 3)]
    pub masks: usize,
    /// Template forms to compare with f32, comma-separated: a dtype (`bf16`, `fp8`)
    /// and/or `stride=K` (f32 K/V stored every K steps).
    #[arg(long, value_delimiter = ',', default_value = "fp8,stride=2,stride=4")]
    pub forms: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `a` against the reference `b`: the largest difference over the largest magnitude,
/// and the L2 norm of the difference over that of `b`.
fn rel_errors(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let (mut dmax, mut bmax, mut d2, mut b2) = (0f64, 0f64, 0f64, 0f64);
    for (x, y) in a.data().iter().zip(b.data()) {
        let d = (*x - *y) as f64;
        dmax = dmax.max(d.abs());
        bmax = bmax.max((*y as f64).abs());
        d2 += d * d;
        b2 += (*y as f64) * (*y as f64);
    }
    (dmax / bmax.max(1e-30), (d2 / b2.max(1e-30)).sqrt())
}

/// PSNR in dB of `a` against `b` over the pixels `mask` marks (infinite when equal).
pub(super) fn psnr_in(a: &Rgb8, b: &Rgb8, mask: &Mask) -> f64 {
    let (mut se, mut n) = (0f64, 0usize);
    for (i, &on) in mask.data.iter().enumerate() {
        if on {
            for c in 0..3 {
                let d = a.data[i * 3 + c] as f64 - b.data[i * 3 + c] as f64;
                se += d * d;
            }
            n += 3;
        }
    }
    if se == 0.0 {
        return f64::INFINITY;
    }
    10.0 * (255.0f64 * 255.0 / (se / n.max(1) as f64)).log10()
}

/// A quality benchmark's pipeline by name: `builtin`, `flux-small`,
/// `flux-small-kontext`, or a diffusers directory.
pub(super) fn load(name: &str, backend: CpuBackend, seed: u64) -> CliResult<FluxFill<CpuBackend>> {
    Ok(match name {
        "builtin" => FluxFill::load(&ModelSource::Builtin, backend)?,
        "flux-small" => FluxFill::seeded_small(backend, seed)?,
        "flux-small-kontext" => FluxFill::seeded_small_kontext(backend, seed)?,
        dir => FluxFill::load(&ModelSource::dir(PathBuf::from(dir)), backend)?,
    })
}

/// Checks a quality benchmark's sizes and returns the pipeline's token side in pixels.
pub(super) fn check_sizes(
    p: &FluxFill<CpuBackend>,
    size: usize,
    masks: usize,
    steps: usize,
) -> CliResult<usize> {
    let tok = 2 * p.vae_scale_factor();
    if size == 0 || size % tok != 0 || masks == 0 || steps == 0 {
        return Err(format!(
            "--size must be a positive multiple of {tok}; --masks, --steps positive"
        )
        .into());
    }
    Ok(tok)
}

pub fn run(a: Args) -> CliResult {
    let p = load(&a.pipeline, a.device.cpu_backend()?, a.seed)?;
    let n = a.size;
    let tok = check_sizes(&p, n, a.masks, a.steps)?;
    let trace = read_ratio_trace(&a.mask_trace)?;
    let mut rng = SplitMix::new(a.seed ^ 0x51a7);
    let image = random_image(n, &mut rng);
    let opts = EditOptions {
        steps: a.steps,
        max_sequence_length: a.max_sequence_length,
        ..Default::default()
    };
    let model = p.transformer()?;
    let schedule = Arc::new(p.schedule(a.steps, n, n)?);
    let (rows, cols) = p.tokens(n, n);
    let mut t = Timings::default();

    // The f32 template: a full run of the image with an empty mask.
    let empty = Mask {
        width: n,
        height: n,
        data: vec![false; n * n],
    };
    let prep = p.prepare(
        &image,
        &empty,
        "a photo of a room",
        &opts,
        &Noise::default(),
        &mut t,
    )?;
    let grid = p.kind.template_tokens(rows * cols);
    let layout = TemplateLayout::for_model(&p.config, grid, a.steps, DType::F32);
    let job = Job::new(
        model,
        &prep.inputs,
        schedule.clone(),
        Mode::Capture(TemplateCache::new(layout)?),
    )?;
    let f32_cache = Arc::new(
        run_to_end(model, job, &DeviceTemplates::new())?
            .1
            .ok_or("the capture returned no template")?,
    );
    eprintln!("captured the f32 template ({} steps)", a.steps);
    let mut forms: Vec<(String, Arc<TemplateCache>)> = vec![];
    for f in &a.forms {
        let l = match f.strip_prefix("stride=") {
            Some(k) => layout.with_step_stride(k.parse().map_err(|_| format!("--forms: `{f}`"))?),
            None => TemplateLayout {
                dtype: storage_dtype(f)?,
                ..layout
            },
        };
        forms.push((f.clone(), Arc::new(f32_cache.converted(l)?)));
    }

    let mut sums: Vec<(f64, f64, f64, usize)> = vec![(0.0, 0.0, 0.0, 0); forms.len()];
    for mi in 0..a.masks {
        let ratio = trace[rng.next_u64() as usize % trace.len()];
        let count = ((ratio * (rows * cols) as f64).round() as usize).max(1);
        let tm = TokenMask::random_blobs(rows, cols, count, rng.next_u64());
        let mask = pixel_mask(&tm, n, tok);
        let prep = p.prepare(
            &image,
            &mask,
            "a red armchair",
            &opts,
            &Noise::default(),
            &mut t,
        )?;
        let tm = Arc::new(TokenMask::from_pixels(&mask.data, n, n, tok, 0)?);
        let edit = |cache: &Arc<TemplateCache>| -> CliResult<(Tensor, Rgb8)> {
            let mode = Mode::Edit {
                mask: tm.clone(),
                cache: cache.clone(),
            };
            let job = Job::new(model, &prep.inputs, schedule.clone(), mode)?;
            let slabs = DeviceTemplates::resident(model.backend(), &[cache])?;
            let latent = run_to_end(model, job, &slabs)?.0;
            let img = p.finish(&prep, &latent, &opts, &mut Timings::default())?;
            Ok((latent, img))
        };
        let (want_latent, want_img) = edit(&f32_cache)?;
        for (fi, (name, cache)) in forms.iter().enumerate() {
            let (latent, img) = edit(cache)?;
            let (max_rel, l2_rel) = rel_errors(&latent, &want_latent);
            let psnr = psnr_in(&img, &want_img, &mask);
            let s = &mut sums[fi];
            *s = (s.0 + max_rel, s.1 + l2_rel, s.2 + psnr.min(99.0), s.3 + 1);
            println!(
                "{}",
                serde_json::json!({
                    "mask": mi, "mask_ratio": ratio, "active_tokens": tm.active().len(),
                    "form": name, "latent_max_rel": max_rel, "latent_l2_rel": l2_rel,
                    "psnr_in_mask_db": psnr, "bytes_vs_f32": cache.layout().total_bytes() as f64
                        / f32_cache.layout().total_bytes() as f64,
                })
            );
        }
    }
    for ((name, cache), (mx, l2, ps, k)) in forms.iter().zip(sums) {
        let k = k.max(1) as f64;
        println!(
            "{}",
            serde_json::json!({
                "summary": name, "pipeline": a.pipeline, "size": n, "steps": a.steps,
                "masks": a.masks, "mean_latent_max_rel": mx / k, "mean_latent_l2_rel": l2 / k,
                "mean_psnr_in_mask_db": ps / k, "cache_bytes_per_step": cache.layout().cache_bytes_per_step(),
            })
        );
    }
    Ok(())
}
