//! AutoencoderKL as FLUX.1 uses it: images to latents (encode) and back (decode),
//! numerically matching diffusers.
//!
//! - [`config`]: `vae/config.json`, validated (only the FLUX variant: no quant convs).
//! - [`weights`]: the parameter set, loaded from diffusers or generated from a seed.
//! - [`model`]: [`AutoencoderKL`], the encoder and decoder forward passes.
//! - [`dense`]: [`DenseVae`], the same dense passes on any `Backend` (a GPU's).
//! - [`sparse`]: the spatially sparse passes of an edit against a template's trace (SIGE).
//!
//! The convolution, GroupNorm and upsampling kernels live in
//! `denoised_runtime::cpu::conv`; the mid-block attention reuses the runtime's CPU
//! attention kernel.

pub mod config;
pub mod crop;
pub mod dense;
pub mod model;
pub mod single_file;
pub mod sparse;
pub mod weights;

pub use config::VaeConfig;
pub use dense::{DenseCoder, DenseVae};
pub use model::AutoencoderKL;
pub use weights::VaeHalves;
