//! ControlNets on mask-aware edits (docs/design.md §Adapters): the ControlNets run over
//! every token, the inactive ones at the template's latents (`Job::control_latents`),
//! and an edit's residuals carry only its active rows.
//!
//! diffusers has no Fill + ControlNet pipeline to compare with, so the checks are
//! invariants of the tiny reference Fill model (the e2e case's inputs) with the tiny
//! ControlNets of gen_controlnet_fixtures.py (same width and depth), on random
//! control latents:
//! - the identity invariant with ControlNets: an edit with a capture's inputs and the
//!   capture's ControlNets gives the capture's final latent (1e-5 relative, the bound
//!   of mask_aware.rs), for empty, one-token, e2e, irregular and full masks, one and two
//!   ControlNets, and through the stepper; it would fail if the residuals were
//!   misplaced: the ControlNets change the capture by far more than the bound;
//! - on a template captured without ControlNets (how the daemon's templates are): an
//!   edit's inactive tokens keep the template's latents exactly; a full-mask edit
//!   equals a full run with the ControlNets;
//! - in planned full blocks an edit's inactive rows are computed too and take no
//!   residual (they stay the template's): a step of an edit over full blocks only
//!   equals that step of a full run whose residuals are zero on the inactive rows.

use std::sync::Arc;

use denoised_models::fixtures::e2e_token_mask;
use denoised_models::flux::control_feed::{
    ControlFeed, ControlInputs, ControlUse, FeedControl, LocalControl,
};
use denoised_models::flux::controlnet::ControlNet;
use denoised_models::flux::edit::{step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode};
use denoised_models::flux::stepper::{ModelStepper, Stepper};
use denoised_models::flux::template::{CacheMode, TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::planner::{prefix, Choice};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{fixtures_dir, tiny_model_dir, RefCase};
use denoised_runtime::{CpuBackend, DType, Tensor};

type Model = Arc<FluxTransformer<CpuBackend>>;

const N: usize = 256;

fn model() -> Model {
    Arc::new(
        FluxTransformer::load(CpuBackend::new(), tiny_model_dir().join("transformer")).unwrap(),
    )
}

fn schedule() -> Arc<FlowMatchEuler> {
    Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 4, N).unwrap())
}

fn inputs() -> DenoiseInputs {
    denoised_models::fixtures::e2e_denoise_inputs(&RefCase::open("e2e").unwrap())
}

/// Seeded control latents `[N, 64]` in about [-1, 1] (a control image's packed
/// latents have that scale).
fn control(seed: u64) -> Tensor {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v = (0..N * 64)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::new([N, 64], v).unwrap()
}

/// One or two of the tiny ControlNets (canny at 0.9, depth at 0.6).
fn uses(count: usize) -> Vec<ControlUse> {
    [("canny-tiny", 0.9f32, 1u64), ("depth-tiny", 0.6, 2)]
        .iter()
        .take(count)
        .map(|&(name, scale, seed)| ControlUse {
            net: Arc::new(
                ControlNet::load(
                    CpuBackend::new(),
                    fixtures_dir().join("controlnets").join(name),
                )
                .unwrap(),
            ),
            control: control(seed),
            scale,
        })
        .collect()
}

/// The feed of `count` ControlNets, keeping `active`'s residual rows (an edit).
fn feed(count: usize, active: Option<&TokenMask>) -> Arc<dyn ControlFeed> {
    let mut ci = ControlInputs::new(&inputs(), &schedule());
    if let Some(m) = active {
        ci = ci.keeping(m.active().to_vec());
    }
    Arc::new(LocalControl::new(uses(count), ci).unwrap().unwrap())
}

/// Runs `job` to the end with `plan`, its residuals from `feed` (as the stepper's
/// `begin_controls` hands them over), and returns its final latent.
fn run(
    m: &Model,
    mut job: Job<Tensor>,
    feed: Option<&Arc<dyn ControlFeed>>,
    slabs: &DeviceTemplates<Tensor>,
    plan: &[Choice],
) -> (Tensor, Option<TemplateCache>) {
    while !job.done() {
        if let Some(f) = feed {
            f.begin(job.step(), &job.control_latents(&**m).unwrap())
                .unwrap();
            job.set_control(Some(Arc::new(
                FeedControl::new(f.clone(), m.clone()).unwrap(),
            )));
        }
        step_batch_with(&**m, &mut [&mut job], slabs, plan).unwrap();
    }
    job.finish(&**m).unwrap()
}

