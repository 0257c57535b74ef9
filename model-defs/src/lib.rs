//! denoised-models: model definitions written against the runtime's `Backend` trait.
//!
//! - [`flux`]: `FluxTransformer2DModel` (FLUX.1 dev, schnell and Fill), loaded from a
//!   diffusers directory or built in with seeded weights.
//! - [`scheduler`]: the flow-match Euler scheduler as FluxFillPipeline drives it.

pub mod fixtures;
pub mod flux;
pub mod lru;
pub mod mask;
pub mod pipeline;
pub mod planner;
pub mod profile;
pub mod scheduler;
pub mod source;
pub mod text;
pub mod vae;

pub use flux::{FluxConfig, FluxInputs, FluxTransformer};
pub use scheduler::FlowMatchEuler;
pub use source::ModelSource;
