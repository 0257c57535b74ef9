use std::time::Instant;

use proptest::prelude::*;

use super::*;

/// A step's seconds: a fixed part, plus per computed row, plus per (row, key) pair.
struct Linear {
    base: f64,
    row: f64,
    pair: f64,
}

impl StepCost for Linear {
    fn step_s(&self, batch: &[StepShape]) -> f64 {
        self.base
            + batch
                .iter()
                .map(|s| {
                    let rows = (s.text + s.active) as f64;
                    rows * self.row + rows * (s.text + s.image) as f64 * self.pair
                })
                .sum::<f64>()
    }
}

const COST: Linear = Linear {
    base: 0.01,
    row: 1e-5,
    pair: 1e-9,
};

fn shape(active: usize) -> StepShape {
    StepShape {
        text: 128,
        active,
        image: 4096,
    }
}

fn running(active: usize, steps_left: u32) -> Running {
    Running {
        shape: shape(active),
        steps_left,
    }
}

fn worker(running: Vec<Running>) -> WorkerView {
    WorkerView {
        room: true,
        running,
        ..Default::default()
    }
}

fn incoming(active: usize) -> Incoming {
    Incoming {
        shape: shape(active),
        steps: 28,
        template: None,
    }
}

/// The request's finish time by brute force: every step's batch built from scratch.
/// [`estimate`] step by step: each of the request's steps priced with and without it,
/// and each running request's latency followed on its own.
fn brute_estimate(w: &WorkerView, req: &Incoming, cost: &dyn StepCost) -> Estimate {
    let load = match req.template {
        None => 0.0,
        Some(n) if w.device_templates.contains(&n.version) => 0.0,
        Some(n) if w.host_templates.contains(&n.version) => n.host_load_s,
        Some(n) => n.disk_load_s,
    };
    let mut t = load;
    // Every running request waits for the load, then pays each shared step's extra.
    let mut delays = vec![load; w.running.len()];
    for k in 0..req.steps {
        let others: Vec<usize> = (0..w.running.len())
            .filter(|&i| w.running[i].steps_left > k)
            .collect();
        let without: Vec<StepShape> = others.iter().map(|&i| w.running[i].shape).collect();
        let mut with = vec![req.shape];
        with.extend(&without);
        t += cost.step_s(&with);
        for &i in &others {
            delays[i] += cost.step_s(&with) - cost.step_s(&without);
        }
    }
    Estimate {
        finish_s: t,
        delay_s: delays.iter().sum(),
    }
}

#[test]
fn a_heavy_mask_goes_to_the_idle_worker() {
    // Worker 0 runs two heavy requests for most of the steps to come; worker 1 three
    // light ones about to finish; worker 2 nothing.
    let workers = vec![
        worker(vec![running(3000, 27), running(3500, 27)]),
        worker(vec![running(200, 3), running(150, 2), running(100, 2)]),
        worker(vec![]),
    ];
    let heavy = incoming(3800);
    for p in Policy::ALL {
        let got = Dispatcher::new(p).choose(&workers, &heavy, &COST);
        println!("{}: worker {got:?}", p.name());
    }
    assert_eq!(
        Dispatcher::new(Policy::MaskAware).choose(&workers, &heavy, &COST),
        Some(2)
    );
    // Without the idle worker, mask_aware takes the one whose batch empties soon;
    // least_requests the one with fewer (but long, heavy) requests.
    let two = &workers[..2];
    assert_eq!(
        Dispatcher::new(Policy::MaskAware).choose(two, &heavy, &COST),
        Some(1)
    );
    assert_eq!(
        Dispatcher::new(Policy::LeastRequests).choose(two, &heavy, &COST),
        Some(0)
    );
}

