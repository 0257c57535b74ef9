//! Templates as they cross processes and pods: their description (the API's too),
//! where they are, and the cache actor's store and hand-out messages.

use denoised_runtime::shm::Handle;
use serde::{Deserialize, Serialize};

use super::WireLora;

/// A registered template's description.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TemplateInfo {
    pub id: String,
    /// This registration of it: every create or replace of the id takes a larger one,
    /// the same on every pod that holds a copy.
    #[serde(default)]
    pub version: u64,
    /// The SHA-256 of what its content is made from (its image and capture
    /// parameters), hex: a copy or a capture again from its recipe has the same.
    #[serde(default)]
    pub digest: String,
    pub model: String,
    /// The size it is computed at: its image's in whole tokens, scaled down to `[server]
    /// max_megapixels` when larger (its cache's size).
    pub width: u32,
    pub height: u32,
    /// Its image's own size: its edits' masks are of it, and their replies come back
    /// at it (0 in a description written before sizes were free: `width` x `height`).
    #[serde(default)]
    pub image_width: u32,
    #[serde(default)]
    pub image_height: u32,
    /// Image tokens (the template's cache covers all of them).
    pub tokens: u32,
    pub steps: u32,
    pub guidance: f32,
    pub seed: u64,
    pub prompt: String,
    pub max_sequence_length: u32,
    pub cache_bytes: u64,
    pub created_unix: f64,
    /// The storage dtype of its K/V (the capturing device's): `f32` or `bf16`.
    #[serde(default)]
    pub kv_dtype: String,
    /// What it caches per block: `kv` or `y`.
    #[serde(default)]
    pub cache_mode: String,
    /// Its slabs are stored every this many steps (step sharing; 1: every step).
    #[serde(default = "one")]
    pub kv_step_stride: u32,
    /// Bytes of its stored VAE traces (the sparse VAE's; 0 when it was captured with
    /// `[pipeline] sparse_vae = "off"`), beside `cache_bytes`; both count in `tiers`.
    #[serde(default)]
    pub vae_trace_bytes: u64,
    /// Where it is now: its bytes in each tier of the template cache (0 where it is
    /// not). Filled in when it is described.
    #[serde(default)]
    pub tiers: TierBytes,
    /// The LoRAs it was captured with; its edits run with them.
    #[serde(default)]
    pub loras: Vec<WireLora>,
}

/// A template's footprint in each tier of the template cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TierBytes {
    pub host: u64,
    pub disk: u64,
}

/// router → cache: store a template (the cache actor copies both slices into its arena).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PutTemplate {
    pub info: TemplateInfo,
    pub blob: Handle,
    pub image: Handle,
    /// Its VAE traces (one record each, `denoised_models::vae::sparse::stored`), which
    /// the cache stores as one slice.
    pub vae_traces: Vec<Handle>,
    /// Replace a template of the same id; without it that id is a conflict.
    pub replace: bool,
    /// The version to store it as (the template registry's); `None`: a new one.
    pub version: Option<u64>,
}

/// A template as the cache actor hands it out.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TemplateEntry {
    pub info: TemplateInfo,
    /// This registration of the template: unique, also across restarts, and the same
    /// in every tier (what pins and device caches name).
    pub version: u64,
    /// Its cache in the host tier, when it is there (else it is on disk: `Load` it).
    pub blob: Option<Handle>,
    /// Its VAE traces in the host tier, when it has them and they are there (they
    /// come and go with `blob`).
    pub vae_traces: Option<Handle>,
    /// The template's encoded image bytes (always in the host tier: they are small).
    pub image: Handle,
}

fn one() -> u32 {
    1
}
