//! Denoising jobs and the batched step: full runs, template captures and mask-aware
//! edits, any mix of them in one transformer call.
//!
//! A [`Job`] is one request being denoised on the model's device: its tensors there
//! (uploaded once when it is created, see [`RequestTensors`]), its schedule and the
//! step it is at. [`step_batch_with`] advances every job in a batch by one step with a
//! single forward over the packed rows of all of them, each at its own step, with its
//! own guidance, text and active set:
//!
//! - a **full** job computes every image token;
//! - a **capture** job computes every token and stores each block's slab (image K/V,
//!   or in Y mode the block's output) and the latent after the step into its
//!   [`TemplateCache`] (asynchronously on a device: `Backend::store`);
//! - an **edit** job computes only its active tokens and attends to the template's
//!   cached K/V for the others (read, or in Y mode recomputed from the cached block
//!   outputs). Its inactive tokens' latents are not kept: at the end they take the
//!   template's final latent ([`Job::finish`]).
//!
//! The step's plan (one [`Choice`] per block) says which blocks compute every token of
//! the edits instead. A Kontext request's reference tokens ride after its noisy ones
//! ([`super::grid`]): a full run or a capture computes them, and an edit of a Kontext
//! template reads them from it with its other inactive rows.
//!
//! The Euler update runs on the device (`Backend::axpy_cols`), so a step moves no
//! latents between host and device. Editing with exactly a capture's inputs reproduces
//! the capture's latents (the identity invariant): every computed row sees the same
//! keys and values as in the full run. This module is plain compute over data, with no
//! I/O; the serving loop drives it.

use std::sync::Arc;

use denoised_runtime::{Backend, DType, Error, Result, Tensor};

use super::adapters::LoraUse;
use super::cost::StepShape;
use super::grid::{job_rows, RestHost};
use super::model::{BlockCache, FluxTransformer, ForwardObserver};
pub use super::reference::{Inpaint, Reference};
use super::request::{Control, RequestTensors, RestRows, StepRequest};
pub use super::slabs::{DeviceTemplates, SlabSource};
use super::template::{CacheMode, TemplateCache};
use crate::mask::TokenMask;
use crate::planner::Choice;
use crate::scheduler::FlowMatchEuler;

/// A request's inputs over the full token grid, on the host.
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
    /// FLUX.1 Kontext's reference image, when the request has one.
    pub reference: Option<Reference>,
}

impl DenoiseInputs {
    /// The noisy image tokens (a Kontext request's reference tokens are not counted).
    pub fn tokens(&self) -> usize {
        self.latents.rows()
    }
}

/// The negative branch of true classifier-free guidance (FluxPipeline's
/// `negative_prompt` with `true_cfg_scale > 1`): each step also runs the transformer on
/// the negative prompt's embeddings, and the step follows `neg + scale * (pos - neg)`.
#[derive(Clone, Debug)]
pub struct TrueCfg {
    /// `[T', joint_attention_dim]` and `[T', 3]`: the negative prompt's T5 embeddings.
    pub txt: Tensor,
    pub txt_ids: Tensor,
    pub pooled: Vec<f32>,
    pub scale: f32,
}

/// The other half of a true-CFG generation whose two branches run on two denoise
/// workers (docs/design.md §Adapters, parallel CFG branches): each worker runs one branch as
/// a job of its own and, every step, hands its velocity over and takes the other's, so
/// both take the same step `dt s v_pos + dt (1 - s) v_neg` and their latents stay equal.
pub trait CfgPartner: Send + Sync {
    /// Whether this job is the positive branch.
    fn positive(&self) -> bool;
    fn scale(&self) -> f32;
    /// Publishes this branch's velocity of `step` (`[N, C]`) and returns the other's,
    /// waiting for it.
    fn exchange(&self, step: usize, mine: &[f32]) -> Result<Vec<f32>>;
}

/// What a job computes.
pub enum Mode {
    Full,
    /// Fills this (writable, empty) cache as the job runs; [`Job::finish`] gives it
    /// back complete.
    Capture(TemplateCache),
    Edit {
        mask: Arc<TokenMask>,
        cache: Arc<TemplateCache>,
    },
}

