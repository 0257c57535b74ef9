//! `denoised bench edit`: one template edit timed end to end, by parts, as the daemon
//! serves it: a template captured first (with its VAE traces), then an edit of it with
//! an irregular mask of `--mask-ratio` of the tokens: text encoders, the sparse VAE
//! encode, the denoising steps over the active tokens against the template, the sparse
//! VAE decode and paste-back, the PNG encode. On a GPU every model is on the device (as
//! a daemon's workers place them) and the template resident there; on the emulator it
//! runs at a small size (CI), whose timings mean nothing. One JSON line:
//! `{"total_s", "parts": {...}, ...}`.
//!
//!     denoised bench edit --pipeline flux1-fill-dev --device cuda:0 --size 1024 \
//!         --mask-ratio 0.1 --steps 28

use std::sync::Arc;
use std::time::Instant;

use denoised_actors::device::{self, StepLimits};
use denoised_models::flux::edit::Mode;
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Parts, Timings};
use denoised_models::pipeline::image::{encode_png, Mask};
use denoised_models::pipeline::sparse_vae::{SparseVae, SparseVaeSetting};
use denoised_models::ModelSource;
use denoised_runtime::HostSlice;

use super::bench_pipeline::{one_request, pixel_mask, random_image};
use super::{CliResult, ModelDeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// `builtin` (the tiny model), `flux-small` (seeded flux-small transformer, FLUX.1
    /// VAE, CLIP-L, a 768-wide T5) or `flux1-fill-dev` (seeded at FLUX.1-Fill-dev's
    /// size: the 12B transformer, T5-XXL; a GPU machine's benchmark).
    #[arg(long, default_value = "builtin", value_parser = ["builtin", "flux-small", "flux1-fill-dev"])]
    pub pipeline: String,
    /// Image side in pixels (square).
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Share of the image's tokens the edit's mask covers (an irregular blob mask).
    #[arg(long, default_value_t = 0.1)]
    pub mask_ratio: f64,
    /// Denoising steps of the template and the edit.
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    /// T5 sequence length.
    #[arg(long, default_value_t = 512)]
    pub max_sequence_length: usize,
    /// Edits timed after the capture (the first warms up; the median is reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    #[command(flatten)]
    pub device: ModelDeviceArgs,
}

