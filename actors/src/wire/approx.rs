//! The approximate cache's messages (`CacheMsg::ApproxLookup` / `ApproxPut`): what a
//! generation is matched by, a hit, and a missed generation's states to keep (the
//! cache process serves them, `crate::workers::cache::noise`).

use denoised_runtime::shm::Handle;
use serde::{Deserialize, Serialize};

/// What the approximate cache matches a generation by.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApproxQuery {
    /// The hash of the fields a state must share exactly (model, size, steps, guidance,
    /// scheduler, adapters).
    pub key: u64,
    /// The hash of the prompt and the seed (an `exact` lookup takes only this one).
    pub text: u64,
    /// The prompt's CLIP pooled embedding.
    pub embedding: Vec<f32>,
    pub steps: u32,
    pub exact: bool,
}

/// A lookup's answer: start after step `k` from `state` (packed latents in the cache's
/// arena), pinned as `pin`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApproxHit {
    pub k: u32,
    pub similarity: f32,
    pub state: Handle,
    pub pin: u64,
}

/// A missed generation's states: its lookup fields and the packed latents after each
/// stored step, in the denoise worker's arena.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApproxPut {
    pub query: ApproxQuery,
    pub states: Vec<(u32, Handle)>,
}
