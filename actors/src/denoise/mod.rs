//! The denoise worker's step loop: schedule → execute → update, on its own OS thread.
//!
//! The thread owns the model (and, with a GPU, the device). Everything else talks to it
//! through channels: [`LoopCommand`]s in (submit, cancel, shut down), [`Event`]s out (steps,
//! progress, finished latents). The loop never blocks on anything but the model: it
//! drains commands without waiting while there is work, sends results on an unbounded
//! channel, and only sleeps on the command channel when it has nothing to run. New
//! requests join the running batch at the next step; finished ones leave at once
//! (continuous batching, [`crate::batching`]); `Batching::Static` is the baseline.
//!
//! A submitted request waits on the host; when the scheduler admits it, the stepper
//! uploads it to the device, where it stays until its final latent is downloaded
//! (so the device holds only the running batch, which its memory budget covers).
//!
//! A batched step that fails (a broken invariant, an error from the backend) is run
//! again for each of its requests alone; those that fail alone get the error, the
//! others go on, and so does the loop. A device fault ends the process instead.

use crate::wire::JobId;
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{unbounded, Receiver, Sender};
use denoised_models::flux::cost::StepShape;
use denoised_models::flux::edit::{DenoiseInputs, Mode, TrueCfg};
use denoised_models::flux::stepper::{StepReport, Stepper};
use denoised_models::flux::template::TemplateCache;
use denoised_models::FlowMatchEuler;
use denoised_runtime::Tensor;

use crate::batching::{BatchConfig, BatchScheduler, SchedRequest, TemplateUse};
use adapters::LoopAdapters;
pub use adapters::{AdapterOptions, LoraRequest};
use denoised_models::flux::control_feed::ControlFeed;
use denoised_models::flux::edit::CfgPartner;
use denoised_models::flux::lora::LoraFile;

/// Exit status of a denoise worker whose device failed (EX_SOFTWARE).
pub const EXIT_DEVICE_FAULT: i32 = 70;

/// A request for the loop: its host inputs, its schedule, and what it computes (a full
/// run, a capture into a template cache, or an edit of one).
pub struct DenoiseRequest {
    pub id: JobId,
    pub inputs: Arc<DenoiseInputs>,
    pub schedule: Arc<FlowMatchEuler>,
    pub work: Mode,
    /// A full run that starts after this step of its schedule (an approximate-cache
    /// hit: its latents are the state after it); 0 for the whole schedule.
    pub start_at: usize,
    /// Steps after which its latents go out ([`Event::Stored`]): a generation that
    /// missed the approximate cache.
    pub store_at: Vec<usize>,
    /// Its LoRAs, loaded while it starts on the base weights ([`adapters`]).
    pub loras: Vec<LoraRequest>,
    /// True CFG's negative branch (a generation), batched with it every step.
    pub true_cfg: Option<Box<TrueCfg>>,
    /// Its ControlNets' residuals (a generation), fed every step.
    pub control: Option<Arc<dyn ControlFeed>>,
    /// True CFG's other branch on another worker (a split generation).
    pub partner: Option<Arc<dyn CfgPartner>>,
    /// Previews of its running latent ([`Event::Preview`]), if asked.
    pub preview: Option<PreviewSpec>,
}

/// A request's previews: after every `every` steps, of its `rows x cols` token grid.
#[derive(Clone, Copy, Debug)]
pub struct PreviewSpec {
    pub every: usize,
    pub rows: usize,
    pub cols: usize,
}

pub enum LoopCommand {
    Submit(DenoiseRequest),
    Cancel(JobId),
    /// Work to run on the loop thread at the next step boundary. This is how the
    /// non-disaggregated baseline (`[denoise] disaggregate = false`) runs pre- and
    /// post-processing "between steps", stalling the batch exactly as a one-process
    /// server would. It may send further commands (e.g. the `Submit` of what it
    /// prepared) through a [`LoopSender`]; they are taken in the same drain.
    Run(Box<dyn FnOnce() + Send>),
    /// The loader read a LoRA (or could not): it goes to the device at this boundary.
    LoraLoaded {
        name: String,
        result: Result<Arc<LoraFile>, String>,
        seconds: f64,
    },
    Shutdown,
}

/// A cloneable sender of commands to a loop (for threads other than the owner's).
#[derive(Clone)]
pub struct LoopSender(Sender<LoopCommand>);

impl LoopSender {
    pub fn send(&self, cmd: LoopCommand) {
        let _ = self.0.send(cmd);
    }
}

