//! `denoised bench simulate`: a cluster of denoise workers in simulated time, to compare
//! routing policies on fleets bigger than this machine. The real routing policies and
//! the real batching scheduler run; step times come from a profile (`denoised
//! profile`). Poisson arrivals at `--rps`, mask ratios drawn from a trace. One JSON line
//! per policy.

use std::path::PathBuf;

use denoised_actors::batching::BatchConfig;
use denoised_actors::routing::sim::{simulate_cluster, SimRequest};
use denoised_actors::routing::{Incoming, Policy, ProfileCost, TemplateNeed};
use denoised_models::flux::cost::StepShape;
use denoised_models::flux::template::TemplateLayout;
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::read_ratio_trace;
use denoised_models::profile::{Profile, Tier};
use denoised_models::FluxConfig;
use denoised_runtime::DType;

use super::CliResult;

/// The flux-small CPU profile `denoised profile` wrote on the 2-core development
/// machine (1024 image tokens): the default, so a fresh clone can simulate.
const FLUX_SMALL_CPU: &str = include_str!("../../tests/fixtures/profiles/flux-small-cpu.json");

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Denoise workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Mean arrival rate (requests per second, Poisson).
    #[arg(long)]
    pub rps: f64,
    /// Requests to simulate.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Mask-ratio trace (one ratio per line).
    #[arg(
        long,
        default_value = "tests/fixtures/traces/production_faceswap_tryon.txt"
    )]
    pub trace: PathBuf,
    /// Routing policies, comma-separated: round_robin, least_requests, least_tokens,
    /// mask_aware.
    #[arg(long, value_delimiter = ',', default_value = "mask_aware")]
    pub policy: Vec<String>,
    /// The workers' latency models (default: the committed flux-small CPU profile).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Named transformer config the profile was measured with.
    #[arg(long, default_value = "flux-small")]
    pub config: String,
    /// Image and text tokens per request, and denoising steps.
    #[arg(long, default_value_t = 4096)]
    pub image_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub text_tokens: usize,
    #[arg(long, default_value_t = 28)]
    pub steps: u32,
    /// Distinct templates the edits read (each loaded from disk on first use, then
    /// from the host tier by other workers).
    #[arg(long, default_value_t = 4)]
    pub templates: u64,
    /// Most requests in one worker's batch (`[denoise] max_batch`).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds added to every request's latency for what happens outside the denoise
    /// workers (preprocessing, postprocessing, HTTP), to compare with end-to-end
    /// latencies (bench serve's `preprocess_mean_s + postprocess_mean_s`).
    #[arg(long, default_value_t = 0.0)]
    pub overhead_s: f64,
    /// One JSON line per policy (the default prints them too; kept for scripts).
    #[arg(long)]
    pub json: bool,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

pub fn run(a: Args) -> CliResult {
    let cfg =
        FluxConfig::named(&a.config).ok_or_else(|| format!("unknown config `{}`", a.config))?;
    let profile: Profile = match &a.profile {
        Some(p) => Profile::read(p)?,
        None => serde_json::from_str(FLUX_SMALL_CPU)?,
    };
    if a.rps.is_nan() || a.rps <= 0.0 || a.requests == 0 || a.workers == 0 || a.steps == 0 {
        return Err("--rps, --requests, --workers and --steps must be positive".into());
    }
    let policies = a
        .policy
        .iter()
        .map(|p| p.parse::<Policy>())
        .collect::<Result<Vec<_>, _>>()?;
    let trace = read_ratio_trace(&a.trace)?;
    // A template's K/V per step, loaded from the host tier or disk in the step that
    // first reads it on a worker (all its steps' slabs, f32 as the CPU stores them).
    let layout = TemplateLayout::for_model(&cfg, a.image_tokens, a.steps as usize, DType::F32);
    let bytes = layout.total_bytes() as f64;
    let mut rng = SplitMix::new(a.seed ^ 0x517e);
    let mut t = 0.0;
    let reqs: Vec<SimRequest> = (0..a.requests)
        .map(|i| {
            // Exponential gaps: -ln(u) / rps.
            let u = ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            t += -u.ln() / a.rps;
            let ratio = trace[rng.next_u64() as usize % trace.len()];
            let active =
                ((ratio * a.image_tokens as f64).round() as usize).clamp(1, a.image_tokens);
            SimRequest {
                arrival: t,
                req: Incoming {
                    shape: StepShape {
                        text: a.text_tokens,
                        active,
                        image: a.image_tokens,
                    },
                    steps: a.steps,
                    template: (a.templates > 0).then(|| TemplateNeed {
                        version: i as u64 % a.templates,
                        host_load_s: profile.load_s(Tier::Host, bytes),
                        disk_load_s: profile.load_s(Tier::Disk, bytes),
                    }),
                },
            }
        })
        .collect();
    // The daemon's defaults but for the batch size.
    let batch = BatchConfig {
        max_batch: a.max_batch,
        ..BatchConfig::default()
    };
    let cost = ProfileCost {
        config: &cfg,
        profile: &profile,
    };
    for p in policies {
        let t0 = std::time::Instant::now();
        let done = simulate_cluster(&reqs, a.workers, batch, p, &cost)?;
        let mut lat: Vec<f64> = done.iter().map(|d| d.latency() + a.overhead_s).collect();
        lat.sort_by(f64::total_cmp);
        let mut queue: Vec<f64> = done.iter().map(|d| d.admit - d.arrival).collect();
        queue.sort_by(f64::total_cmp);
        let span = done.iter().map(|d| d.finish).fold(0.0, f64::max) - reqs[0].arrival;
        let n = lat.len() as f64;
        println!(
            "{}",
            serde_json::json!({
                "policy": p.name(), "workers": a.workers, "rps": a.rps, "requests": a.requests,
                "trace": a.trace, "throughput_rps": n / span,
                "mean_s": lat.iter().sum::<f64>() / n, "p50_s": quantile(&lat, 0.5),
                "p95_s": quantile(&lat, 0.95), "p99_s": quantile(&lat, 0.99),
                "queue_mean_s": queue.iter().sum::<f64>() / n, "queue_p95_s": quantile(&queue, 0.95),
                "profile": profile.device, "sim_wall_s": t0.elapsed().as_secs_f64(),
            })
        );
    }
    Ok(())
}
