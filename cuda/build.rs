//! Builds the kernels for the CPU emulator (emu/emu.h) into a static library, so tests
//! run the real kernel sources on machines without a GPU. The GPU path does not use
//! this: it compiles the same sources with NVRTC at run time (src/compile.rs).
//!
//! The emulator's fiber switch is x86-64 assembly, so elsewhere (e.g. an aarch64
//! Grace Hopper host) the library is built without it and `EmuExec` reports itself
//! unavailable; the real GPU path does not depend on it.
fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo::rustc-check-cfg=cfg(denoised_emu)");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return;
    }
    println!("cargo:rustc-cfg=denoised_emu");
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
