//! denoised-runtime: the layer every other crate stands on.
//!
//! It holds the host [`Tensor`], the [`Backend`] trait that model code is written
//! against, the CPU backend (the numerical reference for every device kernel), and
//! the safetensors loader for diffusers-format model directories. Nothing here knows
//! about Flux or about serving; model definitions live in `denoised-models` and the
//! actors in `denoised-actors`.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod direct;
pub mod error;
pub mod fixtures;
pub mod fp8;
pub mod gguf;
pub mod host;
pub mod quant;
pub mod shm;
pub mod skip;
pub mod stored;
pub mod tensor;
pub mod weights;

pub use backend::{
    AttnSeq, Backend, Conv2dOpts, DeviceTimer, HeadNorm, KvSource, Modulation, QSpan, Rows,
    SlabProvider, SlabShape, Src, TextMask,
};
pub use cpu::CpuBackend;
pub use error::{Error, Result};
pub use gguf::GgufFile;
pub use host::{HostMemory, HostSlice, OwnedHost};
pub use quant::QuantType;
pub use stored::{Stored, StoredFormat};
pub use tensor::{DType, Tensor};
pub use weights::WeightStore;
