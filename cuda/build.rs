//! Builds the kernels for the CPU emulator (emu/emu.h) into a static library, so tests
//! run the real kernel sources on machines without a GPU. The GPU path does not use
//! this: it compiles the same sources with NVRTC at run time (src/compile.rs).
fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=emu");
    cc::Build::new()
        .cpp(true)
        .file("emu/all.cpp")
        .include("emu")
        .std("c++20")
        .define("DENOISED_EMU", None)
        .flag("-fno-strict-aliasing")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("denoised_kernels_emu");
}
