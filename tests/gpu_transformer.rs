//! The whole Flux transformer on the GPU backend against diffusers' reference fixtures
//! and the identity invariant on the device (`denoised::selfcheck`, which states the
//! tolerances), on the CUDA emulator everywhere and on `cuda:0` when a GPU is present
//! (otherwise those tests say why they skip). And the device memory budget's
//! workspace bound, measured on the emulator.

use std::sync::Arc;

use denoised::selfcheck;
use denoised_actors::budget::workspace_bytes;
use denoised_cuda::selfcheck::assert_all_pass;
use denoised_cuda::{CudaExec, Dt, EmuExec, GpuBackend};
use denoised_models::flux::edit::Mode;
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase};
use denoised_runtime::skip::{skip, Need};
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

/// The same through the attention library (the emulator's stand-in for cuDNN's fused
/// SDPA, the default path on a GPU with cuDNN): the single blocks' attention read in
/// place, the double blocks' and edits' packed into scratch.
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_transformer_matches_diffusers_through_the_attention_library() {
    let exec = EmuExec::default().with_attn_library(usize::MAX);
    assert_all_pass(&selfcheck::transformer(|| Ok(exec.clone())).unwrap());
    assert!(exec.library_attention() > 0, "the library ran");
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_identity_invariant_through_the_attention_library() {
    let exec = EmuExec::default().with_attn_library(usize::MAX);
    assert_all_pass(&selfcheck::identity(|| Ok(exec.clone())).unwrap());
    assert!(exec.library_attention() > 0, "the library ran");
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_identity_invariant() {
    assert_all_pass(&selfcheck::identity(|| Ok(EmuExec::default())).unwrap());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_loras_match_the_cpu() {
    assert_all_pass(&selfcheck::lora(|| Ok(EmuExec::default())).unwrap());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_edits_with_controlnets_and_true_cfg_match_the_cpu() {
    assert_all_pass(&selfcheck::edit_adapters(|| Ok(EmuExec::default())).unwrap());
}

#[test]
fn gpu_identity_invariant() {
    if let Err(e) = CudaExec::new(0) {
        skip(
            "gpu_transformer::gpu_identity_invariant",
            Need::Gpu,
            &e.to_string(),
        );
        return;
    }
    assert_all_pass(&selfcheck::identity(cuda0).unwrap());
}

#[test]
fn gpu_transformer_matches_diffusers() {
    if let Err(e) = CudaExec::new(0) {
        skip(
            "gpu_transformer::gpu_transformer_matches_diffusers",
            Need::Gpu,
            &e.to_string(),
        );
        return;
    }
    assert_all_pass(&selfcheck::transformer(cuda0).unwrap());
}

/// The device memory budget's workspace bound holds for real steps: the emulated
/// device accounts every allocation, so the peak of a batched step over what was
/// allocated before it (weights, resident templates, the admitted requests' own
/// tensors) is the step's workspace. Full runs and edits, batches of 1 and 4, in bf16
/// (f32 measured the same ratios: every buffer scales with the dtype). Also checks
/// that the stepper keeps templates resident within its byte capacity, and streams a
/// template larger than all of it from host memory, with the same result.
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_step_workspace_stays_within_the_budget() {
    use denoised_models::flux::stepper::{ModelStepper, Stepper};
    use denoised_models::profile::{Fit, Profile};

    let inputs = denoised_models::fixtures::e2e_denoise_inputs(&RefCase::open("e2e").unwrap());
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256).unwrap());
    let ring: Vec<bool> = (0..256).map(|i| i % 16 == 0 || i / 16 == 3).collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &ring).unwrap());
    let dt = Dt::Bf16;
    // With the attention library's stand-in, as a GPU with cuDNN runs: its scratch
    // (packed queries, K/V and output) is part of the workspace.
    let exec = EmuExec::with_capacity(u64::MAX).with_attn_library(usize::MAX);
    let m = FluxTransformer::load(
        GpuBackend::new(exec.clone(), dt),
        tiny_model_dir().join("transformer"),
    )
    .unwrap();
    let hidden = m.config.hidden();
    let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::BF16);
    let template_bytes = (layout.steps * layout.blocks * 256 * 2 * hidden * dt.size()) as u64;
    // Room for one template: a second one evicts the first.
    let mut st = ModelStepper::new(Arc::new(m), template_bytes, dt.size(), true);
    let mut next_id = 0;
    let mut run = |st: &mut ModelStepper<_>, mode: Mode| {
        next_id += 1;
        st.admit(next_id, &inputs, s.clone(), mode).unwrap();
        while !st.done(next_id) {
            st.step(&[next_id]).unwrap();
        }
        st.finish(next_id).unwrap()
    };
    let mut capture = |st: &mut ModelStepper<_>| {
        let mode = Mode::Capture(TemplateCache::new(layout).unwrap());
        Arc::new(run(st, mode).1.unwrap())
    };
    let (a, b) = (capture(&mut st), capture(&mut st));
    assert_eq!(st.template_bytes(&a), template_bytes);
    let edit = |cache: &Arc<TemplateCache>| Mode::Edit {
        mask: mask.clone(),
        cache: cache.clone(),
    };
    let cases: Vec<(&str, Vec<Mode>)> = vec![
        ("1 full", vec![Mode::Full]),
        ("4 full", (0..4).map(|_| Mode::Full).collect()),
        ("1 edit", vec![edit(&a)]),
        ("4 edits", (0..4).map(|_| edit(&a)).collect()),
    ];
    for (what, modes) in cases {
        let label = format!("{dt:?} {what}");
        step_within_bound(&mut st, &exec, &inputs, &s, modes, hidden, dt, &label);
    }
    // One template fits: editing `b` evicts `a`.
    assert_eq!(st.resident().count(), 1);
    let resident_b = run(&mut st, edit(&b)).0;
    let resident: Vec<_> = st.resident().collect();
    assert_eq!(resident.len(), 1);
    assert!(Arc::ptr_eq(resident[0], &b));

    // A device with room for less than one template streams it from its host memory
    // (page-locked once) and computes the same edit.
    let m = FluxTransformer::load(
        GpuBackend::new(exec.clone(), dt),
        tiny_model_dir().join("transformer"),
    )
    .unwrap();
    let mut small = ModelStepper::new(Arc::new(m), template_bytes - 1, dt.size(), true);
    // Loads priced free: every block reads its cache, as the resident run did (a full
    // prefix would recompute the inactive K/V, equal only to bf16 rounding).
    let mut free_loads = Profile::defaults("emu");
    free_loads.load_host = Fit::assumed(0.0, 0.0);
    small.set_profile(free_loads);
    assert_eq!(small.template_bytes(&b), 0, "streamed: no resident bytes");
    let pinned = exec.pinned_bytes();
    let streamed_b = run(&mut small, edit(&b)).0;
    assert_eq!(small.resident().count(), 0);
    assert!(
        exec.pinned_bytes() > pinned,
        "the template's memory was page-locked"
    );
    assert_eq!(streamed_b.max_abs_diff(&resident_b).unwrap(), 0.0);
    // Without streaming such a template is refused, with the figures.
    let m = FluxTransformer::load(
        GpuBackend::new(exec.clone(), dt),
        tiny_model_dir().join("transformer"),
    )
    .unwrap();
    let mut refusing = ModelStepper::new(Arc::new(m), template_bytes - 1, dt.size(), false);
    refusing.admit(1, &inputs, s.clone(), edit(&b)).unwrap();
    let e = refusing.step(&[1]).unwrap_err().to_string();
    assert!(e.contains("device budget leaves"), "{e}");
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_vae_matches_diffusers() {
    // With the stand-in convolution library, so the VAE runs both convolution paths:
    // the library's (as with cuDNN on a GPU) and im2col + GEMM.
    let exec = EmuExec::default().with_conv_library();
    let checks = selfcheck::vae(|| Ok(exec.clone())).unwrap();
    assert!(
        checks.iter().any(|c| c.name.ends_with("[im2col]")),
        "one path only"
    );
    assert!(
        exec.library_convs() > 0,
        "no convolution went to the library"
    );
    assert_all_pass(&checks);
}

