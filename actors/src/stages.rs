//! The CPU stages of a request around the denoise loop: preparation (decode, mask,
//! text, VAE encode, noise) and finishing (VAE decode, paste-back, encode).
//!
//! They are plain functions over a loaded pipeline so that the same code runs in the
//! preprocess and postprocess workers (disaggregated, the default) and inside the
//! denoise process between steps (`[denoise] disaggregate = false`, the baseline). They
//! do exactly what `denoised edit` and `denoised template capture` do, so the daemon's
//! images equal the CLI's on the same inputs.

use std::time::Instant;

use denoised_models::mask::TokenMask;
use denoised_models::pipeline::flux_fill::{EditOptions, FluxFill, Noise, Prepared, Timings};
use denoised_models::pipeline::image::{
    decode_image, decode_mask, encode_jpeg, encode_png, from_model_space, Mask, Rgb8,
};
use denoised_models::pipeline::paste::paste_back;
use denoised_runtime::CpuBackend;

use crate::wire::{ErrorKind, FinishParams, GenParams, ImageFormat, MaskSpec, WireError};

pub type Pipeline = FluxFill<CpuBackend>;

/// The mask of a request, with encoded bytes already read from shared memory.
pub enum MaskInput<'a> {
    Image(&'a [u8]),
    Boxes(&'a [[u32; 4]]),
    Polygons(&'a [Vec<[f32; 2]>]),
    Empty,
}

impl<'a> MaskInput<'a> {
    /// The mask of a request: `image_mask` holds the bytes of a `MaskSpec::Image`.
    pub fn new(spec: &'a MaskSpec, image_mask: Option<&'a [u8]>) -> Self {
        match (spec, image_mask) {
            (MaskSpec::Image(_), Some(b)) => MaskInput::Image(b),
            (MaskSpec::Boxes(b), _) => MaskInput::Boxes(b),
            (MaskSpec::Polygons(p), _) => MaskInput::Polygons(p),
            _ => MaskInput::Empty,
        }
    }
}

/// A prepared request: the pipeline's conditioning plus the token mask.
pub struct Stage1 {
    pub prepared: Prepared,
    pub token_mask: TokenMask,
    pub seconds: f64,
}

/// Maps an engine error on client data to a 4xx-class error.
fn input_error(e: denoised_runtime::Error) -> WireError {
    let msg = e.to_string();
    let kind = if msg.contains("exceeds the limit") {
        ErrorKind::TooLarge
    } else {
        ErrorKind::BadInput
    };
    WireError::new(kind, msg)
}

/// Rasterises boxes or polygons into a `width x height` mask.
pub fn rasterize(spec: &MaskInput<'_>, width: usize, height: usize) -> Mask {
    let mut data = vec![false; width * height];
    match spec {
        MaskInput::Boxes(boxes) => {
            for &[x, y, w, h] in boxes.iter() {
                let (x0, y0) = ((x as usize).min(width), (y as usize).min(height));
                let x1 = (x as usize).saturating_add(w as usize).min(width);
                let y1 = (y as usize).saturating_add(h as usize).min(height);
                for row in y0..y1 {
                    data[row * width + x0..row * width + x1].fill(true);
                }
            }
        }
        MaskInput::Polygons(polys) => {
            for poly in polys.iter().filter(|p| p.len() >= 3) {
                for row in 0..height {
                    for col in 0..width {
                        let (px, py) = (col as f32 + 0.5, row as f32 + 0.5);
                        if inside(poly, px, py) {
                            data[row * width + col] = true;
                        }
                    }
                }
            }
        }
        MaskInput::Image(_) | MaskInput::Empty => {}
    }
    Mask {
        width,
        height,
        data,
    }
}

/// Even-odd point-in-polygon test.
fn inside(poly: &[[f32; 2]], x: f32, y: f32) -> bool {
    let mut c = false;
    let mut j = poly.len() - 1;
    for i in 0..poly.len() {
        let ([xi, yi], [xj, yj]) = (poly[i], poly[j]);
        if (yi > y) != (yj > y) && x < (xj - xi) * (y - yi) / (yj - yi) + xi {
            c = !c;
        }
        j = i;
    }
    c
}

/// Preparation of one request, as `denoised edit` / `template capture` do it.
pub fn prepare(
    p: &Pipeline,
    image_bytes: &[u8],
    mask: MaskInput<'_>,
    params: &GenParams,
    max_pixels: usize,
) -> Result<Stage1, WireError> {
    let t0 = Instant::now();
    let mut limits = p.limits;
    limits.max_pixels = max_pixels;
    let image = decode_image(image_bytes, &limits).map_err(input_error)?;
    let (w, h) = (image.width, image.height);
    let mask = match mask {
        MaskInput::Image(b) => decode_mask(b, w, h, &limits).map_err(input_error)?,
        other => rasterize(&other, w, h),
    };
    let opts = EditOptions {
        steps: params.steps as usize,
        guidance: params.guidance,
        seed: params.seed,
        max_sequence_length: params.max_sequence_length as usize,
        dilation: params.dilation as usize,
        ..Default::default()
    };
    let block = 2 * p.vae_scale_factor();
    let token_mask =
        TokenMask::from_pixels(&mask.data, h, w, block, opts.dilation).map_err(input_error)?;
    let mut t = Timings::default();
    let prepared = p
        .prepare(
            &image,
            &mask,
            &params.prompt,
            &opts,
            &Noise::default(),
            &mut t,
        )
        .map_err(input_error)?;
    Ok(Stage1 {
        prepared,
        token_mask,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// VAE decode, paste-back and encoding of a finished latent.
pub fn finish(
    p: &Pipeline,
    image: &Rgb8,
    mask: &Mask,
    latents: &[f32],
    cols: usize,
    params: &FinishParams,
) -> Result<Vec<u8>, WireError> {
    let raw = p
        .decode_packed(latents, cols, image.width, image.height)
        .map_err(|e| WireError::internal(e.to_string()))?;
    let generated = from_model_space(raw.data(), image.width, image.height);
    let out = if params.paste_back {
        paste_back(image, &generated, mask, params.feather as usize)
    } else {
        generated
    };
    match params.format {
        ImageFormat::Png => encode_png(&out),
        ImageFormat::Jpeg => encode_jpeg(&out, 92),
    }
    .map_err(|e| WireError::internal(e.to_string()))
}

/// The pixel mask as bytes (0/1) for shared memory, and back.
pub fn mask_to_bytes(m: &Mask) -> Vec<u8> {
    m.data.iter().map(|&b| b as u8).collect()
}

pub fn mask_from_bytes(b: Vec<u8>, width: usize, height: usize) -> Result<Mask, WireError> {
    if b.len() != width * height {
        return Err(WireError::internal(format!(
            "pixel mask of {} bytes for a {width}x{height} image",
            b.len()
        )));
    }
    Ok(Mask {
        width,
        height,
        data: b.into_iter().map(|v| v != 0).collect(),
    })
}

pub fn rgb_from_bytes(b: Vec<u8>, width: usize, height: usize) -> Result<Rgb8, WireError> {
    if b.len() != width * height * 3 {
        return Err(WireError::internal(format!(
            "RGB image of {} bytes for {width}x{height}",
            b.len()
        )));
    }
    Ok(Rgb8 {
        width,
        height,
        data: b,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_and_polygons_rasterize_like_brute_force() {
        let m = rasterize(&MaskInput::Boxes(&[[2, 1, 3, 2], [7, 7, 10, 10]]), 8, 8);
        for y in 0..8 {
            for x in 0..8 {
                let want = ((2..5).contains(&x) && (1..3).contains(&y)) || (x == 7 && y == 7);
                assert_eq!(m.data[y * 8 + x], want, "({x},{y})");
            }
        }
        // A square polygon from (1,1) to (5,5) covers pixel centres 1.5..4.5.
        let sq = vec![vec![[1.0, 1.0], [5.0, 1.0], [5.0, 5.0], [1.0, 5.0]]];
        let m = rasterize(&MaskInput::Polygons(&sq), 8, 8);
        for y in 0..8 {
            for x in 0..8 {
                assert_eq!(
                    m.data[y * 8 + x],
                    (1..5).contains(&x) && (1..5).contains(&y)
                );
            }
        }
    }
}
