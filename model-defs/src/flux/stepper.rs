//! The model on its device, as the denoise loop and the CLI drive it: the requests it
//! is running (their tensors live on the device, so the jobs live here too), one
//! batched step at a time, with each edit's template where that device reads it.
//!
//! A template is made resident when a batch first needs it (uploaded; on the CPU,
//! decoded to f32) and stays while it is among the most recently used and the
//! device's template budget holds it, so the edits of a hot template pay the copy
//! once. A template larger than the whole budget is streamed from host memory instead
//! where the backend can (`Backend::stream_slabs`), through buffers the device budget
//! reserves up front. The batch scheduler admits requests so that the resident
//! templates of a batch fit ([`Stepper::template_bytes`] is what it counts).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::adapters::{LoraId, LoraUse};
use super::control_feed::{ControlFeed, FeedControl};
use super::edit::{
    step_batch_with, CfgPartner, DenoiseInputs, DeviceTemplates, Job, Mode, TrueCfg,
};
use super::lora::LoraFile;
use super::plan::{plan_step, SlabLoad, StepWork};
use super::template::{CacheMode, TemplateCache};
use super::FluxTransformer;
use crate::planner::Choice;
use crate::profile::{Profile, Tier};
use crate::scheduler::FlowMatchEuler;

/// Identifies a job among those a stepper runs.
pub type JobKey = u64;

/// What a stepper counts of its device, for its worker's metrics (read at scrape
/// time; updated a few times per step, never in the forward).
#[derive(Debug, Default)]
pub struct StepperStats {
    /// Templates resident on the device, and their bytes.
    pub entries: AtomicU64,
    pub bytes: AtomicU64,
    /// Per step of a batch, each template it reads: found resident (a hit), or not
    /// (a miss: then made resident, or streamed).
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    /// Bytes made resident, and bytes streamed during steps.
    pub loaded_bytes: AtomicU64,
    pub streamed_bytes: AtomicU64,
    /// Device memory in use, sampled at most once a second.
    pub device_used_bytes: AtomicU64,
    /// Keys of the resident templates, most recently used first: what the worker
    /// tells the router its device holds (written when the set changes).
    pub resident_keys: Mutex<Vec<u64>>,
}

/// What a step did beyond advancing its jobs: the plan it followed and what the
/// loads cost it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Blocks computed over every token.
    pub full_blocks: usize,
    /// The planner's predicted step latency (for steps that read a template).
    pub predicted_s: Option<f64>,
    /// Time compute waited for template loads, where the device measures it.
    pub bubble_s: Option<f64>,
    /// The step's time on the device, by its own clock (CUDA events), where the device
    /// runs asynchronously to the loop ([`Backend::device_timer`]).
    pub device_s: Option<f64>,
}

/// How often the device's memory in use is read (a driver call).
const MEMORY_SAMPLE: Duration = Duration::from_secs(1);