#[test]
fn gpu_vae_matches_diffusers() {
    if let Err(e) = CudaExec::new(0) {
        skip(
            "gpu_transformer::gpu_vae_matches_diffusers",
            Need::Gpu,
            &e.to_string(),
        );
        return;
    }
    assert_all_pass(&selfcheck::vae(cuda0).unwrap());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_gpu_text_encoders_match_transformers() {
    assert_all_pass(&selfcheck::text_encoders(|| Ok(EmuExec::default())).unwrap());
}

#[test]
fn gpu_text_encoders_match_transformers() {
    if let Err(e) = CudaExec::new(0) {
        skip(
            "gpu_transformer::gpu_text_encoders_match_transformers",
            Need::Gpu,
            &e.to_string(),
        );
        return;
    }
    assert_all_pass(&selfcheck::text_encoders(cuda0).unwrap());
}

/// The stage memory budget (model-defs, which does not depend on the CUDA crate) uses
/// the image-op chunk and the cuDNN workspace cap of the GPU backend: one value each.
#[test]
fn stage_budget_uses_the_backends_workspace_constants() {
    use denoised_models::pipeline::stage_memory::{CONV_LIBRARY_BYTES, IMAGE_CHUNK_BYTES};
    assert_eq!(
        IMAGE_CHUNK_BYTES,
        denoised_cuda::IMAGE_WORKSPACE_BYTES as u64
    );
    assert_eq!(
        CONV_LIBRARY_BYTES,
        denoised_cuda::CUDNN_WORKSPACE_BYTES as u64
    );
}

/// The VAE workspace that a denoise worker's budget sets aside for the pre- and
/// postprocess workers on its GPU (`stage_memory::vae_workspace`) bounds what the
/// dense VAE really allocates: the emulated device's peak over its weights, encoding
/// and decoding a 96x128 image of the tiny VAE in bf16 (a 2048x2048 default image is
/// too slow for the emulator; the bound's terms scale with the pixels either way).
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_vae_workspace_stays_within_the_stage_bound() {
    use denoised_models::pipeline::stage_memory::vae_workspace;
    use denoised_models::vae::{AutoencoderKL, DenseVae};
    use denoised_runtime::Tensor;
    let cpu = AutoencoderKL::load(tiny_model_dir().join("vae")).unwrap();
    let exec = EmuExec::with_capacity(u64::MAX);
    let vae = DenseVae::new(Arc::new(GpuBackend::new(exec.clone(), Dt::Bf16)), &cpu).unwrap();
    let (h, w) = (96, 128);
    let (enc_bound, dec_bound) = vae_workspace(cpu.config(), h * w, 2);
    let image = Tensor::new([1, 3, h, w], vec![0.25; 3 * h * w]).unwrap();
    exec.reset_peak();
    let base = exec.in_use_bytes();
    vae.encode(&image).unwrap();
    let enc = exec.peak_bytes() - base;
    let f = cpu.config().vae_scale_factor();
    let z = Tensor::new([1, 16, h / f, w / f], vec![0.1; 16 * h * w / (f * f)]).unwrap();
    exec.reset_peak();
    vae.decode(&z).unwrap();
    let dec = exec.peak_bytes() - base;
    println!(
        "VAE workspace at {h}x{w}: encode {enc} of {enc_bound} bytes, decode {dec} of {dec_bound}"
    );
    assert!(enc <= enc_bound, "encode peak {enc} > bound {enc_bound}");
    assert!(dec <= dec_bound, "decode peak {dec} > bound {dec_bound}");
}

/// With fp8 weights a step also holds each GEMM input quantised to E4M3 and its scales
/// (per tensor: an amax reduction's partials; per channel: a scale per row). That scratch
/// is within the same workspace bound, measured as above for full steps and an edit.
#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_fp8_step_workspace_stays_within_the_budget() {
    use denoised_models::flux::stepper::{ModelStepper, Stepper};
    use denoised_runtime::fp8::Scaling;

    let inputs = denoised_models::fixtures::e2e_denoise_inputs(&RefCase::open("e2e").unwrap());
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 2, 256).unwrap());
    let ring: Vec<bool> = (0..256).map(|i| i % 16 == 0 || i / 16 == 3).collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &ring).unwrap());
    let dt = Dt::Bf16;
    for scaling in [Scaling::Tensor, Scaling::Channel] {
        let exec = EmuExec::with_capacity(u64::MAX).with_attn_library(usize::MAX);
        let be = GpuBackend::new(exec.clone(), dt).with_fp8_weights(Some(scaling));
        let m = FluxTransformer::load(be, tiny_model_dir().join("transformer")).unwrap();
        let forms = m.memory();
        assert!(
            forms.keys().any(|form| form.contains("fp8")),
            "{scaling:?}: {forms:?}"
        );
        let hidden = m.config.hidden();
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::BF16);
        let mut st = ModelStepper::new(Arc::new(m), u64::MAX / 4, dt.size(), true);
        st.admit(
            1,
            &inputs,
            s.clone(),
            Mode::Capture(TemplateCache::new(layout).unwrap()),
        )
        .unwrap();
        while !st.done(1) {
            st.step(&[1]).unwrap();
        }
        let cache = Arc::new(st.finish(1).unwrap().1.unwrap());
        let edit = Mode::Edit {
            mask: mask.clone(),
            cache: cache.clone(),
        };
        for (what, modes) in [
            ("1 full", vec![Mode::Full]),
            ("4 full", (0..4).map(|_| Mode::Full).collect()),
            ("1 edit", vec![edit]),
        ] {
            let label = format!("fp8 {scaling:?} {what}");
            step_within_bound(&mut st, &exec, &inputs, &s, modes, hidden, dt, &label);
        }
    }
}

