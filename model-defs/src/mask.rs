//! Token masks: which image tokens an edit must compute.
//!
//! Flux packs 2x2 latent patches and the VAE downsamples by `vae_scale_factor`, so one
//! image token covers a `(2*vsf) x (2*vsf)` pixel block (16x16 for real Flux, 4x4 for the
//! tiny reference model). A token is *active* if any pixel of its block is masked;
//! optional dilation adds a ring of N tokens (Chebyshev distance) around the active set,
//! which gives the model context across the seam. Token indices are row-major over the
//! token grid, the order of the packed latent sequence.

use denoised_runtime::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct TokenMask {
    /// Token grid rows and columns.
    pub rows: usize,
    pub cols: usize,
    /// Active token indices, ascending.
    active: Vec<u32>,
    /// Fraction of masked pixels (before dilation).
    pub pixel_ratio: f64,
}

impl TokenMask {
    /// Builds the token mask of a binary pixel mask (`true` = repaint) of `height x width`
    /// pixels. Both sides must be multiples of `block` (= 2 * vae_scale_factor).
    pub fn from_pixels(
        mask: &[bool],
        height: usize,
        width: usize,
        block: usize,
        dilation: usize,
    ) -> Result<Self> {
        if block == 0 || height == 0 || width == 0 || height % block != 0 || width % block != 0 {
            return Err(Error::Invalid(format!(
                "mask of {width}x{height} pixels is not a positive multiple of the {block}-pixel token size"
            )));
        }
        if mask.len() != height * width {
            return Err(Error::Invalid(format!(
                "mask has {} pixels, expected {width}x{height}",
                mask.len()
            )));
        }
        let (rows, cols) = (height / block, width / block);
        let mut on = vec![false; rows * cols];
        let mut masked = 0usize;
        for y in 0..height {
            let line = &mask[y * width..(y + 1) * width];
            for (x, &m) in line.iter().enumerate() {
                if m {
                    masked += 1;
                    on[(y / block) * cols + x / block] = true;
                }
            }
        }
        let mut tm = TokenMask::from_tokens(rows, cols, &on)?;
        tm = tm.dilate(dilation);
        tm.pixel_ratio = masked as f64 / mask.len() as f64;
        Ok(tm)
    }

    /// From a per-token flag grid (`rows * cols`, row-major).
    pub fn from_tokens(rows: usize, cols: usize, on: &[bool]) -> Result<Self> {
        if on.len() != rows * cols {
            return Err(Error::Invalid(format!(
                "{} token flags for a {rows}x{cols} grid",
                on.len()
            )));
        }
        let active: Vec<u32> = on
            .iter()
            .enumerate()
            .filter(|(_, &a)| a)
            .map(|(i, _)| i as u32)
            .collect();
        let pixel_ratio = active.len() as f64 / (rows * cols).max(1) as f64;
        Ok(TokenMask {
            rows,
            cols,
            active,
            pixel_ratio,
        })
    }

    /// Every token active: a full run expressed as an edit.
    pub fn full(rows: usize, cols: usize) -> Self {
        TokenMask {
            rows,
            cols,
            active: (0..(rows * cols) as u32).collect(),
            pixel_ratio: 1.0,
        }
    }

    /// Adds every token within Chebyshev distance `n` of an active token.
    pub fn dilate(mut self, n: usize) -> Self {
        if n == 0 || self.active.is_empty() {
            return self;
        }
        let (rows, cols) = (self.rows, self.cols);
        // Separable max filter: first along rows, then along columns.
        let mut on = vec![false; rows * cols];
        for &a in &self.active {
            on[a as usize] = true;
        }
        let mut horiz = vec![false; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                if on[r * cols + c] {
                    for cc in c.saturating_sub(n)..(c + n + 1).min(cols) {
                        horiz[r * cols + cc] = true;
                    }
                }
            }
        }
        let mut out = vec![false; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                if horiz[r * cols + c] {
                    for rr in r.saturating_sub(n)..(r + n + 1).min(rows) {
                        out[rr * cols + c] = true;
                    }
                }
            }
        }
        self.active = out
            .iter()
            .enumerate()
            .filter(|(_, &a)| a)
            .map(|(i, _)| i as u32)
            .collect();
        self
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn active(&self) -> &[u32] {
        &self.active
    }
    /// Token indices not in the active set, ascending.
    pub fn inactive(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len() - self.active.len());
        let mut it = self.active.iter().peekable();
        for i in 0..self.len() as u32 {
            if it.peek() == Some(&&i) {
                it.next();
            } else {
                out.push(i);
            }
        }
        out
    }
    /// Fraction of tokens active (after dilation).
    pub fn token_ratio(&self) -> f64 {
        self.active.len() as f64 / self.len().max(1) as f64
    }
}

impl TokenMask {
    /// A random irregular mask with exactly `count` active tokens: a few blobs grown
    /// from random seeds by random flood fill, like hand-drawn inpainting masks.
    /// Deterministic for a seed (benchmarks and load generators).
    pub fn random_blobs(rows: usize, cols: usize, count: usize, seed: u64) -> Self {
        let n = rows * cols;
        let count = count.min(n);
        let mut rng = seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut next = move |m: usize| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng >> 33) as usize) % m.max(1)
        };
        let mut on = vec![false; n];
        let mut frontier: Vec<usize> = Vec::new();
        let mut got = 0;
        let blobs = 1 + count / 256;
        while got < count {
            if frontier.is_empty() || (got < blobs && next(4) == 0) {
                let s = next(n);
                if !on[s] {
                    on[s] = true;
                    got += 1;
                }
                frontier.push(s);
                continue;
            }
            let k = next(frontier.len());
            let t = frontier[k];
            let (r, c) = (t / cols, t % cols);
            let nb: Vec<usize> = [
                (r > 0).then(|| t - cols),
                (r + 1 < rows).then(|| t + cols),
                (c > 0).then(|| t - 1),
                (c + 1 < cols).then(|| t + 1),
            ]
            .into_iter()
            .flatten()
            .filter(|&x| !on[x])
            .collect();
            if nb.is_empty() {
                frontier.swap_remove(k);
                continue;
            }
            let x = nb[next(nb.len())];
            on[x] = true;
            got += 1;
            frontier.push(x);
        }
        TokenMask::from_tokens(rows, cols, &on).expect("flags match the grid")
    }
}

