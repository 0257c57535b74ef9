//! Device selection: `device = "auto" | "cpu" | "emu" | "cuda:N"` (config key and
//! `--device`); the daemon also takes a list, `cuda:0,1` (one denoise worker per GPU).
//!
//! `auto` takes the first CUDA device when one is usable and otherwise falls back to the
//! CPU, saying so in one log line; an explicit `cuda:N` that cannot be satisfied is an
//! error, because an operator who asked for a GPU must not silently get a CPU. `emu` is
//! the GPU backend on the CPU emulator ([`crate::EmuExec`]): every GPU code path, run
//! slowly, for tests and development on machines without a GPU.

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{sys, CudaContext};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// A library has no algorithm for this operation as asked: cuBLASLt for a GEMM
    /// (its epilogue, scale mode or alignment: the backend runs it bare and applies
    /// the rest itself), cuDNN for an attention shape (our kernel runs it).
    #[error("unsupported by the library: {0}")]
    Unsupported(String),
    #[error("invalid device `{0}`: expected auto, cpu, emu or cuda:N")]
    BadSpec(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    /// The GPU backend on the CPU emulator (tests, development).
    Emu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self, CudaError> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "emu" => Ok(DeviceSpec::Emu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| CudaError::BadSpec(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Emu => write!(f, "emu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What a detected GPU is.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
}

/// The outcome of resolving a [`DeviceSpec`].
#[derive(Clone, Debug, PartialEq)]
pub enum Resolved {
    Cpu,
    Emu,
    Cuda(GpuInfo),
}

fn driver_err(e: impl fmt::Debug) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Lists usable CUDA devices. Errors with [`CudaError::NoDevice`] when the driver
/// library is absent or reports no device.
pub fn probe() -> Result<Vec<GpuInfo>, CudaError> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDevice(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::NoDevice(format!("driver initialisation failed: {e:?}")))?;
    if count <= 0 {
        return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
    }
    (0..count as usize)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
            let attr = |a| ctx.attribute(a).map_err(driver_err);
            use sys::CUdevice_attribute::*;
            let cc = (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            let memory_bytes = cudarc::driver::result::mem_get_info()
                .map(|(_, total)| total)
                .unwrap_or(0);
            Ok(GpuInfo {
                ordinal,
                name: ctx.name().map_err(driver_err)?,
                compute_capability: cc,
                memory_bytes,
            })
        })
        .collect()
}

/// Resolves a device spec against what this machine has. `auto` never fails: without
/// a usable GPU it returns the CPU and logs why, once.
pub fn resolve(spec: DeviceSpec) -> Result<Resolved, CudaError> {
    match spec {
        DeviceSpec::Cpu => Ok(Resolved::Cpu),
        DeviceSpec::Emu => crate::EmuExec::open().map(|_| Resolved::Emu),
        DeviceSpec::Cuda(n) => {
            let gpus = probe()?;
            let count = gpus.len();
            gpus.into_iter()
                .find(|g| g.ordinal == n)
                .map(Resolved::Cuda)
                .ok_or_else(|| {
                    CudaError::NoDevice(format!(
                        "cuda:{n} requested but only {count} device(s) present"
                    ))
                })
        }
        DeviceSpec::Auto => match probe() {
            Ok(mut gpus) => Ok(Resolved::Cuda(gpus.remove(0))),
            Err(e) => {
                tracing::info!("device auto: using the CPU ({e})");
                Ok(Resolved::Cpu)
            }
        },
    }
}

/// The CUDA driver errors after which a context cannot be used again ("sticky"
/// errors: every later call fails the same way), by their `CUresult` names as driver
/// error messages carry them. Out of memory and invalid arguments are not among them.
const STICKY: [&str; 9] = [
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_ASSERT",
];

/// Whether a driver error message reports a sticky error.
pub fn is_sticky(message: &str) -> bool {
    STICKY.iter().any(|s| message.contains(s))
}

/// Parses a device list: one spec, or GPUs as `cuda:0,1` / `cuda:0,cuda:1`.
pub fn parse_list(s: &str) -> Result<Vec<DeviceSpec>, CudaError> {
    let bad = || CudaError::BadSpec(s.to_string());
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() == 1 {
        return Ok(vec![parts[0].parse()?]);
    }
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let n = p.strip_prefix("cuda:").unwrap_or(p);
        out.push(DeviceSpec::Cuda(n.parse().map_err(|_| bad())?));
    }
    let mut sorted = out.clone();
    sorted.sort_by_key(|d| d.to_string());
    sorted.dedup();
    if sorted.len() != out.len() {
        return Err(bad());
    }
    Ok(out)
}

