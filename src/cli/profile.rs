//! `denoised profile`: measures a device's latency models for the planner (docs/design.md
//! §Planner) and writes the profile file `[denoise] profile` names.
//!
//! - **Compute**: steps over a grid of batch sizes and active-token shares (edits
//!   against a captured template, and full steps), each timed, then fitted as seconds
//!   against the step's FLOPs. The planner gives each block its FLOPs' share, so a
//!   step-level fit is the same linear model summed over blocks.
//! - **Loads**: one block's K/V slab of several sizes, from the host tier through the
//!   backend's template stream (on the CPU the loader thread, on a GPU the copy stream)
//!   and from the disk tier (an `O_DIRECT` read and its checksum, as the loader reads
//!   a template file), fitted as seconds against bytes.
//! - **Held out**: a mix of requests not in the grid, timed and compared with the
//!   fitted prediction.
//!
//! It prints one JSON line with the fits, R² and the held-out error.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use denoised_cuda::{Dt, GpuBackend};
use denoised_models::flux::cost::{forward_flops, StepShape};
use denoised_models::flux::edit::{step_batch_with, DeviceTemplates, Job, Mode};
use denoised_models::flux::plan::{plan_step, StepWork};
use denoised_models::flux::template::CacheMode;
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::planner::prefix;
use denoised_models::profile::{Fit, Profile, FORMAT, VERSION};
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::direct::DirectFile;
use denoised_runtime::{Backend, CpuBackend, DType, HostSlice, SlabShape};
use indicatif::{ProgressBar, ProgressStyle};

use super::bench_step::{capture, grid, random_inputs};
use super::{CliResult, DeviceArgs, Selected};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The transformer: a named config (flux-small, flux1-fill-dev, ...) or a diffusers
    /// directory (its `transformer/config.json`). Timing does not depend on the weights'
    /// values, so they are seeded.
    #[arg(long, default_value = "flux-small")]
    pub model: String,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Storage type on a GPU: bf16 or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dtype: String,
    /// Image tokens per request (a 1024x1024 FLUX image is 4096).
    #[arg(long, default_value_t = 1024)]
    pub image_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub text_tokens: usize,
    /// Batch sizes of the compute grid.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub batch: Vec<usize>,
    /// Active-token shares of the compute grid (1 is a full step).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.05,0.1,0.2,0.4,0.7,1.0"
    )]
    pub active: Vec<f64>,
    /// Timed runs per point (the median is fitted), after one warm-up.
    #[arg(long, default_value_t = 2)]
    pub iters: usize,
    /// Slab sizes of the load grid, MB.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32,64")]
    pub load_mb: Vec<usize>,
    /// Where the disk tier's test file is written.
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    pub disk_dir: PathBuf,
    /// The profile file to write.
    #[arg(long, default_value = "profile.json")]
    pub output: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn config_of(model: &str) -> CliResult<FluxConfig> {
    if let Some(c) = FluxConfig::named(model) {
        return Ok(c);
    }
    let dir = PathBuf::from(model);
    for p in [dir.join("transformer/config.json"), dir.join("config.json")] {
        if p.is_file() {
            return Ok(FluxConfig::from_file(&p)?);
        }
    }
    Err(format!(
        "`{model}` is neither a named config ({}) nor a diffusers directory",
        FluxConfig::NAMES.join(", ")
    )
    .into())
}

pub fn run(a: Args) -> CliResult {
    let cfg = config_of(&a.model)?;
    if a.batch.is_empty() || a.active.is_empty() || a.iters == 0 || a.image_tokens == 0 {
        return Err(
            "--batch, --active, --iters and --image-tokens must be non-empty and positive".into(),
        );
    }
    if let Some(bad) = a.active.iter().find(|r| !(0.0 < **r && **r <= 1.0)) {
        return Err(format!("--active {bad} is not in (0, 1]").into());
    }
    let line = match a.device.select()? {
        Selected::Cpu => measure(&a, cfg, CpuBackend::new(), DType::F32)?,
        Selected::Cuda(exec) => {
            exec.warm_up()?;
            let dt = if a.dtype == "f32" { Dt::F32 } else { Dt::Bf16 };
            let be = GpuBackend::new(*exec, dt);
            let storage = be.storage_dtype();
            measure(&a, cfg, be, storage)?
        }
    };
    println!("{line}");
    Ok(())
}

