//! The Flux transformer and the VAE on the GPU backend against diffusers' reference
//! fixtures, and the identity invariant on the device, as lists of [`Check`]s (the kernel-level
//! checks are `denoised_cuda::selfcheck`).
//!
//! Tolerances:
//! - f32 mode: the fixtures' own `suggested_atol`, exactly as the CPU backend;
//! - bf16 mode: max |diff| <= 3% of the output's largest magnitude, against the same
//!   f32 reference. Weights and every activation are stored in bf16 (8 bits of
//!   mantissa), through two double and one single block plus the embedders; this is
//!   the precision diffusers itself runs FLUX at.
//! - VAE, f32 mode: the fixtures' `strict_atol` (the CPU reference meets it too);
//!   bf16 mode: max |diff| <= 3% of the output's largest magnitude, the transformer's
//!   bound: every activation is stored in bf16 (2^-9 relative rounding each) through
//!   about twenty convolutions and GroupNorms per half, so errors of 1e-2 are expected
//!   (the emulator measures 0.7-1.4%); a misread patch or a wrong group gives O(1).
//! - text encoders (CLIP, T5): as the VAE, strict atol in f32 and 3% in bf16 (every
//!   activation stored in bf16 through 2-24 pre-norm blocks).
//! - identity invariant (an edit with exactly a capture's inputs, its cached K/V on
//!   the device, gives the capture's final latent): f32 1e-5 relative, as on the CPU;
//!   bf16 2e-2 relative.
//!
//! The fixtures are found through `DENOISED_FIXTURES` or at this repository's
//! `tests/fixtures`.

use std::sync::Arc;

use denoised_cuda::selfcheck::Check;
use denoised_cuda::{Dt, Exec, GpuBackend};
use denoised_models::flux::edit::{
    run_to_end, step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode,
};
use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::flux::template::{CacheMode, TemplateCache, TemplateLayout};
use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::planner::{prefix, Choice};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::text::device::{ClipOn, T5On};
use denoised_models::text::{ClipTextModel, T5Encoder};
use denoised_models::vae::{AutoencoderKL, DenseVae};
use denoised_models::FluxTransformer;
use denoised_runtime::fixtures::{tiny_model_dir, RefCase, Tier};
use denoised_runtime::{Backend, DType, Error, Result, Tensor};

const CASES: [&str; 4] = [
    "transformer_case1",
    "transformer_case2",
    "transformer_case3",
    "transformer_case4_generic_ids",
];
const BF16_REL_TOL: f64 = 3e-2;
/// The VAE's and the text encoders' bf16 bound (see the module comment).
const VAE_BF16_REL_TOL: f64 = 3e-2;
const IDENTITY_TOL_F32: f64 = 1e-5;
const IDENTITY_TOL_BF16: f64 = 2e-2;
/// An fp8 template's edit against its capture: each cached K and V is within 2^-4 of
/// itself; the CPU measures about 1e-3 on this case (`mask_aware.rs`), and 1e-2 still
/// catches a misread byte or scale (those give O(1) errors).
const FP8_TOL: f64 = 1e-2;

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

/// The dense VAE (both halves) on every reference case, in f32 and bf16. `make`
/// opens the executor (one per dtype).
pub fn vae<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let cpu = AutoencoderKL::load(tiny_model_dir().join("vae"))?;
    let mut out = Vec::new();
    // Where the executor has a convolution library (cuDNN), both convolution paths.
    let paths: &[bool] = if make()?.conv_library().is_some() {
        &[false, true]
    } else {
        &[false]
    };
    for (dt, &im2col_only) in [Dt::F32, Dt::Bf16]
        .iter()
        .flat_map(|d| paths.iter().map(move |p| (*d, p)))
    {
        let mut gpu = GpuBackend::new(make()?, dt);
        if im2col_only {
            gpu = gpu.im2col_only();
        }
        let path = if im2col_only { " [im2col]" } else { "" };
        let m = DenseVae::new(Arc::new(gpu), &cpu)?;
        for key in ["vae_case1", "vae_case2"] {
            let case = RefCase::open(key)?;
            let (mean, logvar) = m.encode(&case.tensor("image"))?;
            let decoded = m.decode(&case.tensor("decode_input"))?;
            for (name, got) in [
                ("latent_mean", mean),
                ("latent_logvar", logvar),
                ("decoded", decoded),
            ] {
                let want = case.tensor(name);
                let label = format!("vae {key} {name} ({dt:?}){path}");
                out.push(compare(
                    &label,
                    dt,
                    &got,
                    &want,
                    case.atol(name, Tier::Strict),
                ));
            }
        }
        if !im2col_only {
            out.extend(sparse_vae(&cpu, &m, dt)?);
        }
    }
    Ok(out)
}

