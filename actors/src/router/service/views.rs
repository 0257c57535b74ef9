//! What a finished request looks like to its client: the reply of an edit and of a
//! generation, for the synchronous reply, the job table (async requests) and the bus.
//! They are types, not ad-hoc JSON, so that the OpenAPI document describes what is
//! sent (`crate::router::http::routes`).

use base64::Engine;
use serde::Serialize;
use utoipa::ToSchema;

use crate::daemon::job_name;
use crate::router::flow::adapters::LoraApplied;
use crate::router::flow::edit::EditOutput;
use crate::router::flow::generate::{ApproxOutcome, GenerateOutput, TrueCfgOutcome};
use crate::wire::pods::AutoTemplate;
use crate::wire::{DenoiseStats, ImageFormat, JobId, StageTimings};

/// The batches a request's steps ran in.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct BatchSizes {
    /// The batch size of each of its steps.
    pub sizes: Vec<u32>,
    pub mean: f64,
    pub max: u32,
}

impl BatchSizes {
    fn of(stats: &DenoiseStats) -> Self {
        let sizes = stats.batch_sizes.clone();
        let mean = match sizes.len() {
            0 => 0.0,
            n => sizes.iter().map(|&s| s as f64).sum::<f64>() / n as f64,
        };
        let max = sizes.iter().max().copied().unwrap_or(0);
        BatchSizes { sizes, mean, max }
    }
}

/// A finished edit.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct EditReply {
    /// The request's id (its job name; also the `x-request-id` header).
    pub id: String,
    pub format: ImageFormat,
    /// The image's size: the input's.
    pub width: u32,
    pub height: u32,
    /// The size it was computed at: the input's rounded to whole tokens (16 pixels),
    /// scaled down to `[server] max_megapixels` when larger.
    pub computed_width: u32,
    pub computed_height: u32,
    /// Image tokens of the computed image.
    pub tokens: u32,
    /// Tokens computed: a template edit's masked tokens (all of them for a full run).
    pub active_tokens: u32,
    /// Fraction of the image's pixels in the mask.
    pub mask_ratio: f64,
    /// The prompt was longer than `max_sequence_length` T5 tokens and was cut.
    pub prompt_truncated: bool,
    /// Runs of the request (more than 1 when a worker died under it).
    pub attempts: usize,
    pub timings: StageTimings,
    pub batch: BatchSizes,
    /// The longest batch assembly among its steps (the denoise loop's overhead).
    pub assembly_max_s: f64,
    pub first_step_unix: f64,
    pub finished_unix: f64,
    pub loras: Vec<LoraApplied>,
    pub true_cfg: Option<TrueCfgOutcome>,
    /// The pod that ran it (in a cluster of pods; docs/cluster.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The version of its template it read (`TemplateInfo::version`; absent for an
    /// edit of an uploaded image).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_version: Option<u64>,
    /// An edit of an uploaded image under `[templates] auto`: the image's template and
    /// whether this edit read it (`hit`), captured it, or ran in full (neither).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_template: Option<AutoTemplate>,
    /// The image, base64 (absent from a synchronous request's job entry: its client
    /// had it in the reply).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

impl EditReply {
    /// The reply of edit `job`; `with_image` adds the base64 image.
    pub fn new(job: JobId, o: &EditOutput, format: ImageFormat, with_image: bool) -> Self {
        EditReply {
            id: job_name(job),
            format,
            width: o.width,
            height: o.height,
            computed_width: o.computed.0,
            computed_height: o.computed.1,
            tokens: o.tokens,
            active_tokens: o.active,
            mask_ratio: o.pixel_ratio,
            prompt_truncated: o.prompt_truncated,
            attempts: o.attempts,
            timings: o.timings.clone(),
            batch: BatchSizes::of(&o.stats),
            assembly_max_s: o.stats.assembly_max_s,
            first_step_unix: o.stats.first_step_unix,
            finished_unix: o.stats.finished_unix,
            loras: o.loras.clone(),
            true_cfg: o.true_cfg.clone(),
            pod: (!o.pod.is_empty()).then(|| o.pod.clone()),
            template_version: (o.template_version > 0).then_some(o.template_version),
            auto_template: o.auto_template.clone(),
            image: with_image.then(|| encode_b64(&o.image)),
        }
    }
}

/// A finished generation.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct GenerationReply {
    /// The request's id (its job name; also the `x-request-id` header).
    pub id: String,
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    /// The prompt was longer than `max_sequence_length` T5 tokens and was cut.
    pub prompt_truncated: bool,
    /// Runs of the request (more than 1 when a worker died under it).
    pub attempts: usize,
    pub approx_cache: ApproxOutcome,
    pub timings: StageTimings,
    pub loras: Vec<LoraApplied>,
    pub true_cfg: Option<TrueCfgOutcome>,
    pub batch: BatchSizes,
    pub first_step_unix: f64,
    pub finished_unix: f64,
    /// The pod that ran it (in a cluster of pods; docs/cluster.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The image, base64 (absent from a synchronous request's job entry).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

impl GenerationReply {
    /// The reply of generation `job`; `with_image` adds the base64 image.
    pub fn new(job: JobId, o: &GenerateOutput, format: ImageFormat, with_image: bool) -> Self {
        GenerationReply {
            id: job_name(job),
            format,
            width: o.width,
            height: o.height,
            steps: o.steps,
            prompt_truncated: o.prompt_truncated,
            attempts: o.attempts,
            approx_cache: o.approx.clone(),
            timings: o.timings.clone(),
            loras: o.loras.clone(),
            true_cfg: o.true_cfg.clone(),
            batch: BatchSizes::of(&o.stats),
            first_step_unix: o.stats.first_step_unix,
            finished_unix: o.stats.finished_unix,
            pod: (!o.pod.is_empty()).then(|| o.pod.clone()),
            image: with_image.then(|| encode_b64(&o.image)),
        }
    }
}

/// An image as a reply's base64 field.
pub fn encode_b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}