/// Runs the requests admitted to one device, a batched step at a time.
pub trait Stepper: Send {
    /// Uploads a request to the device and keeps it until it is finished or removed;
    /// returns the image tokens it computes per step.
    fn admit(
        &mut self,
        id: JobKey,
        inputs: &DenoiseInputs,
        schedule: Arc<FlowMatchEuler>,
        mode: Mode,
    ) -> Result<usize>;
    /// Advances each of `ids` by one step, in one forward, as the planner chose.
    fn step(&mut self, ids: &[JobKey]) -> Result<StepReport>;
    /// The step a job is at (`None` for an unknown job).
    fn position(&self, id: JobKey) -> Option<usize>;
    /// Whether a job has run all its steps (or is unknown).
    fn done(&self, id: JobKey) -> bool;
    /// Takes a finished job out: its final latent, and for a capture the template.
    fn finish(&mut self, id: JobKey) -> Result<(Tensor, Option<TemplateCache>)>;
    /// Moves a just-admitted full run to after step `k` (its latents being a state
    /// after `k`: an approximate-cache hit, see `Job::starting_at`).
    fn skip_to(&mut self, id: JobKey, k: usize) -> Result<()>;
    /// A job's packed latents now, downloaded (the approximate cache's stores).
    fn latents(&self, id: JobKey) -> Result<Tensor>;
    /// The job's estimate of its clean latent over the full grid after its latest
    /// step, given its [`latents`](Self::latents) before that step (for previews).
    fn clean_estimate(&self, id: JobKey, before: &Tensor) -> Result<Tensor>;
    /// Drops a job (cancelled or failed).
    fn remove(&mut self, id: JobKey);
    /// The backend's name, for logs.
    fn backend(&self) -> String;
    /// Whether a step's error leaves the device unusable (see `Backend::is_fatal`).
    fn is_fatal(&self, _e: &Error) -> bool {
        false
    }
    /// Device bytes `template` takes in a batch: its size while resident, 0 when it
    /// is streamed through the reserved slab buffers.
    fn template_bytes(&self, template: &TemplateCache) -> u64;
    /// Its counters, shared with whoever reports them.
    fn stats(&self) -> Arc<StepperStats>;
    /// Plans with `profile`'s latency models from now on.
    fn set_profile(&mut self, profile: Profile);
    /// Uploads a LoRA for the unmerged path (see `FluxTransformer::add_lora`).
    fn add_lora(&mut self, file: &LoraFile) -> Result<LoraId>;
    /// Drops an uploaded LoRA; false if it was not loaded.
    fn remove_lora(&mut self, id: LoraId) -> Result<bool>;
    /// Merges a LoRA set into the weights, restoring the previous set first (an
    /// empty set restores the base); returns the sites patched.
    fn merge_loras(&mut self, loras: &[(&LoraFile, f32)]) -> Result<usize>;
    /// The unmerged LoRAs an admitted job runs with from its next step.
    fn set_loras(&mut self, id: JobKey, loras: Vec<LoraUse>) -> Result<()>;
    /// Adds true CFG's negative branch to a just-admitted full run or edit (`inputs` are the
    /// ones it was admitted with; see `Job::set_true_cfg`).
    fn set_true_cfg(&mut self, id: JobKey, inputs: &DenoiseInputs, cfg: &TrueCfg) -> Result<()>;
    /// Makes a just-admitted full run one branch of a true-CFG generation split across
    /// two workers (see `CfgPartner`).
    fn set_cfg_partner(&mut self, id: JobKey, partner: Arc<dyn CfgPartner>) -> Result<()>;
    /// Gives a just-admitted job ControlNet residuals from `feed`, every step: one row per
    /// computed token (an edit's active tokens, see `Job::control_latents`).
    fn set_control_feed(&mut self, id: JobKey, feed: Arc<dyn ControlFeed>) -> Result<()>;
}

fn no_job(id: JobKey) -> Error {
    Error::Invalid(format!("no job {id:x}"))
}

/// The [`Stepper`] of any backend.
pub struct ModelStepper<B: Backend> {
    model: Arc<FluxTransformer<B>>,
    jobs: HashMap<JobKey, Job<B::Tensor>>,
    templates: DeviceTemplates<B::Tensor>,
    /// Resident templates, most recently used first.
    recent: VecDeque<Arc<TemplateCache>>,
    /// Device bytes resident templates may take; those of the running batch always
    /// stay.
    capacity: u64,
    /// Bytes of one element of a resident slab (f32 on the CPU, else the device's
    /// storage dtype).
    elem_bytes: usize,
    /// Whether templates that can never be resident are streamed (else refused).
    streams: bool,
    stats: Arc<StepperStats>,
    /// When the device's memory in use was last read.
    sampled: Option<Instant>,
    /// The device's latency models, which price the planner's choices.
    profile: Profile,
    /// Jobs with ControlNets: their residuals' feeds.
    feeds: HashMap<JobKey, Arc<dyn ControlFeed>>,
}

