//! The whole Flux transformer on the GPU backend against diffusers' reference fixtures.
//!
//! Runs on the CUDA emulator everywhere (the real kernel sources on CPU threads, the
//! real backend code), and on `cuda:0` when a GPU is present (otherwise it says why it
//! skips). Tolerances:
//! - f32 mode: the fixtures' own `suggested_atol`, exactly as the CPU backend;
//! - bf16 mode: max |diff| <= 3% of the output's largest magnitude, against the same
//!   f32 reference. Weights and every activation are stored in bf16 (8 bits of
//!   mantissa), through two double and one single block plus the embedders; this is
//!   the precision diffusers itself runs FLUX at.
//!
//! And the identity invariant on the GPU backend: an edit with exactly a capture's
//! inputs, its cached K/V resident on the device, gives the capture's final latent
//! (f32: 1e-5 relative, as on the CPU; bf16: 2e-2 relative).

use std::sync::Arc;

use denoised_cuda::{CudaExec, Dt, EmuExec, Exec, GpuBackend, GpuTensor, StreamedTemplate};
use denoised_models::flux::edit::{
    step_batch_with, DenoiseInputs, Job, Mode, ResidentTemplates, SlabSource, TemplateProviders,
};
use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::DType;

const CASES: [&str; 4] = [
    "transformer_case1",
    "transformer_case2",
    "transformer_case3",
    "transformer_case4_generic_ids",
];
const BF16_REL_TOL: f32 = 3e-2;

fn check<E: Exec>(make: impl Fn() -> E) {
    for dt in [Dt::F32, Dt::Bf16] {
        let be = GpuBackend::new(make(), dt);
        let name = denoised_runtime::Backend::name(&be);
        let m = FluxTransformer::load(be, tiny_model_dir().join("transformer")).unwrap();
        for key in CASES {
            let case = RefCase::open(key).unwrap();
            let inputs = FluxInputs::from_file(case.file()).unwrap();
            let out = m.forward_inputs(&inputs, &mut NoObserver).unwrap();
            match dt {
                Dt::F32 => {
                    let d = case.assert_close("output", &out, Tier::Suggested);
                    println!(
                        "{name} {key}: max abs diff {d:.2e} (atol {:.1e})",
                        case.atol("output", Tier::Suggested)
                    );
                }
                Dt::Bf16 => {
                    let want = case.tensor("output");
                    let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = out.max_abs_diff(&want).unwrap();
                    println!(
                        "{name} {key}: max abs diff {d:.2e} = {:.2e} of max |ref| {scale:.2}",
                        d / scale
                    );
                    assert!(
                        d <= BF16_REL_TOL * scale,
                        "{key}: bf16 diff {d} > {BF16_REL_TOL} x {scale}"
                    );
                }
            }
        }
    }
}

/// The diffusers end-to-end case's denoiser inputs (256 image tokens).
fn e2e_inputs() -> DenoiseInputs {
    denoised_models::fixtures::e2e_denoise_inputs(&RefCase::open("e2e").unwrap())
}

fn run_to_end<E: Exec>(
    m: &FluxTransformer<GpuBackend<E>>,
    jobs: &mut [Job],
    slabs: &impl SlabSource<GpuTensor<E>>,
) {
    while jobs.iter().any(|j| !j.done()) {
        let mut refs: Vec<&mut Job> = jobs.iter_mut().filter(|j| !j.done()).collect();
        step_batch_with(m, &mut refs, slabs).unwrap();
    }
}

