//! Messages between pods (docs/cluster.md): what crosses hosts. A pod pushes its report
//! to its peers' pod actors as beats (on change, and as a heartbeat; its template list
//! only when that changed), and forwards an edit whole (its mask's bytes travel, like
//! the bus's) to the pod that holds its template; the result comes back whole. Latents
//! and activations never leave their pod.

use ractor::RpcReplyPort;
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};

pub use super::from_peer::{FromPeer, SessionKey, Stamp, EXPORTER_LABEL};
use super::{DenoiseStats, FinishParams, JobId, MaskChannel, Res, StageTimings, Wire, WireError};

/// The process-group scope and group of the pods' actors (apart from the groups of a
/// pod's workers).
pub const SCOPE: &str = "denoised.cluster";
pub const GROUP: &str = "denoised.pods";

/// The largest frame a pod takes from a peer: ractor_cluster's inbound limit, set
/// explicitly (its default is 16 MiB, under `[server] max_body_bytes`' 32 MiB), since a
/// frame over it closes the session with that peer. Template copies travel in 1 MiB
/// chunks; a request or a reply that would not fit is not sent ([`fits_a_frame`]).
pub const MAX_FRAME_BYTES: u64 = 64 << 20;

/// The bytes `v` takes on the wire (postcard; ractor_cluster's envelope not counted).
pub fn encoded_size<T: Serialize>(v: &T) -> usize {
    postcard::experimental::serialized_size(v).unwrap_or(usize::MAX)
}

/// Whether `v` travels in one frame between pods (with room for the envelope): its
/// encoded size when it does not.
pub fn fits_a_frame<T: Serialize>(v: &T) -> Result<(), usize> {
    let n = encoded_size(v);
    match n as u64 + (1 << 20) <= MAX_FRAME_BYTES {
        true => Ok(()),
        false => Err(n),
    }
}

/// A pod's state as its peers see it: pushed as a beat ([`PodMsg::Beat`]), or answered
/// when a peer asks ([`PodMsg::Report`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodReport {
    /// Its name (`[cluster] pod`).
    pub pod: String,
    /// When its daemon started (Unix seconds): a pod restarted while its old router
    /// still drains is the newer one.
    pub started_unix: f64,
    /// Its HTTP API's address.
    pub http: String,
    /// Its own `/readyz` verdict (false while it drains).
    pub ready: bool,
    /// Requests admitted and not answered, against its limit.
    pub in_flight: u32,
    pub limit: u32,
    /// The templates it holds, when `listed`; else empty (a beat: its list is the one
    /// it last sent, the one whose fingerprint is `listing`).
    pub templates: Vec<PodTemplate>,
    pub listed: bool,
    /// A fingerprint of its whole template list: a peer whose copy of the list has
    /// another one missed a change, and asks for the report.
    pub listing: u64,
    /// Its denoise workers as its router sees them (their own reports after every
    /// step, with the requests sent to them since).
    pub workers: Vec<PodWorker>,
    /// The requests waiting at its router for a worker with room.
    pub queued: Vec<PodRun>,
    /// The templates it is bringing in from a peer or capturing again now.
    pub fetching: Vec<String>,
}

/// A denoise worker in a [`PodReport`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodWorker {
    pub max_batch: u32,
    pub running: Vec<PodRun>,
}

/// A request in a [`PodReport`]: the rows it computes per step, and its steps left.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodRun {
    pub text: u32,
    pub active: u32,
    pub image: u32,
    pub steps_left: u32,
}

/// A template a pod holds, and its bytes in each tier there.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodTemplate {
    pub id: String,
    /// The version it holds (`TemplateInfo::version`).
    pub version: u64,
    pub host_bytes: u64,
    pub disk_bytes: u64,
    /// Its image tokens and steps (what an edit of it computes).
    pub tokens: u32,
    pub steps: u32,
}

