//! Denoising jobs and the batched step: full runs, template captures and mask-aware
//! edits, any mix of them in one transformer call.
//!
//! A [`Job`] is one request being denoised: its inputs, its schedule, the step it is
//! at, and its current packed latent. [`step_batch`] advances every job in a batch by
//! one step with a single forward over the packed rows of all of them, each at its own
//! step, with its own guidance, text and active set:
//!
//! - a **full** job computes every image token;
//! - a **capture** job computes every token and records each block's image K/V and
//!   the latent after the step into a [`TemplateCache`];
//! - an **edit** job computes only its active tokens, attends to the template's cached
//!   K/V for the others, and after the step copies the template's latent into its
//!   inactive tokens.
//!
//! Editing with exactly a capture's inputs reproduces the capture's latents (the
//! identity invariant): every computed row sees the same keys and values as in the full
//! run. This module is plain compute over data, with no I/O; the serving loop drives it.

use std::sync::Arc;

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::model::{FluxRequest, FluxTransformer, ForwardObserver, KvCache};
pub use super::slabs::{HostSlabs, ResidentTemplates, SlabSource, TemplateProviders};
use super::template::TemplateCache;
use crate::mask::TokenMask;
use crate::scheduler::FlowMatchEuler;

/// A request's inputs over the full token grid.
#[derive(Clone, Debug)]
pub struct DenoiseInputs {
    /// `[L, C]` packed initial latents (noise), C = the transformer's out_channels.
    pub latents: Tensor,
    /// `[L, in_channels - C]` conditioning appended to the latents on every step
    /// (Fill: packed masked-image latents, then the packed mask).
    pub cond: Tensor,
    /// `[L, 3]` image position ids.
    pub img_ids: Tensor,
    /// `[T, joint_attention_dim]` text embeddings.
    pub txt: Tensor,
    /// `[T, 3]`.
    pub txt_ids: Tensor,
    pub pooled: Vec<f32>,
    pub guidance: f32,
}

impl DenoiseInputs {
    pub fn tokens(&self) -> usize {
        self.latents.rows()
    }
}

/// What a job computes. Jobs own (or share) everything they read, so a serving loop
/// can hold them across steps while requests come and go.
pub enum Mode {
    Full,
    /// Fills this cache as the job runs; take it back with [`Job::into_parts`].
    Capture(Box<TemplateCache>),
    Edit {
        mask: Arc<TokenMask>,
        cache: Arc<TemplateCache>,
    },
}

pub struct Job {
    inputs: Arc<DenoiseInputs>,
    schedule: Arc<FlowMatchEuler>,
    step: usize,
    latents: Tensor,
    mode: Mode,
    /// Token rows computed each step, and the rest (edits only).
    active: Vec<u32>,
    inactive: Vec<u32>,
}

impl Job {
    pub fn new(
        inputs: impl Into<Arc<DenoiseInputs>>,
        schedule: impl Into<Arc<FlowMatchEuler>>,
        mode: Mode,
    ) -> Result<Self> {
        let (inputs, schedule) = (inputs.into(), schedule.into());
        let l = inputs.tokens();
        let c = inputs.latents.cols();
        if inputs.cond.rows() != l || inputs.img_ids.shape() != [l, 3] {
            return Err(Error::Invalid(format!(
                "inputs: {l} latent tokens but cond {:?} and img_ids {:?}",
                inputs.cond.shape(),
                inputs.img_ids.shape()
            )));
        }
        let (active, inactive) = match &mode {
            Mode::Full | Mode::Capture(_) => ((0..l as u32).collect(), vec![]),
            Mode::Edit { mask, cache } => {
                let lay = cache.layout();
                if mask.len() != l || lay.tokens != l || lay.latent_channels != c {
                    return Err(Error::Invalid(format!(
                        "edit of {l} tokens x {c} channels with a {}-token mask and a template of {} tokens x {} channels",
                        mask.len(),
                        lay.tokens,
                        lay.latent_channels
                    )));
                }
                if lay.steps != schedule.steps() {
                    return Err(Error::Invalid(format!(
                        "template captured with {} steps, edit asks for {}",
                        lay.steps,
                        schedule.steps()
                    )));
                }
                (mask.active().to_vec(), mask.inactive())
            }
        };
        if let Mode::Capture(cache) = &mode {
            let lay = cache.layout();
            if lay.tokens != l || lay.steps != schedule.steps() || lay.latent_channels != c {
                return Err(Error::Invalid(
                    "capture target layout does not match the inputs and schedule".into(),
                ));
            }
        }
        Ok(Job {
            latents: inputs.latents.clone(),
            inputs,
            schedule,
            step: 0,
            mode,
            active,
            inactive,
        })
    }