impl<B: Backend> ModelStepper<B>
where
    B::Tensor: Send + Sync,
{
    /// A stepper keeping templates resident within `capacity` bytes, their slabs
    /// stored with `elem_bytes` per element; larger templates are streamed when
    /// `streams`.
    pub fn new(
        model: Arc<FluxTransformer<B>>,
        capacity: u64,
        elem_bytes: usize,
        streams: bool,
    ) -> Self {
        let device = model.backend().name();
        ModelStepper {
            model,
            jobs: HashMap::new(),
            templates: DeviceTemplates::new(),
            recent: VecDeque::new(),
            capacity,
            elem_bytes,
            streams,
            stats: Arc::default(),
            sampled: None,
            profile: Profile::defaults(&device),
            feeds: HashMap::new(),
        }
    }

    /// A stepper for one-off runs (the CLI, tests): every template resident.
    pub fn unbounded(model: Arc<FluxTransformer<B>>, elem_bytes: usize) -> Self {
        Self::new(model, u64::MAX, elem_bytes, false)
    }

    fn bytes(&self, t: &TemplateCache) -> u64 {
        resident_bytes(t, self.elem_bytes)
    }

    /// Templates resident now, most recently used first (for tests).
    pub fn resident(&self) -> impl Iterator<Item = &Arc<TemplateCache>> {
        self.recent.iter()
    }

    /// Puts every template `ids` read where the device reads it: resident (first
    /// evicting the least recently used others until they fit, never one the batch
    /// reads) or streamed with a buffer pair per distinct step.
    fn place_templates(&mut self, ids: &[JobKey]) -> Result<()> {
        // The batch's templates, each with its distinct stored steps (a stream's lanes).
        let mut batch: Vec<(Arc<TemplateCache>, Vec<usize>)> = Vec::new();
        for job in ids.iter().filter_map(|id| self.jobs.get(id)) {
            if let Some(t) = job.template() {
                let s = t.layout().stored(job.step());
                match batch.iter_mut().find(|(b, _)| b.key() == t.key()) {
                    Some((_, steps)) if !steps.contains(&s) => steps.push(s),
                    Some(_) => {}
                    None => batch.push((t.clone(), vec![s])),
                }
            }
        }
        let in_batch = |r: &TemplateCache| batch.iter().any(|(b, _)| b.key() == r.key());
        let (elem, capacity) = (self.elem_bytes, self.capacity);
        let size = |t: &TemplateCache| resident_bytes(t, elem);
        let resident_size = |t: &TemplateCache| size(t) <= capacity;
        let needed: u64 = batch
            .iter()
            .filter(|(t, _)| resident_size(t))
            .map(|(t, _)| size(t))
            .sum();
        let mut others: u64 = self
            .recent
            .iter()
            .filter(|r| !in_batch(r))
            .map(|r| size(r))
            .sum();
        // Least recently used first; the batch's own stay (the scheduler made sure
        // they fit).
        let mut changed = false;
        while needed + others > self.capacity {
            let Some(i) = self.recent.iter().rposition(|r| !in_batch(r)) else {
                break;
            };
            let old = self.recent.remove(i).expect("index from rposition");
            others -= size(&old);
            changed = true;
            self.templates.evict(&old);
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
        let be = self.model.backend();
        let count = |a: &AtomicU64, n: u64| a.fetch_add(n, Ordering::Relaxed);
        for (t, steps) in &batch {
            if resident_size(t) {
                if let Some(i) = self.recent.iter().position(|r| r.key() == t.key()) {
                    let hit = self.recent.remove(i).expect("index from position");
                    self.recent.push_front(hit);
                    count(&self.stats.hits, 1);
                } else {
                    self.templates.make_resident(be, t)?;
                    self.recent.push_front(t.clone());
                    changed = true;
                    count(&self.stats.misses, 1);
                    count(&self.stats.loaded_bytes, size(t));
                }
            } else if self.streams && self.templates.stream(be, t, steps.len())? {
                count(&self.stats.misses, 1);
                let per_step = t.layout().cache_bytes_per_step() as u64;
                count(&self.stats.streamed_bytes, per_step * steps.len() as u64);
            } else {
                return Err(Error::Invalid(format!(
                    "its template needs {:.2} GB of device memory, and the device budget leaves {:.2} GB",
                    size(t) as f64 / 1e9,
                    capacity as f64 / 1e9
                )));
            }
        }
        if changed {
            let keys = self.recent.iter().map(|r| r.key()).collect();
            *self
                .stats
                .resident_keys
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = keys;
        }
        let resident: u64 = self.recent.iter().map(|r| size(r)).sum();
        self.stats
            .entries
            .store(self.recent.len() as u64, Ordering::Relaxed);
        self.stats.bytes.store(resident, Ordering::Relaxed);
        Ok(())
    }

    /// The planner's choice for a step of `ids` (`None` when no job reads a
    /// template): its costs are the jobs' FLOPs (with the K/V recompute of Y-mode
    /// templates) and the slabs of streamed templates, one stream per (template,
    /// step).
    fn plan(&self, ids: &[JobKey]) -> Option<crate::planner::Plan> {
        let jobs: Vec<&Job<B::Tensor>> = ids
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|j| !j.done())
            .collect();
        if !jobs.iter().any(|j| j.template().is_some()) {
            return None;
        }
        let shapes: Vec<_> = jobs.iter().map(|j| j.shape()).collect();
        let mut mode = CacheMode::Y;
        let mut recomputed = 0;
        for j in &jobs {
            match j.template().map(|t| t.layout().mode) {
                Some(CacheMode::Kv) => mode = CacheMode::Kv,
                Some(CacheMode::Y) => recomputed += j.shape().image - j.shape().active,
                None => {}
            }
        }
        let mut streams: Vec<(u64, usize)> = vec![];
        let mut loads = vec![];
        for j in &jobs {
            let Some(t) = j.template().filter(|t| !self.templates.is_resident(t)) else {
                continue;
            };
            let s = t.layout().stored(j.step());
            if !streams.contains(&(t.key(), s)) {
                streams.push((t.key(), s));
                loads.push(SlabLoad {
                    tier: Tier::Host,
                    bytes: t.layout().slab_bytes(),
                    mode: t.layout().mode,
                });
            }
        }
        Some(plan_step(
            &self.model.config,
            &self.profile,
            &StepWork {
                shapes: &shapes,
                recomputed,
                loads: &loads,
                mode,
            },
        ))
    }

    /// Reads the device's memory in use, at most once per [`MEMORY_SAMPLE`].
    fn sample_memory(&mut self) {
        if self.sampled.is_some_and(|t| t.elapsed() < MEMORY_SAMPLE) {
            return;
        }
        self.sampled = Some(Instant::now());
        if let Some(used) = self.model.backend().memory_in_use() {
            self.stats.device_used_bytes.store(used, Ordering::Relaxed);
        }
    }
}

