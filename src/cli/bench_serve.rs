//! `denoised bench serve`: an open-loop load generator against a running daemon's HTTP
//! API.
//!
//! `bench step` and `bench pipeline` time the compute of one request in isolation; what
//! a deployment needs to know is how the whole daemon behaves under traffic: how long
//! requests wait, how well the denoiser batches them, what latency tail a given arrival
//! rate produces. This command registers a few templates, then fires `POST /v1/edits` at
//! Poisson arrival times (pre-drawn, so a slow response never delays the next request:
//! an open loop, as real clients behave), with mask sizes drawn from a trace of real
//! edit workloads, and reports client-side latency percentiles next to the server's own
//! per-stage timings and batch sizes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use denoised_models::pipeline::image::{encode_png, Rgb8};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use serde_json::{json, Value};

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Base URL of the daemon.
    #[arg(long, env = "DENOISED_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Bearer token, when the daemon sets `[server] api_token`.
    #[arg(long, env = "DENOISED_API_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Mean arrival rate in requests per second (arrivals form a Poisson process).
    #[arg(long, default_value_t = 1.0)]
    pub rps: f64,
    /// Stop issuing requests after this many seconds.
    #[arg(long, required_unless_present = "requests")]
    pub duration: Option<f64>,
    /// Stop issuing requests after this many (with --duration: whichever comes first).
    #[arg(long, required_unless_present = "duration")]
    pub requests: Option<usize>,
    /// File of mask ratios, one per line (e.g. tests/fixtures/traces/*.txt); each edit
    /// draws one at random. Lines that are not numbers are skipped.
    #[arg(long)]
    pub mask_trace: Option<PathBuf>,
    /// Fraction of the image each edit repaints, when no --mask-trace is given.
    #[arg(long, default_value_t = 0.2, conflicts_with = "mask_trace")]
    pub mask_ratio: f64,
    /// Template image (PNG or JPEG); default: a synthetic --width x --height image.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Width of the synthetic template image.
    #[arg(long, default_value_t = 64)]
    pub width: usize,
    /// Height of the synthetic template image.
    #[arg(long, default_value_t = 64)]
    pub height: usize,
    /// Templates to register (ids bench-0, bench-1, ...; existing ones are reused);
    /// each edit picks one at random.
    #[arg(long, default_value_t = 2)]
    pub templates: usize,
    /// Denoising steps of the templates (and so of every edit).
    #[arg(long, default_value_t = 8)]
    pub steps: u32,
    /// Prompt of the edits.
    #[arg(long, default_value = "a small red hat")]
    pub prompt: String,
    /// Seed of the arrival times, mask boxes and template choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most requests in flight at once (default: unlimited). Arrivals beyond it wait
    /// client-side, and their latency is counted from when they are sent.
    #[arg(long)]
    pub concurrency_limit: Option<usize>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Print exactly one JSON line on stdout at the end (the report still goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Clients that never register a template: each edit uploads its image
    /// (`image` + `boxes`), one of --templates popular images with this probability,
    /// else an image never sent before. Against a daemon with `[templates] auto`, the
    /// popular ones become templates by themselves; the report counts the replies'
    /// `auto_template` hits, captures and misses.
    #[arg(long, value_name = "FRACTION")]
    pub repeat_rate: Option<f64>,
}

/// Mask and box sides snap to this many pixels: the tiny built-in model has 4-pixel
/// tokens, so boxes stay token-aligned for it (FLUX's 16-pixel tokens just round up).
const GRID: u32 = 4;
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// SplitMix64: a small, fast, seedable generator; plenty for drawing a workload.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Exponential with the given rate: the gap between Poisson arrivals.
    fn exp(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }
}

/// Arrival times (seconds from the start) of a Poisson process of rate `rps`, up to
/// `max_n` arrivals or time `max_t`, whichever comes first.
fn arrivals(rng: &mut Rng, rps: f64, max_n: Option<usize>, max_t: Option<f64>) -> Vec<f64> {
    let (max_n, max_t) = (max_n.unwrap_or(usize::MAX), max_t.unwrap_or(f64::INFINITY));
    let mut out = Vec::new();
    let mut t = 0.0;
    while out.len() < max_n {
        t += rng.exp(rps);
        if t > max_t {
            break;
        }
        out.push(t);
    }
    out
}

