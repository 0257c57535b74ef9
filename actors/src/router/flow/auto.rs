//! Templates that make themselves (`[templates] auto`; docs/api.md): an uploaded image
//! is keyed by a digest of its bytes with what its template depends on (the model, the
//! size it is computed at, the steps, guidance and text length of a capture). Its first
//! edit runs in full; the sighting that [`crate::router::state::sightings`] admits (the
//! second within the window, by default) captures it as template `auto_<digest>` (a
//! capture like `POST /v1/templates`, with that edit's prompt, steps, guidance and seed,
//! run inside the edit's job) and then runs as an edit of it; every edit after that is
//! an edit of the template, wherever it is (this pod's tiers, a peer's: the template is
//! an ordinary one, routed, copied, evicted and deleted like the others).
//!
//! The capture is its own run, not fused with the edit that triggers it: that edit
//! costs a capture plus a template edit, and its image is exactly what the same edit of
//! the template gives (no approximation beyond the template edit's own).

use sha2::{Digest, Sha256};

use super::capture::{capture, claim, TemplateInput};
use super::defaults;
use super::edit::{edit, Auto, EditInput, EditOutput, MaskIn, Source};
use crate::router::state::Ctx;
use crate::wire::pods::AutoTemplate;
use crate::wire::{ErrorKind, JobId, WireError};

/// The image's template id and sighting key, when the edit can use one: a masked edit
/// of an upload without LoRAs or ControlNets of its own (a template edit runs with its
/// template's LoRAs, so an edit with others keeps its full run; a Kontext instruction
/// edit, with no mask, computes every token and is no template edit).
fn key_of(ctx: &Ctx, input: &EditInput) -> Option<(String, [u8; 32])> {
    let Source::Image(image) = &input.source else {
        return None;
    };
    if input.auto == Auto::Off
        || matches!(input.mask, MaskIn::Whole)
        || !ctx.config.templates.auto
        || !input.loras.is_empty()
        || !input.controlnets.is_empty()
    {
        return None;
    }
    let (steps, guidance, text) = capture_params(ctx, input);
    let mut h = Sha256::new();
    h.update(b"denoised auto template v1\0");
    h.update(ctx.model.as_bytes());
    h.update([0]);
    // The size it is computed at follows from the image and this cap.
    h.update(ctx.config.server.max_megapixels.to_le_bytes());
    h.update(ctx.config.cache.mode.as_bytes());
    h.update([0]);
    h.update(steps.to_le_bytes());
    h.update(guidance.to_le_bytes());
    h.update(text.to_le_bytes());
    h.update(image);
    let key: [u8; 32] = h.finalize().into();
    let hex: String = key[..16].iter().map(|b| format!("{b:02x}")).collect();
    Some((format!("auto_{hex}"), key))
}

/// The steps, guidance and text length its template is captured with: the edit's.
fn capture_params(ctx: &Ctx, input: &EditInput) -> (u32, f32, u32) {
    (
        input.steps.unwrap_or(defaults::STEPS),
        input.guidance.unwrap_or(ctx.edit_guidance),
        input.max_sequence_length,
    )
}

/// Whether template `id` exists: here, at a peer, or in the registry.
async fn exists(ctx: &Ctx, id: &str) -> bool {
    let registered = ctx
        .template_registry()
        .and_then(|r| r.record(id))
        .is_some_and(|r| !r.deleted);
    let at_peer = ctx.pods.as_ref().is_some_and(|p| !p.holders(id).is_empty());
    registered || at_peer || ctx.template(id).await.is_ok()
}

/// Runs an edit (a request's, as it arrived), through the image's template when
/// `[templates] auto` has one or makes one now; the reply says which.
pub async fn edit_auto(ctx: &Ctx, job: JobId, input: &EditInput) -> Result<EditOutput, WireError> {
    let Some((id, key)) = key_of(ctx, input) else {
        return edit(ctx, job, input).await;
    };
    let outcome = |hit: bool, captured: bool| AutoTemplate {
        id: id.clone(),
        hit,
        captured,
    };
    let mut captured = false;
    let capturing = ctx.auto_captures.of(&id);
    let present = if exists(ctx, &id).await {
        true
    } else if input.auto == Auto::See && admitted(ctx, key) {
        let _one = capturing.lock().await;
        match capture_for(ctx, job, input, &id).await {
            Ok(()) => {
                captured = true;
                true
            }
            // Claimed meanwhile (by another request, or a peer): read it if it is there.
            Err(e) if e.kind == ErrorKind::Conflict => true,
            Err(e) if e.kind == ErrorKind::Cancelled => return Err(e),
            Err(e) => {
                tracing::warn!(
                    "capturing template {id} of an uploaded image: {}",
                    e.message
                );
                false
            }
        }
    } else if capturing.try_lock().is_err() {
        // Its capture is under way (another edit's): a template edit once it is done,
        // rather than a full run beside it.
        drop(capturing.lock().await);
        exists(ctx, &id).await
    } else {
        false
    };
    if !present {
        return full(ctx, job, input, outcome(false, false)).await;
    }
    match edit(ctx, job, &input.of(Source::Template(id.clone()))).await {
        Ok(mut o) => {
            let label = if captured { "captured" } else { "hit" };
            count(ctx, label);
            o.auto_template = Some(outcome(!captured, captured));
            Ok(o)
        }
        // Gone meanwhile (deleted, or out of every tier): the upload is still here.
        Err(e) if e.kind == ErrorKind::NotFound => {
            full(ctx, job, input, outcome(false, false)).await
        }
        Err(e) => Err(e),
    }
}

/// The edit's full run, reported as a miss.
async fn full(
    ctx: &Ctx,
    job: JobId,
    input: &EditInput,
    miss: AutoTemplate,
) -> Result<EditOutput, WireError> {
    let mut o = edit(ctx, job, input).await?;
    count(ctx, "miss");
    o.auto_template = Some(miss);
    Ok(o)
}

fn count(ctx: &Ctx, outcome: &'static str) {
    let m = &ctx.metrics.auto_templates;
    m.get_or_create(&[("outcome", outcome)]).inc();
}

/// Counts a sighting of the image; whether it is admitted (to be captured).
fn admitted(ctx: &Ctx, key: [u8; 32]) -> bool {
    let now = crate::daemon::unix_now();
    let mut s = ctx.sightings.lock().unwrap_or_else(|e| e.into_inner());
    s.see(key, now)
}

/// Captures the edit's image as template `id`, with the edit's prompt, steps, guidance,
/// seed and text length, as `POST /v1/templates` would (the id claimed in the registry
/// when there is one; the reply once it is durable).
async fn capture_for(ctx: &Ctx, job: JobId, input: &EditInput, id: &str) -> Result<(), WireError> {
    let Source::Image(image) = &input.source else {
        return Err(WireError::internal(
            "a template edit has no image to capture",
        ));
    };
    let (steps, guidance, max_sequence_length) = capture_params(ctx, input);
    let t = TemplateInput {
        id: id.to_string(),
        image: image.clone(),
        prompt: input.prompt.clone(),
        steps,
        guidance,
        seed: input.seed,
        max_sequence_length,
        replace: false,
        identity: claim(ctx, id, false).await?,
        cache_mode: ctx.config.cache.mode.parse().map_err(WireError::internal)?,
        step_stride: ctx.config.cache.kv_step_stride,
        loras: vec![],
    };
    capture(ctx, job, &t).await.map(drop)
}
