//! The denoise loop on the built-in tiny model: continuous batching is visible (a
//! request arriving mid-way joins before the earliest running request finishes),
//! static batching is not, results equal solo runs, cancellation and bad requests do
//! not stop the loop, and capture + edit through the loop keep the identity invariant.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};
use denoised_models::flux::edit::{run_to_end, DenoiseInputs, DeviceTemplates, Job, Mode};
use denoised_models::flux::embed::image_ids;
use denoised_models::flux::stepper::ModelStepper;
use denoised_models::flux::template::TemplateLayout;
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer, ModelSource};
use denoised_runtime::{CpuBackend, DType, Tensor};

use super::*;
use crate::batching::Batching;

const SIDE: usize = 8; // 8x8 tokens

pub(super) fn model() -> Arc<FluxTransformer<CpuBackend>> {
    Arc::new(
        ModelSource::Builtin
            .load_transformer(CpuBackend::new())
            .unwrap(),
    )
}

pub(super) fn inputs(seed: u64) -> Arc<DenoiseInputs> {
    let c = FluxConfig::tiny();
    let l = SIDE * SIDE;
    let mut rng = SplitMix::new(seed);
    let mut rand = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    Arc::new(DenoiseInputs {
        latents: Tensor::new([l, 64], rand(l * 64)).unwrap(),
        cond: Tensor::new([l, c.in_channels - 64], rand(l * (c.in_channels - 64))).unwrap(),
        img_ids: Tensor::new([l, 3], image_ids(SIDE, SIDE)).unwrap(),
        txt: Tensor::new([8, c.joint_attention_dim], rand(8 * c.joint_attention_dim)).unwrap(),
        txt_ids: Tensor::zeros([8, 3]),
        pooled: rand(c.pooled_projection_dim),
        guidance: 30.0,
        reference: None,
    })
}

/// A template of `layout` marked complete (all zeros: enough where its values do not
/// matter).
fn complete(layout: TemplateLayout) -> TemplateCache {
    let mut t = TemplateCache::new(layout).unwrap();
    t.mark_complete();
    t
}

pub(super) fn schedule(steps: usize) -> Arc<FlowMatchEuler> {
    Arc::new(FlowMatchEuler::new(&Default::default(), steps, SIDE * SIDE).unwrap())
}

/// A full run of `seed`'s inputs alone, to the end.
fn solo(seed: u64, steps: usize) -> Tensor {
    let m = model();
    let job = Job::new(&m, &inputs(seed), schedule(steps), Mode::Full).unwrap();
    run_to_end(&m, job, &DeviceTemplates::new()).unwrap().0
}

pub(super) fn gated(mode: Batching) -> (DenoiseLoop, Sender<()>) {
    gated_with(mode, u64::MAX)
}

/// A loop whose steps wait for the gate, on a stepper that keeps `template_bytes` of
/// templates.
fn gated_with(mode: Batching, template_bytes: u64) -> (DenoiseLoop, Sender<()>) {
    let (gate_tx, gate_rx) = unbounded();
    let cfg = BatchConfig {
        max_batch: 8,
        token_budget: 1 << 20,
        mode,
        template_bytes: u64::MAX,
    };
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::new(model(), template_bytes, 4, false)),
        cfg,
        LoopOptions {
            step_gate: Some(gate_rx),
            ..LoopOptions::default()
        },
    )
    .unwrap();
    (lp, gate_tx)
}

/// The loop's next event but `Submitted` (each test checks what ran; the worker's load
/// reports, which read `Submitted`, are tested with the router).
pub(super) fn next(lp: &DenoiseLoop) -> Event {
    loop {
        match lp
            .events()
            .recv_timeout(Duration::from_secs(60))
            .expect("an event from the denoise loop")
        {
            Event::Submitted { .. } => {}
            ev => return ev,
        }
    }
}

pub(super) fn full(id: u64, seed: u64, steps: usize) -> DenoiseRequest {
    DenoiseRequest {
        id,
        inputs: inputs(seed),
        schedule: schedule(steps),
        work: Mode::Full,
        start_at: 0,
        store_at: Vec::new(),
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    }
}