/// One box `[x, y, w, h]` of area about `ratio * width * height` at a random position,
/// sides and corner on the `GRID` (or the image edge), inside the image. Its aspect is
/// random within 1:2..2:1 unless the image forces a longer box.
fn mask_box(rng: &mut Rng, ratio: f64, width: u32, height: u32) -> [u32; 4] {
    let (wf, hf) = (width as f64, height as f64);
    let area = ratio.clamp(0.0, 1.0) * wf * hf;
    // Nearest multiple of GRID, at least one cell, at most the image side.
    let snap = |v: f64, max: u32| {
        let s = ((v / GRID as f64).round() as u32).saturating_mul(GRID);
        s.clamp(GRID.min(max), max)
    };
    let aspect = (rng.unit() * 2.0 - 1.0) * std::f64::consts::LN_2;
    let mut w = snap((area * aspect.exp()).sqrt(), width);
    let h = snap(area / w as f64, height);
    if h == height {
        // Too tall for the image: take its full height and widen instead.
        w = snap(area / hf, width);
    }
    // Corners on the grid too, and the box inside the image.
    let x = rng.below((width - w) as u64 / GRID as u64 + 1) as u32 * GRID;
    let y = rng.below((height - h) as u64 / GRID as u64 + 1) as u32 * GRID;
    [x, y, w, h]
}

/// Nearest-rank percentile (`p` in 0..=100) of ascending `sorted`: the smallest value
/// with at least `p`% of the values at or below it. None when empty.
fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    let rank = (p * n as f64 / 100.0).ceil() as usize;
    sorted.get(rank.clamp(1, n.max(1)) - 1).copied()
}

fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (s, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

/// A deterministic template image: gradients and a checkerboard whose phase varies with
/// `k`, so templates differ.
fn synthetic_png(width: usize, height: usize, k: usize) -> CliResult<Vec<u8>> {
    Ok(encode_png(&synthetic(width, height, k))?)
}

/// An upload no client sent before (`--repeat-rate`): a synthetic image with `n`
/// written into its first two pixels.
fn one_off_png(width: usize, height: usize, n: u64) -> CliResult<Vec<u8>> {
    let mut img = synthetic(width, height, (n % 4) as usize);
    for (d, b) in img.data.iter_mut().zip(n.to_le_bytes().iter().take(6)) {
        *d = *b;
    }
    Ok(encode_png(&img)?)
}

fn synthetic(width: usize, height: usize, k: usize) -> Rgb8 {
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            let check = ((x + 3 * k) / 8 + y / 8) % 2 == 0;
            data.push((x * 255 / width.max(2)) as u8);
            data.push((y * 255 / height.max(2)) as u8);
            data.push(if check { 200 } else { 40 } ^ (k as u8 * 37));
        }
    }
    Rgb8 {
        width,
        height,
        data,
    }
}

/// Mask ratios from a trace file: one number a line, others skipped, clamped to [0, 1].
fn read_trace(path: &PathBuf) -> CliResult<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Vec<f64> = text
        .lines()
        .filter_map(|l| l.trim().parse::<f64>().ok())
        .filter(|r| r.is_finite())
        .map(|r| r.clamp(0.0, 1.0))
        .collect();
    if v.is_empty() {
        return Err(format!("{}: no mask ratios in it", path.display()).into());
    }
    Ok(v)
}

/// The fields of a template's description that we use.
#[derive(Deserialize)]
struct TemplateInfo {
    id: String,
    width: u32,
    height: u32,
}

/// One successful edit: the fields of the server's reply that we use (the image is
/// skipped), and the latency we measured.
#[derive(Deserialize)]
struct Sample {
    #[serde(skip)]
    latency_s: f64,
    mask_ratio: f64,
    timings: ServerTimings,
    batch: Batch,
    /// An upload's template that made itself (`[templates] auto`).
    auto_template: Option<AutoTemplate>,
}

#[derive(Deserialize)]
struct AutoTemplate {
    hit: bool,
    captured: bool,
}

#[derive(Deserialize)]
struct ServerTimings {
    queue_s: f64,
    preprocess_s: f64,
    denoise_s: f64,
    postprocess_s: f64,
}

#[derive(Deserialize)]
struct Batch {
    sizes: Vec<u32>,
}

/// The HTTP side: base URL, client, optional token.
struct Api {
    base: String,
    client: reqwest::Client,
    token: Option<String>,
}

