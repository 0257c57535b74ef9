//! What a finished request looks like to its client: the JSON of an edit and of a
//! generation, for the synchronous reply, the job table (async requests) and the bus.

use base64::Engine;
use serde_json::{json, Value};

use crate::daemon::job_name;
use crate::router::flow::edit::EditOutput;
use crate::router::flow::generate::GenerateOutput;
use crate::wire::ImageFormat;

/// The JSON of a finished edit; `with_image` adds the base64 image (the job table of
/// a synchronous or bus request keeps only the description).
pub fn edit_json(job: u64, o: &EditOutput, format: ImageFormat, with_image: bool) -> Value {
    let sizes = &o.stats.batch_sizes;
    let mean = if sizes.is_empty() {
        0.0
    } else {
        sizes.iter().map(|&s| s as f64).sum::<f64>() / sizes.len() as f64
    };
    let mut v = json!({
        "id": job_name(job),
        "format": format,
        "width": o.width,
        "height": o.height,
        "tokens": o.tokens,
        "active_tokens": o.active,
        "mask_ratio": o.pixel_ratio,
        "prompt_truncated": o.prompt_truncated,
        "attempts": o.attempts,
        "timings": o.timings,
        "batch": {"sizes": sizes, "mean": mean, "max": sizes.iter().max().copied().unwrap_or(0)},
        "assembly_max_s": o.stats.assembly_max_s,
        "first_step_unix": o.stats.first_step_unix,
        "finished_unix": o.stats.finished_unix,
        "loras": o.loras,
        "true_cfg": o.true_cfg,
    });
    if with_image {
        v["image"] = Value::String(encode_b64(&o.image));
    }
    v
}

/// The JSON of a finished generation; `with_image` adds the base64 image.
pub fn generation_json(
    job: u64,
    o: &GenerateOutput,
    format: ImageFormat,
    with_image: bool,
) -> Value {
    let mut v = json!({
        "id": job_name(job),
        "format": format,
        "width": o.width,
        "height": o.height,
        "steps": o.steps,
        "prompt_truncated": o.prompt_truncated,
        "attempts": o.attempts,
        "approx_cache": o.approx,
        "timings": o.timings,
        "loras": o.loras,
        "true_cfg": o.true_cfg,
        "batch": {"sizes": o.stats.batch_sizes},
        "first_step_unix": o.stats.first_step_unix,
        "finished_unix": o.stats.finished_unix,
    });
    if with_image {
        v["image"] = Value::String(encode_b64(&o.image));
    }
    v
}

/// An image as a reply's base64 field.
pub fn encode_b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}