    pub fn step(&self) -> usize {
        self.step
    }
    pub fn done(&self) -> bool {
        self.step >= self.schedule.steps()
    }
    /// The current packed latent `[L, C]` (the final one once `done()`).
    pub fn latents(&self) -> &Tensor {
        &self.latents
    }
    pub fn into_latents(self) -> Tensor {
        self.latents
    }
    /// The final latent and, for a capture, the filled template cache.
    pub fn into_parts(self) -> (Tensor, Option<TemplateCache>) {
        let cache = match self.mode {
            Mode::Capture(c) => Some(*c),
            _ => None,
        };
        (self.latents, cache)
    }
    pub fn inputs(&self) -> &DenoiseInputs {
        &self.inputs
    }
    /// The template an edit reads; `None` for full runs and captures.
    pub fn template(&self) -> Option<&Arc<TemplateCache>> {
        match &self.mode {
            Mode::Edit { cache, .. } => Some(cache),
            _ => None,
        }
    }
    /// Image tokens computed per step.
    pub fn active_tokens(&self) -> usize {
        self.active.len()
    }
}

/// The cached K/V a job reads at its current step, fetched block by block as the
/// forward reaches each block.
struct StepKv<'a, S> {
    inactive: &'a [u32],
    cache: &'a TemplateCache,
    step: usize,
    source: &'a S,
}

impl<T, S: SlabSource<T>> KvCache<T> for StepKv<'_, S> {
    fn inactive(&self) -> &[u32] {
        self.inactive
    }
    fn block(&self, b: usize) -> Result<&T> {
        self.source.slab(self.cache, self.step, b)
    }
}

/// Collects K/V reports of capture jobs during a forward; they move into the jobs'
/// caches once the forward (which borrows the jobs) is over.
struct CaptureSink {
    capturing: Vec<bool>,
    got: Vec<(usize, usize, Tensor)>,
}

impl ForwardObserver for CaptureSink {
    fn wants_kv(&self) -> bool {
        self.capturing.iter().any(|&c| c)
    }
    fn image_kv(&mut self, req: usize, block: usize, kv: Tensor) {
        if self.capturing.get(req).copied().unwrap_or(false) {
            self.got.push((req, block, kv));
        }
    }
}

/// Advances every unfinished job by one step with one forward call (CPU backend: the
/// templates' host slabs are read in place).
pub fn step_batch<B: Backend<Tensor = Tensor>>(
    model: &FluxTransformer<B>,
    jobs: &mut [&mut Job],
) -> Result<()> {
    step_batch_with(model, jobs, &HostSlabs)
}

