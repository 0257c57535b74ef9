//! `denoised bench step`: times transformer steps of a named config with seeded random
//! weights and prints one JSON line per measurement. Figures in docs/performance.md
//! come from here.
//!
//! Without `--mask-ratio` it times one full step. With mask ratios it first captures a
//! template (one full step, whose K/V stay in memory), then times, in the same run, the
//! full step and a mask-aware edit step at each ratio (a random irregular mask with
//! that share of tokens), and prints the measured speedup beside the FLOP bound
//! `(T+L)/(T+A)`. `--batch N` times N requests in one step, their masks drawn from
//! `--mask-trace` (or the first ratio). `--cache-mode kv,y` captures the template in
//! each mode and times the Y-mode edit against the KV-mode one in alternating runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use denoised_cuda::{Dt, Exec, GpuBackend};
use denoised_models::flux::cost::{flop_bound, forward_flops, StepShape};
use denoised_models::flux::edit::{
    step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode, SlabSource,
};
use denoised_models::flux::embed::image_ids;
use denoised_models::flux::plan::{plan_step, SlabLoad, StepWork};
use denoised_models::flux::template::{
    storage_dtype, storage_name, CacheMode, TemplateCache, TemplateLayout,
};
use denoised_models::flux::template_file::{self, SlabFile, TemplateMeta};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::{read_ratio_trace, TokenMask};
use denoised_models::planner::{prefix, Choice};
use denoised_models::profile::{Profile, Tier};
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::cpu::stream::{CpuStream, SlabRead};
use denoised_runtime::{Backend, CpuBackend, DType, HostSlice, Tensor};

use super::{emu_or_select, CliResult, DeviceArgs, Selected};

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
    /// Mask ratios (share of active image tokens) to time as mask-aware edits against
    /// a cached template, comma-separated; 1.0 alone times a plain full step.
    #[arg(long, value_delimiter = ',', default_value = "1.0")]
    pub mask_ratio: Vec<f64>,
    /// Requests per step. Each gets its own random mask.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Draw each request's mask ratio from this trace (one ratio per line) instead.
    #[arg(long)]
    pub mask_trace: Option<PathBuf>,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Seed of the random weights, inputs and masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Storage type on a GPU: bf16 (production) or f32 (the reference-matching mode).
    /// The CPU always computes in f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dtype: String,
    /// The transformer's large Linear weights: bf16 (the device dtype) or fp8 (E4M3;
    /// the CPU computes the fp8 reference).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp8"])]
    pub weight_dtype: String,
    /// With fp8 weights: `tensor` (one scale per weight and per GEMM input, applied
    /// inside cuBLASLt's GEMM) or `channel` (per output channel and per token).
    #[arg(long, default_value = "tensor", value_parser = ["tensor", "channel"])]
    pub fp8_scaling: String,
    /// Where edits read the template's K/V from: `memory` (resident on the device),
    /// `host` (streamed from host memory: on a GPU from pinned memory on the copy
    /// stream, on the CPU by a loader thread) or `disk` (a template file, page cache
    /// dropped before each run; the CPU only: a GPU worker reads templates from the
    /// host tier, where the cache process prefetches them).
    #[arg(long, default_value = "memory", value_parser = ["memory", "host", "disk"])]
    pub cache_tier: String,
    /// How a step outside the memory tier meets its loads, comma-separated: naive,
    /// pipelined, planner. Each is timed against the in-memory ideal.
    #[arg(long, value_delimiter = ',', default_value = "pipelined",
          value_parser = ["naive", "pipelined", "planner"])]
    pub plan: Vec<String>,
    /// Latency models for `--plan planner` (written by `denoised profile`); without
    /// it the planner uses the defaults.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Where the disk tier's template file is written (a temporary directory there).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    pub disk_dir: PathBuf,
    /// What the template caches, comma-separated: `kv` (K and V per block) and/or `y`
    /// (block outputs: half the bytes, the inactive tokens' K/V recomputed). With
    /// both, the Y-mode edit is also timed against the KV-mode one (`over_baseline`).
    #[arg(long, value_delimiter = ',', default_value = "kv", value_parser = ["kv", "y"])]
    pub cache_mode: Vec<String>,
    /// Storage dtypes of the template, comma-separated: f32, bf16, fp8 (E4M3 with a
    /// scale per head's K and V; KV mode only). Default: the device's own (f32 on the
    /// CPU, bf16 on a GPU). Every template after the first is also timed against the
    /// first in alternating runs (`over_baseline`).
    #[arg(long, value_delimiter = ',', value_parser = ["f32", "bf16", "fp8"])]
    pub cache_dtype: Vec<String>,
    /// With `--device emu`: instead of timing, count the kernel launches of one double
    /// block and one single block (docs/gpu.md, "The emulator").
    #[arg(long)]
    pub report_launches: bool,
    /// On a device (or the emulator): instead of timing, profile one step per
    /// `--mask-ratio` call by call and print its N most expensive kernels (GEMMs as
    /// `gemm`, cuDNN's attention as `sdpa`).
    #[arg(long, value_name = "N")]
    pub kernel_table: Option<usize>,
}

