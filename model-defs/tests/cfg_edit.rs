//! True CFG on mask-aware edits (docs/design.md §Adapters): an edit's negative branch
//! computes its active rows with the negative prompt against the same template as the
//! positive branch, and each step follows `neg + scale * (pos - neg)`.
//!
//! FluxFillPipeline has no true CFG, so there is no diffusers fixture; the checks are
//! exact consequences of that definition, on the tiny reference Fill model with the
//! e2e case's inputs (1e-5 relative, the bound of mask_aware.rs), for KV and Y
//! templates, with no full block and with planned full prefixes:
//! - at scale 0 the edit follows its negative branch alone: it equals a plain edit
//!   whose prompt is the negative prompt;
//! - at scale 1 it follows its positive branch: it equals the plain edit;
//! - in a batch with another edit, each equals itself run alone;
//! - a full-mask edit equals a full run with the same true CFG;
//! - an intermediate scale moves the edit (the test could fail).

use std::sync::Arc;

use denoised_models::flux::edit::{
    step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode, TrueCfg,
};
use denoised_models::flux::template::{CacheMode, TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::planner::{prefix, Choice};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase};
use denoised_runtime::{CpuBackend, DType, Tensor};

type Model = FluxTransformer<CpuBackend>;
const N: usize = 256;

fn model() -> Model {
    FluxTransformer::load(CpuBackend::new(), tiny_model_dir().join("transformer")).unwrap()
}

fn schedule() -> Arc<FlowMatchEuler> {
    Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 4, N).unwrap())
}

fn inputs() -> DenoiseInputs {
    denoised_models::fixtures::e2e_denoise_inputs(&RefCase::open("e2e").unwrap())
}

/// Seeded values in about [-1, 1].
fn seeded(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A negative prompt's embeddings: 5 T5 rows, a pooled vector (seeded).
fn negative(scale: f32) -> TrueCfg {
    let i = inputs();
    let w = i.txt.cols();
    TrueCfg {
        txt: Tensor::new([5, w], seeded(11, 5 * w)).unwrap(),
        txt_ids: Tensor::zeros([5, 3]),
        pooled: seeded(12, i.pooled.len()),
        scale,
    }
}

/// The edit's inputs with the negative prompt as its prompt.
fn negative_inputs() -> DenoiseInputs {
    let n = negative(0.0);
    DenoiseInputs {
        txt: n.txt,
        txt_ids: n.txt_ids,
        pooled: n.pooled,
        ..inputs()
    }
}

fn capture(m: &Model, mode: CacheMode) -> Arc<TemplateCache> {
    let s = schedule();
    let layout = TemplateLayout::for_model(&m.config, N, s.steps(), DType::F32).with_mode(mode);
    let job = Job::new(
        m,
        &inputs(),
        s,
        Mode::Capture(TemplateCache::new(layout).unwrap()),
    );
    let (_, cache) = run(
        m,
        vec![job.unwrap()],
        &DeviceTemplates::new(),
        &prefix(m.num_blocks(), 0),
    )
    .pop()
    .unwrap();
    Arc::new(cache.unwrap())
}

/// Runs `jobs` in one batch to the end with `plan`; their final latents (and
/// templates).
fn run(
    m: &Model,
    mut jobs: Vec<Job<Tensor>>,
    slabs: &DeviceTemplates<Tensor>,
    plan: &[Choice],
) -> Vec<(Tensor, Option<TemplateCache>)> {
    while jobs.iter().any(|j| !j.done()) {
        let mut batch: Vec<&mut Job<Tensor>> = jobs.iter_mut().collect();
        step_batch_with(m, &mut batch, slabs, plan).unwrap();
    }
    jobs.into_iter().map(|j| j.finish(m).unwrap()).collect()
}

fn edit(
    m: &Model,
    inputs: &DenoiseInputs,
    mask: &TokenMask,
    cache: &Arc<TemplateCache>,
    cfg: Option<&TrueCfg>,
) -> Job<Tensor> {
    let mode = Mode::Edit {
        mask: Arc::new(mask.clone()),
        cache: cache.clone(),
    };
    let mut j = Job::new(m, inputs, schedule(), mode).unwrap();
    if let Some(c) = cfg {
        j.set_true_cfg(m, inputs, c).unwrap();
    }
    j
}

/// max |a - b| / max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    a.max_abs_diff(b).unwrap() / b.data().iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn e2e_mask() -> TokenMask {
    denoised_models::fixtures::e2e_token_mask(&RefCase::open("e2e").unwrap(), 0)
}