/// [`step_batch`] on any backend, with edits reading their cached K/V from `slabs`.
pub fn step_batch_with<B: Backend, S: SlabSource<B::Tensor>>(
    model: &FluxTransformer<B>,
    jobs: &mut [&mut Job],
    slabs: &S,
) -> Result<()> {
    let live: Vec<usize> = (0..jobs.len()).filter(|&i| !jobs[i].done()).collect();
    if live.is_empty() {
        return Ok(());
    }
    for &i in &live {
        if let Mode::Edit { cache, .. } = &jobs[i].mode {
            if !cache.is_complete() {
                return Err(Error::Invalid(
                    "edit with an incomplete template cache".into(),
                ));
            }
        }
    }
    // Inputs of the computed rows: [latent | cond] and ids, gathered per job.
    let rows: Vec<(Tensor, Tensor)> = live
        .iter()
        .map(|&i| {
            let j = &jobs[i];
            let (c, k) = (j.latents.cols(), j.inputs.cond.cols());
            let mut x = Vec::with_capacity(j.active.len() * (c + k));
            let mut ids = Vec::with_capacity(j.active.len() * 3);
            for &t in &j.active {
                x.extend_from_slice(j.latents.row(t as usize));
                x.extend_from_slice(j.inputs.cond.row(t as usize));
                ids.extend_from_slice(j.inputs.img_ids.row(t as usize));
            }
            Ok((
                Tensor::new([j.active.len(), c + k], x)?,
                Tensor::new([j.active.len(), 3], ids)?,
            ))
        })
        .collect::<Result<_>>()?;
    let kvs: Vec<Option<StepKv<'_, S>>> = live
        .iter()
        .map(|&i| match &jobs[i].mode {
            Mode::Edit { cache, .. } => {
                slabs.prepare(cache, jobs[i].step)?;
                Ok(Some(StepKv {
                    inactive: &jobs[i].inactive,
                    cache,
                    step: jobs[i].step,
                    source: slabs,
                }))
            }
            _ => Ok(None),
        })
        .collect::<Result<_>>()?;
    let reqs: Vec<FluxRequest<'_, B::Tensor>> = live
        .iter()
        .zip(&rows)
        .zip(&kvs)
        .map(|((&i, (x, ids)), kv)| {
            let j = &jobs[i];
            FluxRequest {
                img: x,
                img_ids: ids,
                txt: &j.inputs.txt,
                txt_ids: &j.inputs.txt_ids,
                pooled: &j.inputs.pooled,
                timestep: j.schedule.model_timestep(j.step),
                guidance: j.inputs.guidance,
                cache: kv.as_ref().map(|k| k as &dyn KvCache<B::Tensor>),
            }
        })
        .collect();
    let mut sink = CaptureSink {
        capturing: live
            .iter()
            .map(|&i| matches!(jobs[i].mode, Mode::Capture(_)))
            .collect(),
        got: Vec::new(),
    };
    let velocities = model.forward(&reqs, &mut sink);
    slabs.finish();
    let velocities = velocities?;
    drop(reqs);
    drop(kvs);
    for (req, block, kv) in sink.got {
        let j = &mut *jobs[live[req]];
        if let Mode::Capture(cache) = &mut j.mode {
            cache.set_kv(j.step, block, kv)?;
        }
    }
    for (&i, v) in live.iter().zip(&velocities) {
        let j = &mut *jobs[i];
        let c = j.latents.cols();
        let dt = j.schedule.sigmas[j.step + 1] - j.schedule.sigmas[j.step];
        let lat = j.latents.data_mut();
        for (r, &t) in j.active.iter().enumerate() {
            let dst = &mut lat[t as usize * c..(t as usize + 1) * c];
            for (x, dv) in dst.iter_mut().zip(v.row(r)) {
                *x += dt * dv;
            }
        }
        match &mut j.mode {
            Mode::Edit { cache, .. } => {
                let tl = cache.latent(j.step)?;
                for &t in &j.inactive {
                    let t = t as usize;
                    lat[t * c..(t + 1) * c].copy_from_slice(tl.row(t));
                }
            }
            Mode::Capture(cache) => cache.set_latent(j.step, j.latents.clone())?,
            Mode::Full => {}
        }
        j.step += 1;
    }
    Ok(())
}

/// Runs one job to the end and returns its final latent.
pub fn run<B: Backend<Tensor = Tensor>>(model: &FluxTransformer<B>, job: Job) -> Result<Tensor> {
    Ok(run_job(model, job)?.into_latents())
}

/// Runs one job to the end and returns it (see [`Job::into_parts`]).
pub fn run_job<B: Backend<Tensor = Tensor>>(
    model: &FluxTransformer<B>,
    mut job: Job,
) -> Result<Job> {
    while !job.done() {
        step_batch(model, &mut [&mut job])?;
    }
    Ok(job)
}