fn cache_mode(name: &str) -> CacheMode {
    if name == "y" {
        CacheMode::Y
    } else {
        CacheMode::Kv
    }
}

/// Random inputs of a request of `l` image and `t` text tokens for `cfg` (timing does
/// not depend on their values), on the most square grid of `l` tokens.
pub(super) fn random_inputs(
    cfg: &FluxConfig,
    l: usize,
    t: usize,
    rng: &mut SplitMix,
) -> CliResult<DenoiseInputs> {
    let (rows, cols) = grid(l);
    let c = cfg.out_channels();
    Ok(DenoiseInputs {
        latents: random(&[l, c], rng),
        cond: random(&[l, cfg.in_channels - c], rng),
        img_ids: Tensor::new([l, 3], image_ids(rows, cols))?,
        txt: random(&[t, cfg.joint_attention_dim], rng),
        txt_ids: Tensor::zeros([t, 3]),
        pooled: (0..cfg.pooled_projection_dim)
            .map(|_| rng.normal())
            .collect(),
        guidance: 30.0,
        reference: None,
    })
}

/// The template of a full step of `inputs`, captured on `model`'s device in `storage`
/// and `cache_mode`.
pub(super) fn capture<B: Backend>(
    model: &FluxTransformer<B>,
    inputs: &DenoiseInputs,
    schedule: &Arc<FlowMatchEuler>,
    storage: DType,
    cache_mode: CacheMode,
) -> CliResult<Arc<TemplateCache>>
where
    B::Tensor: Send + Sync,
{
    let l = inputs.tokens();
    let layout = TemplateLayout::for_model(&model.config, l, schedule.steps(), storage)
        .with_mode(cache_mode);
    let mode = Mode::Capture(TemplateCache::new(layout)?);
    let mut job = Job::new(model, inputs, schedule.clone(), mode)?;
    let plan = prefix(model.num_blocks(), 0);
    step_batch_with(model, &mut [&mut job], &DeviceTemplates::new(), &plan)?;
    Ok(Arc::new(
        job.finish(model)?.1.ok_or("capture returned no cache")?,
    ))
}

/// The most square `rows x cols` grid with `n` cells.
pub(super) fn grid(n: usize) -> (usize, usize) {
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

struct Timing {
    min: f64,
    median: f64,
    /// Median time compute waited for loads.
    bubble: f64,
}

/// Times `iters` runs of `run` on fresh jobs from `setup` (built outside the timed
/// region, as the serving loop uploads a request once when it is admitted), after one
/// warm-up. `run` returns its bubble.
fn time_steps<J>(
    iters: usize,
    mut setup: impl FnMut() -> CliResult<J>,
    mut run: impl FnMut(&mut J) -> CliResult<f64>,
) -> CliResult<Timing> {
    run(&mut setup()?)?;
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        samples.push(timed(&mut setup()?, &mut run)?);
    }
    Ok(timing(samples))
}

