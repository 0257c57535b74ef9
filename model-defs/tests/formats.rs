//! The checkpoint files users hold, against diffusers on the same files
//! (tests/fixtures/formats, written by tests/fixtures/gen_format_fixtures.py): the
//! end-to-end Fill case (image, mask, prompt, initial noise of cases/e2e.safetensors)
//! with the transformer and VAE from BFL single files, fp8 files and GGUF quantisations.
//!
//! Tolerances: the BFL files hold the directory's weights, so their image must equal
//! the directory's bit for bit (same weights, other layout); every other case must be
//! within 1 level (of 255) of diffusers' image on the same file.

use std::path::PathBuf;

use denoised_models::flux::edit::{run_to_end, DeviceTemplates, Job, Mode};
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Timings};
use denoised_models::pipeline::image::{decode_image, decode_mask, from_model_space, Rgb8};
use denoised_models::source::ComponentFiles;
use denoised_models::ModelSource;
use denoised_runtime::fixtures::{fixtures_dir, tiny_model_dir, RefCase};
use denoised_runtime::CpuBackend;

fn formats() -> PathBuf {
    fixtures_dir().join("formats")
}

fn read(path: PathBuf) -> Vec<u8> {
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The tiny directory with `files` in place of its components.
fn source(files: ComponentFiles) -> ModelSource {
    ModelSource::dir(tiny_model_dir())
        .with_files(files)
        .unwrap()
}

fn transformer(file: &str) -> ModelSource {
    source(ComponentFiles {
        transformer: Some(formats().join(file)),
        ..Default::default()
    })
}

/// The e2e case's image and final latents through `source`'s pipeline.
fn e2e(source: &ModelSource) -> (Rgb8, Vec<f32>) {
    let case = RefCase::open("e2e").unwrap();
    let mut p = FluxFill::load(source, CpuBackend::new()).unwrap();
    // Torch's own sinusoid table, as the e2e test uses (see pipeline_e2e.rs).
    p.transformer_mut()
        .unwrap()
        .set_time_proj_freqs(
            RefCase::open("transformer_case1")
                .unwrap()
                .tensor("time_proj_freqs")
                .into_data(),
        )
        .unwrap();
    let cases = fixtures_dir().join("cases");
    let image = decode_image(&read(cases.join("e2e_input.png")), &p.limits).unwrap();
    let mask = decode_mask(
        &read(cases.join("e2e_mask.png")),
        64,
        64,
        &p.limits,
        Default::default(),
    )
    .unwrap();
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
    let prompt = case.params["prompt"].as_str().unwrap();
    let mut t = Timings::default();
    let prep = p
        .prepare(&image, &mask, prompt, &opts, &noise, &mut t)
        .unwrap();
    let m = p.transformer().unwrap();
    let job = Job::new(m, &prep.inputs, p.schedule(4, 64, 64).unwrap(), Mode::Full).unwrap();
    let latents = run_to_end(m, job, &DeviceTemplates::new()).unwrap().0;
    let raw = p.decode_raw(&latents, 64, 64).unwrap();
    (from_model_space(raw.data(), 64, 64), latents.into_data())
}

/// Asserts `img` within one level of diffusers' image of `case`.
fn assert_diffusers(case: &str, img: &Rgb8) {
    let want = decode_image(
        &read(formats().join(format!("{case}_output.png"))),
        &denoised_models::pipeline::image::ImageLimits {
            max_pixels: 1 << 20,
            multiple_of: 1,
        },
    )
    .unwrap();
    let (worst, off) = img.level_diff(&want);
    println!(
        "{case}: max level diff {worst}, {off} of {} values differ",
        img.data.len()
    );
    assert!(
        worst <= 1,
        "{case}: levels differ by {worst} from diffusers"
    );
}

#[test]
fn bfl_single_files_give_the_directory_image_bit_for_bit() {
    let (dir_img, dir_latents) = e2e(&ModelSource::dir(tiny_model_dir()));
    let files = source(ComponentFiles {
        transformer: Some(formats().join("flux1-fill-tiny.safetensors")),
        vae: Some(formats().join("ae-tiny.safetensors")),
        text_encoder_2: None,
    });
    let (img, latents) = e2e(&files);
    let differ = latents
        .iter()
        .zip(&dir_latents)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differ, 0,
        "final latents differ from the directory's at {differ} values"
    );
    assert!(img == dir_img, "the image differs from the directory's");
    assert_diffusers("bfl", &img);
}

