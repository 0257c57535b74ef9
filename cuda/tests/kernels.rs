//! Every GPU-backend op against the CPU backend (`denoised_cuda::selfcheck`, which
//! states the tolerances), on two executors:
//! - the CPU emulator, always: the real kernel sources run on CPU threads (CI);
//! - a real GPU (`cuda:0`), when one is present; otherwise the test says why it skips.

use denoised_cuda::selfcheck::{assert_all_pass, kernels};
use denoised_cuda::{CudaExec, EmuExec, Exec};
use denoised_runtime::Error;

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn param_structs_match_cpp() {
    use denoised_cuda::params::*;
    use std::mem::size_of;
    let rust = [
        size_of::<EwParams>(),
        size_of::<LnModParams>(),
        size_of::<RmsRopeParams>(),
        size_of::<GatherParams>(),
        size_of::<TimestepParams>(),
        size_of::<AttnParams>(),
        size_of::<ImgParams>(),
    ];
    assert_eq!(rust, denoised_cuda::emu::param_sizes());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_kernels_match_cpu() {
    // With the stand-in convolution library, so that the backend's library path (what
    // cuDNN runs on a GPU: the shapes it is given, the bias and residual pass after)
    // and its im2col path (the chunked run) are both checked.
    let exec = EmuExec::default().with_conv_library();
    let checks = kernels(|| Ok(exec.clone())).unwrap();
    // 18 op checks per dtype, the fused LayerNorm (2) and the timestep embedding: a
    // check that stops running shows here.
    assert!(checks.len() >= 39, "only {} checks ran", checks.len());
    assert_all_pass(&checks);
    // Per dtype: 3 of the 5 geometries are the library's, each with and without a
    // residual; the VAE's upsample and asymmetric convolutions fell back.
    assert_eq!(exec.library_convs(), 2 * 3 * 2);
}

#[test]
fn gpu_kernels_match_cpu() {
    let exec = match CudaExec::new(0) {
        Ok(e) => e,
        Err(e) => {
            println!("skipping the GPU run: {e}");
            return;
        }
    };
    println!("on {}", exec.describe());
    let open = || CudaExec::new(0).map_err(|e| Error::Device(e.to_string()));
    assert_all_pass(&kernels(open).unwrap());
}
