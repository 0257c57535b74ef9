//! Mask-aware computation on the tiny reference model, with the inputs of the
//! diffusers end-to-end case:
//!
//! - the plain denoising loop reproduces diffusers' per-step latents;
//! - the identity invariant: an edit with exactly a capture's inputs gives the
//!   capture's final latent (1e-5 relative), for empty, full, one-token and irregular
//!   masks, alone and in a batch of requests at different steps;
//! - it holds for every planned full prefix (the first blocks computing every token),
//!   with the template resident or streamed by the CPU's loader thread;
//! - with a Y-mode template (block outputs cached, inactive K/V recomputed) it holds
//!   for any pattern of cached and full blocks, resident and streamed, and in a batch
//!   with KV-mode edits;
//! - an fp8 template (K/V in E4M3, a scale per head) is read as it is by the attention
//!   kernel, resident or streamed alike, within a stated bound of the f32 template;
//! - batch independence: a request's result does not depend on its batch mates;
//! - an all-active edit equals a plain full run.

use std::sync::Arc;

use denoised_models::fixtures::e2e_token_mask;
use denoised_models::flux::edit::{
    run_to_end, step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode,
};
use denoised_models::flux::template::{CacheMode, TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::planner::{prefix, Choice};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::{CpuBackend, DType, Tensor};

fn model() -> FluxTransformer<CpuBackend> {
    FluxTransformer::load(CpuBackend::new(), tiny_model_dir().join("transformer")).unwrap()
}

fn e2e_inputs(case: &RefCase) -> DenoiseInputs {
    denoised_models::fixtures::e2e_denoise_inputs(case)
}

fn schedule() -> FlowMatchEuler {
    FlowMatchEuler::new(&SchedulerConfig::default(), 4, 256).unwrap()
}

fn capture(
    m: &FluxTransformer<CpuBackend>,
    inputs: &DenoiseInputs,
    s: &FlowMatchEuler,
) -> (Arc<TemplateCache>, Tensor) {
    capture_in(m, inputs, s, CacheMode::Kv)
}

fn capture_in(
    m: &FluxTransformer<CpuBackend>,
    inputs: &DenoiseInputs,
    s: &FlowMatchEuler,
    cache_mode: CacheMode,
) -> (Arc<TemplateCache>, Tensor) {
    capture_as(m, inputs, s, cache_mode, DType::F32)
}

fn capture_as(
    m: &FluxTransformer<CpuBackend>,
    inputs: &DenoiseInputs,
    s: &FlowMatchEuler,
    cache_mode: CacheMode,
    dtype: DType,
) -> (Arc<TemplateCache>, Tensor) {
    let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), dtype).with_mode(cache_mode);
    let mode = Mode::Capture(TemplateCache::new(layout).unwrap());
    let job = Job::new(m, inputs, s.clone(), mode).unwrap();
    let (fin, cache) = run_to_end(m, job, &DeviceTemplates::new()).unwrap();
    let cache = cache.unwrap();
    assert!(cache.is_complete());
    (Arc::new(cache), fin)
}

/// The CPU's form of a template: resident (decoded to f32).
fn slabs(m: &FluxTransformer<CpuBackend>, cache: &Arc<TemplateCache>) -> DeviceTemplates<Tensor> {
    DeviceTemplates::resident(m.backend(), &[cache]).unwrap()
}

/// Runs one job to the end and returns its final latent.
fn run(
    m: &FluxTransformer<CpuBackend>,
    job: Job<Tensor>,
    slabs: &DeviceTemplates<Tensor>,
) -> Tensor {
    run_to_end(m, job, slabs).unwrap().0
}

fn edit(mask: &TokenMask, cache: &Arc<TemplateCache>) -> Mode {
    Mode::Edit {
        mask: Arc::new(mask.clone()),
        cache: cache.clone(),
    }
}