impl Api {
    /// GET `path`, or POST `body` to it; a non-2xx status becomes `Err` with the API's
    /// error code and message.
    async fn call(&self, path: &str, body: Option<&Value>) -> Result<String, String> {
        let url = format!("{}{path}", self.base);
        let mut r = match body {
            Some(b) => self.client.post(url).json(b),
            None => self.client.get(url),
        };
        if let Some(t) = &self.token {
            r = r.bearer_auth(t);
        }
        let resp = r.send().await.map_err(|e| {
            // reqwest's message leaves out the cause (refused, reset, timed out...).
            let mut msg = format!("request failed: {e}");
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                msg += &format!(": {c}");
                cause = c.source();
            }
            msg
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| format!("reading reply: {e}"))?;
        if status.is_success() {
            return Ok(text);
        }
        let v = serde_json::from_str::<Value>(&text).unwrap_or_default();
        let msg = match (v["error"]["code"].as_str(), v["error"]["message"].as_str()) {
            (Some(code), Some(message)) => format!("{code}: {message}"),
            _ => text.chars().take(200).collect(),
        };
        Err(format!("HTTP {}: {msg}", status.as_u16()))
    }

    /// Polls `/readyz` until it answers 200, or fails after `READY_TIMEOUT`.
    async fn wait_ready(&self) -> CliResult {
        let t0 = Instant::now();
        loop {
            let last = match self.call("/readyz", None).await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if t0.elapsed() > READY_TIMEOUT {
                let base = &self.base;
                return Err(format!("daemon at {base} not ready after 120 s ({last})").into());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Registers the template `body` describes, or reuses it when its id exists (409).
    async fn template(&self, body: Value) -> CliResult<TemplateInfo> {
        let id = body["id"].as_str().unwrap_or_default();
        let text = match self.call("/v1/templates", Some(&body)).await {
            Ok(t) => Ok(t),
            Err(e) if e.starts_with("HTTP 409") => {
                self.call(&format!("/v1/templates/{id}"), None).await
            }
            Err(e) => Err(e),
        };
        let info = text.and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()));
        Ok(info.map_err(|e| format!("template {id}: {e}"))?)
    }
}

pub fn run(a: Args) -> CliResult {
    if !(a.rps.is_finite() && a.rps > 0.0) {
        return Err("--rps must be a positive number".into());
    }
    if a.templates == 0 {
        return Err("--templates must be at least 1".into());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(a))
}

async fn bench(a: Args) -> CliResult {
    let ratios = match &a.mask_trace {
        Some(p) => read_trace(p)?,
        None => vec![a.mask_ratio.clamp(0.0, 1.0)],
    };
    let api = Arc::new(Api {
        base: a.url.trim_end_matches('/').to_string(),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(a.timeout))
            .build()?,
        token: a.token.clone(),
    });
    eprintln!("bench serve: waiting for {}/readyz", api.base);
    api.wait_ready().await?;

    // Templates are registered before the clock starts: capture is a full run.
    let file_image = a.image.as_ref().map(std::fs::read).transpose()?;
    let mut templates = Vec::new();
    let mut rng = Rng(a.seed);
    if let Some(rate) = a.repeat_rate {
        let plan = uploads(&a, rate, &ratios, file_image.as_deref(), &mut rng)?;
        return run_plan(&a, &api, plan, 0).await;
    }
    for k in 0..a.templates {
        let image = match &file_image {
            Some(b) => b.clone(),
            None => synthetic_png(a.width, a.height, k)?,
        };
        // Ids name what the template is: a daemon keeps templates across restarts
        // (its disk tier), and one registered by another run is reused only when it
        // is the same template.
        let source = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            image.hash(&mut h);
            h.finish() as u32
        };
        let body = json!({
            "id": format!(
                "bench-{k}-s{}-seed{}-{source:08x}",
                a.steps,
                a.seed.wrapping_add(k as u64)
            ),
            "image": base64::engine::general_purpose::STANDARD.encode(image),
            "steps": a.steps,
            "seed": a.seed.wrapping_add(k as u64),
        });
        let t = api.template(body).await?;
        eprintln!("bench serve: template {} ({}x{})", t.id, t.width, t.height);
        templates.push(t);
    }

    // The whole workload is drawn up front, so the timing loop only sleeps and spawns.
    let times = planned_arrivals(&a, &mut rng)?;
    // Each planned request: (arrival time in s, requested mask ratio, body).
    let plan: Vec<(f64, f64, Value)> = times
        .iter()
        .map(|&t| {
            let tpl = &templates[rng.below(templates.len() as u64) as usize];
            let ratio = ratios[rng.below(ratios.len() as u64) as usize];
            let body = json!({
                "template_id": tpl.id,
                "boxes": [mask_box(&mut rng, ratio, tpl.width, tpl.height)],
                "prompt": a.prompt,
                "seed": rng.next_u64() >> 12,
            });
            (t, ratio, body)
        })
        .collect();
    run_plan(&a, &api, plan, templates.len()).await
}