/// Bound of the device's sparse VAE pass against the CPU's in f32, relative to the
/// output's largest magnitude: the same values in another summation order (and the
/// mid block's attention dense on the device), measured at about 1e-6 on the emulator;
/// a misplaced pixel, tap or group is O(1).
const SPARSE_VAE_F32_REL_TOL: f64 = 1e-4;

/// The device's sparse VAE passes (SIGE's gather, GEMM and scatter, and the GroupNorm
/// sums' deltas), against a trace the device recorded, against the CPU's tile-based
/// ones on the same plan and the CPU's trace: an edit of a disk of a seeded template
/// image and latent, through each half, under the serving modes (encoder: local regions
/// and frozen statistics; decoder: local and incremental) and SIGE's dilated regions,
/// whose tiles are computed whole. And the CPU's pass against the device's trace.
fn sparse_vae<B: Backend>(cpu: &AutoencoderKL, dev: &DenseVae<B>, dt: Dt) -> Result<Vec<Check>> {
    use denoised_models::vae::sparse::{Half, RegionMode, SparseOpts, StatsMode};
    let noise = |shape: [usize; 4], seed: u64| {
        let mut r = SplitMix::new(seed);
        let n = shape.iter().product();
        Tensor::new(shape, (0..n).map(|_| r.uniform() * 2.0 - 1.0).collect())
    };
    let disk = |h: usize, w: usize, r: f32| -> Vec<bool> {
        let (cy, cx) = (h as f32 * 0.4, w as f32 * 0.55);
        (0..h * w)
            .map(|i| ((i / w) as f32 - cy).powi(2) + ((i % w) as f32 - cx).powi(2) <= r * r)
            .collect()
    };
    let f = cpu.config().vae_scale_factor();
    let lc = cpu.config().latent_channels;
    let (h, w) = (48, 40);
    let image = noise([1, 3, h, w], 1)?;
    let latent = noise([1, lc, h / f, w / f], 2)?;
    let mut out = Vec::new();
    for (half, template, diff, keep) in [
        (
            Half::Encoder,
            &image,
            disk(h, w, 7.0),
            disk(h / f, w / f, 3.0),
        ),
        (
            Half::Decoder,
            &latent,
            disk(h / f, w / f, 3.0),
            disk(h, w, 6.0),
        ),
    ] {
        let trace = match half {
            Half::Encoder => cpu.trace_encode(template)?,
            Half::Decoder => cpu.trace_decode(template)?,
        };
        // The device records its own trace, as a capture on a device does.
        let dev_trace = dev.trace(cpu, half, template)?;
        let on_device = dev.upload_trace(&dev_trace)?;
        let mut edited = template.clone();
        let plane = diff.len();
        let fresh = noise(*<&[usize; 4]>::try_from(template.shape()).expect("4-D"), 3)?;
        for (i, v) in edited.data_mut().iter_mut().enumerate() {
            if diff[i % plane] {
                *v = fresh.data()[i];
            }
        }
        let shape = [edited.shape()[1], edited.shape()[2], edited.shape()[3]];
        for (region, stats) in [
            (RegionMode::Local, StatsMode::Frozen),
            (RegionMode::Local, StatsMode::Incremental),
            (RegionMode::Dilated(1), StatsMode::Frozen),
        ] {
            let opts = SparseOpts {
                region,
                stats,
                tile: 8,
                crop: false,
            };
            let plan = cpu.plan_sparse(half, shape, &diff, &keep, opts)?;
            let want = cpu.run_sparse(&plan, &edited, &trace)?;
            let label = format!(
                "sparse vae {half:?} {region}/{stats} ({dt:?}, {:.0}% of the MACs)",
                100.0 * plan.report.fraction()
            );
            let got = dev.run_sparse(&plan, &edited, &on_device)?;
            out.push(sparse_check(label.clone(), dt, &got, &want));
            // The device-recorded trace read by the CPU's pass: its sums and the
            // attention's K and V (which only the CPU pass reads) are the CPU's too.
            let got = cpu.run_sparse(&plan, &edited, &dev_trace)?;
            out.push(sparse_check(format!("{label} [CPU pass]"), dt, &got, &want));
        }
    }
    Ok(out)
}

