//! FLUX.1 Kontext instruction edits against diffusers' `FluxKontextPipeline` on the
//! tiny seeded Kontext directory (tests/fixtures/gen_kontext_fixtures.py): the
//! directory loads as a Kontext model, the reference image's latents, every step's
//! latents (the reference tokens ride in the sequence and are never stepped), the
//! float image and its PNG; and the same run with the transformer given as the BFL
//! single file of the same weights.
//!
//! Tolerances: the reference latents within 1e-5 of their largest magnitude (measured
//! below), step latents within 1e-5 of theirs (`fixtures::run_checked`), the float image
//! within 1e-4, the 8-bit image within 1 level.

use denoised_models::fixtures::{check_decoded, max_abs, run_checked};
use denoised_models::flux::edit::{Job, Mode};
use denoised_models::pipeline::fill::pack_latents;
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, PipelineKind, Timings};
use denoised_models::pipeline::image::{decode_image, decode_mask};
use denoised_models::pipeline::kontext::{kontext_sizes, InpaintImages};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::CpuBackend;

#[test]
fn instruction_edit_matches_diffusers_flux_kontext_pipeline() {
    let cases: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/kontext_cases.json")).unwrap(),
    )
    .unwrap();
    let case = &cases["cases"]["kontext_instruct"];
    let params = &case["params"];
    let steps = params["num_inference_steps"].as_u64().unwrap() as usize;
    let dir = fixtures_dir().join(case["model_dir"].as_str().unwrap());
    let fill = FluxFill::load(&ModelSource::dir(dir.clone()), CpuBackend::new()).unwrap();
    assert_eq!(
        fill.kind,
        PipelineKind::Kontext,
        "model_index.json names FluxKontextPipeline"
    );
    let f = SafetensorsFile::open(
        fixtures_dir()
            .join("cases")
            .join(case["file"].as_str().unwrap()),
    )
    .unwrap();
    let want = |name: &str| f.tensor_f32(name).unwrap();

    // Sizes as diffusers computed them: max_area 64^2, no auto-resize.
    let png = std::fs::read(fixtures_dir().join("cases/e2e_input.png")).unwrap();
    let image = decode_image(&png, &fill.limits).unwrap();
    let max_area = params["max_area"].as_u64().unwrap() as usize;
    let block = 2 * fill.vae_scale_factor();
    let (reference, output) = kontext_sizes(64, 64, max_area, block, false);
    assert_eq!((reference, output), ((64, 64), (64, 64)));

    let noise = want("noise");
    let packed = pack_latents(noise.data(), 16, 32, 32).unwrap();
    let opts = EditOptions {
        steps,
        guidance: params["guidance_scale"].as_f64().unwrap() as f32,
        max_sequence_length: params["max_sequence_length"].as_u64().unwrap() as usize,
        ..Default::default()
    };
    let noise = Noise {
        initial_latents: Some(packed),
        posterior_eps: None,
    };
    let prompt = cases["prompt"].as_str().unwrap();
    let prep = fill
        .prepare_kontext(
            &image,
            output,
            prompt,
            &opts,
            &noise,
            &mut Timings::default(),
        )
        .unwrap();
    let r = prep.inputs.reference.as_ref().unwrap();
    let (d, mx) = max_abs(r.latents.data(), want("image_latents").data());
    println!("reference latents: max abs diff {d:.2e} of {mx:.2}");
    assert!(d <= 1e-5 * mx, "reference latents: {d:.2e} of {mx:.2}");
    assert!(r.ids.data().chunks(3).all(|id| id[0] == 1.0));

    let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
    // The schedule is the noisy tokens' (256), not the sequence's (512).
    let schedule = FlowMatchEuler::new(&sc, steps, 256).unwrap();
    let (ds, _) = max_abs(&schedule.sigmas, want("sigmas").data());
    assert!(ds <= 1e-6, "sigmas differ by {ds:.2e}");
    for (label, fill) in [
        ("diffusers directory", fill),
        ("BFL single file", bfl(&dir)),
    ] {
        let m = fill.shared_transformer().unwrap();
        let job = Job::new(&m, &prep.inputs, schedule.clone(), Mode::Full).unwrap();
        assert_eq!(
            job.shape().active,
            512,
            "noisy and reference tokens computed"
        );
        let latents = run_checked(&m, job, &want("step_latents"), label);
        let raw = fill.decode_raw(&latents, 64, 64).unwrap();
        let png = "kontext_instruct_output.png";
        check_decoded(&raw, Some(&want("output")), png, label);
    }
}

#[test]
fn masked_edit_matches_diffusers_flux_kontext_inpaint_pipeline() {
    masked_case("kontext_inpaint", None);
}

