//! Compiles every kernel module with NVRTC for the architectures we serve on, to
//! CUBIN (so the inline PTX also goes through ptxas). Needs only libnvrtc, not a GPU:
//! CI installs it from PyPI (`nvidia-cuda-nvrtc`) and points LD_LIBRARY_PATH at it.
//! Where libnvrtc is absent the test says so and skips.

use denoised_cuda::compile::{compile, nvrtc_available, nvrtc_version, ptxas_report};
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

/// ptxas's report on the attention kernels (printed: registers, stack frame, spills),
/// and what must hold: the tensor-core kernels keep everything in registers (no spill
/// stores or loads, no stack frame: their parameter block is read where the launch put
/// it, `__grid_constant__`, not copied to local memory to be indexed).
#[test]
fn the_attention_kernels_neither_spill_nor_copy_their_parameters() {
    if !nvrtc_available() {
        skip(
            "nvrtc::the_attention_kernels_neither_spill_nor_copy_their_parameters",
            Need::Tool,
            "libnvrtc is not installed (set LD_LIBRARY_PATH to a CUDA 13 libnvrtc)",
        );
        return;
    }
    let m = MODULES.iter().find(|m| m.name == "attention.cu").unwrap();
    for arch in ["sm_80", "sm_90a"] {
        let log = ptxas_report(m.name, &m.full_source(), arch).unwrap();
        // Blocks of "Compiling entry function 'NAME'" ... "Function properties for
        // NAME" / "N bytes stack frame, N bytes spill stores, N bytes spill loads" /
        // "Used N registers ...".
        let mut checked = 0;
        for block in log.split("Compiling entry function").skip(1) {
            let name = block.split('\'').nth(1).unwrap_or("?");
            let props: String = block
                .lines()
                .filter(|l| l.contains("stack frame") || l.contains("Used "))
                .map(str::trim)
                .collect::<Vec<_>>()
                .join("; ");
            println!("  {arch} {name}: {props}");
            if name.starts_with("attn_fa2") {
                checked += 1;
                assert!(
                    props
                        .contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                    "{name} on {arch}: {props}"
                );
            }
        }
        assert_eq!(checked, 4, "the four FA2 kernels on {arch}:\n{log}");
    }
}
