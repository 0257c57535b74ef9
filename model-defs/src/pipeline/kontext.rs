//! FLUX.1 Kontext: instruction edits ("make the walls blue", no mask), as diffusers'
//! `FluxKontextPipeline` computes them ([`PipelineKind::Kontext`]).
//!
//! Kontext [dev] is FLUX.1-dev's transformer (64 input channels, a guidance embedding)
//! trained to read a reference image: the image's VAE latents (the posterior's mean,
//! normalised and packed) join the sequence after the noisy tokens with position ids
//! whose first coordinate is 1, every block attends to them, and the prediction for
//! them is dropped. So a request is a text-to-image run over the noisy tokens with a
//! [`Reference`] riding along ([`crate::flux::edit`] keeps its rows out of each step's
//! update); the schedule is the noisy tokens' (`image_seq_len = latents.shape[1]`).
//!
//! Sizes follow diffusers: the output's area is `max_area` at the input's aspect
//! ([`kontext_sizes`]); the reference image keeps its own size, or takes the nearest
//! of Kontext's preferred resolutions (`_auto_resize`).

use std::time::Instant;

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::fill::{normalize_and_pack, pack_latents};
use super::flux_fill::{EditOptions, FluxFill, Noise, PipelineKind, Prepared, Timings};
use super::generate::GenerateOptions;
use super::image::{to_model_space, Mask, Rgb8};
use crate::flux::config::FluxConfig;
use crate::flux::edit::{Inpaint, Reference};
use crate::flux::embed::image_ids;

/// `PREFERRED_KONTEXT_RESOLUTIONS` of diffusers' `pipeline_flux_kontext.py`, as
/// `(width, height)`: the sizes Kontext was trained at.
pub const PREFERRED_RESOLUTIONS: [(usize, usize); 17] = [
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
];

/// diffusers' default `max_area` (`1024**2`).
pub const MAX_AREA: usize = 1024 * 1024;

/// The sizes of a Kontext edit of a `width x height` image, as `FluxKontextPipeline`
/// computes them when called with the image's own `width` and `height`: `(reference,
/// output)`, each `(width, height)` in multiples of `multiple` (two VAE factors: one
/// token). The output has area `max_area` at the image's aspect (`round(sqrt(area *
/// aspect))`, Python's rounding, then down to the multiple); the reference keeps the
/// image's size (down to the multiple), or with `auto_resize` takes the preferred
/// resolution nearest the image's aspect.
pub fn kontext_sizes(
    width: usize,
    height: usize,
    max_area: usize,
    multiple: usize,
    auto_resize: bool,
) -> ((usize, usize), (usize, usize)) {
    let m = multiple.max(1);
    let down = |v: usize| (v / m * m).max(m);
    let aspect = width.max(1) as f64 / height.max(1) as f64;
    let area = max_area as f64;
    let out_w = (area * aspect).sqrt().round_ties_even() as usize;
    let out_h = (area / aspect).sqrt().round_ties_even() as usize;
    let (rw, rh) = match auto_resize {
        // Python's `min` over (|aspect difference|, w, h) tuples: ties go to the
        // smaller width.
        true => PREFERRED_RESOLUTIONS
            .iter()
            .copied()
            .min_by(|a, b| {
                let d = |&(w, h): &(usize, usize)| (aspect - w as f64 / h as f64).abs();
                d(a).total_cmp(&d(b)).then(a.cmp(b))
            })
            .expect("a preferred resolution"),
        false => (width, height),
    };
    ((down(rw), down(rh)), (down(out_w), down(out_h)))
}

/// The step a masked edit of `strength` starts at, as diffusers' `get_timesteps`:
/// `int(steps - min(steps * strength, steps))` (strength 1 starts from pure noise).
pub fn start_step(steps: usize, strength: f32) -> usize {
    let n = steps as f64;
    let init = (n * strength as f64).min(n);
    (n - init).max(0.0) as usize
}