/// max |a - b| / max |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    a.max_abs_diff(b).unwrap() / b.data().iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn masks(case: &RefCase) -> Vec<(&'static str, TokenMask)> {
    let mut one = vec![false; 256];
    one[7 * 16 + 9] = true;
    let mut ring = vec![false; 256];
    for (i, f) in ring.iter_mut().enumerate() {
        let (r, c) = (i / 16, i % 16);
        *f = (r == 0 || c == 15 || (r + 2 * c) % 7 == 0) && i % 5 != 0;
    }
    vec![
        (
            "empty",
            TokenMask::from_tokens(16, 16, &[false; 256]).unwrap(),
        ),
        ("full", TokenMask::full(16, 16)),
        ("one token", TokenMask::from_tokens(16, 16, &one).unwrap()),
        ("e2e mask", e2e_token_mask(case, 0)),
        ("e2e mask dilated", e2e_token_mask(case, 1)),
        (
            "irregular, touching borders",
            TokenMask::from_tokens(16, 16, &ring).unwrap(),
        ),
    ]
}

#[test]
fn full_loop_matches_diffusers_per_step() {
    let case = RefCase::open("e2e").unwrap();
    let s = schedule();
    assert_eq!(s.timesteps, case.tensor("timesteps").into_data());
    assert_eq!(s.sigmas, case.tensor("sigmas").into_data());
    for (torch_freqs, tier) in [(false, Tier::Suggested), (true, Tier::Strict)] {
        let mut m = model();
        if torch_freqs {
            m.set_time_proj_freqs(
                RefCase::open("transformer_case1")
                    .unwrap()
                    .tensor("time_proj_freqs")
                    .into_data(),
            )
            .unwrap();
        }
        let inputs = e2e_inputs(&case);
        let mut job = Job::new(&m, &inputs, s.clone(), Mode::Full).unwrap();
        let none = DeviceTemplates::new();
        let plan = prefix(m.num_blocks(), 0);
        for i in 0..4 {
            step_batch_with(&m, &mut [&mut job], &none, &plan).unwrap();
            let latents = job.computed_latents(&m).unwrap();
            let d = case.assert_close(&format!("step{i}.latents"), &latents, tier);
            println!("step{i}.latents ({tier:?}): {d:.2e}");
        }
    }
}

#[test]
fn identity_invariant_for_every_mask() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, template_final) = capture(&m, &inputs, &s);
    let slabs = slabs(&m, &cache);
    for (name, mask) in masks(&case) {
        let job = Job::new(&m, &inputs, s.clone(), edit(&mask, &cache)).unwrap();
        let fin = run(&m, job, &slabs);
        let rel = rel_diff(&fin, &template_final);
        println!(
            "{name}: {} of 256 tokens active, relative diff {rel:.1e}",
            mask.active().len()
        );
        assert!(rel <= 1e-5, "{name}: relative diff {rel:.2e}");
    }
}

#[test]
fn identity_invariant_in_a_batch_at_different_steps() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, template_final) = capture(&m, &inputs, &s);
    let all = masks(&case);
    let (ma, mb, mc) = (&all[3].1, &all[2].1, &all[5].1);
    let slabs = slabs(&m, &cache);
    let job = |mask| Job::new(&m, &inputs, s.clone(), edit(mask, &cache)).unwrap();
    let (mut a, mut b, mut c) = (job(ma), job(mb), job(mc));
    let plan = prefix(m.num_blocks(), 0);
    // a starts first, b joins one step later, c two steps later: the batch holds
    // requests at steps (2, 1, 0) at its third call.
    step_batch_with(&m, &mut [&mut a], &slabs, &plan).unwrap();
    step_batch_with(&m, &mut [&mut a, &mut b], &slabs, &plan).unwrap();
    assert_eq!((a.step(), b.step(), c.step()), (2, 1, 0));
    while !(a.done() && b.done() && c.done()) {
        step_batch_with(&m, &mut [&mut a, &mut b, &mut c], &slabs, &plan).unwrap();
    }
    for (name, j) in [("a", a), ("b", b), ("c", c)] {
        let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
        assert!(rel <= 1e-5, "{name}: relative diff {rel:.2e}");
    }
}

