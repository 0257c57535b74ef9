//! Routing between pods (a pod: one host's daemon, its denoise workers and template
//! tiers; docs/cluster.md): which pod runs a request. Pure, like the in-pod policies:
//! the pods' reports and the template's prices in, a pod index out. The cluster
//! simulator (`denoised simulate --pods`) calls it; inside the chosen pod the in-pod
//! policy ([`super::Dispatcher`]) places the request on a worker.
//!
//! - `round_robin`: the next pod that is up, in turn;
//! - `least_loaded`: the pod whose best worker the request would cost the least
//!   latency, by the in-pod policy's own key ([`super::estimate`]: its finish and the
//!   delay it adds to the running requests), its template ignored, after the requests
//!   queued at the pod;
//! - `template_aware` (the default): the same, with the template's price in that pod
//!   ([`in_pod`]): nothing where a worker's device holds it, a host-tier load where the
//!   pod's memory does, else the cheapest of a disk load, a transfer from a peer (the
//!   request waits at the pod while it comes) and a recapture (all its steps). The
//!   template is the load: a FLUX.1-Fill-dev template at 1024x1024 and 28 steps is
//!   40 GB in fp8, so where it lives decides where its edits should run.
//!
//! Ties go to the lowest pod index.

use std::str::FromStr;

use super::{estimate, Incoming, Running, StepCost, TemplateNeed, WorkerView};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PodPolicy {
    RoundRobin,
    LeastLoaded,
    #[default]
    TemplateAware,
}

impl PodPolicy {
    pub const ALL: [PodPolicy; 3] = [
        PodPolicy::RoundRobin,
        PodPolicy::LeastLoaded,
        PodPolicy::TemplateAware,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PodPolicy::RoundRobin => "round_robin",
            PodPolicy::LeastLoaded => "least_loaded",
            PodPolicy::TemplateAware => "template_aware",
        }
    }
}

impl FromStr for PodPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PodPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "pod policy `{s}`: expected one of {}",
                    PodPolicy::ALL.map(PodPolicy::name).join(", ")
                )
            })
    }
}

/// Where a pod holds a template, best tier first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Held {
    /// On some worker's device (the worker views say which).
    Device,
    /// In the pod's host memory (its shared-memory tier).
    Host,
    /// On the pod's disk.
    Disk,
    /// Not in the pod.
    Absent,
}

/// What a pod reports: whether it answers, its workers (as each reports itself, the
/// pod's host tier in their `host_templates`), the requests waiting at its router for a
/// worker with room, the templates on its disk, and those on their way from a peer
/// (with the seconds left).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodView {
    pub up: bool,
    pub workers: Vec<WorkerView>,
    pub queued: Vec<Running>,
    pub disk_templates: Vec<u64>,
    pub fetching: Vec<(u64, f64)>,
}

impl PodView {
    /// The best tier of `version` in this pod.
    pub fn holds(&self, version: u64) -> Held {
        if self
            .workers
            .iter()
            .any(|w| w.device_templates.contains(&version))
        {
            Held::Device
        } else if self
            .workers
            .iter()
            .any(|w| w.host_templates.contains(&version))
        {
            Held::Host
        } else if self.disk_templates.contains(&version) {
            Held::Disk
        } else {
            Held::Absent
        }
    }
}

/// The price of a template a pod lacks: a transfer from a peer (the whole file at the
/// cluster's bandwidth cap), or a capture again (all its steps, full, on the worker).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MissPrices {
    pub fetch_s: f64,
    pub recapture_s: f64,
}

/// Where a request's template came from when its worker admitted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// The request reads no template.
    None,
    Device,
    Host,
    Disk,
    /// Transferred from another pod.
    Peer,
    /// Captured again (no pod held it, or that was cheaper).
    Recapture,
}

impl Source {
    pub const ALL: [Source; 6] = [
        Source::None,
        Source::Device,
        Source::Host,
        Source::Disk,
        Source::Peer,
        Source::Recapture,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Source::None => "none",
            Source::Device => "device",
            Source::Host => "host",
            Source::Disk => "disk",
            Source::Peer => "peer",
            Source::Recapture => "recapture",
        }
    }
}

/// Where a pod whose memory lacks a template gets it, and the seconds that takes: the
/// cheapest of its disk (where it is there), a peer's copy (where one holds it) and a
/// recapture. Ties go to the disk, then the peer.
pub fn miss_source(
    on_disk: bool,
    peer_holds: bool,
    t: &TemplateNeed,
    miss: MissPrices,
) -> (Source, f64) {
    [
        (on_disk, Source::Disk, t.disk_load_s),
        (peer_holds, Source::Peer, miss.fetch_s),
        (true, Source::Recapture, miss.recapture_s),
    ]
    .into_iter()
    .filter(|o| o.0)
    .fold((Source::Recapture, f64::INFINITY), |best, (_, src, s)| {
        if s < best.1 {
            (src, s)
        } else {
            best
        }
    })
}