/// An edit of a template, forwarded whole to the pod that runs it (the fields of a
/// template edit's request; an edit with its own LoRAs or ControlNets runs where it
/// arrives).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodEdit {
    pub template: String,
    pub mask: PodMask,
    pub steps: Option<u32>,
    pub guidance: Option<f32>,
    pub prompt: String,
    pub seed: u64,
    pub dilation: u32,
    pub max_sequence_length: u32,
    pub finish: FinishParams,
    pub negative_prompt: Option<String>,
    pub true_cfg_scale: f32,
    /// The pod and job it came from, which the pod that runs it tells its progress
    /// and previews ([`PodMsg::Event`]), and the previews that job asked for.
    pub origin: Option<PodOrigin>,
}

/// A generation without LoRAs or ControlNets of its own, forwarded whole to the pod
/// that runs it (the fields of a generation's request).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodGenerate {
    pub prompt: String,
    pub steps: Option<u32>,
    pub guidance: Option<f32>,
    pub seed: u64,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub max_sequence_length: u32,
    pub approx: ApproxMode,
    pub format: super::ImageFormat,
    #[serde(default)]
    pub compression: Option<u8>,
    pub negative_prompt: Option<String>,
    pub true_cfg_scale: f32,
    pub origin: Option<PodOrigin>,
}

/// What a generation does with the approximate cache (`approx_cache` in a request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ApproxMode {
    /// Start from the nearest similar prompt's state when there is one (the default).
    #[default]
    Auto,
    /// Neither read nor fill the cache.
    Off,
    /// Only a state of this very prompt and seed, so that the image is the uncached
    /// one, bit for bit; a miss fills the cache.
    Exact,
}

/// What the approximate cache did for a request (the reply's `approx_cache`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApproxOutcome {
    pub hit: bool,
    /// The steps skipped (0 on a miss).
    pub k: u32,
    /// The matched prompt's cosine similarity (a hit only).
    pub similarity: Option<f32>,
}

/// A generation's result: the encoded image and what the reply says of its run (a
/// forwarded generation's comes back whole from the pod that ran it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GenerateOutput {
    pub image: Vec<u8>,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub prompt_truncated: bool,
    pub timings: StageTimings,
    pub stats: DenoiseStats,
    pub attempts: usize,
    pub approx: ApproxOutcome,
    /// Whether the approximate cache was asked (not opted out).
    pub approx_used: bool,
    /// Its LoRAs and the step they applied from.
    pub loras: Vec<LoraApplied>,
    /// True CFG, when it ran.
    pub true_cfg: Option<TrueCfgOutcome>,
    /// The pod that ran it (empty outside a cluster).
    pub pod: String,
}

/// Where a forwarded edit or generation came from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodOrigin {
    pub pod: String,
    pub job: JobId,
    pub previews: Previews,
}

/// A forwarded edit's event, as the pod that runs it tells the one it came from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PodJobEvent {
    Status(JobStatus),
    Step { step: u32, steps: u32 },
    Preview { step: u32, jpeg: Vec<u8> },
}

/// A job's status (`GET /v1/jobs/{id}`, its events).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    Queued,
    Preprocessing,
    Denoising,
    Postprocessing,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobStatus {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobStatus::Succeeded | JobStatus::Failed | JobStatus::Cancelled
        )
    }
}

/// The previews a request asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Previews {
    #[default]
    None,
    /// One every this many steps (the native routes' `preview_every`).
    Every(u32),
    /// This many, spread over the steps (OpenAI's `partial_images`): one every
    /// `ceil(steps / (n + 1))` steps, which makes at most `n` before the last step
    /// (exactly `n` when `n + 1` divides the steps; OpenAI allows fewer).
    Count(u32),
}

impl Previews {
    /// The interval for a job of `steps` steps (0: none).
    pub fn every(self, steps: u32) -> u32 {
        match self {
            Previews::None | Previews::Every(0) | Previews::Count(0) => 0,
            Previews::Every(k) => k,
            Previews::Count(n) => steps.div_ceil(n + 1).max(1),
        }
    }
}

/// How a forwarded edit's region is given (an encoded image's bytes travel).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PodMask {
    Image(Vec<u8>, MaskChannel),
    Boxes(Vec<[u32; 4]>),
    Polygons(Vec<Vec<[f32; 2]>>),
    Whole,
}