/// One request being denoised; `T` is the tensor type of the model's backend.
pub struct Job<T> {
    tensors: RequestTensors<T>,
    guidance: f32,
    schedule: Arc<FlowMatchEuler>,
    step: usize,
    mode: Mode,
    /// Token rows computed each step, and the rest (edits only).
    active: Vec<u32>,
    inactive: Vec<u32>,
    /// Kontext reference rows computed after the active ones and never stepped (an
    /// edit of a template reads them from it instead: they are among its inactive rows).
    reference: usize,
    /// Rows of its token grid: the noisy tokens, then a Kontext request's reference
    /// tokens (a Kontext template caches both).
    grid: usize,
    /// A Kontext masked edit's hold on the unmasked latents, applied after each step.
    inpaint: Option<Inpaint>,
    /// An edit's inactive rows for planned full blocks and Y-mode templates: their
    /// inputs on the host, and on the device once a step first needs them.
    rest_host: Option<RestHost>,
    rest: Option<RestRows<T>>,
    tokens: usize,
    latent_channels: usize,
    /// The unmerged LoRAs its next steps run with.
    loras: Vec<LoraUse>,
    /// True CFG: the negative branch's tensors (its image rows kept equal to the
    /// job's) and the scale.
    cfg: Option<(RequestTensors<T>, f32)>,
    /// ControlNet residuals for its next step (set before each step, taken by it).
    control: Option<Arc<dyn Control<T> + Send>>,
    /// True CFG's other branch, on another worker.
    partner: Option<Arc<dyn CfgPartner>>,
}

impl<T> Job<T> {
    /// Checks a request and uploads its tensors to the model's device.
    pub fn new<B: Backend<Tensor = T>>(
        model: &FluxTransformer<B>,
        inputs: &DenoiseInputs,
        schedule: impl Into<Arc<FlowMatchEuler>>,
        mode: Mode,
    ) -> Result<Self> {
        let schedule = schedule.into();
        let l = inputs.tokens();
        let grid = l + inputs.reference.as_ref().map_or(0, |r| r.latents.rows());
        let c = inputs.latents.cols();
        if inputs.cond.rows() != l || inputs.img_ids.shape() != [l, 3] {
            return Err(Error::Invalid(format!(
                "inputs: {l} latent tokens but cond {:?} and img_ids {:?}",
                inputs.cond.shape(),
                inputs.img_ids.shape()
            )));
        }
        let check = |what: &str, cache: &TemplateCache| -> Result<()> {
            let lay = cache.layout();
            if lay.tokens != grid || lay.latent_channels != c || lay.steps != schedule.steps() {
                return Err(Error::Invalid(format!(
                    "{what} of {grid} tokens x {c} channels x {} steps with a template of {} tokens x {} channels x {} steps",
                    schedule.steps(),
                    lay.tokens,
                    lay.latent_channels,
                    lay.steps
                )));
            }
            Ok(())
        };
        let (active, inactive) = match &mode {
            Mode::Full => ((0..l as u32).collect(), vec![]),
            Mode::Capture(cache) => {
                check("capture", cache)?;
                if !cache.bytes().writable() || cache.is_complete() {
                    return Err(Error::Invalid(
                        "a capture needs an empty, writable template cache".into(),
                    ));
                }
                ((0..l as u32).collect(), vec![])
            }
            Mode::Edit { mask, cache } => {
                check("edit", cache)?;
                if mask.len() != l {
                    return Err(Error::Invalid(format!(
                        "edit of {l} tokens with a {}-token mask",
                        mask.len()
                    )));
                }
                if !cache.is_complete() {
                    return Err(Error::Invalid(
                        "edit with an incomplete template cache".into(),
                    ));
                }
                // A Kontext template's reference rows follow the noisy ones: inactive.
                let mut inactive = mask.inactive();
                inactive.extend(l as u32..grid as u32);
                (mask.active().to_vec(), inactive)
            }
        };
        let mut inpaint = inputs.reference.as_ref().and_then(|r| r.inpaint.clone());
        if let Some(ip) = &inpaint {
            for t in [&ip.mask, &ip.image, &ip.noise] {
                if t.shape() != [l, c] {
                    return Err(Error::Invalid(format!(
                        "inpaint tensors {:?} for {l} tokens of {c} channels",
                        t.shape()
                    )));
                }
            }
        }
        // An edit computes its active rows only: its hold covers those.
        let computes_reference = !matches!(mode, Mode::Edit { .. });
        if !computes_reference {
            inpaint = inpaint.map(|ip| ip.rows(&active));
        }
        let (img, ids) = job_rows(inputs, &active, computes_reference)?;
        let tensors = RequestTensors::upload(
            model.backend(),
            &model.config,
            &img,
            &ids,
            &inputs.txt,
            &inputs.txt_ids,
            &inputs.pooled,
        )?;
        if let Mode::Capture(cache) = &mode {
            model.backend().pin_host(cache.bytes().memory())?;
        }
        let rest_host = match inactive.is_empty() {
            true => None,
            false => Some(RestHost::new(inputs, &inactive)?),
        };
        Ok(Job {
            tensors,
            guidance: inputs.guidance,
            schedule,
            step: 0,
            mode,
            reference: img.rows() - active.len(),
            grid,
            inpaint,
            active,
            inactive,
            rest_host,
            rest: None,
            tokens: l,
            latent_channels: c,
            loras: vec![],
            cfg: None,
            control: None,
            partner: None,
        })
    }