#[derive(Debug)]
pub enum Event {
    /// A request joined the loop's queue: the rows it computes per step (what the
    /// worker reports to the router) and its steps.
    Submitted {
        id: JobId,
        shape: StepShape,
        steps: u32,
    },
    /// One batched step ran: its number, the requests in it, and how long it took.
    Step {
        step: u64,
        batch: Vec<JobId>,
        seconds: f64,
        /// Wall-clock time (Unix seconds) the step ended, read on the loop thread: the
        /// event thread may see the event later, so request timelines use this.
        ended_unix: f64,
        /// Of which: building the batch (scheduler plan, taking the jobs out of the
        /// table), the loop's own per-step overhead.
        assembly_seconds: f64,
        /// Token rows the step computed, and the requests running and waiting after it.
        rows: usize,
        running: usize,
        waiting: usize,
        /// The plan it followed: full blocks, predicted latency, bubble.
        report: StepReport,
    },
    /// A request finished its last step: the final packed latent, and for a capture
    /// the template cache.
    Finished {
        id: JobId,
        latents: Tensor,
        cache: Option<TemplateCache>,
    },
    /// A request's estimate of its clean latent over its full grid after step `k`
    /// (packed `[L, C]`), for a preview; sent after the step's own event.
    Preview {
        id: JobId,
        k: usize,
        latents: Tensor,
        spec: PreviewSpec,
    },
    /// A request's packed latents after step `k` (one of its `store_at`), sent before
    /// the step's own event.
    Stored {
        id: JobId,
        k: usize,
        latents: Tensor,
    },
    /// A request could not be run; the message says why.
    Failed {
        id: JobId,
        error: String,
    },
    Cancelled {
        id: JobId,
    },
    /// A request's LoRAs apply from this step of its schedule on.
    LoraApplied {
        id: JobId,
        step: usize,
    },
    /// The loader finished reading a LoRA (`error` if it could not), in `seconds`.
    LoraLoaded {
        name: String,
        seconds: f64,
        error: Option<String>,
    },
}

/// Handle to a running loop: a command sender and an event receiver. Dropping it
/// shuts the loop down.
pub struct DenoiseLoop {
    commands: Sender<LoopCommand>,
    events: Receiver<Event>,
    thread: Option<JoinHandle<()>>,
}

/// Knobs for tests and benchmarks.
#[derive(Default)]
pub struct LoopOptions {
    /// When set, the loop takes one token from this channel before each step (and then
    /// reads the commands that arrived), so a test can interleave submissions and
    /// cancellations with steps deterministically. Serving leaves it unset.
    pub step_gate: Option<Receiver<()>>,
    /// Fault injection (`DENOISED_FAULT`, see [`crate::fault`]): the loop thread panics
    /// before the step with this number.
    pub panic_at_step: Option<u64>,
    /// Fault injection: the loop thread sleeps this long before each batched step (a
    /// slow device).
    pub slow_step: Option<std::time::Duration>,
    /// LoRAs: requests naming some are refused without.
    pub adapters: Option<AdapterOptions>,
}

impl DenoiseLoop {
    /// Starts the loop thread, which takes ownership of the model on its device.
    pub fn spawn(
        stepper: Box<dyn Stepper>,
        config: BatchConfig,
        options: LoopOptions,
    ) -> Result<Self, String> {
        let sched = BatchScheduler::new(config).map_err(|e| e.to_string())?;
        let (commands, rx) = unbounded();
        let (tx, events) = unbounded();
        let adapters = match &options.adapters {
            Some(o) => Some(LoopAdapters::new(o, LoopSender(commands.clone()))?),
            None => None,
        };
        let thread = std::thread::Builder::new()
            .name("denoise-loop".into())
            .spawn(move || run(stepper, sched, adapters, rx, tx, options))
            .map_err(|e| format!("cannot start the denoise thread: {e}"))?;
        Ok(DenoiseLoop {
            commands,
            events,
            thread: Some(thread),
        })
    }

    pub fn submit(&self, req: DenoiseRequest) {
        // The loop only stops after Shutdown, which only Drop sends.
        let _ = self.commands.send(LoopCommand::Submit(req));
    }

    pub fn cancel(&self, id: JobId) {
        let _ = self.commands.send(LoopCommand::Cancel(id));
    }

    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    pub fn sender(&self) -> LoopSender {
        LoopSender(self.commands.clone())
    }
}

