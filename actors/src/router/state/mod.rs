//! The router's state, the bottom of its layers (edges → service → flows → state):
//! [`Ctx`] (configuration, arena, the calls to workers), the job table, admission, and
//! the balancer that routes denoise work. Nothing here imports a flow, the service or
//! an HTTP module.

pub mod admission;
pub mod balance;
mod ctx;
pub mod idempotency;
pub mod images;
pub mod jobs;
pub mod keyed;
pub mod pod_route;
pub mod pods;
pub mod recipes;
pub mod registry;
pub mod sessions;
pub mod sightings;

pub use ctx::{AdapterDir, Ctx, GenerationModel, Listed};
