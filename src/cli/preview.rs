//! `--preview FILE` of `edit`, `generate` and `template capture`: the image as it
//! denoises, rewritten after every step from the model's estimate of the clean latent
//! (docs/api.md, "Streaming and previews", says how a preview is drawn).

use std::path::{Path, PathBuf};

use denoised_models::pipeline::flux_fill::load_vae;
use denoised_models::pipeline::image::{encode_jpeg, encode_png};
use denoised_models::pipeline::preview::{fit_vae, PreviewFactors};
use denoised_models::vae::{AutoencoderKL, VaeHalves};
use denoised_models::ModelSource;
use denoised_runtime::Tensor;

use super::CliResult;

pub(super) struct PreviewFile {
    path: PathBuf,
    factors: PreviewFactors,
    /// The latent grid, rows and columns.
    grid: (usize, usize),
    jpeg: bool,
}

impl PreviewFile {
    /// For an image of `width x height` (pixels) of `model`: the factors are fitted to
    /// its VAE first (2 s for the built-in model's, 17 s for a FLUX.1-size VAE on 2
    /// cores): `vae`, the pipeline's, when it holds both halves (a Fill model's), else
    /// both loaded for the fit (a text-to-image pipeline loads no encoder).
    pub fn new(
        path: Option<&Path>,
        model: &ModelSource,
        vae: &AutoencoderKL,
        (width, height): (usize, usize),
    ) -> CliResult<Option<PreviewFile>> {
        let Some(path) = path else { return Ok(None) };
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let jpeg = match ext.to_ascii_lowercase().as_str() {
            "png" => false,
            "jpg" | "jpeg" => true,
            _ => return Err(format!("--preview {}: a .png or .jpg file", path.display()).into()),
        };
        let loaded;
        let vae = match vae.halves() {
            VaeHalves::BOTH => vae,
            _ => {
                loaded = load_vae(model, VaeHalves::BOTH)?;
                &loaded
            }
        };
        let vae_factor = vae.config().vae_scale_factor();
        let (factors, q) = fit_vae(vae)?;
        tracing::info!(
            "preview factors: PSNR {:.1} dB, correlation {:.3} against the decoder",
            q.psnr_db,
            q.correlation
        );
        Ok(Some(PreviewFile {
            path: path.to_path_buf(),
            factors,
            grid: (height / vae_factor, width / vae_factor),
            jpeg,
        }))
    }

    /// Draws packed full-grid `latents` and replaces the file at once (written beside
    /// it, then renamed: a viewer never reads half an image).
    pub fn write(&self, latents: &Tensor) -> CliResult {
        let img = self
            .factors
            .preview(latents.data(), latents.cols(), self.grid.0, self.grid.1)?;
        let bytes = match self.jpeg {
            true => encode_jpeg(&img, 90)?,
            false => encode_png(&img)?,
        };
        let tmp = self.path.with_extension("partial");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(|e| format!("--preview {}: {e}", self.path.display()).into())
    }
}
