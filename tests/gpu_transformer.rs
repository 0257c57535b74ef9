//! The whole Flux transformer on the GPU backend against diffusers' reference fixtures
//! and the identity invariant on the device (`denoised::selfcheck`, which states the
//! tolerances), on the CUDA emulator everywhere and on `cuda:0` when a GPU is present
//! (otherwise those tests say why they skip). And the device memory budget's
//! workspace bound, measured on the emulator.

use std::sync::Arc;

use denoised::selfcheck;
use denoised_cuda::selfcheck::assert_all_pass;
use denoised_cuda::{CudaExec, Dt, EmuExec, GpuBackend};
use denoised_models::flux::edit::{Job, Mode};
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase};
use denoised_runtime::DType;

/// `cuda:0`, or why not.
fn cuda0() -> denoised_runtime::Result<CudaExec> {
    CudaExec::new(0).map_err(|e| denoised_runtime::Error::Device(e.to_string()))
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_transformer_matches_diffusers() {
    assert_all_pass(&selfcheck::transformer(|| Ok(EmuExec::default())).unwrap());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_identity_invariant() {
    assert_all_pass(&selfcheck::identity(|| Ok(EmuExec::default())).unwrap());
}

#[test]
fn gpu_identity_invariant() {
    if let Err(e) = CudaExec::new(0) {
        println!("skipping the GPU run: {e}");
        return;
    }
    assert_all_pass(&selfcheck::identity(cuda0).unwrap());
}

#[test]
fn gpu_transformer_matches_diffusers() {
    if let Err(e) = CudaExec::new(0) {
        println!("skipping the GPU run: {e}");
        return;
    }
    assert_all_pass(&selfcheck::transformer(cuda0).unwrap());
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

    let inputs = Arc::new(denoised_models::fixtures::e2e_denoise_inputs(
        &RefCase::open("e2e").unwrap(),
    ));
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