pub fn run(a: Args) -> CliResult {
    if !(0.0..=1.0).contains(&a.mask_ratio) || a.steps == 0 || a.iters == 0 {
        return Err("--mask-ratio must be in [0, 1]; --steps and --iters positive".into());
    }
    let source: ModelSource = format!(
        "builtin{}",
        match a.pipeline.as_str() {
            "builtin" => "",
            "flux-small" => ":flux-small",
            _ => ":flux1-fill-dev",
        }
    )
    .parse()
    .unwrap_or_else(|e| match e {});
    let (spec, dt) = (a.device.spec()?, a.device.dtype()?);
    let n = a.size;
    let t0 = Instant::now();
    let fp8 = a.device.fp8_weights()?;
    let parts = device::host_parts(spec, Parts::ALL);
    let mut p = FluxFill::load_parts(&source, device::host_backend(spec, fp8), parts)?;
    p.limits.max_pixels = p.limits.max_pixels.max(n * n);
    p.sparse_vae = SparseVae::new(SparseVaeSetting::Auto, usize::MAX);
    let limits = StepLimits {
        // Resident on the device, where the daemon keeps a template in steady use.
        resident_template_bytes: u64::MAX,
        ..one_request(spec, n)
    };
    let mut placed = device::place(&source, spec, dt, fp8, &p, limits)?;
    device::place_stages(spec, dt, &mut p)?;
    let load_s = t0.elapsed().as_secs_f64();

    let mut rng = SplitMix::new(5);
    let image = random_image(n, &mut rng);
    let prompt = "a photo of a cat wearing a small hat";
    // The template: captured with an empty mask, its decode recording the VAE traces
    // its edits run sparse against.
    let c0 = Instant::now();
    let opts = EditOptions {
        steps: a.steps,
        max_sequence_length: a.max_sequence_length,
        paste_back: false,
        record_vae_trace: true,
        ..Default::default()
    };
    let empty = Mask {
        width: n,
        height: n,
        data: vec![false; n * n],
    };
    let mut t = Timings::default();
    let prep = p.prepare(&image, &empty, prompt, &opts, &Noise::default(), &mut t)?;
    let (rows, cols) = p.tokens(n, n);
    let layout =
        TemplateLayout::for_model(&p.config, rows * cols, a.steps, placed.template_dtype());
    let schedule = Arc::new(p.schedule(a.steps, n, n)?);
    let st = &mut placed.stepper;
    st.admit(
        0,
        &prep.inputs,
        schedule.clone(),
        Mode::Capture(TemplateCache::new(layout)?),
    )?;
    while !st.done(0) {
        st.step(&[0])?;
    }
    let (latents, cache) = st.finish(0)?;
    let cache = Arc::new(cache.ok_or("the capture returned no template cache")?);
    let (_, traces) = super::edit::decode_with_traces(&p, &prep, &latents, n, n)?;
    let traces = traces.map(|t| HostSlice::copy_of(&t)).transpose()?;
    let capture_s = c0.elapsed().as_secs_f64();

    // The edit: an irregular mask of the asked share of tokens.
    let tok = 2 * p.vae_scale_factor();
    let (tr, tc) = (n / tok, n / tok);
    let active = ((a.mask_ratio * (tr * tc) as f64).round() as usize).clamp(1, tr * tc);
    let mask = pixel_mask(&TokenMask::random_blobs(tr, tc, active, 11), n, tok);
    let opts = EditOptions {
        steps: a.steps,
        max_sequence_length: a.max_sequence_length,
        template_edit: true,
        vae_traces: traces,
        ..Default::default()
    };
    let template_latent = cache.latent(a.steps - 1)?;
    let mut runs: Vec<(f64, Timings, usize, usize)> = vec![];
    for i in 0..a.iters {
        let e0 = Instant::now();
        let mut t = Timings::default();
        // A new prompt each time: the text encoders run, as for a new request (the
        // pipeline caches prompts it has seen).
        let prompt = format!("{prompt}, take {i}");
        let prep = p.prepare(&image, &mask, &prompt, &opts, &Noise::default(), &mut t)?;
        let tm = TokenMask::from_pixels(&mask.data, n, n, tok, 0)?;
        let (active, tokens) = (tm.active().len(), tm.len());
        let d0 = Instant::now();
        let st = &mut placed.stepper;
        let mode = Mode::Edit {
            mask: Arc::new(tm),
            cache: cache.clone(),
        };
        let id = 1 + i as u64;
        st.admit(id, &prep.inputs, schedule.clone(), mode)?;
        while !st.done(id) {
            st.step(&[id])?;
        }
        let (latents, _) = st.finish(id)?;
        t.denoise_s = d0.elapsed().as_secs_f64();
        let out = p.finish_edit(&prep, &latents, Some(&template_latent), &opts, &mut t)?;
        let p0 = Instant::now();
        encode_png(&out)?;
        t.png_encode_s = p0.elapsed().as_secs_f64();
        runs.push((e0.elapsed().as_secs_f64(), t, active, tokens));
    }
    // The median run by total time (the first warms caches up when there are several).
    runs.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (total_s, t, active, tokens) = &runs[runs.len() / 2];
    let parts = serde_json::to_value(t)?;
    let v = serde_json::json!({
        "what": "template_edit", "pipeline": a.pipeline, "device": placed.device,
        "dtype": placed.dtype, "weights": fp8.map_or("bf16".into(), |s| format!("fp8 ({})", s.name())),
        "attention": placed.attention, "size": n, "steps": a.steps,
        "mask_ratio": a.mask_ratio, "active_tokens": active, "tokens": tokens,
        "total_s": total_s, "parts": parts, "denoise_step_s": t.denoise_s / a.steps as f64,
        "all_totals_s": runs.iter().map(|r| r.0).collect::<Vec<_>>(),
        "capture_s": capture_s, "load_s": load_s,
    });
    println!("{v}");
    Ok(())
}
