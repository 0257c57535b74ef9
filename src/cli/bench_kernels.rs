//! `bench step --kernel-table N`: where a step's device time goes, kernel by kernel: one
//! full step and one edit step per `--mask-ratio` (against a template captured first),
//! each timed call by call through [`Profiled`] (two timing events around every
//! launch, GEMM and library call), the top N by time. For the one-shot GPU run, whose
//! machines have no Nsight Systems (docs/gpu.md); on the emulator the times are the host
//! clock's and only the shape of the table means anything.

use std::sync::Arc;

use denoised_cuda::{Dt, Exec, GpuBackend, Profiled};
use denoised_models::flux::edit::{DeviceTemplates, Job, Mode};
use denoised_models::flux::template::CacheMode;
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::planner::prefix;
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::Backend;

use super::bench_step::{capture, grid, random_inputs, step, Args};
use super::CliResult;

/// One JSON object per mask ratio: the step's profiled calls by kernel, the top `top`.
pub fn tables<E: Exec>(
    a: &Args,
    cfg: FluxConfig,
    exec: E,
    top: usize,
) -> CliResult<Vec<serde_json::Value>> {
    let dt = if a.dtype == "f32" { Dt::F32 } else { Dt::Bf16 };
    let be = GpuBackend::new(Profiled::new(exec), dt)
        .with_fp8_weights(super::bench_step::fp8_weights(a)?);
    let storage = be.storage_dtype();
    let model = FluxTransformer::seeded(be, cfg.clone(), a.seed)?;
    let (l, t) = (a.image_tokens, a.text_tokens);
    let (rows, cols) = grid(l);
    let mut rng = SplitMix::new(a.seed ^ 0x6b7e);
    let inputs = random_inputs(&cfg, l, t, &mut rng)?;
    let schedule = Arc::new(FlowMatchEuler::new(&Default::default(), 1, l)?);
    let plan = prefix(model.num_blocks(), 0);
    let cache = match a.mask_ratio.iter().any(|&r| r < 1.0) {
        true => Some(capture(&model, &inputs, &schedule, storage, CacheMode::Kv)?),
        false => None,
    };
    let slabs = match &cache {
        Some(c) => DeviceTemplates::resident(model.backend(), &[c])?,
        None => DeviceTemplates::new(),
    };
    let profiler = model.backend().exec().clone();
    let mut out = Vec::new();
    for &ratio in &a.mask_ratio {
        let active = (ratio * l as f64).round() as usize;
        let mode = || match &cache {
            Some(c) if ratio < 1.0 => Mode::Edit {
                mask: Arc::new(TokenMask::random_blobs(rows, cols, active, a.seed)),
                cache: c.clone(),
            },
            _ => Mode::Full,
        };
        // A warm-up (plans, workspace), then the profiled step.
        step(
            &model,
            &mut [Job::new(&model, &inputs, schedule.clone(), mode())?],
            &slabs,
            &plan,
        )?;
        let mut jobs = [Job::new(&model, &inputs, schedule.clone(), mode())?];
        profiler.start();
        step(&model, &mut jobs, &slabs, &plan)?;
        let times = profiler.stop()?;
        let total: f64 = times.iter().map(|k| k.ms).sum();
        let kernels: Vec<serde_json::Value> = times
            .iter()
            .take(top)
            .map(|k| {
                serde_json::json!({
                    "name": k.name, "calls": k.calls, "ms": k.ms, "share": k.ms / total.max(1e-12),
                })
            })
            .collect();
        out.push(serde_json::json!({
            "what": "kernel_table", "config": a.config, "mask_ratio": ratio,
            "image_tokens": l, "text_tokens": t, "backend": model.backend().name(),
            "kernels_ms": total, "calls": times.iter().map(|k| k.calls).sum::<usize>(),
            "distinct": times.len(), "kernels": kernels,
        }));
    }
    Ok(out)
}
