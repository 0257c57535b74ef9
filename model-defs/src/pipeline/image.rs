//! Images in and out: decoding PNG/JPEG uploads, binarising masks, encoding results.
//!
//! Conventions follow diffusers' `VaeImageProcessor` as FluxFillPipeline configures it,
//! so that results match the reference pipeline bit for bit:
//!
//! - **Images** are converted to RGB, scaled to [0, 1] (`u8 / 255`) and normalised to
//!   [-1, 1] (`2x - 1`); EXIF orientation is applied (a photo is what a viewer shows).
//!   The pipeline computes sizes that are multiples of the token size `2 *
//!   vae_scale_factor` (16 for FLUX.1); `ImageLimits::multiple_of` refuses others (the
//!   CLI's reference runs), while the daemon takes any size and computes it at a work
//!   size ([`super::sizing`]), pasting back at the input's own resolution.
//! - **Masks** may be grayscale, grayscale+alpha, RGB or RGBA images of the image's size
//!   (or of its aspect, resized to it). They are converted to luminance as PIL's
//!   `convert("L")` does (`(19595 R + 38470 G + 7471 B + 32768) >> 16`), scaled by 1/255
//!   and binarised: `>= 0.5` (luminance 128 and up) means "repaint". A mask whose alpha
//!   channel is not opaque everywhere (strokes on a transparent layer) is read from its
//!   alpha instead, opaque meaning "repaint" ([`MaskChannel`]). A mask that selects no
//!   pixel is refused.
//! - Decoding is bounded: dimensions are read from the header and checked against the
//!   pixel limit before any pixel buffer is allocated.

use std::io::Cursor;

use denoised_runtime::{Error, Result};
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

/// An RGB image, 8 bits per channel, row-major `[H, W, 3]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb8 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl Rgb8 {
    /// `(largest per-channel level difference, number of differing values)` against an
    /// image of the same size: how outputs are compared with a reference PNG.
    pub fn level_diff(&self, other: &Rgb8) -> (u8, usize) {
        let pairs = self.data.iter().zip(&other.data);
        let worst = pairs
            .clone()
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        (worst, pairs.filter(|(a, b)| a != b).count())
    }
}

/// A binary mask, row-major `[H, W]`; `true` = repaint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mask {
    pub width: usize,
    pub height: usize,
    pub data: Vec<bool>,
}

impl Mask {
    /// Share of masked pixels.
    pub fn ratio(&self) -> f64 {
        self.data.iter().filter(|&&m| m).count() as f64 / self.data.len().max(1) as f64
    }
}

/// Limits on what a decode may produce.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Largest accepted width x height.
    pub max_pixels: usize,
    /// Sides must be multiples of this (2 * vae_scale_factor).
    pub multiple_of: usize,
}

fn decode(bytes: &[u8], what: &str, limits: &ImageLimits) -> Result<DynamicImage> {
    if bytes.is_empty() {
        return Err(Error::Invalid(format!("{what}: empty input")));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Invalid(format!("{what}: cannot read: {e}")))?;
    match reader.format() {
        Some(ImageFormat::Png) | Some(ImageFormat::Jpeg) => {}
        Some(f) => {
            return Err(Error::Invalid(format!(
                "{what}: {f:?} images are not supported (use PNG or JPEG)"
            )))
        }
        None => return Err(Error::Invalid(format!("{what}: not a PNG or JPEG image"))),
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| Error::Invalid(format!("{what}: corrupt or truncated image header: {e}")))?;
    check_size(what, w as usize, h as usize, limits)?;
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
    let mut lim = image::Limits::default();
    lim.max_image_width = Some(w);
    lim.max_image_height = Some(h);
    lim.max_alloc = Some((limits.max_pixels as u64) * 16 + (1 << 20));
    reader.limits(lim);
    let corrupt = |e| Error::Invalid(format!("{what}: corrupt or truncated image: {e}"));
    let mut decoder = reader.into_decoder().map_err(corrupt)?;
    // A phone stores a photo as its sensor read it and says in EXIF how to turn it;
    // unreadable metadata is no orientation (the pixels are what matter).
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    img.apply_orientation(orientation);
    Ok(img)
}

