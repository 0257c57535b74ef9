//! Denoiser inputs from the reference fixtures' end-to-end case (`e2e`), shared by the
//! mask-aware tests of every backend. The fixture files themselves are found and read
//! by `denoised_runtime::fixtures`.

use denoised_runtime::fixtures::RefCase;
use denoised_runtime::{CpuBackend, Tensor};

use crate::flux::edit::{step_batch_with, DenoiseInputs, DeviceTemplates, Job};
use crate::flux::FluxTransformer;
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
        reference: None,
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

/// The largest absolute difference of `a` from `b`, and `b`'s largest magnitude.
pub fn max_abs(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold((0.0, 0.0), |(d, m), (x, y)| {
        (f32::max(d, (x - y).abs()), f32::max(m, y.abs()))
    })
}

/// Runs a full `job` to its end on the CPU, checking its latents after each remaining
/// step against the rows of `want` (`[S', 1, N, C]`, the first for the job's current
/// step) within `1e-5` of their largest magnitude; returns the final packed latents.
pub fn run_checked(
    m: &FluxTransformer<CpuBackend>,
    mut job: Job<Tensor>,
    want: &Tensor,
    label: &str,
) -> Tensor {
    let first = job.step();
    let per = want.len() / want.shape()[0];
    while !job.done() {
        let i = job.step();
        let plan = crate::planner::prefix(m.num_blocks(), 0);
        step_batch_with(m, &mut [&mut job], &DeviceTemplates::new(), &plan).unwrap();
        let got = job.computed_latents(m).unwrap();
        let j = i - first;
        let (d, mx) = max_abs(got.data(), &want.data()[j * per..(j + 1) * per]);
        println!("{label} step {i}: max abs diff {d:.2e} of {mx:.2}");
        assert!(d <= 1e-5 * mx, "{label} step {i}: {d:.2e} of {mx:.2}");
    }
    assert_eq!(
        (job.step() - first) * per,
        want.len(),
        "{label}: every step checked"
    );
    job.finish(m).unwrap().0
}

/// Checks a decoder output `raw` (`[1, 3, H, W]`, model space) against diffusers': its
/// float image `want` (`output_type="np"`, `[1, H, W, 3]`) within 1e-4 when given, and
/// its PNG `cases/<png>` within 1 level.
pub fn check_decoded(raw: &Tensor, want: Option<&Tensor>, png: &str, label: &str) {
    use crate::pipeline::image::{decode_image, from_model_space, ImageLimits};
    let &[1, 3, h, w] = raw.shape() else {
        panic!(
            "{label}: a decoder output is [1, 3, H, W], not {:?}",
            raw.shape()
        )
    };
    let n = w * h;
    if let Some(want) = want {
        let np: Vec<f32> = (0..n)
            .flat_map(|i| (0..3).map(move |c| (i, c)))
            .map(|(i, c)| (raw.data()[c * n + i] * 0.5 + 0.5).clamp(0.0, 1.0))
            .collect();
        let (d, _) = max_abs(&np, want.data());
        println!("{label}: image max abs diff {d:.2e}");
        assert!(d <= 1e-4, "{label} image: {d:.2e}");
    }
    let path = denoised_runtime::fixtures::fixtures_dir()
        .join("cases")
        .join(png);
    let limits = ImageLimits {
        max_pixels: 1 << 24,
        multiple_of: 1,
    };
    let png = decode_image(&std::fs::read(path).unwrap(), &limits).unwrap();
    let (worst, _) = from_model_space(raw.data(), w, h).level_diff(&png);
    println!("{label}: PNG max level diff {worst}");
    assert!(worst <= 1, "{label}: PNG levels differ by {worst}");
}
