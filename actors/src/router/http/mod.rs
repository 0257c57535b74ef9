//! The router's HTTP edge: the route table and its layers ([`routes`]), one module
//! per resource, and the request and error plumbing they share. The routes parse and
//! check bodies, then start work through `crate::router::service`; flows' errors map
//! to HTTP here ([`error`]).

mod adapters;
mod admin;
mod binary;
mod edits;
pub mod error;
mod events;
mod extract;
mod generations;
mod idempotency;
mod images;
pub mod inputs;
mod jobs;
mod openai;
pub mod openapi;
mod ops;
mod page;
pub mod respond;
mod routes;
mod templates;

pub use routes::app;
