//! A discrete-event simulator of denoise workers, alone or in pods: the real routing
//! policies (between pods [`PodRouter`], inside a pod [`Dispatcher`]) and the real
//! batching scheduler ([`BatchScheduler`]) on simulated time, each step priced by a
//! step-cost model (a worker's profile). How the policies compare on fleets bigger
//! than one machine (`denoised simulate`).
//!
//! A request goes, on arrival, to the pod the pod policy picks (forwarded whole, as a
//! router does), and waits in that pod's queue. It goes to the worker the in-pod policy
//! picks among those with room (running plus waiting below `max_batch`); when none has
//! room it waits, in arrival order, until a step ends there. A worker pays for its
//! request's template in the step that admits it: nothing if its device holds it, a
//! host-tier or disk load if its pod's memory or disk does, a transfer if another pod
//! holds it, else a recapture. The template then lands on the worker's device and in
//! its pod's memory and disk (written through), each tier keeping the most recently
//! used templates up to its capacity.

use std::collections::{HashMap, VecDeque};

use denoised_models::flux::cost::StepShape;

pub use super::pods::Source;
use super::pods::{miss_source, MissPrices, PodPolicy, PodRouter, PodView};
use super::{Dispatcher, Incoming, Policy, Running, StepCost, WorkerView};
use crate::batching::{BatchConfig, BatchScheduler, SchedRequest, StepPlan};

/// One simulated request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimRequest {
    pub arrival: f64,
    pub req: Incoming,
}

/// When a request started its first step and ended its last, and where.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Done {
    pub arrival: f64,
    pub admit: f64,
    pub finish: f64,
    pub pod: usize,
    /// The worker, within its pod.
    pub worker: usize,
    /// Where its template came from: `Peer` where it waited for a transfer to its pod
    /// (the one it started, or one under way), else the tier its worker read.
    pub source: Source,
    /// Whether its arrival started a transfer of its template to its pod.
    pub transfer: bool,
}

impl Done {
    pub fn latency(&self) -> f64 {
        self.finish - self.arrival
    }
}

/// The fleet: pods of workers, and what each tier holds and costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fleet {
    pub pods: usize,
    pub workers_per_pod: usize,
    /// Templates each tier keeps (least recently used out first); `None`: no limit.
    pub device_templates: Option<usize>,
    pub host_templates: Option<usize>,
    pub disk_templates: Option<usize>,
    /// Where the templates are at the start.
    pub placement: Placement,
    pub miss: MissPrices,
}

impl Fleet {
    /// One pod of `workers` with unlimited tiers and every template on its disk: one
    /// host's daemon.
    pub fn one_pod(workers: usize) -> Fleet {
        Fleet {
            pods: 1,
            workers_per_pod: workers,
            device_templates: None,
            host_templates: None,
            disk_templates: None,
            placement: Placement::EveryDisk,
            // No peers, and every template on the disk.
            miss: MissPrices {
                fetch_s: f64::INFINITY,
                recapture_s: f64::INFINITY,
            },
        }
    }
}

/// Where the templates start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On every pod's disk (one host's daemon and its cache directory).
    EveryDisk,
    /// Template v on the disk of pod v mod pods (each captured once, somewhere).
    OnePod,
    /// Nowhere: a template's first request captures it.
    Nowhere,
}

/// Templates in one tier, most recently used last.
struct Tier {
    cap: Option<usize>,
    items: Vec<u64>,
}

impl Tier {
    fn new(cap: Option<usize>) -> Tier {
        Tier { cap, items: vec![] }
    }
    fn contains(&self, v: u64) -> bool {
        self.items.contains(&v)
    }
    /// Marks `v` used now, adding it (and dropping the least recently used beyond the
    /// capacity) if it was not there.
    fn touch(&mut self, v: u64) {
        if let Some(i) = self.items.iter().position(|&x| x == v) {
            self.items.remove(i);
        }
        self.items.push(v);
        if let Some(cap) = self.cap {
            while self.items.len() > cap {
                self.items.remove(0);
            }
        }
    }
}

struct Worker {
    sched: BatchScheduler,
    /// The step in flight and when it ends.
    step: Option<(StepPlan, f64)>,
    device: Tier,
}

struct Pod {
    workers: Vec<Worker>,
    queue: VecDeque<usize>,
    dispatcher: Dispatcher,
    host: Tier,
    disk: Tier,
    /// Templates on their way from a peer, and when each arrives.
    fetching: Vec<(u64, f64)>,
}

