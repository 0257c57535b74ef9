//! `denoised bench simulate`: denoise workers, alone or in pods, in simulated time, to
//! compare routing policies on fleets bigger than this machine. The real routing
//! policies and the real batching scheduler run; step times come from a profile
//! (`denoised profile`). Poisson arrivals at `--rps` (or `--load` of the fleet's
//! capacity), mask ratios drawn from a trace, templates drawn with a popularity skew.
//! One JSON line per policy.

use std::path::PathBuf;

use denoised_actors::batching::BatchConfig;
use denoised_actors::routing::beats::{polled, pushed, Sizes};
use denoised_actors::routing::pods::{MissPrices, PodPolicy};
use denoised_actors::routing::sim::{
    simulate_pods, simulate_pods_noting, Changes, Done, Fleet, Placement, SimRequest, Source,
};
use denoised_actors::routing::{Incoming, Policy, ProfileCost, StepCost, TemplateNeed};
use denoised_actors::wire::pods::{encoded_size, PodReport, PodRun, PodTemplate, PodWorker};
use denoised_models::flux::cost::StepShape;
use denoised_models::flux::template::{storage_dtype, TemplateLayout};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::read_ratio_trace;
use denoised_models::profile::{Profile, Tier};
use denoised_models::FluxConfig;

use super::CliResult;

/// The flux-small CPU profile `denoised profile` wrote on the 2-core development
/// machine (1024 image tokens): the default, so a fresh clone can simulate.
const FLUX_SMALL_CPU: &str = include_str!("../../tests/fixtures/profiles/flux-small-cpu.json");

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Denoise workers (of each pod).
    #[arg(long, alias = "gpus-per-pod", default_value_t = 8)]
    pub workers: usize,
    /// Pods (hosts), each with `--workers` workers and its own template tiers.
    #[arg(long, default_value_t = 1)]
    pub pods: usize,
    /// Policies between pods, comma-separated: round_robin, least_loaded,
    /// template_aware (with more than one pod).
    #[arg(long, value_delimiter = ',', default_value = "template_aware")]
    pub pod_policy: Vec<String>,
    /// Mean arrival rate (requests per second, Poisson).
    #[arg(long, conflicts_with = "load", required_unless_present = "load")]
    pub rps: Option<f64>,
    /// Arrival rate as a fraction of the fleet's capacity: the throughput it reaches
    /// saturated (offered twice what full batches of the trace's mean request with no
    /// template loads would finish) under `least_loaded` between pods and the first
    /// `--policy` inside them.
    #[arg(long)]
    pub load: Option<f64>,
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
    /// Template popularity: Zipf exponent (0: the templates in turn).
    #[arg(long, default_value_t = 0.0)]
    pub template_skew: f64,
    /// Templates a worker's device, a pod's memory and a pod's disk keep (least
    /// recently used out first); unlimited where not given. With more than one pod each
    /// template starts on one pod's disk (template v on pod v mod pods), else on the
    /// disk.
    #[arg(long)]
    pub device_templates: Option<usize>,
    #[arg(long)]
    pub host_templates: Option<usize>,
    #[arg(long)]
    pub disk_templates: Option<usize>,
    /// How templates are stored: f32, bf16 or fp8 (their bytes price every load).
    #[arg(long, default_value = "f32")]
    pub template_dtype: String,
    /// Bandwidth of a template transfer between pods (Gbit/s).
    #[arg(long, default_value_t = 100.0)]
    pub transfer_gbps: f64,
    /// Seconds to capture a template again (default: its steps at full size).
    #[arg(long)]
    pub recapture_s: Option<f64>,
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

/// Template versions `0..n` by popularity: Zipf with exponent `skew` (0: uniform).
struct Popularity {
    cumulative: Vec<f64>,
}

impl Popularity {
    fn new(n: u64, skew: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|k| {
                total += (k as f64).powf(-skew);
                total
            })
            .collect();
        Popularity { cumulative }
    }
    /// The template of a uniform draw `u` in [0, 1).
    fn draw(&self, u: f64) -> u64 {
        let x = u * self.cumulative.last().copied().unwrap_or(0.0);
        self.cumulative.partition_point(|&c| c <= x) as u64
    }
}

/// A uniform draw in (0, 1).
fn uniform(rng: &mut SplitMix) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