#[test]
fn identity_invariant_for_every_full_prefix_resident_and_streamed() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, template_final) = capture(&m, &inputs, &s);
    let blocks = m.num_blocks();
    let all = masks(&case);
    let resident = slabs(&m, &cache);
    let mut streamed = DeviceTemplates::new();
    assert!(streamed.stream(m.backend(), &cache, 3).unwrap());
    for (form, source) in [("resident", &resident), ("streamed", &streamed)] {
        // A fixed prefix for every step, then a plan that changes from step to step,
        // with three edits at different steps in one batch.
        for k in 0..=blocks {
            let mask = &all[3].1;
            let mut j = Job::new(&m, &inputs, s.clone(), edit(mask, &cache)).unwrap();
            while !j.done() {
                step_batch_with(&m, &mut [&mut j], source, &prefix(blocks, k)).unwrap();
            }
            let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
            println!("{form}, {k} full blocks: relative diff {rel:.1e}");
            assert!(
                rel <= 1e-5,
                "{form}, {k} full blocks: relative diff {rel:.2e}"
            );
        }
        let job = |mask| Job::new(&m, &inputs, s.clone(), edit(mask, &cache)).unwrap();
        let (mut a, mut b, mut c) = (job(&all[3].1), job(&all[2].1), job(&all[5].1));
        let mut full = Job::new(&m, &inputs, s.clone(), Mode::Full).unwrap();
        step_batch_with(&m, &mut [&mut a], source, &prefix(blocks, blocks)).unwrap();
        step_batch_with(&m, &mut [&mut a, &mut b], source, &prefix(blocks, 1)).unwrap();
        let mut call = 0;
        while !(a.done() && b.done() && c.done()) {
            let k = (call * 7 + 3) % (blocks + 1);
            let plan = prefix(blocks, k);
            step_batch_with(&m, &mut [&mut a, &mut b, &mut c, &mut full], source, &plan).unwrap();
            call += 1;
        }
        for (name, j) in [("a", a), ("b", b), ("c", c)] {
            let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
            assert!(rel <= 1e-5, "{form} batch {name}: relative diff {rel:.2e}");
        }
    }
    // The full prefix really computes the inactive tokens: with another guidance their
    // K/V in the first blocks differ from the template's, and so do the active tokens.
    let mut other = inputs.clone();
    other.guidance = 4.0;
    let run_k = |k: usize| {
        let mut j = Job::new(&m, &other, s.clone(), edit(&all[3].1, &cache)).unwrap();
        while !j.done() {
            step_batch_with(&m, &mut [&mut j], &resident, &prefix(blocks, k)).unwrap();
        }
        j.finish(&m).unwrap().0
    };
    let moved = rel_diff(&run_k(blocks), &run_k(0));
    println!("another guidance, all blocks full vs all cached: relative diff {moved:.1e}");
    assert!(
        moved > 1e-4,
        "the full prefix changed nothing ({moved:.1e})"
    );
    // A plan of another length, and a KV template's inactive rows asked to rejoin
    // after a cached block, are refused.
    let mut j = Job::new(&m, &inputs, s.clone(), edit(&all[3].1, &cache)).unwrap();
    assert!(step_batch_with(&m, &mut [&mut j], &resident, &prefix(blocks + 1, 0)).is_err());
    let mut gap = prefix(blocks, blocks);
    gap[1] = Choice::Cached;
    let e = step_batch_with(&m, &mut [&mut j], &resident, &gap).unwrap_err();
    assert!(e.to_string().contains("not a prefix"), "{e}");
}

/// Patterns of cached and full blocks: the ends, alternations, and seeded random ones.
fn patterns(blocks: usize) -> Vec<Vec<Choice>> {
    let (c, f) = (Choice::Cached, Choice::Full);
    let mut out = vec![
        vec![c; blocks],
        vec![f; blocks],
        (0..blocks)
            .map(|b| if b % 2 == 0 { c } else { f })
            .collect(),
        (0..blocks)
            .map(|b| if b % 2 == 0 { f } else { c })
            .collect(),
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..4 {
        out.push(
            (0..blocks)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 3 == 0 {
                        f
                    } else {
                        c
                    }
                })
                .collect(),
        );
    }
    out
}