/// `req` as pod `p` would see it, and how long it would wait before a worker could take
/// it. A template in the pod's memory or on a device costs what the in-pod estimate
/// charges. Otherwise the cheapest of [`miss_source`]: from its disk or by recapture, a
/// load in the step that admits it (stalling that step's batch, as [`estimate`]
/// charges); from a peer, a transfer into the pod's memory while the request waits at
/// the pod (the router fetches on arrival; no worker stalls), then a host load. A
/// template already on its way costs the seconds it has left.
pub fn in_pod(req: &Incoming, p: &PodView, peer_holds: bool, miss: MissPrices) -> (Incoming, f64) {
    let Some(t) = req.template else {
        return (*req, 0.0);
    };
    let held = p
        .workers
        .iter()
        .any(|w| w.device_templates.contains(&t.version) || w.host_templates.contains(&t.version));
    let arriving = p.fetching.iter().find(|f| f.0 == t.version).map(|f| f.1);
    let (disk_load_s, wait) = match (held, arriving) {
        (true, _) => (t.disk_load_s, 0.0),
        (false, Some(left)) => (t.host_load_s, left),
        (false, None) => {
            match miss_source(p.disk_templates.contains(&t.version), peer_holds, &t, miss) {
                (Source::Peer, s) => (t.host_load_s, s),
                (_, s) => (s, 0.0),
            }
        }
    };
    let template = Some(TemplateNeed { disk_load_s, ..t });
    (Incoming { template, ..*req }, wait)
}

/// Seconds of latency `req` would cost on pod `p`'s best worker, by the in-pod policy's
/// own key (its finish and the delay it adds to the running requests; `template`: with
/// the template's price in that pod, else without it), after any wait for the
/// template and the requests queued at the pod (their work, alone, shared over its
/// workers).
pub fn pod_cost_s(
    p: &PodView,
    req: &Incoming,
    peer_holds: bool,
    miss: MissPrices,
    template: bool,
    cost: &dyn StepCost,
) -> f64 {
    let (r, wait) = match template {
        true => in_pod(req, p, peer_holds, miss),
        false => (
            Incoming {
                template: None,
                ..*req
            },
            0.0,
        ),
    };
    let queued: f64 = p
        .queued
        .iter()
        .map(|q| q.steps_left as f64 * cost.step_s(&[q.shape]))
        .sum();
    let best = p
        .workers
        .iter()
        .map(|w| estimate(w, &r, cost).cost_s())
        .fold(f64::INFINITY, f64::min);
    wait + best + queued / p.workers.len().max(1) as f64
}

/// Chooses the pod that runs a request, with its round-robin position.
#[derive(Clone, Debug, Default)]
pub struct PodRouter {
    pub policy: PodPolicy,
    next: usize,
}

impl PodRouter {
    pub fn new(policy: PodPolicy) -> Self {
        PodRouter { policy, next: 0 }
    }

    /// The pod to run `req` among those up (`None` if none is).
    pub fn choose(
        &mut self,
        pods: &[PodView],
        req: &Incoming,
        miss: MissPrices,
        cost: &dyn StepCost,
    ) -> Option<usize> {
        let n = pods.len();
        if self.policy == PodPolicy::RoundRobin {
            let i = (0..n).map(|k| (self.next + k) % n).find(|&i| pods[i].up)?;
            self.next = (i + 1) % n;
            return Some(i);
        }
        let template = self.policy == PodPolicy::TemplateAware;
        // Which pods hold the template anywhere: a pod lacking it fetches from them.
        let holders: Vec<bool> = match (template, req.template) {
            (true, Some(t)) => pods
                .iter()
                .map(|p| p.up && p.holds(t.version) != Held::Absent)
                .collect(),
            _ => vec![false; n],
        };
        let holders_n = holders.iter().filter(|&&h| h).count();
        (0..n)
            .filter(|&i| pods[i].up)
            .map(|i| {
                let peer = holders_n > usize::from(holders[i]);
                (i, pod_cost_s(&pods[i], req, peer, miss, template, cost))
            })
            .fold(None, |best: Option<(usize, f64)>, (i, k)| match best {
                Some((_, b)) if b <= k => best,
                _ => Some((i, k)),
            })
            .map(|(i, _)| i)
    }
}