fn progress(n: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} profiling [{bar:30}] {pos}/{len} {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn measure<B: Backend>(
    a: &Args,
    cfg: FluxConfig,
    backend: B,
    storage: DType,
) -> CliResult<serde_json::Value>
where
    B::Tensor: Send + Sync,
{
    let device = backend.name();
    let model = FluxTransformer::seeded(backend, cfg.clone(), a.seed)?;
    let (l, t) = (a.image_tokens, a.text_tokens);
    let (rows, cols) = grid(l);
    let inputs = random_inputs(&cfg, l, t, &mut SplitMix::new(a.seed ^ 0x9f0f))?;
    let schedule = Arc::new(FlowMatchEuler::new(&Default::default(), 1, l)?);
    let cache = capture(&model, &inputs, &schedule, storage, CacheMode::Kv)?;
    let all_cached = prefix(model.num_blocks(), 0);
    let slabs = DeviceTemplates::resident(model.backend(), &[&cache])?;

    // Times one step of requests with these active shares (median of `iters`).
    let mut mask_seed = a.seed;
    let mut time = |shares: &[f64]| -> CliResult<(f64, Vec<StepShape>)> {
        let jobs_of = |seed: &mut u64| -> CliResult<Vec<Job<B::Tensor>>> {
            shares
                .iter()
                .map(|&r| {
                    *seed += 1;
                    let mode = if r >= 1.0 {
                        Mode::Full
                    } else {
                        let n = ((r * l as f64).round() as usize).max(1);
                        Mode::Edit {
                            mask: Arc::new(TokenMask::random_blobs(rows, cols, n, *seed)),
                            cache: cache.clone(),
                        }
                    };
                    Ok(Job::new(&model, &inputs, schedule.clone(), mode)?)
                })
                .collect()
        };
        let mut ts = vec![];
        let mut shapes = vec![];
        for i in 0..=a.iters {
            let mut jobs = jobs_of(&mut mask_seed)?;
            shapes = jobs.iter().map(Job::shape).collect();
            let t0 = Instant::now();
            let mut refs = jobs.iter_mut().collect::<Vec<_>>();
            step_batch_with(&model, &mut refs, &slabs, &all_cached)?;
            model.backend().synchronize()?;
            if i > 0 {
                ts.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok((median(ts), shapes))
    };

    let points: Vec<(usize, f64)> = a
        .batch
        .iter()
        .flat_map(|&b| a.active.iter().map(move |&r| (b, r)))
        .collect();
    let pb = progress(points.len() + 2 * a.load_mb.len() + 1);
    let (mut flops, mut secs) = (vec![], vec![]);
    for &(b, r) in &points {
        pb.set_message(format!("compute: batch {b}, active {r}"));
        let (s, shapes) = time(&vec![r; b])?;
        flops.push(shapes.iter().map(|x| forward_flops(&cfg, *x)).sum::<f64>());
        secs.push(s);
        pb.inc(1);
    }
    let compute = Fit::least_squares(&flops, &secs)?;

    let sizes: Vec<usize> = a.load_mb.iter().map(|mb| mb << 20).collect();
    pb.set_message("loads: host");
    let load_host = fit_loads(
        &sizes,
        a.iters,
        |bytes| load_host(model.backend(), bytes, storage),
        &pb,
    )?;
    pb.set_message("loads: disk");
    let disk = DiskFile::create(&a.disk_dir, *sizes.iter().max().unwrap_or(&(1 << 20)))?;
    let mut buf = vec![];
    let load_disk = fit_loads(&sizes, a.iters, |bytes| disk.read(bytes, &mut buf), &pb)?;

    // A mix the grid did not contain.
    pb.set_message("held-out mix");
    let held_out = [0.13, 0.31, 0.07];
    let (measured, shapes) = time(&held_out)?;
    pb.inc(1);
    pb.finish_and_clear();
    let profile = Profile {
        format: FORMAT.into(),
        version: VERSION,
        device: device.clone(),
        model: a.model.clone(),
        compute,
        load_host,
        load_disk,
    };
    let work = StepWork {
        shapes: &shapes,
        recomputed: 0,
        loads: &[],
        mode: CacheMode::Kv,
    };
    let predicted = plan_step(&cfg, &profile, &work).latency;
    profile.write(&a.output)?;
    Ok(serde_json::json!({
        "profile": a.output, "device": device, "model": a.model,
        "image_tokens": l, "text_tokens": t, "points": points.len(),
        "compute_r2": compute.r2, "compute_gflops_per_s": 1e-9 / compute.slope_s,
        "compute_intercept_s": compute.intercept_s,
        "load_host_r2": load_host.r2, "load_host_gb_per_s": 1e-9 / load_host.slope_s,
        "load_disk_r2": load_disk.r2, "load_disk_gb_per_s": 1e-9 / load_disk.slope_s,
        "held_out_active": held_out, "held_out_measured_s": measured,
        "held_out_predicted_s": predicted,
        "held_out_error": (predicted - measured).abs() / measured,
    }))
}

/// Fits load time against bytes, timing `load(bytes)` (which returns seconds) for
/// each size.
fn fit_loads(
    sizes: &[usize],
    iters: usize,
    mut load: impl FnMut(usize) -> CliResult<f64>,
    pb: &ProgressBar,
) -> CliResult<Fit> {
    let (mut x, mut y) = (vec![], vec![]);
    for &bytes in sizes {
        load(bytes)?;
        let ts = (0..iters)
            .map(|_| load(bytes))
            .collect::<CliResult<Vec<_>>>()?;
        x.push(bytes as f64);
        y.push(median(ts));
        pb.inc(1);
    }
    Ok(Fit::least_squares(&x, &y)?)
}

/// Seconds to bring a slab of `bytes` (stored as `dtype`) from host memory to where
/// compute reads it, through the backend's own template stream (`stream_slabs`: on
/// the CPU the loader thread's copy into f32 staging, on a GPU the copy stream from
/// page-locked memory), its buffers warm.
fn load_host<B: Backend>(be: &B, bytes: usize, dtype: DType) -> CliResult<f64> {
    let src = HostSlice::zeroed(bytes)?;
    // Written, so reads touch real pages (untouched zeroed memory reads the kernel's
    // one zero page, from cache).
    // SAFETY: this slice is fresh and only this function holds it.
    unsafe { src.bytes_mut() }.fill(1);
    let slab = SlabShape {
        rows: 1,
        cols: bytes / dtype.size_bytes(),
        dtype,
        groups: 1,
    };
    let stream = be
        .stream_slabs(&src, &slab, 1, 1, 1)?
        .ok_or("this device cannot stream templates")?;
    let once = || -> CliResult<f64> {
        let t0 = Instant::now();
        stream.prepare(0, &[0])?;
        stream.slab(0, 0)?;
        be.synchronize()?;
        let s = t0.elapsed().as_secs_f64();
        stream.finish();
        Ok(s)
    };
    once()?;
    once()
}

/// A file of random bytes for the disk tier's load fit, read as the loader reads a
/// slab of a template file ([`DirectFile`]).
struct DiskFile {
    _dir: tempfile::TempDir,
    file: DirectFile,
}

impl DiskFile {
    fn create(parent: &std::path::Path, bytes: usize) -> CliResult<Self> {
        let dir = tempfile::Builder::new()
            .prefix("denoised-profile-")
            .tempdir_in(parent)?;
        let path = dir.path().join("slabs.bin");
        let mut f = std::fs::File::create(&path)?;
        let mut rng = SplitMix::new(7);
        let chunk: Vec<u8> = (0..1 << 20).map(|_| rng.next_u64() as u8).collect();
        for _ in 0..bytes.div_ceil(chunk.len()) {
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
        Ok(DiskFile {
            _dir: dir,
            file: DirectFile::open(&path)?,
        })
    }

    /// Seconds to read and checksum `bytes` from the start of the file, its pages
    /// dropped from the page cache first.
    fn read(&self, bytes: usize, dst: &mut Vec<u8>) -> CliResult<f64> {
        self.file.drop_page_cache()?;
        dst.resize(bytes, 0);
        let t0 = Instant::now();
        std::hint::black_box(self.file.read_crc(0, dst)?);
        Ok(t0.elapsed().as_secs_f64())
    }
}