/// The arrival times of `a`'s workload (seconds from the start).
fn planned_arrivals(a: &Args, rng: &mut Rng) -> CliResult<Vec<f64>> {
    let times = arrivals(rng, a.rps, a.requests, a.duration);
    if times.is_empty() {
        return Err("no request arrives within --duration at this --rps".into());
    }
    Ok(times)
}

/// `--repeat-rate`'s workload: each edit uploads one of `a.templates` popular images
/// with probability `rate`, else a one-off, with a box of a drawn ratio.
fn uploads(
    a: &Args,
    rate: f64,
    ratios: &[f64],
    file_image: Option<&[u8]>,
    rng: &mut Rng,
) -> CliResult<Vec<(f64, f64, Value)>> {
    if !(0.0..=1.0).contains(&rate) {
        return Err("--repeat-rate is a fraction, 0 to 1".into());
    }
    let (w, h) = (a.width, a.height);
    let popular: Vec<Vec<u8>> = (0..a.templates.max(1))
        .map(|k| match (k, file_image) {
            (0, Some(b)) => Ok(b.to_vec()),
            _ => synthetic_png(w, h, k),
        })
        .collect::<CliResult<_>>()?;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let popular: Vec<String> = popular.iter().map(|p| b64(p)).collect();
    let times = planned_arrivals(a, rng)?;
    let mut plan = Vec::with_capacity(times.len());
    for (i, t) in times.into_iter().enumerate() {
        let image = match rng.unit() < rate {
            true => popular[rng.below(popular.len() as u64) as usize].clone(),
            // Unique to this run and request: the seed keeps runs apart.
            false => b64(&one_off_png(w, h, (a.seed << 32) | i as u64)?),
        };
        let ratio = ratios[rng.below(ratios.len() as u64) as usize];
        let body = json!({
            "image": image,
            "boxes": [mask_box(rng, ratio, w as u32, h as u32)],
            "prompt": a.prompt,
            "steps": a.steps,
            "seed": rng.next_u64() >> 12,
        });
        plan.push((t, ratio, body));
    }
    Ok(plan)
}

