//! Previews of a running latent: a fixed linear map of the VAE's latent channels to RGB
//! (16 x 3 weights and a bias for FLUX), the approach ComfyUI and stable-diffusion.cpp
//! take, applied to the model's current estimate of the clean latent. One output pixel
//! per latent pixel: a 1024² image previews at 128², for a few microseconds of work per
//! pixel and no VAE.
//!
//! The factors belong to a VAE, so they are fitted to the VAE that runs
//! ([`fit`]): images are encoded, their latents decoded, and the decoded images averaged
//! over each latent pixel's footprint; a least-squares fit maps the (normalised, as the
//! transformer sees them) latent channels to those averages. The target is the
//! decoder's output, not the input image, because a preview shows what decoding the
//! latent would show. [`quality`] says how close a projection comes (PSNR and
//! correlation, in the pipeline's [-1, 1] space).

use denoised_runtime::{Error, Result, Tensor};

use super::fill::unpack_latent_rows;
use super::image::{from_model_space, to_model_space, Rgb8};
use crate::flux::weights::SplitMix;
use crate::vae::AutoencoderKL;

/// `rgb = bias + sum_c weight[c] * latent[c]`, in the pipeline's [-1, 1] image space, of
/// latents normalised as the transformer sees them (`(z - shift) * scale`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PreviewFactors {
    pub weight: Vec<[f32; 3]>,
    pub bias: [f32; 3],
}

/// How close a projection is to the decoded image, both at latent resolution.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct FitQuality {
    /// Peak signal-to-noise ratio over the [-1, 1] range (peak 2), in dB.
    pub psnr_db: f64,
    /// Pearson correlation of all channel values.
    pub correlation: f64,
}

/// One image for the fit: its normalised latent `[C, h, w]` and the decoder's output
/// averaged to the same grid, `[3, h, w]`.
pub struct Sample {
    pub latent: Vec<f32>,
    pub rgb: Vec<f32>,
}

impl PreviewFactors {
    pub fn channels(&self) -> usize {
        self.weight.len()
    }

    /// Planar `[3, h*w]` RGB of a planar `[C, h*w]` latent.
    pub fn project(&self, latent: &[f32]) -> Vec<f32> {
        let c = self.channels();
        let n = latent.len() / c;
        let mut out = vec![0.0f32; 3 * n];
        for (k, o) in out.chunks_exact_mut(n).enumerate() {
            o.fill(self.bias[k]);
            for ch in 0..c {
                let w = self.weight[ch][k];
                for (o, l) in o.iter_mut().zip(&latent[ch * n..(ch + 1) * n]) {
                    *o += w * l;
                }
            }
        }
        out
    }

    /// The preview of packed transformer latents `[(h/2)*(w/2), 4C]` of an `h x w`
    /// latent grid: 8-bit RGB, one pixel per latent pixel.
    pub fn preview(&self, packed: &[f32], cols: usize, h: usize, w: usize) -> Result<Rgb8> {
        if cols != 4 * self.channels() {
            return Err(Error::Invalid(format!(
                "preview factors for {} channels, latents of width {cols}",
                self.channels()
            )));
        }
        let latent = unpack_latent_rows(packed, cols, h, w)?;
        Ok(from_model_space(&self.project(&latent), w, h))
    }

    /// The least-squares factors over `samples` (a small ridge keeps the normal
    /// equations solvable when a channel hardly varies).
    pub fn fit(samples: &[Sample], channels: usize) -> Result<PreviewFactors> {
        let k = channels + 1;
        let mut ata = vec![0.0f64; k * k];
        let mut aty = vec![[0.0f64; 3]; k];
        let mut row = vec![0.0f64; k];
        for s in samples {
            let n = s.rgb.len() / 3;
            if s.latent.len() != channels * n || s.rgb.len() != 3 * n {
                return Err(Error::Invalid(format!(
                    "a preview sample of {} latent values and {} RGB values for {channels} channels",
                    s.latent.len(),
                    s.rgb.len()
                )));
            }
            for i in 0..n {
                for (ch, r) in row.iter_mut().take(channels).enumerate() {
                    *r = s.latent[ch * n + i] as f64;
                }
                row[channels] = 1.0;
                for a in 0..k {
                    for b in 0..k {
                        ata[a * k + b] += row[a] * row[b];
                    }
                    for (c, v) in aty[a].iter_mut().enumerate() {
                        *v += row[a] * s.rgb[c * n + i] as f64;
                    }
                }
            }
        }
        let ridge = 1e-6 * (0..k).map(|i| ata[i * k + i]).sum::<f64>() / k as f64;
        for i in 0..channels {
            ata[i * k + i] += ridge;
        }
        let x = solve(ata, aty, k)?;
        Ok(PreviewFactors {
            weight: x[..channels].iter().map(|r| r.map(|v| v as f32)).collect(),
            bias: x[channels].map(|v| v as f32),
        })
    }
}

