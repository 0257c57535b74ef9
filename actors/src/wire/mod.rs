//! Messages between the serving processes, as they travel over ractor_cluster.
//!
//! Each actor group has one message enum (`RouterMsg`, `PreprocessMsg`, ...), derived
//! with `RactorClusterMessage` so that a remote `ActorRef` can `cast` and `call` it.
//! Every field is a [`Wire<T>`]: a plain serde type encoded with postcard. Requests and
//! replies stay small: bulk data (images, latents, conditioning tensors, template
//! caches) stays in shared-memory arenas and only [`Handle`]s travel here (docs/design.md
//! §Processes and actors). The one exception is the internal bus ([`BusEdit`]): a client
//! of another service does not share our arenas (and once the node listens beyond
//! loopback, may run on another host), so, like an HTTP body, its request carries the
//! image bytes; the router moves them into shared memory at once.
//!
//! Replies are `Result<T, WireError>`: a worker turns every failure into a typed error
//! the router maps to an HTTP status.

use denoised_models::pipeline::sparse_vae::VaePass;
use denoised_models::planner::CacheMode;
use denoised_runtime::shm::Handle;
use ractor::{BytesConvertable, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A serde value carried in a cluster message, encoded with postcard.
#[derive(Clone, Debug)]
pub struct Wire<T>(pub T);

impl<T: Serialize + DeserializeOwned> BytesConvertable for Wire<T> {
    fn into_bytes(self) -> Vec<u8> {
        // postcard encodes every serde value we define (no maps with non-string keys,
        // no untagged enums), so this cannot fail.
        postcard::to_stdvec(&self.0).expect("postcard encodes the wire types")
    }
    fn from_bytes(bytes: Vec<u8>) -> Self {
        // ractor_cluster's trait has no error path. A reply (`Res<T>`, a `Result<_,
        // WireError>`) that does not decode becomes an error reply: the postcard bytes of
        // an `Err(WireError)` decode as any such `Result`. Anything else that does not
        // decode is a bug in this process's own messages (peers' requests travel as
        // `pods::FromPeer`, which keeps the failure): ractor catches the panic and drops it.
        match postcard::from_bytes(&bytes) {
            Ok(v) => Wire(v),
            Err(e) => {
                let err: Result<(), WireError> = Err(WireError::internal(format!(
                    "a reply that does not decode ({e}): a peer of another version?"
                )));
                let bytes = postcard::to_stdvec(&err).expect("postcard encodes an error");
                Wire(postcard::from_bytes(&bytes).expect("cluster message does not decode"))
            }
        }
    }
}

/// Request id, unique within a daemon.
pub type JobId = u64;

/// The reply of a call: a result or a typed error. (The derive macro recognises reply
/// ports by the literal `RpcReplyPort<..>` type, so variants spell that out around it.)
pub type Res<T> = Wire<Result<T, WireError>>;

/// The reply port of a call, for the code that holds one.
pub type Reply<T> = RpcReplyPort<Res<T>>;

mod error;
mod from_peer;
pub mod ids;
pub mod pods;

pub use denoised_models::pipeline::image::MaskChannel;
pub use error::{ErrorKind, WireError};
pub use ids::{check_template_id, check_version_name, version_name};

/// How the region to repaint is given.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum MaskSpec {
    /// An encoded image (PNG/JPEG) of the image's size or aspect, and the channel that
    /// marks the pixels to repaint (white luma, or opaque alpha).
    Image(Handle, MaskChannel),
    /// Rectangles `[x, y, width, height]` in pixels.
    Boxes(Vec<[u32; 4]>),
    /// Polygons of `[x, y]` pixel vertices (even-odd fill, pixel centres).
    Polygons(Vec<Vec<[f32; 2]>>),
    /// Nothing to repaint: a template capture.
    Empty,
    /// No mask: the whole image may change (a FLUX.1 Kontext instruction edit).
    Whole,
}

/// Generation parameters of a request (validated by the router).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GenParams {
    pub prompt: String,
    pub steps: u32,
    pub guidance: f32,
    pub seed: u64,
    pub max_sequence_length: u32,
    /// Extra ring of computed tokens around the mask (template edits).
    pub dilation: u32,
}