/// Runs `reqs` (in arrival order) on `workers` workers of one pod with `batch` limits,
/// routed by `policy`, every step priced by `cost`. One outcome per request, in input
/// order.
pub fn simulate_cluster(
    reqs: &[SimRequest],
    workers: usize,
    batch: BatchConfig,
    policy: Policy,
    cost: &dyn StepCost,
) -> Result<Vec<Done>, String> {
    simulate_pods(
        reqs,
        &Fleet::one_pod(workers),
        batch,
        (PodPolicy::RoundRobin, policy),
        cost,
    )
}

/// Runs `reqs` (in arrival order) on `fleet`, routed between pods and inside each by
/// `policies`, every step priced by `cost`. One outcome per request, in input order.
pub fn simulate_pods(
    reqs: &[SimRequest],
    fleet: &Fleet,
    batch: BatchConfig,
    policies: (PodPolicy, Policy),
    cost: &dyn StepCost,
) -> Result<Vec<Done>, String> {
    simulate_pods_noting(reqs, fleet, batch, policies, cost, &mut Changes::default())
}

/// When each pod's state changed in a run, as its peers would be told
/// ([`super::beats`]): its load (a request routed to it, started or ended there) and
/// its template list (a copy arrived).
#[derive(Clone, Debug, Default)]
pub struct Changes {
    pub load: Vec<Vec<f64>>,
    pub templates: Vec<Vec<f64>>,
    /// The templates each pod holds at the end (its disk's, or its memory's without
    /// a disk limit).
    pub held: Vec<usize>,
}