/// Side of the fit's images: small, so that a large VAE fits in seconds on a CPU, and
/// a multiple of every VAE's scale factor times the latent packing's 2.
pub const FIT_SIDE: usize = 64;

/// Factors fitted to `vae` (both halves) on 20 synthetic images and 20 noise latents,
/// and how well they predict its decoder on 10 images the fit did not see.
pub fn fit_vae(vae: &AutoencoderKL) -> Result<(PreviewFactors, FitQuality)> {
    let (f, c) = (
        vae.config().vae_scale_factor(),
        vae.config().latent_channels,
    );
    let mut codec = |x: &Tensor| {
        let (mean, _) = vae.encode(x)?;
        Ok((vae.normalize(&mean), vae.decode(&mean)?))
    };
    let mut decode = |z: &Tensor| vae.decode(&vae.denormalize(z));
    let mut train = samples(&synthetic_images(20, FIT_SIDE, 1), f, &mut codec)?;
    train.extend(noise_samples(20, c, FIT_SIDE / f, f, 1, &mut decode)?);
    let factors = PreviewFactors::fit(&train, c)?;
    let test = samples(&synthetic_images(10, FIT_SIDE, 2), f, &mut codec)?;
    let (pred, target): (Vec<f32>, Vec<f32>) = test
        .iter()
        .flat_map(|s| {
            factors
                .project(&s.latent)
                .into_iter()
                .zip(s.rgb.iter().copied())
        })
        .unzip();
    Ok((factors, quality(&pred, &target)))
}

/// Solves `a x = b` (a symmetric positive definite, `k x k`) by Gaussian elimination
/// with partial pivoting, for three right-hand sides at once.
fn solve(mut a: Vec<f64>, mut b: Vec<[f64; 3]>, k: usize) -> Result<Vec<[f64; 3]>> {
    for col in 0..k {
        let p = (col..k)
            .max_by(|&x, &y| a[x * k + col].abs().total_cmp(&a[y * k + col].abs()))
            .unwrap();
        if a[p * k + col].abs() < 1e-300 {
            return Err(Error::Invalid(
                "preview fit: the latents do not vary".into(),
            ));
        }
        for j in 0..k {
            a.swap(col * k + j, p * k + j);
        }
        b.swap(col, p);
        for r in col + 1..k {
            let f = a[r * k + col] / a[col * k + col];
            for j in col..k {
                a[r * k + j] -= f * a[col * k + j];
            }
            let bc = b[col];
            for (v, c) in b[r].iter_mut().zip(bc) {
                *v -= f * c;
            }
        }
    }
    let mut x = vec![[0.0f64; 3]; k];
    for r in (0..k).rev() {
        for c in 0..3 {
            let s: f64 = (r + 1..k).map(|j| a[r * k + j] * x[j][c]).sum();
            x[r][c] = (b[r][c] - s) / a[r * k + r];
        }
    }
    Ok(x)
}

/// PSNR and correlation of a projection against its target (same layout).
pub fn quality(pred: &[f32], target: &[f32]) -> FitQuality {
    let n = pred.len() as f64;
    let mse = pred
        .iter()
        .zip(target)
        .map(|(p, t)| ((p.clamp(-1.0, 1.0) - t.clamp(-1.0, 1.0)) as f64).powi(2))
        .sum::<f64>()
        / n;
    let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let (mp, mt) = (mean(pred), mean(target));
    let (mut cov, mut vp, mut vt) = (0.0, 0.0, 0.0);
    for (&p, &t) in pred.iter().zip(target) {
        let (dp, dt) = (p as f64 - mp, t as f64 - mt);
        cov += dp * dt;
        vp += dp * dp;
        vt += dt * dt;
    }
    FitQuality {
        psnr_db: 10.0 * (4.0 / mse.max(1e-12)).log10(),
        correlation: cov / (vp * vt).sqrt().max(1e-30),
    }
}

/// Averages a planar `[3, H, W]` image over `f x f` blocks: `[3, H/f, W/f]`.
pub fn downsample(planar: &[f32], width: usize, height: usize, f: usize) -> Vec<f32> {
    let (w, h) = (width / f, height / f);
    let mut out = vec![0.0f32; 3 * w * h];
    let inv = 1.0 / (f * f) as f32;
    for c in 0..3 {
        for y in 0..h * f {
            for x in 0..w * f {
                out[c * w * h + (y / f) * w + x / f] +=
                    planar[c * width * height + y * width + x] * inv;
            }
        }
    }
    out
}

