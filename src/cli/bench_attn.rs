//! `denoised bench attn`: times the masked-query attention op alone and prints its
//! TFLOP/s, one JSON line per mask ratio. This is the kernel behind every block of a
//! mask-aware edit: queries are the text plus the active image tokens; keys and values
//! are those fresh rows plus the template's cached rows of the inactive tokens, read
//! by index (no gather first).
//!
//! FLOPs counted: 4 * queries * keys * head_dim * heads (QK^T and PV, two per MAC),
//! the same count PyTorch SDPA benchmarks use, so the figures compare directly with
//! `benches/torch_reference.py attn` on the equivalent gathered (contiguous) problem.

use std::time::Instant;

use denoised_cuda::{AttnKernel, DeviceSpec, Dt, EmuExec, Exec, GpuBackend};
use denoised_models::flux::weights::SplitMix;
use denoised_runtime::backend::{AttnSeq, KvSource, QSpan, Rows, Src};
use denoised_runtime::{Backend, CpuBackend, Tensor};

use super::{emu_or_select, CliResult, DeviceArgs, Selected};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Attention heads (FLUX.1: 24).
    #[arg(long, default_value_t = 24)]
    pub heads: usize,
    /// Head dimension (FLUX.1: 128).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Text tokens (always queries).
    #[arg(long, default_value_t = 512)]
    pub text_tokens: usize,
    /// Image tokens (4096 = 1024x1024 pixels).
    #[arg(long, default_value_t = 4096)]
    pub image_tokens: usize,
    /// Shares of active image tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.2,0.4,1.0")]
    pub mask_ratio: Vec<f64>,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Storage type on a GPU (bf16 uses the tensor-core kernel for head dims 64/128).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dtype: String,
    /// Attention paths to time, comma-separated, one after the other on the same
    /// device: cudnn (the default: the executor's fused-attention library, cuDNN's SDPA
    /// on a GPU, with fa2w where it refuses a shape), fa2w (our kernel: 128-row blocks,
    /// 32 rows a warp), fa2 (64-row blocks) and mma (the first version). Each line says
    /// which path ran (`path`: `library` or `ours`).
    #[arg(long, value_delimiter = ',', default_value = "cudnn,fa2w", value_parser = AttnKernel::NAMES)]
    pub kernel: Vec<String>,
    /// With `--device emu`: count every kernel's shared-memory accesses and bank
    /// conflicts as the hardware would serve them, and its launches; one JSON line per
    /// kernel (timings on the emulator mean nothing, so none are printed).
    #[arg(long)]
    pub report_conflicts: bool,
}

fn kernel_of(name: &str) -> AttnKernel {
    AttnKernel::named(name).expect("clap checked the name")
}

pub fn run(a: Args) -> CliResult {
    if a.heads == 0 || a.head_dim == 0 || a.iters == 0 || a.image_tokens == 0 {
        return Err("--heads, --head-dim, --iters and --image-tokens must be positive".into());
    }
    if let Some(bad) = a.mask_ratio.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        return Err(format!("--mask-ratio {bad} is not in [0, 1]").into());
    }
    let dt = if a.dtype == "f32" { Dt::F32 } else { Dt::Bf16 };
    if a.report_conflicts {
        if a.device.device != DeviceSpec::Emu {
            return Err("--report-conflicts counts on the emulator: use --device emu".into());
        }
        for line in conflicts(&a, GpuBackend::new(EmuExec::open()?, dt))? {
            println!("{line}");
        }
        return Ok(());
    }
    let lines = match emu_or_select(&a.device)? {
        Some(Selected::Cpu) => measure(&a, &CpuBackend::new(), &|f| {
            f()?;
            Ok(None)
        })?,
        Some(Selected::Cuda(exec)) => {
            exec.warm_up()?;
            each_kernel(&a, &GpuBackend::new(*exec, dt))?
        }
        None => each_kernel(&a, &GpuBackend::new(EmuExec::open()?, dt))?,
    };
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// Every asked tensor-core kernel on the same device, one after the other.
fn each_kernel<E: Exec>(a: &Args, be: &GpuBackend<E>) -> CliResult<Vec<serde_json::Value>> {
    let mut lines = vec![];
    for k in &a.kernel {
        be.set_attn_kernel(kernel_of(k));
        let before = be.attention_launches();
        for mut l in measure(a, be, &|f| be.gpu_seconds(f))? {
            l["kernel"] = k.as_str().into();
            lines.push(l);
        }
        // Which path ran: the library where it took every launch, else ours (it is
        // absent, or refused the shapes: the log says why).
        let after = be.attention_launches();
        let path = if after.1 == before.1 {
            "library"
        } else {
            "ours"
        };
        for l in lines.iter_mut().filter(|l| l["kernel"] == k.as_str()) {
            l["path"] = path.into();
            l["attention"] = be.attention_path().into();
        }
    }
    be.set_attn_kernel(AttnKernel::from_env());
    Ok(lines)
}