/// [`simulate_pods`], noting in `changes` when each pod's state changed.
pub fn simulate_pods_noting(
    reqs: &[SimRequest],
    fleet: &Fleet,
    batch: BatchConfig,
    (pod_policy, policy): (PodPolicy, Policy),
    cost: &dyn StepCost,
    changes: &mut Changes,
) -> Result<Vec<Done>, String> {
    changes.load = vec![vec![]; fleet.pods];
    changes.templates = vec![vec![]; fleet.pods];
    if fleet.pods == 0 || fleet.workers_per_pod == 0 {
        return Err("a fleet of no workers".into());
    }
    let mut pods: Vec<Pod> = (0..fleet.pods)
        .map(|_| {
            Ok(Pod {
                workers: (0..fleet.workers_per_pod)
                    .map(|_| {
                        Ok(Worker {
                            sched: BatchScheduler::new(batch).map_err(|e| e.to_string())?,
                            step: None,
                            device: Tier::new(fleet.device_templates),
                        })
                    })
                    .collect::<Result<_, String>>()?,
                queue: VecDeque::new(),
                dispatcher: Dispatcher::new(policy),
                host: Tier::new(fleet.host_templates),
                disk: Tier::new(fleet.disk_templates),
                fetching: vec![],
            })
        })
        .collect::<Result<_, String>>()?;
    if fleet.placement == Placement::OnePod {
        for t in reqs.iter().filter_map(|r| r.req.template) {
            let p = &mut pods[t.version as usize % fleet.pods];
            if !p.disk.contains(t.version) {
                p.disk.touch(t.version);
            }
        }
    }
    let mut router = PodRouter::new(pod_policy);
    let mut out: Vec<Option<Done>> = vec![None; reqs.len()];
    let mut admit: HashMap<u64, (f64, usize, Source)> = HashMap::new();
    // When each routed request can go to a worker: at once, or when the transfer of
    // its template from a peer to its pod ends.
    let mut ready: Vec<f64> = vec![0.0; reqs.len()];
    let mut via_peer: Vec<(bool, bool)> = vec![(false, false); reqs.len()];
    let (mut now, mut next) = (0.0f64, 0usize);
    loop {
        // The next event: the earliest step end, transfer end or arrival; at one time,
        // step ends first (freeing room), then transfers, then arrivals.
        let end = pods
            .iter()
            .enumerate()
            .flat_map(|(pi, p)| {
                p.workers
                    .iter()
                    .enumerate()
                    .filter_map(move |(wi, w)| w.step.as_ref().map(|(_, t)| (pi, wi, *t)))
            })
            .min_by(|a, b| a.2.total_cmp(&b.2));
        let fetched = pods
            .iter()
            .enumerate()
            .flat_map(|(pi, p)| p.fetching.iter().map(move |&(v, t)| (pi, v, t)))
            .min_by(|a, b| a.2.total_cmp(&b.2));
        let arrival = reqs.get(next).map(|r| r.arrival);
        let first = |t: f64, others: [Option<f64>; 2]| others.iter().flatten().all(|&o| t <= o);
        let pi = match (end, fetched, arrival) {
            (Some((pi, wi, t)), f, a) if first(t, [f.map(|f| f.2), a]) => {
                now = t;
                let w = &mut pods[pi].workers[wi];
                let (plan, _) = w.step.take().expect("a step in flight");
                let finished = w.sched.complete_step(&plan);
                if !finished.is_empty() {
                    changes.load[pi].push(now);
                }
                for id in finished {
                    let (admitted, worker, source) = admit[&id];
                    let (peer, transfer) = via_peer[id as usize];
                    out[id as usize] = Some(Done {
                        arrival: reqs[id as usize].arrival,
                        admit: admitted,
                        finish: now,
                        pod: pi,
                        worker,
                        source: if peer { Source::Peer } else { source },
                        // A template evicted from the pod's memory while its request
                        // waited is transferred again in the admitting step.
                        transfer: transfer || source == Source::Peer,
                    });
                }
                pi
            }
            (_, Some((pi, v, t)), a) if first(t, [a, None]) => {
                // The template is in the pod's memory and on its disk.
                now = t;
                let p = &mut pods[pi];
                p.fetching.retain(|f| f.0 != v);
                p.host.touch(v);
                p.disk.touch(v);
                changes.templates[pi].push(now);
                pi
            }
            (_, _, Some(a)) => {
                now = now.max(a);
                let r = reqs[next].req;
                let pi = match fleet.pods {
                    1 => 0,
                    _ => {
                        let views: Vec<PodView> = pods
                            .iter()
                            .map(|p| pod_view(p, reqs, batch, fleet, r, now))
                            .collect();
                        router
                            .choose(&views, &r, fleet.miss, cost)
                            .ok_or("no pod is up")?
                    }
                };
                let (at, started) = fetch_if_cheapest(&mut pods, pi, fleet, r, now);
                ready[next] = at;
                via_peer[next] = (at > now, started);
                pods[pi].queue.push_back(next);
                changes.load[pi].push(now);
                next += 1;
                pi
            }
            _ if pods.iter().all(|p| p.queue.is_empty()) => break,
            _ => return Err("requests wait with every worker idle".into()),
        };
        // The pod the event touched: route what waits there and can go (its template
        // arrived), in order, while some worker has room, then start its idle
        // workers' steps.
        loop {
            let p = &pods[pi];
            let Some(qi) = p.queue.iter().position(|&ri| ready[ri] <= now) else {
                break;
            };
            let ri = p.queue[qi];
            let r = reqs[ri].req;
            let peer = r
                .template
                .is_some_and(|t| held_elsewhere(&pods, pi, t.version));
            let pv = pod_view(p, reqs, batch, fleet, r, now);
            let (r, _) = super::pods::in_pod(&r, &pv, peer, fleet.miss);
            let Some(wi) = pods[pi].dispatcher.choose(&pv.workers, &r, cost) else {
                break;
            };
            pods[pi].queue.remove(qi);
            let s = r.shape;
            let sr = SchedRequest::new(ri as u64, s.text + s.active, r.steps);
            pods[pi].workers[wi]
                .sched
                .submit(sr)
                .map_err(|e| e.to_string())?;
        }
        for wi in 0..pods[pi].workers.len() {
            let w = &mut pods[pi].workers[wi];
            if w.step.is_some() || w.sched.is_idle() {
                continue;
            }
            let plan = w.sched.plan();
            if plan.is_empty() {
                continue;
            }
            let mut load = 0.0;
            if !plan.admitted().is_empty() {
                changes.load[pi].push(now);
            }
            for &id in plan.admitted() {
                let (source, s) = acquire(&mut pods, pi, wi, fleet, reqs[id as usize].req);
                load += s;
                admit.insert(id, (now, wi, source));
            }
            let w = &mut pods[pi].workers[wi];
            let shapes: Vec<StepShape> = w
                .sched
                .running()
                .iter()
                .map(|s| reqs[s.id as usize].req.shape)
                .collect();
            let dt = load + cost.step_s(&shapes);
            w.step = Some((plan, now + dt));
        }
    }
    changes.held = pods
        .iter()
        .map(|p| p.disk.items.len().max(p.host.items.len()))
        .collect();
    out.into_iter()
        .enumerate()
        .map(|(i, d)| d.ok_or_else(|| format!("request {i} never finished")))
        .collect()
}

/// Whether a pod other than `pi` holds template `v` (in memory or on disk).
fn held_elsewhere(pods: &[Pod], pi: usize, v: u64) -> bool {
    pods.iter()
        .enumerate()
        .any(|(i, p)| i != pi && (p.host.contains(v) || p.disk.contains(v)))
}