#[test]
fn y_mode_identity_for_any_pattern_resident_and_streamed() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (kv_cache, kv_final) = capture(&m, &inputs, &s);
    let (cache, template_final) = capture_in(&m, &inputs, &s, CacheMode::Y);
    // Capturing block outputs instead of K/V changes nothing of the run itself.
    assert_eq!(template_final, kv_final);
    let l = cache.layout();
    assert_eq!(l.slabs_per_step(), m.num_blocks() - 1);
    assert_eq!(l.slab_width(), m.config.hidden());
    let blocks = m.num_blocks();
    let all = masks(&case);
    let resident = slabs(&m, &cache);
    let mut streamed = DeviceTemplates::new();
    assert!(streamed.stream(m.backend(), &cache, 4).unwrap());
    for (form, source) in [("resident", &resident), ("streamed", &streamed)] {
        for (pi, plan) in patterns(blocks).iter().enumerate() {
            for (name, mask) in [&all[3], &all[0], &all[5]] {
                let mut j = Job::new(&m, &inputs, s.clone(), edit(mask, &cache)).unwrap();
                while !j.done() {
                    step_batch_with(&m, &mut [&mut j], source, plan).unwrap();
                }
                let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
                println!("Y {form}, pattern {pi}, {name}: relative diff {rel:.1e}");
                assert!(rel <= 1e-5, "Y {form} pattern {pi} {name}: {rel:.2e}");
            }
        }
        // Three edits at different steps, an all-active edit at c's step (it reads no
        // slab), a full run, a plan changing every call.
        let job = |mask| Job::new(&m, &inputs, s.clone(), edit(mask, &cache)).unwrap();
        let (mut a, mut b, mut c) = (job(&all[3].1), job(&all[2].1), job(&all[5].1));
        let mut d = job(&all[1].1);
        let mut full = Job::new(&m, &inputs, s.clone(), Mode::Full).unwrap();
        let ps = patterns(blocks);
        step_batch_with(&m, &mut [&mut a], source, &ps[2]).unwrap();
        step_batch_with(&m, &mut [&mut a, &mut b], source, &ps[5]).unwrap();
        let mut call = 0;
        while !(a.done() && b.done() && c.done() && d.done()) {
            let plan = &ps[(call * 3 + 1) % ps.len()];
            let mut batch = [&mut a, &mut b, &mut c, &mut d, &mut full];
            step_batch_with(&m, &mut batch, source, plan).unwrap();
            call += 1;
        }
        for (name, j) in [("a", a), ("b", b), ("c", c), ("d", d)] {
            let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
            assert!(
                rel <= 1e-5,
                "Y {form} batch {name}: relative diff {rel:.2e}"
            );
        }
    }
    // A Y edit batched with a KV edit: the plan is a prefix, both reproduce.
    let kv_slabs = DeviceTemplates::resident(m.backend(), &[&kv_cache, &cache]).unwrap();
    let mut y = Job::new(&m, &inputs, s.clone(), edit(&all[3].1, &cache)).unwrap();
    let mut kv = Job::new(&m, &inputs, s.clone(), edit(&all[5].1, &kv_cache)).unwrap();
    let mut k = 0;
    while !(y.done() && kv.done()) {
        step_batch_with(&m, &mut [&mut y, &mut kv], &kv_slabs, &prefix(blocks, k)).unwrap();
        k = (k + 2) % (blocks + 1);
    }
    for (name, j) in [("Y", y), ("KV", kv)] {
        let rel = rel_diff(&j.finish(&m).unwrap().0, &template_final);
        assert!(
            rel <= 1e-5,
            "mixed batch, {name} edit: relative diff {rel:.2e}"
        );
    }
    // A real edit (another guidance): all-full is one computation in both modes; a
    // cached Y block recomputes the inactive K/V with the edit's conditioning, so
    // all-cached Y differs from all-cached KV.
    let mut other = inputs.clone();
    other.guidance = 4.0;
    let run = |cache: &Arc<TemplateCache>, src: &DeviceTemplates<Tensor>, plan: &[Choice]| {
        let mut j = Job::new(&m, &other, s.clone(), edit(&all[3].1, cache)).unwrap();
        while !j.done() {
            step_batch_with(&m, &mut [&mut j], src, plan).unwrap();
        }
        j.finish(&m).unwrap().0
    };
    let (full, cached) = (prefix(blocks, blocks), prefix(blocks, 0));
    let kv_res = slabs(&m, &kv_cache);
    let same = rel_diff(
        &run(&cache, &resident, &full),
        &run(&kv_cache, &kv_res, &full),
    );
    let y_vs_kv = rel_diff(
        &run(&cache, &resident, &cached),
        &run(&kv_cache, &kv_res, &cached),
    );
    println!("another guidance: all full Y vs KV {same:.1e}; all cached Y vs KV {y_vs_kv:.1e}");
    assert!(same <= 1e-5, "all-full Y vs KV: {same:.2e}");
    assert!(
        y_vs_kv > 1e-4,
        "Y recompute changed nothing ({y_vs_kv:.1e})"
    );
}