/// An edit's result: the encoded image and what the reply says of its run. A forwarded
/// edit's comes back whole from the pod that ran it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EditOutput {
    pub image: Vec<u8>,
    /// The image's size: its input's.
    pub width: u32,
    pub height: u32,
    /// The size it was computed at (`denoised_models::pipeline::sizing`).
    #[serde(default)]
    pub computed: (u32, u32),
    pub tokens: u32,
    pub active: u32,
    pub pixel_ratio: f64,
    pub prompt_truncated: bool,
    pub timings: StageTimings,
    pub stats: DenoiseStats,
    pub attempts: usize,
    /// The LoRAs it ran with, and the step they applied from.
    pub loras: Vec<LoraApplied>,
    /// How true CFG ran, when it did (always batched in one worker for an edit).
    pub true_cfg: Option<TrueCfgOutcome>,
    /// The pod that ran it (empty outside a cluster).
    pub pod: String,
    /// The version of its template it read (0: an edit of an image).
    pub template_version: u64,
    /// What `[templates] auto` made of an edit of an uploaded image (set where the
    /// edit arrived).
    pub auto_template: Option<AutoTemplate>,
}

/// The template an edit of an uploaded image used under `[templates] auto` (docs/api.md,
/// "Templates that make themselves").
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AutoTemplate {
    /// The image's template: `auto_` and its digest (of the image, the model, the size
    /// and the steps).
    pub id: String,
    /// The edit read the template, which existed before it.
    pub hit: bool,
    /// This edit captured the template (its second sighting), then read it.
    pub captured: bool,
}

/// A LoRA as a reply reports it: the step of the request's schedule it applied from.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LoraApplied {
    pub id: String,
    pub scale: f64,
    pub applied_at_step: Option<u32>,
}

/// How true CFG ran (the reply's `true_cfg`).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TrueCfgOutcome {
    pub scale: f32,
    /// Its branches ran on two denoise workers (else batched in one).
    pub split: bool,
}

/// A template's version as it leaves its pod: its directory's name, its description
/// and its image (its template file follows as a stream of [`PodMsg::Next`] chunks).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Exported {
    pub name: String,
    pub info: Vec<u8>,
    pub image: Vec<u8>,
}

/// A pod's actor, called by its peers' routers.
#[derive(RactorClusterMessage)]
pub enum PodMsg {
    #[rpc]
    Report(FromPeer<()>, RpcReplyPort<Res<PodReport>>),
    #[rpc]
    Edit(FromPeer<PodEdit>, RpcReplyPort<Res<EditOutput>>),
    #[rpc]
    Generate(FromPeer<PodGenerate>, RpcReplyPort<Res<GenerateOutput>>),
    /// The newest version of a template this pod holds on disk.
    #[rpc]
    Export(FromPeer<String>, RpcReplyPort<Res<Exported>>),
    /// Opens a template transfer: the receiver's request (`template_transfer`'s
    /// request line); the reply is the stream's id.
    #[rpc]
    Open(FromPeer<Vec<u8>>, RpcReplyPort<Res<u64>>),
    /// The stream's next bytes (empty: its end).
    #[rpc]
    Next(FromPeer<u64>, RpcReplyPort<Res<Vec<u8>>>),
    /// The receiver is done with the stream (finished or not).
    Close(FromPeer<u64>),
    /// An event of a job this pod forwarded (its id here), from the pod running it.
    Event(FromPeer<(JobId, PodJobEvent)>),
    /// The forwarded edit of (pod, job there) was cancelled where it came from.
    Cancel(FromPeer<(String, JobId)>),
    /// A template was deleted (`DELETE /v1/templates/{id}` at a pod that held it): this
    /// pod drops its copy and recipe.
    Forget(FromPeer<String>),
    /// A peer's report, pushed: when its state changed, and at least every heartbeat
    /// (docs/cluster.md, "Beats").
    Beat(FromPeer<PodReport>),
    /// A template's recipe (its description and image, no template file), from the
    /// recipes this pod keeps or from its own copy: asked when needed.
    #[rpc]
    Recipe(FromPeer<String>, RpcReplyPort<Res<Exported>>),
}

