//! denoised-cuda: the CUDA side of denoised, through cudarc.
//!
//! cudarc is built with `dynamic-loading`, so this crate compiles and links on machines
//! without the CUDA toolkit or driver; `libcuda.so` is looked up only when a device is
//! probed. cudarc panics when asked for a symbol of a library that is absent, so every
//! entry point here checks for the library first and returns a clean
//! [`CudaError::NoDevice`] instead.
//!
//! Today this crate detects devices; the kernels and the CUDA `Backend` follow.

pub mod device;

pub use device::{probe, resolve, CudaError, DeviceSpec, GpuInfo, Resolved};
