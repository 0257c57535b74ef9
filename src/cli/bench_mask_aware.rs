//! `denoised bench mask-aware-quality`: what computing only the masked tokens changes
//! against computing every token, for FLUX.1 Fill and FLUX.1 Kontext alike.
//!
//! One template is captured from an image under one prompt, with an empty mask: a Fill
//! model reconstructs the image; a Kontext model holds every noisy token to the
//! image's (`FluxKontextInpaintPipeline` with nothing masked), with the image as its
//! reference. Then, for each mask (token masks at ratios drawn from a mask-ratio
//! trace), the same masked edit under another prompt runs twice from the same inputs
//! (the template's seed): dense, every token computed, and as a template edit, only
//! the masked tokens computed while the unmasked tokens' K/V (and on Kontext the
//! reference tokens') are the template's, computed under the capture's prompt. Both
//! are decoded without paste-back and compared: PSNR inside and outside the mask, and
//! the largest 8-bit level difference in each, and the two denoising loops' times. One
//! JSON line per mask, then a summary.
//!
//! The weights are seeded, not trained: the figures compare the two approximations on
//! the same footing and guard against regressions; they are not FLUX.1's image quality.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use denoised_models::flux::edit::{run_to_end, DeviceTemplates, Job, Mode};
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::{read_ratio_trace, TokenMask};
use denoised_models::pipeline::flux_fill::{EditOptions, Noise, Timings};
use denoised_models::pipeline::image::{Mask, Rgb8};
use denoised_runtime::DType;

use super::bench_pipeline::{pixel_mask, random_image};
use super::bench_quality::{check_sizes, load, psnr_in};
use super::{CliResult, DeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// `builtin` (the tiny Fill model), `flux-small` (seeded flux-small Fill),
    /// `flux-small-kontext` (the same with FLUX.1-dev's input channels, as Kontext),
    /// or a diffusers directory (Fill or Kontext): as `bench cache-quality`.
    #[arg(long, default_value = "flux-small")]
    pub pipeline: String,
    /// Image side in pixels (square).
    #[arg(long, default_value_t = 256)]
    pub size: usize,
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// T5 sequence length.
    #[arg(long, default_value_t = 64)]
    pub max_sequence_length: usize,
    /// Mask-ratio trace (one ratio per line) the masks' sizes are drawn from.
    #[arg(
        long,
        default_value = "tests/fixtures/traces/production_faceswap_tryon.txt"
    )]
    pub mask_trace: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub masks: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// The largest level difference of `a` against `b` over the pixels `mask` marks.
fn max_level_in(a: &Rgb8, b: &Rgb8, mask: &Mask) -> u8 {
    let px = a.data.chunks(3).zip(b.data.chunks(3)).zip(&mask.data);
    px.filter(|(_, &on)| on)
        .flat_map(|((x, y), _)| x.iter().zip(y).map(|(p, q)| p.abs_diff(*q)))
        .max()
        .unwrap_or(0)
}

pub fn run(a: Args) -> CliResult {
    let p = load(&a.pipeline, a.device.cpu_backend()?, a.seed)?;
    let n = a.size;
    let tok = check_sizes(&p, n, a.masks, a.steps)?;
    let trace = read_ratio_trace(&a.mask_trace)?;
    let mut rng = SplitMix::new(a.seed ^ 0x3a5c);
    let image = random_image(n, &mut rng);
    // Every run draws the same noise (the template's seed), and nothing is pasted back.
    let opts = EditOptions {
        steps: a.steps,
        seed: a.seed,
        max_sequence_length: a.max_sequence_length,
        paste_back: false,
        ..Default::default()
    };
    let model = p.transformer()?;
    let schedule = Arc::new(p.schedule(a.steps, n, n)?);
    let (rows, cols) = p.tokens(n, n);
    let t = &mut Timings::default();
    let prepare = |mask: &Mask, prompt: &str, t: &mut Timings| {
        p.prepare(&image, mask, prompt, &opts, &Noise::default(), t)
    };

    let empty = Mask {
        width: n,
        height: n,
        data: vec![false; n * n],
    };
    let grid = p.kind.template_tokens(rows * cols);
    let layout = TemplateLayout::for_model(&p.config, grid, a.steps, DType::F32);
    let capture = prepare(&empty, "a photo of a room", t)?;
    let job = Job::new(
        model,
        &capture.inputs,
        schedule.clone(),
        Mode::Capture(TemplateCache::new(layout)?),
    )?;
    let cache = Arc::new(
        run_to_end(model, job, &DeviceTemplates::new())?
            .1
            .ok_or("the capture returned no template")?,
    );
    let slabs = DeviceTemplates::resident(model.backend(), &[&cache])?;
    eprintln!("{:?}: captured a template of {grid} tokens", p.kind);

    let mut sums = [0f64; 6];
    for mi in 0..a.masks {
        let ratio = trace[rng.next_u64() as usize % trace.len()];
        let count = ((ratio * (rows * cols) as f64).round() as usize).max(1);
        let tm = TokenMask::random_blobs(rows, cols, count, rng.next_u64());
        let mask = pixel_mask(&tm, n, tok);
        let prep = prepare(&mask, "a red armchair", t)?;
        let tm = Arc::new(TokenMask::from_pixels(&mask.data, n, n, tok, 0)?);
        let t0 = Instant::now();
        let dense = Job::new(model, &prep.inputs, schedule.clone(), Mode::Full)?;
        let dense = run_to_end(model, dense, &slabs)?.0;
        let t1 = Instant::now();
        let edit = Mode::Edit {
            mask: tm.clone(),
            cache: cache.clone(),
        };
        let edit = Job::new(model, &prep.inputs, schedule.clone(), edit)?;
        let edit = run_to_end(model, edit, &slabs)?.0;
        let (dense_s, edit_s) = ((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64());
        let [want, got] = [dense, edit].map(|l| p.finish(&prep, &l, &opts, t));
        let (want, got) = (want?, got?);
        let outside = Mask {
            data: mask.data.iter().map(|m| !m).collect(),
            ..mask.clone()
        };
        let (pin, pout) = (psnr_in(&got, &want, &mask), psnr_in(&got, &want, &outside));
        let (lin, lout) = (
            max_level_in(&got, &want, &mask),
            max_level_in(&got, &want, &outside),
        );
        let s = [
            pin.min(99.0),
            pout.min(99.0),
            lin as f64,
            lout as f64,
            dense_s,
            edit_s,
        ];
        sums.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        println!(
            "{}",
            serde_json::json!({
                "mask": mi, "mask_ratio": ratio, "active_tokens": tm.active().len(),
                "tokens": rows * cols, "psnr_in_mask_db": pin, "psnr_outside_db": pout,
                "max_level_diff_in": lin, "max_level_diff_outside": lout,
                "denoise_dense_s": dense_s, "denoise_template_s": edit_s,
            })
        );
    }
    let k = a.masks as f64;
    println!(
        "{}",
        serde_json::json!({
            "summary": format!("{:?}", p.kind), "pipeline": a.pipeline, "size": n,
            "steps": a.steps, "masks": a.masks, "template_tokens": grid,
            "mean_psnr_in_mask_db": sums[0] / k, "mean_psnr_outside_db": sums[1] / k,
            "mean_max_level_diff_in": sums[2] / k, "mean_max_level_diff_outside": sums[3] / k,
            "mean_denoise_dense_s": sums[4] / k, "mean_denoise_template_s": sums[5] / k,
        })
    );
    Ok(())
}
