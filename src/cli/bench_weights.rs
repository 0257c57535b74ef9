//! `denoised bench weights`: the same transformer from several checkpoint files (f32,
//! bf16, fp8, GGUF Q8_0, Q4_K, ...) on the CPU, in one run. For each file it prints
//! the process's resident memory growth while loading it and a full step's time, the
//! steps of all files alternating round by round so a drift of the machine's speed
//! cancels out of their ratios to the first file. docs/performance.md ("Checkpoint
//! formats") has the figures; benches/make_flux_small_formats.py writes flux-small's
//! files.
//!
//!     denoised bench weights --config flux-small --transformer f32.safetensors,Q8_0.gguf,Q4_K.gguf

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use denoised_models::flux::edit::{step_batch_with, DeviceTemplates, Job, Mode};
use denoised_models::flux::single_file::TransformerFile;
use denoised_models::flux::weights::SplitMix;
use denoised_models::planner::prefix;
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::CpuBackend;
use serde_json::json;

use super::bench_step::random_inputs;
use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Transformer files, comma-separated; ratios are to the first.
    #[arg(long, value_delimiter = ',', required = true)]
    pub transformer: Vec<PathBuf>,
    /// The named config the files hold: its RoPE axes are the one thing shapes
    /// cannot tell.
    #[arg(long, default_value = "flux-small")]
    pub config: String,
    /// Image tokens of the request (a near-square grid).
    #[arg(long, default_value_t = 1024)]
    pub image_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub text_tokens: usize,
    /// Timed rounds (one step of every file each), after one warm-up round.
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
}

/// This process's resident memory, from /proc (Linux); 0 elsewhere.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub fn run(a: Args) -> CliResult {
    let hint =
        FluxConfig::named(&a.config).ok_or_else(|| format!("unknown --config {}", a.config))?;
    let mut models = Vec::new();
    for path in &a.transformer {
        let before = rss_bytes();
        let file = TransformerFile::open(path, Some(&hint))?;
        let dtypes = denoised_runtime::checkpoint::stored_types(file.file());
        let config = file.config.clone();
        let m = FluxTransformer::from_source(CpuBackend::new(), config, Box::new(file))?;
        let grown = rss_bytes().saturating_sub(before);
        println!(
            "{}",
            json!({
                "file": path.display().to_string(),
                "stored": dtypes,
                "weights": m.memory(),
                "rss_growth_bytes": grown,
            })
        );
        models.push(m);
    }
    let cfg = &models[0].config;
    let mut rng = SplitMix::new(0);
    let inputs = random_inputs(cfg, a.image_tokens, a.text_tokens, &mut rng)?;
    let schedule = Arc::new(FlowMatchEuler::new(
        &Default::default(),
        28,
        a.image_tokens,
    )?);
    let step = |m: &FluxTransformer<CpuBackend>| -> CliResult<f64> {
        let mut job = Job::new(m, &inputs, schedule.clone(), Mode::Full)?;
        let plan = prefix(m.num_blocks(), 0);
        let t = Instant::now();
        step_batch_with(m, &mut [&mut job], &DeviceTemplates::new(), &plan)?;
        Ok(t.elapsed().as_secs_f64())
    };
    for m in &models {
        step(m)?;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    for _ in 0..a.iters {
        let round: Vec<f64> = models.iter().map(step).collect::<CliResult<_>>()?;
        for (i, t) in round.iter().enumerate() {
            times[i].push(*t);
            ratios[i].push(t / round[0]);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        v[v.len() / 2]
    };
    for (i, path) in a.transformer.iter().enumerate() {
        println!(
            "{}",
            json!({
                "file": path.display().to_string(),
                "image_tokens": a.image_tokens,
                "step_ms": 1e3 * median(&mut times[i]),
                "over_first": median(&mut ratios[i]),
            })
        );
    }
    Ok(())
}
