//! The pure batch scheduler of the denoise loop (docs/design.md §"Processes and actors").
//!
//! The denoise loop is schedule → execute → update, at step granularity. This module is
//! the "schedule" and "update" halves as plain code and data: it holds no device, no
//! clock, no thread and does no I/O. The denoise actor drives it:
//!
//! ```text
//! loop {
//!     for req in newly_arrived { sched.submit(req)?; }      // join at the next step
//!     let plan = sched.plan();                              // admit + step plan
//!     if plan.is_empty() { wait for work; continue; }
//!     run one batched forward of plan.ids();                // the only device work
//!     for id in sched.complete_step(&plan) { hand the latent of `id` to postprocess; }
//! }
//! ```
//!
//! The same state machine replays without a model in [`simulate`] (discrete-event), which
//! is how the router prices "this worker's pipeline latency with the new request added".
//!
//! # Policy
//!
//! * **Running requests are never preempted or reordered.** Every step runs every
//!   running request, in admission order; a request leaves the batch in the step it
//!   finishes (its last step), never later.
//! * **Admission is strict FIFO with head-of-line blocking.** Waiting requests are admitted
//!   in submission order while the batch stays within `max_batch` requests and
//!   `token_budget` rows; the first request that does not fit stops admission for this
//!   step, even if a later, smaller one would fit. Skipping ahead would raise utilisation
//!   a little, but lets a stream of small (masked) requests starve a large (full-image)
//!   one indefinitely; with strict FIFO no request waits for more than the remaining
//!   steps of the batch in front of it, which is what the router's latency estimate and
//!   the per-request deadline need. The lost utilisation is bounded: the blocked head
//!   joins as soon as enough running requests finish, at most one request's run later.
//! * **An oversized request runs alone.** A request whose rows exceed the whole
//!   `token_budget` is admitted when the batch is empty (otherwise it would wait forever),
//!   and nothing joins it until it finishes. This is the only way the total rows of a
//!   step exceed the budget.
//! * **Device memory.** On a GPU every template the batch reads must be resident
//!   during the step. A request names its template ([`TemplateUse`]); the distinct
//!   templates of the running batch stay within `template_bytes`, the device memory
//!   left for them by the budget computed at start. A template shared by several
//!   requests counts once. A request whose template alone exceeds it is refused at
//!   submission with the figures: it could never run without an out-of-memory error.
//! * **A held request pauses in place.** [`BatchScheduler::hold`] leaves a running
//!   request out of the plans (it keeps its place, rows and template, since its state
//!   stays on the device) until [`BatchScheduler::release`]: how a request waits at step
//!   K for a LoRA that is still loading (bounded asynchronous loading, docs/design.md
//!   §Adapters). The others go on.
//! * **`Batching::Static`** (a baseline for measured comparisons): admission happens only
//!   when nothing is running; it then takes as many waiting requests as fit (same FIFO
//!   rule), and no request joins until the whole batch has finished.
//!
//! # Cost
//!
//! `plan()` + `complete_step()` are O(running + admitted) with one allocation (the id
//! list of the plan); ids are checked for uniqueness with a hash set at `submit`.
//! See the ignored `bench_plan_complete_step` test for the measured time.

mod sim;
#[cfg(test)]
mod tests;

use crate::wire::JobId;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

pub use sim::{simulate, SimOutcome};

/// What the scheduler knows of a request: plain numbers, no tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SchedRequest {
    pub id: JobId,
    /// Rows this request adds to a batched step: text tokens T plus active image tokens
    /// A (A = L, all image tokens, for full runs and template captures). The token
    /// budget counts these rows.
    pub rows_per_step: usize,
    /// Denoising steps of the whole request.
    pub steps_total: u32,
    /// Steps already run (0 for a new request; more for one resumed elsewhere).
    pub steps_done: u32,
    /// The caller's logical arrival stamp (a time or a sequence number), carried along
    /// for bookkeeping. It does not order admission: submission order does.
    pub arrival: u64,
    /// The template an edit reads, which the device must hold while it runs.
    pub template: Option<TemplateUse>,
}

/// A template as the scheduler counts it: an identity (requests with equal keys share
/// one resident copy) and its bytes in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TemplateUse {
    pub key: u64,
    pub bytes: u64,
}

