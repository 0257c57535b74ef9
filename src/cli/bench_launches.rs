//! `bench step --device emu --report-launches`: kernel launches per double block and per
//! single block of the transformer, counted by the emulator (docs/gpu.md, "The
//! emulator"). Launches cost a few microseconds each on a GPU whatever they do, so the
//! memory-bound passes are judged by how many a block takes.
//!
//! A full step of the named config is run with one and two double blocks (and one
//! single block), then with one double and two single blocks; the differences are one
//! block's launches, by kernel (GEMMs, cuBLASLt launches on a GPU, count as `gemm`).

use std::collections::BTreeMap;
use std::sync::Arc;

use denoised_cuda::emu::{count_shared, shared_counters};
use denoised_cuda::{Dt, EmuExec, GpuBackend};
use denoised_models::flux::edit::{step_batch_with, DeviceTemplates, Job, Mode};
use denoised_models::flux::weights::SplitMix;
use denoised_models::planner::prefix;
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::Backend;

use super::bench_step::random_inputs;
use super::CliResult;

/// Launches by kernel of one full step of `cfg` with `doubles` and `singles` blocks.
fn launches(
    cfg: &FluxConfig,
    doubles: usize,
    singles: usize,
    l: usize,
    t: usize,
) -> CliResult<BTreeMap<String, i64>> {
    let cfg = FluxConfig {
        num_layers: doubles,
        num_single_layers: singles,
        ..cfg.clone()
    };
    let model =
        FluxTransformer::seeded(GpuBackend::new(EmuExec::open()?, Dt::Bf16), cfg.clone(), 0)?;
    let inputs = random_inputs(&cfg, l, t, &mut SplitMix::new(1))?;
    let schedule = Arc::new(FlowMatchEuler::new(&Default::default(), 1, l)?);
    let mut job = Job::new(&model, &inputs, schedule, Mode::Full)?;
    count_shared(true);
    let ran = step_batch_with(
        &model,
        &mut [&mut job],
        &DeviceTemplates::new(),
        &prefix(doubles + singles, 0),
    )
    .and_then(|_| model.backend().synchronize());
    let counted = shared_counters();
    count_shared(false);
    ran?;
    Ok(counted
        .into_iter()
        .map(|c| (c.kernel, c.launches as i64))
        .collect())
}

/// One JSON line per block kind: its launches in all and by kernel.
pub fn per_block(cfg: &FluxConfig, l: usize, t: usize) -> CliResult<Vec<serde_json::Value>> {
    let base = launches(cfg, 1, 1, l, t)?;
    let mut lines = vec![];
    for (block, counted) in [
        ("double", launches(cfg, 2, 1, l, t)?),
        ("single", launches(cfg, 1, 2, l, t)?),
    ] {
        let mut by_kernel = BTreeMap::new();
        for (k, n) in &counted {
            let d = n - base.get(k).copied().unwrap_or(0);
            if d != 0 {
                by_kernel.insert(k.clone(), d);
            }
        }
        let total: i64 = by_kernel.values().sum();
        lines.push(serde_json::json!({
            "block": block, "launches": total, "by_kernel": by_kernel,
            "image_tokens": l, "text_tokens": t,
        }));
    }
    Ok(lines)
}