/// router → preprocess: decode, mask, text, VAE encode, noise (an edit or a capture);
/// text and noise (a generation).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PrepareReq {
    pub job: JobId,
    pub input: PrepareInput,
    pub params: GenParams,
    /// An edit's largest input image; a generation's largest size (`[server]`).
    pub max_pixels: u64,
    /// The most image tokens an edit is computed at (`ServerConfig::max_edit_tokens`).
    pub max_tokens: u64,
}

/// An edit's image and pixel mask at the input's size, when it is computed at another
/// (`denoised_models::pipeline::sizing`): RGB8 `[h, w, 3]` and 0/1 `[h, w]`, for the
/// paste-back at the input's resolution.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SourceRefs {
    pub image: Handle,
    pub mask: Handle,
    pub width: u32,
    pub height: u32,
}

/// What a request prepares from besides its prompt.
// A message, built once and serialized: boxing the larger variant would save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PrepareInput {
    /// An edit or a template capture (FLUX.1 Fill).
    Edit {
        /// Encoded image bytes (the request's image or the template's).
        image: Handle,
        mask: MaskSpec,
        /// What the VAE encoder does with a template's traces.
        vae: VaeTraces,
        /// True CFG's negative prompt when it runs (an edit).
        #[serde(default)]
        negative_prompt: Option<String>,
    },
    /// A text-to-image generation of this size (FLUX.1-dev / -schnell), and true
    /// CFG's negative prompt when it runs.
    Generate {
        width: u32,
        height: u32,
        #[serde(default)]
        negative_prompt: Option<String>,
    },
}

/// True CFG's negative branch in shared memory: the negative prompt's T5 embeddings
/// `[T', joint]` and pooled CLIP embedding, in the preprocess worker's arena.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NegativeHandles {
    pub txt: Handle,
    pub pooled: Handle,
}

/// What a request's VAE pass does with a template's traces
/// (`denoised_models::pipeline::sparse_vae`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub enum VaeTraces {
    /// Nothing: a dense pass (an inline image).
    #[default]
    None,
    /// A mask-aware edit of a template (whose image or final latent the request's
    /// differ from only at the mask): sparse when it pays, against the template's
    /// stored traces in the cache's arena when they are there.
    Edit(Option<Handle>),
    /// A template capture: record the pass's trace and return it
    /// ([`PreparedRefs::vae_trace`], [`Finished::vae_trace`]).
    Capture,
}

/// The conditioning tensors of one request, in the preprocess worker's arena.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InputHandles {
    pub latents: Handle,
    pub cond: Handle,
    pub img_ids: Handle,
    pub txt: Handle,
    pub txt_ids: Handle,
    pub pooled: Handle,
    pub guidance: f32,
    /// A Kontext request's reference tokens.
    pub reference: Option<ReferenceHandles>,
}

/// A Kontext request's reference tokens in shared memory
/// (`denoised_models::flux::edit::Reference`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReferenceHandles {
    pub latents: Handle,
    pub ids: Handle,
    /// A masked edit's hold on the unmasked latents: its mask, image latents, noise.
    pub inpaint: Option<[Handle; 3]>,
}

impl InputHandles {
    pub fn all(&self) -> Vec<Handle> {
        let mut all = vec![
            self.latents.clone(),
            self.cond.clone(),
            self.img_ids.clone(),
            self.txt.clone(),
            self.txt_ids.clone(),
            self.pooled.clone(),
        ];
        if let Some(r) = &self.reference {
            all.extend([r.latents.clone(), r.ids.clone()]);
            all.extend(r.inpaint.iter().flatten().cloned());
        }
        all
    }
}