/// Sends `plan` and reports on it (`templates`: how many were registered for it).
async fn run_plan(
    a: &Args,
    api: &Arc<Api>,
    plan: Vec<(f64, f64, Value)>,
    templates: usize,
) -> CliResult {
    // The realised offered rate: arrivals over the window they were drawn in.
    let last = plan.last().map_or(0.0, |p| p.0);
    let window = match a.duration {
        Some(d) if a.requests.is_none_or(|n| plan.len() < n) => d,
        _ => last,
    };
    let offered_rps = plan.len() as f64 / window;

    let outcomes = dispatch(api, &plan, a.concurrency_limit).await?;
    let first_arrival = plan[0].0;
    let last_done = outcomes.iter().map(|o| o.0).fold(first_arrival, f64::max);
    let duration_s = last_done - first_arrival;
    // Refused for overload (429) is the server protecting its latency, not a failure:
    // counted apart, with how fast the refusals came.
    let (mut ok, mut errors, mut rejected) = (Vec::new(), Vec::new(), Vec::new());
    for (_, latency_s, r) in outcomes {
        match r {
            Ok(s) => ok.push(s),
            Err(e) if e.starts_with("HTTP 429") => rejected.push(latency_s),
            Err(e) => errors.push(e),
        }
    }
    rejected.sort_by(f64::total_cmp);

    let mut lat: Vec<f64> = ok.iter().map(|s| s.latency_s).collect();
    lat.sort_by(f64::total_cmp);
    let mut queue: Vec<f64> = ok.iter().map(|s| s.timings.queue_s).collect();
    queue.sort_by(f64::total_cmp);
    // The wait for a denoise worker and the run on it: what `denoised bench simulate` models.
    let mut on_denoise: Vec<f64> = ok
        .iter()
        .map(|s| s.timings.queue_s + s.timings.denoise_s)
        .collect();
    on_denoise.sort_by(f64::total_cmp);
    // Every denoising step of every request, counted at the batch size it ran in.
    let mut hist = BTreeMap::<u32, u64>::new();
    for s in ok.iter().flat_map(|s| &s.batch.sizes) {
        *hist.entry(*s).or_default() += 1;
    }
    let steps: u64 = hist.values().sum();
    let batch_mean = (steps > 0)
        .then(|| hist.iter().map(|(&b, &n)| b as f64 * n as f64).sum::<f64>() / steps as f64);
    let batch_hist: serde_json::Map<_, _> = hist
        .iter()
        .map(|(b, n)| (b.to_string(), json!(n)))
        .collect();
    let report = json!({
        "url": api.base,
        "rps": a.rps,
        "requests": plan.len(),
        "ok": ok.len(),
        "errors": errors.len(),
        "rejected": rejected.len(),
        "rejected_p95_s": percentile(&rejected, 95.0),
        "duration_s": duration_s,
        "throughput_rps": ok.len() as f64 / duration_s,
        "offered_rps": offered_rps,
        "mean_s": mean(lat.iter().copied()),
        "p50_s": percentile(&lat, 50.0),
        "p95_s": percentile(&lat, 95.0),
        "p99_s": percentile(&lat, 99.0),
        "max_s": lat.last(),
        "queue_mean_s": mean(queue.iter().copied()),
        "queue_p95_s": percentile(&queue, 95.0),
        "queue_denoise_mean_s": mean(on_denoise.iter().copied()),
        "queue_denoise_p95_s": percentile(&on_denoise, 95.0),
        "preprocess_mean_s": mean(ok.iter().map(|s| s.timings.preprocess_s)),
        "denoise_mean_s": mean(ok.iter().map(|s| s.timings.denoise_s)),
        "postprocess_mean_s": mean(ok.iter().map(|s| s.timings.postprocess_s)),
        "batch_mean": batch_mean,
        "batch_hist": batch_hist,
        "mask_ratio_mean": mean(ok.iter().map(|s| s.mask_ratio)),
        "requested_mask_ratio_mean": mean(plan.iter().map(|p| p.1)),
        "templates": templates,
        "repeat_rate": a.repeat_rate,
        "auto_hits": ok.iter().filter(|s| s.auto_template.as_ref().is_some_and(|t| t.hit)).count(),
        "auto_captured": ok.iter().filter(|s| s.auto_template.as_ref().is_some_and(|t| t.captured)).count(),
        "auto_misses": ok.iter().filter(|s| s.auto_template.as_ref().is_some_and(|t| !t.hit && !t.captured)).count(),
        "steps": a.steps,
        "mask_trace": a.mask_trace.as_ref().map(|p| p.display().to_string()),
    });

    print_human(&report, &hist, &errors);
    if a.json {
        println!("{report}");
    }
    if ok.is_empty() {
        return Err(format!("none of the {} requests succeeded", plan.len()).into());
    }
    Ok(())
}

/// What one request came to: when it finished (seconds from the start), its latency,
/// and its reply.
type Outcome = (f64, f64, Result<Sample, String>);

/// The open loop: sleeps until each planned arrival and spawns its request then, so
/// a slow response never delays later arrivals (only `limit`, when given, does).
async fn dispatch(
    api: &Arc<Api>,
    plan: &[(f64, f64, Value)],
    limit: Option<usize>,
) -> CliResult<Vec<Outcome>> {
    let pb = ProgressBar::new(plan.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} done {msg}")?
            .progress_chars("=> "),
    );
    let limit = limit.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(plan.len());
    for (t, _, body) in plan.iter().cloned() {
        tokio::time::sleep_until((start + Duration::from_secs_f64(t)).into()).await;
        let permit = match &limit {
            Some(s) => Some(s.clone().acquire_owned().await?),
            None => None,
        };
        let (api, pb) = (Arc::clone(api), pb.clone());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let r = api.call("/v1/edits", Some(&body)).await;
            let latency_s = sent.elapsed().as_secs_f64();
            drop(permit);
            pb.inc(1);
            let result = r.and_then(|text| {
                serde_json::from_str::<Sample>(&text)
                    .map(|s| Sample { latency_s, ..s })
                    .map_err(|e| format!("malformed edit reply: {e}"))
            });
            (start.elapsed().as_secs_f64(), latency_s, result)
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await?);
    }
    pb.finish_and_clear();
    Ok(outcomes)
}

