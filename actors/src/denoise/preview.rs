//! Previews in the denoise worker: the event thread draws each [`Event::Preview`]'s
//! latent with factors fitted to the model's VAE, and sends the JPEG to the router.
//!
//! The factors are fitted once per worker start on a background thread
//! (`denoised_models::pipeline::preview::fit_vae`: the VAE's both halves on the CPU,
//! 64² images; 17 s for a FLUX.1-size VAE on a 2-core machine), then the VAE is dropped. Until they are
//! ready a preview is skipped; the steps go on either way. Drawing costs the loop
//! nothing: the loop only hands over the latent.
//!
//! [`Event::Preview`]: super::Event::Preview

use std::sync::{Arc, OnceLock};

use denoised_models::pipeline::flux_fill::load_vae;
use denoised_models::pipeline::image::{encode_jpeg, Rgb8};
use denoised_models::pipeline::preview::{fit_vae, PreviewFactors};
use denoised_models::vae::VaeHalves;
use denoised_models::ModelSource;
use denoised_runtime::Tensor;

use super::PreviewSpec;

/// A preview's long side at least (nearest-neighbour: a latent pixel stays a block).
const MIN_SIDE: usize = 256;
const JPEG_QUALITY: u8 = 85;

#[derive(Clone, Default)]
pub(super) struct Previewer {
    factors: Arc<OnceLock<PreviewFactors>>,
}

impl Previewer {
    /// Fits the factors of `source`'s VAE on a background thread.
    pub fn start(source: ModelSource) -> Previewer {
        let p = Previewer::default();
        let factors = p.factors.clone();
        let fit = move || {
            let t = std::time::Instant::now();
            match load_vae(&source, VaeHalves::BOTH).and_then(|vae| fit_vae(&vae)) {
                Ok((f, q)) => {
                    tracing::info!(
                        "preview factors fitted in {:.1} s (PSNR {:.1} dB, correlation {:.3} against the decoder)",
                        t.elapsed().as_secs_f64(),
                        q.psnr_db,
                        q.correlation
                    );
                    let _ = factors.set(f);
                }
                Err(e) => {
                    tracing::warn!("no previews: the preview factors could not be fitted: {e}")
                }
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("preview-fit".into())
            .spawn(fit)
        {
            tracing::warn!("no previews: {e}");
        }
        p
    }

    /// The JPEG of a preview of packed `latents`, once the factors are ready.
    pub fn draw(&self, latents: &Tensor, spec: PreviewSpec) -> Option<Vec<u8>> {
        let f = self.factors.get()?;
        let img = f
            .preview(latents.data(), latents.cols(), 2 * spec.rows, 2 * spec.cols)
            .map_err(|e| tracing::debug!("no preview: {e}"))
            .ok()?;
        encode_jpeg(&upscale(&img), JPEG_QUALITY).ok()
    }
}

/// `img` scaled by the smallest whole factor that makes its long side at least
/// [`MIN_SIDE`].
fn upscale(img: &Rgb8) -> Rgb8 {
    let k = MIN_SIDE.div_ceil(img.width.max(img.height).max(1)).max(1);
    if k == 1 {
        return img.clone();
    }
    let (w, h) = (img.width * k, img.height * k);
    let mut data = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let i = 3 * ((y / k) * img.width + x / k);
            data.extend_from_slice(&img.data[i..i + 3]);
        }
    }
    Rgb8 {
        width: w,
        height: h,
        data,
    }
}