impl<B: Backend + 'static> Stepper for ModelStepper<B>
where
    B::Tensor: Send + Sync,
{
    fn admit(
        &mut self,
        id: JobKey,
        inputs: &DenoiseInputs,
        schedule: Arc<FlowMatchEuler>,
        mode: Mode,
    ) -> Result<usize> {
        let job = Job::new(&self.model, inputs, schedule, mode)?;
        let active = job.active_tokens();
        self.jobs.insert(id, job);
        Ok(active)
    }

    fn step(&mut self, ids: &[JobKey]) -> Result<StepReport> {
        self.place_templates(ids)?;
        let plan = self.plan(ids);
        let choices = match &plan {
            Some(p) => p.choices.clone(),
            None => vec![Choice::Cached; self.model.num_blocks()],
        };
        if !self.feeds.is_empty() {
            self.begin_controls(ids)?;
        }
        let mut batch: Vec<&mut Job<B::Tensor>> = self
            .jobs
            .iter_mut()
            .filter(|(id, _)| ids.contains(id))
            .map(|(_, j)| j)
            .collect();
        let timer = self.model.backend().device_timer()?;
        let r = step_batch_with(&self.model, &mut batch, &self.templates, &choices);
        // Waiting for the step's end on the device: the loop never queues a step before
        // the previous one has run, so its step time is the device's (not the time to
        // queue the kernels), its progress and cancellations are the device's, and a
        // kernel fault surfaces in the step that caused it (the batch is then retried
        // one request at a time, each step waited for the same way). The cost is the
        // host's planning of the next step (`denoise_step_duration` less
        // `denoise_step_device_duration`).
        let device_s = match (&r, timer) {
            (Ok(()), Some(t)) => Some(t.stop()?),
            _ => None,
        };
        let bubble = self.templates.take_wait();
        self.sample_memory();
        r.map(|()| StepReport {
            full_blocks: plan.as_ref().map_or(0, |p| p.full_blocks()),
            predicted_s: plan.map(|p| p.latency),
            bubble_s: bubble.map(|d| d.as_secs_f64()),
            device_s,
        })
    }

    fn position(&self, id: JobKey) -> Option<usize> {
        self.jobs.get(&id).map(Job::step)
    }

    fn done(&self, id: JobKey) -> bool {
        self.jobs.get(&id).is_none_or(Job::done)
    }

    fn finish(&mut self, id: JobKey) -> Result<(Tensor, Option<TemplateCache>)> {
        let job = self.jobs.remove(&id).ok_or_else(|| no_job(id))?;
        self.feeds.remove(&id);
        let out = job.finish(&self.model);
        self.drop_unused_streams();
        out
    }

    fn skip_to(&mut self, id: JobKey, k: usize) -> Result<()> {
        let job = self.jobs.remove(&id).ok_or_else(|| no_job(id))?;
        self.jobs.insert(id, job.starting_at(k)?);
        Ok(())
    }

    fn latents(&self, id: JobKey) -> Result<Tensor> {
        self.jobs
            .get(&id)
            .ok_or_else(|| no_job(id))?
            .computed_latents(&self.model)
    }

    fn clean_estimate(&self, id: JobKey, before: &Tensor) -> Result<Tensor> {
        self.jobs
            .get(&id)
            .ok_or_else(|| no_job(id))?
            .clean_estimate(&self.model, before)
    }

    fn remove(&mut self, id: JobKey) {
        self.jobs.remove(&id);
        self.feeds.remove(&id);
        self.drop_unused_streams();
    }

    fn backend(&self) -> String {
        self.model.backend().name()
    }
    fn is_fatal(&self, e: &Error) -> bool {
        self.model.backend().is_fatal(e)
    }
    fn template_bytes(&self, template: &TemplateCache) -> u64 {
        match self.bytes(template) {
            b if b > self.capacity && self.streams => 0,
            b => b,
        }
    }
    fn stats(&self) -> Arc<StepperStats> {
        self.stats.clone()
    }
    fn set_profile(&mut self, profile: Profile) {
        self.profile = profile;
    }

    fn add_lora(&mut self, file: &LoraFile) -> Result<LoraId> {
        self.model.add_lora(file)
    }

    fn remove_lora(&mut self, id: LoraId) -> Result<bool> {
        self.model.remove_lora(id)
    }

    fn merge_loras(&mut self, loras: &[(&LoraFile, f32)]) -> Result<usize> {
        self.model.merge_loras(loras)
    }

    fn set_true_cfg(&mut self, id: JobKey, inputs: &DenoiseInputs, cfg: &TrueCfg) -> Result<()> {
        if self.feeds.contains_key(&id) {
            return Err(Error::Invalid(
                "true CFG does not run with ControlNets".into(),
            ));
        }
        let model = &self.model;
        self.jobs
            .get_mut(&id)
            .ok_or_else(|| no_job(id))?
            .set_true_cfg(model, inputs, cfg)
    }

    fn set_cfg_partner(&mut self, id: JobKey, partner: Arc<dyn CfgPartner>) -> Result<()> {
        if self.feeds.contains_key(&id) {
            return Err(Error::Invalid(
                "true CFG does not run with ControlNets".into(),
            ));
        }
        self.jobs
            .get_mut(&id)
            .ok_or_else(|| no_job(id))?
            .set_cfg_partner(partner)
    }

    fn set_control_feed(&mut self, id: JobKey, feed: Arc<dyn ControlFeed>) -> Result<()> {
        let job = self.jobs.get_mut(&id).ok_or_else(|| no_job(id))?;
        if job.step() != 0 || job.has_true_cfg() {
            return Err(Error::Invalid(
                "ControlNets condition a job from its first step, without true CFG".into(),
            ));
        }
        let rows = feed.layout().rows;
        if rows != job.active_tokens() {
            return Err(Error::Invalid(format!(
                "ControlNet residuals of {rows} rows for a job computing {} tokens",
                job.active_tokens()
            )));
        }
        FeedControl::new(feed.clone(), self.model.clone())?;
        // An edit with no active token has nothing to add residuals to.
        if rows > 0 {
            self.feeds.insert(id, feed);
        }
        Ok(())
    }

    fn set_loras(&mut self, id: JobKey, loras: Vec<LoraUse>) -> Result<()> {
        self.jobs
            .get_mut(&id)
            .ok_or_else(|| no_job(id))?
            .set_loras(loras);
        Ok(())
    }
}

