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
fn distance_inside(mask: &Mask, cap: usize) -> Vec<u16> {
    let (w, h) = (mask.width, mask.height);
    let mut d: Vec<u16> = mask
        .data
        .iter()
        .map(|&m| if m { cap as u16 } else { 0 })
        .collect();
    // Each pass lowers a pixel to 1 + the smallest neighbour; `cap` passes suffice.
    for _ in 0..cap {
        let prev = d.clone();
        let mut changed = false;
        for y in 0..h {
            for x in 0..w {
                let i = y * w + x;
                if prev[i] == 0 {
                    continue;
                }
                let mut best = prev[i];
                for yy in y.saturating_sub(1)..(y + 2).min(h) {
                    for xx in x.saturating_sub(1)..(x + 2).min(w) {
                        best = best.min(prev[yy * w + xx] + 1);
                    }
                }
                if best < d[i] {
                    d[i] = best;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
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