/// On a request's arrival at pod `pi`: where the pod lacks its template and a peer's
/// copy is the cheapest way to get it, the transfer starts (one per template and pod).
/// When the request can go to a worker, and whether it started a transfer.
fn fetch_if_cheapest(
    pods: &mut [Pod],
    pi: usize,
    fleet: &Fleet,
    req: Incoming,
    now: f64,
) -> (f64, bool) {
    let Some(t) = req.template else {
        return (now, false);
    };
    let v = t.version;
    let p = &pods[pi];
    if let Some(&(_, at)) = p.fetching.iter().find(|f| f.0 == v) {
        return (at, false);
    }
    if p.host.contains(v) || p.workers.iter().any(|w| w.device.contains(v)) {
        return (now, false);
    }
    let on_disk = (fleet.placement == Placement::EveryDisk) || p.disk.contains(v);
    let peer = held_elsewhere(pods, pi, v);
    match miss_source(on_disk, peer, &t, fleet.miss) {
        (Source::Peer, s) => {
            pods[pi].fetching.push((v, now + s));
            (now + s, true)
        }
        _ => (now, false),
    }
}

/// The templates on pod `p`'s disk that `req` could read: its own, where every
/// template starts on every disk.
fn pod_disk(p: &Pod, fleet: &Fleet, req: Incoming) -> Vec<u64> {
    match ((fleet.placement == Placement::EveryDisk), req.template) {
        (true, Some(t)) => vec![t.version],
        _ => p.disk.items.clone(),
    }
}

/// Brings `req`'s template to worker `wi` of pod `pi`: where it came from and the
/// seconds it took. It lands on the device and in the pod's memory and disk.
fn acquire(pods: &mut [Pod], pi: usize, wi: usize, fleet: &Fleet, req: Incoming) -> (Source, f64) {
    let Some(t) = req.template else {
        return (Source::None, 0.0);
    };
    let v = t.version;
    let p = &pods[pi];
    let (source, s) = if p.workers[wi].device.contains(v) {
        (Source::Device, 0.0)
    } else if p.host.contains(v) {
        (Source::Host, t.host_load_s)
    } else {
        let on_disk = (fleet.placement == Placement::EveryDisk) || p.disk.contains(v);
        let peer = pods
            .iter()
            .enumerate()
            .any(|(i, q)| i != pi && (q.host.contains(v) || q.disk.contains(v)));
        miss_source(on_disk, peer, &t, fleet.miss)
    };
    let p = &mut pods[pi];
    p.workers[wi].device.touch(v);
    p.host.touch(v);
    p.disk.touch(v);
    (source, s)
}

/// What pod `p` reports to a router about `req`: its workers' views, its queue, the
/// templates on its disk and those on their way.
fn pod_view(
    p: &Pod,
    reqs: &[SimRequest],
    batch: BatchConfig,
    fleet: &Fleet,
    req: Incoming,
    now: f64,
) -> PodView {
    PodView {
        up: true,
        workers: p
            .workers
            .iter()
            .map(|w| view(w, reqs, &p.host.items, batch))
            .collect(),
        queued: p
            .queue
            .iter()
            .map(|&i| Running {
                shape: reqs[i].req.shape,
                steps_left: reqs[i].req.steps,
            })
            .collect(),
        disk_templates: pod_disk(p, fleet, req),
        fetching: p.fetching.iter().map(|&(v, at)| (v, at - now)).collect(),
    }
}

