//! `denoised bench pipeline`: per-stage timings of a whole edit (tokenize, encode text,
//! VAE encode, denoise, VAE decode, PNG encode) with seeded components, on a random
//! image and an irregular mask, on any device. One JSON line.

use std::time::Instant;

use std::sync::Arc;

use denoised_actors::device::{self, StepLimits};
use denoised_cuda::DeviceSpec;
use denoised_models::flux::edit::Mode;
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Parts, Timings};
use denoised_models::pipeline::image::{encode_png, Mask, Rgb8};
use denoised_models::ModelSource;

use super::{CliResult, ModelDeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// `builtin` (the tiny model) or `flux-small` (seeded flux-small transformer,
    /// FLUX.1 VAE, CLIP-L, a 768-wide T5).
    #[arg(long, default_value = "builtin")]
    pub pipeline: String,
    /// Image side in pixels (square).
    #[arg(long, default_value_t = 512)]
    pub size: usize,
    /// Denoising steps to run (the JSON also gives the time per step).
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// T5 sequence length.
    #[arg(long, default_value_t = 512)]
    pub max_sequence_length: usize,
    /// Where every model runs (`--device cuda:0` puts CLIP, T5, the VAE and the
    /// transformer on the GPU, as a daemon's workers place them), in `--dtype`.
    #[command(flatten)]
    pub device: ModelDeviceArgs,
    /// Time the VAE alone, dense against spatially sparse (SIGE), encode and decode
    /// per mask ratio and mode, instead of the whole edit (CPU only).
    #[arg(long)]
    pub sparse_vae: bool,
    /// With --sparse-vae: token mask ratios, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.05,0.1,0.2,0.4")]
    pub mask_ratio: Vec<f64>,
    /// With --sparse-vae: modes as REGION/STATS (exact, local or dilated:N; frozen or
    /// incremental), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "local/incremental")]
    pub sparse_modes: Vec<String>,
    /// With --sparse-vae: timed runs of each sparse pass (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// With --sparse-vae: tile side in pixels.
    #[arg(long, default_value_t = denoised_models::vae::sparse::DEFAULT_TILE)]
    pub tile: usize,
}

/// A square `n x n` image of random pixels (timing and error figures do not depend on
/// the content).
pub(super) fn random_image(n: usize, rng: &mut SplitMix) -> Rgb8 {
    Rgb8 {
        width: n,
        height: n,
        data: (0..n * n * 3)
            .map(|_| (rng.next_u64() >> 56) as u8)
            .collect(),
    }
}

/// The pixel mask of an `n x n` image whose `tok`-pixel tokens `tm` marks.
pub(super) fn pixel_mask(tm: &TokenMask, n: usize, tok: usize) -> Mask {
    let cols = n / tok;
    let mut on = vec![false; tm.len()];
    for &t in tm.active() {
        on[t as usize] = true;
    }
    Mask {
        width: n,
        height: n,
        data: (0..n * n)
            .map(|i| on[(i / n / tok) * cols + (i % n) / tok])
            .collect(),
    }
}

/// The step limits of one `n x n` request at a time, every model on `spec` (as a
/// daemon's workers place them), no template resident.
pub(super) fn one_request(spec: DeviceSpec, n: usize) -> StepLimits {
    StepLimits {
        max_batch: 1,
        token_budget: 1,
        max_pixels: n * n,
        host_template_bytes: u64::MAX,
        resident_template_bytes: 0,
        stages_on_device: device::StagesOnDevice {
            preprocess: (spec != DeviceSpec::Cpu) as usize,
            postprocess: (spec != DeviceSpec::Cpu) as usize,
        },
    }
}

pub fn run(a: Args) -> CliResult {
    if a.sparse_vae {
        return super::bench_sparse_vae::run(&a);
    }
    let source = match a.pipeline.as_str() {
        "builtin" => ModelSource::Builtin,
        "flux-small" => ModelSource::BuiltinSmall,
        other => return Err(format!("unknown --pipeline `{other}`: builtin or flux-small").into()),
    };
    let (spec, dt) = (a.device.spec()?, a.device.dtype()?);
    let n = a.size;
    let t0 = Instant::now();
    let parts = device::host_parts(spec, Parts::ALL);
    let fp8_weights = a.device.fp8_weights()?;
    let mut p = FluxFill::load_parts(&source, device::host_backend(spec, fp8_weights), parts)?;
    p.limits.max_pixels = p.limits.max_pixels.max(n * n);
    let mut placed = device::place(&source, spec, dt, fp8_weights, &p, one_request(spec, n))?;
    device::place_stages(spec, dt, &mut p)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut rng = SplitMix::new(5);
    let image = random_image(n, &mut rng);
    // An irregular mask covering about 20% of the image, drawn at token resolution.
    let tok = 2 * p.vae_scale_factor();
    let (tr, tc) = (n / tok, n / tok);
    let tm = TokenMask::random_blobs(tr, tc, tr * tc / 5, 11);
    let mask = pixel_mask(&tm, n, tok);
    let opts = EditOptions {
        steps: a.steps,
        max_sequence_length: a.max_sequence_length,
        ..Default::default()
    };
    let mut t = Timings::default();
    let prep = p.prepare(
        &image,
        &mask,
        "a photo of a cat wearing a small hat",
        &opts,
        &Noise::default(),
        &mut t,
    )?;
    let schedule = p.schedule(a.steps, n, n)?;
    let d0 = Instant::now();
    let st = &mut placed.stepper;
    st.admit(0, &prep.inputs, Arc::new(schedule), Mode::Full)?;
    while !st.done(0) {
        st.step(&[0])?;
    }
    let (latents, _) = st.finish(0)?;
    t.denoise_s = d0.elapsed().as_secs_f64();
    let out = p.finish(&prep, &latents, &opts, &mut t)?;
    let e0 = Instant::now();
    let png = encode_png(&out)?;
    t.png_encode_s = e0.elapsed().as_secs_f64();
    let mut v = serde_json::to_value(&t)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("pipeline".into(), a.pipeline.clone().into());
        o.insert("device".into(), placed.device.clone().into());
        o.insert("dtype".into(), placed.dtype.into());
        o.insert("size".into(), n.into());
        o.insert("image_tokens".into(), (tr * tc).into());
        o.insert("steps".into(), a.steps.into());
        o.insert(
            "denoise_step_s".into(),
            (t.denoise_s / a.steps.max(1) as f64).into(),
        );
        o.insert("load_s".into(), load_s.into());
        o.insert("png_bytes".into(), png.len().into());
    }
    println!("{v}");
    Ok(())
}