/// Times `run` against `ideal` in alternating runs (after a warm-up of each), so that
/// a drift of the machine's speed cancels out of their ratio. Returns both timings and
/// the median of the per-round ratios `run / ideal`.
fn time_paired<J>(
    iters: usize,
    mut setup: impl FnMut() -> CliResult<J>,
    mut ideal: impl FnMut(&mut J) -> CliResult<f64>,
    mut run: impl FnMut(&mut J) -> CliResult<f64>,
) -> CliResult<(Timing, Timing, f64)> {
    ideal(&mut setup()?)?;
    run(&mut setup()?)?;
    let (mut a, mut b, mut ratios) = (vec![], vec![], vec![]);
    for _ in 0..iters {
        a.push(timed(&mut setup()?, &mut ideal)?);
        b.push(timed(&mut setup()?, &mut run)?);
        ratios.push(b[b.len() - 1].0 / a[a.len() - 1].0);
    }
    ratios.sort_by(|x, y| x.total_cmp(y));
    Ok((timing(a), timing(b), ratios[ratios.len() / 2]))
}

/// One run's seconds and bubble.
fn timed<J>(jobs: &mut J, run: &mut impl FnMut(&mut J) -> CliResult<f64>) -> CliResult<(f64, f64)> {
    let t = Instant::now();
    let bubble = run(jobs)?;
    Ok((t.elapsed().as_secs_f64(), bubble))
}

fn timing(samples: Vec<(f64, f64)>) -> Timing {
    let (mut ts, mut bubbles): (Vec<f64>, Vec<f64>) = samples.into_iter().unzip();
    ts.sort_by(|a, b| a.total_cmp(b));
    bubbles.sort_by(|a, b| a.total_cmp(b));
    Timing {
        min: ts[0],
        median: ts[ts.len() / 2],
        bubble: bubbles[bubbles.len() / 2],
    }
}

/// One step of `jobs` reading `slabs` following `plan`; a device queues the step, so
/// the clock stops when it has run. Returns the bubble the slabs saw.
pub(super) fn step<B: Backend>(
    model: &FluxTransformer<B>,
    jobs: &mut [Job<B::Tensor>],
    slabs: &DeviceTemplates<B::Tensor>,
    plan: &[Choice],
) -> CliResult<f64>
where
    B::Tensor: Send + Sync,
{
    step_batch_with(model, &mut jobs.iter_mut().collect::<Vec<_>>(), slabs, plan)?;
    model.backend().synchronize()?;
    Ok(slabs.take_wait().map_or(0.0, |d| d.as_secs_f64()))
}