impl SchedRequest {
    /// A new request with no step run yet and arrival stamp 0.
    pub fn new(id: JobId, rows_per_step: usize, steps_total: u32) -> Self {
        SchedRequest {
            id,
            rows_per_step,
            steps_total,
            steps_done: 0,
            arrival: 0,
            template: None,
        }
    }

    /// The same request, reading `template`.
    pub fn with_template(self, template: TemplateUse) -> Self {
        SchedRequest {
            template: Some(template),
            ..self
        }
    }

    /// Steps still to run.
    pub fn steps_left(&self) -> u32 {
        self.steps_total.saturating_sub(self.steps_done)
    }

    /// Whether every step has run.
    pub fn is_finished(&self) -> bool {
        self.steps_done >= self.steps_total
    }
}

pub use denoised_runtime::config::Batching;

/// Limits and mode of the denoise batch: the `[denoise]` section of config.toml.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BatchConfig {
    /// Most requests in one batched step (`[denoise] max_batch`, at least 1).
    pub max_batch: usize,
    /// Most rows (text + active image tokens, summed over the batch) in one step
    /// (`[denoise] token_budget`, at least 1). A single request larger than the budget
    /// still runs, alone.
    pub token_budget: usize,
    /// `"continuous"` (default) or `"static"`, the baseline for measured comparisons
    /// (`[denoise] batching`).
    #[serde(rename = "batching")]
    pub mode: Batching,
    /// Device bytes for the distinct templates of the running batch (computed from the
    /// device memory budget at start; unlimited on the CPU, which reads templates in
    /// place).
    #[serde(skip, default = "unlimited")]
    pub template_bytes: u64,
}

fn unlimited() -> u64 {
    u64::MAX
}

impl BatchConfig {
    /// Default `max_batch`.
    pub const DEFAULT_MAX_BATCH: usize = 16;
    /// Default `token_budget`: about seven full 1024x1024 FLUX requests (4096 image
    /// tokens + 512 text tokens each), or many more masked ones.
    pub const DEFAULT_TOKEN_BUDGET: usize = 32768;

    /// Checks the limits (both must be at least 1).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_batch == 0 {
            return Err(ConfigError::ZeroMaxBatch);
        }
        if self.token_budget == 0 {
            return Err(ConfigError::ZeroTokenBudget);
        }
        Ok(())
    }
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_batch: Self::DEFAULT_MAX_BATCH,
            token_budget: Self::DEFAULT_TOKEN_BUDGET,
            mode: Batching::Continuous,
            template_bytes: u64::MAX,
        }
    }
}

/// An invalid [`BatchConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigError {
    ZeroMaxBatch,
    ZeroTokenBudget,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroMaxBatch => write!(f, "[denoise] max_batch must be at least 1"),
            ConfigError::ZeroTokenBudget => {
                write!(f, "[denoise] token_budget must be at least 1")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why [`BatchScheduler::submit`] refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// A request with this id is already waiting or running.
    DuplicateId(JobId),
    /// The request has no rows (nothing to compute).
    ZeroRows(JobId),
    /// The request has no step left (`steps_done >= steps_total`).
    NoStepsLeft(JobId),
    /// The request's template alone needs more device memory than the budget leaves
    /// for templates.
    TemplateTooLarge { id: JobId, bytes: u64, budget: u64 },
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::DuplicateId(id) => write!(f, "request {id} is already scheduled"),
            SubmitError::ZeroRows(id) => write!(f, "request {id} has no rows per step"),
            SubmitError::NoStepsLeft(id) => write!(f, "request {id} has no step left"),
            SubmitError::TemplateTooLarge { id, bytes, budget } => write!(
                f,
                "request {id}: its template needs {:.2} GB of device memory, and the \
                 device budget leaves {:.2} GB for templates (see /readyz `device_budget`)",
                *bytes as f64 / 1e9,
                *budget as f64 / 1e9
            ),
        }
    }
}

impl std::error::Error for SubmitError {}

/// The requests of one step, returned by [`BatchScheduler::plan`] and given back to
/// [`BatchScheduler::complete_step`] once the step has run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    ids: Vec<JobId>,
    admitted: usize,
    rows: usize,
    step: u64,
    /// Admission tickets below this one are in the plan (every request running when the
    /// plan was made); later admissions are not.
    ticket_end: u64,
    /// Running requests held when the plan was made: not in it, not advanced.
    held: Vec<JobId>,
}

