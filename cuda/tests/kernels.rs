//! Every GPU-backend op against the CPU backend (`denoised_cuda::selfcheck`, which
//! states the tolerances), on two executors:
//! - the CPU emulator, always: the real kernel sources run on CPU threads (CI);
//! - a real GPU (`cuda:0`), when one is present; otherwise the test says why it skips.

use denoised_cuda::selfcheck::{assert_all_pass, kernels};
use denoised_cuda::{CudaExec, EmuExec, Exec};
use denoised_runtime::skip::{skip, Need};
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
        size_of::<EpilogueParams>(),
        size_of::<AttnPackParams>(),
        size_of::<TextAttnParams>(),
    ];
    assert_eq!(rust, denoised_cuda::emu::param_sizes());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn kernels_match_cpu_where_cublaslt_refuses() {
    // cuBLASLt on the first H100 refused outer-vector-scaled fp8 and some misaligned
    // biases and outputs: the backend then runs the GEMM bare into an aligned scratch
    // and applies scales, bias and GELU in a pass (`linear_epilogue_*`). The emulator
    // refusing the same forms puts every GEMM check through that path.
    let exec = EmuExec::default().with_cublaslt_limits();
    let checks = kernels(|| Ok(exec.clone())).unwrap();
    assert!(checks.len() >= 75, "only {} checks ran", checks.len());
    assert!(
        checks
            .iter()
            .any(|c| c.name.starts_with("fp8 linear+bias+gelu")),
        "the fp8 checks ran"
    );
    assert_all_pass(&checks);
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_kernels_match_cpu() {
    // With the stand-in convolution library, so that the backend's library path (what
    // cuDNN runs on a GPU: the shapes it is given, the bias and residual pass after)
    // and its im2col path (the chunked run) are both checked; likewise the stand-in
    // attention library (the views handed over in place, the pack and unpack of
    // gathered and fp8 rows) beside every one of our attention kernels.
    let exec = EmuExec::default()
        .with_conv_library()
        .with_attn_library(usize::MAX);
    let checks = kernels(|| Ok(exec.clone())).unwrap();
    // 18 op checks and 5 fp8-weight checks per dtype, 13 of the fused block passes per
    // dtype (both widths: 16-byte runs and the scalar fallback), the fused LayerNorm
    // (2) and the timestep embedding: a check that stops running shows here.
    assert!(checks.len() >= 75, "only {} checks ran", checks.len());
    // Fast accumulation over FLUX.1's longest sums, per channel and per tensor.
    for k in [3072, 15360] {
        let at_k = checks
            .iter()
            .filter(|c| c.name.starts_with(&format!("fp8 linear at K = {k}")));
        assert!(at_k.count() >= 2, "the fp8 checks at K = {k} ran");
    }
    let fused = checks
        .iter()
        .filter(|c| c.name.contains(" w45 ") || c.name.contains(" w96 "));
    assert_eq!(
        fused.count(),
        16,
        "the fused residual/LayerNorm checks at both widths"
    );
    assert_all_pass(&checks);
    // Per dtype: 3 of the 5 geometries are the library's, each with and without a
    // residual; the VAE's upsample and asymmetric convolutions fell back.
    assert_eq!(exec.library_convs(), 2 * 3 * 2);
    // The bf16 attention checks that ask for the library went to it: three head
    // geometries (2 x 64, 1 x 128, 3 x 16) of two sequences each with bf16 and fp8
    // caches, the in-place pair, and the 12 sequences of the many-caches check (the
    // default path).
    assert_eq!(exec.library_attention(), 3 * 2 * 2 + 2 + 12);
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn attention_falls_back_to_our_kernel_where_the_library_refuses() {
    // A library that takes at most 30 keys: the checks' sequences of 37 to 150 keys
    // are refused, each launch as a whole (before anything is written), and fa2w
    // runs them; the many-caches check's sequences of 14 to 20 keys it takes.
    let exec = EmuExec::default().with_attn_library(30);
    let checks = kernels(|| Ok(exec.clone())).unwrap();
    assert!(
        checks.iter().any(|c| c.name.contains("[Cudnn]")),
        "the library path was asked for"
    );
    assert_all_pass(&checks);
    assert_eq!(exec.library_attention(), 12);
}

#[test]
fn gpu_kernels_match_cpu() {
    let exec = match CudaExec::new(0) {
        Ok(e) => e,
        Err(e) => {
            skip("kernels::gpu_kernels_match_cpu", Need::Gpu, &e.to_string());
            return;
        }
    };
    println!("on {}", exec.describe());
    let open = || CudaExec::new(0).map_err(|e| Error::Device(e.to_string()));
    assert_all_pass(&kernels(open).unwrap());
}

/// The FlashAttention-2 kernels' shared-memory layout (swizzled rows, ldmatrix phases,
/// cp.async phases) is free of bank conflicts, counted as the hardware serves accesses
/// (emu.h); the first kernel, with its transposed V tile, is not (the counter works).
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn the_fa2_attention_kernel_has_no_bank_conflicts() {
    use denoised_cuda::emu::{count_shared, shared_counters};
    use denoised_cuda::{AttnKernel, Dt, GpuBackend};
    use denoised_runtime::backend::{AttnSeq, Backend, KvSource, QSpan, Rows, Src};
    use denoised_runtime::Tensor;

    let be = GpuBackend::new(EmuExec::default(), Dt::Bf16);
    let run = |heads: usize, hd: usize| {
        let w = heads * hd;
        // 70 query rows (a partial second tile), 70 own keys and 90 cached by index.
        let fresh: Vec<f32> = (0..70 * 3 * w)
            .map(|i| ((i * 7919) % 61) as f32 / 61.0 - 0.5)
            .collect();
        let cache: Vec<f32> = (0..120 * 2 * w)
            .map(|i| ((i * 104729) % 53) as f32 / 53.0 - 0.5)
            .collect();
        let mut q = be
            .upload(&Tensor::new([70, 3 * w], fresh).unwrap())
            .unwrap();
        let c = be
            .upload(&Tensor::new([120, 2 * w], cache).unwrap())
            .unwrap();
        let idx: Vec<u32> = (0..120).step_by(4).chain(1..61).map(|i| i as u32).collect();
        let seqs = [AttnSeq {
            q: vec![QSpan {
                buf: 0,
                rows: 0..70,
            }],
            kv: vec![
                KvSource {
                    src: Src::Own(0),
                    k_col: w,
                    v_col: 2 * w,
                    rows: Rows::Range(0..70),
                },
                KvSource {
                    src: Src::Ext(&c),
                    k_col: 0,
                    v_col: w,
                    rows: Rows::Index(&idx),
                },
            ],
        }];
        be.attention(&mut [&mut q], 0, w, heads, &seqs).unwrap();
    };
    let mut counted = vec![];
    for k in [AttnKernel::Fa2, AttnKernel::Fa2Wide, AttnKernel::Mma] {
        be.set_attn_kernel(k);
        count_shared(true);
        run(1, 128);
        run(2, 64);
        counted.extend(shared_counters());
        count_shared(false);
    }
    let of = |name: &str| {
        counted
            .iter()
            .find(|c| c.kernel == name)
            .unwrap_or_else(|| panic!("{name} did not run: {counted:?}"))
    };
    for name in [
        "attn_fa2_bf16_d128",
        "attn_fa2_bf16_d64",
        "attn_fa2w_bf16_d128",
        "attn_fa2w_bf16_d64",
    ] {
        let c = of(name);
        assert!(c.shared_accesses > 0, "{c:?}");
        assert_eq!(c.bank_conflicts, 0, "{c:?}");
        // 16-byte accesses only: 4 wavefronts each, the minimum.
        assert_eq!(c.wavefronts, 4 * c.shared_accesses, "{c:?}");
    }
    assert!(of("attn_mma_bf16_d128").bank_conflicts > 0, "{counted:?}");
}
