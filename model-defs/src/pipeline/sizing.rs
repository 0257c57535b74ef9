//! Any image size: the size an edit is computed at, and the way there and back.
//!
//! The transformer takes images whose sides are multiples of its token (16 pixels for
//! FLUX.1), and its cost grows with the area; photos come at any size, often tens of
//! megapixels. So an edit is computed at the **work size** ([`work_size`]): the input's
//! own size rounded to the token when that is within `max_area`, else the input scaled
//! down (aspect kept) until it is, as diffusers' Kontext pipeline caps its `max_area`.
//! The image goes there with a Lanczos filter and the mask by coverage (a work pixel is
//! masked when any input pixel under it is, so the computed tokens cover every painted
//! pixel). The generated image comes back to the input's size with the same filter,
//! and paste-back then runs at the input's resolution against the input's own pixels
//! and mask, so that everything outside the mask is the input's, bit for bit.
//!
//! An image already at a work size is not touched: no resampling, and the result is
//! what it was before sizes were free.

use image::imageops::FilterType;

use super::image::{Mask, Rgb8};

/// The size an image of `width x height` is computed at: sides multiples of
/// `multiple`, at least one token each; the area at most `max_area` (or one token row
/// and column, for an image so thin that no smaller multiple keeps its shape). An image
/// within `max_area` keeps its size, rounded to the nearest multiple (down when
/// rounding up would pass `max_area`); a larger one is scaled down, keeping its aspect.
pub fn work_size(width: usize, height: usize, multiple: usize, max_area: usize) -> (usize, usize) {
    let m = multiple.max(1);
    let (w0, h0) = (width.max(1) as f64, height.max(1) as f64);
    let floor = |v: f64| ((v / m as f64).floor() as usize * m).max(m);
    let nearest = |v: f64| ((v / m as f64).round() as usize * m).max(m);
    let (mut w, mut h) = if w0 * h0 <= max_area as f64 {
        (nearest(w0), nearest(h0))
    } else {
        let s = (max_area as f64 / (w0 * h0)).sqrt();
        (floor(w0 * s), floor(h0 * s))
    };
    if w * h > max_area {
        let s = (max_area as f64 / (w * h) as f64).sqrt();
        (w, h) = (floor(w as f64 * s), floor(h as f64 * s));
    }
    // A side pinned at one token can leave the other over the area: it gives way.
    if w * h > max_area {
        if h == m {
            w = (max_area / h / m * m).max(m);
        } else {
            h = (max_area / w / m * m).max(m);
        }
    }
    (w, h)
}

/// An image and its mask at the input's size, kept when the work size differs so that
/// the result is pasted back at the input's resolution.
#[derive(Clone, Debug)]
pub struct Source {
    pub image: Rgb8,
    pub mask: Mask,
}

/// The image and mask to compute at `(w, h)`, and the input's own when they were
/// resized (`None`: the input is at a work size already and is used as it is).
pub fn to_work(image: Rgb8, mask: Mask, (w, h): (usize, usize)) -> (Rgb8, Mask, Option<Source>) {
    if (image.width, image.height) == (w, h) {
        return (image, mask, None);
    }
    let work = resize_rgb(&image, w, h);
    let work_mask = cover_mask(&mask, w, h);
    (work, work_mask, Some(Source { image, mask }))
}

/// RGB resized to `w x h` (Lanczos3: sharp, no ringing worth the name on photos).
pub fn resize_rgb(img: &Rgb8, w: usize, h: usize) -> Rgb8 {
    if (img.width, img.height) == (w, h) {
        return img.clone();
    }
    let src = image::RgbImage::from_raw(img.width as u32, img.height as u32, img.data.clone())
        .expect("an Rgb8's buffer matches its size");
    let out = image::imageops::resize(&src, w as u32, h as u32, FilterType::Lanczos3);
    Rgb8 {
        width: w,
        height: h,
        data: out.into_raw(),
    }
}

/// The source pixels `[lo, hi)` under destination pixel `i` of `n` over `from` source
/// pixels (at least one).
fn span(i: usize, n: usize, from: usize) -> (usize, usize) {
    let lo = i * from / n;
    let hi = ((i + 1) * from).div_ceil(n).max(lo + 1).min(from);
    (lo, hi)
}

