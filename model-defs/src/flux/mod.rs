//! The Flux transformer family.
//!
//! - [`config`]: `config.json` and the named configs of real and benchmark models.
//! - [`weights`]: the parameter set, loaded from diffusers or generated from a seed.
//! - [`embed`]: timestep/guidance sinusoids and the 3-axis RoPE tables.
//! - [`model`]: the forward pass over a packed batch of requests.
//! - [`edit`]: jobs and the batched step; [`slabs`]: where edits read cached slabs from;
//!   [`reference`]: a Kontext request's reference tokens.

pub mod adapters;
pub mod bfl;
pub mod config;
pub mod control_feed;
pub mod controlnet;
pub mod cost;
pub mod edit;
pub mod embed;
mod grid;
mod host;
mod inactive;
pub mod lora;
pub mod lora_formats;
pub mod model;
mod observer;
mod packing;
pub mod plan;
pub mod reference;
pub mod request;
pub mod single_file;
pub mod slabs;
pub mod stepper;
pub mod template;
pub mod template_file;
pub mod template_transfer;
pub mod weights;

pub use config::FluxConfig;
pub use host::FluxInputs;
pub use model::{FluxRequest, FluxTransformer};
