//! The approximate nearest-prompt index of one exact key, once it holds many prompts:
//! an HNSW graph from the `hnsw_rs` crate over the prompts' unit embeddings (dot
//! distance, `1 - cos`).
//!
//! Below [`ANN_FROM`] prompts under a key the exact SIMD scan is the index: it is exact
//! and costs about 0.1 us per prompt at CLIP-L's 768 dimensions (0.93 ms at 10,000
//! prompts, 9.4 ms at 100,000; `denoised bench approx-cache --index-sizes`, one core).
//! The graph's search costs 1.5 ms at 10,000 prompts, 1.8 ms at 30,000 and 2.5 ms at
//! 100,000: the two cross near 16,384. The few candidates it returns are scored
//! exactly, so a hit's similarity (and so its K) is always the true cosine of the prompt
//! it picked; how often that is the nearest prompt, and gives the same K, the bench
//! reports.
//!
//! HNSW has no deletion: an evicted prompt stays in the graph and is filtered out of
//! searches, and the graph is rebuilt from the live prompts once the dead outnumber
//! them.

use denoised_runtime::cpu::simd;
use hnsw_rs::prelude::{Distance, Hnsw};

use super::PromptId;

/// `1 - cos` of unit vectors with our SIMD dot product (hnsw_rs's `DistDot` asserts
/// `dot <= 1`, which rounding breaks for near-duplicates).
#[derive(Clone, Copy, Default)]
pub struct UnitDot;

impl Distance<f32> for UnitDot {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - simd::dot(a, b)).max(0.0)
    }
}

/// Prompts under one key from which lookups use the graph.
pub const ANN_FROM: usize = 16_384;
/// Neighbours per node and layer, and the construction and search beam widths: the
/// hnswlib defaults' order, for recall above 0.99 on the bench's clustered embeddings.
const CONNECTIONS: usize = 24;
const EF_CONSTRUCTION: usize = 200;
const EF_SEARCH: usize = 96;
/// Candidates a search returns, scored exactly by the caller.
pub const CANDIDATES: usize = 8;

pub struct Ann {
    graph: Hnsw<'static, f32, UnitDot>,
    /// Prompts inserted, live or evicted since.
    inserted: usize,
}

impl Ann {
    /// A graph of `prompts` (unit embeddings).
    pub fn build<'a>(prompts: impl ExactSizeIterator<Item = (PromptId, &'a [f32])>) -> Self {
        let n = prompts.len();
        let mut ann = Ann {
            graph: Hnsw::new(
                CONNECTIONS,
                (2 * n).max(ANN_FROM),
                16,
                EF_CONSTRUCTION,
                UnitDot,
            ),
            inserted: 0,
        };
        for (id, v) in prompts {
            ann.insert(id, v);
        }
        ann
    }

    pub fn insert(&mut self, id: PromptId, embedding: &[f32]) {
        self.graph.insert_slice((embedding, id as usize));
        self.inserted += 1;
    }

    /// Whether the dead outnumber `live` prompts: time to rebuild.
    pub fn stale(&self, live: usize) -> bool {
        self.inserted > 2 * live
    }

    /// The live prompts nearest to `query` (unit), best first, at most [`CANDIDATES`].
    pub fn candidates(&self, query: &[f32], live: impl Fn(PromptId) -> bool) -> Vec<PromptId> {
        let filter = |id: &usize| live(*id as PromptId);
        self.graph
            .search_filter(query, CANDIDATES, EF_SEARCH, Some(&filter))
            .into_iter()
            .map(|n| n.d_id as PromptId)
            .collect()
    }
}