/// The fit's samples from `images`, through a VAE: `codec` maps a `[1, 3, H, W]` image
/// in [-1, 1] to its normalised latent mean `[1, C, h, w]` and the decoder's output
/// `[1, 3, H, W]` for that latent; `f` is the VAE's scale factor.
pub fn samples(
    images: &[Rgb8],
    f: usize,
    codec: &mut dyn FnMut(&Tensor) -> Result<(Tensor, Tensor)>,
) -> Result<Vec<Sample>> {
    images
        .iter()
        .map(|img| {
            let (w, h) = (img.width, img.height);
            let x = Tensor::new([1, 3, h, w], to_model_space(img))?;
            let (latent, decoded) = codec(&x)?;
            Ok(Sample {
                latent: latent.data().to_vec(),
                rgb: downsample(decoded.data(), w, h, f),
            })
        })
        .collect()
}

/// Samples of latents drawn as the sampler starts them (standard normal in the
/// normalised space, `[C, h, w]`), through the decoder alone: `decode` maps a
/// normalised `[1, C, h, w]` latent to the decoder's `[1, 3, f*h, f*w]` output. With
/// them the fit also holds away from encoded images, where a denoising run passes (and
/// where an untrained model's latents stay).
pub fn noise_samples(
    count: usize,
    channels: usize,
    side: usize,
    f: usize,
    seed: u64,
    decode: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Vec<Sample>> {
    let mut rng = SplitMix::new(seed);
    (0..count)
        .map(|_| {
            let latent: Vec<f32> = (0..channels * side * side).map(|_| rng.normal()).collect();
            let decoded = decode(&Tensor::new([1, channels, side, side], latent.clone())?)?;
            Ok(Sample {
                latent,
                rgb: downsample(decoded.data(), side * f, side * f, f),
            })
        })
        .collect()
}

/// Twenty images the fit can always use: smooth random colour fields of a few
/// low-frequency waves each, then hard-edged shapes over them (seeded, `size` square).
/// Real photographs fit better; these keep the fit self-contained.
pub fn synthetic_images(count: usize, size: usize, seed: u64) -> Vec<Rgb8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32
    };
    (0..count)
        .map(|_| {
            let waves: Vec<[f32; 6]> = (0..9).map(|_| std::array::from_fn(|_| next())).collect();
            let shapes: Vec<[f32; 6]> = (0..3).map(|_| std::array::from_fn(|_| next())).collect();
            let mut data = Vec::with_capacity(size * size * 3);
            for y in 0..size {
                for x in 0..size {
                    let (u, v) = (x as f32 / size as f32, y as f32 / size as f32);
                    for c in 0..3 {
                        let mut val = 0.5f32;
                        for wv in &waves[3 * c..3 * c + 3] {
                            let (fx, fy, ph, amp) =
                                (wv[0] * 6.0, wv[1] * 6.0, wv[2] * 6.3, wv[3] * 0.35);
                            val += amp * (fx * u * 6.3 + fy * v * 6.3 + ph).sin();
                        }
                        for sh in &shapes {
                            let (cx, cy, r) = (sh[0], sh[1], 0.08 + 0.2 * sh[2]);
                            if (u - cx).powi(2) + (v - cy).powi(2) < r * r {
                                val = sh[3 + c];
                            }
                        }
                        data.push((val.clamp(0.0, 1.0) * 255.0).round() as u8);
                    }
                }
            }
            Rgb8 {
                width: size,
                height: size,
                data,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_linear_map_exactly() {
        // Latents made from known factors: the fit must give them back.
        let truth = PreviewFactors {
            weight: (0..4)
                .map(|c| [0.1 * c as f32, -0.2, 0.05 * (c * c) as f32])
                .collect(),
            bias: [0.3, -0.1, 0.0],
        };
        let mut x = 1u32;
        let mut rnd = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let samples: Vec<Sample> = (0..3)
            .map(|_| {
                let latent: Vec<f32> = (0..4 * 50).map(|_| rnd()).collect();
                Sample {
                    rgb: truth.project(&latent),
                    latent,
                }
            })
            .collect();
        let fit = PreviewFactors::fit(&samples, 4).unwrap();
        for (a, b) in fit
            .weight
            .iter()
            .flatten()
            .zip(truth.weight.iter().flatten())
        {
            assert!((a - b).abs() < 1e-4, "{fit:?}");
        }
        for (a, b) in fit.bias.iter().zip(&truth.bias) {
            assert!((a - b).abs() < 1e-4, "{fit:?}");
        }
        let q = quality(&fit.project(&samples[0].latent), &samples[0].rgb);
        assert!(q.correlation > 0.9999 && q.psnr_db > 60.0, "{q:?}");
    }
}