/// Reads a mask-ratio trace: one ratio in [0, 1] per line; blank lines and `#`
/// comments are skipped.
pub fn read_ratio_trace(path: impl AsRef<std::path::Path>) -> Result<Vec<f64>> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.parse::<f64>() {
            Ok(v) if (0.0..=1.0).contains(&v) => out.push(v),
            _ => {
                return Err(Error::Invalid(format!(
                    "{}:{}: `{line}` is not a ratio in [0, 1]",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    if out.is_empty() {
        return Err(Error::Invalid(format!("{}: no ratios", path.display())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Brute force: a token is active iff a masked pixel lies within `n` tokens of it.
    fn brute(mask: &[bool], h: usize, w: usize, block: usize, n: usize) -> Vec<u32> {
        let (rows, cols) = (h / block, w / block);
        let mut out = vec![];
        for r in 0..rows {
            for c in 0..cols {
                let hit = (0..h).any(|y| {
                    (0..w).any(|x| {
                        mask[y * w + x]
                            && (y / block).abs_diff(r) <= n
                            && (x / block).abs_diff(c) <= n
                    })
                });
                if hit {
                    out.push((r * cols + c) as u32);
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn matches_brute_force(rows in 1usize..7, cols in 1usize..7, block in 1usize..5, n in 0usize..3,
                               seed in any::<u64>(), density in 0.0f64..0.3) {
            let (h, w) = (rows * block, cols * block);
            let mut s = seed;
            let mask: Vec<bool> = (0..h * w).map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f64 / (1u64 << 31) as f64) < density
            }).collect();
            let tm = TokenMask::from_pixels(&mask, h, w, block, n).unwrap();
            prop_assert_eq!(tm.active(), &brute(&mask, h, w, block, n)[..]);
            let mut all: Vec<u32> = tm.active().iter().copied().chain(tm.inactive()).collect();
            all.sort();
            prop_assert_eq!(all, (0..(rows * cols) as u32).collect::<Vec<_>>());
            let masked = mask.iter().filter(|&&m| m).count() as f64 / (h * w) as f64;
            prop_assert!((tm.pixel_ratio - masked).abs() < 1e-12);
        }
    }

    #[test]
    fn random_blobs_have_the_exact_count() {
        for (count, seed) in [(0, 1), (1, 2), (205, 3), (819, 4), (4096, 5)] {
            let m = TokenMask::random_blobs(64, 64, count, seed);
            assert_eq!(m.active().len(), count);
        }
        assert_eq!(
            TokenMask::random_blobs(8, 8, 20, 9),
            TokenMask::random_blobs(8, 8, 20, 9)
        );
    }

    #[test]
    fn traces_parse() {
        let dir = denoised_runtime::fixtures::fixtures_dir().join("traces");
        let prod = read_ratio_trace(dir.join("production_faceswap_tryon.txt")).unwrap();
        let mean = prod.iter().sum::<f64>() / prod.len() as f64;
        assert!(
            prod.len() > 900 && (mean - 0.11).abs() < 0.01,
            "{} ratios, mean {mean}",
            prod.len()
        );
        let bad = std::env::temp_dir().join("denoised-bad-trace.txt");
        std::fs::write(&bad, "0.1\n1.5\n").unwrap();
        assert!(read_ratio_trace(&bad)
            .unwrap_err()
            .to_string()
            .contains(":2:"));
    }

    #[test]
    fn edge_cases() {
        let (h, w, b) = (16, 24, 4);
        // Empty mask: nothing to compute.
        let empty = TokenMask::from_pixels(&vec![false; h * w], h, w, b, 2).unwrap();
        assert!(
            empty.active().is_empty() && empty.token_ratio() == 0.0 && empty.pixel_ratio == 0.0
        );
        assert_eq!(empty.inactive().len(), 24);
        // Full mask.
        let full = TokenMask::from_pixels(&vec![true; h * w], h, w, b, 0).unwrap();
        assert_eq!(full, TokenMask::full(4, 6));
        // One pixel: one token, and its ring when dilated.
        let mut one = vec![false; h * w];
        one[5 * w + 9] = true; // token (1, 2)
        let t = TokenMask::from_pixels(&one, h, w, b, 0).unwrap();
        assert_eq!(t.active(), &[8]);
        assert!((t.pixel_ratio - 1.0 / 384.0).abs() < 1e-12);
        let t1 = TokenMask::from_pixels(&one, h, w, b, 1).unwrap();
        assert_eq!(t1.active(), &[1, 2, 3, 7, 8, 9, 13, 14, 15]);
        // A mask touching the corner: dilation is clipped at the borders.
        let mut corner = vec![false; h * w];
        corner[h * w - 1] = true;
        let tc = TokenMask::from_pixels(&corner, h, w, b, 1).unwrap();
        assert_eq!(tc.active(), &[16, 17, 22, 23]);
        // Sizes that are not token multiples are rejected with a clear message.
        let e = TokenMask::from_pixels(&vec![false; 15 * 24], 15, 24, 4, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("24x15") && e.contains("4-pixel"), "{e}");
        assert!(TokenMask::from_pixels(&[true; 3], 16, 24, 4, 0).is_err());
    }
}