pub(crate) fn check_size(what: &str, w: usize, h: usize, limits: &ImageLimits) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(Error::Invalid(format!(
            "{what}: zero-sized image ({w}x{h})"
        )));
    }
    if w * h > limits.max_pixels {
        return Err(Error::Invalid(format!(
            "{what}: {w}x{h} = {} pixels exceeds the limit of {}",
            w * h,
            limits.max_pixels
        )));
    }
    let m = limits.multiple_of.max(1);
    if w % m != 0 || h % m != 0 {
        return Err(Error::Invalid(format!(
            "{what}: {w}x{h} is not a multiple of {m} pixels in both sides (the model's token size); crop or pad it first"
        )));
    }
    Ok(())
}

/// Decodes an uploaded image (PNG or JPEG) to RGB.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<Rgb8> {
    let img = decode(bytes, "image", limits)?.into_rgb8();
    Ok(Rgb8 {
        width: img.width() as usize,
        height: img.height() as usize,
        data: img.into_raw(),
    })
}

/// Which channel of a mask image marks the pixels to repaint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskChannel {
    /// Alpha when the mask has an alpha channel that is not opaque everywhere (strokes
    /// painted on a transparent layer, as drawing apps save them), else luma.
    #[default]
    Auto,
    /// Luminance: white (128 and up) is repaint; alpha is ignored.
    Luma,
    /// Alpha: opaque (128 and up) is repaint, transparent is kept.
    Alpha,
}

/// A mask image for an image of `width x height`: the same size, or the same aspect
/// (within 1%), then resized to it (a triangle filter; binarised after).
fn decode_mask_image(
    bytes: &[u8],
    width: usize,
    height: usize,
    limits: &ImageLimits,
) -> Result<DynamicImage> {
    // A mask is resized to the image, so its sides need not be multiples of the token.
    let any_side = ImageLimits {
        multiple_of: 1,
        ..*limits
    };
    let img = decode(bytes, "mask", &any_side)?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    if (w, h) == (width, height) {
        return Ok(img);
    }
    let (aspect, want) = (w as f64 / h as f64, width as f64 / height as f64);
    if (aspect / want - 1.0).abs() > 0.01 {
        return Err(Error::Invalid(format!(
            "mask is {w}x{h} but the image is {width}x{height}: another aspect ratio \
             (a mask of another size is resized to the image only when their aspects match)"
        )));
    }
    let filter = image::imageops::FilterType::Triangle;
    Ok(img.resize_exact(width as u32, height as u32, filter))
}

/// Decodes a mask image and binarises it, reading the channel `channel` names (the
/// native API's masks); it must be `width x height` or of that aspect. An empty mask is
/// a mask (`denoised edit` reproduces a template's capture with one).
pub fn decode_mask(
    bytes: &[u8],
    width: usize,
    height: usize,
    limits: &ImageLimits,
    channel: MaskChannel,
) -> Result<Mask> {
    read_mask(bytes, width, height, limits, channel).map(|(m, _)| m)
}

/// [`decode_mask`] for a request to the daemon: a mask that selects no pixel is an
/// error that says how to mark one (an edit of nothing is a client's mistake there).
pub fn decode_edit_mask(
    bytes: &[u8],
    width: usize,
    height: usize,
    limits: &ImageLimits,
    channel: MaskChannel,
) -> Result<Mask> {
    let (mask, alpha) = read_mask(bytes, width, height, limits, channel)?;
    if mask.data.contains(&true) {
        return Ok(mask);
    }
    Err(Error::Invalid(match alpha {
        true => "the mask selects no pixel: read from its alpha channel (it has \
                 transparent pixels), none is opaque; paint the area to repaint opaque, \
                 or send mask_channel \"luma\" to read its brightness"
            .into(),
        false => "the mask selects no pixel: none is white (brightness 128 or more); \
                  paint the area to repaint white, or opaque on a transparent layer"
            .into(),
    }))
}

