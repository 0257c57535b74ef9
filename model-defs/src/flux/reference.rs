//! FLUX.1 Kontext's reference tokens in a denoising job ([`super::edit`]): the
//! reference image's latents that ride in the sequence, and a masked edit's hold on the
//! latents outside its mask.

use denoised_runtime::Tensor;

/// FLUX.1 Kontext's reference image (`FluxKontextPipeline`): its packed latents join
/// the sequence after the noisy tokens, with their own position ids (first coordinate
/// 1), so every block attends to them; the step never moves them, and their
/// prediction is dropped (`noise_pred[:, :latents.size(1)]`).
#[derive(Clone, Debug)]
pub struct Reference {
    /// `[R, C + K]`: packed latents, laid out as the noisy rows are (a Kontext model
    /// has no Fill conditioning, so `K` is 0).
    pub latents: Tensor,
    /// `[R, 3]`.
    pub ids: Tensor,
    /// A masked edit (`FluxKontextInpaintPipeline`): what holds the unmasked latents.
    pub inpaint: Option<Inpaint>,
}

/// `FluxKontextInpaintPipeline`'s hold on the area outside the mask: after each step
/// the latents there are the image's, noised to the next step's sigma
/// (`scale_noise(image_latents, t_next, noise)`; the image's own after the last), so
/// only the masked area is generated.
#[derive(Clone, Debug)]
pub struct Inpaint {
    /// `[L, C]`: 1 where the latents may change (the mask at latent resolution, packed
    /// like the latents), else 0.
    pub mask: Tensor,
    /// `[L, C]`: the image's packed latents (at the output's size).
    pub image: Tensor,
    /// `[L, C]`: the noise the run started from.
    pub noise: Tensor,
}

impl Inpaint {
    /// `x[..L, ..C]` outside the mask becomes `sigma * noise + (1 - sigma) * image`.
    pub(super) fn hold(&self, x: &mut [f32], width: usize, sigma: f32) {
        let c = self.mask.cols();
        let (m, z, n) = (self.mask.data(), self.image.data(), self.noise.data());
        for (row, xr) in x.chunks_mut(width).take(self.mask.rows()).enumerate() {
            for (k, v) in xr[..c].iter_mut().enumerate() {
                let i = row * c + k;
                let held = sigma * n[i] + (1.0 - sigma) * z[i];
                *v = m[i] * *v + (1.0 - m[i]) * held;
            }
        }
    }

    /// The hold of only `rows` (an edit's computed rows, in that order).
    pub(super) fn rows(&self, rows: &[u32]) -> Inpaint {
        Inpaint {
            mask: self.mask.gather(rows),
            image: self.image.gather(rows),
            noise: self.noise.gather(rows),
        }
    }
}
