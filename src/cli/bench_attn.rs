//! `denoised bench-attn`: times the masked-query attention op alone and prints its
//! TFLOP/s, one JSON line per mask ratio. This is the kernel behind every block of a
//! mask-aware edit: queries are the text plus the active image tokens; keys and values
//! are those fresh rows plus the template's cached rows of the inactive tokens, read
//! by index (no gather first).
//!
//! FLOPs counted: 4 * queries * keys * head_dim * heads (QK^T and PV, two per MAC),
//! the same count PyTorch SDPA benchmarks use, so the figures compare directly with
//! `benches/torch_reference.py attn` on the equivalent gathered (contiguous) problem.

use std::time::Instant;

use denoised_cuda::{Dt, GpuBackend};
use denoised_models::flux::weights::SplitMix;
use denoised_runtime::backend::{AttnSeq, KvSource, QSpan, Rows, Src};
use denoised_runtime::{Backend, CpuBackend, Tensor};

use super::{CliResult, DeviceArgs, Selected};

#[derive(clap::Args, Debug)]
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
}

pub fn run(a: Args) -> CliResult {
    if a.heads == 0 || a.head_dim == 0 || a.iters == 0 || a.image_tokens == 0 {
        return Err("--heads, --head-dim, --iters and --image-tokens must be positive".into());
    }
    if let Some(bad) = a.mask_ratio.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        return Err(format!("--mask-ratio {bad} is not in [0, 1]").into());
    }
    let lines = match a.device.select()? {
        Selected::Cpu => measure(&a, CpuBackend::new())?,
        Selected::Cuda(exec) => {
            let dt = if a.dtype == "f32" { Dt::F32 } else { Dt::Bf16 };
            exec.warm_up()?;
            measure(&a, GpuBackend::new(*exec, dt))?
        }
    };
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

fn random(rows: usize, cols: usize, rng: &mut SplitMix) -> Tensor {
    Tensor::new(
        [rows, cols],
        (0..rows * cols).map(|_| rng.normal()).collect(),
    )
    .expect("shape")
}

/// One JSON object per mask ratio.
pub fn measure<B: Backend>(a: &Args, be: B) -> CliResult<Vec<serde_json::Value>> {
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
        for _ in 0..a.iters {
            let t0 = Instant::now();
            be.attention(&mut [&mut fresh], 0, w, a.heads, &seqs)?;
            be.synchronize()?;
            ts.push(t0.elapsed().as_secs_f64());
        }
        ts.sort_by(|x, y| x.total_cmp(y));
        let median = ts[ts.len() / 2];
        let keys = q + inactive.len();
        let flops = 4.0 * q as f64 * keys as f64 * (a.head_dim * a.heads) as f64;
        lines.push(serde_json::json!({
            "mask_ratio": m, "queries": q, "keys": keys, "heads": a.heads, "head_dim": a.head_dim,
            "median_s": median, "min_s": ts[0], "tflops": flops / median / 1e12, "backend": be.name(),
        }));
    }
    Ok(lines)
}