impl<B: Backend + 'static> ModelStepper<B>
where
    B::Tensor: Send + Sync,
{
    /// Hands each job of the step with ControlNets its latents, and its step the
    /// residuals: a local feed computes them now, the service's as the forward goes.
    fn begin_controls(&mut self, ids: &[JobKey]) -> Result<()> {
        for id in ids {
            let (Some(feed), Some(job)) = (self.feeds.get(id), self.jobs.get_mut(id)) else {
                continue;
            };
            let latents = job.control_latents(&self.model)?;
            feed.begin(job.step(), &latents)?;
            let control = FeedControl::new(feed.clone(), self.model.clone())?;
            job.set_control(Some(Arc::new(control)));
        }
        Ok(())
    }

    /// Frees the buffers of streamed templates no admitted job reads any more.
    fn drop_unused_streams(&mut self) {
        let jobs = &self.jobs;
        let recent = &self.recent;
        self.templates.retain(|t| {
            recent.iter().any(|r| r.key() == t.key())
                || jobs
                    .values()
                    .any(|j| j.template().is_some_and(|jt| jt.key() == t.key()))
        });
    }
}

/// Device bytes of a template's slabs at `elem_bytes` per element.
fn resident_bytes(t: &TemplateCache, elem_bytes: usize) -> u64 {
    let l = t.layout();
    (l.slab_count() * l.slab_elems() * elem_bytes) as u64
}

/// Runs one job to the end on a stepper (the CLI): its final latent and, for a
/// capture, its template.
pub fn run_on(
    stepper: &mut dyn Stepper,
    inputs: &DenoiseInputs,
    schedule: Arc<FlowMatchEuler>,
    mode: Mode,
) -> Result<(Tensor, Option<TemplateCache>)> {
    const ONE: JobKey = 0;
    stepper.admit(ONE, inputs, schedule, mode)?;
    let run = (|| {
        while !stepper.done(ONE) {
            stepper.step(&[ONE])?;
        }
        stepper.finish(ONE)
    })();
    if run.is_err() {
        stepper.remove(ONE);
    }
    run
}