#[test]
fn the_delay_to_running_requests_counts() {
    // Worker 0 runs eight light edits with their whole run ahead; worker 1 one heavy
    // edit. A heavy newcomer would finish sooner on worker 0 (fewer rows per step), but
    // would slow eight requests there for 28 steps, against one on worker 1.
    let ws = vec![
        worker((0..8).map(|_| running(50, 28)).collect()),
        worker(vec![running(3500, 28)]),
    ];
    let heavy = incoming(3800);
    let (e0, e1) = (
        estimate(&ws[0], &heavy, &COST),
        estimate(&ws[1], &heavy, &COST),
    );
    println!("light batch: {e0:?}; heavy one: {e1:?}");
    assert!(e0.finish_s < e1.finish_s);
    assert!(e0.cost_s() > e1.cost_s());
    assert_eq!(
        Dispatcher::new(Policy::MaskAware).choose(&ws, &heavy, &COST),
        Some(1)
    );
    // An idle worker delays nobody.
    assert_eq!(estimate(&worker(vec![]), &heavy, &COST).delay_s, 0.0);
}

#[test]
fn template_locality_is_priced() {
    let need = TemplateNeed {
        version: 7,
        host_load_s: 0.5,
        disk_load_s: 3.0,
    };
    let req = Incoming {
        template: Some(need),
        ..incoming(400)
    };
    let mut on_host = worker(vec![running(300, 10)]);
    on_host.host_templates = vec![7];
    let mut on_device = worker(vec![running(300, 10), running(300, 10)]);
    on_device.device_templates = vec![7];
    let cold = worker(vec![]);
    let ws = vec![cold.clone(), on_host.clone(), on_device.clone()];
    // The cold worker is idle but pays a disk load (3 s, far more than sharing 28 steps).
    assert_eq!(
        Dispatcher::new(Policy::MaskAware).choose(&ws, &req, &COST),
        Some(2)
    );
    // A cheap disk makes the idle worker best again.
    let cheap = Incoming {
        template: Some(TemplateNeed {
            disk_load_s: 0.0,
            host_load_s: 0.0,
            ..need
        }),
        ..req
    };
    assert_eq!(
        Dispatcher::new(Policy::MaskAware).choose(&ws, &cheap, &COST),
        Some(0)
    );
    let (a, b) = (
        estimate(&on_host, &req, &COST),
        brute_estimate(&on_host, &req, &COST),
    );
    assert!(
        (a.finish_s - b.finish_s).abs() <= 1e-12 * b.finish_s,
        "{a:?} vs {b:?}"
    );
    assert!(
        (a.delay_s - b.delay_s).abs() <= 1e-9 * b.delay_s,
        "{a:?} vs {b:?}"
    );
}

#[test]
fn a_profile_prices_a_step_by_its_flops() {
    use denoised_models::flux::cost::forward_flops;
    use denoised_models::flux::FluxConfig;
    use denoised_models::profile::{Fit, Profile};
    let c = FluxConfig::small();
    let mut p = Profile::defaults("cpu");
    p.compute = Fit::assumed(0.002, 1.0 / 3.7e11);
    let cost = ProfileCost {
        config: &c,
        profile: &p,
    };
    let batch = [shape(800), shape(300)];
    let want = 0.002 + (forward_flops(&c, batch[0]) + forward_flops(&c, batch[1])) / 3.7e11;
    assert!(
        (cost.step_s(&batch) - want).abs() < 1e-12,
        "{} vs {want}",
        cost.step_s(&batch)
    );
}

#[test]
fn ties_go_to_the_lowest_index_and_round_robin_turns() {
    let ws = vec![worker(vec![]), worker(vec![]), worker(vec![])];
    let req = incoming(500);
    for p in [
        Policy::LeastRequests,
        Policy::LeastTokens,
        Policy::MaskAware,
    ] {
        let mut r = Dispatcher::new(p);
        for _ in 0..3 {
            assert_eq!(r.choose(&ws, &req, &COST), Some(0), "{}", p.name());
        }
    }
    let mut ws = ws;
    ws[1].room = false;
    let mut rr = Dispatcher::new(Policy::RoundRobin);
    let picks: Vec<_> = (0..5).map(|_| rr.choose(&ws, &req, &COST)).collect();
    assert_eq!(picks, [Some(0), Some(2), Some(0), Some(2), Some(0)]);
    for w in ws.iter_mut() {
        w.room = false;
    }
    for p in Policy::ALL {
        assert_eq!(Dispatcher::new(p).choose(&ws, &req, &COST), None);
    }
    assert_eq!("mask_aware".parse::<Policy>(), Ok(Policy::MaskAware));
    assert!("fastest"
        .parse::<Policy>()
        .unwrap_err()
        .contains("least_tokens"));
}

