//! Routing policies: which denoise worker takes a request (issue: mask-aware load
//! balancing). Pure: worker states and a step-cost model in, a worker index out. The
//! router (once workers report their state) and `denoised bench simulate` both call it.
//!
//! - `round_robin`: the next worker with room, in turn;
//! - `least_requests`: the worker with room running the fewest requests;
//! - `least_tokens`: the worker with room computing the fewest rows per step;
//! - `mask_aware` (Algorithm 2 of the mask-aware caching design): the worker with room
//!   whose running batch, with the request added, would cost the least latency: the
//!   request's own finish time (its template load, none if the worker's device holds
//!   the template, a host load if its host tier does, else a disk load; then each of
//!   its steps priced with the worker's step-cost model over the batch it would run in,
//!   the running requests leaving as their remaining steps end), plus the time it adds
//!   to the running requests (the load, and the extra cost of each step they share).
//!   Balancing by count or tokens is wrong when masks vary tenfold; this counts the
//!   work. Counting the others' delay too (not only the request's own finish) is what
//!   keeps a heavy edit from joining a batch of many light ones that have long to run:
//!   in simulation it lowers p95 by a further 15-18 points on the public trace at
//!   90-95% load (docs/performance.md).
//!
//! Ties go to the lowest worker index, so a decision is a function of its inputs.

use std::str::FromStr;

use denoised_models::flux::cost::{forward_flops, StepShape};
use denoised_models::flux::FluxConfig;
use denoised_models::profile::Profile;

pub mod beats;
pub mod pods;
pub mod sim;
#[cfg(test)]
mod tests;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    RoundRobin,
    LeastRequests,
    LeastTokens,
    #[default]
    MaskAware,
}

impl Policy {
    pub const ALL: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::LeastRequests,
        Policy::LeastTokens,
        Policy::MaskAware,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequests => "least_requests",
            Policy::LeastTokens => "least_tokens",
            Policy::MaskAware => "mask_aware",
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "routing policy `{s}`: expected one of {}",
                    Policy::ALL.map(Policy::name).join(", ")
                )
            })
    }
}

/// A request a worker is running: its step shape and the steps it has left.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Running {
    pub shape: StepShape,
    pub steps_left: u32,
}

/// What a worker reports of itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerView {
    /// Whether its batch can take one more request now.
    pub room: bool,
    pub running: Vec<Running>,
    /// Templates (their versions) resident on its device, and in the host tier it
    /// reads from.
    pub device_templates: Vec<u64>,
    pub host_templates: Vec<u64>,
}

impl WorkerView {
    /// A worker with nothing to do (and room).
    pub fn idle() -> Self {
        WorkerView {
            room: true,
            ..WorkerView::default()
        }
    }

    /// Rows it computes per step (text and active image tokens of every request).
    pub fn rows(&self) -> usize {
        self.running
            .iter()
            .map(|r| r.shape.text + r.shape.active)
            .sum()
    }
}

/// The template a request reads, and what bringing it to a worker costs from each tier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TemplateNeed {
    pub version: u64,
    pub host_load_s: f64,
    pub disk_load_s: f64,
}

/// The request to place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Incoming {
    pub shape: StepShape,
    pub steps: u32,
    pub template: Option<TemplateNeed>,
}

/// Seconds of one step of a batch of these shapes on a worker (its fitted model).
pub trait StepCost {
    fn step_s(&self, batch: &[StepShape]) -> f64;
}

/// A worker's step-cost model from its profile (`denoised profile`): the compute fit
/// over the batch's FLOPs, as the planner prices a step whose loads hide.
pub struct ProfileCost<'a> {
    pub config: &'a FluxConfig,
    pub profile: &'a Profile,
}

impl StepCost for ProfileCost<'_> {
    fn step_s(&self, batch: &[StepShape]) -> f64 {
        let flops: f64 = batch.iter().map(|s| forward_flops(self.config, *s)).sum();
        self.profile.compute.predict(flops)
    }
}

/// What placing a request on a worker would cost, in seconds of latency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Until the request would finish: its template load, then each of its steps over
    /// the batch it would share, the running requests leaving as their steps run out.
    pub finish_s: f64,
    /// What it would add to the running requests' latencies, summed: the load (the
    /// step that admits it waits for it), and each shared step's extra cost once per
    /// request sharing it.
    pub delay_s: f64,
}

impl Estimate {
    /// `mask_aware`'s key: the latency the worker's batch gains, all requests counted.
    pub fn cost_s(&self) -> f64 {
        self.finish_s + self.delay_s
    }
}

/// What placing `req` on `w` would cost (see [`Estimate`]).
pub fn estimate(w: &WorkerView, req: &Incoming, cost: &dyn StepCost) -> Estimate {
    let load = match req.template {
        None => 0.0,
        Some(t) if w.device_templates.contains(&t.version) => 0.0,
        Some(t) if w.host_templates.contains(&t.version) => t.host_load_s,
        Some(t) => t.disk_load_s,
    };
    // The batch changes only when a running request ends: price each stretch once.
    let mut ends: Vec<u32> = w.running.iter().map(|r| r.steps_left).collect();
    ends.sort_unstable();
    let mut batch: Vec<StepShape> = Vec::with_capacity(w.running.len() + 1);
    let (mut t, mut done) = (load, 0u32);
    let mut delay = load * w.running.len() as f64;
    for &end in ends.iter().chain(std::iter::once(&u32::MAX)) {
        let upto = end.min(req.steps);
        if upto > done {
            batch.clear();
            batch.push(req.shape);
            batch.extend(
                w.running
                    .iter()
                    .filter(|r| r.steps_left > done)
                    .map(|r| r.shape),
            );
            let (steps, with) = ((upto - done) as f64, cost.step_s(&batch));
            t += steps * with;
            let others = batch.len() - 1;
            if others > 0 {
                delay += steps * others as f64 * (with - cost.step_s(&batch[1..]));
            }
            done = upto;
        }
        if done == req.steps {
            break;
        }
    }
    Estimate {
        finish_s: t,
        delay_s: delay,
    }
}

/// Chooses the worker that takes a request: the routing policy, with its round-robin
/// position (the router's balancer and the cluster simulator both dispatch with it).
#[derive(Clone, Debug, Default)]
pub struct Dispatcher {
    pub policy: Policy,
    next: usize,
}

impl Dispatcher {
    pub fn new(policy: Policy) -> Self {
        Dispatcher { policy, next: 0 }
    }

    /// The worker to take `req`, among those with room (`None` if none has).
    pub fn choose(
        &mut self,
        workers: &[WorkerView],
        req: &Incoming,
        cost: &dyn StepCost,
    ) -> Option<usize> {
        let open = || (0..workers.len()).filter(|&i| workers[i].room);
        // The first minimum: ties go to the lowest index.
        let argmin = |key: &dyn Fn(usize) -> f64| {
            open().fold(None, |best: Option<(usize, f64)>, i| {
                let k = key(i);
                match best {
                    Some((_, b)) if b <= k => best,
                    _ => Some((i, k)),
                }
            })
        };
        let pick = match self.policy {
            Policy::RoundRobin => {
                let n = workers.len();
                let i = (0..n)
                    .map(|k| (self.next + k) % n)
                    .find(|&i| workers[i].room)?;
                self.next = (i + 1) % n;
                return Some(i);
            }
            Policy::LeastRequests => argmin(&|i| workers[i].running.len() as f64),
            Policy::LeastTokens => argmin(&|i| workers[i].rows() as f64),
            Policy::MaskAware => argmin(&|i| estimate(&workers[i], req, cost).cost_s()),
        };
        pick.map(|(i, _)| i)
    }
}