#[test]
fn an_edits_branches_are_plain_edits_of_their_prompts() {
    let m = model();
    let mask = e2e_mask();
    let (pos, neg) = (inputs(), negative_inputs());
    for mode in [CacheMode::Kv, CacheMode::Y] {
        let cache = capture(&m, mode);
        let slabs = DeviceTemplates::resident(m.backend(), &[&cache]).unwrap();
        // Full prefixes: the inactive rows computed in both branches.
        for full in [0, 2, 3] {
            let plan = prefix(m.num_blocks(), full);
            let one = |i: &DenoiseInputs, cfg: Option<&TrueCfg>| {
                run(&m, vec![edit(&m, i, &mask, &cache, cfg)], &slabs, &plan)
                    .pop()
                    .unwrap()
                    .0
            };
            let plain_pos = one(&pos, None);
            let plain_neg = one(&neg, None);
            let at0 = one(&pos, Some(&negative(0.0)));
            let at1 = one(&pos, Some(&negative(1.0)));
            let at3 = one(&pos, Some(&negative(3.0)));
            let (d0, d1) = (rel(&at0, &plain_neg), rel(&at1, &plain_pos));
            let moved = rel(&at3, &plain_pos);
            println!(
                "{mode:?}, {full} full blocks: scale 0 vs the negative prompt's edit {d0:.1e}, scale 1 vs the plain edit {d1:.1e}; scale 3 moves it {moved:.1e}"
            );
            assert!(d0 <= 1e-5 && d1 <= 1e-5, "{mode:?} {full}: {d0:e} {d1:e}");
            assert!(moved > 1e-2, "{mode:?} {full}: {moved:e}");

            // Batched with a plain edit of another mask: each as alone.
            if full == 0 {
                let small = TokenMask::from_tokens(16, 16, &{
                    let mut v = vec![false; N];
                    v[3 * 16 + 4..3 * 16 + 9].fill(true);
                    v
                })
                .unwrap();
                let other = one_other(&m, &small, &cache, &slabs, &plan);
                let jobs = vec![
                    edit(&m, &pos, &mask, &cache, Some(&negative(3.0))),
                    edit(&m, &pos, &small, &cache, None),
                ];
                let out = run(&m, jobs, &slabs, &plan);
                let (da, db) = (rel(&out[0].0, &at3), rel(&out[1].0, &other));
                println!("{mode:?} batched: {da:.1e} / {db:.1e}");
                assert!(da <= 1e-5 && db <= 1e-5, "{mode:?} batched: {da:e} {db:e}");
            }
        }
    }
}

fn one_other(
    m: &Model,
    mask: &TokenMask,
    cache: &Arc<TemplateCache>,
    slabs: &DeviceTemplates<Tensor>,
    plan: &[Choice],
) -> Tensor {
    run(m, vec![edit(m, &inputs(), mask, cache, None)], slabs, plan)
        .pop()
        .unwrap()
        .0
}

#[test]
fn a_full_mask_edit_with_true_cfg_equals_a_full_run_with_it() {
    let m = model();
    let cache = capture(&m, CacheMode::Kv);
    let slabs = DeviceTemplates::resident(m.backend(), &[&cache]).unwrap();
    let plan = prefix(m.num_blocks(), 0);
    let cfg = negative(3.0);
    let full = TokenMask::full(16, 16);
    let got = run(
        &m,
        vec![edit(&m, &inputs(), &full, &cache, Some(&cfg))],
        &slabs,
        &plan,
    );
    let mut j = Job::new(&m, &inputs(), schedule(), Mode::Full).unwrap();
    j.set_true_cfg(&m, &inputs(), &cfg).unwrap();
    let want = run(&m, vec![j], &DeviceTemplates::new(), &plan);
    let d = rel(&got[0].0, &want[0].0);
    println!("full-mask edit vs full run, true CFG 3: {d:.1e}");
    assert!(d <= 1e-5, "{d:e}");
    // A capture takes no negative branch (its template would hold only one branch's
    // K/V).
    let s = schedule();
    let layout = TemplateLayout::for_model(&m.config, N, s.steps(), DType::F32);
    let mut c = Job::new(
        &m,
        &inputs(),
        s,
        Mode::Capture(TemplateCache::new(layout).unwrap()),
    )
    .unwrap();
    assert!(c.set_true_cfg(&m, &inputs(), &cfg).is_err());
}
