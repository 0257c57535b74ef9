//! Compiles every kernel module with NVRTC for the architectures we serve on, to
//! CUBIN (so the inline PTX also goes through ptxas). Needs only libnvrtc, not a GPU:
//! CI installs it from PyPI (`nvidia-cuda-nvrtc`) and points LD_LIBRARY_PATH at it.
//! Where libnvrtc is absent the test says so and skips.

use denoised_cuda::compile::{compile, nvrtc_available, nvrtc_version};
use denoised_cuda::kernels::MODULES;
use denoised_runtime::skip::{skip, Need};

#[test]
fn every_module_compiles_for_ampere_and_hopper() {
    if !nvrtc_available() {
        skip(
            "nvrtc::every_module_compiles_for_ampere_and_hopper",
            Need::Tool,
            "libnvrtc is not installed (set LD_LIBRARY_PATH to a CUDA 13 libnvrtc)",
        );
        return;
    }
    println!("NVRTC {:?}", nvrtc_version().unwrap());
    for arch in ["sm_80", "sm_90a"] {
        for m in MODULES {
            let bin = compile(m.name, &m.full_source(), arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
            // An ELF CUBIN that defines every kernel the module lists.
            assert_eq!(&bin[..4], b"\x7fELF", "{} for {arch}", m.name);
            for k in m.kernels {
                assert!(
                    bin.windows(k.len()).any(|w| w == k.as_bytes()),
                    "{k} missing from the {arch} CUBIN of {}",
                    m.name
                );
            }
            println!("  {} {arch}: {} bytes", m.name, bin.len());
        }
    }
}
