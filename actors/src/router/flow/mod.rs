//! The flows: the life of each kind of request through the worker groups, as the
//! router drives it. Nothing here imports axum or the HTTP edge; errors are the
//! flows' own ([`crate::wire::WireError`]), mapped to HTTP statuses at the edge.

pub mod adapters;
pub mod auto;
pub mod capture;
pub mod cfg_split;
pub mod controlnets;
pub mod defaults;
pub mod edit;
pub mod generate;
pub mod identity;
pub mod pod;
pub(crate) mod stages;
pub mod transfer;
