//! ControlNet residuals fed to the denoise loop from the host (docs/design.md §Adapters).
//!
//! A job with ControlNets gets a [`ControlFeed`]: before each of its steps the stepper
//! hands the feed the job's latents ([`ControlFeed::begin`]), and the step's forward
//! asks for each block's residual as it reaches the block ([`FeedControl`], uploading it
//! then). Two feeds exist: [`LocalControl`] computes them in process, sequentially,
//! before the step (the CLI); the ControlNet service's client (the daemon's denoise
//! workers) returns from `begin` at once and waits, block by block, for residuals
//! another process streams into shared memory. Both sum with [`run_summed`], so they
//! agree bit for bit.

use std::sync::{Arc, Mutex, OnceLock};

use denoised_runtime::{Backend, CpuBackend, Error, Result, Tensor};

use super::controlnet::{intervals, run_summed, ControlNet};
use super::edit::DenoiseInputs;
use super::model::{FluxRequest, FluxTransformer};
use super::request::Control;
use crate::scheduler::FlowMatchEuler;

/// The residuals a feed gives per step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FeedLayout {
    /// Residual blocks: the ControlNets' double blocks, then single blocks.
    pub doubles: usize,
    pub singles: usize,
    /// Each `[rows, hidden]`.
    pub rows: usize,
    pub hidden: usize,
    /// The scale they are added with (see [`super::controlnet::sum`]).
    pub scale: f32,
}

impl FeedLayout {
    pub fn blocks(&self) -> usize {
        self.doubles + self.singles
    }
}

/// A job's ControlNet residuals, step by step.
pub trait ControlFeed: Send + Sync {
    fn layout(&self) -> FeedLayout;
    /// Starts step `step` from the job's packed latents now, `[rows, C]`.
    fn begin(&self, step: usize, latents: &Tensor) -> Result<()>;
    /// Runs `f` on residual `k` (double blocks first) of the step begun last, once
    /// it is there.
    fn with_residual(&self, k: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()>;
}

/// A feed's residuals of one step as the transformer reads them: each uploaded when its
/// first transformer block asks for it (diffusers' interval mapping).
pub struct FeedControl<B: Backend> {
    feed: Arc<dyn ControlFeed>,
    model: Arc<FluxTransformer<B>>,
    layout: FeedLayout,
    intervals: (usize, usize),
    uploaded: Vec<OnceLock<B::Tensor>>,
}

impl<B: Backend> FeedControl<B> {
    pub fn new(feed: Arc<dyn ControlFeed>, model: Arc<FluxTransformer<B>>) -> Result<Self> {
        let layout = feed.layout();
        let intervals = intervals(&model.config, layout.doubles, layout.singles)?;
        Ok(FeedControl {
            uploaded: (0..layout.blocks()).map(|_| OnceLock::new()).collect(),
            feed,
            model,
            layout,
            intervals,
        })
    }

    fn residual(&self, k: usize) -> Result<&B::Tensor> {
        let cell = &self.uploaded[k];
        if let Some(t) = cell.get() {
            return Ok(t);
        }
        let (rows, hidden) = (self.layout.rows, self.layout.hidden);
        let mut up = None;
        self.feed.with_residual(k, &mut |r| {
            up = Some(
                self.model
                    .backend()
                    .upload(&Tensor::new([rows, hidden], r.to_vec())?)?,
            );
            Ok(())
        })?;
        let t =
            up.ok_or_else(|| Error::Invalid(format!("ControlNet residual {k} was not given")))?;
        // Blocks are asked for one at a time, so nobody set it meanwhile.
        let _ = cell.set(t);
        cell.get()
            .ok_or_else(|| Error::Invalid("a residual went missing".into()))
    }
}

impl<B: Backend> Control<B::Tensor> for FeedControl<B>
where
    B::Tensor: Send + Sync,
{
    fn double(&self, block: usize) -> Result<Option<(&B::Tensor, f32)>> {
        let k = block / self.intervals.0;
        if k >= self.layout.doubles {
            return Ok(None);
        }
        Ok(Some((self.residual(k)?, self.layout.scale)))
    }
    fn single(&self, block: usize) -> Result<Option<(&B::Tensor, f32)>> {
        let k = block / self.intervals.1;
        if k >= self.layout.singles {
            return Ok(None);
        }
        Ok(Some((
            self.residual(self.layout.doubles + k)?,
            self.layout.scale,
        )))
    }
}

/// One ControlNet of a request: the net, its packed control latents `[N, 4c]`, its
/// conditioning scale.
pub struct ControlUse {
    pub net: Arc<ControlNet<CpuBackend>>,
    pub control: Tensor,
    pub scale: f32,
}

/// What a request's ControlNets read besides the latents: its text, positions,
/// guidance and schedule.
pub struct ControlInputs {
    pub img_ids: Tensor,
    pub txt: Tensor,
    pub txt_ids: Tensor,
    pub pooled: Vec<f32>,
    pub guidance: f32,
    /// The model timestep of each step.
    pub timesteps: Vec<f32>,
    /// The rows the job reads residuals for: an edit's active tokens (the ControlNets
    /// still run over every token: their attention needs them); `None`: every row.
    pub keep: Option<Vec<u32>>,
}

impl ControlInputs {
    pub fn new(inputs: &DenoiseInputs, schedule: &FlowMatchEuler) -> Self {
        ControlInputs {
            img_ids: inputs.img_ids.clone(),
            txt: inputs.txt.clone(),
            txt_ids: inputs.txt_ids.clone(),
            pooled: inputs.pooled.clone(),
            guidance: inputs.guidance,
            timesteps: Self::timesteps(schedule),
            keep: None,
        }
    }