pub fn run(a: Args) -> CliResult {
    let cfg =
        FluxConfig::named(&a.config).ok_or_else(|| format!("unknown config `{}`", a.config))?;
    let profile: Profile = match &a.profile {
        Some(p) => Profile::read(p)?,
        None => serde_json::from_str(FLUX_SMALL_CPU)?,
    };
    if a.requests == 0 || a.workers == 0 || a.pods == 0 || a.steps == 0 {
        return Err("--requests, --workers, --pods and --steps must be positive".into());
    }
    let policies = a
        .policy
        .iter()
        .map(|p| p.parse::<Policy>())
        .collect::<Result<Vec<_>, _>>()?;
    let pod_policies = match a.pods {
        1 => vec![PodPolicy::RoundRobin],
        _ => a
            .pod_policy
            .iter()
            .map(|p| p.parse::<PodPolicy>())
            .collect::<Result<Vec<_>, _>>()?,
    };
    let trace = read_ratio_trace(&a.trace)?;
    let cost = ProfileCost {
        config: &cfg,
        profile: &profile,
    };
    // A template's K/V, loaded from the host tier or disk in the step that first reads
    // it on a worker, or fetched from a peer pod, or captured again.
    let dtype = storage_dtype(&a.template_dtype)?;
    let layout = TemplateLayout::for_model(&cfg, a.image_tokens, a.steps as usize, dtype);
    let bytes = layout.total_bytes() as f64;
    let full = StepShape {
        text: a.text_tokens,
        active: a.image_tokens,
        image: a.image_tokens,
    };
    let miss = MissPrices {
        fetch_s: bytes / (a.transfer_gbps * 1e9 / 8.0),
        recapture_s: a
            .recapture_s
            .unwrap_or(a.steps as f64 * cost.step_s(&[full])),
    };
    let fleet = Fleet {
        pods: a.pods,
        workers_per_pod: a.workers,
        device_templates: a.device_templates,
        host_templates: a.host_templates,
        disk_templates: a.disk_templates,
        placement: match a.pods {
            1 => Placement::EveryDisk,
            _ => Placement::OnePod,
        },
        miss,
    };
    // The daemon's defaults but for the batch size.
    let batch = BatchConfig {
        max_batch: a.max_batch,
        ..BatchConfig::default()
    };
    let at = |rps: f64| requests(&a, &trace, rps, &profile, bytes);
    let rps = match (a.rps, a.load) {
        (Some(r), _) => r,
        (None, Some(l)) => {
            let offered = 2.0 * full_batches_rps(&a, &trace, &cost);
            let baseline = (PodPolicy::LeastLoaded, policies[0]);
            let saturated = at(offered);
            let done = simulate_pods(&saturated, &fleet, batch, baseline, &cost)?;
            l * throughput(&done, &saturated)
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if rps.is_nan() || rps <= 0.0 {
        return Err("the arrival rate must be positive".into());
    }
    let reqs = at(rps);
    for &pp in &pod_policies {
        for &p in &policies {
            let t0 = std::time::Instant::now();
            let mut changes = Changes::default();
            let done = simulate_pods_noting(&reqs, &fleet, batch, (pp, p), &cost, &mut changes)?;
            let mut line = summary(&done, &reqs, a.overhead_s);
            let extra = serde_json::json!({
                "policy": p.name(), "workers": a.workers, "rps": rps, "requests": a.requests,
                "trace": a.trace, "profile": profile.device,
                "sim_wall_s": t0.elapsed().as_secs_f64(),
            });
            line.extend(extra.as_object().cloned().unwrap_or_default());
            if a.pods > 1 {
                let transfers = done.iter().filter(|d| d.transfer).count();
                line.insert("mesh".into(), mesh(&a, &done, &reqs, &changes));
                let pods = serde_json::json!({
                    "pods": a.pods, "pod_policy": pp.name(), "templates": a.templates,
                    "template_skew": a.template_skew, "template_bytes": bytes,
                    "fetch_s": miss.fetch_s, "recapture_s": miss.recapture_s,
                    "transfers": transfers, "bytes_transferred": transfers as f64 * bytes,
                });
                line.extend(pods.as_object().cloned().unwrap_or_default());
            }
            println!("{}", serde_json::Value::Object(line));
        }
    }
    Ok(())
}

/// The mesh's control traffic in this run (messages and payload bytes a second, summed
/// over the pods): beats as the mesh paces them, over the run's changes, beside the
/// asks every second they replaced. A report's size is that of one whose workers run
/// half-full batches; a pod's template list, the mean number of templates the pods
/// hold at the end.
fn mesh(a: &Args, done: &[Done], reqs: &[SimRequest], changes: &Changes) -> serde_json::Value {
    let span = done.iter().map(|d| d.finish).fold(0.0, f64::max) - reqs[0].arrival.min(0.0);
    let run = PodRun {
        text: a.text_tokens as u32,
        active: a.image_tokens as u32 / 4,
        image: a.image_tokens as u32,
        steps_left: a.steps / 2,
    };
    let report = PodReport {
        pod: "pod-000".into(),
        started_unix: 1.8e9,
        http: "10.0.0.1:8080".into(),
        ready: true,
        in_flight: (a.workers * a.max_batch / 2) as u32,
        limit: (a.workers * a.max_batch) as u32,
        templates: vec![],
        listed: false,
        listing: u64::MAX / 3,
        workers: vec![
            PodWorker {
                max_batch: a.max_batch as u32,
                running: vec![run; a.max_batch / 2],
            };
            a.workers
        ],
        queued: vec![],
        fetching: vec![],
    };
    let template = PodTemplate {
        id: "template-00042".into(),
        version: 1_800_000_000_000_000,
        host_bytes: 1 << 33,
        disk_bytes: 1 << 33,
        tokens: a.image_tokens as u32,
        steps: a.steps,
    };
    let held = changes.held.iter().sum::<usize>().div_ceil(a.pods);
    let sizes = Sizes {
        report: encoded_size(&report) as f64,
        listing: (encoded_size(&template) * held) as f64,
        ask: 0.0,
    };
    let push = pushed(&changes.load, &changes.templates, span, sizes);
    serde_json::json!({
        "span_s": span, "report_bytes": sizes.report, "listing_bytes": sizes.listing,
        "templates_held": held,
        "pushed": push, "polled": polled(a.pods, sizes),
        "idle_pushed": pushed(&vec![vec![]; a.pods], &[], span, sizes),
    })
}

/// Poisson arrivals at `rps`, mask ratios from the trace, templates by popularity.
fn requests(a: &Args, trace: &[f64], rps: f64, profile: &Profile, bytes: f64) -> Vec<SimRequest> {
    let mut rng = SplitMix::new(a.seed ^ 0x517e);
    let popularity = Popularity::new(a.templates, a.template_skew);
    let mut t = 0.0;
    (0..a.requests)
        .map(|i| {
            // Exponential gaps: -ln(u) / rps.
            t += -uniform(&mut rng).ln() / rps;
            let ratio = trace[rng.next_u64() as usize % trace.len()];
            let active =
                ((ratio * a.image_tokens as f64).round() as usize).clamp(1, a.image_tokens);
            let version = match a.template_skew {
                0.0 => i as u64 % a.templates.max(1),
                _ => popularity.draw(uniform(&mut rng)),
            };
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
                        version,
                        host_load_s: profile.load_s(Tier::Host, bytes),
                        disk_load_s: profile.load_s(Tier::Disk, bytes),
                    }),
                },
            }
        })
        .collect()
}

