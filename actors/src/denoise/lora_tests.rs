//! Bounded asynchronous loading of LoRAs in the denoise loop (docs/design.md §Adapters), on
//! the built-in tiny model with the fixture LoRA `detail` (attention only, so it fits
//! the Fill model): each run is compared bit for bit with a reference that switches
//! the LoRA on at exactly the step the loop reported, so the steps before it ran on the
//! base weights and every step from it on with the LoRA.

use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};
use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::edit::{step_batch_with, DeviceTemplates, Job};
use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::stepper::ModelStepper;
use denoised_models::FluxConfig;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::Tensor;

use super::tests::{full, gated, inputs, model, next, schedule};
use super::*;
use crate::batching::Batching;

const STEPS: usize = 6;
const SCALE: f32 = 1.5;

fn detail() -> std::path::PathBuf {
    fixtures_dir().join("loras/detail")
}

/// Seed 3's full run with the LoRA from step `from` on (`STEPS`: never), alone.
fn reference(from: usize) -> Tensor {
    let m = model();
    let id = m
        .add_lora(&LoraFile::open(detail(), &m.config).unwrap())
        .unwrap();
    let mut job = Job::new(&m, &inputs(3), schedule(STEPS), Mode::Full).unwrap();
    let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
    while !job.done() {
        if job.step() == from {
            job.set_loras(vec![LoraUse { id, scale: SCALE }]);
        }
        step_batch_with(&m, &mut [&mut job], &DeviceTemplates::new(), &plan).unwrap();
    }
    job.finish(&m).unwrap().0
}

/// A loop serving LoRAs, its loader reading at `throttle` bytes/s, its steps gated when
/// `gate` is set.
fn lora_loop(throttle: Option<f64>, gate: bool) -> (DenoiseLoop, Option<Sender<()>>) {
    let (tx, rx) = unbounded();
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model(), 4)),
        BatchConfig::default(),
        LoopOptions {
            step_gate: gate.then_some(rx),
            adapters: Some(AdapterOptions {
                config: FluxConfig::tiny(),
                slots: 2,
                throttle_bytes_per_s: throttle,
            }),
            ..LoopOptions::default()
        },
    )
    .unwrap();
    (lp, gate.then_some(tx))
}

fn with_lora(id: u64, patch_by: usize) -> DenoiseRequest {
    DenoiseRequest {
        loras: vec![LoraRequest {
            name: "detail".into(),
            path: detail(),
            scale: SCALE,
            patch_by,
        }],
        ..full(id, 3, STEPS)
    }
}

/// Events until request `id` finished: (its latents, the step its LoRA applied at,
/// whether the load was reported before that, the ids finished in order).
fn until_finished(lp: &DenoiseLoop, id: u64) -> (Tensor, Option<usize>, bool, Vec<u64>) {
    let (mut applied, mut loaded, mut loaded_first, mut order) = (None, false, false, vec![]);
    loop {
        match next(lp) {
            Event::LoraLoaded { error, .. } => {
                assert!(error.is_none(), "{error:?}");
                loaded = true;
            }
            Event::LoraApplied { id: i, step } => {
                assert_eq!(i, id);
                applied = Some(step);
                loaded_first = loaded;
            }
            Event::Finished { id: i, latents, .. } => {
                order.push(i);
                if i == id {
                    return (latents, applied, loaded_first, order);
                }
            }
            Event::Failed { error, .. } => panic!("{error}"),
            _ => {}
        }
    }
}

#[test]
fn patch_step_zero_is_synchronous_loading() {
    let (lp, _) = lora_loop(None, false);
    lp.submit(with_lora(1, 0));
    let (latents, applied, loaded_first, _) = until_finished(&lp, 1);
    assert_eq!(applied, Some(0), "K = 0: the first step waits for the LoRA");
    assert!(loaded_first);
    assert!(
        latents.data() == reference(0).data(),
        "not bit-identical to synchronous loading"
    );
    // The LoRA changes the run (the comparison is not vacuous).
    assert!(latents.max_abs_diff(&reference(STEPS)).unwrap() > 1e-3);
}

#[test]
fn a_load_slower_than_k_steps_holds_the_request_at_k_and_not_the_batch() {
    // About 2 s to read the ~100 kB LoRA: the request reaches K = 2 long before.
    let (lp, _) = lora_loop(Some(50e3), false);
    lp.submit(with_lora(1, 2));
    lp.submit(full(2, 4, STEPS));
    let (latents, applied, loaded_first, order) = until_finished(&lp, 1);
    assert_eq!(applied, Some(2), "applied at K, having waited there");
    assert!(loaded_first);
    assert_eq!(
        order,
        vec![2, 1],
        "the request without LoRA went on meanwhile"
    );
    // Its first steps ran in a batch of two, so equal to the solo reference within the
    // batching tolerance (1e-6 relative) rather than bit for bit; switching one step
    // earlier or later is far beyond that.
    let rel = |p: usize| {
        let r = reference(p);
        latents.max_abs_diff(&r).unwrap() / r.data().iter().fold(0f32, |a, v| a.max(v.abs()))
    };
    let (at, before, after) = (rel(2), rel(1), rel(3));
    println!("LoRA from step 2: {at:.1e}; from 1: {before:.1e}; from 3: {after:.1e}");
    assert!(at <= 1e-6, "steps 0-1 base, 2-5 with the LoRA: {at:e}");
    assert!(before > 1e-4 && after > 1e-4);
}

#[test]
fn a_load_that_lands_before_k_applies_at_the_next_step_boundary() {
    let (lp, gate) = lora_loop(None, true);
    let gate = gate.unwrap();
    let k = STEPS - 1;
    lp.submit(with_lora(1, k));
    gate.send(()).unwrap(); // step 0, most likely before the load lands
    std::thread::sleep(Duration::from_millis(300));
    for _ in 1..STEPS + 1 {
        let _ = gate.send(());
    }
    let (latents, applied, loaded_first, _) = until_finished(&lp, 1);
    let p = applied.expect("applied");
    println!("the LoRA applied at step {p} (K = {k})");
    assert!(loaded_first, "applied only after its load");
    assert!(p <= k, "applied at {p}, after K = {k}");
    assert!(
        latents.data() == reference(p).data(),
        "base before step {p}, LoRA from it"
    );
}

#[test]
fn a_lora_that_cannot_load_fails_its_requests_only() {
    let (lp, _) = lora_loop(None, false);
    let mut bad = with_lora(1, 1);
    bad.loras[0].path = fixtures_dir().join("loras/missing");
    bad.loras[0].name = "missing".into();
    lp.submit(bad);
    lp.submit(full(2, 4, STEPS));
    let mut failed = None;
    let mut finished = vec![];
    while finished.is_empty() || failed.is_none() {
        match next(&lp) {
            Event::Failed { id, error } => failed = Some((id, error)),
            Event::Finished { id, .. } => finished.push(id),
            _ => {}
        }
    }
    let (id, error) = failed.unwrap();
    assert_eq!(id, 1);
    assert!(
        error.contains("LoRA `missing` could not be loaded"),
        "{error}"
    );
    assert_eq!(finished, vec![2]);
    // A loop without adapters refuses requests that name one.
    let (plain, _) = gated(Batching::Continuous);
    plain.submit(with_lora(3, 0));
    match next(&plain) {
        Event::Failed { error, .. } => assert!(error.contains("serves no LoRAs"), "{error}"),
        ev => panic!("{ev:?}"),
    }
}