/// A mask, and whether it was read from its alpha channel.
fn read_mask(
    bytes: &[u8],
    width: usize,
    height: usize,
    limits: &ImageLimits,
    channel: MaskChannel,
) -> Result<(Mask, bool)> {
    let img = decode_mask_image(bytes, width, height, limits)?;
    let alpha = match channel {
        MaskChannel::Luma => false,
        MaskChannel::Alpha if !img.color().has_alpha() => {
            return Err(Error::Invalid(
                "mask_channel is alpha but the mask has no alpha channel".into(),
            ))
        }
        MaskChannel::Alpha => true,
        MaskChannel::Auto => img.color().has_alpha() && !opaque(&img),
    };
    let level: Vec<u8> = match (alpha, img) {
        (true, img) => img.into_rgba8().pixels().map(|p| p.0[3]).collect(),
        (false, DynamicImage::ImageLuma8(g)) => g.into_raw(),
        (false, DynamicImage::ImageLumaA8(g)) => {
            g.into_raw().chunks_exact(2).map(|p| p[0]).collect()
        }
        (false, other) => other
            .into_rgb8()
            .into_raw()
            .chunks_exact(3)
            .map(|p| pil_luma(p[0], p[1], p[2]))
            .collect(),
    };
    let data: Vec<bool> = level.into_iter().map(|l| l >= 128).collect();
    let mask = Mask {
        width,
        height,
        data,
    };
    Ok((mask, alpha))
}

/// Whether every pixel of `img` is opaque (an alpha channel that says nothing).
fn opaque(img: &DynamicImage) -> bool {
    match img {
        DynamicImage::ImageLumaA8(g) => g.pixels().all(|p| p.0[1] == 255),
        DynamicImage::ImageRgba8(g) => g.pixels().all(|p| p.0[3] == 255),
        other => other.to_rgba8().pixels().all(|p| p.0[3] == 255),
    }
}

/// The mask of an image in OpenAI's convention (the Images API's edits): its fully
/// transparent pixels (alpha 0) are the area to edit. `bytes` is a PNG with an alpha
/// channel, of `width x height` or its aspect (the image itself, when the request has
/// no mask).
pub fn decode_alpha_mask(
    bytes: &[u8],
    width: usize,
    height: usize,
    limits: &ImageLimits,
) -> Result<Mask> {
    let img = decode_mask_image(bytes, width, height, limits)?;
    if !img.color().has_alpha() {
        return Err(Error::Invalid(
            "the mask has no alpha channel: its fully transparent pixels mark the area to edit (a PNG with transparency)".into(),
        ));
    }
    let data: Vec<bool> = img.into_rgba8().pixels().map(|p| p.0[3] == 0).collect();
    if !data.contains(&true) {
        return Err(Error::Invalid(
            "the mask selects no pixel: none is fully transparent (without a mask, none of \
             the image's); make the area to edit transparent"
                .into(),
        ));
    }
    Ok(Mask {
        width,
        height,
        data,
    })
}

/// A mask as the 8-bit grey PNG the native API takes (white = repaint).
pub fn encode_mask_png(mask: &Mask) -> Result<Vec<u8>> {
    let px = mask.data.iter().map(|&m| if m { 255 } else { 0 }).collect();
    let buf = image::GrayImage::from_raw(mask.width as u32, mask.height as u32, px)
        .ok_or_else(|| Error::Invalid("mask buffer does not match its size".into()))?;
    let mut out = Vec::new();
    buf.write_to(&mut Cursor::new(&mut out), ImageFormat::Png)
        .map_err(|e| Error::Invalid(format!("PNG encode: {e}")))?;
    Ok(out)
}

/// PIL's RGB -> L conversion (ITU-R 601-2 luma in 16-bit fixed point).
pub fn pil_luma(r: u8, g: u8, b: u8) -> u8 {
    ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16) as u8
}

/// `[3, H, W]` planar floats in [-1, 1], as `VaeImageProcessor.preprocess` makes them.
pub fn to_model_space(img: &Rgb8) -> Vec<f32> {
    let n = img.width * img.height;
    let mut out = vec![0.0f32; 3 * n];
    for (i, px) in img.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = 2.0 * (px[c] as f32 / 255.0) - 1.0;
        }
    }
    out
}

/// The pipeline's output conversion: `[3, H, W]` raw decoder output to 8-bit RGB:
/// `clamp(x * 0.5 + 0.5, 0, 1)`, then `round(x * 255)`.
pub fn from_model_space(planar: &[f32], width: usize, height: usize) -> Rgb8 {
    let n = width * height;
    let mut data = vec![0u8; 3 * n];
    for i in 0..n {
        for c in 0..3 {
            let v = (planar[c * n + i] * 0.5 + 0.5).clamp(0.0, 1.0);
            data[i * 3 + c] = (v * 255.0).round() as u8;
        }
    }
    Rgb8 {
        width,
        height,
        data,
    }
}

