//! A template's registration: a capture run (a full generation of the template's image
//! that records its activations), then its cache, image and VAE traces go to the
//! cache process, which answers once they are durable. With a template registry
//! (docs/cluster.md) the id is claimed there first (409 when the cluster holds it), and
//! the stored version becomes the template's by a compare-and-swap there once durable.

use std::time::Instant;

use denoised_models::pipeline::sparse_vae::SparseVaeSetting;
use denoised_models::planner::CacheMode;
use denoised_runtime::shm::Handle;

use sha2::{Digest, Sha256};

use super::stages::{denoise, finish_req, postprocess, preprocess, with_retries, Held};
use crate::daemon::unix_now;
use crate::router::state::jobs::JobStatus;
use crate::router::state::registry::Intent;
use crate::router::state::Ctx;
use crate::wire::*;

/// Whose version a registration stores.
pub enum Identity {
    /// No registry: the cache process's new version, the id checked against this
    /// pod's own templates.
    Local,
    /// A new version, claimed in the registry, committed there once durable.
    New(Intent),
    /// The registry's current version, captured again from its recipe (nothing to
    /// commit).
    Existing(u64),
}

/// Claims template id `id` for a registration (`replace`: of a template that may
/// exist): 409 when it is taken, 503 when the registry does not answer.
pub async fn claim(ctx: &Ctx, id: &str, replace: bool) -> Result<Identity, WireError> {
    match ctx.template_registry() {
        Some(reg) => Ok(Identity::New(reg.begin(id, replace).await?)),
        // Checked before the capture runs (the cache checks again when storing, so
        // two registrations racing for one id cannot both win).
        None if !replace && ctx.template(id).await.is_ok() => Err(WireError::template_exists(id)),
        None => Ok(Identity::Local),
    }
}