fn identity<E: Exec>(make: impl Fn() -> E) {
    let inputs = Arc::new(e2e_inputs());
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256).unwrap());
    // An irregular mask: a ring, a diagonal band and holes.
    let tokens: Vec<bool> = (0..256)
        .map(|i| {
            let (r, c) = (i / 16, i % 16);
            (r == 0 || c == 15 || (r + 2 * c) % 7 == 0) && i % 5 != 0
        })
        .collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &tokens).unwrap());
    for (dt, tol) in [(Dt::F32, 1e-5), (Dt::Bf16, 2e-2)] {
        let be = GpuBackend::new(make(), dt);
        let m = FluxTransformer::load(be, tiny_model_dir().join("transformer")).unwrap();
        let name = denoised_runtime::Backend::name(m.backend());
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::F32);
        let mut resident = ResidentTemplates::new();
        let capture = Mode::Capture(Box::new(TemplateCache::new(layout)));
        let mut cap = [Job::new(inputs.clone(), s.clone(), capture).unwrap()];
        run_to_end(&m, &mut cap, &resident);
        let [cap] = cap;
        let (fin, cache) = cap.into_parts();
        let cache = Arc::new(cache.unwrap());
        let scale = fin.data().iter().fold(0f32, |a, v| a.max(v.abs()));
        let edit = || {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(inputs.clone(), s.clone(), mode).unwrap()
        };
        let check = |what: &str, job: &Job| {
            let d = job.latents().max_abs_diff(&fin).unwrap() / scale;
            println!(
                "identity invariant on {name}, {what} ({} of 256 tokens active): relative diff {d:.2e} (bound {tol:.0e})",
                mask.active().len()
            );
            assert!(d <= tol, "{dt:?} {what}: identity invariant broken: {d}");
        };

        // The template resident on the device.
        resident.make_resident(m.backend(), &cache).unwrap();
        let mut one = [edit()];
        run_to_end(&m, &mut one, &resident);
        check("resident template", &one[0]);

        // Streamed block by block through ping-pong buffers, by two requests that
        // share every forward at different steps (the second starts one step later).
        let lay = cache.layout();
        let slabs = cache.kv_slabs().unwrap();
        let streamed =
            StreamedTemplate::new(m.backend(), &slabs, lay.steps, lay.blocks, 2).unwrap();
        let mut providers = TemplateProviders::new();
        providers.insert(&cache, Box::new(streamed));
        let mut first = edit();
        step_batch_with(&m, &mut [&mut first], &providers).unwrap();
        let mut two = [first, edit()];
        run_to_end(&m, &mut two, &providers);
        check("streamed template, request at steps 0..3", &two[0]);
        check("streamed template, request joining a step later", &two[1]);
    }
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_transformer_matches_diffusers() {
    check(EmuExec::default);
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_identity_invariant() {
    identity(EmuExec::default);
}

#[test]
fn gpu_identity_invariant() {
    if let Err(e) = CudaExec::new(0) {
        println!("skipping the GPU run: {e}");
        return;
    }
    identity(|| CudaExec::new(0).unwrap());
}

#[test]
fn gpu_transformer_matches_diffusers() {
    if let Err(e) = CudaExec::new(0) {
        println!("skipping the GPU run: {e}");
        return;
    }
    check(|| CudaExec::new(0).unwrap());
}

/// The device memory budget's workspace bound holds for real steps: the emulated
/// device accounts every allocation, so the peak of a batched step over what was
/// allocated before it (weights, resident templates) is the step's workspace. Full
/// runs and edits, batches of 1 and 4, in bf16 (f32 measured the same ratios: every
/// buffer scales with the dtype). Also checks that the stepper keeps templates
/// resident within its byte capacity.
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_step_workspace_stays_within_the_budget() {
    use denoised_actors::budget::workspace_bytes;
    use denoised_models::flux::stepper::{DeviceStepper, Stepper};

    let inputs = Arc::new(e2e_inputs());
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256).unwrap());
    let text = inputs.txt.rows();
    let ring: Vec<bool> = (0..256).map(|i| i % 16 == 0 || i / 16 == 3).collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &ring).unwrap());
    {
        let dt = Dt::Bf16;
        let exec = EmuExec::with_capacity(u64::MAX);
        let m = FluxTransformer::load(
            GpuBackend::new(exec.clone(), dt),
            tiny_model_dir().join("transformer"),
        )
        .unwrap();
        let hidden = m.config.hidden();
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::F32);
        let template_bytes = (layout.steps * layout.blocks * 256 * 2 * hidden * dt.size()) as u64;
        // Room for one template: a second one evicts the first.
        let mut st = DeviceStepper::new(m, template_bytes, dt.size());
        let mut capture = || {
            let mode = Mode::Capture(Box::new(TemplateCache::new(layout)));
            let job = Job::new(inputs.clone(), s.clone(), mode).unwrap();
            let (_, cache) = denoised_models::flux::stepper::run_job_on(&mut st, job)
                .unwrap()
                .into_parts();
            Arc::new(cache.unwrap())
        };
        let (a, b) = (capture(), capture());
        assert_eq!(st.template_bytes(&a), template_bytes);
        let edit = |cache: &Arc<TemplateCache>| {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(inputs.clone(), s.clone(), mode).unwrap()
        };
        let full = || Job::new(inputs.clone(), s.clone(), Mode::Full).unwrap();
        let cases: Vec<(&str, Vec<Job>)> = vec![
            ("1 full", vec![full()]),
            ("4 full", (0..4).map(|_| full()).collect()),
            ("1 edit", vec![edit(&a)]),
            ("4 edits", (0..4).map(|_| edit(&a)).collect()),
        ];
        for (what, mut jobs) in cases {
            let rows: usize = jobs.iter().map(|j| text + j.active_tokens()).sum();
            let context = jobs.len() * (text + 256);
            // The first step makes the template resident; the second is measured.
            let mut refs: Vec<&mut Job> = jobs.iter_mut().collect();
            st.step(&mut refs).unwrap();
            exec.reset_peak();
            let before = exec.in_use_bytes();
            st.step(&mut refs).unwrap();
            let used = exec.peak_bytes() - before;
            let bound = workspace_bytes(hidden, dt.size(), rows, context);
            println!(
                "{dt:?} {what}: {rows} rows over {context} tokens: step workspace {used} B, \
                 budget bound {bound} B ({:.2}x)",
                bound as f64 / used as f64
            );
            assert!(used <= bound, "{dt:?} {what}: {used} > {bound}");
        }
        // One template fits: editing `b` evicts `a`.
        assert_eq!(st.resident().count(), 1);
        let mut j = edit(&b);
        st.step(&mut [&mut j]).unwrap();
        let resident: Vec<_> = st.resident().collect();
        assert_eq!(resident.len(), 1);
        assert!(Arc::ptr_eq(resident[0], &b));
    }
}