    /// The ControlNet residuals of its next step (computed from
    /// [`Job::control_latents`] now; see `controlnet::ControlNet`), used by that step
    /// only: residuals belong to the latents they were computed from. They carry one
    /// row per computed row: an edit's active rows only (its inactive rows follow the
    /// template, which ran without them).
    pub fn set_control(&mut self, control: Option<Arc<dyn Control<T> + Send>>) {
        self.control = control;
    }

    /// Whether it runs true CFG's negative branch (here or on a partner's worker).
    pub fn has_true_cfg(&self) -> bool {
        self.cfg.is_some() || self.partner.is_some()
    }

    /// Makes a full run, before its first step, one branch of a true-CFG generation
    /// split across two workers (see [`CfgPartner`]).
    pub fn set_cfg_partner(&mut self, partner: Arc<dyn CfgPartner>) -> Result<()> {
        if !matches!(self.mode, Mode::Full)
            || self.step != 0
            || self.inpaint.is_some()
            || self.cfg.is_some()
            || self.control.is_some()
            || !partner.scale().is_finite()
        {
            return Err(Error::Invalid(
                "a split true-CFG branch is a generation's full run, from its first step, with a finite scale".into(),
            ));
        }
        self.partner = Some(partner);
        Ok(())
    }

    /// Whether it computes every image token (a generation, not an edit).
    pub fn is_full(&self) -> bool {
        matches!(self.mode, Mode::Full)
    }

    /// Adds true CFG's negative branch to a full run or an edit, before it steps:
    /// `inputs` are the job's own (its computed image rows are the negative
    /// branch's too). An edit's negative branch computes its active rows against the
    /// same template as the positive one (the unmasked tokens' cached K/V: the shared
    /// context, as the positive branch reads it).
    pub fn set_true_cfg<B: Backend<Tensor = T>>(
        &mut self,
        model: &FluxTransformer<B>,
        inputs: &DenoiseInputs,
        cfg: &TrueCfg,
    ) -> Result<()> {
        // A full run may have resumed from an approximate-cache state (a later step):
        // its image rows are the negative branch's there too.
        if self.inpaint.is_some() {
            return Err(Error::Invalid(
                "true CFG with a masked Kontext edit is not built yet".into(),
            ));
        }
        if matches!(self.mode, Mode::Capture(_)) || !cfg.scale.is_finite() || self.partner.is_some()
        {
            return Err(Error::Invalid(
                "true CFG runs on full runs and edits (not captures), with a finite scale".into(),
            ));
        }
        let (img, ids) = job_rows(inputs, &self.active, self.reference > 0)?;
        let tensors = RequestTensors::upload(
            model.backend(),
            &model.config,
            &img,
            &ids,
            &cfg.txt,
            &cfg.txt_ids,
            &cfg.pooled,
        )?;
        self.cfg = Some((tensors, cfg.scale));
        Ok(())
    }

