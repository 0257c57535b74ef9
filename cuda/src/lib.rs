//! denoised-cuda: the GPU backend of denoised, through cudarc.
//!
//! - [`kernels`]: the CUDA C sources (`kernels/*.cu`), embedded in the binary;
//! - [`compile`]: NVRTC compilation to CUBIN at first use, per device architecture,
//!   cached in memory and on disk;
//! - [`exec`]: the executor trait, with [`gpu::CudaExec`] (a real device) and
//!   [`emu::EmuExec`] (the same kernels on the CPU, for machines without a GPU);
//! - [`backend`]: [`GpuBackend`], the model-facing `Backend` over any executor;
//! - [`stream`]: templates streamed to the device block by block on the copy stream;
//! - [`selfcheck`]: every kernel against the CPU backend, for tests and `denoised selftest`;
//! - [`device`]: `auto | cpu | emu | cuda:N[,M..]` selection and probing.
//!
//! cudarc is built with `dynamic-loading`, so this crate compiles and links on machines
//! without the CUDA toolkit or driver; `libcuda.so` and `libnvrtc.so` are looked up only
//! when used. cudarc panics when asked for a symbol of an absent library, so every entry
//! point checks for the library first and returns [`CudaError::NoDevice`] instead.

pub mod attention;
pub mod backend;
pub mod compile;
mod cublaslt;
mod cudnn;
pub mod device;
pub mod emu;
pub mod exec;
mod fp8;
pub mod gpu;
mod host;
mod image;
pub mod kernels;
pub mod params;
pub mod profiled;
mod quant;
mod ring;
mod sdpa;
pub mod selfcheck;
mod sige;
pub mod stream;
mod tensor;
mod text;

pub use attention::AttnKernel;
pub use backend::{GpuBackend, GpuTensor};
pub use cudnn::{library as cudnn_library, WORKSPACE_CAP as CUDNN_WORKSPACE_BYTES};
pub use device::{
    parse_list, probe, resolve, resolve_list, CudaError, DeviceSpec, GpuInfo, Resolved,
};
pub use emu::EmuExec;
pub use exec::{Dt, Exec, MemInfo, Sdpa, Strided};
pub use gpu::{CudaExec, Priority};
pub use image::WORKSPACE_BYTES as IMAGE_WORKSPACE_BYTES;
pub use profiled::{KernelTime, Profiled};
pub use sdpa::query_bucket;
pub use stream::StreamedTemplate;