/// Admits `modes` (requests of 256 image tokens) to `st`, steps once (templates become
/// resident), then checks the peak device allocation of a second step against the
/// budget's workspace bound for its rows and attended tokens.
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
#[allow(clippy::too_many_arguments)]
fn step_within_bound<S: denoised_models::flux::stepper::Stepper>(
    st: &mut S,
    exec: &EmuExec,
    inputs: &denoised_models::flux::edit::DenoiseInputs,
    s: &Arc<FlowMatchEuler>,
    modes: Vec<Mode>,
    hidden: usize,
    dt: Dt,
    label: &str,
) {
    let text = inputs.txt.rows();
    let ids: Vec<u64> = (0..modes.len() as u64).map(|i| 1000 + i).collect();
    let mut rows = 0;
    for (&id, mode) in ids.iter().zip(modes) {
        rows += text + st.admit(id, inputs, s.clone(), mode).unwrap();
    }
    let context = ids.len() * (text + 256);
    st.step(&ids).unwrap();
    exec.reset_peak();
    let before = exec.in_use_bytes();
    st.step(&ids).unwrap();
    let used = exec.peak_bytes() - before;
    let bound = workspace_bytes(hidden, dt.size(), rows, context);
    println!(
        "{label}: {rows} rows over {context} tokens: step workspace {used} B, budget bound \
         {bound} B ({:.2}x)",
        bound as f64 / used as f64
    );
    assert!(used <= bound, "{label}: {used} > {bound}");
    for id in ids {
        st.remove(id);
    }
}