    /// Sets the unmerged LoRAs of its steps from the next one on (registered on the
    /// model that steps it): at admission, or at a step boundary when an adapter it
    /// waited for has loaded (bounded asynchronous loading).
    pub fn set_loras(&mut self, loras: Vec<LoraUse>) {
        self.loras = loras;
    }
    pub fn loras(&self) -> &[LoraUse] {
        &self.loras
    }

    /// This full job resumed after step `k` of its schedule: its latents are a state
    /// after `k` steps (an approximate-cache hit, text-to-image), and it runs the
    /// schedule's remaining sigmas. Only full runs (captures and edits need every step).
    pub fn starting_at(mut self, k: usize) -> Result<Self> {
        if !matches!(self.mode, Mode::Full) || self.step != 0 || k >= self.schedule.steps() {
            return Err(Error::Invalid(format!(
                "a job resumes at a step before its last ({} steps), once, and only a full run: step {k}",
                self.schedule.steps()
            )));
        }
        self.step = k;
        Ok(self)
    }
    pub fn step(&self) -> usize {
        self.step
    }
    pub fn done(&self) -> bool {
        self.step >= self.schedule.steps()
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
    /// The shape of its steps, for costs.
    pub fn shape(&self) -> StepShape {
        StepShape {
            text: self.tensors.txt_rows(),
            active: self.active.len() + self.reference,
            image: self.grid,
        }
    }

    /// The latent of the rows it computes, `[A, C]` (every row for a full run or a
    /// capture), as it is after the steps run so far.
    pub fn computed_latents<B: Backend<Tensor = T>>(
        &self,
        model: &FluxTransformer<B>,
    ) -> Result<Tensor> {
        let be = model.backend();
        let (a, c) = (self.active.len(), self.latent_channels);
        be.download(&be.gather_cols(&self.tensors.img, 0..a, 0..c)?)
    }

    /// The latents a ControlNet reads at its current step, `[L, C]` over the full
    /// grid: the computed rows' and, for an edit, the inactive rows' from the template
    /// (as its full blocks see them, [`RestHost`]).
    pub fn control_latents<B: Backend<Tensor = T>>(
        &self,
        model: &FluxTransformer<B>,
    ) -> Result<Tensor> {
        let mine = self.computed_latents(model)?;
        let (Some(host), Mode::Edit { cache, .. }) = (&self.rest_host, &self.mode) else {
            return Ok(mine);
        };
        let c = self.latent_channels;
        let mut out = Tensor::zeros([self.tokens, c]);
        let data = out.data_mut();
        let rest = host.latent(cache, &self.inactive, self.step)?;
        for (rows, from) in [(&self.inactive, &rest), (&self.active, &mine)] {
            // Reference rows (after the grid's noisy ones) are not latents to steer.
            for (r, &t) in rows
                .iter()
                .enumerate()
                .filter(|(_, &t)| (t as usize) < self.tokens)
            {
                let t = t as usize;
                data[t * c..(t + 1) * c].copy_from_slice(from.row(r));
            }
        }
        Ok(out)
    }

    /// The final packed latent `[L, C]` (downloaded once, here) and, for a capture,
    /// its template cache, complete. An edit's inactive tokens take the template's
    /// final latent.
    pub fn finish<B: Backend<Tensor = T>>(
        self,
        model: &FluxTransformer<B>,
    ) -> Result<(Tensor, Option<TemplateCache>)> {
        if !self.done() {
            return Err(Error::Invalid(format!(
                "a job at step {} of {} is not finished",
                self.step,
                self.schedule.steps()
            )));
        }
        let be = model.backend();
        let mine = self.computed_latents(model)?;
        match self.mode {
            Mode::Full => Ok((mine, None)),
            Mode::Capture(mut cache) => {
                be.flush_stores()?;
                cache.mark_complete();
                Ok((mine, Some(cache)))
            }
            Mode::Edit { .. } => Ok((self.over_template(&mine)?, None)),
        }
    }

    /// An edit's computed rows `mine` over the template's final latent (its inactive
    /// tokens' result); other jobs' rows are the whole grid already.
    fn over_template(&self, mine: &Tensor) -> Result<Tensor> {
        let Mode::Edit { cache, .. } = &self.mode else {
            return Ok(mine.clone());
        };
        let c = self.latent_channels;
        // A Kontext template's latents carry its reference rows after the noisy ones.
        let mut out = cache.latent(self.schedule.steps() - 1)?;
        if out.rows() > self.tokens {
            out = Tensor::new([self.tokens, c], out.data()[..self.tokens * c].to_vec())?;
        }
        let data = out.data_mut();
        for (r, &t) in self.active.iter().enumerate() {
            let t = t as usize;
            data[t * c..(t + 1) * c].copy_from_slice(mine.row(r));
        }
        Ok(out)
    }

    /// The model's estimate of the clean latent after the step just taken, over the
    /// full grid, from the computed latents `before` that step
    /// ([`computed_latents`](Self::computed_latents)) and after it: on the straight
    /// flow-matching path `x_s = x0 + s (noise - x0)` the step moved by `dt * v`, so
    /// `x0 = after - s_next * v` with `v = (after - before) / dt`. This holds whatever
    /// made the velocity (true CFG, a partner's), so the step itself is untouched. An
    /// edit's inactive tokens show the template's result. For previews.
    pub fn clean_estimate<B: Backend<Tensor = T>>(
        &self,
        model: &FluxTransformer<B>,
        before: &Tensor,
    ) -> Result<Tensor> {
        if self.step == 0 || before.shape() != [self.active.len(), self.latent_channels] {
            return Err(Error::Invalid(format!(
                "a clean estimate at step {} from latents of shape {:?}",
                self.step,
                before.shape()
            )));
        }
        let sig = &self.schedule.sigmas;
        let (next, dt) = (sig[self.step], sig[self.step] - sig[self.step - 1]);
        let mut x0 = self.computed_latents(model)?;
        let k = next / dt;
        for (a, b) in x0.data_mut().iter_mut().zip(before.data()) {
            *a -= k * (*a - b);
        }
        self.over_template(&x0)
    }
}

impl<T> Job<T> {
    /// Whether its step with `plan` needs its inactive rows: an edit whose template
    /// is in Y mode (its K/V are recomputed from them), or whose plan has full blocks.
    fn needs_rest(&self, plan: &[Choice]) -> bool {
        match &self.mode {
            Mode::Edit { cache, .. } if !self.inactive.is_empty() => {
                cache.layout().mode == CacheMode::Y || plan.contains(&Choice::Full)
            }
            _ => false,
        }
    }

