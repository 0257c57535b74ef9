//! What denoise workers exchange about their devices: the velocity exchange of true
//! CFG split across two workers, and a worker's device memory budget.

use serde::{Deserialize, Serialize};

/// True CFG split across two denoise workers: the velocity exchange between them
/// (`crate::denoise::cfg_pair`).
/// A pair's slice: where it is and its size (the router's, lent to both workers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CfgPairRef {
    pub slot: denoised_runtime::shm::Handle,
    /// Rows and columns of a velocity (`[N, C]`).
    pub rows: u32,
    pub cols: u32,
    /// Which branch the receiving worker runs.
    pub positive: bool,
    pub scale: f32,
}

/// A denoise worker's device memory budget (`crate::budget` computes it).
/// As logged at start and shown in `/readyz`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceBudget {
    pub total_bytes: u64,
    pub weights_bytes: u64,
    pub workspace_bytes: u64,
    /// The running requests' tensors.
    #[serde(default)]
    pub requests_bytes: u64,
    /// Buffers of streamed templates.
    #[serde(default)]
    pub slab_buffer_bytes: u64,
    pub reserve_bytes: u64,
    /// The pre- and postprocess workers on this device.
    #[serde(default)]
    pub stage_bytes: u64,
    /// Device memory for resident templates.
    pub template_bytes: u64,
}