pub fn run(a: Args) -> CliResult {
    let cfg = FluxConfig::named(&a.config).ok_or_else(|| {
        format!(
            "unknown config `{}`; known: {}",
            a.config,
            FluxConfig::NAMES.join(", ")
        )
    })?;
    if a.image_tokens == 0 || a.iters == 0 || a.batch == 0 {
        return Err("--image-tokens, --iters and --batch must be positive".into());
    }
    if let Some(bad) = a.mask_ratio.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        return Err(format!("--mask-ratio {bad} is not in [0, 1]").into());
    }
    if a.cache_tier != "memory" && a.mask_trace.is_none() && a.mask_ratio.iter().all(|&r| r >= 1.0)
    {
        return Err(
            "--cache-tier host|disk times edits: give --mask-ratio below 1 or --mask-trace".into(),
        );
    }
    if a.report_launches {
        if a.device.device != denoised_cuda::DeviceSpec::Emu {
            return Err("--report-launches counts on the emulator: use --device emu".into());
        }
        for line in super::bench_launches::per_block(&cfg, a.image_tokens, a.text_tokens)? {
            println!("{line}");
        }
        return Ok(());
    }
    if let Some(top) = a.kernel_table {
        let lines = match emu_or_select(&a.device)? {
            None => super::bench_kernels::tables(&a, cfg, denoised_cuda::EmuExec::open()?, top)?,
            Some(Selected::Cuda(exec)) => {
                exec.warm_up()?;
                super::bench_kernels::tables(&a, cfg, *exec, top)?
            }
            Some(Selected::Cpu) => {
                return Err("--kernel-table profiles a device: use --device cuda:N or emu".into())
            }
        };
        for line in lines {
            println!("{line}");
        }
        return Ok(());
    }
    let lines = match emu_or_select(&a.device)? {
        None => measure_gpu(&a, cfg, denoised_cuda::EmuExec::open()?)?,
        Some(Selected::Cpu) => {
            // One template file per template (cache mode) the bench captures.
            let disk: std::cell::RefCell<Vec<(u64, Arc<DiskTier>)>> = Default::default();
            let disk_of = |cache: &TemplateCache| -> CliResult<Arc<DiskTier>> {
                let mut d = disk.borrow_mut();
                if let Some((_, t)) = d.iter().find(|(k, _)| *k == cache.key()) {
                    return Ok(t.clone());
                }
                let t = Arc::new(DiskTier::save(&a.disk_dir, cache, &a.config)?);
                d.push((cache.key(), t.clone()));
                Ok(t)
            };
            bench(
                &a,
                cfg,
                match fp8_weights(&a)? {
                    Some(s) => CpuBackend::new().with_fp8_weights(s),
                    None => CpuBackend::new(),
                },
                DType::F32,
                |be, cache, tier, whole| {
                    Ok(match (tier, whole) {
                        (Tier::Device, _) | (Tier::Host, true) => {
                            DeviceTemplates::resident(be, &[cache])?
                        }
                        (Tier::Host, false) => {
                            let mut t = DeviceTemplates::new();
                            t.stream(be, cache, a.batch)?;
                            t
                        }
                        (Tier::Disk, whole) => {
                            let d = disk_of(cache)?;
                            if whole {
                                let read = Arc::new(d.read(cache)?);
                                DeviceTemplates::resident(be, &[&read])?
                            } else {
                                d.stream(cache, a.batch)?
                            }
                        }
                    })
                },
            )?
        }
        Some(Selected::Cuda(exec)) => {
            // Compile (or load from the kernel cache) before timing anything.
            exec.warm_up()?;
            measure_gpu(&a, cfg, *exec)?
        }
    };
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// `--weight-dtype` and `--fp8-scaling`: fp8 weights and how they are scaled, or none.
pub(super) fn fp8_weights(a: &Args) -> CliResult<Option<denoised_runtime::fp8::Scaling>> {
    Ok(denoised_actors::device::parse_weight_dtype(
        &a.weight_dtype,
        &a.fp8_scaling,
    )?)
}

/// The measurements on a GPU backend over `exec` (a device, or the emulator for
/// `selftest --device emu`), one JSON object per line of output.

pub fn measure_gpu<E: Exec>(
    a: &Args,
    cfg: FluxConfig,
    exec: E,
) -> CliResult<Vec<serde_json::Value>> {
    let dt = if a.dtype == "f32" { Dt::F32 } else { Dt::Bf16 };
    let be = GpuBackend::new(exec, dt).with_fp8_weights(fp8_weights(a)?);
    let storage = be.storage_dtype();
    if a.cache_tier == "disk" {
        return Err("on a GPU the disk tier is read through the host tier (the cache process prefetches it): use --cache-tier host".into());
    }
    bench(a, cfg, be, storage, |be, cache, tier, whole| {
        if tier == Tier::Host && !whole {
            // One lane per request: every request may be at its own step. The slabs
            // stream from the template's host memory, page-locked.
            let mut t = DeviceTemplates::new();
            if !t.stream(be, cache, a.batch)? {
                return Err("this device cannot stream templates".into());
            }
            Ok(t)
        } else {
            // The template's K/V live in device memory during the timed steps, as for
            // a template that is hot in the device tier.
            Ok(DeviceTemplates::resident(be, &[cache])?)
        }
    })
}

fn tier_of(name: &str) -> Tier {
    match name {
        "host" => Tier::Host,
        "disk" => Tier::Disk,
        _ => Tier::Device,
    }
}

/// The disk tier of a bench: the template saved as a template file, streamed from it
/// by a loader thread (the CPU).
struct DiskTier {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl DiskTier {
    fn save(parent: &Path, cache: &TemplateCache, cfg_name: &str) -> CliResult<Self> {
        let dir = tempfile::Builder::new()
            .prefix("denoised-bench-")
            .tempdir_in(parent)?;
        let path = dir.path().join("template");
        let l = cache.layout();
        let meta = TemplateMeta {
            model: cfg_name.into(),
            height: 0,
            width: 0,
            steps: l.steps,
            guidance: 0.0,
            seed: 0,
            prompt: String::new(),
            adapters: String::new(),
        };
        template_file::save(&path, cache, &meta, l.dtype)?;
        Ok(DiskTier { _dir: dir, path })
    }