/// The stepper plans every step from its profile: with a template it must stream
/// (over its budget) and slow loads, its steps compute a full prefix, report the
/// prediction and the bubble its loader measured, and still reproduce the capture.
#[test]
fn the_stepper_follows_the_planner_and_reports_its_steps() {
    use denoised_models::flux::stepper::{ModelStepper, Stepper};
    use denoised_models::profile::{Fit, Profile};
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, template_final) = capture(&m, &inputs, &s);
    let m = Arc::new(m);
    let mask = &masks(&case)[3].1;
    let run = |load_bps: f64| {
        // A budget of 0 bytes: the template is streamed by the CPU's loader thread.
        let mut st = ModelStepper::new(m.clone(), 0, 4, true);
        let mut p = Profile::defaults("cpu");
        p.compute = Fit::assumed(0.0, 1e-11);
        p.load_host = Fit::assumed(0.0, 1.0 / load_bps);
        st.set_profile(p);
        st.admit(1, &inputs, Arc::new(s.clone()), edit(mask, &cache))
            .unwrap();
        let mut reports = vec![];
        while !st.done(1) {
            reports.push(st.step(&[1]).unwrap());
        }
        (st.finish(1).unwrap().0, reports)
    };
    let (fast, fast_reports) = run(1e15);
    let (slow, slow_reports) = run(1e3);
    for r in &fast_reports {
        assert_eq!(r.full_blocks, 0, "{r:?}");
        assert!(r.predicted_s.is_some() && r.bubble_s.is_some(), "{r:?}");
    }
    for r in &slow_reports {
        assert_eq!(
            r.full_blocks,
            m.num_blocks(),
            "loads this slow make every block full: {r:?}"
        );
    }
    for (name, fin) in [("fast loads", fast), ("slow loads", slow)] {
        let rel = rel_diff(&fin, &template_final);
        assert!(rel <= 1e-5, "{name}: relative diff {rel:.2e}");
    }
    // Full runs read no template: no plan.
    let mut st = ModelStepper::new(m.clone(), 0, 4, true);
    st.admit(2, &inputs, Arc::new(s.clone()), Mode::Full)
        .unwrap();
    let r = st.step(&[2]).unwrap();
    assert_eq!((r.full_blocks, r.predicted_s), (0, None));
}