/// Each variant's [`FromPeer`], whatever its type.
macro_rules! each {
    ($msg:expr, $m:ident => $e:expr) => {
        match $msg {
            PodMsg::Report($m, ..) => $e,
            PodMsg::Edit($m, ..) => $e,
            PodMsg::Generate($m, ..) => $e,
            PodMsg::Export($m, ..) => $e,
            PodMsg::Open($m, ..) => $e,
            PodMsg::Next($m, ..) => $e,
            PodMsg::Close($m) => $e,
            PodMsg::Event($m) => $e,
            PodMsg::Cancel($m) => $e,
            PodMsg::Forget($m) => $e,
            PodMsg::Beat($m) => $e,
            PodMsg::Recipe($m, ..) => $e,
        }
    };
}

impl PodMsg {
    /// Seals the message as pod `from`'s for the session it goes on (wire/from_peer.rs).
    pub fn seal(&mut self, from: &str, key: Option<&SessionKey>) {
        each!(self, m => m.seal(from, key))
    }

    /// What the receiver checks of its sender ([`Stamp`]).
    pub fn stamp(&self) -> Stamp<'_> {
        each!(self, m => m.stamp())
    }

    /// Why the message did not decode, if it did not.
    pub fn undecodable(&self) -> Option<&str> {
        each!(self, m => m.body.as_ref().err().map(String::as_str))
    }

    /// The message's name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            PodMsg::Report(..) => "Report",
            PodMsg::Edit(..) => "Edit",
            PodMsg::Generate(..) => "Generate",
            PodMsg::Export(..) => "Export",
            PodMsg::Open(..) => "Open",
            PodMsg::Next(..) => "Next",
            PodMsg::Close(..) => "Close",
            PodMsg::Event(..) => "Event",
            PodMsg::Cancel(..) => "Cancel",
            PodMsg::Forget(..) => "Forget",
            PodMsg::Beat(..) => "Beat",
            PodMsg::Recipe(..) => "Recipe",
        }
    }

    /// Answers the message with `e` if it is a call (a tell has no one to answer).
    pub fn refuse(self, e: WireError) {
        match self {
            PodMsg::Report(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Edit(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Generate(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Export(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Open(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Next(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Recipe(_, r) => drop(r.send(Wire(Err(e)))),
            PodMsg::Close(_)
            | PodMsg::Event(_)
            | PodMsg::Cancel(_)
            | PodMsg::Forget(_)
            | PodMsg::Beat(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ErrorKind;
    use ractor::BytesConvertable;

    /// A reply that does not decode becomes an error reply (what `Wire` does for every
    /// `Result<_, WireError>`), not a dropped message (a peer's message that does not
    /// decode: wire/from_peer.rs).
    #[test]
    fn replies_that_do_not_decode_become_errors() {
        let reply = <Res<PodReport>>::from_bytes(vec![0, 0xff, 0xff]);
        let e = reply.0.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Internal, "{e:?}");
        assert!(e.message.contains("does not decode"), "{e:?}");
        let ok: Res<u64> = Wire(Ok(7));
        assert_eq!(<Res<u64>>::from_bytes(ok.into_bytes()).0, Ok(7));
        let err: Res<u64> = Wire(Err(WireError::bad_input("no")));
        assert_eq!(
            <Res<u64>>::from_bytes(err.into_bytes())
                .0
                .unwrap_err()
                .message,
            "no"
        );
    }

    /// What travels in one frame: a mask at `[server] max_body_bytes` (32 MiB) does; one
    /// over the frame limit does not, by its encoded size.
    #[test]
    fn a_message_over_the_frame_limit_is_told_apart() {
        let mask = |n: usize| PodMask::Image(vec![7; n], MaskChannel::Auto);
        assert_eq!(fits_a_frame(&mask(32 << 20)), Ok(()));
        let big = MAX_FRAME_BYTES as usize;
        assert!(fits_a_frame(&mask(big)).unwrap_err() > big);
    }
}
