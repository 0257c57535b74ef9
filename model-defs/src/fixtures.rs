//! Denoiser inputs from the reference fixtures' end-to-end case (`e2e`), shared by the
//! mask-aware tests of every backend. The fixture files themselves are found and read
//! by `denoised_runtime::fixtures`.

use denoised_runtime::fixtures::RefCase;
use denoised_runtime::Tensor;

use crate::flux::edit::DenoiseInputs;
use crate::mask::TokenMask;

/// `[1, N, C]` → `[N, C]`.
fn squeeze(t: Tensor) -> Tensor {
    let cols = *t.shape().last().expect("a tensor with a shape");
    let rows = t.len() / cols;
    t.reshape([rows, cols]).expect("same element count")
}

/// The case's initial latents, Fill conditioning (packed masked-image latents, then the
/// packed mask), ids, prompt embeddings and guidance. Panics if the case lacks them, as
/// fixture readers do: a broken fixture is a test failure.
pub fn e2e_denoise_inputs(case: &RefCase) -> DenoiseInputs {
    let mil = squeeze(case.tensor("masked_image_latents_packed"));
    let mask = squeeze(case.tensor("mask_packed"));
    let cond: Vec<f32> = (0..mil.rows())
        .flat_map(|r| {
            mil.row(r)
                .iter()
                .chain(mask.row(r))
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    DenoiseInputs {
        latents: squeeze(case.tensor("initial_latents")),
        cond: Tensor::new([mil.rows(), mil.cols() + mask.cols()], cond).expect("shape"),
        img_ids: case.tensor("img_ids"),
        txt: squeeze(case.tensor("prompt_embeds")),
        txt_ids: case.tensor("txt_ids"),
        pooled: case.tensor("pooled_prompt_embeds").into_data(),
        guidance: case.tensor("guidance").data()[0],
    }
}

/// The case's 64x64 mask (soft edges, binarised at 0.5) as 4x4-pixel tokens, grown by
/// `dilation` tokens.
pub fn e2e_token_mask(case: &RefCase, dilation: usize) -> TokenMask {
    let px: Vec<bool> = case
        .tensor("mask_image")
        .data()
        .iter()
        .map(|&v| v >= 0.5)
        .collect();
    TokenMask::from_pixels(&px, 64, 64, 4, dilation).expect("the e2e mask's shape")
}