/// Runs steps one token at a time until `want` requests finished; returns the step
/// batches in order, the finished latents, and the finishing order. The loop sends a
/// step's results before the step's own event, so reading up to that event is enough.
fn drive(
    lp: &DenoiseLoop,
    gate: &Sender<()>,
    want: usize,
) -> (Vec<Vec<u64>>, HashMap<u64, Tensor>, Vec<u64>) {
    let (mut steps, mut done, mut order) = (vec![], HashMap::new(), vec![]);
    while done.len() < want {
        gate.send(()).unwrap();
        loop {
            match next(lp) {
                Event::Step { batch, .. } => {
                    steps.push(batch);
                    break;
                }
                Event::Finished { id, latents, .. } => {
                    order.push(id);
                    done.insert(id, latents);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    (steps, done, order)
}

#[test]
fn a_request_arriving_mid_way_joins_before_the_first_finishes() {
    let (lp, gate) = gated(Batching::Continuous);
    lp.submit(full(1, 1, 6));
    gate.send(()).unwrap();
    assert!(matches!(next(&lp), Event::Step { ref batch, .. } if batch == &[1]));
    lp.submit(full(2, 2, 6));
    let (steps, done, order) = drive(&lp, &gate, 2);
    // Request 2 is in a batch together with request 1, before request 1 finishes.
    let joined = steps
        .iter()
        .position(|b| b.contains(&2))
        .expect("request 2 ran");
    assert!(steps[joined].contains(&1), "request 2 ran alone: {steps:?}");
    // `steps` starts with the first step after the submission.
    assert_eq!(
        joined, 0,
        "request 2 must join at the very next step: {steps:?}"
    );
    assert_eq!(order, vec![1, 2]);
    // Results equal solo runs.
    for (id, seed) in [(1, 1), (2, 2)] {
        let solo = solo(seed, 6);
        let rel = done[&id].max_abs_diff(&solo).unwrap()
            / solo.data().iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert!(rel <= 1e-6, "request {id}: {rel:e}");
    }
}

#[test]
fn static_batching_holds_new_requests_until_the_batch_ends() {
    let (lp, gate) = gated(Batching::Static);
    lp.submit(full(1, 1, 4));
    gate.send(()).unwrap();
    assert!(matches!(next(&lp), Event::Step { .. }));
    lp.submit(full(2, 2, 4));
    let (steps, _, order) = drive(&lp, &gate, 2);
    assert!(steps.iter().all(|b| b.len() == 1), "{steps:?}");
    assert_eq!(order, vec![1, 2]);
}

#[test]
fn cancel_and_bad_requests_do_not_stop_the_loop() {
    let (lp, gate) = gated(Batching::Continuous);
    lp.submit(full(1, 1, 5));
    gate.send(()).unwrap();
    assert!(matches!(next(&lp), Event::Step { .. }));
    lp.cancel(1);
    // An edit whose template does not match its schedule fails on admission.
    let layout = TemplateLayout::for_model(&FluxConfig::tiny(), SIDE * SIDE, 2, DType::F32);
    let bad = DenoiseRequest {
        id: 2,
        inputs: inputs(2),
        schedule: schedule(4),
        work: Mode::Edit {
            mask: Arc::new(TokenMask::full(SIDE, SIDE)),
            cache: Arc::new(complete(layout)),
        },
        start_at: 0,
        store_at: Vec::new(),
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    };
    lp.submit(bad);
    lp.submit(full(3, 3, 2));
    let mut seen: Vec<String> = vec![];
    while !seen.iter().any(|e| e.starts_with("finished 3")) {
        gate.send(()).unwrap();
        loop {
            let ev = next(&lp);
            let last = matches!(ev, Event::Step { .. });
            seen.push(match ev {
                Event::Cancelled { id } => format!("cancelled {id}"),
                Event::Failed { id, error } => format!("failed {id}: {error}"),
                Event::Finished { id, .. } => format!("finished {id}"),
                Event::Step { batch, .. } => format!("step {batch:?}"),
                Event::Stored { id, k, .. } => format!("stored {id} after {k}"),
                Event::Preview { id, k, .. } => format!("preview {id} after {k}"),
                Event::Submitted { .. } => unreachable!("next() skips them"),
                ev @ (Event::LoraApplied { .. } | Event::LoraLoaded { .. }) => {
                    unreachable!("no request names a LoRA: {ev:?}")
                }
            });
            if last {
                break;
            }
        }
    }
    assert!(seen.contains(&"cancelled 1".to_string()), "{seen:?}");
    assert!(
        seen.iter()
            .any(|e| e.starts_with("failed 2:") && e.contains("steps")),
        "{seen:?}"
    );
    assert!(!seen.iter().any(|e| e.contains("step [1"))); // never stepped after the cancel
}

#[test]
fn capture_then_edit_through_the_loop_keeps_the_identity() {
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model(), 4)),
        BatchConfig::default(),
        LoopOptions::default(),
    )
    .unwrap();
    let (inp, s) = (inputs(9), schedule(3));
    let layout = TemplateLayout::for_model(&FluxConfig::tiny(), SIDE * SIDE, 3, DType::F32);
    lp.submit(DenoiseRequest {
        id: 1,
        inputs: inp.clone(),
        schedule: s.clone(),
        work: Mode::Capture(TemplateCache::new(layout).unwrap()),
        start_at: 0,
        store_at: Vec::new(),
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    });
    let (fin, cache) = loop {
        if let Event::Finished { latents, cache, .. } = next(&lp) {
            break (latents, cache.expect("a capture returns its cache"));
        }
    };
    let cache: Arc<TemplateCache> = Arc::new(cache);
    let mask = Arc::new(TokenMask::random_blobs(SIDE, SIDE, 13, 4));
    lp.submit(DenoiseRequest {
        id: 2,
        inputs: inp,
        schedule: s,
        work: Mode::Edit { mask, cache },
        start_at: 0,
        store_at: Vec::new(),
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    });
    let edited = loop {
        if let Event::Finished { latents, .. } = next(&lp) {
            break latents;
        }
    };
    let rel =
        edited.max_abs_diff(&fin).unwrap() / fin.data().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    assert!(rel <= 1e-5, "{rel:e}");
}

#[test]
fn a_request_whose_step_fails_does_not_fail_its_batch_mates() {
    // An edit whose template cannot be put on the device (a stepper with no room for
    // it, that cannot stream) passes admission but fails in the step, taking the
    // batched step down with it.
    let (lp, gate) = gated_with(Batching::Continuous, 1);
    let layout = TemplateLayout::for_model(&FluxConfig::tiny(), SIDE * SIDE, 3, DType::F32);
    let bad = DenoiseRequest {
        id: 2,
        inputs: inputs(2),
        schedule: schedule(3),
        work: Mode::Edit {
            mask: Arc::new(TokenMask::random_blobs(SIDE, SIDE, 9, 1)),
            cache: Arc::new(complete(layout)),
        },
        start_at: 0,
        store_at: Vec::new(),
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    };
    lp.submit(full(1, 1, 3));
    lp.submit(bad);
    let (mut failed, mut done, mut batches) = (vec![], HashMap::new(), vec![]);
    while done.is_empty() {
        gate.send(()).unwrap();
        loop {
            match next(&lp) {
                Event::Step { batch, .. } => {
                    batches.push(batch);
                    break;
                }
                Event::Failed { id, error } => failed.push((id, error)),
                Event::Finished { id, latents, .. } => {
                    done.insert(id, latents);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(batches[0], vec![1, 2], "both ran in one batch: {batches:?}");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 2);
    assert!(failed[0].1.contains("device budget leaves"), "{failed:?}");
    // The good request finished, at the same step it would have, with its solo result.
    assert_eq!(batches.len(), 3, "{batches:?}");
    let solo = solo(1, 3);
    let rel = done[&1].max_abs_diff(&solo).unwrap()
        / solo.data().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    assert!(rel <= 1e-6, "{rel:e}");
}

/// The approximate cache's identity through the loop: a full run stores its latents
/// after every step; the same request resumed from each of those states ends
/// bit-identical to the full run when it runs alone, as the full run did (a batch
/// changes the rows' reduction blocking, so batched runs equal solo ones within the
/// batching tolerance instead, as every request does).
#[test]
fn a_run_resumed_from_any_stored_state_ends_bit_identical() {
    const STEPS: usize = 5;
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model(), 4)),
        BatchConfig::default(),
        LoopOptions::default(),
    )
    .unwrap();
    let (inp, s) = (inputs(4), schedule(STEPS));
    let request = |id: u64, inputs: Arc<DenoiseInputs>, start_at: usize| DenoiseRequest {
        id,
        inputs,
        schedule: s.clone(),
        work: Mode::Full,
        start_at,
        store_at: if id == 1 {
            (1..STEPS).collect()
        } else {
            Vec::new()
        },
        preview: None,
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    };
    let resumed = |state: &Tensor| {
        Arc::new(DenoiseInputs {
            latents: state.clone(),
            ..(*inp).clone()
        })
    };
    // Runs until `n` requests finished: their latents and steps run, by id.
    let finish = |n: usize| {
        let mut out = std::collections::HashMap::new();
        let mut steps_run = std::collections::HashMap::new();
        let mut states = Vec::new();
        // A step's results come before its own event: end on that event.
        let mut stepped = false;
        while out.len() < n || !stepped {
            let ev = next(&lp);
            stepped = matches!(ev, Event::Step { .. });
            match ev {
                Event::Step { batch, .. } => {
                    for id in batch {
                        *steps_run.entry(id).or_insert(0) += 1;
                    }
                }
                Event::Stored { id, k, latents } => {
                    assert_eq!(id, 1, "only the request with store_at stores");
                    states.push((k, latents));
                }
                Event::Finished { id, latents, .. } => {
                    out.insert(id, latents);
                }
                Event::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        (out, steps_run, states)
    };
    lp.submit(request(1, inp.clone(), 0));
    let (out, _, states) = finish(1);
    let full = out[&1].clone();
    let ks: Vec<usize> = states.iter().map(|s| s.0).collect();
    assert_eq!(
        ks,
        (1..STEPS).collect::<Vec<_>>(),
        "one state after each stored step"
    );
    for (k, state) in &states {
        let id = 10 + *k as u64;
        lp.submit(request(id, resumed(state), *k));
        let (out, steps_run, _) = finish(1);
        assert_eq!(steps_run[&id], STEPS - k, "runs only the steps after {k}");
        assert!(
            out[&id].data() == full.data(),
            "resumed after step {k}: not bit-identical"
        );
    }
    // All at once, beside another request: one continuous batch.
    lp.submit(request(100, inputs(5), 0));
    for (k, state) in &states {
        lp.submit(request(20 + *k as u64, resumed(state), *k));
    }
    let (out, _, _) = finish(states.len() + 1);
    let peak = full.data().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for (k, _) in &states {
        let rel = out[&(20 + *k as u64)].max_abs_diff(&full).unwrap() / peak;
        assert!(rel <= 1e-6, "resumed after {k} in a batch: {rel:e}");
    }
}

/// A full run of `inputs` with a preview every `every` steps (0: none).
fn previewed(
    id: u64,
    inputs: &Arc<DenoiseInputs>,
    s: &Arc<FlowMatchEuler>,
    every: usize,
) -> DenoiseRequest {
    DenoiseRequest {
        id,
        inputs: inputs.clone(),
        schedule: s.clone(),
        work: Mode::Full,
        start_at: 0,
        store_at: Vec::new(),
        preview: (every > 0).then_some(crate::denoise::PreviewSpec {
            every,
            rows: SIDE,
            cols: SIDE,
        }),
        loras: vec![],
        true_cfg: None,
        control: None,
        partner: None,
    }
}

/// A request that asks for previews every 2 of 5 steps gets one after steps 2 and 4
/// (not after its last: its result follows), each after its step's event and over
/// the full grid, and ends exactly as the same request without previews.
#[test]
fn previews_come_at_their_interval_and_change_nothing() {
    const STEPS: usize = 5;
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model(), 4)),
        BatchConfig::default(),
        LoopOptions::default(),
    )
    .unwrap();
    let (inp, s) = (inputs(4), schedule(STEPS));
    let run = |id: u64, every: usize| {
        lp.submit(previewed(id, &inp, &s, every));
        let (mut seen, mut out) = (vec![], None);
        while out.is_none() {
            match next(&lp) {
                Event::Step { .. } => seen.push("step".to_string()),
                Event::Preview { k, latents, .. } => {
                    assert_eq!(latents.shape(), inp.latents.shape(), "the full grid");
                    seen.push(format!("preview {k}"));
                }
                Event::Finished { latents, .. } => out = Some(latents),
                Event::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        (seen, out.unwrap())
    };
    let (seen, with) = run(1, 2);
    // (The last step's own event comes after its result.)
    assert_eq!(
        seen,
        ["step", "step", "preview 2", "step", "step", "preview 4"],
        "{seen:?}"
    );
    let (seen, without) = run(2, 0);
    assert!(seen.iter().all(|e| e == "step"), "{seen:?}");
    assert_eq!(with.data(), without.data());
}

/// The loop's cost of previews: the same request with previews (after every step, and
/// every 4) and with none, on the built-in model (the cheapest steps, so the largest
/// share), by the time of a whole run (submit to its last step's event: the previews'
/// downloads and hand-off included). Rounds run the three one after the other, and each
/// round's ratios to its own run without previews are taken, so the machine's drift
/// cancels; the median ratio is printed.
/// `cargo test --release -p denoised-actors --lib preview_cost -- --ignored --nocapture`
#[test]
#[ignore = "a timing"]
fn preview_cost_in_the_loop() {
    const STEPS: usize = 8;
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model(), 4)),
        BatchConfig::default(),
        LoopOptions::default(),
    )
    .unwrap();
    let (inp, s) = (inputs(4), schedule(STEPS));
    let run = |id: u64, every: usize| {
        let t0 = std::time::Instant::now();
        lp.submit(previewed(id, &inp, &s, every));
        let mut steps = 0;
        while steps < STEPS {
            if let Event::Step { .. } = next(&lp) {
                steps += 1;
            }
        }
        t0.elapsed().as_secs_f64() / STEPS as f64
    };
    let (mut off, mut ratios) = (vec![], [vec![], vec![]]);
    for round in 0..300u64 {
        let base = run(3 * round, 0);
        off.push(base);
        for (i, every) in [1, 4].into_iter().enumerate() {
            ratios[i].push(run(3 * round + 1 + i as u64, every) / base);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    println!(
        "time per step without previews: median {:.3} ms over {} runs",
        1e3 * median(&mut off),
        off.len()
    );
    for (i, every) in [1, 4].into_iter().enumerate() {
        println!(
            "previews every {every} step(s): median ratio to the same round's run without {:+.2}%",
            100.0 * (median(&mut ratios[i]) - 1.0)
        );
    }
}