/// Encodes RGB as PNG.
pub fn encode_png(img: &Rgb8) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let buf = image::RgbImage::from_raw(img.width as u32, img.height as u32, img.data.clone())
        .ok_or_else(|| Error::Invalid("image buffer does not match its size".into()))?;
    buf.write_to(&mut Cursor::new(&mut out), ImageFormat::Png)
        .map_err(|e| Error::Invalid(format!("PNG encode: {e}")))?;
    Ok(out)
}

/// Encodes RGB as JPEG at `quality` (1-100).
pub fn encode_jpeg(img: &Rgb8, quality: u8) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality.clamp(1, 100))
        .encode(
            &img.data,
            img.width as u32,
            img.height as u32,
            image::ExtendedColorType::Rgb8,
        )
        .map_err(|e| Error::Invalid(format!("JPEG encode: {e}")))?;
    Ok(out)
}

/// WebP's largest side (its header has 14 bits a side).
pub const WEBP_MAX_SIDE: usize = 16383;

/// Encodes RGB as lossy WebP at `quality` (0-100), by libwebp.
pub fn encode_webp(img: &Rgb8, quality: u8) -> Result<Vec<u8>> {
    if img.width > WEBP_MAX_SIDE || img.height > WEBP_MAX_SIDE {
        return Err(Error::Invalid(format!(
            "a {}x{} image cannot be WebP (at most {WEBP_MAX_SIDE} pixels a side): ask for png or jpeg",
            img.width, img.height
        )));
    }
    let enc = webp::Encoder::from_rgb(&img.data, img.width as u32, img.height as u32);
    Ok(enc.encode(quality.min(100) as f32).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: ImageLimits = ImageLimits {
        max_pixels: 4096 * 4096,
        multiple_of: 4,
    };

    fn png(img: DynamicImage) -> Vec<u8> {
        let mut v = Vec::new();
        img.write_to(&mut Cursor::new(&mut v), ImageFormat::Png)
            .unwrap();
        v
    }

    /// A phone's photo with EXIF Orientation 6, written by PIL: decoded as a viewer
    /// shows it (PIL's `exif_transpose`), not as stored.
    #[test]
    fn exif_orientation_is_honoured() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/photos/");
        let any = ImageLimits {
            max_pixels: 1 << 20,
            multiple_of: 1,
        };
        let jpg = std::fs::read(format!("{dir}exif_rotated.jpg")).unwrap();
        let shown = std::fs::read(format!("{dir}exif_rotated_display.png")).unwrap();
        let got = decode_image(&jpg, &any).unwrap();
        let want = decode_image(&shown, &any).unwrap();
        assert_eq!(
            (got.width, got.height),
            (32, 48),
            "stored 48x32, shown 32x48"
        );
        // Red on top, blue below, as PIL shows it (two JPEG decoders differ by a few
        // levels at the colour seam, so the comparison is by pixel, within 24 levels).
        assert_eq!((want.width, want.height), (32, 48));
        let far = got
            .data
            .iter()
            .zip(&want.data)
            .filter(|(a, b)| a.abs_diff(**b) > 24)
            .count();
        assert_eq!(far, 0, "pixels unlike PIL's exif_transpose");
        assert!(
            got.data[0] > 200 && got.data[got.data.len() - 1] > 200,
            "red top, blue bottom"
        );
    }

    /// Lossy WebP: a valid file (libwebp decodes it, at its size, close to the
    /// input), smaller at a lower quality.
    #[test]
    fn webp_is_lossy_and_smaller_at_a_lower_quality() {
        let img = Rgb8 {
            width: 96,
            height: 64,
            data: (0..96 * 64 * 3).map(|i| ((i * 37) % 251) as u8).collect(),
        };
        let (hi, lo) = (
            encode_webp(&img, 95).unwrap(),
            encode_webp(&img, 20).unwrap(),
        );
        assert!(lo.len() < hi.len(), "{} vs {}", lo.len(), hi.len());
        let back = webp::Decoder::new(&hi).decode().unwrap();
        assert_eq!((back.width(), back.height()), (96, 64));
        let wide = Rgb8 {
            width: WEBP_MAX_SIDE + 1,
            height: 1,
            data: vec![0; (WEBP_MAX_SIDE + 1) * 3],
        };
        assert!(encode_webp(&wide, 90).is_err());
    }

    #[test]
    fn luma_matches_pil() {
        // Values computed with PIL's Image.convert("L") on single pixels.
        assert_eq!(pil_luma(255, 255, 255), 255);
        assert_eq!(pil_luma(0, 0, 0), 0);
        assert_eq!(pil_luma(255, 0, 0), 76);
        assert_eq!(pil_luma(0, 255, 0), 150);
        assert_eq!(pil_luma(0, 0, 255), 29);
        assert_eq!(pil_luma(128, 128, 128), 128);
    }

    #[test]
    fn openai_masks_edit_the_transparent_pixels() {
        let (w, h) = (8, 4);
        let rgba = image::RgbaImage::from_fn(w, h, |x, y| {
            image::Rgba([
                200,
                10,
                10,
                if x >= 4 && y < 2 {
                    0
                } else {
                    (x * 30 + 1) as u8
                },
            ])
        });
        let m = decode_alpha_mask(&png(DynamicImage::ImageRgba8(rgba)), 8, 4, &LIM).unwrap();
        let want: Vec<bool> = (0..h)
            .flat_map(|y| (0..w).map(move |x| x >= 4 && y < 2))
            .collect();
        assert_eq!(
            m.data, want,
            "alpha 0 is the edit area; any other alpha is kept"
        );
        // As the native API's mask, it reads back the same.
        let back = decode_mask(
            &encode_mask_png(&m).unwrap(),
            8,
            4,
            &LIM,
            Default::default(),
        )
        .unwrap();
        assert_eq!(back, m);
        // A mask without alpha says what it lacks; a wrong size is refused.
        let grey = png(DynamicImage::ImageLuma8(image::GrayImage::new(8, 4)));
        let e = decode_alpha_mask(&grey, 8, 4, &LIM)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no alpha channel"), "{e}");
        assert!(decode_alpha_mask(&grey, 4, 4, &LIM).is_err());
    }

    /// A mask painted in a drawing app: black, opaque strokes on a transparent layer.
    fn strokes(w: u32, h: u32) -> (Vec<u8>, Vec<bool>) {
        let inside = |x: u32, y: u32| x >= w / 2 && y < h / 2;
        let rgba = image::RgbaImage::from_fn(w, h, |x, y| match inside(x, y) {
            true => image::Rgba([0, 0, 0, 255]),
            false => image::Rgba([0, 0, 0, 0]),
        });
        let want = (0..h)
            .flat_map(|y| (0..w).map(move |x| inside(x, y)))
            .collect();
        (png(DynamicImage::ImageRgba8(rgba)), want)
    }

    #[test]
    fn masks_painted_in_alpha_are_read_from_alpha() {
        let (bytes, want) = strokes(8, 4);
        let m = decode_mask(&bytes, 8, 4, &LIM, MaskChannel::Auto).unwrap();
        assert_eq!(m.data, want, "opaque strokes are the area to repaint");
        assert_eq!(
            decode_mask(&bytes, 8, 4, &LIM, MaskChannel::Alpha).unwrap(),
            m
        );
        // Read as luma, black strokes select nothing: a 400 that says so.
        let e = decode_edit_mask(&bytes, 8, 4, &LIM, MaskChannel::Luma)
            .unwrap_err()
            .to_string();
        let nothing = decode_mask(&bytes, 8, 4, &LIM, MaskChannel::Luma).unwrap();
        assert!(!nothing.data.contains(&true), "an empty mask, for the CLI");
        assert!(e.contains("selects no pixel") && e.contains("white"), "{e}");
        // An opaque mask's alpha says nothing: luma, as before.
        let grey =
            image::GrayImage::from_fn(8, 4, |x, _| image::Luma([if x < 2 { 255 } else { 0 }]));
        let opaque = png(DynamicImage::ImageRgba8(
            DynamicImage::ImageLuma8(grey).into_rgba8(),
        ));
        let m = decode_mask(&opaque, 8, 4, &LIM, MaskChannel::Auto).unwrap();
        assert_eq!(m.data.iter().filter(|&&b| b).count(), 8);
        // Forcing alpha on a mask without one is an error that says so.
        let rgb = png(DynamicImage::ImageRgb8(image::RgbImage::new(8, 4)));
        let e = decode_mask(&rgb, 8, 4, &LIM, MaskChannel::Alpha)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no alpha channel"), "{e}");
        // All black, all transparent: nothing selected, each with its own fix.
        let e = decode_edit_mask(&rgb, 8, 4, &LIM, MaskChannel::Auto)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("selects no pixel") && e.contains("paint the area"),
            "{e}"
        );
        let clear = png(DynamicImage::ImageRgba8(image::RgbaImage::new(8, 4)));
        let e = decode_edit_mask(&clear, 8, 4, &LIM, MaskChannel::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("selects no pixel") && e.contains("alpha"), "{e}");
        let e = decode_alpha_mask(&opaque, 8, 4, &LIM)
            .unwrap_err()
            .to_string();
        assert!(e.contains("none is fully transparent"), "{e}");
    }

    #[test]
    fn a_mask_of_the_images_aspect_is_resized_to_it_and_another_is_refused() {
        // Painted at half the image's size (and not a multiple of the token size).
        let (half, _) = strokes(10, 6);
        let (full, want) = strokes(20, 12);
        let m = decode_mask(&half, 20, 12, &LIM, MaskChannel::Auto).unwrap();
        assert_eq!((m.width, m.height), (20, 12));
        let same = m.data.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert!(same >= 240 - 12, "{same} of 240 pixels as at full size");
        assert_eq!(
            decode_mask(&full, 20, 12, &LIM, MaskChannel::Auto)
                .unwrap()
                .data,
            want
        );
        let (square, _) = strokes(12, 12);
        let e = decode_mask(&square, 20, 12, &LIM, MaskChannel::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("another aspect ratio"), "{e}");
    }

    #[test]
    fn mask_formats_binarise_alike() {
        let (w, h) = (8, 4);
        let gray = image::GrayImage::from_fn(w, h, |x, _| image::Luma([(x * 36) as u8]));
        let want: Vec<bool> = (0..h).flat_map(|_| (0..w).map(|x| x * 36 >= 128)).collect();
        let rgb = DynamicImage::ImageLuma8(gray.clone()).into_rgb8();
        let rgba = DynamicImage::ImageLuma8(gray.clone()).into_rgba8();
        for bytes in [
            png(DynamicImage::ImageLuma8(gray)),
            png(DynamicImage::ImageRgb8(rgb)),
            png(DynamicImage::ImageRgba8(rgba)),
        ] {
            let m = decode_mask(&bytes, 8, 4, &LIM, Default::default()).unwrap();
            assert_eq!(m.data, want);
        }
    }

    #[test]
    fn bad_inputs_are_clear_errors() {
        let ok = png(DynamicImage::ImageRgb8(image::RgbImage::new(8, 8)));
        let err = |r: Result<Rgb8>| r.unwrap_err().to_string();
        assert!(err(decode_image(&ok[..ok.len() / 2], &LIM)).contains("corrupt or truncated"));
        assert!(err(decode_image(b"not an image at all", &LIM)).contains("not a PNG or JPEG"));
        assert!(err(decode_image(&[], &LIM)).contains("empty"));
        let odd = png(DynamicImage::ImageRgb8(image::RgbImage::new(10, 8)));
        assert!(err(decode_image(&odd, &LIM)).contains("not a multiple of 4"));
        let small = ImageLimits {
            max_pixels: 32,
            multiple_of: 4,
        };
        assert!(err(decode_image(&ok, &small)).contains("exceeds the limit"));
        let e = decode_mask(&ok, 16, 8, &LIM, Default::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("mask is 8x8 but the image is 16x8"), "{e}");
        let e = decode_mask(b"hello", 8, 8, &LIM, Default::default())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mask:"), "{e}");
    }

    #[test]
    fn jpeg_decodes() {
        let src = image::RgbImage::from_fn(16, 8, |x, y| {
            image::Rgb([(x * 16) as u8, (y * 32) as u8, 128])
        });
        let mut jpg = Vec::new();
        DynamicImage::ImageRgb8(src.clone())
            .write_to(&mut Cursor::new(&mut jpg), ImageFormat::Jpeg)
            .unwrap();
        let img = decode_image(&jpg, &LIM).unwrap();
        assert_eq!((img.width, img.height), (16, 8));
        // Lossy, but close to the source.
        let worst = img
            .data
            .iter()
            .zip(src.as_raw())
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert!(worst < 40, "{worst}");
        let m = decode_mask(&jpg, 16, 8, &LIM, Default::default()).unwrap();
        assert_eq!(m.data.len(), 128);
    }

    #[test]
    fn png_round_trip() {
        let img = Rgb8 {
            width: 4,
            height: 4,
            data: (0..48).map(|i| (i * 5) as u8).collect(),
        };
        assert_eq!(decode_image(&encode_png(&img).unwrap(), &LIM).unwrap(), img);
    }
}
