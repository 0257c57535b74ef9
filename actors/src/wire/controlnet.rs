//! The ControlNet service's messages (see `crate::wire` for how messages travel):
//! the router opens and closes a request's residual stream; the stream itself is
//! shared memory (`crate::controlnet::stream`, which reads and writes it by its
//! [`StreamLayout`]).

use denoised_runtime::shm::Handle;
use ractor::RpcReplyPort;
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};

use crate::wire::{InputHandles, JobId, Res, Wire};

/// One ControlNet of a request, as the router resolved it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireControlNet {
    /// Its directory's name under `[adapters] controlnets_dir`.
    pub name: String,
    /// The control image, encoded (PNG/JPEG), in the router's arena.
    pub image: Handle,
    pub scale: f64,
}

/// router → controlnet: start a generation's or an edit's residual stream (after
/// preprocessing: its text embeddings are read from the preprocess worker's arena).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControlStart {
    pub job: JobId,
    pub nets: Vec<WireControlNet>,
    pub inputs: InputHandles,
    pub steps: u32,
    pub width: u32,
    pub height: u32,
    /// The request's seed (the control images' posterior draws come from it).
    pub seed: u64,
    /// An edit's active tokens: the rows its residuals carry (`None`: a generation,
    /// every row).
    #[serde(default)]
    pub active: Option<Vec<u32>>,
}

/// A residual stream a denoise worker feeds a job from: a slice of the ControlNet
/// process's arena (`crate::controlnet::stream`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControlStreamRef {
    pub slot: Handle,
    pub layout: StreamLayout,
}

/// Where a stream lies and what it carries (the service's reply to a start).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamLayout {
    pub doubles: u32,
    pub singles: u32,
    /// Latent rows: every token.
    pub rows: u32,
    /// Latent columns (the transformer's out_channels).
    pub cols: u32,
    /// Rows of each residual: every token for a generation, an edit's active ones.
    pub residual_rows: u32,
    pub hidden: u32,
    /// The scale the summed residuals are added with.
    pub scale: f32,
}

#[derive(RactorClusterMessage)]
pub enum ControlNetMsg {
    /// Loads a generation's ControlNets, encodes its control images and opens its
    /// stream; `None` when every scale is 0 (nothing to add).
    #[rpc]
    Start(
        Wire<ControlStart>,
        RpcReplyPort<Res<Option<ControlStreamRef>>>,
    ),
    /// The generation is over (finished, failed or cancelled): its stream closes.
    Stop(Wire<JobId>),
    /// From the process itself: the router was lost, and with it every stream.
    RouterLost(Wire<()>),
}
