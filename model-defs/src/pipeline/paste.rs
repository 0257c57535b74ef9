//! Paste-back: the edited image keeps the original pixels outside the mask.
//!
//! The VAE round trip changes every pixel slightly, and users notice when pixels they
//! did not mask drift. So the output takes the input's pixels, bit for bit, wherever the
//! mask is off; inside the mask it takes the generated pixels, blended toward the
//! original over a feather of `feather` pixels next to the seam so the edge does not
//! show. The feather lies entirely inside the mask, which keeps the outside exact.

use super::image::{Mask, Rgb8};

/// For each masked pixel, its Chebyshev distance to the nearest unmasked pixel, capped
/// at `cap` (unmasked pixels get 0).
///
/// Two raster passes (a chamfer transform with unit weights to all eight neighbours,
/// which is exact for the Chebyshev metric): linear in the pixels whatever `cap`, so a
/// paste at a photo's resolution (tens of megapixels) stays cheap.
fn distance_inside(mask: &Mask, cap: usize) -> Vec<u16> {
    let (w, h) = (mask.width, mask.height);
    let cap = cap.min(u16::MAX as usize - 1) as u16;
    let mut d: Vec<u16> = mask.data.iter().map(|&m| if m { cap } else { 0 }).collect();
    // Forward: the neighbours above and to the left.
    for y in 0..h {
        for x in 0..w {
            let i = y * w + x;
            if d[i] == 0 {
                continue;
            }
            let mut best = d[i];
            if x > 0 {
                best = best.min(d[i - 1] + 1);
            }
            if y > 0 {
                let up = i - w;
                best = best.min(d[up] + 1);
                if x > 0 {
                    best = best.min(d[up - 1] + 1);
                }
                if x + 1 < w {
                    best = best.min(d[up + 1] + 1);
                }
            }
            d[i] = best;
        }
    }
    // Backward: below and to the right.
    for y in (0..h).rev() {
        for x in (0..w).rev() {
            let i = y * w + x;
            if d[i] == 0 {
                continue;
            }
            let mut best = d[i];
            if x + 1 < w {
                best = best.min(d[i + 1] + 1);
            }
            if y + 1 < h {
                let down = i + w;
                best = best.min(d[down] + 1);
                if x > 0 {
                    best = best.min(d[down - 1] + 1);
                }
                if x + 1 < w {
                    best = best.min(d[down + 1] + 1);
                }
            }
            d[i] = best;
        }
    }
    d
}

/// Combines the generated image with the original: outside the mask the original
/// exactly; inside, the generated pixels, feathered over `feather` pixels at the seam.
pub fn paste_back(original: &Rgb8, generated: &Rgb8, mask: &Mask, feather: usize) -> Rgb8 {
    let dist = distance_inside(mask, feather + 1);
    let mut out = original.clone();
    for (i, &d) in dist.iter().enumerate() {
        if d == 0 {
            continue;
        }
        // Weight of the generated pixel: 1/(F+1) at the seam up to 1 beyond the feather.
        let a = (d as f32 / (feather + 1) as f32).min(1.0);
        for c in 0..3 {
            let (o, g) = (
                original.data[i * 3 + c] as f32,
                generated.data[i * 3 + c] as f32,
            );
            out.data[i * 3 + c] = (a * g + (1.0 - a) * o).round().clamp(0.0, 255.0) as u8;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The distance by definition: the nearest unmasked pixel by brute force, capped.
    fn brute_distance(mask: &Mask, cap: usize) -> Vec<u16> {
        let (w, h) = (mask.width, mask.height);
        (0..w * h)
            .map(|i| {
                if !mask.data[i] {
                    return 0;
                }
                let (x, y) = ((i % w) as i64, (i / w) as i64);
                let nearest = (0..w * h)
                    .filter(|&j| !mask.data[j])
                    .map(|j| {
                        let (u, v) = ((j % w) as i64, (j / w) as i64);
                        (u - x).abs().max((v - y).abs()) as usize
                    })
                    .min()
                    .unwrap_or(cap);
                nearest.min(cap) as u16
            })
            .collect()
    }

    proptest! {
        #[test]
        fn the_two_pass_distance_is_the_chebyshev_distance(
            w in 1usize..24, h in 1usize..24, cap in 1usize..12,
            bits in prop::collection::vec(prop::bool::weighted(0.8), 576),
        ) {
            let mask = Mask { width: w, height: h, data: bits[..w * h].to_vec() };
            prop_assert_eq!(distance_inside(&mask, cap), brute_distance(&mask, cap));
        }
    }

    #[test]
    fn outside_is_exact_inside_is_generated_and_seam_is_blended() {
        let (w, h) = (12, 10);
        let original = Rgb8 {
            width: w,
            height: h,
            data: (0..w * h * 3).map(|i| (i * 7 % 256) as u8).collect(),
        };
        let generated = Rgb8 {
            width: w,
            height: h,
            data: vec![200; w * h * 3],
        };
        let mask = Mask {
            width: w,
            height: h,
            data: (0..w * h)
                .map(|i| (2..10).contains(&(i % w)) && (2..9).contains(&(i / w)))
                .collect(),
        };
        for feather in [0, 2] {
            let out = paste_back(&original, &generated, &mask, feather);
            for i in 0..w * h {
                let px = &out.data[i * 3..i * 3 + 3];
                if !mask.data[i] {
                    assert_eq!(
                        px,
                        &original.data[i * 3..i * 3 + 3],
                        "pixel {i} outside the mask changed"
                    );
                }
            }
            // Deep inside (distance > feather) the generated value wins.
            let centre = 5 * w + 5;
            assert_eq!(&out.data[centre * 3..centre * 3 + 3], &[200, 200, 200]);
            // At the seam with a feather, a blend (neither value) appears.
            let seam = 2 * w + 5;
            if feather > 0 {
                assert_ne!(out.data[seam * 3], 200);
            } else {
                assert_eq!(out.data[seam * 3], 200);
            }
        }
    }
}