/// What a masked Kontext edit reads: the image, the mask over it, and optionally a
/// separate reference image (diffusers' `image_reference`; else the image is its own).
#[derive(Clone, Copy)]
pub struct InpaintImages<'a> {
    pub image: &'a Rgb8,
    pub mask: &'a Mask,
    pub reference: Option<&'a Rgb8>,
}

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// A FLUX.1 Kontext pipeline of seeded components at benchmark scale: as
    /// [`seeded_small`](Self::seeded_small), with FLUX.1-dev's input channels.
    pub fn seeded_small_kontext(backend: B, seed: u64) -> Result<Self> {
        let small = FluxConfig::small();
        let config = FluxConfig {
            in_channels: small.out_channels(),
            ..small
        };
        let mut p = Self::seeded_small_as(backend, config, seed, "-kontext")?;
        p.kind = PipelineKind::Kontext;
        Ok(p)
    }

    /// Preprocessing of an instruction edit: the prompt's embeddings, the reference
    /// image's latents (`image`, at its reference size) and the initial noise over an
    /// `output` (`(width, height)`) grid (`noise.initial_latents`, packed `[N, 4c]`:
    /// diffusers' `latents`, to reproduce its run; else drawn from the seed).
    pub fn prepare_kontext(
        &self,
        image: &Rgb8,
        output: (usize, usize),
        prompt: &str,
        opts: &EditOptions,
        noise: &Noise,
        t: &mut Timings,
    ) -> Result<Prepared> {
        self.kind.require(PipelineKind::Kontext)?;
        let (w, h) = output;
        let block = 2 * self.vae_scale_factor();
        for (what, (x, y)) in [
            ("reference image", (image.width, image.height)),
            ("output", output),
        ] {
            if x == 0 || y == 0 || x % block != 0 || y % block != 0 {
                return Err(Error::Invalid(format!(
                    "the {what} is {x}x{y}: a Kontext edit needs sides that are multiples of {block}"
                )));
            }
        }
        let grid = GenerateOptions {
            steps: opts.steps,
            guidance: opts.guidance,
            seed: opts.seed,
            max_sequence_length: opts.max_sequence_length,
            width: w,
            height: h,
        };
        let mut p = self.prepare_from_noise(prompt, &grid, noise.initial_latents.as_ref(), t)?;
        let t0 = Instant::now();
        p.inputs.reference = Some(self.reference_latents(image)?);
        t.vae_encode_s += t0.elapsed().as_secs_f64();
        Ok(p)
    }

    /// Preprocessing of a masked instruction edit, as `FluxKontextInpaintPipeline`
    /// computes it: the image (at its size, whole tokens) is the reference, or
    /// `images.reference` at its own size (diffusers' `image_reference`), and the
    /// latents outside `images.mask` follow the image, re-noised to each step's sigma
    /// ([`Inpaint`]);
    /// the run starts at step [`start_step`] of `opts.steps` at `opts.strength`
    /// (returned with it), from
    /// `noise.initial_latents` as they are when given (diffusers' `latents=`), else
    /// from the image's latents noised to that step's sigma with noise drawn from the
    /// seed.
    pub fn prepare_kontext_inpaint(
        &self,
        images: InpaintImages<'_>,
        prompt: &str,
        opts: &EditOptions,
        noise: &Noise,
        t: &mut Timings,
    ) -> Result<(Prepared, usize)> {
        let InpaintImages {
            image,
            mask,
            reference: separate,
        } = images;
        let strength = opts.strength;
        if !(strength > 0.0 && strength <= 1.0) {
            return Err(Error::Invalid(format!(
                "strength {strength} is not in (0, 1]"
            )));
        }
        let (w, h) = (image.width, image.height);
        if (mask.width, mask.height) != (w, h) {
            return Err(Error::Invalid(format!(
                "mask is {}x{} but the image is {w}x{h}",
                mask.width, mask.height
            )));
        }
        let start = start_step(opts.steps, strength);
        if start >= opts.steps {
            return Err(Error::Invalid(format!(
                "strength {strength} leaves none of the {} steps to run",
                opts.steps
            )));
        }
        let reads = separate.unwrap_or(image);
        let mut p = self.prepare_kontext(reads, (w, h), prompt, opts, noise, t)?;
        let inputs = &mut p.inputs;
        let reference = inputs
            .reference
            .as_mut()
            .expect("a Kontext request's reference");
        let image_latents = match separate {
            None => reference.latents.clone(),
            Some(_) => {
                let t0 = Instant::now();
                let z = self.reference_latents(image)?.latents;
                t.vae_encode_s += t0.elapsed().as_secs_f64();
                z
            }
        };
        let n = inputs.latents.clone();
        if noise.initial_latents.is_none() {
            let sigma = self.schedule(opts.steps, w, h)?.sigmas[start];
            let x = n.data().iter().zip(image_latents.data());
            let noised = x.map(|(n, z)| sigma * n + (1.0 - sigma) * z).collect();
            inputs.latents = Tensor::new([n.rows(), n.cols()], noised)?;
        }
        reference.inpaint = Some(Inpaint {
            mask: self.mask_latents(mask)?,
            image: image_latents,
            noise: n,
        });
        Ok((
            Prepared {
                image: image.clone(),
                mask: mask.clone(),
                ..p
            },
            start,
        ))
    }

    /// A pixel mask at latent resolution (nearest: latent pixel `(i, j)` is pixel
    /// `(i f, j f)`, as torch's `interpolate` picks it), repeated over the latent
    /// channels and packed like the latents: `[L, 4c]` of 0 and 1.
    fn mask_latents(&self, mask: &Mask) -> Result<Tensor> {
        let vsf = self.vae_scale_factor();
        let c = self.vae.config().latent_channels;
        let (lh, lw) = (mask.height / vsf, mask.width / vsf);
        let plane: Vec<f32> = (0..lh * lw)
            .map(|i| {
                let (y, x) = (i / lw * vsf, i % lw * vsf);
                mask.data[y * mask.width + x] as u8 as f32
            })
            .collect();
        let planes: Vec<f32> = (0..c).flat_map(|_| plane.iter().copied()).collect();
        pack_latents(&planes, c, lh, lw)
    }

    /// The reference image's tokens: the VAE posterior's mean (diffusers'
    /// `sample_mode="argmax"`), normalised and packed, with ids `(1, row, col)`.
    fn reference_latents(&self, image: &Rgb8) -> Result<Reference> {
        let (w, h) = (image.width, image.height);
        let vsf = self.vae_scale_factor();
        let x = Tensor::new([1, 3, h, w], to_model_space(image))?;
        let (mean, _) = self.vae_encode(&x)?;
        let cfg = self.vae.config();
        let latents = normalize_and_pack(
            mean.data(),
            cfg.latent_channels,
            h / vsf,
            w / vsf,
            cfg.shift(),
            cfg.scale(),
        )?;
        let (rows, cols) = self.tokens(w, h);
        let mut ids = image_ids(rows, cols);
        for id in ids.chunks_mut(3) {
            id[0] = 1.0;
        }
        Ok(Reference {
            latents,
            ids: Tensor::new([rows * cols, 3], ids)?,
            inpaint: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_edits_start_where_diffusers_does() {
        assert_eq!(start_step(4, 0.75), 1);
        assert_eq!(start_step(28, 1.0), 0);
        assert_eq!(start_step(28, 0.6), 11);
        assert_eq!(start_step(10, 0.05), 9);
    }

    #[test]
    fn sizes_follow_diffusers() {
        // diffusers' own numbers: a 1024^2 area at 3:2 is 1254x836 -> 1248x832 in
        // multiples of 16, and the preferred resolution nearest 3:2 is 1248x832.
        assert_eq!(
            kontext_sizes(1500, 1000, MAX_AREA, 16, true),
            ((1248, 832), (1248, 832))
        );
        // Without auto-resize the reference keeps its size, down to the multiple.
        assert_eq!(
            kontext_sizes(1500, 1000, MAX_AREA, 16, false),
            ((1488, 992), (1248, 832))
        );
        // The tiny fixtures: 64x64 at an area of 64^2.
        assert_eq!(kontext_sizes(64, 64, 4096, 4, false), ((64, 64), (64, 64)));
        // Square inputs take 1024x1024; a tall one the tallest preferred size.
        assert_eq!(kontext_sizes(500, 500, MAX_AREA, 16, true).0, (1024, 1024));
        assert_eq!(kontext_sizes(100, 1000, MAX_AREA, 16, true).0, (672, 1568));
    }
}