/// CLIP and T5 on every prompt of the reference case, in f32 and bf16, at the VAE's
/// bounds (strict atol in f32; 3% of the largest magnitude in bf16). `make` opens the
/// executor (one per dtype).
pub fn text_encoders<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let dir = tiny_model_dir();
    let clip = Arc::new(ClipTextModel::load(dir.join("text_encoder"))?);
    let t5 = Arc::new(T5Encoder::load(dir.join("text_encoder_2"))?);
    let case = RefCase::open("text_encoders")?;
    let ids = |name: &str| case.file().tensor_i64(name);
    let (clip_ids, t5_ids) = (ids("clip_input_ids")?, ids("t5_input_ids")?);
    let prompts = case.tensor("clip_pooled").shape()[0];
    let mut out = Vec::new();
    for dt in [Dt::F32, Dt::Bf16] {
        let backend = Arc::new(GpuBackend::new(make()?, dt));
        let c = ClipOn::new(backend.clone(), clip.clone())?;
        let t = T5On::new(backend, t5.clone())?;
        let (mut hidden, mut pooled, mut t5_hidden) = (Vec::new(), Vec::new(), Vec::new());
        for row in clip_ids.chunks_exact(clip_ids.len() / prompts) {
            let (h, p) = c.forward(row)?;
            hidden.extend_from_slice(h.data());
            pooled.extend_from_slice(&p);
        }
        for row in t5_ids.chunks_exact(t5_ids.len() / prompts) {
            t5_hidden.extend_from_slice(t.forward(row)?.data());
        }
        for (name, got) in [
            ("clip_last_hidden_state", hidden),
            ("clip_pooled", pooled),
            ("t5_last_hidden_state", t5_hidden),
        ] {
            let want = case.tensor(name);
            let got = denoised_runtime::Tensor::new(want.shape().to_vec(), got)?;
            out.push(compare(
                &format!("{name} ({dt:?})"),
                dt,
                &got,
                &want,
                case.atol(name, Tier::Strict),
            ));
        }
    }
    Ok(out)
}

/// `got` against `want`: max abs diff within `atol` in f32, max diff within
/// [`VAE_BF16_REL_TOL`] of the largest magnitude in bf16.
fn compare(
    name: &str,
    dt: Dt,
    got: &denoised_runtime::Tensor,
    want: &denoised_runtime::Tensor,
    atol: f32,
) -> Check {
    let d = match got.max_abs_diff(want) {
        Ok(d) => d as f64,
        Err(e) => return Check::fail(name.into(), e.to_string()),
    };
    match dt {
        Dt::F32 => Check::within(name.into(), "max abs diff", d, atol as f64),
        Dt::Bf16 => {
            let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            Check::within(name.into(), "max rel diff", d / scale, VAE_BF16_REL_TOL)
        }
    }
}

fn sparse_check(label: String, dt: Dt, got: &Tensor, want: &Tensor) -> Check {
    match dt {
        Dt::F32 => {
            let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            match got.max_abs_diff(want) {
                Ok(d) => Check::within(
                    label,
                    "max rel diff",
                    d as f64 / scale,
                    SPARSE_VAE_F32_REL_TOL,
                ),
                Err(e) => Check::fail(label, e.to_string()),
            }
        }
        Dt::Bf16 => compare(&label, dt, got, want, 0.0),
    }
}