impl StepPlan {
    /// The requests to run, in batch order: the ones already running in admission
    /// order, then the newly admitted ones in FIFO order.
    pub fn ids(&self) -> &[JobId] {
        &self.ids
    }

    /// The requests that join the batch with this step (a suffix of [`StepPlan::ids`]).
    pub fn admitted(&self) -> &[JobId] {
        &self.ids[self.ids.len() - self.admitted..]
    }

    /// Total rows of the step.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The step's index (steps completed by the scheduler before it).
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// An empty plan: nothing to run (the loop waits for a submission).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The scheduler state: a FIFO of waiting requests and the running batch.
#[derive(Clone, Debug)]
pub struct BatchScheduler {
    config: BatchConfig,
    waiting: VecDeque<SchedRequest>,
    /// The running batch in admission order, with `tickets` in lockstep.
    running: Vec<SchedRequest>,
    tickets: Vec<u64>,
    running_rows: usize,
    /// Distinct templates of the running batch: key -> (bytes, running requests).
    templates: HashMap<u64, (u64, usize)>,
    template_bytes: u64,
    /// Ids waiting or running.
    live: HashSet<JobId>,
    next_ticket: u64,
    step: u64,
    /// Running requests paused by [`hold`](Self::hold).
    held: HashSet<JobId>,
}

impl BatchScheduler {
    /// An empty scheduler; fails on an invalid config.
    pub fn new(config: BatchConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(BatchScheduler {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            tickets: Vec::new(),
            running_rows: 0,
            templates: HashMap::new(),
            template_bytes: 0,
            live: HashSet::new(),
            next_ticket: 0,
            step: 0,
            held: HashSet::new(),
        })
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// Queues a request; it joins the batch at a later [`plan`](Self::plan).
    pub fn submit(&mut self, req: SchedRequest) -> Result<(), SubmitError> {
        if req.rows_per_step == 0 {
            return Err(SubmitError::ZeroRows(req.id));
        }
        if req.is_finished() {
            return Err(SubmitError::NoStepsLeft(req.id));
        }
        if let Some(t) = req
            .template
            .filter(|t| t.bytes > self.config.template_bytes)
        {
            return Err(SubmitError::TemplateTooLarge {
                id: req.id,
                bytes: t.bytes,
                budget: self.config.template_bytes,
            });
        }
        if !self.live.insert(req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        self.waiting.push_back(req);
        Ok(())
    }

    /// Removes a request, waiting or running; false if it is neither. A running request
    /// cancelled while its step runs is not advanced by [`complete_step`](Self::complete_step)
    /// and not reported as finished.
    pub fn cancel(&mut self, id: JobId) -> bool {
        if !self.live.remove(&id) {
            return false;
        }
        self.held.remove(&id);
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.tickets.remove(i);
            self.leave(&r);
        } else if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
        } else {
            unreachable!("live id {id} neither waiting nor running");
        }
        true
    }

    /// Admits waiting requests (see the module's policy) and returns the next step: every
    /// running request. Calling it again before [`complete_step`](Self::complete_step)
    /// supersedes the earlier plan (and may admit more).
    pub fn plan(&mut self) -> StepPlan {
        let before = self.running.len();
        self.admit();
        let held: Vec<JobId> = match self.held.is_empty() {
            true => vec![],
            false => self
                .running
                .iter()
                .map(|r| r.id)
                .filter(|id| self.held.contains(id))
                .collect(),
        };
        let rows = self.running_rows
            - self
                .running
                .iter()
                .filter(|r| held.contains(&r.id))
                .map(|r| r.rows_per_step)
                .sum::<usize>();
        StepPlan {
            ids: self
                .running
                .iter()
                .map(|r| r.id)
                .filter(|id| !held.contains(id))
                .collect(),
            admitted: self.running.len() - before,
            rows,
            step: self.step,
            ticket_end: self.next_ticket,
            held,
        }
    }

