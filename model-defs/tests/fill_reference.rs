//! FluxFillPipeline's conditioning against the diffusers end-to-end case: the binarised
//! mask from the soft-edged PNG, the packed mask, the masked image, latent packing and
//! normalisation.

use denoised_models::pipeline::fill::{
    masked_image, normalize_and_pack, pack_latents, pack_mask, unpack_latents,
};
use denoised_models::pipeline::image::{decode_image, decode_mask, to_model_space, ImageLimits};
use denoised_runtime::fixtures::{fixtures_dir, RefCase, Tier};
use denoised_runtime::Tensor;

const LIM: ImageLimits = ImageLimits {
    max_pixels: 1 << 24,
    multiple_of: 4,
};

fn read(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join("cases").join(name)).unwrap()
}

#[test]
fn image_and_mask_preprocessing_match_diffusers() {
    let case = RefCase::open("e2e").unwrap();
    let img = decode_image(&read("e2e_input.png"), &LIM).unwrap();
    let planar = to_model_space(&img);
    case.assert_close(
        "init_image",
        &Tensor::new([1, 3, 64, 64], planar.clone()).unwrap(),
        Tier::Strict,
    );

    let mask = decode_mask(&read("e2e_mask.png"), 64, 64, &LIM, Default::default()).unwrap();
    let want = case.tensor("mask_image");
    let got: Vec<f32> = mask.data.iter().map(|&m| m as u8 as f32).collect();
    assert_eq!(got, want.data(), "binarised mask must match exactly");

    let mi = masked_image(&planar, &mask);
    case.assert_close(
        "masked_image",
        &Tensor::new([1, 3, 64, 64], mi).unwrap(),
        Tier::Strict,
    );

    let packed = pack_mask(&mask, 2).unwrap();
    assert_eq!(
        packed.data(),
        case.tensor("mask_packed").data(),
        "packed mask must match exactly"
    );
}

#[test]
fn packing_matches_diffusers() {
    let case = RefCase::open("e2e").unwrap();
    let noise = case.tensor("initial_noise_unpacked");
    let packed = pack_latents(noise.data(), 16, 32, 32).unwrap();
    assert_eq!(packed.data(), case.tensor("initial_latents").data());
    assert_eq!(unpack_latents(&packed, 32, 32).unwrap(), noise.data());

    // (posterior_sample - shift) * scale, packed = the masked-image latents.
    let sample = case.tensor("posterior_sample");
    let got = normalize_and_pack(sample.data(), 16, 32, 32, 0.1159, 0.3611).unwrap();
    case.assert_close(
        "masked_image_latents_packed",
        &got.reshape([1, 256, 64]).unwrap(),
        Tier::Strict,
    );
}