/// What worker `w` reports to the router: room, its requests (running and waiting)
/// with their steps left, its templates.
fn view(w: &Worker, reqs: &[SimRequest], host: &[u64], batch: BatchConfig) -> WorkerView {
    let running = w
        .sched
        .running()
        .iter()
        .chain(w.sched.waiting())
        .map(|s| Running {
            shape: reqs[s.id as usize].req.shape,
            steps_left: s.steps_left(),
        })
        .collect::<Vec<_>>();
    WorkerView {
        room: running.len() < batch.max_batch,
        running,
        device_templates: w.device.items.clone(),
        host_templates: host.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::simulate;
    use crate::routing::TemplateNeed;

    struct Rows(f64);
    impl StepCost for Rows {
        fn step_s(&self, batch: &[StepShape]) -> f64 {
            0.01 + self.0
                * batch
                    .iter()
                    .map(|s| (s.text + s.active) as f64)
                    .sum::<f64>()
        }
    }

    fn requests(n: usize, gap: f64, seed: u64) -> Vec<SimRequest> {
        let mut x = seed | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                SimRequest {
                    arrival: i as f64 * gap,
                    req: Incoming {
                        shape: StepShape {
                            text: 64,
                            active: 50 + (x % 2000) as usize,
                            image: 4096,
                        },
                        steps: 4 + (x % 5) as u32,
                        template: None,
                    },
                }
            })
            .collect()
    }

    /// One worker: exactly the single-worker scheduler replay, whatever the policy.
    #[test]
    fn one_worker_equals_the_scheduler_replay() {
        let batch = BatchConfig {
            max_batch: 4,
            ..BatchConfig::default()
        };
        let reqs = requests(40, 0.013, 7);
        let cost = Rows(2e-5);
        let arrivals: Vec<(f64, SchedRequest)> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let s = r.req.shape;
                (
                    r.arrival,
                    SchedRequest::new(i as u64, s.text + s.active, r.req.steps),
                )
            })
            .collect();
        let want = simulate(BatchScheduler::new(batch).unwrap(), 0.0, &arrivals, |run| {
            let shapes: Vec<StepShape> =
                run.iter().map(|s| reqs[s.id as usize].req.shape).collect();
            cost.step_s(&shapes)
        })
        .unwrap();
        for p in Policy::ALL {
            let got = simulate_cluster(&reqs, 1, batch, p, &cost).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert_eq!((g.admit, g.finish), (w.admit, w.finish), "{}", p.name());
            }
        }
    }

    /// Two pods of one worker, the template on pod 0's disk, round robin between pods:
    /// the request sent to pod 1 waits there for the transfer (and starts it); the one
    /// on pod 0 loads from its disk in its step. The next request to pod 1 finds the
    /// template in its memory.
    #[test]
    fn a_transfer_delays_only_its_request() {
        let batch = BatchConfig {
            max_batch: 4,
            ..BatchConfig::default()
        };
        let mut reqs = requests(3, 0.001, 5);
        for r in reqs.iter_mut() {
            r.req.template = Some(TemplateNeed {
                version: 0,
                host_load_s: 0.1,
                disk_load_s: 0.5,
            });
        }
        reqs[2].arrival = 10.0;
        let fleet = Fleet {
            pods: 2,
            workers_per_pod: 1,
            device_templates: Some(1),
            host_templates: None,
            disk_templates: None,
            placement: Placement::OnePod,
            miss: MissPrices {
                fetch_s: 1.0,
                recapture_s: 9.0,
            },
        };
        let d = simulate_pods(
            &reqs,
            &fleet,
            batch,
            (PodPolicy::RoundRobin, Policy::MaskAware),
            &Rows(2e-5),
        )
        .unwrap();
        assert_eq!(
            (d[0].pod, d[0].source, d[0].transfer),
            (0, Source::Disk, false)
        );
        assert_eq!(
            (d[1].pod, d[1].source, d[1].transfer),
            (1, Source::Peer, true)
        );
        assert!(
            (d[1].admit - (reqs[1].arrival + 1.0)).abs() < 1e-9,
            "{:?}",
            d[1]
        );
        assert!(d[0].admit == reqs[0].arrival, "{:?}", d[0]);
        // Round robin sends the third to pod 0 again: its device holds the template.
        assert_eq!((d[2].pod, d[2].source), (0, Source::Device));
    }

    #[test]
    fn more_workers_finish_sooner_and_templates_load_once_per_worker() {
        let batch = BatchConfig {
            max_batch: 4,
            ..BatchConfig::default()
        };
        let mut reqs = requests(60, 0.005, 3);
        for (i, r) in reqs.iter_mut().enumerate() {
            r.req.template = Some(TemplateNeed {
                version: (i % 3) as u64,
                host_load_s: 0.02,
                disk_load_s: 0.5,
            });
        }
        let cost = Rows(2e-5);
        let p95 = |w: usize, p: Policy| {
            let d = simulate_cluster(&reqs, w, batch, p, &cost).unwrap();
            let mut l: Vec<f64> = d.iter().map(Done::latency).collect();
            l.sort_by(f64::total_cmp);
            l[l.len() * 95 / 100]
        };
        for p in Policy::ALL {
            let (one, four) = (p95(1, p), p95(4, p));
            println!("{}: p95 {one:.3} s on 1 worker, {four:.3} s on 4", p.name());
            assert!(four < one, "{}: {four} vs {one}", p.name());
        }
        assert!(simulate_cluster(&reqs, 0, batch, Policy::MaskAware, &cost).is_err());
    }
}