/// Requests a second the fleet would finish with every worker running full batches of
/// the trace's mean request and no template loads.
fn full_batches_rps(a: &Args, trace: &[f64], cost: &dyn StepCost) -> f64 {
    let mean = trace.iter().sum::<f64>() / trace.len().max(1) as f64;
    let shape = StepShape {
        text: a.text_tokens,
        active: ((mean * a.image_tokens as f64).round() as usize).clamp(1, a.image_tokens),
        image: a.image_tokens,
    };
    let batch = vec![shape; a.max_batch];
    (a.pods * a.workers * a.max_batch) as f64 / (a.steps as f64 * cost.step_s(&batch))
}

/// Requests finished a second, from the first arrival to the last finish.
fn throughput(done: &[Done], reqs: &[SimRequest]) -> f64 {
    let span = done.iter().map(|d| d.finish).fold(0.0, f64::max) - reqs[0].arrival;
    done.len() as f64 / span
}

/// Latency and queue figures, and where the templates came from (fractions).
fn summary(
    done: &[Done],
    reqs: &[SimRequest],
    overhead_s: f64,
) -> serde_json::Map<String, serde_json::Value> {
    let mut lat: Vec<f64> = done.iter().map(|d| d.latency() + overhead_s).collect();
    lat.sort_by(f64::total_cmp);
    let mut queue: Vec<f64> = done.iter().map(|d| d.admit - d.arrival).collect();
    queue.sort_by(f64::total_cmp);
    let n = lat.len() as f64;
    let sources: serde_json::Map<String, serde_json::Value> = Source::ALL
        .iter()
        .map(|s| {
            let k = done.iter().filter(|d| d.source == *s).count();
            (s.name().to_string(), serde_json::json!(k as f64 / n))
        })
        .collect();
    let v = serde_json::json!({
        "throughput_rps": throughput(done, reqs),
        "mean_s": lat.iter().sum::<f64>() / n, "p50_s": quantile(&lat, 0.5),
        "p95_s": quantile(&lat, 0.95), "p99_s": quantile(&lat, 0.99),
        "queue_mean_s": queue.iter().sum::<f64>() / n, "queue_p95_s": quantile(&queue, 0.95),
        "template_from": sources,
    });
    v.as_object().cloned().unwrap_or_default()
}
