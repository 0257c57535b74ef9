//! The model on its device, as the denoise loop and the CLI drive it: one batched
//! step at a time, with each edit's template where that device reads it.
//!
//! The CPU reads a template's host slabs in place ([`HostStepper`]). Any other
//! backend ([`DeviceStepper`]) needs them in its own memory: a template is uploaded
//! whole when a batch first needs it and stays resident while it is among the most
//! recently used, so the edits of a hot template pay the upload once. Every template
//! of the running batch is resident during its step, however many there are.

use std::collections::VecDeque;
use std::sync::Arc;

use denoised_runtime::{Backend, CpuBackend, Result};

use super::edit::{step_batch, step_batch_with, Job, ResidentTemplates};
use super::template::TemplateCache;
use super::FluxTransformer;

/// Runs batched steps on one device.
pub trait Stepper: Send {
    /// Advances every unfinished job in `jobs` by one step, in one forward.
    fn step(&mut self, jobs: &mut [&mut Job]) -> Result<()>;
    /// The backend's name, for logs.
    fn backend(&self) -> String;
    /// Whether a step's error leaves the device unusable (see `Backend::is_fatal`).
    fn is_fatal(&self, _e: &denoised_runtime::Error) -> bool {
        false
    }
}

/// The CPU backend: templates are read where they lie.
pub struct HostStepper(pub Arc<FluxTransformer<CpuBackend>>);

impl Stepper for HostStepper {
    fn step(&mut self, jobs: &mut [&mut Job]) -> Result<()> {
        step_batch(&self.0, jobs)
    }
    fn backend(&self) -> String {
        self.0.backend().name()
    }
}

/// A device backend: weights on the device, templates resident while in use.
pub struct DeviceStepper<B: Backend> {
    model: FluxTransformer<B>,
    resident: ResidentTemplates<B::Tensor>,
    /// Resident templates, most recently used first.
    recent: VecDeque<Arc<TemplateCache>>,
    /// Templates kept resident beyond those of the running batch.
    keep: usize,
}

impl<B: Backend> DeviceStepper<B> {
    pub fn new(model: FluxTransformer<B>, keep: usize) -> Self {
        DeviceStepper {
            model,
            resident: ResidentTemplates::new(),
            recent: VecDeque::new(),
            keep,
        }
    }

    pub fn model(&self) -> &FluxTransformer<B> {
        &self.model
    }

    /// Templates resident now, most recently used first (for tests).
    pub fn resident(&self) -> impl Iterator<Item = &Arc<TemplateCache>> {
        self.recent.iter()
    }

    /// Makes every template of `jobs` resident, then evicts the least recently used
    /// beyond `keep` (never one the batch reads).
    fn admit(&mut self, jobs: &[&mut Job]) -> Result<()> {
        let mut used = 0;
        for t in jobs.iter().filter_map(|j| j.template()) {
            match self.recent.iter().position(|r| Arc::ptr_eq(r, t)) {
                Some(i) if i < used => continue, // already seen in this batch
                Some(i) => {
                    let hit = self.recent.remove(i).expect("index from position");
                    self.recent.push_front(hit);
                }
                None => {
                    self.resident.make_resident(self.model.backend(), t)?;
                    self.recent.push_front(t.clone());
                }
            }
            used += 1;
        }
        while self.recent.len() > self.keep.max(used) {
            if let Some(old) = self.recent.pop_back() {
                self.resident.evict(&old);
            }
        }
        Ok(())
    }
}

impl<B: Backend> Stepper for DeviceStepper<B>
where
    B::Tensor: Send + Sync,
{
    fn step(&mut self, jobs: &mut [&mut Job]) -> Result<()> {
        self.admit(jobs)?;
        step_batch_with(&self.model, jobs, &self.resident)
    }
    fn backend(&self) -> String {
        self.model.backend().name()
    }
    fn is_fatal(&self, e: &denoised_runtime::Error) -> bool {
        self.model.backend().is_fatal(e)
    }
}

/// Runs one job to the end on a stepper and returns it (see [`Job::into_parts`]).
pub fn run_job_on(stepper: &mut dyn Stepper, mut job: Job) -> Result<Job> {
    while !job.done() {
        stepper.step(&mut [&mut job])?;
    }
    Ok(job)
}