/// A mask resized to `w x h` by coverage: a pixel is masked when any input pixel it
/// covers is (rows, then columns: the OR is separable).
pub fn cover_mask(mask: &Mask, w: usize, h: usize) -> Mask {
    let (w0, h0) = (mask.width, mask.height);
    let mut rows = vec![false; w * h0];
    for y in 0..h0 {
        let src = &mask.data[y * w0..(y + 1) * w0];
        for x in 0..w {
            let (lo, hi) = span(x, w, w0);
            rows[y * w + x] = src[lo..hi].contains(&true);
        }
    }
    let mut data = vec![false; w * h];
    for y in 0..h {
        let (lo, hi) = span(y, h, h0);
        for yy in lo..hi {
            let src = &rows[yy * w..(yy + 1) * w];
            for (d, &s) in data[y * w..(y + 1) * w].iter_mut().zip(src) {
                *d |= s;
            }
        }
    }
    Mask {
        width: w,
        height: h,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The work size is whole tokens, within the area, and keeps the aspect as
        /// closely as whole tokens can.
        #[test]
        fn the_work_size_is_whole_tokens_within_the_area(
            w in 1usize..20_000, h in 1usize..20_000,
            max_area in 256usize..4_000_000,
        ) {
            let (ww, wh) = work_size(w, h, 16, max_area);
            prop_assert!(ww % 16 == 0 && wh % 16 == 0 && ww >= 16 && wh >= 16);
            prop_assert!(ww * wh <= max_area.max(256), "{ww}x{wh} over {max_area}");
            // A side is off its share of the scale by under one token (the rounding),
            // unless it is pinned at one token or given way to the area.
            let s = ((max_area as f64) / (w * h) as f64).sqrt().min(1.0);
            for (got, side) in [(ww, w), (wh, h)] {
                let want = side as f64 * s;
                if want >= 32.0 && (ww > 16 && wh > 16) {
                    prop_assert!((got as f64 - want).abs() <= 16.0 + want * 0.02,
                        "{w}x{h} -> {ww}x{wh} (area {max_area})");
                }
            }
        }

        /// A covered mask selects every work pixel over a masked input pixel, and
        /// none over only unmasked ones (against brute force on each pixel's footprint).
        #[test]
        fn a_covered_mask_masks_exactly_the_pixels_over_masked_ones(
            w0 in 1usize..40, h0 in 1usize..40, w in 1usize..40, h in 1usize..40,
            bits in prop::collection::vec(any::<bool>(), 1600),
        ) {
            let m = Mask { width: w0, height: h0, data: bits[..w0 * h0].to_vec() };
            let c = cover_mask(&m, w, h);
            for y in 0..h {
                for x in 0..w {
                    let (xl, xh) = span(x, w, w0);
                    let (yl, yh) = span(y, h, h0);
                    let any = (yl..yh).any(|yy| (xl..xh).any(|xx| m.data[yy * w0 + xx]));
                    prop_assert_eq!(c.data[y * w + x], any);
                }
            }
        }
    }

    #[test]
    fn sizes_people_send() {
        let mp = 1024 * 1024;
        // Within the area: rounded to whole tokens.
        assert_eq!(work_size(1000, 700, 16, mp), (1008, 704));
        assert_eq!(work_size(64, 64, 16, mp), (64, 64));
        assert_eq!(work_size(1024, 1024, 16, mp), (1024, 1024));
        // Above it: scaled down, aspect kept.
        assert_eq!(work_size(1080, 1350, 16, mp), (912, 1136));
        assert_eq!(work_size(4000, 3000, 16, mp), (1168, 880));
        assert_eq!(work_size(2048, 2048, 16, mp), (1024, 1024));
        // Tiny and thin images still get a token.
        assert_eq!(work_size(1, 1, 16, mp), (16, 16));
        assert_eq!(work_size(100_000, 3, 16, mp), (65_536, 16));
    }

    #[test]
    fn an_image_at_a_work_size_is_used_as_it_is() {
        let img = Rgb8 {
            width: 32,
            height: 16,
            data: (0..32 * 16 * 3).map(|i| i as u8).collect(),
        };
        let mask = Mask {
            width: 32,
            height: 16,
            data: vec![true; 32 * 16],
        };
        let (w, m, source) = to_work(img.clone(), mask.clone(), (32, 16));
        assert_eq!((w, m), (img.clone(), mask.clone()));
        assert!(source.is_none());
        let (w, m, source) = to_work(img.clone(), mask, (16, 16));
        assert_eq!((w.width, w.height, m.width, m.height), (16, 16, 16, 16));
        assert_eq!(source.unwrap().image, img);
    }

    #[test]
    fn resizing_keeps_a_flat_colour() {
        let img = Rgb8 {
            width: 30,
            height: 20,
            data: [10u8, 200, 90].repeat(600),
        };
        for (w, h) in [(16, 16), (64, 48)] {
            let r = resize_rgb(&img, w, h);
            assert!(r.data.chunks(3).all(|p| p == [10, 200, 90]), "{w}x{h}");
        }
    }
}
