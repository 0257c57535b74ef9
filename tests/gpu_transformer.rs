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

use denoised_cuda::{CudaExec, Dt, EmuExec, Exec, GpuBackend};
use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};

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

#[test]
fn emulated_gpu_transformer_matches_diffusers() {
    check(|| EmuExec);
}

#[test]
fn gpu_transformer_matches_diffusers() {
    if let Err(e) = CudaExec::new(0) {
        println!("skipping the GPU run: {e}");
        return;
    }
    check(|| CudaExec::new(0).unwrap());
}