/// The diffusers end-to-end case's denoiser inputs (256 image tokens).
fn e2e_inputs() -> Result<DenoiseInputs> {
    Ok(denoised_models::fixtures::e2e_denoise_inputs(
        &RefCase::open("e2e")?,
    ))
}

/// The identity invariant on the device, in f32 and bf16: the template captured on
/// the device (its K/V stored asynchronously into host memory), then read resident in
/// device memory, and streamed block by block through ping-pong buffers by two
/// requests at different steps of one batch.
pub fn identity<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let inputs = e2e_inputs()?;
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
        let storage = m.backend().storage_dtype();
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), storage);
        let capture = Mode::Capture(TemplateCache::new(layout)?);
        let job = Job::new(&m, &inputs, s.clone(), capture)?;
        let (fin, cache) = run_to_end(&m, job, &DeviceTemplates::new())?;
        let cache =
            Arc::new(cache.ok_or_else(|| Error::Invalid("a capture returned no template".into()))?);
        let scale = fin.data().iter().fold(0f32, |a, v| a.max(v.abs()));
        let edit = || {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(&m, &inputs, s.clone(), mode)
        };
        let mut check = |what: &str, latent: &denoised_runtime::Tensor| -> Result<()> {
            let d = latent.max_abs_diff(&fin)? / scale;
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

        let resident = DeviceTemplates::resident(m.backend(), &[&cache])?;
        check("resident template", &run_to_end(&m, edit()?, &resident)?.0)?;

        // Streamed by two requests that share every forward at different steps (the
        // second starts one step later), under plans whose full prefix changes from
        // step to step (the slabs of a prefix's blocks are not loaded).
        let mut streamed = DeviceTemplates::new();
        if !streamed.stream(m.backend(), &cache, 2)? {
            return Err(Error::Invalid(
                "the device backend cannot stream templates".into(),
            ));
        }
        let blocks = m.num_blocks();
        let mut first = edit()?;
        step_batch_with(&m, &mut [&mut first], &streamed, &prefix(blocks, 0))?;
        let mut second = edit()?;
        let mut call = 1;
        while !(first.done() && second.done()) {
            let mut refs: Vec<&mut Job<_>> = [&mut first, &mut second]
                .into_iter()
                .filter(|j| !j.done())
                .collect();
            step_batch_with(
                &m,
                &mut refs,
                &streamed,
                &prefix(blocks, call % (blocks + 1)),
            )?;
            call += 1;
        }
        check(
            "streamed with full prefixes, steps 0..3",
            &first.finish(&m)?.0,
        )?;
        check("streamed, joining a step later", &second.finish(&m)?.0)?;

        // A Y-mode template (block outputs; the inactive tokens' K/V recomputed on
        // the device), resident and streamed, under patterns of cached and full
        // blocks that are not prefixes and change every step.
        let layout = layout.with_mode(CacheMode::Y);
        let capture = Mode::Capture(TemplateCache::new(layout)?);
        let job = Job::new(&m, &inputs, s.clone(), capture)?;
        let cache = run_to_end(&m, job, &DeviceTemplates::new())?
            .1
            .ok_or_else(|| Error::Invalid("a capture returned no template".into()))?;
        let cache = Arc::new(cache);
        let edit = || {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(&m, &inputs, s.clone(), mode)
        };
        let every_third = |call: usize| -> Vec<Choice> {
            (0..blocks)
                .map(|b| match (b + call) % 3 {
                    0 => Choice::Full,
                    _ => Choice::Cached,
                })
                .collect()
        };
        let resident = DeviceTemplates::resident(m.backend(), &[&cache])?;
        let mut streamed = DeviceTemplates::new();
        streamed.stream(m.backend(), &cache, 1)?;
        for (what, src) in [("resident", &resident), ("streamed", &streamed)] {
            let mut j = edit()?;
            let mut call = 0;
            while !j.done() {
                step_batch_with(&m, &mut [&mut j], src, &every_third(call))?;
                call += 1;
            }
            check(
                &format!("Y-mode template {what}, changing patterns"),
                &j.finish(&m)?.0,
            )?;
        }

        // An fp8 template (K/V in E4M3, a scale per head: quantised as the capture
        // stores them, read as they are by the attention kernel), resident and
        // streamed: equal to each other, and within the fp8 bound of the capture.
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), DType::F8E4M3);
        let job = Job::new(
            &m,
            &inputs,
            s.clone(),
            Mode::Capture(TemplateCache::new(layout)?),
        )?;
        let cache = Arc::new(
            run_to_end(&m, job, &DeviceTemplates::new())?
                .1
                .ok_or_else(|| Error::Invalid("a capture returned no template".into()))?,
        );
        let edit = || {
            let mode = Mode::Edit {
                mask: mask.clone(),
                cache: cache.clone(),
            };
            Job::new(&m, &inputs, s.clone(), mode)
        };
        let resident = DeviceTemplates::resident(m.backend(), &[&cache])?;
        let mut streamed = DeviceTemplates::new();
        streamed.stream(m.backend(), &cache, 1)?;
        let a = run_to_end(&m, edit()?, &resident)?.0;
        let b = run_to_end(&m, edit()?, &streamed)?.0;
        out.push(Check::within(
            format!("fp8 template, resident vs streamed ({dt:?})"),
            "max abs diff",
            a.max_abs_diff(&b)? as f64,
            0.0,
        ));
        out.push(Check::within(
            format!("fp8 template vs the capture ({dt:?})"),
            "rel diff",
            (a.max_abs_diff(&fin)? / scale) as f64,
            tol.max(FP8_TOL),
        ));
    }
    Ok(out)
}