/// Resolves a device list for the daemon: `auto` is every usable GPU (the CPU
/// without one, said once in the log); explicit GPUs must all be present.
pub fn resolve_list(specs: &[DeviceSpec]) -> Result<Vec<Resolved>, CudaError> {
    if specs == [DeviceSpec::Auto] {
        return Ok(match probe() {
            Ok(gpus) => {
                tracing::info!(
                    "device auto: {} GPU(s) found, one denoise worker each",
                    gpus.len()
                );
                gpus.into_iter().map(Resolved::Cuda).collect()
            }
            Err(e) => {
                tracing::info!("device auto: using the CPU ({e})");
                vec![Resolved::Cpu]
            }
        });
    }
    specs.iter().map(|s| resolve(*s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_are_told_apart() {
        let e = CudaError::Driver(format!(
            "{:?}",
            sys::cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS
        ));
        assert!(is_sticky(&e.to_string()), "{e}");
        let oom = CudaError::Driver(format!(
            "{:?}",
            sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
        ));
        assert!(!is_sticky(&oom.to_string()), "{oom}");
    }

    #[test]
    fn parses_specs() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert!("gpu".parse::<DeviceSpec>().is_err());
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
        assert_eq!(DeviceSpec::Cuda(1).to_string(), "cuda:1");
        assert_eq!("emu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Emu);
        assert_eq!(
            parse_list("cuda:0,1").unwrap(),
            [DeviceSpec::Cuda(0), DeviceSpec::Cuda(1)]
        );
        assert_eq!(
            parse_list("cuda:2, cuda:0").unwrap(),
            [DeviceSpec::Cuda(2), DeviceSpec::Cuda(0)]
        );
        assert_eq!(parse_list("auto").unwrap(), [DeviceSpec::Auto]);
        assert!(parse_list("cuda:0,0").is_err(), "a GPU listed twice");
        assert!(parse_list("cpu,cuda:0").is_err());
    }

    /// Runs everywhere: on a machine without a GPU it checks the clean error path; on
    /// a GPU machine it checks that detection reports something sensible.
    #[test]
    fn probe_is_clean_with_or_without_gpu() {
        match probe() {
            Err(CudaError::NoDevice(why)) => {
                println!("no GPU here ({why}); checking the fallback paths");
                assert_eq!(resolve(DeviceSpec::Auto).unwrap(), Resolved::Cpu);
                let e = resolve(DeviceSpec::Cuda(0)).unwrap_err();
                assert!(e.to_string().starts_with("no CUDA device"), "{e}");
            }
            Err(e) => panic!("driver present but failing: {e}"),
            Ok(gpus) => {
                assert!(!gpus.is_empty());
                for g in &gpus {
                    println!(
                        "GPU {}: {} sm_{}{} {} GiB",
                        g.ordinal,
                        g.name,
                        g.compute_capability.0,
                        g.compute_capability.1,
                        g.memory_bytes >> 30
                    );
                    assert!(g.compute_capability.0 >= 5 && !g.name.is_empty());
                }
                assert!(matches!(
                    resolve(DeviceSpec::Auto).unwrap(),
                    Resolved::Cuda(_)
                ));
            }
        }
    }
}
