//! The text-to-image denoising loop (FluxPipeline: latents alone, no Fill conditioning)
//! against diffusers' fixtures for the tiny dev and schnell configs
//! (tests/fixtures/gen_t2i_fixtures.py): the same engine, transformer and scheduler as
//! the Fill path, every step's latents, the decoded image and its PNG; and the resume
//! fixture: another prompt continued from the first one's state after step K.
//!
//! Tolerances: latents within 1e-5 of their largest magnitude (measured 2e-6 / 3e-6 of ~6
//! after 6 / 4 steps; the transformer tests' strict tier is 2e-5 absolute per forward),
//! the float image within 1e-4, the 8-bit image within 1 level.

use std::sync::Arc;

use denoised_models::fixtures::{check_decoded, run_checked};
use denoised_models::flux::edit::{DenoiseInputs, Job, Mode};
use denoised_models::pipeline::flux_fill::{FluxFill, PipelineKind, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{CpuBackend, Tensor};

#[test]
fn text_to_image_loop_matches_diffusers_flux_pipeline() {
    let cases: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/t2i_cases.json")).unwrap(),
    )
    .unwrap();
    let prompt = cases["prompts"]["a"].as_str().unwrap();
    for variant in ["dev", "schnell"] {
        let case = &cases["cases"][format!("t2i_{variant}")];
        let params = &case["params"];
        let steps = params["num_inference_steps"].as_u64().unwrap() as usize;
        let guidance = params["guidance_scale"].as_f64().unwrap() as f32;
        let seq = params["max_sequence_length"].as_u64().unwrap() as usize;
        let dir = fixtures_dir().join(case["model_dir"].as_str().unwrap());
        // The pipeline directory as FluxPipeline saved it: its kind is read from the
        // transformer's channels; its encoders, tokenizers and VAE are the Fill
        // fixture's.
        let fill = FluxFill::load(&ModelSource::dir(dir.clone()), CpuBackend::new()).unwrap();
        assert_eq!(fill.kind, PipelineKind::TextToImage);
        let m = fill.shared_transformer().unwrap();
        let m = &*m;
        assert_eq!(m.config.guidance_embeds, variant == "dev");
        let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
        let schedule = FlowMatchEuler::new(&sc, steps, 256).unwrap();
        let f = SafetensorsFile::open(
            fixtures_dir()
                .join("cases")
                .join(case["file"].as_str().unwrap()),
        )
        .unwrap();
        let want = |name: &str| f.tensor_f32(name).unwrap();
        let opts = GenerateOptions {
            steps,
            guidance,
            seed: 0,
            max_sequence_length: seq,
            width: 64,
            height: 64,
        };
        let inputs = fill
            .prepare_generate(
                prompt,
                &opts,
                Some(&want("initial_latents")),
                &mut Timings::default(),
            )
            .unwrap()
            .inputs;
        assert_eq!(inputs.cond.shape(), &[256, 0], "no Fill conditioning");
        let job = Job::new(m, &inputs, schedule, Mode::Full).unwrap();
        let latents = run_checked(m, job, &want("step_latents"), variant);
        let raw = fill.decode_raw(&latents, 64, 64).unwrap();
        let png = format!("t2i_{variant}_output.png");
        check_decoded(&raw, Some(&want("output")), &png, variant);

        // The resume fixture: prompt B from prompt A's state after step k, on the rest of
        // the same schedule (what an approximate-cache hit at k computes).
        let k = case["resume"]["k"].as_u64().unwrap() as usize;
        let prompt_b = cases["prompts"]["b"].as_str().unwrap();
        let (txt, pooled, _) = fill
            .encode_prompt(prompt_b, seq, &mut Timings::default())
            .unwrap();
        let resumed = DenoiseInputs {
            latents: Tensor::new([256, 64], want("resume_from").into_data()).unwrap(),
            txt,
            pooled,
            ..inputs
        };
        let schedule = Arc::new(FlowMatchEuler::new(&sc, steps, 256).unwrap());
        let past_the_end = Job::new(m, &resumed, schedule.clone(), Mode::Full).unwrap();
        assert!(
            past_the_end.starting_at(steps).is_err(),
            "a resume leaves a step"
        );
        let job = Job::new(m, &resumed, schedule, Mode::Full)
            .unwrap()
            .starting_at(k)
            .unwrap();
        let label = format!("{variant} resumed at {k}");
        let latents = run_checked(m, job, &want("resume_step_latents"), &label);
        let raw = fill.decode_raw(&latents, 64, 64).unwrap();
        check_decoded(
            &raw,
            None,
            &format!("t2i_{variant}_resume_output.png"),
            &label,
        );
    }
}