#[test]
fn fp8_files_equal_diffusers() {
    for (case, file) in [
        ("fp8", "flux1-fill-tiny-fp8.safetensors"),
        ("fp8_scaled", "flux1-fill-tiny-fp8-scaled.safetensors"),
    ] {
        let (img, _) = e2e(&transformer(file));
        assert_diffusers(case, &img);
    }
}

#[test]
fn gguf_transformers_equal_diffusers_gguf() {
    for (case, file) in [
        ("q8_0", "flux1-fill-tiny-Q8_0.gguf"),
        ("q4_k", "flux-d256-Q4_K.gguf"),
    ] {
        let (img, _) = e2e(&transformer(file));
        assert_diffusers(case, &img);
    }
}

#[test]
fn t5_single_files() {
    let t5 = |file: &str| {
        source(ComponentFiles {
            text_encoder_2: Some(formats().join(file)),
            ..Default::default()
        })
    };
    let (dir_img, dir_latents) = e2e(&ModelSource::dir(tiny_model_dir()));
    // transformers' names in one file: the directory's weights, bit for bit.
    let (img, latents) = e2e(&t5("t5-tiny.safetensors"));
    assert!(
        latents == dir_latents && img == dir_img,
        "T5 single file differs from the directory"
    );
    // llama.cpp's names in a GGUF, Q8_0.
    let (img, _) = e2e(&t5("t5-tiny-Q8_0.gguf"));
    assert_diffusers("t5_q8_0", &img);
}

/// A LoRA merged into a quantised transformer makes its sites dense while merged, and
/// unmerging restores them quantised, exactly as loaded.
#[test]
fn lora_merge_on_a_quantised_transformer_restores_it() {
    use denoised_models::flux::lora::LoraFile;
    use denoised_models::flux::weights::{DoubleLinear, Site};
    use denoised_runtime::weights::write_safetensors;
    use denoised_runtime::Tensor;

    let m = transformer("flux1-fill-tiny-Q8_0.gguf")
        .load_transformer(CpuBackend::new())
        .unwrap();
    let before = m.memory();
    assert!(before.contains_key("Q8_0"), "{before:?}");
    let site = Site::Double(0, DoubleLinear::Qkv);
    let w0 = m.site_weight(site).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lora = dir.path().join("lora.safetensors");
    let (r, d) = (2, m.config.hidden());
    let down = Tensor::new([r, d], (0..r * d).map(|i| (i % 7) as f32 * 0.01).collect()).unwrap();
    let up = Tensor::new([d, r], (0..r * d).map(|i| (i % 5) as f32 * 0.01).collect()).unwrap();
    let p = "transformer.transformer_blocks.0.attn.to_q";
    write_safetensors(
        &lora,
        &[
            (&format!("{p}.lora_A.weight"), &down),
            (&format!("{p}.lora_B.weight"), &up),
        ],
    )
    .unwrap();
    let file = LoraFile::open(&lora, &m.config).unwrap();
    m.merge_loras(&[(&file, 1.0)]).unwrap();
    let merged = m.memory();
    assert!(merged["Q8_0"] < before["Q8_0"], "{merged:?}");
    assert!(
        m.site_weight(site).unwrap() != w0,
        "the merge changed nothing"
    );
    m.unmerge().unwrap();
    assert_eq!(m.memory(), before);
    assert!(
        m.site_weight(site).unwrap() == w0,
        "unmerged weights differ from the loaded"
    );
}