#[test]
fn batch_results_do_not_depend_on_batch_mates() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, _) = capture(&m, &inputs, &s);
    // A real edit: different noise in the masked region and a different prompt scale.
    let mut edit_inputs = inputs.clone();
    for v in edit_inputs.latents.data_mut() {
        *v = -*v * 0.9;
    }
    edit_inputs.guidance = 7.5;
    let all = masks(&case);
    let slabs = slabs(&m, &cache);
    let job = |mode: Mode, inp: &DenoiseInputs| Job::new(&m, inp, s.clone(), mode).unwrap();
    let solo = |mode: Mode, inp: &DenoiseInputs| run(&m, job(mode, inp), &slabs);
    let want_a = solo(edit(&all[3].1, &cache), &edit_inputs);
    let want_b = solo(edit(&all[5].1, &cache), &inputs);
    let want_c = solo(Mode::Full, &edit_inputs);
    let mut a = job(edit(&all[3].1, &cache), &edit_inputs);
    let mut b = job(edit(&all[5].1, &cache), &inputs);
    let mut c = job(Mode::Full, &edit_inputs);
    let plan = prefix(m.num_blocks(), 0);
    step_batch_with(&m, &mut [&mut c], &slabs, &plan).unwrap();
    while !(a.done() && b.done() && c.done()) {
        step_batch_with(&m, &mut [&mut a, &mut b, &mut c], &slabs, &plan).unwrap();
    }
    for (name, got, want) in [
        ("a", a.finish(&m).unwrap().0, &want_a),
        ("b", b.finish(&m).unwrap().0, &want_b),
        ("c", c.finish(&m).unwrap().0, &want_c),
    ] {
        let rel = rel_diff(&got, want);
        println!("{name}: batch vs solo relative diff {rel:.1e}");
        assert!(rel <= 1e-6, "{name}: batch vs solo relative diff {rel:.2e}");
    }
    // The edit really changed something inside the mask, and nothing outside it.
    let (_, template_final) = capture(&m, &inputs, &s);
    let inactive = all[3].1.inactive();
    let moved = all[3]
        .1
        .active()
        .iter()
        .any(|&t| want_a.row(t as usize) != template_final.row(t as usize));
    assert!(
        moved,
        "an edit with new noise must change the masked tokens"
    );
    for t in inactive {
        assert_eq!(
            want_a.row(t as usize),
            template_final.row(t as usize),
            "token {t} outside the mask drifted"
        );
    }
}

#[test]
fn all_active_edit_equals_full_run() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (cache, _) = capture(&m, &inputs, &s);
    let mut other = inputs.clone();
    other.guidance = 4.0;
    for v in other.latents.data_mut() {
        *v *= 1.1;
    }
    let full = TokenMask::full(16, 16);
    let slabs = slabs(&m, &cache);
    let edited = run(
        &m,
        Job::new(&m, &other, s.clone(), edit(&full, &cache)).unwrap(),
        &slabs,
    );
    let plain = run(
        &m,
        Job::new(&m, &other, s.clone(), Mode::Full).unwrap(),
        &slabs,
    );
    let rel = rel_diff(&edited, &plain);
    assert!(rel <= 1e-6, "relative diff {rel:.2e}");
}

#[test]
fn mismatched_templates_are_rejected() {
    let case = RefCase::open("e2e").unwrap();
    let (m, inputs) = (model(), e2e_inputs(&case));
    let s4 = schedule();
    let (cache, _) = capture(&m, &inputs, &s4);
    let s8 = FlowMatchEuler::new(&SchedulerConfig::default(), 8, 256).unwrap();
    let mask = e2e_token_mask(&case, 0);
    let e = Job::new(&m, &inputs, s8.clone(), edit(&mask, &cache))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("4 steps") && e.contains("8"), "{e}");
    let small = TokenMask::full(8, 8);
    assert!(Job::new(&m, &inputs, s4.clone(), edit(&small, &cache)).is_err());
}