/// preprocess → router: where a prepared request lies in shared memory (the
/// conditioning itself is `denoised_models::pipeline::flux_fill::Prepared`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PreparedRefs {
    pub inputs: InputHandles,
    /// Decoded RGB8 pixels `[h, w, 3]` and the binary pixel mask `[h, w]` (0/1), for
    /// paste-back.
    pub image: Handle,
    pub mask: Handle,
    pub width: u32,
    pub height: u32,
    /// Token grid of the image, and the active tokens (ascending) of its mask.
    pub rows: u32,
    pub cols: u32,
    pub active: Vec<u32>,
    pub pixel_ratio: f64,
    pub prompt_truncated: bool,
    pub seconds: f64,
    pub vae_pass: VaePass,
    /// The prompt's embeddings came from the worker's prompt cache.
    pub prompt_cache_hit: bool,
    /// A capture's encoder trace, as the template stores it.
    pub vae_trace: Option<Handle>,
    /// The negative prompt's embeddings (true CFG).
    #[serde(default)]
    pub negative: Option<NegativeHandles>,
    /// The input's image and mask when `width x height` is not its size.
    #[serde(default)]
    pub source: Option<SourceRefs>,
}

impl PreparedRefs {
    /// The size of the image the request returns: its input's.
    pub fn output_size(&self) -> (u32, u32) {
        self.source
            .as_ref()
            .map_or((self.width, self.height), |s| (s.width, s.height))
    }

    /// The slices of the preprocess worker's arena this reply lends to the router.
    pub fn handles(&self) -> Vec<Handle> {
        let mut h = self.inputs.all();
        h.extend([self.image.clone(), self.mask.clone()]);
        if let Some(s) = &self.source {
            h.extend([s.image.clone(), s.mask.clone()]);
        }
        h.extend(self.vae_trace.clone());
        if let Some(n) = &self.negative {
            h.extend([n.txt.clone(), n.pooled.clone()]);
        }
        h
    }
}

/// A template's cache as the cache actor holds it: the flat f32 image of
/// `TemplateLayout` in the cache process's arena.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TemplateRef {
    pub id: String,
    /// See [`TemplateEntry::version`].
    pub version: u64,
    pub blob: Handle,
    pub steps: u32,
    pub tokens: u32,
    /// Its slabs are stored every this many steps (see [`TemplateInfo`]).
    pub step_stride: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DenoiseWork {
    /// A full run: an edit of an inline image (every token computed).
    Full {
        /// True CFG: the negative prompt's embeddings and the scale.
        #[serde(default)]
        true_cfg: Option<(NegativeHandles, f32)>,
        /// Its ControlNets' residual stream.
        #[serde(default)]
        control: Option<ControlStreamRef>,
    },
    /// A text-to-image generation: it starts after step `start_at` (an approximate-cache
    /// hit, whose state is its `latents`; 0 for a miss) and returns its latents after
    /// each step of `store_at` ([`Denoised::states`]) for the cache.
    Generate {
        start_at: u32,
        store_at: Vec<u32>,
        /// True CFG: the negative prompt's embeddings and the scale.
        #[serde(default)]
        true_cfg: Option<(NegativeHandles, f32)>,
        /// Its ControlNets' residual stream (from the ControlNet service).
        #[serde(default)]
        control: Option<ControlStreamRef>,
        /// True CFG split across two workers: this worker's branch and the velocity
        /// exchange with the other (then `true_cfg` is `None`; a negative branch's
        /// `inputs` carry the negative prompt).
        #[serde(default)]
        cfg_pair: Option<CfgPairRef>,
    },
    /// A full run that records a template cache of this mode, its slabs stored every
    /// `step_stride` steps.
    Capture { mode: CacheMode, step_stride: u32 },
    /// A mask-aware edit: only `active` tokens are computed.
    Edit {
        template: TemplateRef,
        /// True CFG: the negative prompt's embeddings and the scale (the negative
        /// branch reads the same template).
        #[serde(default)]
        true_cfg: Option<(NegativeHandles, f32)>,
        /// Its ControlNets' residual stream (their active rows).
        #[serde(default)]
        control: Option<ControlStreamRef>,
    },
}

/// One LoRA of a request, as the router resolved it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WireLora {
    /// The adapter's name under `[adapters] dir`.
    pub name: String,
    /// As the request gave it (f32 on the device).
    pub scale: f64,
    /// K of bounded asynchronous loading (0: before the first step).
    pub patch_by: u32,
    /// Already merged into the workers' weights (`[adapters] merged`): nothing to load.
    #[serde(default)]
    pub merged: bool,
}