    /// `cache` (the template this file holds) streamed from the file, which must
    /// bypass the page cache: else every run after the first would read memory.
    fn stream(
        &self,
        cache: &Arc<TemplateCache>,
        lanes: usize,
    ) -> CliResult<DeviceTemplates<Tensor>> {
        let file = SlabFile::open(&self.path)?;
        if !file.file().is_direct() {
            return Err(format!(
                "{} does not allow O_DIRECT reads; give --disk-dir on a disk filesystem",
                self.path.display()
            )
            .into());
        }
        let l = *file.layout();
        let (slab, per_step) = (l.slab_shape(), l.slabs_per_step());
        let stream = CpuStream::new(Arc::new(file), &slab, l.steps, per_step, lanes)?;
        let mut t = DeviceTemplates::new();
        t.insert_streamed(cache, Box::new(stream), lanes);
        Ok(t)
    }

    /// Every slab of `cache` read from the file into host memory, through the
    /// reader the stream uses (O_DIRECT, checked), the latents taken from `cache`.
    fn read(&self, cache: &TemplateCache) -> CliResult<TemplateCache> {
        let file = SlabFile::open(&self.path)?;
        let l = *file.layout();
        let bytes = HostSlice::zeroed(l.total_bytes())?;
        // SAFETY: a fresh slice only this function holds.
        let out = unsafe { bytes.bytes_mut() };
        let slabs = l.latent_offset(0);
        for (i, slab) in out[..slabs].chunks_mut(l.slab_bytes()).enumerate() {
            file.read(i, slab)?;
        }
        out[slabs..].copy_from_slice(&cache.bytes().bytes()[slabs..]);
        Ok(TemplateCache::view(l, bytes)?.with_key(cache.key()))
    }
}

/// The measurements on one backend, whose templates are stored in `storage`.
/// `slabs_for(backend, template, tier, whole)` makes a captured template readable by
/// edits on that backend from `tier`: every slab loaded now (`whole`, resident) or
/// streamed during the steps.
fn bench<B: Backend>(
    a: &Args,
    cfg: FluxConfig,
    backend: B,
    storage: DType,
    slabs_for: impl Fn(&B, &Arc<TemplateCache>, Tier, bool) -> CliResult<DeviceTemplates<B::Tensor>>,
) -> CliResult<Vec<serde_json::Value>>
where
    B::Tensor: Send + Sync,
{
    let backend_name = backend.name();
    let model = FluxTransformer::seeded(backend, cfg.clone(), a.seed)?;
    let (l, t) = (a.image_tokens, a.text_tokens);
    let (rows, cols) = grid(l);
    let mut rng = SplitMix::new(a.seed ^ 0xbe4c);
    let inputs = random_inputs(&cfg, l, t, &mut rng)?;
    // One step of the real schedule at this resolution: timing does not depend on
    // which step it is, and a one-step template keeps the cache in memory small.
    let schedule = Arc::new(FlowMatchEuler::new(&Default::default(), 1, l)?);
    let batch = a.batch;
    let full_flops = forward_flops(&cfg, StepShape::full(t, l));
    let no_slabs = DeviceTemplates::<B::Tensor>::new();
    let full = time_steps(
        a.iters,
        || {
            Ok((0..batch)
                .map(|_| Job::new(&model, &inputs, schedule.clone(), Mode::Full))
                .collect::<Result<Vec<_>, _>>()?)
        },
        |jobs| {
            step(
                &model,
                jobs,
                &no_slabs,
                &prefix(cfg.num_layers + cfg.num_single_layers, 0),
            )
        },
    )?;
    let mut lines = Vec::new();
    let mut line = |ratio: serde_json::Value, tm: &Timing, flops: f64, extra: serde_json::Value| {
        let mut v = serde_json::json!({
            "config": a.config, "image_tokens": l, "text_tokens": t, "mask_ratio": ratio,
            "batch": batch, "min_s": tm.min, "median_s": tm.median, "gflops": flops / tm.median / 1e9,
            "backend": backend_name, "bubble_s": tm.bubble, "weight_dtype": a.weight_dtype,
        });
        if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        lines.push(v);
    };
    let masked_runs = a.mask_trace.is_some() || a.mask_ratio.iter().any(|&r| r < 1.0);
    if !masked_runs {
        line(
            1.0.into(),
            &full,
            batch as f64 * full_flops,
            serde_json::json!({}),
        );
        return Ok(lines);
    }

    // The template in each cache mode and dtype asked for, read from device memory.
    let dtypes = match a.cache_dtype.is_empty() {
        true => vec![storage],
        false => a
            .cache_dtype
            .iter()
            .map(|n| storage_dtype(n))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let mut templates = vec![];
    for name in &a.cache_mode {
        for &dt in &dtypes {
            let label = format!("{name}/{}", storage_name(dt));
            if let Err(e) = TemplateLayout::for_model(&cfg, l, 1, dt)
                .with_mode(cache_mode(name))
                .check()
            {
                eprintln!("skipping {label}: {e}");
                continue;
            }
            let cache = capture(&model, &inputs, &schedule, dt, cache_mode(name))?;
            let slabs = slabs_for(model.backend(), &cache, Tier::Device, true)?;
            templates.push((label, cache, slabs));
        }
    }
    let tier = tier_of(&a.cache_tier);
    let profile = match &a.profile {
        Some(p) => Profile::read(p)?,
        None => Profile::defaults(&model.backend().name()),
    };
    let trace = a.mask_trace.as_ref().map(read_ratio_trace).transpose()?;
    let ratio_sets: Vec<Vec<f64>> = match &trace {
        Some(tr) => vec![(0..batch)
            .map(|_| tr[rng.next_u64() as usize % tr.len()])
            .collect()],
        None => a.mask_ratio.iter().map(|&r| vec![r; batch]).collect(),
    };
    let all_cached = prefix(model.num_blocks(), 0);
    for ratios in ratio_sets {
        let masks: Vec<Arc<TokenMask>> = ratios
            .iter()
            .map(|&r| {
                Arc::new(TokenMask::random_blobs(
                    rows,
                    cols,
                    (r * l as f64).round() as usize,
                    rng.next_u64(),
                ))
            })
            .collect();
        let shapes: Vec<StepShape> = masks
            .iter()
            .map(|m| StepShape {
                text: t,
                active: m.active().len(),
                image: l,
            })
            .collect();
        let flops: f64 = shapes.iter().map(|s| forward_flops(&cfg, *s)).sum();
        let edits_of = |cache: &Arc<TemplateCache>| -> CliResult<Vec<Job<B::Tensor>>> {
            Ok(masks
                .iter()
                .map(|m| {
                    let mode = Mode::Edit {
                        mask: m.clone(),
                        cache: cache.clone(),
                    };
                    Job::new(&model, &inputs, schedule.clone(), mode)
                })
                .collect::<Result<Vec<_>, _>>()?)
        };
        let ratio_field = if trace.is_some() {
            serde_json::json!(ratios)
        } else {
            serde_json::json!(ratios[0])
        };
        let (base_label, base_cache, base_slabs) = &templates[0];
        for (ti, (label, cache, slabs)) in templates.iter().enumerate() {
            let edits = || edits_of(cache);
            let tm = time_steps(a.iters, edits, |jobs| {
                step(&model, jobs, slabs, &all_cached)
            })?;
            let bound = batch as f64 * full_flops / flops;
            let speedup = full.median / tm.median;
            let token_ratio =
                shapes.iter().map(|s| s.active as f64).sum::<f64>() / (batch * l) as f64;
            let single_bound = (batch == 1).then(|| flop_bound(&cfg, shapes[0]));
            let lay = cache.layout();
            let mut extra = serde_json::json!({
                "token_ratio": token_ratio,
                "full_median_s": full.median,
                "speedup": speedup,
                "flop_bound": single_bound.unwrap_or(bound),
                "fraction_of_bound": speedup / bound,
                "cache_tier": "memory",
                "cache": label,
                "cache_bytes_per_step": lay.cache_bytes_per_step(),
            });
            // Against the first template, in alternating runs.
            if ti > 0 {
                let (base_t, _, ratio) = time_paired(
                    a.iters,
                    || Ok((edits_of(base_cache)?, edits()?)),
                    |(b, _)| step(&model, b, base_slabs, &all_cached),
                    |(_, e)| step(&model, e, slabs, &all_cached),
                )?;
                extra["baseline"] = base_label.as_str().into();
                extra["baseline_median_s"] = base_t.median.into();
                extra["over_baseline"] = (ratio - 1.0).into();
                extra["bytes_vs_baseline"] = (lay.cache_bytes_per_step() as f64
                    / base_cache.layout().cache_bytes_per_step() as f64)
                    .into();
            }
            line(ratio_field.clone(), &tm, flops, extra);
            if tier == Tier::Device {
                continue;
            }
            // The same edits with the template on another tier, each plan's runs
            // alternating with runs of the ideal.
            let loads = [SlabLoad {
                tier,
                bytes: lay.slab_bytes(),
                mode: lay.mode,
            }];
            let ideal = |jobs: &mut Vec<Job<B::Tensor>>| step(&model, jobs, slabs, &all_cached);
            // The load alone: one step's slabs brought from the tier to where compute
            // reads them, with no compute to hide behind.
            let load_step_s = {
                let streamed = slabs_for(model.backend(), cache, tier, false)?;
                let blocks: Vec<usize> = (0..lay.slabs_per_step()).collect();
                let mut ts = vec![];
                for _ in 0..=a.iters {
                    let t0 = Instant::now();
                    streamed.prepare(cache, 0, &blocks)?;
                    for &b in &blocks {
                        streamed.slab(cache, 0, b)?;
                    }
                    model.backend().synchronize()?;
                    streamed.finish();
                    ts.push(t0.elapsed().as_secs_f64());
                }
                ts.remove(0); // warm-up
                ts.sort_by(|x, y| x.total_cmp(y));
                ts[ts.len() / 2]
            };
            for plan in &a.plan {
                let ((ideal_t, out, ratio), full_blocks, predicted) = match plan.as_str() {
                    "naive" => {
                        // Load the step's slabs, then compute: compute waits for all of it.
                        let out = time_paired(a.iters, edits, ideal, |jobs| {
                            let t0 = Instant::now();
                            let resident = slabs_for(model.backend(), cache, tier, true)?;
                            model.backend().synchronize()?;
                            let load = t0.elapsed().as_secs_f64();
                            step(&model, jobs, &resident, &all_cached)?;
                            Ok(load)
                        })?;
                        (out, 0, None)
                    }
                    p => {
                        let work = StepWork {
                            shapes: &shapes,
                            recomputed: match lay.mode {
                                CacheMode::Y => shapes.iter().map(|s| s.image - s.active).sum(),
                                CacheMode::Kv => 0,
                            },
                            loads: &loads,
                            mode: lay.mode,
                        };
                        let planned = plan_step(&cfg, &profile, &work);
                        let choices = if p == "planner" {
                            planned.choices.clone()
                        } else {
                            all_cached.clone()
                        };
                        // One stream for every run, as a worker keeps it: its buffers
                        // are warm. The disk tier's reads bypass the page cache
                        // (O_DIRECT), so every run reads the disk.
                        let streamed = slabs_for(model.backend(), cache, tier, false)?;
                        let out = time_paired(a.iters, edits, ideal, |jobs| {
                            step(&model, jobs, &streamed, &choices)
                        })?;
                        let full = choices.iter().filter(|&&c| c == Choice::Full).count();
                        (out, full, (p == "planner").then_some(planned.latency))
                    }
                };
                line(
                    ratio_field.clone(),
                    &out,
                    flops,
                    serde_json::json!({
                        "cache_tier": a.cache_tier,
                        "cache": label,
                        "load_step_s": load_step_s,
                        "plan": plan,
                        "full_blocks": full_blocks,
                        "predicted_s": predicted,
                        "ideal_median_s": ideal_t.median,
                        "over_ideal": ratio - 1.0,
                    }),
                );
            }
        }
    }
    Ok(lines)
}