/// A KV template of the e2e inputs, captured with `feed`'s ControlNets (or none).
fn capture(m: &Model, feed: Option<&Arc<dyn ControlFeed>>) -> (Arc<TemplateCache>, Tensor) {
    let s = schedule();
    let layout =
        TemplateLayout::for_model(&m.config, N, s.steps(), DType::F32).with_mode(CacheMode::Kv);
    let mode = Mode::Capture(TemplateCache::new(layout).unwrap());
    let job = Job::new(&**m, &inputs(), s, mode).unwrap();
    let plan = prefix(m.num_blocks(), 0);
    let (fin, cache) = run(m, job, feed, &DeviceTemplates::new(), &plan);
    (Arc::new(cache.unwrap()), fin)
}

fn edit_job(m: &Model, mask: &TokenMask, cache: &Arc<TemplateCache>) -> Job<Tensor> {
    let mode = Mode::Edit {
        mask: Arc::new(mask.clone()),
        cache: cache.clone(),
    };
    Job::new(&**m, &inputs(), schedule(), mode).unwrap()
}

/// max |a - b| / max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    a.max_abs_diff(b).unwrap() / b.data().iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn masks() -> Vec<(&'static str, TokenMask)> {
    let mut one = vec![false; N];
    one[7 * 16 + 9] = true;
    let ring: Vec<bool> = (0..N)
        .map(|i| {
            let (r, c) = (i / 16, i % 16);
            (r == 0 || c == 15 || (r + 2 * c) % 7 == 0) && i % 5 != 0
        })
        .collect();
    vec![
        (
            "empty",
            TokenMask::from_tokens(16, 16, &[false; N]).unwrap(),
        ),
        ("one token", TokenMask::from_tokens(16, 16, &one).unwrap()),
        (
            "e2e mask",
            e2e_token_mask(&RefCase::open("e2e").unwrap(), 0),
        ),
        ("irregular", TokenMask::from_tokens(16, 16, &ring).unwrap()),
        ("full", TokenMask::full(16, 16)),
    ]
}

#[test]
fn an_edit_with_a_captures_controlnets_reproduces_the_capture() {
    let m = model();
    let (_, plain) = capture(&m, None);
    for count in [1, 2] {
        let (cache, want) = capture(&m, Some(&feed(count, None)));
        // The ControlNets matter: a misplaced residual row would show.
        let moved = rel(&want, &plain);
        println!("{count} ControlNet(s) move the capture by {moved:.2e}");
        assert!(moved > 1e-2, "{moved:e}");
        let slabs = DeviceTemplates::resident(m.backend(), &[&cache]).unwrap();
        // No full block: full blocks recompute the inactive rows without residuals, as
        // a template captured without ControlNets has them (the next test).
        let plan = prefix(m.num_blocks(), 0);
        for (name, mask) in masks() {
            let f = feed(count, Some(&mask));
            let (got, _) = run(&m, edit_job(&m, &mask, &cache), Some(&f), &slabs, &plan);
            let d = rel(&got, &want);
            println!(
                "{count} net(s), {name} ({} active): {d:.1e}",
                mask.active().len()
            );
            assert!(d <= 1e-5, "{count} net(s), {name}: {d:e}");
        }
    }
}

#[test]
fn the_stepper_feeds_an_edit_its_active_rows() {
    let m = model();
    let f = feed(2, None);
    let (cache, want) = capture(&m, Some(&f));
    let (_, mask) = masks().swap_remove(2);
    let mut st = ModelStepper::unbounded(m.clone(), 4);
    let mode = |mask: &TokenMask| Mode::Edit {
        mask: Arc::new(mask.clone()),
        cache: cache.clone(),
    };
    // A feed of every row is refused for an edit of some.
    st.admit(1, &inputs(), schedule(), mode(&mask)).unwrap();
    let e = st.set_control_feed(1, f).unwrap_err();
    assert!(e.to_string().contains("rows"), "{e}");
    st.set_control_feed(1, feed(2, Some(&mask))).unwrap();
    while !st.done(1) {
        st.step(&[1]).unwrap();
    }
    let d = rel(&st.finish(1).unwrap().0, &want);
    println!("through the stepper: {d:.1e}");
    assert!(d <= 1e-5, "{d:e}");
}