impl WireLora {
    /// A set of LoRAs as one key (`name*scale+...`): a template's in the cache files,
    /// and in the error of an edit naming other LoRAs than its template's.
    pub fn set_key(loras: &[WireLora]) -> String {
        loras
            .iter()
            .map(|l| format!("{}*{}", l.name, l.scale))
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// How long a served request spent in each stage (the reply's `timings`, and the
/// router's stage histograms).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StageTimings {
    pub queue_s: f64,
    pub preprocess_s: f64,
    pub denoise_s: f64,
    pub postprocess_s: f64,
    pub total_s: f64,
    /// Which VAE passes ran (sparse only for template edits, `[pipeline] sparse_vae`):
    /// `dense` or `sparse`.
    #[schema(value_type = String)]
    pub vae_encode: VaePass,
    #[schema(value_type = String)]
    pub vae_decode: VaePass,
    /// `hit` when the prompt's embeddings came from the preprocess worker's prompt
    /// cache (the text encoders did not run), else `miss`.
    #[schema(value_type = String)]
    pub prompt_cache: PromptCache,
}

/// Whether a request's prompt embeddings came from the prompt cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptCache {
    Hit,
    Miss,
}

impl PromptCache {
    pub fn of(hit: bool) -> Self {
        if hit {
            PromptCache::Hit
        } else {
            PromptCache::Miss
        }
    }

    /// Its name (the metrics' `result` label).
    pub fn name(self) -> &'static str {
        match self {
            PromptCache::Hit => "hit",
            PromptCache::Miss => "miss",
        }
    }
}

impl StageTimings {
    /// Each stage's seconds, by stage name (the metrics' `stage` label).
    pub fn stages(&self) -> [(&'static str, f64); 5] {
        [
            ("queue", self.queue_s),
            ("preprocess", self.preprocess_s),
            ("denoise", self.denoise_s),
            ("postprocess", self.postprocess_s),
            ("total", self.total_s),
        ]
    }
}

/// router → denoise.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DenoiseReq {
    pub job: JobId,
    pub inputs: InputHandles,
    pub steps: u32,
    /// Token grid of the image.
    pub rows: u32,
    pub cols: u32,
    pub active: Vec<u32>,
    pub work: DenoiseWork,
    /// Its LoRAs.
    #[serde(default)]
    pub loras: Vec<WireLora>,
    /// A preview of its clean-latent estimate after every this many steps (0: none).
    #[serde(default)]
    pub preview_every: u32,
}

/// What a request saw in the denoise loop.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DenoiseStats {
    /// From arrival at the denoise worker to its first step.
    pub queue_s: f64,
    /// From its first step to its last.
    pub denoise_s: f64,
    /// Batch size of each of its steps.
    pub batch_sizes: Vec<u32>,
    /// Largest per-step batch assembly time among its steps (the loop's overhead).
    pub assembly_max_s: f64,
    /// Wall-clock (Unix) seconds of its first and last step, for cross-request ordering.
    pub first_step_unix: f64,
    pub finished_unix: f64,
    /// The step of its schedule from which its LoRAs applied (bounded asynchronous
    /// loading); None without LoRAs.
    #[serde(default)]
    pub loras_applied_at: Option<u32>,
}

/// denoise → router.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Denoised {
    /// The final packed latent `[L, C]` in the denoise worker's arena.
    pub latents: Handle,
    /// For a capture: the template cache, flat, in the denoise worker's arena.
    pub cache: Option<Handle>,
    /// For a generation with `store_at`: the packed latents after each of those steps,
    /// in the denoise worker's arena.
    pub states: Vec<(u32, Handle)>,
    pub stats: DenoiseStats,
}

impl Denoised {
    /// The slices of the denoise worker's arena this reply lends to the router.
    pub fn handles(&self) -> Vec<Handle> {
        let mut h = vec![self.latents.clone()];
        h.extend(self.cache.clone());
        h.extend(self.states.iter().map(|(_, s)| s.clone()));
        h
    }
}

