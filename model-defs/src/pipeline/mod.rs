//! The FLUX.1 Fill pipeline around the transformer: images and masks in, Fill
//! conditioning, latents out through the VAE, paste-back.

mod components;
pub mod control;
pub mod defaults;
pub mod fill;
pub mod flux_fill;
pub mod generate;
pub mod image;
mod kind;
pub mod kontext;
pub mod paste;
pub mod preview;
pub mod prompts;
pub mod sizing;
pub mod sparse_vae;
pub mod stage_memory;