#[test]
fn on_a_plain_template_controlnets_move_only_the_active_tokens() {
    let m = model();
    let (cache, template) = capture(&m, None);
    let slabs = DeviceTemplates::resident(m.backend(), &[&cache]).unwrap();
    let plan = prefix(m.num_blocks(), 0);
    let (_, mask) = masks().swap_remove(2);
    let f = feed(2, Some(&mask));
    let (got, _) = run(&m, edit_job(&m, &mask, &cache), Some(&f), &slabs, &plan);
    let c = 64;
    let active = mask.active();
    let mut moved = 0f32;
    for t in 0..N {
        let (a, b) = (
            &got.data()[t * c..(t + 1) * c],
            &template.data()[t * c..(t + 1) * c],
        );
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        if active.contains(&(t as u32)) {
            moved = moved.max(d);
        } else {
            assert_eq!(d, 0.0, "inactive token {t} moved");
        }
    }
    println!("active tokens moved by up to {moved:.2e}");
    assert!(moved > 1e-2, "{moved:e}");

    // Every token active: a full run with the ControlNets.
    let full = TokenMask::full(16, 16);
    let f = feed(2, Some(&full));
    let (got, _) = run(&m, edit_job(&m, &full, &cache), Some(&f), &slabs, &plan);
    let job = Job::new(&*m, &inputs(), schedule(), Mode::Full).unwrap();
    let (want, _) = run(
        &m,
        job,
        Some(&feed(2, None)),
        &DeviceTemplates::new(),
        &plan,
    );
    let d = rel(&got, &want);
    println!("full-mask edit vs full run: {d:.1e}");
    assert!(d <= 1e-5, "{d:e}");
}

/// A feed of every row whose residuals are zero outside `active`.
struct ZeroInactive {
    inner: Arc<dyn ControlFeed>,
    active: Vec<bool>,
}

impl ControlFeed for ZeroInactive {
    fn layout(&self) -> denoised_models::flux::control_feed::FeedLayout {
        self.inner.layout()
    }
    fn begin(&self, step: usize, latents: &Tensor) -> denoised_runtime::Result<()> {
        self.inner.begin(step, latents)
    }
    fn with_residual(
        &self,
        k: usize,
        f: &mut dyn FnMut(&[f32]) -> denoised_runtime::Result<()>,
    ) -> denoised_runtime::Result<()> {
        let hidden = self.layout().hidden;
        self.inner.with_residual(k, &mut |r| {
            let mut v = r.to_vec();
            for (t, row) in v.chunks_mut(hidden).enumerate() {
                if !self.active[t] {
                    row.fill(0.0);
                }
            }
            f(&v)
        })
    }
}

#[test]
fn full_blocks_give_an_edits_inactive_rows_no_residual() {
    let m = model();
    let (cache, _) = capture(&m, None);
    let slabs = DeviceTemplates::resident(m.backend(), &[&cache]).unwrap();
    // Every block over every token: the first step reads nothing from the template,
    // and its inactive rows start at the edit's own noise, as a full run's do.
    let plan = prefix(m.num_blocks(), m.num_blocks());
    for (name, mask) in masks().into_iter().skip(1).take(3) {
        let f = feed(2, Some(&mask));
        let mut edit = edit_job(&m, &mask, &cache);
        f.begin(0, &edit.control_latents(&*m).unwrap()).unwrap();
        edit.set_control(Some(Arc::new(FeedControl::new(f, m.clone()).unwrap())));
        step_batch_with(&*m, &mut [&mut edit], &slabs, &plan).unwrap();
        let got = edit.computed_latents(&*m).unwrap();

        let mut active = vec![false; N];
        for &t in mask.active() {
            active[t as usize] = true;
        }
        let f: Arc<dyn ControlFeed> = Arc::new(ZeroInactive {
            inner: feed(2, None),
            active,
        });
        let mut full = Job::new(&*m, &inputs(), schedule(), Mode::Full).unwrap();
        f.begin(0, &full.control_latents(&*m).unwrap()).unwrap();
        full.set_control(Some(Arc::new(FeedControl::new(f, m.clone()).unwrap())));
        step_batch_with(&*m, &mut [&mut full], &DeviceTemplates::new(), &plan).unwrap();
        let want = full.computed_latents(&*m).unwrap().gather(mask.active());

        let d = rel(&got, &want);
        println!("{name}: step 0 over full blocks vs a full run: {d:.1e}");
        assert!(d <= 1e-5, "{name}: {d:e}");
    }
}
