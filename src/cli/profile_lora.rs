//! `denoised bench profile-lora`: K of bounded asynchronous loading for one (model, LoRA)
//! pair (docs/design.md §Adapters). The same generation runs with and without the LoRA in
//! one batch; K is the first step whose latents with and without it fall below a
//! cosine similarity (0.99): the steps before it barely depend on the LoRA, so a
//! request may run them on the base weights while the LoRA loads. `--write` records
//! K for the model's fingerprint beside the adapter (`bal.json` in its directory, or
//! `NAME.bal.json` beside a file), where the daemon's router reads it.

use std::path::{Path, PathBuf};

use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::edit::Mode;
use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::stepper::JobKey;
use denoised_models::pipeline::flux_fill::Timings;
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::ModelSource;
use serde_json::{json, Value};

use super::adapters::LoraSpec;
use super::edit::load_pipeline;
use super::{CliResult, ModelDeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A text-to-image model (FluxPipeline directory or `builtin:t2i`,
    /// `builtin:flux-small-t2i`).
    #[arg(long, env = "DENOISED_MODEL", default_value = "builtin:t2i")]
    pub model: ModelSource,
    /// The LoRA, `PATH[:SCALE]` (see `denoised generate --lora`).
    #[arg(long)]
    pub lora: LoraSpec,
    /// The prompt of the profiling run.
    #[arg(long, default_value = "a photograph of a red fox in the snow")]
    pub prompt: String,
    /// Steps of the profiling run: K is in steps of this schedule.
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    #[arg(long, default_value_t = 3.5)]
    pub guidance: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Image side in pixels [default: the model's, 1024 for FLUX.1].
    #[arg(long)]
    pub size: Option<usize>,
    #[arg(long, default_value_t = 512)]
    pub max_sequence_length: usize,
    /// The cosine similarity below which the LoRA's effect counts.
    #[arg(long, default_value_t = 0.99)]
    pub threshold: f64,
    /// Record K beside the adapter for this model (the daemon's router reads it).
    #[arg(long)]
    pub write: bool,
    #[command(flatten)]
    pub device: ModelDeviceArgs,
}

/// The cosine similarity of two equally long vectors (in f64).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt()).max(f64::MIN_POSITIVE)
}

/// K from the similarities after each step: the first step whose similarity is below
/// `threshold`, at most the last step (a LoRA always applies to one step at least).
pub fn k_of(similarity: &[f64], threshold: f64) -> usize {
    let last = similarity.len().saturating_sub(1);
    similarity
        .iter()
        .position(|&s| s < threshold)
        .unwrap_or(last)
        .min(last)
}

/// Where an adapter's K is recorded (the router's `adapters::profiled_k` reads it).
pub fn bal_file(adapter: &Path) -> PathBuf {
    if adapter.is_dir() {
        adapter.join("bal.json")
    } else {
        adapter.with_extension("bal.json")
    }
}

pub fn run(a: Args) -> CliResult {
    let (p, mut placed) = load_pipeline(&a.model, &a.device, 2048 * 2048)?;
    let side = a.size.unwrap_or_else(|| p.default_side());
    let opts = GenerateOptions {
        steps: a.steps,
        guidance: a.guidance,
        seed: a.seed,
        max_sequence_length: a.max_sequence_length,
        width: side,
        height: side,
    };
    let file = LoraFile::open(&a.lora.path, &p.config)?;
    let prepared = p.prepare_generate(&a.prompt, &opts, None, &mut Timings::default())?;
    let schedule = std::sync::Arc::new(p.schedule(a.steps, side, side)?);
    let st = &mut placed.stepper;
    let id = st.add_lora(&file)?;
    const BASE: JobKey = 0;
    const ADAPTED: JobKey = 1;
    for key in [BASE, ADAPTED] {
        st.admit(key, &prepared.inputs, schedule.clone(), Mode::Full)?;
    }
    st.set_loras(
        ADAPTED,
        vec![LoraUse {
            id,
            scale: a.lora.scale as f32,
        }],
    )?;
    let mut similarity = Vec::with_capacity(a.steps);
    while !st.done(BASE) {
        st.step(&[BASE, ADAPTED])?;
        let (x, y) = (st.latents(BASE)?, st.latents(ADAPTED)?);
        similarity.push(cosine(x.data(), y.data()));
    }
    let k = k_of(&similarity, a.threshold);
    let fingerprint = a.model.fingerprint()?;
    let line = json!({
        "model": fingerprint,
        "lora": file.fingerprint,
        "scale": a.lora.scale,
        "steps": a.steps,
        "size": side,
        "threshold": a.threshold,
        "k": k,
        "similarity": similarity,
    });
    println!("{line}");
    if a.write {
        let path = bal_file(&a.lora.path);
        let mut all: Value = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| json!({}));
        all[&fingerprint] = json!({
            "k": k, "steps": a.steps, "threshold": a.threshold, "lora": file.fingerprint,
        });
        std::fs::write(&path, serde_json::to_vec_pretty(&all)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!(
            "bench profile-lora: K = {k} of {} steps, written to {}",
            a.steps,
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_is_the_first_step_below_the_threshold_and_at_most_the_last() {
        assert_eq!(k_of(&[1.0, 0.999, 0.98, 0.9], 0.99), 2);
        assert_eq!(k_of(&[0.5, 0.4], 0.99), 0);
        assert_eq!(
            k_of(&[1.0, 1.0, 1.0], 0.99),
            2,
            "never below: the last step"
        );
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
    }
}
