//! `denoised devices`: what this machine can compute on.

use denoised_runtime::{Backend, CpuBackend};

use super::CliResult;

pub fn run() -> CliResult {
    println!("cpu: {}", CpuBackend::new().name());
    match denoised_cuda::probe() {
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "cuda:{}: {} (sm_{}{}, {:.1} GiB)",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.memory_bytes as f64 / (1u64 << 30) as f64
                );
            }
        }
        Err(e) => println!("cuda: {e}"),
    }
    Ok(())
}
