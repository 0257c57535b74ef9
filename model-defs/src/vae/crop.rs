//! Crop-with-halo decoding: for an edit whose output keeps only some pixels (paste-back
//! restores the rest), decode the latent window over those pixels' bounding box, grown
//! by a halo, instead of the whole latent.
//!
//! It needs no template trace (so it serves edits without a template, and templates
//! whose trace is not in memory), runs the dense decoder's own code on a smaller input
//! (on whatever device the VAE is), and costs the window's share of the dense MACs at
//! dense speed. It is not exact: the decoder's GroupNorms take their statistics over
//! the window and its mid-block attention sees only the window, so the kept pixels move
//! a little; the halo keeps the convolutions' near context and moves the statistics
//! toward the whole image's. `DEFAULT_HALO` is chosen from measurements
//! (docs/performance.md, "Crop-with-halo").

use denoised_runtime::{Error, Result, Tensor};

/// Latent pixels of context around the kept pixels' box (64 image pixels for FLUX's
/// 8x VAE): the convolutions between the mid-block and the output reach about 12 latent
/// pixels, and beyond that a wider halo mostly moves the statistics.
pub const DEFAULT_HALO: usize = 16;

/// A window of a latent plane: rows `y0..y1`, columns `x0..x1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub y0: usize,
    pub y1: usize,
    pub x0: usize,
    pub x1: usize,
}

impl Window {
    /// The window of an `lh x lw` latent that covers the image pixels set in `keep`
    /// (`[H * W]`, `H = lh * f`), grown by `halo` latent pixels and clamped; `None` when
    /// nothing is kept.
    pub fn covering(keep: &[bool], lh: usize, lw: usize, f: usize, halo: usize) -> Option<Self> {
        let (h, w) = (lh * f, lw * f);
        if keep.len() != h * w {
            return None;
        }
        let (mut y0, mut y1, mut x0, mut x1) = (h, 0, w, 0);
        for (i, _) in keep.iter().enumerate().filter(|(_, &k)| k) {
            let (y, x) = (i / w, i % w);
            (y0, y1, x0, x1) = (y0.min(y), y1.max(y + 1), x0.min(x), x1.max(x + 1));
        }
        (y1 > 0).then(|| Window {
            y0: (y0 / f).saturating_sub(halo),
            y1: (y1.div_ceil(f) + halo).min(lh),
            x0: (x0 / f).saturating_sub(halo),
            x1: (x1.div_ceil(f) + halo).min(lw),
        })
    }

    /// The window's share of an `lh x lw` plane: what its decode costs against the
    /// whole latent's (the convolutions scale with the pixels; the attention, a few
    /// percent of the decoder, falls faster).
    pub fn fraction(&self, lh: usize, lw: usize) -> f64 {
        ((self.y1 - self.y0) * (self.x1 - self.x0)) as f64 / (lh * lw).max(1) as f64
    }

    /// `z` (`[1, C, lh, lw]`) inside the window.
    pub fn crop(&self, z: &Tensor) -> Result<Tensor> {
        let [1, c, lh, lw] = *z.shape() else {
            return Err(Error::shape(
                "crop",
                format!("one latent, got {:?}", z.shape()),
            ));
        };
        if self.y1 > lh || self.x1 > lw || self.y0 >= self.y1 || self.x0 >= self.x1 {
            return Err(Error::shape(
                "crop",
                format!("{self:?} of a {lh}x{lw} latent"),
            ));
        }
        let (wh, ww) = (self.y1 - self.y0, self.x1 - self.x0);
        let mut out = Vec::with_capacity(c * wh * ww);
        for plane in z.data().chunks_exact(lh * lw) {
            for y in self.y0..self.y1 {
                out.extend_from_slice(&plane[y * lw + self.x0..y * lw + self.x1]);
            }
        }
        Tensor::new([1, c, wh, ww], out)
    }

    /// The decoded window (`[1, C, wh * f, ww * f]`) at its place in an image of
    /// `h x w` pixels, zero elsewhere (pixels no one keeps).
    pub fn place(&self, decoded: &Tensor, h: usize, w: usize, f: usize) -> Result<Tensor> {
        let (wh, ww) = ((self.y1 - self.y0) * f, (self.x1 - self.x0) * f);
        let [1, c, dh, dw] = *decoded.shape() else {
            return Err(Error::shape(
                "crop",
                format!("one image, got {:?}", decoded.shape()),
            ));
        };
        if (dh, dw) != (wh, ww) || self.y1 * f > h || self.x1 * f > w {
            return Err(Error::shape(
                "crop",
                format!("a {dh}x{dw} decode of {self:?} in a {h}x{w} image"),
            ));
        }
        let mut out = vec![0f32; c * h * w];
        for (dst, src) in out
            .chunks_exact_mut(h * w)
            .zip(decoded.data().chunks_exact(wh * ww))
        {
            for (r, row) in src.chunks_exact(ww).enumerate() {
                let at = (self.y0 * f + r) * w + self.x0 * f;
                dst[at..at + ww].copy_from_slice(row);
            }
        }
        Tensor::new([1, c, h, w], out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_covers_the_kept_pixels_and_round_trips() {
        let (lh, lw, f) = (6, 8, 2);
        let mut keep = vec![false; lh * f * lw * f];
        keep[5 * 16 + 3] = true; // pixel (5, 3): latent (2, 1)
        keep[7 * 16 + 9] = true; // pixel (7, 9): latent (3, 4)
        let w0 = Window::covering(&keep, lh, lw, f, 0).unwrap();
        assert_eq!(
            w0,
            Window {
                y0: 2,
                y1: 4,
                x0: 1,
                x1: 5
            }
        );
        let w1 = Window::covering(&keep, lh, lw, f, 3).unwrap();
        assert_eq!(
            w1,
            Window {
                y0: 0,
                y1: 6,
                x0: 0,
                x1: 8
            }
        );
        assert_eq!(w1.fraction(lh, lw), 1.0);
        assert!(Window::covering(&vec![false; keep.len()], lh, lw, f, 1).is_none());

        let z = Tensor::new([1, 2, lh, lw], (0..2 * lh * lw).map(|v| v as f32).collect()).unwrap();
        let c = w0.crop(&z).unwrap();
        assert_eq!(c.shape(), &[1, 2, 2, 4]);
        assert_eq!(c.data()[..4], [17.0, 18.0, 19.0, 20.0]);
        assert_eq!(c.data()[8], 48.0 + 17.0);
        // A "decode" that repeats each latent pixel f x f, placed back: every pixel of
        // the window is its latent pixel's value, everything else zero.
        let up: Vec<f32> = (0..2 * 4 * 8)
            .map(|i| {
                let (ch, y, x) = (i / 32, i / 8 % 4, i % 8);
                c.data()[ch * 8 + (y / f) * 4 + x / f]
            })
            .collect();
        let img = w0
            .place(&Tensor::new([1, 2, 4, 8], up).unwrap(), 12, 16, f)
            .unwrap();
        for (i, &v) in img.data()[..12 * 16].iter().enumerate() {
            let (y, x) = (i / 16, i % 16);
            let inside = (4..8).contains(&y) && (2..10).contains(&x);
            let want = if inside {
                (y / f * lw + x / f) as f32
            } else {
                0.0
            };
            assert_eq!(v, want, "pixel ({y}, {x})");
        }
        assert!(
            w0.place(&c, 12, 16, f).is_err(),
            "a window-sized decode only"
        );
    }
}