/// The report for people, on stderr, with the first few distinct error messages.
fn print_human(r: &Value, hist: &BTreeMap<u32, u64>, errors: &[String]) {
    let line = |head: &str, keys: &str| {
        let parts: Vec<String> = (keys.split_whitespace())
            .map(|k| match &r[k] {
                Value::Number(n) if n.is_f64() => format!("{k} {:.3}", n.as_f64().unwrap()),
                v => format!("{k} {v}"),
            })
            .collect();
        eprintln!("{head}: {}", parts.join("  "));
    };
    line(
        "load",
        "requests ok errors rejected duration_s throughput_rps offered_rps",
    );
    line("latency", "mean_s p50_s p95_s p99_s max_s");
    line(
        "server",
        "queue_mean_s queue_p95_s preprocess_mean_s denoise_mean_s",
    );
    line(
        "server",
        "postprocess_mean_s mask_ratio_mean requested_mask_ratio_mean",
    );
    line("batch", "batch_mean");
    eprintln!("batch size: request-steps {hist:?}");
    if !r["repeat_rate"].is_null() {
        line("uploads", "repeat_rate auto_hits auto_captured auto_misses");
    }
    let mut seen: Vec<&String> = Vec::new();
    for e in errors {
        if !seen.contains(&e) && seen.len() < 5 {
            seen.push(e);
            eprintln!("error: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_repeat_popular_images_at_the_rate_and_never_repeat_one_offs() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let cli = Cli::parse_from(["x", "--requests", "400", "--rps", "100", "--templates", "3"]);
        let plan = uploads(&cli.a, 0.7, &[0.2], None, &mut Rng(5)).unwrap();
        let images: Vec<&str> = plan
            .iter()
            .map(|p| p.2["image"].as_str().unwrap())
            .collect();
        let mut seen = std::collections::HashMap::<&str, usize>::new();
        for i in &images {
            *seen.entry(i).or_default() += 1;
        }
        let repeated: usize = seen.values().filter(|&&n| n > 1).sum();
        // Three popular images; every other image is sent once.
        assert_eq!(seen.values().filter(|&&n| n > 1).count(), 3);
        let rate = repeated as f64 / images.len() as f64;
        assert!((rate - 0.7).abs() < 0.07, "repeat rate {rate}");
    }

    #[test]
    fn percentile_matches_brute_force() {
        let mut rng = Rng(7);
        for n in 1..60 {
            let mut v: Vec<f64> = (0..n).map(|_| rng.below(20) as f64).collect();
            v.sort_by(f64::total_cmp);
            for p in [0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 90.0, 95.0, 99.0, 100.0] {
                // The definition: the smallest value with at least p% of them at or below.
                let covers = |x: f64| v.iter().filter(|&&y| y <= x).count() * 100;
                let brute = v
                    .iter()
                    .copied()
                    .find(|&x| covers(x) as f64 >= p * n as f64);
                assert_eq!(percentile(&v, p), brute, "n {n} p {p}");
            }
        }
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn poisson_mean_gap() {
        for rps in [0.5, 4.0, 100.0] {
            let t = arrivals(&mut Rng(42), rps, Some(20000), None);
            let gap = t.last().unwrap() / t.len() as f64;
            assert!(
                t.len() == 20000 && (gap * rps - 1.0).abs() < 0.05,
                "{rps}: {gap}"
            );
        }
        // A duration bound stops the arrivals, and they are increasing.
        let t = arrivals(&mut Rng(1), 10.0, None, Some(5.0));
        assert!(t.windows(2).all(|w| w[0] < w[1]) && *t.last().unwrap() <= 5.0);
        assert!((30..=70).contains(&t.len()), "{}", t.len());
    }

    #[test]
    fn boxes_cover_the_ratio_inside_the_image() {
        let mut rng = Rng(3);
        for _ in 0..5000 {
            // Some widths off the grid, to test the clamping to the image edge.
            let w = 16 * (1 + rng.below(64) as u32) + 5 * (rng.below(4) == 0) as u32;
            let h = 16 * (1 + rng.below(64) as u32);
            let ratio = rng.unit();
            let [x, y, bw, bh] = mask_box(&mut rng, ratio, w, h);
            let inside = bw > 0 && bh > 0 && x + bw <= w && y + bh <= h;
            assert!(
                inside && x % GRID == 0 && y % GRID == 0,
                "{w}x{h}: {x},{y} {bw}x{bh}"
            );
            // Rounding one side to the grid moves the area by at most half a row of cells.
            let tol = (w.max(h) * GRID / 2 + GRID * GRID) as f64;
            let err = (bw * bh) as f64 - ratio * w as f64 * h as f64;
            assert!(err.abs() <= tol, "{w}x{h} ratio {ratio}: {bw}x{bh}");
        }
    }
}