/// LoRAs on the device (docs/design.md §Adapters), in f32 and bf16, on the tiny FLUX.1-dev
/// transformer with the fixture LoRAs (tests/fixtures/loras): unmerged in a batch that
/// mixes sets (the base, `style` 0.8, `style` 0.7 + `detail` 1.3), and merged, each
/// against the CPU backend's unmerged run of the same request. Bounds: the identity
/// check's (f32 1e-5 relative, bf16 2e-2 relative to the largest latent).
pub fn lora<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    use denoised_models::flux::adapters::LoraUse;
    use denoised_models::flux::lora::LoraFile;
    use denoised_models::flux::weights::SplitMix;
    use denoised_runtime::{Backend, CpuBackend, Tensor};

    let fx = denoised_runtime::fixtures::fixtures_dir();
    let dir = fx.join("flux-dev-tiny/transformer");
    let cases =
        denoised_runtime::weights::SafetensorsFile::open(fx.join("cases/lora_dev.safetensors"))?;
    let latents = cases.tensor_f32("initial_latents")?.reshape([256, 64])?;
    // Seeded text conditioning: the check is of the transformer, not the encoders.
    let mut rng = SplitMix::new(31);
    let mut randn = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    let ids: Vec<f32> = (0..256)
        .flat_map(|i| [0.0, (i / 16) as f32, (i % 16) as f32])
        .collect();
    let inputs = DenoiseInputs {
        latents,
        cond: Tensor::zeros([256, 0]),
        img_ids: Tensor::new([256, 3], ids)?,
        txt: Tensor::new([32, 32], randn(32 * 32))?,
        txt_ids: Tensor::zeros([32, 3]),
        pooled: randn(32),
        guidance: 3.5,
        reference: None,
    };
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256)?);

    // Runs the sets in one batch on `m` (ids from `register`), returning final latents.
    fn run_sets<B: Backend>(
        m: &FluxTransformer<B>,
        inputs: &DenoiseInputs,
        s: &Arc<FlowMatchEuler>,
        sets: &[Vec<LoraUse>],
    ) -> Result<Vec<denoised_runtime::Tensor>> {
        let mut jobs = sets
            .iter()
            .map(|set| {
                let mut j = Job::new(m, inputs, s.clone(), Mode::Full)?;
                j.set_loras(set.clone());
                Ok(j)
            })
            .collect::<Result<Vec<_>>>()?;
        let plan = prefix(m.num_blocks(), 0);
        while !jobs[0].done() {
            let mut refs: Vec<&mut Job<B::Tensor>> = jobs.iter_mut().collect();
            step_batch_with(m, &mut refs, &DeviceTemplates::new(), &plan)?;
        }
        jobs.into_iter().map(|j| Ok(j.finish(m)?.0)).collect()
    }
    fn sets<B: Backend>(m: &FluxTransformer<B>, files: &[LoraFile]) -> Result<Vec<Vec<LoraUse>>> {
        let (a, b) = (m.add_lora(&files[0])?, m.add_lora(&files[1])?);
        let u = |id, scale| LoraUse { id, scale };
        Ok(vec![vec![], vec![u(a, 0.8)], vec![u(a, 0.7), u(b, 1.3)]])
    }
    const NAMES: [&str; 3] = ["base", "style 0.8", "style 0.7 + detail 1.3"];

    let cpu = FluxTransformer::load(CpuBackend::new(), &dir)?;
    let files = ["style", "detail"]
        .map(|n| LoraFile::open(fx.join("loras").join(n), &cpu.config))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let want = run_sets(&cpu, &inputs, &s, &sets(&cpu, &files)?)?;
    let mut out = Vec::new();
    for (dt, tol) in [(Dt::F32, IDENTITY_TOL_F32), (Dt::Bf16, IDENTITY_TOL_BF16)] {
        let m = FluxTransformer::load(GpuBackend::new(make()?, dt), &dir)?;
        let got = run_sets(&m, &inputs, &s, &sets(&m, &files)?)?;
        let mut check = |what: String, got: &Tensor, want: &Tensor| -> Result<()> {
            let scale = want.data().iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = got.max_abs_diff(want)? / scale;
            out.push(Check::within(what, "rel diff", d as f64, tol));
            Ok(())
        };
        for ((name, g), w) in NAMES.iter().zip(&got).zip(&want) {
            check(
                format!("LoRA unmerged in a mixed batch, {name} ({dt:?})"),
                g,
                w,
            )?;
        }
        let base = run_sets(&m, &inputs, &s, &[vec![]])?.remove(0);
        for (i, set) in [
            vec![(&files[0], 0.8)],
            vec![(&files[0], 0.7), (&files[1], 1.3)],
        ]
        .iter()
        .enumerate()
        {
            m.merge_loras(set)?;
            let merged = run_sets(&m, &inputs, &s, &[vec![]])?.remove(0);
            check(
                format!("LoRA merged, {} ({dt:?})", NAMES[i + 1]),
                &merged,
                &want[i + 1],
            )?;
        }
        m.unmerge()?;
        let again = run_sets(&m, &inputs, &s, &[vec![]])?.remove(0);
        let d = again.max_abs_diff(&base)?;
        out.push(Check::within(
            format!("LoRA merged then unmerged: the base, bit for bit ({dt:?})"),
            "max abs diff",
            d as f64,
            0.0,
        ));
    }
    Ok(out)
}