    /// Puts an edit's inactive rows at its current step on the device.
    fn prepare_rest<B: Backend<Tensor = T>>(&mut self, model: &FluxTransformer<B>) -> Result<()> {
        let (Some(host), Mode::Edit { cache, .. }) = (&self.rest_host, &self.mode) else {
            return Ok(());
        };
        let img = host.rows(cache, &self.inactive, self.step)?;
        match &mut self.rest {
            Some(rest) => rest.set_img(model.backend(), &img),
            None => {
                self.rest = Some(RestRows::upload(
                    model.backend(),
                    &model.config,
                    &img,
                    &host.ids,
                )?);
                Ok(())
            }
        }
    }
}

/// The template slabs `plan` reads of a template in `mode`: the cached blocks' K/V, or
/// in Y mode the outputs of the cached blocks but the last (the next block's input).
pub fn slabs_read(mode: CacheMode, plan: &[Choice]) -> Vec<usize> {
    let n = match mode {
        CacheMode::Kv => plan.len(),
        CacheMode::Y => plan.len().saturating_sub(1),
    };
    (0..n).filter(|&b| plan[b] == Choice::Cached).collect()
}

/// The template cache a job reads at its current step, fetched block by block as the
/// forward reaches each block.
struct StepCache<'a, S> {
    inactive: &'a [u32],
    cache: &'a TemplateCache,
    step: usize,
    source: &'a S,
}

