//! A discrete-event simulator of a cluster of denoise workers: the real routing
//! policies ([`Dispatcher`]) and the real batching scheduler ([`BatchScheduler`]) on
//! simulated time, each step priced by a step-cost model (a worker's profile). How the
//! policies compare on fleets bigger than one machine (`denoised bench simulate`).
//!
//! A request goes to the worker the policy picks among those with room (running plus
//! waiting below `max_batch`); when none has room it waits at the router, in arrival
//! order, until a step ends somewhere. A worker whose device lacks a request's template
//! pays its load (from the host tier if some worker loaded it before, else from disk)
//! in the step that admits the request.

use std::collections::{HashMap, VecDeque};

use denoised_models::flux::cost::StepShape;

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
    pub worker: usize,
}

impl Done {
    pub fn latency(&self) -> f64 {
        self.finish - self.arrival
    }
}

struct Worker {
    sched: BatchScheduler,
    /// The step in flight and when it ends.
    step: Option<(StepPlan, f64)>,
    device_templates: Vec<u64>,
}

/// Runs `reqs` (in arrival order) on `workers` workers with `batch` limits, routed by
/// `policy`, every step priced by `cost`. One outcome per request, in input order.
pub fn simulate_cluster(
    reqs: &[SimRequest],
    workers: usize,
    batch: BatchConfig,
    policy: Policy,
    cost: &dyn StepCost,
) -> Result<Vec<Done>, String> {
    if workers == 0 {
        return Err("a cluster of no workers".into());
    }
    let mut ws: Vec<Worker> = (0..workers)
        .map(|_| {
            Ok(Worker {
                sched: BatchScheduler::new(batch).map_err(|e| e.to_string())?,
                step: None,
                device_templates: vec![],
            })
        })
        .collect::<Result<_, String>>()?;
    let mut dispatcher = Dispatcher::new(policy);
    let mut host_templates: Vec<u64> = vec![];
    let mut out: Vec<Option<Done>> = vec![None; reqs.len()];
    let mut admit: HashMap<u64, (f64, usize)> = HashMap::new();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let (mut now, mut next) = (0.0f64, 0usize);
    loop {
        // The next event: the earliest step end, else the next arrival (a step ending
        // at an arrival's time goes first, freeing room for it).
        let end = ws
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.step.as_ref().map(|(_, t)| (i, *t)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let arrival = reqs.get(next).map(|r| r.arrival);
        match (end, arrival) {
            (Some((wi, t)), a) if a.is_none_or(|a| t <= a) => {
                now = t;
                let (plan, _) = ws[wi].step.take().expect("a step in flight");
                for id in ws[wi].sched.complete_step(&plan) {
                    let (admitted, worker) = admit[&id];
                    out[id as usize] = Some(Done {
                        arrival: reqs[id as usize].arrival,
                        admit: admitted,
                        finish: now,
                        worker,
                    });
                }
            }
            (_, Some(a)) => {
                now = now.max(a);
                queue.push_back(next);
                next += 1;
            }
            _ if queue.is_empty() => break,
            _ => return Err("requests wait with every worker idle".into()),
        }
        // Route what waits, in order, while some worker has room.
        while let Some(&ri) = queue.front() {
            let views: Vec<WorkerView> = ws
                .iter()
                .map(|w| view(w, reqs, &host_templates, batch))
                .collect();
            let Some(wi) = dispatcher.choose(&views, &reqs[ri].req, cost) else {
                break;
            };
            queue.pop_front();
            let r = &reqs[ri].req;
            let sr = SchedRequest::new(ri as u64, r.shape.text + r.shape.active, r.steps);
            ws[wi].sched.submit(sr).map_err(|e| e.to_string())?;
        }
        // Idle workers with work start a step.
        for (wi, w) in ws.iter_mut().enumerate() {
            if w.step.is_some() || w.sched.is_idle() {
                continue;
            }
            let plan = w.sched.plan();
            if plan.is_empty() {
                continue;
            }
            let mut load = 0.0;
            for &id in plan.admitted() {
                admit.insert(id, (now, wi));
                if let Some(t) = reqs[id as usize].req.template {
                    if !w.device_templates.contains(&t.version) {
                        load += if host_templates.contains(&t.version) {
                            t.host_load_s
                        } else {
                            t.disk_load_s
                        };
                        w.device_templates.push(t.version);
                        host_templates.push(t.version);
                    }
                }
            }
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
    out.into_iter()
        .enumerate()
        .map(|(i, d)| d.ok_or_else(|| format!("request {i} never finished")))
        .collect()
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
        device_templates: w.device_templates.clone(),
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