/// Each asked kernel once per mask ratio on the emulator, with the shared-memory
/// counters on: one line per kernel that ran.
fn conflicts<E: Exec>(a: &Args, be: GpuBackend<E>) -> CliResult<Vec<serde_json::Value>> {
    use denoised_cuda::emu;
    let once = Args {
        iters: 1,
        ..a.clone()
    };
    let mut lines = vec![];
    for k in &a.kernel {
        be.set_attn_kernel(kernel_of(k));
        emu::count_shared(true);
        measure(&once, &be, &|f| be.gpu_seconds(f))?;
        let counted = emu::shared_counters();
        emu::count_shared(false);
        for c in counted {
            lines.push(serde_json::json!({
                "kernel": c.kernel, "launches": c.launches, "shared_accesses": c.shared_accesses,
                "wavefronts": c.wavefronts, "bank_conflicts": c.bank_conflicts,
                "mask_ratio": a.mask_ratio, "heads": a.heads, "head_dim": a.head_dim,
            }));
        }
    }
    Ok(lines)
}

/// GPU time of the work a closure queues (CUDA events), or `None` without a GPU clock.
pub type GpuClock<'a> = &'a dyn Fn(
    &mut dyn FnMut() -> denoised_runtime::Result<()>,
) -> denoised_runtime::Result<Option<f64>>;

fn random(rows: usize, cols: usize, rng: &mut SplitMix) -> Tensor {
    Tensor::new(
        [rows, cols],
        (0..rows * cols).map(|_| rng.normal()).collect(),
    )
    .expect("shape")
}

/// One JSON object per mask ratio.
/// Measures with `gpu_seconds` where it gives a time (CUDA events), else the wall
/// clock around the op and a synchronise.
pub fn measure<B: Backend>(
    a: &Args,
    be: &B,
    gpu_seconds: GpuClock,
) -> CliResult<Vec<serde_json::Value>> {
    let mut lines = Vec::new();
    let (t, l, w) = (a.text_tokens, a.image_tokens, a.heads * a.head_dim);
    let mut rng = SplitMix::new(17);
    let cache = be.upload(&random(l, 2 * w, &mut rng))?;
    for &m in &a.mask_ratio {
        let active = ((m * l as f64).round() as usize).min(l);
        // Spread the active tokens over the grid, as a mask would.
        let is_active = |i: usize| (i * active) / l != ((i + 1) * active) / l;
        let inactive: Vec<u32> = (0..l)
            .filter(|&i| !is_active(i))
            .map(|i| i as u32)
            .collect();
        let q = t + active;
        let mut fresh = be.upload(&random(q, 3 * w, &mut rng))?;
        let seqs = [AttnSeq {
            q: vec![QSpan { buf: 0, rows: 0..q }],
            kv: vec![
                KvSource {
                    src: Src::Own(0),
                    k_col: w,
                    v_col: 2 * w,
                    rows: Rows::Range(0..q),
                },
                KvSource {
                    src: Src::Ext(&cache),
                    k_col: 0,
                    v_col: w,
                    rows: Rows::Index(&inactive),
                },
            ],
        }];
        // Outputs overwrite the queries, so later iterations attend with the previous
        // output as queries: same shapes and cost, bounded values.
        be.attention(&mut [&mut fresh], 0, w, a.heads, &seqs)?;
        be.synchronize()?;
        let mut ts = Vec::with_capacity(a.iters);
        let mut clock = "wall";
        for _ in 0..a.iters {
            let t0 = Instant::now();
            let gpu = gpu_seconds(&mut || be.attention(&mut [&mut fresh], 0, w, a.heads, &seqs))?;
            be.synchronize()?;
            ts.push(match gpu {
                Some(s) => {
                    clock = "device events";
                    s
                }
                None => t0.elapsed().as_secs_f64(),
            });
        }
        ts.sort_by(|x, y| x.total_cmp(y));
        let median = ts[ts.len() / 2];
        let keys = q + inactive.len();
        let flops = 4.0 * q as f64 * keys as f64 * (a.head_dim * a.heads) as f64;
        lines.push(serde_json::json!({
            "mask_ratio": m, "queries": q, "keys": keys, "heads": a.heads, "head_dim": a.head_dim,
            "median_s": median, "min_s": ts[0], "tflops": flops / median / 1e12, "backend": be.name(), "clock": clock,
        }));
    }
    Ok(lines)
}
