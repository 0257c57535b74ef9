//! denoised-actors: the actor groups of the serving runtime (router, preprocess,
//! denoise, postprocess, cache), the batching loop and routing policies.
//!
//! The serving runtime is built on top of the engine crates (`denoised-runtime`,
//! `denoised-models`); see docs/design.md §"Processes and actors". Its first pieces land
//! with the serving work.

pub mod approx;
pub mod batching;
pub mod budget;
pub mod controlnet;
pub mod daemon;
pub mod denoise;
pub mod device;
pub mod fault;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod notify;
pub mod overheads;
pub mod process;
pub mod restarts;
pub mod router;
pub mod routing;
pub mod stages;
pub mod supervisor;
pub mod wire;
pub mod workers;