/// router → postprocess.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FinishReq {
    pub job: JobId,
    pub latents: Handle,
    pub image: Handle,
    pub mask: Handle,
    pub width: u32,
    pub height: u32,
    pub params: FinishParams,
    /// A template edit's template cache in the cache's arena: its last latent is the
    /// template's final latent, against whose trace the decoder may run sparse.
    pub template: Option<Handle>,
    /// What the VAE decoder does with a template's traces (an edit's also needs
    /// `template`).
    pub vae: VaeTraces,
    /// The input's image and mask, when `width x height` is not its size: the result
    /// is resized to it and pasted back there.
    #[serde(default)]
    pub source: Option<SourceRefs>,
}

/// postprocess → router: the encoded output image in the postprocess worker's arena.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Finished {
    pub image: Handle,
    pub seconds: f64,
    pub vae_pass: VaePass,
    /// A capture's decoder trace, as the template stores it.
    pub vae_trace: Option<Handle>,
}

impl Finished {
    /// The slices of the postprocess worker's arena this reply lends to the router.
    pub fn handles(&self) -> Vec<Handle> {
        let mut h = vec![self.image.clone()];
        h.extend(self.vae_trace.clone());
        h
    }
}

/// The non-disaggregated baseline: the denoise process prepares, denoises and finishes
/// a request itself, running the CPU stages between steps.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InlineReq {
    pub prepare: PrepareReq,
    pub work: DenoiseWork,
    /// None for a capture (no image is returned).
    pub finish: Option<FinishParams>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InlineDone {
    /// Encoded output image, in the denoise worker's arena (None for a capture).
    pub image: Option<Handle>,
    pub cache: Option<Handle>,
    /// The size it was computed at.
    pub width: u32,
    pub height: u32,
    /// The input's size, when it was computed at another (the image is the input's).
    #[serde(default)]
    pub input_size: Option<(u32, u32)>,
    pub tokens: u32,
    pub active: u32,
    pub pixel_ratio: f64,
    pub prompt_truncated: bool,
    pub prompt_cache_hit: bool,
    pub stats: DenoiseStats,
    pub preprocess_s: f64,
    pub postprocess_s: f64,
}

/// Progress of a request, denoise → router after each of its steps.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Progress {
    pub job: JobId,
    pub step: u32,
    pub steps: u32,
    pub batch: u32,
}

/// A preview of a request's running latent, denoise → router after one of its steps:
/// a small JPEG of the model's clean-latent estimate (`crate::denoise::events`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Preview {
    pub job: JobId,
    /// The step it follows (1-based: steps done).
    pub step: u32,
    pub jpeg: Vec<u8>,
}

/// A denoise worker's load, reported to the router after each of its steps and each
/// change of its requests, so that the router places a request on fresh data without
/// asking anyone (`crate::routing`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// Its process name (`denoise0`), which is also its actor's name.
    pub worker: String,
    /// `[denoise] max_batch`: the requests (running and waiting) it takes at once.
    pub max_batch: u32,
    /// Its requests, running and waiting, with their shapes and the steps they have
    /// left.
    pub requests: Vec<LoadEntry>,
    /// Versions of the templates resident on its device.
    pub device_templates: Vec<u64>,
}

/// One request of a [`WorkerLoad`]: the rows it computes per step and its steps left.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadEntry {
    pub job: JobId,
    pub text: u32,
    pub active: u32,
    pub image: u32,
    pub steps_left: u32,
}

/// An edit over the internal bus (see the module docs on why bytes travel here).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BusEdit {
    pub template_id: String,
    /// Encoded mask image (PNG/JPEG).
    pub mask_png: Vec<u8>,
    pub prompt: String,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BusEditResult {
    pub job: JobId,
    pub png: Vec<u8>,
    pub active_tokens: u32,
    pub tokens: u32,
}

