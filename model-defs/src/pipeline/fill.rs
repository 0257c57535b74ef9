//! FluxFillPipeline's tensor plumbing: latent packing, the Fill conditioning (masked
//! image and space-to-depth mask), exactly as diffusers builds them (fixture README,
//! "Packing" and "Fill conditioning").
//!
//! Packed layouts: a latent `[C, h, w]` (h, w even) becomes `[(h/2)*(w/2), 4C]`, token
//! `r*(w/2) + c` row-major over 2x2 patches, channel `ch*4 + dy*2 + dx`.

use denoised_runtime::{Error, Result, Tensor};

use super::image::Mask;
use crate::flux::weights::SplitMix;
use crate::vae::model::AutoencoderKL;

/// `[C, h, w]` planar -> `[(h/2)*(w/2), 4C]` packed tokens.
pub fn pack_latents(lat: &[f32], c: usize, h: usize, w: usize) -> Result<Tensor> {
    if h % 2 != 0 || w % 2 != 0 || lat.len() != c * h * w {
        return Err(Error::Invalid(format!(
            "cannot pack a latent of {} values as [{c}, {h}, {w}]",
            lat.len()
        )));
    }
    let (th, tw) = (h / 2, w / 2);
    let mut out = vec![0.0f32; c * h * w];
    for r in 0..th {
        for col in 0..tw {
            let t = r * tw + col;
            for ch in 0..c {
                for dy in 0..2 {
                    for dx in 0..2 {
                        out[t * 4 * c + ch * 4 + dy * 2 + dx] =
                            lat[ch * h * w + (2 * r + dy) * w + 2 * col + dx];
                    }
                }
            }
        }
    }
    Tensor::new([th * tw, 4 * c], out)
}

/// The inverse of [`pack_latents`]: `[(h/2)*(w/2), 4C]` -> `[C, h, w]`.
pub fn unpack_latents(t: &Tensor, h: usize, w: usize) -> Result<Vec<f32>> {
    if t.shape().len() != 2 {
        return Err(Error::Invalid(format!(
            "cannot unpack {:?} to a {h}x{w} latent",
            t.shape()
        )));
    }
    unpack_latent_rows(t.data(), t.cols(), h, w)
}

/// [`unpack_latents`] over raw `[rows, cols]` data (e.g. a slice borrowed from shared
/// memory, so a finished latent is decoded without copying it out first).
pub fn unpack_latent_rows(data: &[f32], cols: usize, h: usize, w: usize) -> Result<Vec<f32>> {
    let (th, tw) = (h / 2, w / 2);
    let c = cols / 4;
    if data.len() != th * tw * cols || cols != 4 * c || h % 2 != 0 || w % 2 != 0 {
        return Err(Error::Invalid(format!(
            "cannot unpack {} values of width {cols} to a {h}x{w} latent",
            data.len()
        )));
    }
    let mut out = vec![0.0f32; c * h * w];
    for r in 0..th {
        for col in 0..tw {
            let i = r * tw + col;
            let row = &data[i * cols..(i + 1) * cols];
            for ch in 0..c {
                for dy in 0..2 {
                    for dx in 0..2 {
                        out[ch * h * w + (2 * r + dy) * w + 2 * col + dx] =
                            row[ch * 4 + dy * 2 + dx];
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The packed Fill mask `[(h/2)*(w/2), 4*vsf*vsf]`: space-to-depth by the VAE factor
/// (channel `dy*vsf + dx` for pixel `(y*vsf+dy, x*vsf+dx)`), then packed like latents.
/// No interpolation: every pixel of the mask is kept.
pub fn pack_mask(mask: &Mask, vsf: usize) -> Result<Tensor> {
    let (hh, ww) = (mask.height, mask.width);
    if vsf == 0 || hh % (2 * vsf) != 0 || ww % (2 * vsf) != 0 {
        return Err(Error::Invalid(format!(
            "mask {ww}x{hh} is not a multiple of {}",
            2 * vsf
        )));
    }
    let (h, w) = (hh / vsf, ww / vsf);
    let c = vsf * vsf;
    let mut s2d = vec![0.0f32; c * h * w];
    for y in 0..hh {
        for x in 0..ww {
            if mask.data[y * ww + x] {
                s2d[((y % vsf) * vsf + x % vsf) * h * w + (y / vsf) * w + x / vsf] = 1.0;
            }
        }
    }
    pack_latents(&s2d, c, h, w)
}

/// `image * (1 - mask)` on `[3, H, W]` planar model-space pixels: masked pixels become 0.
pub fn masked_image(image: &[f32], mask: &Mask) -> Vec<f32> {
    let n = mask.width * mask.height;
    image
        .iter()
        .enumerate()
        .map(|(i, &v)| if mask.data[i % n] { 0.0 } else { v })
        .collect()
}

/// A draw from the VAE posterior `N(mean, exp(logvar))` as diffusers'
/// `latent_dist.sample(generator)` takes it: `mean + std * eps`, the N(0, 1) draws from
/// `eps` when given (to reproduce a diffusers run; `what` names it in errors), else
/// from `rng`.
pub fn posterior_sample(
    mean: &Tensor,
    logvar: &Tensor,
    eps: Option<&Tensor>,
    rng: &mut SplitMix,
    what: &str,
) -> Result<Vec<f32>> {
    let std = AutoencoderKL::std_from_logvar(logvar);
    let eps: Vec<f32> = match eps {
        Some(e) if e.len() == mean.len() => e.data().to_vec(),
        Some(e) => {
            return Err(Error::Invalid(format!(
                "{what} has shape {:?}, expected {:?}",
                e.shape(),
                mean.shape()
            )))
        }
        None => (0..mean.len()).map(|_| rng.normal()).collect(),
    };
    Ok(mean
        .data()
        .iter()
        .zip(std.data())
        .zip(&eps)
        .map(|((m, s), e)| m + s * e)
        .collect())
}

/// `pack((z - shift) * scale)`: VAE latents `[C, h, w]` to the transformer's space.
pub fn normalize_and_pack(
    z: &[f32],
    c: usize,
    h: usize,
    w: usize,
    shift: f32,
    scale: f32,
) -> Result<Tensor> {
    let norm: Vec<f32> = z.iter().map(|v| (v - shift) * scale).collect();
    pack_latents(&norm, c, h, w)
}

/// `unpack(x) / scale + shift`: the decoder's input from packed transformer latents.
pub fn unpack_and_denormalize(
    t: &[f32],
    cols: usize,
    h: usize,
    w: usize,
    shift: f32,
    scale: f32,
) -> Result<Vec<f32>> {
    Ok(unpack_latent_rows(t, cols, h, w)?
        .into_iter()
        .map(|v| v / scale + shift)
        .collect())
}

/// Concatenates per-token rows: `[N, a] ++ [N, b] -> [N, a+b]`.
pub fn concat_rows(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.rows() != b.rows() {
        return Err(Error::Invalid(format!(
            "cannot concatenate {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let data = (0..a.rows())
        .flat_map(|r| a.row(r).iter().chain(b.row(r)).copied().collect::<Vec<_>>())
        .collect();
    Tensor::new([a.rows(), a.cols() + b.cols()], data)
}
