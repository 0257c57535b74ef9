//! `denoised bench-step`: times one transformer step of a named config with seeded
//! random weights and prints one JSON line. Figures in docs/performance.md come from
//! here.

use std::time::Instant;

use denoised_models::flux::cost::{forward_flops, StepShape};
use denoised_models::flux::embed::image_ids;
use denoised_models::flux::model::{FluxRequest, NoObserver};
use denoised_models::flux::weights::SplitMix;
use denoised_models::{FluxConfig, FluxTransformer};
use denoised_runtime::{Backend, Tensor};

use super::{CliResult, DeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Named transformer config (flux-small, flux-tiny, flux1-dev, flux1-fill-dev, flux1-schnell).
    #[arg(long, default_value = "flux-small")]
    pub config: String,
    /// Image tokens per request (a near-square grid is used).
    #[arg(long, default_value_t = 1024)]
    pub image_tokens: usize,
    /// Text tokens per request.
    #[arg(long, default_value_t = 128)]
    pub text_tokens: usize,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Seed of the random weights and inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// The most square `rows x cols` grid with `n` cells.
fn grid(n: usize) -> (usize, usize) {
    let mut r = (n as f64).sqrt() as usize;
    while r > 1 && n % r != 0 {
        r -= 1;
    }
    (r.max(1), n / r.max(1))
}

fn random(shape: &[usize], rng: &mut SplitMix) -> Tensor {
    let n = shape.iter().product();
    Tensor::new(shape.to_vec(), (0..n).map(|_| rng.normal()).collect()).expect("shape matches")
}

pub fn run(a: Args) -> CliResult {
    let cfg = FluxConfig::named(&a.config).ok_or_else(|| {
        format!(
            "unknown config `{}`; known: {}",
            a.config,
            FluxConfig::NAMES.join(", ")
        )
    })?;
    if a.image_tokens == 0 || a.iters == 0 {
        return Err("--image-tokens and --iters must be positive".into());
    }
    let backend = a.device.cpu_backend()?;
    let backend_name = backend.name();
    let model = FluxTransformer::seeded(backend, cfg.clone(), a.seed)?;
    let mut rng = SplitMix::new(a.seed ^ 0xbe4c);
    let (rows, cols) = grid(a.image_tokens);
    let img = random(&[a.image_tokens, cfg.in_channels], &mut rng);
    let img_ids = Tensor::new([a.image_tokens, 3], image_ids(rows, cols))?;
    let txt = random(&[a.text_tokens, cfg.joint_attention_dim], &mut rng);
    let txt_ids = Tensor::zeros([a.text_tokens, 3]);
    let pooled: Vec<f32> = (0..cfg.pooled_projection_dim)
        .map(|_| rng.normal())
        .collect();
    let req = FluxRequest {
        img: &img,
        img_ids: &img_ids,
        txt: &txt,
        txt_ids: &txt_ids,
        pooled: &pooled,
        timestep: 0.75,
        guidance: 30.0,
        cache: None,
    };
    let reqs = [req];
    model.forward(&reqs, &mut NoObserver)?;
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let t = Instant::now();
        model.forward(&reqs, &mut NoObserver)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let median = times[times.len() / 2];
    let flops = forward_flops(&cfg, StepShape::full(a.text_tokens, a.image_tokens));
    let line = serde_json::json!({
        "config": a.config,
        "image_tokens": a.image_tokens,
        "text_tokens": a.text_tokens,
        "mask_ratio": 1.0,
        "batch": 1,
        "min_s": times[0],
        "median_s": median,
        "gflops": flops / median / 1e9,
        "backend": backend_name,
    });
    println!("{line}");
    Ok(())
}