impl Drop for DenoiseLoop {
    fn drop(&mut self) {
        let _ = self.commands.send(LoopCommand::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Loop state: the scheduler's view, and the requests not yet on the device.
struct State {
    sched: BatchScheduler,
    /// Submitted requests waiting for admission, with their host inputs.
    waiting: HashMap<JobId, DenoiseRequest>,
    /// The `store_at` of running requests that have one.
    stores: HashMap<JobId, Vec<usize>>,
    /// The previews of running requests that asked for them.
    previews: HashMap<JobId, PreviewSpec>,
    adapters: Option<LoopAdapters>,
    tx: Sender<Event>,
}

impl State {
    /// Applies a command; returns false on shutdown.
    fn apply(&mut self, cmd: LoopCommand, model: &mut dyn Stepper) -> bool {
        match cmd {
            LoopCommand::Shutdown => return false,
            LoopCommand::Run(f) => f(),
            LoopCommand::Cancel(id) => {
                if self.sched.cancel(id) {
                    self.forget(id, model);
                    let _ = self.tx.send(Event::Cancelled { id });
                }
            }
            LoopCommand::LoraLoaded {
                name,
                result,
                seconds,
            } => {
                let error = result.as_ref().err().cloned();
                let _ = self.tx.send(Event::LoraLoaded {
                    name: name.clone(),
                    seconds,
                    error,
                });
                let failed = match &mut self.adapters {
                    Some(a) => a.loaded(name, result, model),
                    None => vec![],
                };
                for (id, error) in failed {
                    self.sched.cancel(id);
                    self.forget(id, model);
                    let _ = self.tx.send(Event::Failed { id, error });
                }
            }
            LoopCommand::Submit(r) => {
                let id = r.id;
                if let Err(error) = self.submit(r, model) {
                    let _ = self.tx.send(Event::Failed { id, error });
                }
            }
        }
        true
    }

    /// Drops what the loop keeps of a request that left (cancelled or failed).
    fn forget(&mut self, id: JobId, model: &mut dyn Stepper) {
        self.waiting.remove(&id);
        self.stores.remove(&id);
        self.previews.remove(&id);
        model.remove(id);
        if let Some(a) = &mut self.adapters {
            a.leave(id, model);
        }
    }

    fn submit(&mut self, mut r: DenoiseRequest, model: &dyn Stepper) -> Result<(), String> {
        if !r.loras.is_empty() && self.adapters.is_none() {
            return Err("this denoise worker serves no LoRAs".into());
        }
        // The scheduler counts the steps the request will run.
        let steps = r.schedule.steps().saturating_sub(r.start_at) as u32;
        let tokens = match &r.work {
            Mode::Edit { mask, .. } => mask.active().len(),
            _ => r.inputs.tokens(),
        };
        let text = r.inputs.txt.rows();
        // True CFG's negative branch is a second set of rows in every step.
        let negative = r.true_cfg.as_ref().map_or(0, |c| c.txt.rows() + tokens);
        let mut req = SchedRequest::new(r.id, (text + tokens + negative).max(1), steps);
        if let Mode::Edit { cache, .. } = &r.work {
            req = req.with_template(TemplateUse {
                key: cache.key(),
                bytes: model.template_bytes(cache),
            });
        }
        self.sched.submit(req).map_err(|e| e.to_string())?;
        let shape = StepShape {
            text,
            active: tokens,
            image: r.inputs.tokens(),
        };
        let _ = self.tx.send(Event::Submitted {
            id: r.id,
            shape,
            steps,
        });
        if let Some(a) = &mut self.adapters {
            a.submit(r.id, std::mem::take(&mut r.loras));
        }
        self.waiting.insert(r.id, r);
        Ok(())
    }

    /// Puts the requests the scheduler just admitted on the device; returns those that
    /// could not be (already failed and out of the scheduler).
    fn admit(&mut self, admitted: &[JobId], model: &mut dyn Stepper) -> Vec<JobId> {
        let mut failed = Vec::new();
        for &id in admitted {
            let Some(r) = self.waiting.remove(&id) else {
                continue;
            };
            let admitted = model
                .admit(id, &r.inputs, r.schedule, r.work)
                .and_then(|_| match r.start_at {
                    0 => Ok(()),
                    k => model.skip_to(id, k),
                })
                .and_then(|_| match &r.true_cfg {
                    Some(cfg) => model.set_true_cfg(id, &r.inputs, cfg),
                    None => Ok(()),
                })
                .and_then(|_| match &r.control {
                    Some(feed) => model.set_control_feed(id, feed.clone()),
                    None => Ok(()),
                })
                .and_then(|_| match &r.partner {
                    Some(p) => model.set_cfg_partner(id, p.clone()),
                    None => Ok(()),
                });
            if admitted.is_ok() && !r.store_at.is_empty() {
                self.stores.insert(id, r.store_at);
            }
            if let (true, Some(p)) = (admitted.is_ok(), r.preview) {
                self.previews.insert(id, p);
            }
            if let Err(e) = admitted {
                if model.is_fatal(&e) {
                    device_fault(&e, format_args!("the admission of request {id:x}"));
                }
                self.sched.cancel(id);
                if let Some(a) = &mut self.adapters {
                    a.leave(id, model);
                }
                failed.push(id);
                let _ = self.tx.send(Event::Failed {
                    id,
                    error: e.to_string(),
                });
            }
        }
        failed
    }
}

fn run(
    mut model: Box<dyn Stepper>,
    sched: BatchScheduler,
    adapters: Option<LoopAdapters>,
    rx: Receiver<LoopCommand>,
    tx: Sender<Event>,
    options: LoopOptions,
) {
    let mut st = State {
        sched,
        waiting: HashMap::new(),
        stores: HashMap::new(),
        previews: HashMap::new(),
        adapters,
        tx,
    };
    loop {
        // Sleep on the channel only when idle; otherwise take what has arrived and go.
        if st.sched.is_idle() {
            match rx.recv() {
                Ok(cmd) => {
                    if !st.apply(cmd, &mut *model) {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        if let Some(gate) = &options.step_gate {
            if gate.recv().is_err() {
                return;
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if !st.apply(cmd, &mut *model) {
                return;
            }
        }
        let t0 = Instant::now();
        let mut plan = st.sched.plan();
        let mut dropped = Vec::new();
        loop {
            dropped.extend(st.admit(plan.admitted(), &mut *model));
            // LoRAs that have landed apply now; a request at its K without them waits.
            let changed = match &mut st.adapters {
                Some(a) => a.gate(&mut st.sched, &mut *model, &st.tx),
                None => false,
            };
            if !changed {
                break;
            }
            plan = st.sched.plan();
        }
        if plan.is_empty() {
            if !st.sched.is_idle() {
                // All that runs waits for a LoRA: sleep until the loader's result (or
                // any command) arrives.
                let Ok(cmd) = rx.recv() else { return };
                if !st.apply(cmd, &mut *model) {
                    return;
                }
            }
            continue;
        }
        if options.panic_at_step == Some(plan.step()) {
            panic!("fault injection: panic at step {}", plan.step());
        }
        if let Some(d) = options.slow_step {
            std::thread::sleep(d);
        }
        let ids: Vec<JobId> = plan
            .ids()
            .iter()
            .copied()
            .filter(|id| !dropped.contains(id))
            .collect();
        // Where each job was before the step: after a failure, those that did not
        // advance are retried alone.
        let before: Vec<Option<usize>> = ids.iter().map(|&id| model.position(id)).collect();
        // The latents before the step of the requests whose preview falls after it.
        let preview_from = match st.previews.is_empty() {
            true => Vec::new(),
            false => previews_due(&st, &*model, &ids),
        };
        let assembly_seconds = t0.elapsed().as_secs_f64();
        let report = match model.step(&ids) {
            Ok(r) => r,
            Err(e) => {
                for (id, error) in isolate(&mut *model, &ids, &before, e) {
                    st.sched.cancel(id);
                    st.forget(id, &mut *model);
                    let _ = st.tx.send(Event::Failed { id, error });
                }
                StepReport::default()
            }
        };
        if !st.stores.is_empty() {
            store_states(&st, &*model, &ids);
        }
        let finished = st.sched.complete_step(&plan);
        // Finished results go out first, so whoever sees a step's event has already been
        // sent everything that step produced. Each result is downloaded here, once.
        for id in finished {
            st.stores.remove(&id);
            st.previews.remove(&id);
            if let Some(a) = &mut st.adapters {
                a.leave(id, &mut *model);
            }
            let event = match model.finish(id) {
                Ok((latents, cache)) => Event::Finished { id, latents, cache },
                Err(e) => {
                    if model.is_fatal(&e) {
                        device_fault(&e, format_args!("the result of request {id:x}"));
                    }
                    Event::Failed {
                        id,
                        error: e.to_string(),
                    }
                }
            };
            let _ = st.tx.send(event);
        }
        let _ = st.tx.send(Event::Step {
            step: plan.step(),
            batch: ids,
            seconds: t0.elapsed().as_secs_f64(),
            ended_unix: crate::daemon::unix_now(),
            assembly_seconds,
            rows: plan.rows(),
            running: st.sched.num_running(),
            waiting: st.sched.num_waiting(),
            report,
        });
        // After the step's event, so that a watcher sees a step, then its preview.
        if !preview_from.is_empty() {
            send_previews(&st, &*model, preview_from);
        }
    }
}

/// Sends the latents of the requests of a step that has just reached one of their
/// `store_at` steps. A download that fails loses only that state (the request goes on;
/// a device fault ends the process).
fn store_states(st: &State, model: &dyn Stepper, ids: &[JobId]) {
    for id in ids {
        let (Some(ks), Some(k)) = (st.stores.get(id), model.position(*id)) else {
            continue;
        };
        if !ks.contains(&k) {
            continue;
        }
        match model.latents(*id) {
            Ok(latents) => {
                let _ = st.tx.send(Event::Stored {
                    id: *id,
                    k,
                    latents,
                });
            }
            Err(e) => {
                if model.is_fatal(&e) {
                    device_fault(&e, format_args!("storing the state of request {id:x}"));
                }
                tracing::warn!("request {id:x}: its state after step {k} is not stored: {e}");
            }
        }
    }
}

/// The requests of a step whose preview falls after it (every `every` steps, not the
/// last: its result follows), with their latents before it: a small download each,
/// at a boundary where the device is idle.
fn previews_due(st: &State, model: &dyn Stepper, ids: &[JobId]) -> Vec<(JobId, Tensor)> {
    ids.iter()
        .filter_map(|&id| {
            let every = st.previews.get(&id)?.every;
            let next = model.position(id)? + 1;
            (next % every == 0)
                .then(|| model.latents(id).ok())
                .flatten()
                .map(|t| (id, t))
        })
        .collect()
}

/// Sends the previews of the requests that took their step: the model's estimate of
/// each clean latent, for the event thread to draw. A preview that fails is skipped.
fn send_previews(st: &State, model: &dyn Stepper, from: Vec<(JobId, Tensor)>) {
    for (id, before) in from {
        let (Some(&spec), Some(k)) = (st.previews.get(&id), model.position(id)) else {
            continue;
        };
        if model.done(id) {
            continue;
        }
        match model.clean_estimate(id, &before) {
            Ok(latents) => {
                let _ = st.tx.send(Event::Preview {
                    id,
                    k,
                    latents,
                    spec,
                });
            }
            Err(e) => tracing::debug!("request {id:x}: no preview after step {k}: {e}"),
        }
    }
}

/// After a batched step failed with `error`: runs the step again for each request
/// alone, so that one bad request cannot fail its batch-mates, and returns those that
/// fail alone (the whole batch if it was one request). A job that did advance before
/// the error is not run twice. A device fault ends the process (see [`device_fault`]).
fn isolate(
    model: &mut dyn Stepper,
    ids: &[JobId],
    before: &[Option<usize>],
    error: denoised_runtime::Error,
) -> Vec<(JobId, String)> {
    if model.is_fatal(&error) {
        device_fault(&error, format_args!("a step of requests {ids:x?}"));
    }
    if let [id] = ids {
        tracing::warn!("denoise step of request {id:x} failed: {error}");
        return vec![(*id, error.to_string())];
    }
    tracing::warn!(
        "a batched step of {} requests failed ({error}); retrying each alone",
        ids.len()
    );
    let mut failed = Vec::new();
    for (&id, &step) in ids.iter().zip(before) {
        if model.position(id) != step {
            continue;
        }
        if let Err(e) = model.step(&[id]) {
            if model.is_fatal(&e) {
                device_fault(&e, format_args!("request {id:x} stepped alone"));
            }
            tracing::warn!("denoise step of request {id:x} failed: {e}");
            failed.push((id, e.to_string()));
        }
    }
    failed
}

/// The device is gone for this process (a sticky CUDA error). Exit without answering:
/// the router sees the worker lost and retries its requests on the restarted worker,
/// as after a kill.
fn device_fault(e: &denoised_runtime::Error, during: std::fmt::Arguments) -> ! {
    // A step waits for its end on the device (`Stepper::step`), so a kernel fault is
    // reported by the step that caused it, and `during` names its requests.
    tracing::error!("device fault during {during}; the worker exits to be restarted: {e}");
    std::process::exit(EXIT_DEVICE_FAULT);
}

#[cfg(test)]
mod lora_tests;
#[cfg(test)]
mod tests;

pub mod actor;
pub mod adapters;
pub mod cfg_pair;
mod events;
pub mod inline;
mod preview;