    /// Pauses a running request (see the module's policy); false if it is not running.
    pub fn hold(&mut self, id: JobId) -> bool {
        self.running.iter().any(|r| r.id == id) && self.held.insert(id)
    }

    /// Resumes a held request from the next plan; false if it was not held.
    pub fn release(&mut self, id: JobId) -> bool {
        self.held.remove(&id)
    }

    /// Whether a request is held.
    pub fn is_held(&self, id: JobId) -> bool {
        self.held.contains(&id)
    }

    fn admit(&mut self) {
        if self.config.mode == Batching::Static && !self.running.is_empty() {
            return;
        }
        while let Some(head) = self.waiting.front() {
            if self.running.len() >= self.config.max_batch {
                break;
            }
            // The empty-batch exception lets an oversized request run, alone.
            if !self.running.is_empty()
                && self.running_rows.saturating_add(head.rows_per_step) > self.config.token_budget
            {
                break; // Head-of-line blocking: nothing overtakes the head.
            }
            if self
                .template_bytes
                .saturating_add(self.new_template_bytes(head))
                > self.config.template_bytes
            {
                break; // Same rule; submit refused any template that never fits.
            }
            let req = self.waiting.pop_front().expect("front exists");
            self.join(&req);
            self.running.push(req);
            self.tickets.push(self.next_ticket);
            self.next_ticket += 1;
        }
    }

    /// Records that `plan`'s step has run: advances every request of the plan that is
    /// still running by one step, and removes and returns (in batch order) the ones that
    /// have finished. Panics if `plan` is not from the current step (a plan runs once).
    pub fn complete_step(&mut self, plan: &StepPlan) -> Vec<JobId> {
        assert_eq!(
            plan.step, self.step,
            "complete_step: plan of step {} given at step {}",
            plan.step, self.step
        );
        self.step += 1;
        let mut finished = Vec::new();
        let mut keep = 0;
        for i in 0..self.running.len() {
            let mut r = self.running[i];
            let ticket = self.tickets[i];
            if ticket < plan.ticket_end && !plan.held.contains(&r.id) {
                r.steps_done += 1;
                if r.is_finished() {
                    finished.push(r.id);
                    self.live.remove(&r.id);
                    self.leave(&r);
                    continue;
                }
            }
            self.running[keep] = r;
            self.tickets[keep] = ticket;
            keep += 1;
        }
        self.running.truncate(keep);
        self.tickets.truncate(keep);
        finished
    }

    /// Device bytes `r`'s template adds to the running batch (0 if already there).
    fn new_template_bytes(&self, r: &SchedRequest) -> u64 {
        match r.template {
            Some(t) if !self.templates.contains_key(&t.key) => t.bytes,
            _ => 0,
        }
    }

    /// Accounts for `r` joining the running batch.
    fn join(&mut self, r: &SchedRequest) {
        self.running_rows += r.rows_per_step;
        if let Some(t) = r.template {
            self.template_bytes += self.new_template_bytes(r);
            self.templates.entry(t.key).or_insert((t.bytes, 0)).1 += 1;
        }
    }

    /// Accounts for `r` leaving the running batch (finished or cancelled).
    fn leave(&mut self, r: &SchedRequest) {
        self.running_rows -= r.rows_per_step;
        if let Some(t) = r.template {
            let e = self.templates.get_mut(&t.key).expect("a running template");
            e.1 -= 1;
            if e.1 == 0 {
                self.template_bytes -= e.0;
                self.templates.remove(&t.key);
            }
        }
    }

    /// Device bytes of the distinct templates of the running batch.
    pub fn running_template_bytes(&self) -> u64 {
        self.template_bytes
    }

    /// The running batch, in admission (batch) order.
    pub fn running(&self) -> &[SchedRequest] {
        &self.running
    }

    /// The waiting queue, head first.
    pub fn waiting(&self) -> impl ExactSizeIterator<Item = &SchedRequest> + '_ {
        self.waiting.iter()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Total rows of the running batch.
    pub fn running_rows(&self) -> usize {
        self.running_rows
    }

    /// Steps completed so far.
    pub fn steps_completed(&self) -> u64 {
        self.step
    }

    /// Nothing waiting and nothing running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Whether a request is waiting or running.
    pub fn contains(&self, id: JobId) -> bool {
        self.live.contains(&id)
    }
}