/// What a worker process runs on and loaded, announced to the router once it is up
/// and shown in `/readyz`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct WorkerInfo {
    /// Process name, e.g. `denoise0`.
    pub name: String,
    pub role: String,
    /// `cpu`, `emu` or `cuda:N NAME (ARCH)`: where its transformer computes.
    pub device: String,
    /// Storage dtype of its device weights (`f32` on the CPU).
    pub dtype: String,
    /// Its CPU compute threads.
    pub threads: u32,
    pub components: Vec<denoised_models::pipeline::flux_fill::Component>,
    /// A GPU (or emulated) denoise worker's device memory budget; null elsewhere.
    /// (No `skip_serializing_if`: cluster messages are postcard, which is positional.)
    pub device_budget: Option<DeviceBudget>,
    /// A GPU (or emulated) denoise worker's attention path: cuDNN's fused SDPA, or
    /// our kernel and why. Null elsewhere.
    pub attention: Option<String>,
    /// A denoise worker's latency models (its planner's): what the router prices its
    /// steps with. Null for other roles.
    pub profile: Option<denoised_models::profile::Profile>,
}

// A message is short-lived; an announcement (with its profile) is the large one.
#[allow(clippy::large_enum_variant)]
#[derive(RactorClusterMessage)]
pub enum RouterMsg {
    /// A denoise worker reports a request's step.
    Progress(Wire<Progress>),
    /// A denoise worker sends a preview of a request's latent.
    Preview(Wire<Preview>),
    /// A worker process says what it loaded.
    Announce(Wire<WorkerInfo>),
    /// A denoise worker reports its load.
    Load(Wire<WorkerLoad>),
    /// Echoes its argument: liveness checks and message round-trip measurements.
    #[rpc]
    Ping(Wire<u64>, RpcReplyPort<Res<u64>>),
    /// The internal bus: an edit from another service's actor.
    #[rpc]
    BusEdit(Wire<BusEdit>, RpcReplyPort<Res<BusEditResult>>),
}

// The derive needs the payload types as they are (no boxing), and a message is
// short-lived, so the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(RactorClusterMessage)]
pub enum PreprocessMsg {
    #[rpc]
    Prepare(Wire<PrepareReq>, RpcReplyPort<Res<PreparedRefs>>),
    /// The router is done with these slices of this worker's arena.
    Release(Wire<Vec<Handle>>),
}

// The derive needs the payload types as they are (no boxing), and a message is
// short-lived, so the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(RactorClusterMessage)]
pub enum DenoiseMsg {
    #[rpc]
    Denoise(Wire<DenoiseReq>, RpcReplyPort<Res<Denoised>>),
    #[rpc]
    Inline(Wire<InlineReq>, RpcReplyPort<Res<InlineDone>>),
    Cancel(Wire<JobId>),
    Release(Wire<Vec<Handle>>),
    /// From the worker's own event thread: a request left the loop (finished, failed or
    /// cancelled). Serializable only because every variant must be.
    Done(Wire<(JobId, Result<Denoised, WireError>)>),
    /// From the worker's own process: the router's connection was lost, so the
    /// requests it sent are dropped (see `node::stay_connected`).
    RouterLost(Wire<()>),
}

// The derive needs the payload types as they are (no boxing), and a message is
// short-lived, so the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(RactorClusterMessage)]
pub enum PostprocessMsg {
    #[rpc]
    Finish(Wire<FinishReq>, RpcReplyPort<Res<Finished>>),
    Release(Wire<Vec<Handle>>),
}