/// An fp8 template: captured (quantised once, as the capture stores each slab), read
/// by the attention kernel as it is, resident and streamed with identical results, and
/// close to the f32 template's edit.
#[test]
fn fp8_templates_are_read_as_they_are_and_stay_close_to_f32() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (f32_cache, template_final) = capture(&m, &inputs, &s);
    let (cache, fp8_final) = capture_as(&m, &inputs, &s, CacheMode::Kv, DType::F8E4M3);
    // The capture itself computes in f32: only what it stores differs, and that is
    // exactly the f32 template quantised.
    assert_eq!(fp8_final, template_final);
    let converted = f32_cache.converted(*cache.layout()).unwrap();
    assert_eq!(converted.bytes().bytes(), cache.bytes().bytes());
    let (l, l32) = (cache.layout(), f32_cache.layout());
    println!(
        "slab bytes: fp8 {} vs f32 {} ({:.3}x)",
        l.slab_bytes(),
        l32.slab_bytes(),
        l.slab_bytes() as f64 / l32.slab_bytes() as f64
    );
    assert!(l.slab_bytes() * 3 < l32.slab_bytes());
    let all = masks(&case);
    let resident = slabs(&m, &cache);
    let mut streamed = DeviceTemplates::new();
    assert!(streamed.stream(m.backend(), &cache, 2).unwrap());
    let f32_slabs = slabs(&m, &f32_cache);
    for (name, mask) in [&all[3], &all[5], &all[2]] {
        let job = |c: &Arc<TemplateCache>| Job::new(&m, &inputs, s.clone(), edit(mask, c)).unwrap();
        let a = run(&m, job(&cache), &resident);
        let b = run(&m, job(&cache), &streamed);
        let want = run(&m, job(&f32_cache), &f32_slabs);
        assert_eq!(a, b, "{name}: resident and streamed fp8 differ");
        let rel = rel_diff(&a, &want);
        println!("{name}: fp8 vs f32 template, final latent relative diff {rel:.2e}");
        // Each cached K and V is within 2^-4 of itself, and attention averages the
        // errors of many of them: measured about 1e-3 here; 1e-2 leaves a margin
        // while still catching a wrong scale or a misread byte (those give O(1)).
        assert!(rel <= 1e-2, "{name}: {rel:.2e}");
        assert!(rel > 0.0, "{name}: fp8 changed nothing");
    }
    // The planner prices an fp8 template by its stored bytes.
    assert!(l.cache_bytes_per_step() * 3 < l32.cache_bytes_per_step());
}

/// Step sharing: a template storing K/V every second step holds exactly the full
/// capture's slabs of the steps it stores, and its edits read the nearest stored step
/// (resident and streamed alike).
#[test]
fn step_sharing_stores_every_kth_step_and_reads_the_nearest() {
    let case = RefCase::open("e2e").unwrap();
    let (m, s, inputs) = (model(), schedule(), e2e_inputs(&case));
    let (every, template_final) = capture(&m, &inputs, &s);
    let layout =
        TemplateLayout::for_model(&m.config, 256, s.steps(), DType::F32).with_step_stride(2);
    let job = Job::new(
        &m,
        &inputs,
        s.clone(),
        Mode::Capture(TemplateCache::new(layout).unwrap()),
    )
    .unwrap();
    let (fin, shared) = run_to_end(&m, job, &DeviceTemplates::new()).unwrap();
    let shared = Arc::new(shared.unwrap());
    assert_eq!(fin, template_final);
    // Converting the full template stores exactly what the capture stored.
    let converted = every.converted(layout).unwrap();
    assert_eq!(converted.bytes().bytes(), shared.bytes().bytes());
    assert_eq!(
        shared.layout().slab_count() * 2,
        every.layout().slab_count()
    );
    for step in [0, 2] {
        for b in 0..m.num_blocks() {
            assert_eq!(shared.slab(step, b).unwrap(), every.slab(step, b).unwrap());
        }
    }
    // Step 1 reads step 2's K/V, step 3 step 2's too (the last stored).
    assert_eq!(shared.slab(1, 0).unwrap(), every.slab(2, 0).unwrap());
    assert_eq!(shared.slab(3, 0).unwrap(), every.slab(2, 0).unwrap());
    let all = masks(&case);
    let resident = slabs(&m, &shared);
    let mut streamed = DeviceTemplates::new();
    assert!(streamed.stream(m.backend(), &shared, 2).unwrap());
    let job =
        |c: &Arc<TemplateCache>| Job::new(&m, &inputs, s.clone(), edit(&all[3].1, c)).unwrap();
    let a = run(&m, job(&shared), &resident);
    let b = run(&m, job(&shared), &streamed);
    assert_eq!(a, b);
    let rel = rel_diff(&a, &template_final);
    println!("stride 2: edit vs the capture, relative diff {rel:.2e}");
    assert!(rel > 1e-5, "step sharing changed nothing ({rel:.1e})");
}
