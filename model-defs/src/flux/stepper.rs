//! The model on its device, as the denoise loop and the CLI drive it: one batched
//! step at a time, with each edit's template where that device reads it.
//!
//! The CPU reads a template's host slabs in place ([`HostStepper`]). Any other
//! backend ([`DeviceStepper`]) needs them in its own memory: a template is uploaded
//! whole when a batch first needs it and stays resident while it is among the most
//! recently used and the device's template budget holds it, so the edits of a hot
//! template pay the upload once. Every template of the running batch is resident
//! during its step; the batch scheduler admits requests so that they fit
//! ([`Stepper::template_bytes`] is what it counts).

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
    /// Device bytes `template` takes while resident (0 where templates are read in
    /// place).
    fn template_bytes(&self, _template: &TemplateCache) -> u64 {
        0
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
    /// Device bytes templates may take; those of the running batch always stay.
    capacity: u64,
    /// Bytes of one element of a resident slab (the device's storage dtype).
    elem_bytes: usize,
}

impl<B: Backend> DeviceStepper<B> {
    /// A stepper keeping templates resident within `capacity` bytes, their slabs
    /// stored with `elem_bytes` per element.
    pub fn new(model: FluxTransformer<B>, capacity: u64, elem_bytes: usize) -> Self {
        DeviceStepper {
            model,
            resident: ResidentTemplates::new(),
            recent: VecDeque::new(),
            capacity,
            elem_bytes,
        }
    }

    fn bytes(&self, t: &TemplateCache) -> u64 {
        let l = t.layout();
        (l.steps * l.blocks * l.tokens * 2 * l.hidden * self.elem_bytes) as u64
    }

    pub fn model(&self) -> &FluxTransformer<B> {
        &self.model
    }

    /// Templates resident now, most recently used first (for tests).
    pub fn resident(&self) -> impl Iterator<Item = &Arc<TemplateCache>> {
        self.recent.iter()
    }

    /// Makes every template of `jobs` resident, first evicting the least recently used
    /// others until they fit (never one the batch reads).
    fn admit(&mut self, jobs: &[&mut Job]) -> Result<()> {
        let mut used = 0;
        let mut batch: Vec<&Arc<TemplateCache>> = Vec::new();
        for t in jobs.iter().filter_map(|j| j.template()) {
            if !batch.iter().any(|b| Arc::ptr_eq(b, t)) {
                batch.push(t);
            }
        }
        let in_batch = |r: &Arc<TemplateCache>| batch.iter().any(|b| Arc::ptr_eq(b, r));
        let needed: u64 = batch.iter().map(|t| self.bytes(t)).sum();
        let mut others: u64 = self
            .recent
            .iter()
            .filter(|r| !in_batch(r))
            .map(|r| self.bytes(r))
            .sum();
        // Least recently used first; the batch's own stay (the scheduler made sure
        // they fit).
        while needed + others > self.capacity {
            let Some(i) = self.recent.iter().rposition(|r| !in_batch(r)) else {
                break;
            };
            let old = self.recent.remove(i).expect("index from rposition");
            others -= self.bytes(&old);
            self.resident.evict(&old);
        }
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
    fn template_bytes(&self, template: &TemplateCache) -> u64 {
        self.bytes(template)
    }
}

/// Runs one job to the end on a stepper and returns it (see [`Job::into_parts`]).
pub fn run_job_on(stepper: &mut dyn Stepper, mut job: Job) -> Result<Job> {
    while !job.done() {
        stepper.step(&mut [&mut job])?;
    }
    Ok(job)
}