impl<T, S: SlabSource<T>> BlockCache<T> for StepCache<'_, S> {
    fn inactive(&self) -> &[u32] {
        self.inactive
    }
    fn mode(&self) -> CacheMode {
        self.cache.layout().mode
    }
    fn block(&self, b: usize) -> Result<&T> {
        self.source.slab(self.cache, self.step, b)
    }
}

/// Stores the slabs of capture jobs into their caches as the forward produces them.
struct CaptureSink<'a, B: Backend> {
    backend: &'a B,
    /// Per request of the forward: the cache it captures into, and its step.
    targets: Vec<Option<(&'a TemplateCache, usize)>>,
}

impl<B: Backend> ForwardObserver<B::Tensor> for CaptureSink<'_, B> {
    fn captures(&self, req: usize) -> Option<CacheMode> {
        self.targets.get(req)?.map(|(cache, _)| cache.layout().mode)
    }
    fn block_slab(&mut self, req: usize, block: usize, slab: &B::Tensor) -> Result<()> {
        if let Some(Some((cache, step))) = self.targets.get(req) {
            let l = cache.layout();
            if !l.stores(*step) {
                return Ok(()); // step sharing: another step's slabs stand for this one
            }
            let dst = cache.slab_slice(*step, block)?;
            match l.dtype {
                // Quantised once, here, where the capture computed it.
                DType::F8E4M3 => self.backend.store_fp8(slab, &dst, l.slab_shape().groups)?,
                dt => self.backend.store(slab, &dst, dt)?,
            }
        }
        Ok(())
    }
}

