//! Routing policies: which denoise worker takes a request (issue: mask-aware load
//! balancing). Pure: worker states and a step-cost model in, a worker index out. The
//! router (once workers report their state) and `denoised simulate` both call it.
//!
//! - `round_robin`: the next worker with room, in turn;
//! - `least_requests`: the worker with room running the fewest requests;
//! - `least_tokens`: the worker with room computing the fewest rows per step;
//! - `mask_aware` (Algorithm 2 of the mask-aware caching design): the worker with room
//!   that would *finish the request soonest*: its template load (none if the worker's
//!   device holds the template, a host load if its host tier does, else a disk load),
//!   then each of the request's steps priced with the worker's step-cost model over the
//!   batch it would run in, the running requests leaving as their remaining steps end.
//!   Balancing by count or tokens is wrong when masks vary tenfold; this counts the
//!   work.
//!
//! Ties go to the lowest worker index, so a decision is a function of its inputs.

use std::str::FromStr;

use denoised_models::flux::cost::{forward_flops, StepShape};
use denoised_models::flux::FluxConfig;
use denoised_models::profile::Profile;

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

/// The seconds until `req` would finish on `w`: its template load, then each of its
/// steps over the batch it would share, the running requests leaving as their
/// remaining steps run out.
pub fn finish_s(w: &WorkerView, req: &Incoming, cost: &dyn StepCost) -> f64 {
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
            t += (upto - done) as f64 * cost.step_s(&batch);
            done = upto;
        }
        if done == req.steps {
            break;
        }
    }
    t
}

/// A router's policy and its round-robin position.
#[derive(Clone, Debug, Default)]
pub struct Router {
    pub policy: Policy,
    next: usize,
}

impl Router {
    pub fn new(policy: Policy) -> Self {
        Router { policy, next: 0 }
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
            Policy::MaskAware => argmin(&|i| finish_s(&workers[i], req, cost)),
        };
        pick.map(|(i, _)| i)
    }
}
