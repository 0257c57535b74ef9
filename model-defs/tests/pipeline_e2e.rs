//! The whole FLUX.1 Fill pipeline against diffusers' end-to-end case: image and mask
//! PNGs and the prompt in, with the case's noise, paste-back off; every intermediate
//! the case stores, every per-step latent, the decoder output and the final 8-bit image.

use denoised_models::flux::edit::{run_to_end, step_batch_with, DeviceTemplates, Job, Mode};
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Timings};
use denoised_models::pipeline::image::{decode_image, decode_mask, from_model_space};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::{fixtures_dir, tiny_model_dir, RefCase, Tier};
use denoised_runtime::{CpuBackend, Tensor};

fn read(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join("cases").join(name)).unwrap()
}

fn cols(t: &Tensor, range: std::ops::Range<usize>) -> Tensor {
    let data = (0..t.rows())
        .flat_map(|r| t.row(r)[range.clone()].to_vec())
        .collect();
    Tensor::new([t.rows(), range.len()], data).unwrap()
}

#[test]
fn end_to_end_matches_diffusers() {
    let case = RefCase::open("e2e").unwrap();
    let mut p = FluxFill::load(&ModelSource::dir(tiny_model_dir()), CpuBackend::new()).unwrap();
    // Torch's own sinusoid frequencies, so the strict tier applies (see the
    // transformer tests); the suggested tier holds without them too.
    p.transformer_mut()
        .unwrap()
        .set_time_proj_freqs(
            RefCase::open("transformer_case1")
                .unwrap()
                .tensor("time_proj_freqs")
                .into_data(),
        )
        .unwrap();
    let prompt = case.params["prompt"].as_str().unwrap();
    let image = decode_image(&read("e2e_input.png"), &p.limits).unwrap();
    let mask = decode_mask(&read("e2e_mask.png"), 64, 64, &p.limits, Default::default()).unwrap();
    let opts = EditOptions {
        steps: 4,
        guidance: 30.0,
        max_sequence_length: 32,
        paste_back: false,
        ..Default::default()
    };
    let noise = Noise {
        initial_latents: Some(case.tensor("initial_latents")),
        posterior_eps: Some(case.tensor("posterior_eps")),
    };
    let mut t = Timings::default();
    let prep = p
        .prepare(&image, &mask, prompt, &opts, &noise, &mut t)
        .unwrap();

    case.assert_close("prompt_embeds", &prep.inputs.txt, Tier::Strict);
    case.assert_close(
        "pooled_prompt_embeds",
        &Tensor::new([1, 32], prep.inputs.pooled.clone()).unwrap(),
        Tier::Strict,
    );
    case.assert_close(
        "masked_image_latents_packed",
        &cols(&prep.inputs.cond, 0..64),
        Tier::Strict,
    );
    assert_eq!(
        cols(&prep.inputs.cond, 64..80).data(),
        case.tensor("mask_packed").data()
    );
    assert_eq!(prep.inputs.img_ids.data(), case.tensor("img_ids").data());
    assert_eq!(prep.inputs.txt_ids.data(), case.tensor("txt_ids").data());

    let schedule = p.schedule(4, 64, 64).unwrap();
    assert_eq!(schedule.timesteps, case.tensor("timesteps").into_data());
    let m = p.transformer().unwrap();
    let mut job = Job::new(m, &prep.inputs, schedule.clone(), Mode::Full).unwrap();
    for i in 0..4 {
        step_batch_with(
            m,
            &mut [&mut job],
            &DeviceTemplates::new(),
            &denoised_models::planner::prefix(m.num_blocks(), 0),
        )
        .unwrap();
        let latents = job.computed_latents(m).unwrap();
        let d = case.assert_close(&format!("step{i}.latents"), &latents, Tier::Strict);
        println!("step{i}.latents: {d:.2e}");
    }
    let latents = job.finish(m).unwrap().0;
    let raw = p.decode_raw(&latents, 64, 64).unwrap();
    println!(
        "decoded: {:.2e}",
        case.assert_close("decoded", &raw, Tier::Strict)
    );

    // image_np = clamp(decoded * 0.5 + 0.5, 0, 1) in NHWC.
    let n = 64 * 64;
    let np: Vec<f32> = (0..n)
        .flat_map(|i| (0..3).map(move |c| (i, c)))
        .map(|(i, c)| (raw.data()[c * n + i] * 0.5 + 0.5).clamp(0.0, 1.0))
        .collect();
    println!(
        "image_np: {:.2e}",
        case.assert_close(
            "image_np",
            &Tensor::new([1, 64, 64, 3], np).unwrap(),
            Tier::Strict
        )
    );
    // The PNG: e2e_output.png holds image_uint8.
    let img = from_model_space(raw.data(), 64, 64);
    let want = decode_image(&read("e2e_output.png"), &p.limits).unwrap();
    let (worst, off) = img.level_diff(&want);
    println!(
        "image_uint8: max level diff {worst}, {off} of {} values differ",
        img.data.len()
    );
    assert!(worst <= 1, "PNG levels differ by {worst}");

    // finish() without paste-back is the same image.
    let fin = p.finish(&prep, &latents, &opts, &mut t).unwrap();
    assert_eq!(fin, img);
}

#[test]
fn paste_back_keeps_every_unmasked_pixel() {
    let case = RefCase::open("e2e").unwrap();
    let p = FluxFill::load(&ModelSource::dir(tiny_model_dir()), CpuBackend::new()).unwrap();
    let image = decode_image(&read("e2e_input.png"), &p.limits).unwrap();
    let mask = decode_mask(&read("e2e_mask.png"), 64, 64, &p.limits, Default::default()).unwrap();
    let opts = EditOptions {
        steps: 4,
        max_sequence_length: 32,
        ..Default::default()
    };
    let mut t = Timings::default();
    let prep = p
        .prepare(
            &image,
            &mask,
            case.params["prompt"].as_str().unwrap(),
            &opts,
            &Noise::default(),
            &mut t,
        )
        .unwrap();
    let s = p.schedule(4, 64, 64).unwrap();
    let m = p.transformer().unwrap();
    let job = Job::new(m, &prep.inputs, s.clone(), Mode::Full).unwrap();
    let lat = run_to_end(m, job, &DeviceTemplates::new()).unwrap().0;
    let out = p.finish(&prep, &lat, &opts, &mut t).unwrap();
    let mut inside_changed = 0;
    for i in 0..64 * 64 {
        let (o, g) = (&out.data[i * 3..i * 3 + 3], &image.data[i * 3..i * 3 + 3]);
        if mask.data[i] {
            inside_changed += (o != g) as usize;
        } else {
            assert_eq!(o, g, "pixel {i} outside the mask changed");
        }
    }
    assert!(
        inside_changed > 100,
        "the edit changed only {inside_changed} masked pixels"
    );
}