/// Advances every unfinished job by one step with one forward call following `plan`
/// (one choice per block; with KV-mode templates its full blocks form a prefix), edits
/// reading their template slabs from `slabs`.
pub fn step_batch_with<B: Backend, S: SlabSource<B::Tensor>>(
    model: &FluxTransformer<B>,
    jobs: &mut [&mut Job<B::Tensor>],
    slabs: &S,
    plan: &[Choice],
) -> Result<()> {
    let live: Vec<usize> = (0..jobs.len()).filter(|&i| !jobs[i].done()).collect();
    if live.is_empty() {
        return Ok(());
    }
    let rest: Vec<bool> = live.iter().map(|&i| jobs[i].needs_rest(plan)).collect();
    for (&i, _) in live.iter().zip(&rest).filter(|(_, &r)| r) {
        jobs[i].prepare_rest(model)?;
    }
    let be = model.backend();
    let kvs: Vec<Option<StepCache<'_, S>>> = live
        .iter()
        .map(|&i| match &jobs[i].mode {
            Mode::Edit { cache, .. } => {
                // An edit that computes every token reads no slab.
                if !jobs[i].inactive.is_empty() {
                    let read = slabs_read(cache.layout().mode, plan);
                    slabs.prepare(cache, jobs[i].step, &read)?;
                }
                Ok(Some(StepCache {
                    inactive: &jobs[i].inactive,
                    cache,
                    step: jobs[i].step,
                    source: slabs,
                }))
            }
            _ => Ok(None),
        })
        .collect::<Result<_>>()?;
    let mut reqs: Vec<StepRequest<'_, B::Tensor>> = live
        .iter()
        .zip(&kvs)
        .zip(&rest)
        .map(|((&i, kv), &rest)| {
            let j = &jobs[i];
            StepRequest {
                tensors: &j.tensors,
                timestep: j.schedule.model_timestep(j.step),
                guidance: j.guidance,
                cache: kv.as_ref().map(|k| k as &dyn BlockCache<B::Tensor>),
                rest: j.rest.as_ref().filter(|_| rest),
                loras: &j.loras,
                control: j.control.as_deref().map(|c| c as &dyn Control<B::Tensor>),
            }
        })
        .collect();
    // True CFG's negative branches run in the same forward, after every positive one
    // (request `live.len() + n` is the n-th job with a negative branch); an edit's
    // reads its positive branch's template and inactive rows.
    for (n, &i) in live.iter().enumerate() {
        let j = &jobs[i];
        let Some((tensors, _)) = &j.cfg else {
            continue;
        };
        reqs.push(StepRequest { tensors, ..reqs[n] });
    }
    let mut sink = CaptureSink {
        backend: be,
        targets: live
            .iter()
            .map(|&i| match &jobs[i].mode {
                Mode::Capture(cache) => Some((cache, jobs[i].step)),
                _ => None,
            })
            .collect(),
    };
    let velocity = model.forward_step(&reqs, plan, &mut sink);
    slabs.finish();
    let velocity = velocity?;
    drop(sink);
    drop(reqs);
    drop(kvs);
    let mut negative_rows = velocity.rows[live.len()..].iter();
    for (&i, rows) in live.iter().zip(&velocity.rows) {
        let j = &mut *jobs[i];
        let c = j.latent_channels;
        // The rows the step moves: a Kontext job's reference rows (after them) stay.
        let rows = &(rows.start..rows.start + j.active.len());
        let dt = j.schedule.sigmas[j.step + 1] - j.schedule.sigmas[j.step];
        if let Some(p) = &j.partner {
            // The same step as a batched negative branch takes, from the other
            // worker's velocity (an exact copy of what it computed).
            let mine = be.download(&be.gather_cols(&velocity.packed, rows.clone(), 0..c)?)?;
            let other = p.exchange(j.step, mine.data())?;
            let other = be.upload(&Tensor::new([rows.len(), c], other)?)?;
            let s = p.scale();
            let (pos, pos_rows, neg, neg_rows) = match p.positive() {
                true => (&velocity.packed, rows.clone(), &other, 0..rows.len()),
                false => (&other, 0..rows.len(), &velocity.packed, rows.clone()),
            };
            be.axpy_cols(&mut j.tensors.img, 0..c, pos, pos_rows, dt * s)?;
            be.axpy_cols(&mut j.tensors.img, 0..c, neg, neg_rows, dt * (1.0 - s))?;
            j.step += 1;
            j.control = None;
            continue;
        }
        if let Some((neg, scale)) = &mut j.cfg {
            // x += dt (v_neg + s (v_pos - v_neg)) = dt s v_pos + dt (1 - s) v_neg, on
            // both branches' rows (they stay equal).
            let nr = negative_rows.next().expect("a negative branch's rows");
            let nr = nr.start..nr.start + j.active.len();
            let v = &velocity.packed;
            for img in [&mut j.tensors.img, &mut neg.img] {
                be.axpy_cols(img, 0..c, v, rows.clone(), dt * *scale)?;
                be.axpy_cols(img, 0..c, v, nr.clone(), dt * (1.0 - *scale))?;
            }
            j.step += 1;
            j.control = None;
            continue;
        }
        be.axpy_cols(&mut j.tensors.img, 0..c, &velocity.packed, rows.clone(), dt)?;
        if let Some(ip) = &j.inpaint {
            // On the host: a download and an upload of the job's rows per step (a
            // device kernel for it is not written yet).
            let mut x = be.download(&j.tensors.img)?;
            let width = x.cols();
            ip.hold(x.data_mut(), width, j.schedule.sigmas[j.step + 1]);
            j.tensors.img = be.upload(&x)?;
        }
        if let Mode::Capture(cache) = &j.mode {
            // Every row, a Kontext capture's reference rows too (its template's grid).
            let latent = be.gather_cols(&j.tensors.img, 0..j.grid, 0..c)?;
            be.store(&latent, &cache.latent_slice(j.step)?, DType::F32)?;
        }
        j.step += 1;
        j.control = None;
    }
    Ok(())
}

/// Runs one job to the end on a model whose edits read templates from `slabs`, and
/// returns its final latent and, for a capture, its template (see [`Job::finish`]).
pub fn run_to_end<B: Backend, S: SlabSource<B::Tensor>>(
    model: &FluxTransformer<B>,
    mut job: Job<B::Tensor>,
    slabs: &S,
) -> Result<(Tensor, Option<TemplateCache>)> {
    let plan = vec![Choice::Cached; model.num_blocks()];
    while !job.done() {
        step_batch_with(model, &mut [&mut job], slabs, &plan)?;
    }
    job.finish(model)
}
