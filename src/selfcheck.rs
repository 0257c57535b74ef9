//! The Flux transformer on the GPU backend against diffusers' reference fixtures, and
//! the identity invariant on the device, as lists of [`Check`]s (the kernel-level
//! checks are `denoised_cuda::selfcheck`).
//!
//! Tolerances:
//! - f32 mode: the fixtures' own `suggested_atol`, exactly as the CPU backend;
//! - bf16 mode: max |diff| <= 3% of the output's largest magnitude, against the same
//!   f32 reference. Weights and every activation are stored in bf16 (8 bits of
//!   mantissa), through two double and one single block plus the embedders; this is
//!   the precision diffusers itself runs FLUX at.
//! - identity invariant (an edit with exactly a capture's inputs, its cached K/V on
//!   the device, gives the capture's final latent): f32 1e-5 relative, as on the CPU;
//!   bf16 2e-2 relative.
//!
//! The fixtures are found through `DENOISED_FIXTURES` or at this repository's
//! `tests/fixtures`.

use std::sync::Arc;

use denoised_cuda::selfcheck::Check;
use denoised_cuda::{Dt, Exec, GpuBackend, GpuTensor, StreamedTemplate};
use denoised_models::flux::edit::{
    step_batch_with, DenoiseInputs, Job, Mode, ResidentTemplates, SlabSource, TemplateProviders,
};
use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::{DType, Result};

const CASES: [&str; 4] = [
    "transformer_case1",
    "transformer_case2",
    "transformer_case3",
    "transformer_case4_generic_ids",
];
const BF16_REL_TOL: f64 = 3e-2;
const IDENTITY_TOL_F32: f64 = 1e-5;
const IDENTITY_TOL_BF16: f64 = 2e-2;

/// The transformer's output on every reference case, in f32 and bf16. `make` opens
/// the executor (one per dtype).
pub fn transformer<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    for dt in [Dt::F32, Dt::Bf16] {
        let m = FluxTransformer::load(
            GpuBackend::new(make()?, dt),
            tiny_model_dir().join("transformer"),
        )?;
        for key in CASES {
            let case = RefCase::open(key)?;
            let inputs = FluxInputs::from_file(case.file())?;
            let got = m.forward_inputs(&inputs, &mut NoObserver)?;
            let want = case.tensor("output");
            let got = got.reshape(want.shape().to_vec())?;
            let d = got.max_abs_diff(&want)? as f64;
            let name = format!("transformer {key} ({dt:?})");
            out.push(match dt {
                Dt::F32 => Check::within(
                    name,
                    "max abs diff",
                    d,
                    case.atol("output", Tier::Suggested) as f64,
                ),
                Dt::Bf16 => {
                    let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    Check::within(name, "max rel diff", d / scale, BF16_REL_TOL)
                }
            });
        }
    }
    Ok(out)
}

/// The diffusers end-to-end case's denoiser inputs (256 image tokens).
fn e2e_inputs() -> Result<DenoiseInputs> {
    Ok(denoised_models::fixtures::e2e_denoise_inputs(
        &RefCase::open("e2e")?,
    ))
}

fn run_to_end<E: Exec>(
    m: &FluxTransformer<GpuBackend<E>>,
    jobs: &mut [Job],
    slabs: &impl SlabSource<GpuTensor<E>>,
) -> Result<()> {
    while jobs.iter().any(|j| !j.done()) {
        let mut refs: Vec<&mut Job> = jobs.iter_mut().filter(|j| !j.done()).collect();
        step_batch_with(m, &mut refs, slabs)?;
    }
    Ok(())
}

/// The identity invariant on the device, in f32 and bf16: the template resident in
/// device memory, and streamed block by block through ping-pong buffers by two
/// requests at different steps of one batch.
pub fn identity<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let inputs = Arc::new(e2e_inputs()?);
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256)?);
    // An irregular mask: a ring, a diagonal band and holes.
    let tokens: Vec<bool> = (0..256)
        .map(|i| {
            let (r, c) = (i / 16, i % 16);
            (r == 0 || c == 15 || (r + 2 * c) % 7 == 0) && i % 5 != 0
        })
        .collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &tokens)?);
    for (dt, tol) in [(Dt::F32, IDENTITY_TOL_F32), (Dt::Bf16, IDENTITY_TOL_BF16)] {
        let m = FluxTransformer::load(
            GpuBackend::new(make()?, dt),
            tiny_model_dir().join("transformer"),
        )?;
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::F32);
        let mut resident = ResidentTemplates::new();
        let capture = Mode::Capture(Box::new(TemplateCache::new(layout)));
        let mut cap = [Job::new(inputs.clone(), s.clone(), capture)?];
        run_to_end(&m, &mut cap, &resident)?;
        let [cap] = cap;
        let (fin, cache) = cap.into_parts();
        let cache = Arc::new(cache.ok_or_else(|| {
            denoised_runtime::Error::Invalid("a capture returned no template".into())
        })?);
        let scale = fin.data().iter().fold(0f32, |a, v| a.max(v.abs()));
        let edit = || {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(inputs.clone(), s.clone(), mode)
        };
        let mut check = |what: &str, job: &Job| -> Result<()> {
            let d = job.latents().max_abs_diff(&fin)? / scale;
            out.push(Check::within(
                format!(
                    "identity, {what}, {} of 256 tokens ({dt:?})",
                    mask.active().len()
                ),
                "rel diff",
                d as f64,
                tol,
            ));
            Ok(())
        };

        resident.make_resident(m.backend(), &cache)?;
        let mut one = [edit()?];
        run_to_end(&m, &mut one, &resident)?;
        check("resident template", &one[0])?;

        // Streamed by two requests that share every forward at different steps (the
        // second starts one step later).
        let lay = cache.layout();
        let slabs = cache.kv_slabs()?;
        let streamed = StreamedTemplate::new(m.backend(), &slabs, lay.steps, lay.blocks, 2)?;
        let mut providers = TemplateProviders::new();
        providers.insert(&cache, Box::new(streamed));
        let mut first = edit()?;
        step_batch_with(&m, &mut [&mut first], &providers)?;
        let mut two = [first, edit()?];
        run_to_end(&m, &mut two, &providers)?;
        check("streamed, steps 0..3", &two[0])?;
        check("streamed, joining a step later", &two[1])?;
    }
    Ok(out)
}
