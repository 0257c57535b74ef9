//! `denoised devices`: what this machine can compute on.

use denoised_cuda::{CudaExec, Dt, GpuBackend};
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
                println!("  attention: {}", attention(g.ordinal));
            }
        }
        Err(e) => println!("cuda: {e}"),
    }
    match denoised_cuda::cudnn_library() {
        Ok(v) => println!("cudnn: {v}"),
        Err(why) => {
            println!("cudnn: {why} (convolutions on im2col + cuBLASLt, attention on our kernel)")
        }
    }
    Ok(())
}

/// What runs bf16 attention on GPU `ordinal` (the library if it plans FLUX.1's full
/// step, else our kernel, and why).
fn attention(ordinal: usize) -> String {
    match CudaExec::new(ordinal) {
        Ok(exec) => GpuBackend::new(exec, Dt::Bf16).attention_at_flux(),
        Err(e) => format!("unknown ({e})"),
    }
}