/// ControlNets and true CFG on a template edit on the device (docs/design.md §Adapters), in
/// f32 and bf16, through the stepper as the daemon's denoise workers run them: a KV
/// template of the e2e case captured on the device, then an edit of an irregular mask
/// with the two fixture ControlNets (residuals of its active rows only, computed on the
/// host) and one with true CFG (the negative branch against the same template), each
/// against the CPU backend's run of the same. Bounds: the identity check's.
pub fn edit_adapters<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    use denoised_models::flux::control_feed::{ControlInputs, ControlUse, LocalControl};
    use denoised_models::flux::controlnet::ControlNet;
    use denoised_models::flux::edit::TrueCfg;
    use denoised_models::flux::stepper::{ModelStepper, Stepper};
    use denoised_models::flux::weights::SplitMix;
    use denoised_runtime::{Backend, CpuBackend, Tensor};

    let fx = denoised_runtime::fixtures::fixtures_dir();
    let inputs = e2e_inputs()?;
    let s = Arc::new(FlowMatchEuler::new(&SchedulerConfig::default(), 3, 256)?);
    let tokens: Vec<bool> = (0..256).map(|i| (i / 16 + i % 16) % 3 == 0).collect();
    let mask = Arc::new(TokenMask::from_tokens(16, 16, &tokens)?);
    // Seeded control latents and negative prompt: the check is of the denoise path.
    let mut rng = SplitMix::new(17);
    let mut randn = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    let controls = [randn(256 * 64), randn(256 * 64)];
    let cfg = TrueCfg {
        txt: Tensor::new([5, inputs.txt.cols()], randn(5 * inputs.txt.cols()))?,
        txt_ids: Tensor::zeros([5, 3]),
        pooled: randn(inputs.pooled.len()),
        scale: 3.0,
    };
    let feed = || -> Result<Arc<LocalControl>> {
        let uses = [("canny-tiny", 0.9), ("depth-tiny", 0.6)]
            .iter()
            .zip(&controls)
            .map(|(&(n, scale), c)| {
                Ok(ControlUse {
                    net: Arc::new(ControlNet::load(
                        CpuBackend::new(),
                        fx.join("controlnets").join(n),
                    )?),
                    control: Tensor::new([256, 64], c.clone())?,
                    scale,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ci = ControlInputs::new(&inputs, &s).keeping(mask.active().to_vec());
        LocalControl::new(uses, ci)?
            .map(Arc::new)
            .ok_or_else(|| Error::Invalid("no ControlNet with a nonzero scale".into()))
    };
    /// The two edits' final latents on `m`.
    fn run<B: Backend + 'static>(
        (m, storage): (FluxTransformer<B>, DType),
        (inputs, s, mask): (&DenoiseInputs, &Arc<FlowMatchEuler>, &Arc<TokenMask>),
        cfg: &TrueCfg,
        feed: &dyn Fn() -> Result<Arc<LocalControl>>,
    ) -> Result<[Tensor; 2]>
    where
        B::Tensor: Send + Sync,
    {
        let layout = TemplateLayout::for_model(&m.config, 256, s.steps(), storage);
        let mut st = ModelStepper::unbounded(Arc::new(m), 4);
        let to_end = |st: &mut ModelStepper<B>, id| -> Result<_> {
            while !st.done(id) {
                st.step(&[id])?;
            }
            st.finish(id)
        };
        st.admit(
            0,
            inputs,
            s.clone(),
            Mode::Capture(TemplateCache::new(layout)?),
        )?;
        let cache = to_end(&mut st, 0)?
            .1
            .ok_or_else(|| Error::Invalid("a capture returned no template".into()))?;
        let cache = Arc::new(cache);
        let edit = || Mode::Edit {
            mask: mask.clone(),
            cache: cache.clone(),
        };
        st.admit(1, inputs, s.clone(), edit())?;
        st.set_control_feed(1, feed()?)?;
        let controlled = to_end(&mut st, 1)?.0;
        st.admit(2, inputs, s.clone(), edit())?;
        st.set_true_cfg(2, inputs, cfg)?;
        Ok([controlled, to_end(&mut st, 2)?.0])
    }
    let dir = tiny_model_dir().join("transformer");
    let args = (&inputs, &s, &mask);
    let cpu = FluxTransformer::load(CpuBackend::new(), &dir)?;
    let want = run((cpu, DType::F32), args, &cfg, &feed)?;
    let mut out = Vec::new();
    for (dt, tol) in [(Dt::F32, IDENTITY_TOL_F32), (Dt::Bf16, IDENTITY_TOL_BF16)] {
        let m = FluxTransformer::load(GpuBackend::new(make()?, dt), &dir)?;
        let storage = m.backend().storage_dtype();
        let got = run((m, storage), args, &cfg, &feed)?;
        for ((what, g), w) in ["ControlNets", "true CFG"].iter().zip(&got).zip(&want) {
            let scale = w.data().iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = g.max_abs_diff(w)? / scale;
            out.push(Check::within(
                format!("template edit with {what} vs the CPU ({dt:?})"),
                "rel diff",
                d as f64,
                tol,
            ));
        }
    }
    Ok(out)
}