/// A template's content digest: SHA-256 over what its content is made from (the
/// model, its image and the capture's parameters), so that a copy or a capture again
/// from its recipe has its original's.
pub fn digest(info: &TemplateInfo, image: &[u8]) -> String {
    let params = serde_json::json!([
        info.model,
        info.prompt,
        info.steps,
        info.guidance,
        info.seed,
        info.max_sequence_length,
        info.kv_step_stride,
        info.loras,
    ]);
    let mut h = Sha256::new();
    h.update(params.to_string().as_bytes());
    h.update(image);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

pub struct TemplateInput {
    pub id: String,
    pub image: Vec<u8>,
    pub prompt: String,
    pub steps: u32,
    pub guidance: f32,
    pub seed: u64,
    pub max_sequence_length: u32,
    /// Replace a template of the same id instead of refusing (409).
    pub replace: bool,
    /// Whose version it stores (see [`claim`]).
    pub identity: Identity,
    /// What the template caches per block.
    pub cache_mode: CacheMode,
    /// Its slabs are stored every this many steps (`[cache] kv_step_stride`).
    pub step_stride: u32,
    /// The LoRAs it is captured with (every edit of it runs with them).
    pub loras: Vec<WireLora>,
}

/// Registers a template: a capture run, then the cache goes to the cache actor.
pub async fn capture(
    ctx: &Ctx,
    job: JobId,
    input: &TemplateInput,
) -> Result<TemplateInfo, WireError> {
    let t0 = Instant::now();
    let params = GenParams {
        prompt: input.prompt.clone(),
        steps: input.steps,
        guidance: input.guidance,
        seed: input.seed,
        max_sequence_length: input.max_sequence_length,
        dilation: 0,
    };
    let (info, _) = with_retries(ctx, job, |_| async {
        let mut held = Held::default();
        let r = capture_once(ctx, job, input, &params, &mut held).await;
        held.release(&ctx.shm);
        r
    })
    .await?;
    tracing::info!(
        "template {} registered in {:.2} s ({} bytes of cache)",
        info.id,
        t0.elapsed().as_secs_f64(),
        info.cache_bytes
    );
    Ok(info)
}

/// What a capture run produced: the template's cache, its size, and the VAE traces
/// its sparse passes will read (none from the inline baseline).
struct Captured {
    blob: Handle,
    width: u32,
    height: u32,
    /// The image's own size (`width` x `height` is the computed one).
    image: (u32, u32),
    tokens: u32,
    vae_traces: Vec<Handle>,
}

async fn capture_once(
    ctx: &Ctx,
    job: JobId,
    input: &TemplateInput,
    params: &GenParams,
    held: &mut Held,
) -> Result<TemplateInfo, WireError> {
    let image = ctx.shm.write_bytes(&input.image)?;
    held.own.push(image.clone());
    // The traces the template's sparse VAE passes read: recorded by the
    // disaggregated workers (the inline baseline runs the VAE dense).
    let record = ctx.config.pipeline.sparse_vae == SparseVaeSetting::Auto;
    let prepare = PrepareReq {
        job,
        input: PrepareInput::Edit {
            image: image.clone(),
            mask: MaskSpec::Empty,
            vae: match record {
                true => VaeTraces::Capture,
                false => VaeTraces::None,
            },
            negative_prompt: None,
        },
        params: params.clone(),
        max_pixels: ctx.config.server.max_input_pixels as u64,
        max_tokens: ctx.config.server.max_edit_tokens() as u64,
    };
    let work = DenoiseWork::Capture {
        mode: input.cache_mode,
        step_stride: input.step_stride,
    };
    let c = if ctx.config.denoise.disaggregate {
        let loras = input.loras.clone();
        capture_disaggregated(ctx, job, prepare, work, loras, record, held).await?
    } else {
        capture_inline(ctx, job, prepare, work, held).await?
    };
    store(ctx, input, params, image, c).await
}

/// The disaggregated capture: preprocess, the capture run on a denoise worker, and
/// when the sparse VAE may serve the template's edits, the dense decode whose trace
/// they will read.
async fn capture_disaggregated(
    ctx: &Ctx,
    job: JobId,
    prepare: PrepareReq,
    work: DenoiseWork,
    loras: Vec<WireLora>,
    record: bool,
    held: &mut Held,
) -> Result<Captured, WireError> {
    let steps = prepare.params.steps;
    let prepared = preprocess(ctx, job, prepare, held).await?;
    let d = denoise(ctx, job, &prepared, steps, Vec::new(), work, loras, held).await?;
    let blob = d
        .cache
        .clone()
        .ok_or_else(|| WireError::internal("capture returned no cache"))?;
    let mut vae_traces = Vec::new();
    if record {
        // The decoder's trace is the dense decode of the final latent, recorded
        // (when sparse decodes of the template's edits can pay).
        let whole = FinishParams::whole_image(ImageFormat::Png, None);
        let fin = FinishReq {
            vae: VaeTraces::Capture,
            // Only the trace is kept: no image at the input's size to make.
            source: None,
            ..finish_req(job, &prepared, &d, whole)
        };
        let f = postprocess(ctx, job, fin, held).await?;
        vae_traces.extend(prepared.vae_trace.clone());
        vae_traces.extend(f.vae_trace);
    }
    Ok(Captured {
        blob,
        width: prepared.width,
        height: prepared.height,
        image: prepared.output_size(),
        tokens: prepared.rows * prepared.cols,
        vae_traces,
    })
}

/// The in-process baseline's capture: one denoise worker prepares and runs it.
async fn capture_inline(
    ctx: &Ctx,
    job: JobId,
    prepare: PrepareReq,
    work: DenoiseWork,
    held: &mut Held,
) -> Result<Captured, WireError> {
    let den = ctx.pick(groups::DENOISE, 1).await?;
    ctx.jobs.stage(job, JobStatus::Denoising, Some(den.clone()));
    let req = InlineReq {
        prepare,
        work,
        finish: None,
    };
    let d = ctx.ask(&den, |p| DenoiseMsg::Inline(Wire(req), p)).await?;
    held.den.push((den, d.cache.iter().cloned().collect()));
    let blob = d
        .cache
        .ok_or_else(|| WireError::internal("capture returned no cache"))?;
    Ok(Captured {
        blob,
        width: d.width,
        height: d.height,
        image: d.input_size.unwrap_or((d.width, d.height)),
        tokens: d.tokens,
        vae_traces: Vec::new(),
    })
}

/// Hands a captured template to the cache process, which answers once it is durable.
async fn store(
    ctx: &Ctx,
    input: &TemplateInput,
    params: &GenParams,
    image: Handle,
    c: Captured,
) -> Result<TemplateInfo, WireError> {
    let info = TemplateInfo {
        id: input.id.clone(),
        // The cache's (or the registry's, below), and the digest below.
        version: 0,
        digest: String::new(),
        model: ctx.model.clone(),
        width: c.width,
        height: c.height,
        image_width: c.image.0,
        image_height: c.image.1,
        tokens: c.tokens,
        steps: params.steps,
        guidance: params.guidance,
        seed: params.seed,
        prompt: params.prompt.clone(),
        max_sequence_length: params.max_sequence_length,
        cache_bytes: c.blob.len,
        created_unix: unix_now(),
        // The cache fills these in.
        kv_dtype: String::new(),
        cache_mode: String::new(),
        kv_step_stride: input.step_stride,
        vae_trace_bytes: c.vae_traces.iter().map(|h| h.len).sum(),
        tiers: TierBytes::default(),
        loras: input.loras.clone(),
    };
    let info = TemplateInfo {
        digest: digest(&info, &input.image),
        ..info
    };
    let (version, governed) = match &input.identity {
        Identity::Local => (None, false),
        Identity::New(i) => (Some(i.version), true),
        Identity::Existing(v) => (Some(*v), true),
    };
    let cache = ctx.cache().await?;
    let put = PutTemplate {
        info,
        blob: c.blob,
        image,
        vae_traces: c.vae_traces,
        // The registry decided whether the id may be taken.
        replace: input.replace || governed,
        version,
    };
    let entry = ctx.ask(&cache, |p| CacheMsg::Put(Wire(put), p)).await?;
    ctx.templates_changed();
    if let (Identity::New(intent), Some(reg)) = (&input.identity, ctx.template_registry()) {
        if let Err(e) = reg.commit(intent, &entry.info.digest).await {
            // Refused: not the template's version, it goes. Unanswered: it may be the
            // template's; kept, and dropped by the first edit that finds the registry
            // without it (`identity::confirm`).
            if e.kind == ErrorKind::Conflict {
                let _ = ctx.delete_template(&intent.id, Some(intent.version)).await;
            }
            return Err(e);
        }
    }
    Ok(entry.info)
}