/// How long a decision takes: 8 workers with 8 running requests each, 28 steps.
/// Printed, not asserted (tests never assert wall-clock time); the target is
/// under 50 µs.
#[test]
fn decision_time_for_8_workers_of_8_requests() {
    let ws: Vec<WorkerView> = (0..8)
        .map(|w| {
            worker(
                (0..8)
                    .map(|r| running(100 + 37 * (w * 8 + r) % 900, 1 + ((w + r * 5) % 28) as u32))
                    .collect(),
            )
        })
        .collect();
    let req = Incoming {
        template: Some(TemplateNeed {
            version: 3,
            host_load_s: 0.1,
            disk_load_s: 1.0,
        }),
        ..incoming(700)
    };
    let mut r = Dispatcher::new(Policy::MaskAware);
    let n = 2000;
    let t0 = Instant::now();
    let mut sum = 0;
    for _ in 0..n {
        sum += r.choose(&ws, &req, &COST).unwrap();
    }
    let us = t0.elapsed().as_secs_f64() / n as f64 * 1e6;
    println!("mask_aware decision, 8 workers x 8 running requests: {us:.2} us (sum {sum})");
}

fn arb_worker() -> impl Strategy<Value = WorkerView> {
    (
        any::<bool>(),
        prop::collection::vec((0usize..4096, 1u32..30), 0..9),
        prop::collection::vec(0u64..4, 0..3),
        prop::collection::vec(0u64..4, 0..3),
    )
        .prop_map(|(room, rs, dev, host)| WorkerView {
            room,
            running: rs.into_iter().map(|(a, s)| running(a, s)).collect(),
            device_templates: dev,
            host_templates: host,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn policies_equal_brute_force(
        ws in prop::collection::vec(arb_worker(), 1..9),
        active in 0usize..4096,
        steps in 1u32..40,
        tpl in prop::option::of((0u64..4, 0.0f64..2.0, 0.0f64..5.0)),
    ) {
        let req = Incoming {
            shape: shape(active),
            steps,
            template: tpl.map(|(version, host_load_s, disk_load_s)| TemplateNeed {
                version,
                host_load_s,
                disk_load_s,
            }),
        };
        // The first worker with room minimising each policy's key, by brute force.
        let best = |key: &dyn Fn(&WorkerView) -> f64| {
            let mut b: Option<(usize, f64)> = None;
            for (i, w) in ws.iter().enumerate().filter(|(_, w)| w.room) {
                let k = key(w);
                if b.is_none_or(|(_, bk)| k < bk) {
                    b = Some((i, k));
                }
            }
            b.map(|(i, _)| i)
        };
        for w in &ws {
            let (a, b) = (estimate(w, &req, &COST), brute_estimate(w, &req, &COST));
            prop_assert!((a.finish_s - b.finish_s).abs() <= 1e-9 * b.finish_s.max(1.0), "{a:?} vs {b:?}");
            prop_assert!((a.delay_s - b.delay_s).abs() <= 1e-9 * b.delay_s.max(1.0), "{a:?} vs {b:?}");
        }
        // mask_aware picks a worker with the least added latency (up to rounding: the
        // two sums add the same step costs in another order).
        let got = Dispatcher::new(Policy::MaskAware).choose(&ws, &req, &COST);
        let key = |w: &WorkerView| brute_estimate(w, &req, &COST).cost_s();
        let want = best(&key);
        prop_assert_eq!(got.is_some(), want.is_some());
        if let (Some(g), Some(b)) = (got, want) {
            let (fg, fb) = (key(&ws[g]), key(&ws[b]));
            prop_assert!(fg <= fb * (1.0 + 1e-9), "worker {g} ({fg}) vs {b} ({fb})");
        }
        prop_assert_eq!(
            Dispatcher::new(Policy::LeastRequests).choose(&ws, &req, &COST),
            best(&|w| w.running.len() as f64)
        );
        prop_assert_eq!(
            Dispatcher::new(Policy::LeastTokens).choose(&ws, &req, &COST),
            best(&|w| w.running.iter().map(|r| (r.shape.text + r.shape.active) as f64).sum())
        );
        prop_assert_eq!(
            Dispatcher::new(Policy::RoundRobin).choose(&ws, &req, &COST),
            ws.iter().position(|w| w.room)
        );
    }
}

fn arb_pod() -> impl Strategy<Value = pods::PodView> {
    (
        any::<bool>(),
        prop::collection::vec(arb_worker(), 1..5),
        prop::collection::vec((0usize..4096, 1u32..30), 0..4),
        prop::collection::vec(0u64..4, 0..3),
        prop::collection::vec((0u64..4, 0.0f64..3.0), 0..2),
    )
        .prop_map(|(up, workers, queued, disk, fetching)| pods::PodView {
            up,
            workers,
            queued: queued
                .into_iter()
                .map(|(a, steps_left)| Running {
                    shape: shape(a),
                    steps_left,
                })
                .collect(),
            disk_templates: disk,
            fetching,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Each pod policy against its definition, written out: the first pod that is up
    /// minimising the best worker's finish (the template priced by its best tier in
    /// that pod: device, host, disk, a peer's copy, or a recapture) plus the queued
    /// work shared over the pod's workers.
    #[test]
    fn pod_policies_equal_brute_force(
        ps in prop::collection::vec(arb_pod(), 1..6),
        active in 0usize..4096,
        steps in 1u32..40,
        tpl in prop::option::of((0u64..4, 0.0f64..2.0, 0.0f64..5.0)),
        (fetch_s, recapture_s) in (0.0f64..6.0, 0.0f64..8.0),
    ) {
        use pods::{Held, MissPrices, PodPolicy, PodRouter};
        let req = Incoming {
            shape: shape(active),
            steps,
            template: tpl.map(|(version, host_load_s, disk_load_s)| TemplateNeed {
                version,
                host_load_s,
                disk_load_s,
            }),
        };
        let miss = MissPrices { fetch_s, recapture_s };
        let held = |p: &pods::PodView, v: u64| {
            if p.workers.iter().any(|w| w.device_templates.contains(&v)) {
                Held::Device
            } else if p.workers.iter().any(|w| w.host_templates.contains(&v)) {
                Held::Host
            } else if p.disk_templates.contains(&v) {
                Held::Disk
            } else {
                Held::Absent
            }
        };
        let key = |i: usize, with_template: bool| {
            let p = &ps[i];
            let (r, wait) = match (with_template, req.template) {
                (true, Some(t)) => {
                    let peer = ps.iter().enumerate().any(|(j, q)| {
                        j != i && q.up && held(q, t.version) != Held::Absent
                    });
                    let in_memory = matches!(held(p, t.version), Held::Device | Held::Host);
                    let arriving = p.fetching.iter().find(|f| f.0 == t.version);
                    // (in-step load where no worker's memory has it, wait at the pod)
                    let (load, wait) = if in_memory {
                        (t.disk_load_s, 0.0)
                    } else if let Some(&(_, left)) = arriving {
                        (t.host_load_s, left)
                    } else {
                        // (price, in-step load, wait), ties to the first: disk, peer, recapture
                        let mut options = vec![];
                        if p.disk_templates.contains(&t.version) {
                            options.push((t.disk_load_s, t.disk_load_s, 0.0));
                        }
                        if peer {
                            options.push((fetch_s, t.host_load_s, fetch_s));
                        }
                        options.push((recapture_s, recapture_s, 0.0));
                        let best = options.iter().map(|o| o.0).fold(f64::INFINITY, f64::min);
                        let o = options.iter().find(|o| o.0 == best).unwrap();
                        (o.1, o.2)
                    };
                    (
                        Incoming {
                            template: Some(TemplateNeed { disk_load_s: load, ..t }),
                            ..req
                        },
                        wait,
                    )
                }
                _ => (Incoming { template: None, ..req }, 0.0),
            };
            let best = p
                .workers
                .iter()
                .map(|w| brute_estimate(w, &r, &COST).cost_s())
                .fold(f64::INFINITY, f64::min);
            let queued: f64 = p.queued.iter().map(|q| q.steps_left as f64 * COST.step_s(&[q.shape])).sum();
            wait + best + queued / p.workers.len() as f64
        };
        for (policy, with_template) in [(PodPolicy::LeastLoaded, false), (PodPolicy::TemplateAware, true)] {
            let got = PodRouter::new(policy).choose(&ps, &req, miss, &COST);
            let up: Vec<usize> = (0..ps.len()).filter(|&i| ps[i].up).collect();
            prop_assert_eq!(got.is_some(), !up.is_empty());
            if let Some(g) = got {
                prop_assert!(ps[g].up);
                let kg = key(g, with_template);
                for &i in &up {
                    let ki = key(i, with_template);
                    prop_assert!(kg <= ki * (1.0 + 1e-9) + 1e-12, "{}: pod {g} ({kg}) vs {i} ({ki})", policy.name());
                }
            }
        }
        prop_assert_eq!(
            PodRouter::new(PodPolicy::RoundRobin).choose(&ps, &req, miss, &COST),
            ps.iter().position(|p| p.up)
        );
    }
}

/// A pod holding the template on a worker's device wins over an idle pod that must
/// fetch it, until its queue costs more than the fetch; least_loaded ignores templates.
#[test]
fn template_aware_prefers_the_pod_holding_the_template() {
    use pods::{MissPrices, PodPolicy, PodRouter, PodView};
    let busy_with_template = |queued: usize| PodView {
        up: true,
        workers: vec![WorkerView {
            device_templates: vec![7],
            ..WorkerView::idle()
        }],
        queued: vec![
            Running {
                shape: shape(400),
                steps_left: 28,
            };
            queued
        ],
        disk_templates: vec![],
        fetching: vec![],
    };
    let idle = PodView {
        up: true,
        workers: vec![WorkerView::idle()],
        ..PodView::default()
    };
    let req = Incoming {
        shape: shape(400),
        steps: 28,
        template: Some(TemplateNeed {
            version: 7,
            host_load_s: 0.5,
            disk_load_s: 2.0,
        }),
    };
    let miss = MissPrices {
        fetch_s: 1.0,
        recapture_s: 5.0,
    };
    let one = COST.step_s(&[shape(400)]) * 28.0;
    let pick = |p: PodPolicy, q: usize| {
        PodRouter::new(p).choose(&[idle.clone(), busy_with_template(q)], &req, miss, &COST)
    };
    // One queued request (about `one` seconds) costs less than the 1 s fetch.
    assert!(one < 1.0, "{one}");
    assert_eq!(pick(PodPolicy::TemplateAware, 1), Some(1));
    assert_eq!(pick(PodPolicy::LeastLoaded, 1), Some(0));
    // Enough queued work outweighs the fetch.
    let q = (1.0 / one).ceil() as usize + 1;
    assert_eq!(pick(PodPolicy::TemplateAware, q), Some(0));
    // A pod that is down is never picked.
    let mut down = busy_with_template(0);
    down.up = false;
    assert_eq!(
        PodRouter::new(PodPolicy::TemplateAware).choose(&[down, idle.clone()], &req, miss, &COST),
        Some(1)
    );
}