    /// For an edit: residuals of its `active` tokens only.
    pub fn keeping(mut self, active: Vec<u32>) -> Self {
        self.keep = Some(active);
        self
    }

    /// Rows of each residual the job reads.
    pub fn residual_rows(&self) -> usize {
        self.keep.as_ref().map_or(self.img_ids.rows(), |k| k.len())
    }

    /// The model timestep of each step of `schedule`.
    pub fn timesteps(schedule: &FlowMatchEuler) -> Vec<f32> {
        (0..schedule.steps())
            .map(|i| schedule.model_timestep(i))
            .collect()
    }
}

/// One step of a request's ControlNets (on the host's CPU backend) from the latents
/// of every token `[L, C]` ([`super::edit::Job::control_latents`]), residual `k`
/// (its rows in [`ControlInputs::keep`]) to `sink` as soon as it is final; the scale,
/// or `None` when every scale is 0.
pub fn control_step(
    uses: &[ControlUse],
    inputs: &ControlInputs,
    step: usize,
    latents: &Tensor,
    sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
) -> Result<Option<f32>> {
    let rows = latents.rows();
    let timestep = *inputs
        .timesteps
        .get(step)
        .ok_or_else(|| Error::Invalid(format!("no step {step} in the schedule")))?;
    let joined = uses
        .iter()
        .map(|u| {
            if u.control.rows() != rows {
                return Err(Error::Invalid(format!(
                    "control latents of {} rows for latents of {rows}",
                    u.control.rows()
                )));
            }
            let (c, k) = (latents.cols(), u.control.cols());
            let mut x = Vec::with_capacity(rows * (c + k));
            for r in 0..rows {
                x.extend_from_slice(latents.row(r));
                x.extend_from_slice(u.control.row(r));
            }
            Tensor::new([rows, c + k], x)
        })
        .collect::<Result<Vec<_>>>()?;
    let reqs: Vec<FluxRequest<'_, Tensor>> = joined
        .iter()
        .map(|img| FluxRequest {
            img,
            img_ids: &inputs.img_ids,
            txt: &inputs.txt,
            txt_ids: &inputs.txt_ids,
            pooled: &inputs.pooled,
            timestep,
            guidance: inputs.guidance,
            cache: None,
        })
        .collect();
    let nets: Vec<_> = uses
        .iter()
        .zip(&reqs)
        .map(|(u, r)| (&*u.net, r, u.scale))
        .collect();
    let be = CpuBackend::new();
    match &inputs.keep {
        None => run_summed(&be, &nets, sink),
        Some(rows) => run_summed(&be, &nets, &mut |k, r| sink(k, &r.gather(rows))),
    }
}

/// The layout of `uses`' residuals for a job of `inputs`; `None` when no ControlNet
/// has a nonzero scale (the job runs without control).
pub fn layout_of(uses: &[ControlUse], inputs: &ControlInputs) -> Result<Option<FeedLayout>> {
    let tokens = inputs.img_ids.rows();
    if let Some(bad) = inputs
        .keep
        .iter()
        .flatten()
        .find(|&&r| r as usize >= tokens)
    {
        return Err(Error::Invalid(format!(
            "ControlNet residual row {bad} of {tokens} tokens"
        )));
    }
    let rows = inputs.residual_rows();
    let live: Vec<&ControlUse> = uses.iter().filter(|u| u.scale != 0.0).collect();
    let Some(first) = live.first() else {
        return Ok(None);
    };
    let (doubles, singles) = first.net.blocks();
    if live.iter().any(|u| u.net.blocks() != (doubles, singles)) {
        return Err(Error::Invalid(
            "ControlNets of different block counts are not summed".into(),
        ));
    }
    Ok(Some(FeedLayout {
        doubles,
        singles,
        rows,
        hidden: first.net.hidden(),
        scale: first.scale,
    }))
}

/// Residuals computed in process, the whole step's before the step (the CLI, and the
/// sequential reference of the streamed service).
pub struct LocalControl {
    uses: Vec<ControlUse>,
    inputs: ControlInputs,
    layout: FeedLayout,
    current: Mutex<Vec<Tensor>>,
}

impl LocalControl {
    /// `None` when no ControlNet has a nonzero scale.
    pub fn new(uses: Vec<ControlUse>, inputs: ControlInputs) -> Result<Option<Self>> {
        let Some(layout) = layout_of(&uses, &inputs)? else {
            return Ok(None);
        };
        Ok(Some(LocalControl {
            uses,
            inputs,
            layout,
            current: Mutex::new(Vec::new()),
        }))
    }
}

impl ControlFeed for LocalControl {
    fn layout(&self) -> FeedLayout {
        self.layout
    }
    fn begin(&self, step: usize, latents: &Tensor) -> Result<()> {
        let mut got = Vec::with_capacity(self.layout.blocks());
        control_step(&self.uses, &self.inputs, step, latents, &mut |_, r| {
            got.push(r.clone());
            Ok(())
        })?;
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = got;
        Ok(())
    }
    fn with_residual(&self, k: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let r = cur
            .get(k)
            .ok_or_else(|| Error::Invalid(format!("no ControlNet residual {k} this step")))?;
        f(r.data())
    }
}