/// With a separate reference image (`image_reference`, 48x80 on a 64x64 edit): the
/// reference tokens are its own, on its own grid; the hold still follows the image.
#[test]
fn masked_edit_with_a_separate_reference_matches_diffusers() {
    masked_case("kontext_inpaint_reference", Some("kontext_reference.png"));
}

fn masked_case(name: &str, reference: Option<&str>) {
    let cases: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/kontext_cases.json")).unwrap(),
    )
    .unwrap();
    let case = &cases["cases"][name];
    let params = &case["params"];
    let steps = params["num_inference_steps"].as_u64().unwrap() as usize;
    let dir = fixtures_dir().join(case["model_dir"].as_str().unwrap());
    let fill = FluxFill::load(&ModelSource::dir(dir), CpuBackend::new()).unwrap();
    let f = SafetensorsFile::open(
        fixtures_dir()
            .join("cases")
            .join(format!("{name}.safetensors")),
    )
    .unwrap();
    let want = |name: &str| f.tensor_f32(name).unwrap();
    let read = |name: &str| std::fs::read(fixtures_dir().join("cases").join(name)).unwrap();
    let image = decode_image(&read("e2e_input.png"), &fill.limits).unwrap();
    let mask = decode_mask(
        &read("e2e_mask.png"),
        64,
        64,
        &fill.limits,
        Default::default(),
    )
    .unwrap();
    let separate = reference.map(|r| decode_image(&read(r), &fill.limits).unwrap());
    let noise = want("noise");
    let opts = EditOptions {
        steps,
        guidance: params["guidance_scale"].as_f64().unwrap() as f32,
        max_sequence_length: params["max_sequence_length"].as_u64().unwrap() as usize,
        strength: params["strength"].as_f64().unwrap() as f32,
        ..Default::default()
    };
    let noise = Noise {
        initial_latents: Some(pack_latents(noise.data(), 16, 32, 32).unwrap()),
        posterior_eps: None,
    };
    let prompt = cases["prompt"].as_str().unwrap();
    let images = InpaintImages {
        image: &image,
        mask: &mask,
        reference: separate.as_ref(),
    };
    let (prep, start) = fill
        .prepare_kontext_inpaint(images, prompt, &opts, &noise, &mut Timings::default())
        .unwrap();
    assert_eq!(start, 1, "strength 0.75 of 4 steps starts at the second");
    let r = prep.inputs.reference.as_ref().unwrap();
    let held = &r.inpaint.as_ref().unwrap().image;
    let refs = match reference {
        Some(_) => want("reference_latents"),
        None => want("image_latents"),
    };
    for (what, got, want) in [
        ("reference latents", &r.latents, &refs),
        ("image latents", held, &want("image_latents")),
    ] {
        let (d, mx) = max_abs(got.data(), want.data());
        assert!(d <= 1e-5 * mx, "{name}: {what}: {d:.2e} of {mx:.2}");
    }
    let m = fill.shared_transformer().unwrap();
    let schedule = fill.schedule(steps, 64, 64).unwrap();
    let job = Job::new(&m, &prep.inputs, schedule, Mode::Full)
        .unwrap()
        .starting_at(start)
        .unwrap();
    assert_eq!(job.shape().image, 256 + r.latents.rows());
    let latents = run_checked(&m, job, &want("step_latents"), name);
    let raw = fill.decode_raw(&latents, 64, 64).unwrap();
    check_decoded(&raw, None, &format!("{name}_output.png"), name);
}

/// The Kontext directory with its transformer given as the BFL-layout single file of
/// the same weights (as BFL ships Kontext; gen_kontext_fixtures.py checked it gives
/// diffusers' image).
fn bfl(dir: &std::path::Path) -> FluxFill<CpuBackend> {
    let source = ModelSource::dir(dir.to_path_buf())
        .with_files(denoised_models::source::ComponentFiles {
            transformer: Some(fixtures_dir().join("formats/flux1-kontext-tiny.safetensors")),
            ..Default::default()
        })
        .unwrap();
    let fill = FluxFill::load(&source, CpuBackend::new()).unwrap();
    assert_eq!(fill.kind, PipelineKind::Kontext);
    fill
}

#[test]
fn a_fill_model_refuses_an_edit_without_a_mask() {
    let fill = FluxFill::load(&ModelSource::Builtin, CpuBackend::new()).unwrap();
    let image = denoised_models::pipeline::image::Rgb8 {
        width: 64,
        height: 64,
        data: vec![128; 64 * 64 * 3],
    };
    let Err(e) = fill.prepare_kontext(
        &image,
        (64, 64),
        "x",
        &EditOptions::default(),
        &Noise::default(),
        &mut Timings::default(),
    ) else {
        panic!("a Fill model took an instruction edit");
    };
    assert!(e.to_string().contains("needs a mask"), "{e}");
}
