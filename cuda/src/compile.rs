//! NVRTC compilation of the kernel modules, at first use, for the device's exact
//! architecture (`sm_90a` on an H100/H200), straight to CUBIN.
//!
//! Compiling on the serving machine means no toolkit at build time and no PTX-version
//! mismatch with the driver. Results are cached twice: in memory per (module, arch),
//! and on disk under `$DENOISED_KERNEL_CACHE` (default `~/.cache/denoised/kernels`),
//! keyed by a hash of the source, options and NVRTC version, so a restarted daemon
//! does not pay the ~1 s compile again.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys};

use crate::kernels::Module;
use crate::CudaError;

/// Options for every module. No fast-math: the f32 path must match the CPU reference
/// (exp2/tanh/rsqrt at full precision); the bf16 path is bandwidth- and MMA-bound.
const OPTIONS: &[&str] = &[
    "--std=c++17",
    "-default-device",
    "--extra-device-vectorization",
];

/// The architecture name NVRTC targets for compute capability `(major, minor)`. Hopper
/// gets the `a` variant so architecture-specific instructions are allowed.
pub fn arch_for(cc: (i32, i32)) -> String {
    let suffix = if cc.0 == 9 { "a" } else { "" };
    format!("sm_{}{}{suffix}", cc.0, cc.1)
}

/// Whether the NVRTC library can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoDevice("libnvrtc is not installed".into()));
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    unsafe { sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((a, b))
}

type Key = (&'static str, String);
fn memory_cache() -> &'static Mutex<HashMap<Key, Arc<Vec<u8>>>> {
    static C: OnceLock<Mutex<HashMap<Key, Arc<Vec<u8>>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn disk_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DENOISED_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(home.join("denoised").join("kernels"))
}

/// FNV-1a: a stable content hash for cache file names (not for security).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x100000001b3);
    }
    h
}

/// The CUBIN of `module` for `arch`, compiled on first use and cached.
pub fn cubin(module: &'static Module, arch: &str) -> Result<Arc<Vec<u8>>, CudaError> {
    let key = (module.name, arch.to_string());
    if let Some(c) = memory_cache().lock().unwrap().get(&key) {
        return Ok(c.clone());
    }
    let src = module.full_source();
    let ver = nvrtc_version()?;
    let hash = fnv(&[
        src.as_bytes(),
        arch.as_bytes(),
        OPTIONS.join(" ").as_bytes(),
        format!("{ver:?}").as_bytes(),
    ]);
    let file = disk_dir().map(|d| d.join(format!("{}-{arch}-{hash:016x}.cubin", module.name)));
    let bin = match file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        Some(b) if !b.is_empty() => b,
        _ => {
            let t = std::time::Instant::now();
            let b = compile(module.name, &src, arch)?;
            tracing::info!(
                "compiled {} for {arch} in {:.2} s ({} bytes)",
                module.name,
                t.elapsed().as_secs_f64(),
                b.len()
            );
            if let Some(f) = &file {
                // Best effort: a read-only home only costs a recompile next time.
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                let _ = std::fs::create_dir_all(f.parent().unwrap())
                    .and_then(|_| std::fs::write(&tmp, &b))
                    .and_then(|_| std::fs::rename(&tmp, f));
            }
            b
        }
    };
    let bin = Arc::new(bin);
    memory_cache().lock().unwrap().insert(key, bin.clone());
    Ok(bin)
}

/// One NVRTC compilation to CUBIN. Errors carry NVRTC's log.
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    compile_with(name, src, arch, &[]).map(|(bin, _)| bin)
}

/// ptxas's resource report of every kernel in `src` (`-v`): registers, shared memory,
/// stack frame, spills, one block of lines per function, as the program log has it.
pub fn ptxas_report(name: &str, src: &str, arch: &str) -> Result<String, CudaError> {
    compile_with(name, src, arch, &["--ptxas-options=-v"]).map(|(_, log)| log)
}

/// [`compile`] with `extra` options; also returns NVRTC's log.
fn compile_with(
    name: &str,
    src: &str,
    arch: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, String), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoDevice("libnvrtc is not installed".into()));
    }
    let csrc = CString::new(src).map_err(|_| CudaError::Driver("NUL in kernel source".into()))?;
    let cname = CString::new(name).unwrap();
    let prog = result::create_program(&csrc, Some(&cname))
        .map_err(|e| CudaError::Driver(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    opts.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program until destroyed at the end of this function.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = match result::get_program_log(prog) {
            Ok(l) if !l.is_empty() => CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned(),
            _ => String::new(),
        };
        let out = match compiled {
            Err(e) => Err(CudaError::Driver(format!(
                "NVRTC failed on {name} for {arch} ({e:?}):\n{log}"
            ))),
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| CudaError::Driver(format!("nvrtcGetCUBINSize: {e:?}")))?;
                let mut bin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _)
                    .result()
                    .map_err(|e| CudaError::Driver(format!("nvrtcGetCUBIN: {e:?}")))?;
                Ok((bin, log))
            }
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}