// The derive needs the payload types as they are (no boxing), and a message is
// short-lived, so the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(RactorClusterMessage)]
pub enum CacheMsg {
    #[rpc]
    Put(Wire<PutTemplate>, RpcReplyPort<Res<TemplateEntry>>),
    #[rpc]
    Get(Wire<String>, RpcReplyPort<Res<TemplateEntry>>),
    #[rpc]
    List(Wire<()>, RpcReplyPort<Res<Vec<TemplateInfo>>>),
    /// Deletes a template's current version (only when it is at most the version
    /// given: older copies than the registry allows go, a newer one stays).
    #[rpc]
    Delete(Wire<(String, Option<u64>)>, RpcReplyPort<Res<TemplateInfo>>),
    /// A copy of template `.0` from another pod, received complete by the router in its
    /// staging directory at `.1`: move it into the disk tier and index it (the cache
    /// process is the only writer of its tier).
    #[rpc]
    Adopt(Wire<(String, String)>, RpcReplyPort<Res<TemplateInfo>>),
    /// `Get` for an edit: the template stays (pinned: never evicted, its slices valid
    /// even if it is deleted or replaced meanwhile) until the matching `Unpin`. A
    /// template only on disk starts loading into the host tier at once; the reply does
    /// not wait for it (`Load` does), so the load overlaps the edit's preprocessing.
    #[rpc]
    Pin(Wire<String>, RpcReplyPort<Res<TemplateEntry>>),
    /// A pinned template version, once its cache is in the host tier (`blob` set).
    #[rpc]
    Load(Wire<u64>, RpcReplyPort<Res<TemplateEntry>>),
    /// The edit that pinned this template version is done with it.
    Unpin(Wire<u64>),
    /// A generation's nearest cached noise state (the approximate cache), pinned until
    /// the matching `ApproxUnpin` when there is one.
    #[rpc]
    ApproxLookup(Wire<ApproxQuery>, RpcReplyPort<Res<Option<ApproxHit>>>),
    /// The generation that pinned this state (`ApproxHit::pin`) has read it.
    ApproxUnpin(Wire<u64>),
    /// A missed generation's states, to copy into the cache (the reply: how many it
    /// kept). The router holds the slices until the reply.
    #[rpc]
    ApproxPut(Wire<ApproxPut>, RpcReplyPort<Res<u32>>),
    /// From the cache process itself: the router was lost, and with it every pin.
    RouterLost(Wire<()>),
    /// From the cache's own tasks (copies and disk I/O run off the message loop): a
    /// registration's copy into the host tier is done.
    Copied(Wire<(u64, Result<(), WireError>)>),
    /// A version's cache was read from disk into the host tier (or found corrupt).
    Loaded(Wire<(u64, Result<(), WireError>)>),
    /// A version was written to disk (its bytes there), or could not be.
    Written(Wire<(u64, Result<u64, WireError>)>),
}

#[derive(RactorClusterMessage)]
pub enum MetricsMsg {
    /// This process's metrics, as an OpenMetrics exposition without `# EOF`.
    #[rpc]
    Scrape(Wire<()>, RpcReplyPort<Res<String>>),
}

pub mod approx;
pub mod controlnet;
mod device;
mod output;
mod templates;
pub use approx::{ApproxHit, ApproxPut, ApproxQuery};
pub use controlnet::{ControlNetMsg, ControlStart, ControlStreamRef, WireControlNet};
pub use device::{CfgPairRef, DeviceBudget};
pub use output::{FinishParams, ImageFormat};
pub use templates::{PutTemplate, TemplateEntry, TemplateInfo, TierBytes};

/// Process-group names under which each group's actors register.
pub mod groups {
    pub const ROUTER: &str = "denoised.router";
    pub const PREPROCESS: &str = "denoised.preprocess";
    pub const DENOISE: &str = "denoised.denoise";
    pub const POSTPROCESS: &str = "denoised.postprocess";
    pub const CACHE: &str = "denoised.cache";
    pub const CONTROLNET: &str = "denoised.controlnet";
    /// Every worker process's metrics actor (see `crate::metrics`).
    pub const METRICS: &str = "denoised.metrics";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_round_trip_through_postcard() {
        let p = Progress {
            job: 7,
            step: 3,
            steps: 28,
            batch: 4,
        };
        let back = Wire::<Progress>::from_bytes(Wire(p.clone()).into_bytes()).0;
        assert_eq!((back.job, back.step, back.steps, back.batch), (7, 3, 28, 4));
        let e: Result<u32, WireError> = Err(WireError::bad_input("mask is 32x32"));
        let back = Wire::<Result<u32, WireError>>::from_bytes(Wire(e.clone()).into_bytes()).0;
        assert_eq!(back, e);
    }
}
