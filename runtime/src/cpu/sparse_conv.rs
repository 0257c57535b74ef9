//! Spatially sparse convolution (SIGE) on the CPU: a convolution evaluated only on the
//! active tiles of its output, on top of a copy of a cached output.
//!
//! An edit changes its image only inside the mask, so at every layer of the VAE the
//! activations differ from the template's only in a region: the mask grown by the
//! receptive field of the layers so far ([`grow`]). A sparse layer starts from the
//! template's cached output and recomputes the tiles of its output that the region
//! touches ([`Tiles`]), with three things fused that a dense layer does in separate
//! passes:
//!
//! - the **gather** reads each tile's input window (the tile's receptive field, clipped
//!   to the image) once, applying the preceding GroupNorm as a per-channel scale and
//!   shift and the SiLU on the way ([`PreAct`]); the zero padding of the convolution
//!   stays zero, as in the dense layer, where the convolution pads its already
//!   normalised input;
//! - the **convolution** runs on the gathered window: im2col of the tile, then one GEMM
//!   with the whole weight, the layout [`super::conv::conv2d`] uses (pixels as the GEMM's
//!   rows, so the product lands column-major in the tile's NCHW planes);
//! - the **scatter** writes the tile into the output, bias and the residual (read at the
//!   tile's pixels) added in the same pass.
//!
//! Every geometry the FLUX VAE has is covered: 3x3 stride 1, 3x3 stride 2 with the
//! (0,1,0,1) padding of diffusers' `Downsample2D`, nearest 2x upsampling folded into a
//! 3x3 convolution (`Upsample2D`), and 1x1 shortcuts. GroupNorm statistics for the
//! gather come from [`GroupSums`]: the template's (frozen, as the SIGE paper does), or
//! updated exactly from the changed tiles' old and new values (incremental).
//!
//! Only batches of one image: an edit is one image against one template.

mod plane;

pub use plane::{Plane, TileData};

use rayon::prelude::*;

use super::conv::{patches_times_weight, scale_shift_in_place, Conv2dOpts};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Square tiles of an `h x w` plane, the active ones listed in row-major order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tiles {
    pub h: usize,
    pub w: usize,
    pub size: usize,
    /// `(tile row, tile column)` of each active tile.
    pub active: Vec<(usize, usize)>,
}

impl Tiles {
    /// The tiles of an `h x w` plane holding any pixel of `region` (`[h * w]`,
    /// row-major).
    pub fn covering(region: &[bool], h: usize, w: usize, size: usize) -> Result<Tiles> {
        if region.len() != h * w || size == 0 {
            return Err(Error::shape(
                "sparse tiles",
                format!(
                    "region of {} pixels for a {h}x{w} plane, tile size {size}",
                    region.len()
                ),
            ));
        }
        let (th, tw) = (h.div_ceil(size), w.div_ceil(size));
        let mut on = vec![false; th * tw];
        for (i, _) in region.iter().enumerate().filter(|(_, &r)| r) {
            on[(i / w / size) * tw + (i % w) / size] = true;
        }
        let active = (0..th * tw)
            .filter(|&t| on[t])
            .map(|t| (t / tw, t % tw))
            .collect();
        Ok(Tiles { h, w, size, active })
    }

    /// Every tile of the plane.
    pub fn all(h: usize, w: usize, size: usize) -> Tiles {
        let region = vec![true; h * w];
        Tiles::covering(&region, h, w, size.max(1)).expect("a region of the plane's size")
    }

    /// Pixel rectangle `(y0, y1, x0, x1)` of active tile `i`, clipped to the plane.
    pub fn rect(&self, i: usize) -> (usize, usize, usize, usize) {
        let (ty, tx) = self.active[i];
        let (y0, x0) = (ty * self.size, tx * self.size);
        (
            y0,
            (y0 + self.size).min(self.h),
            x0,
            (x0 + self.size).min(self.w),
        )
    }

    /// Pixels the active tiles cover.
    pub fn pixels(&self) -> usize {
        (0..self.active.len())
            .map(|i| {
                let (y0, y1, x0, x1) = self.rect(i);
                (y1 - y0) * (x1 - x0)
            })
            .sum()
    }
}

/// The output pixels of a convolution whose value depends on any input pixel of
/// `region` (`[h * w]`): the region grown by the kernel (`k x k`) through the layer's
/// geometry. Returns the output region and its size.
pub fn grow(
    region: &[bool],
    h: usize,
    w: usize,
    k: usize,
    opts: Conv2dOpts,
) -> (Vec<bool>, usize, usize) {
    let (oh, ow) = out_size(h, w, k, opts);
    let mut out = vec![false; oh * ow];
    let (up, s) = (if opts.upsample2x { 2 } else { 1 }, opts.stride);
    let [pt, _, pl, _] = opts.pad;
    // Output index range whose window [o*s - pad, o*s - pad + k) holds upsampled input
    // coordinate u.
    let span = |u: usize, pad: usize, n: usize| {
        let u = u + pad;
        let lo = (u + 1).saturating_sub(k).div_ceil(s);
        let hi = (u / s + 1).min(n);
        lo..hi
    };
    for (i, _) in region.iter().enumerate().filter(|(_, &r)| r) {
        let (iy, ix) = (i / w, i % w);
        for uy in iy * up..(iy + 1) * up {
            for oy in span(uy, pt, oh) {
                for ux in ix * up..(ix + 1) * up {
                    for ox in span(ux, pl, ow) {
                        out[oy * ow + ox] = true;
                    }
                }
            }
        }
    }
    (out, oh, ow)
}

/// The input pixels (`[h * w]`) that the outputs of `out_region` (`[oh * ow]`, the
/// layer's output plane) read: the backward twin of [`grow`], for the region a later
/// layer needs. A window's zero padding reads nothing.
pub fn grow_back(out_region: &[bool], h: usize, w: usize, k: usize, opts: Conv2dOpts) -> Vec<bool> {
    let (oh, ow) = out_size(h, w, k, opts);
    debug_assert_eq!(out_region.len(), oh * ow);
    let (up, s) = (if opts.upsample2x { 2 } else { 1 }, opts.stride.max(1));
    let [pt, _, pl, _] = opts.pad;
    // Input index range (before upsampling) read by output o along one axis.
    let span = |o: usize, pad: usize, n: usize| {
        let lo = (o * s).saturating_sub(pad);
        let hi = (o * s + k).saturating_sub(pad).min(n * up);
        (lo / up)..hi.div_ceil(up).max(lo / up)
    };
    let mut inp = vec![false; h * w];
    for (i, _) in out_region.iter().enumerate().filter(|(_, &r)| r) {
        let (oy, ox) = (i / ow, i % ow);
        let xs = span(ox, pl, w);
        for iy in span(oy, pt, h) {
            inp[iy * w + xs.start..iy * w + xs.end].fill(true);
        }
    }
    inp
}

/// Output size of a `k x k` convolution with `opts` on an `h x w` input.
pub fn out_size(h: usize, w: usize, k: usize, opts: Conv2dOpts) -> (usize, usize) {
    let up = if opts.upsample2x { 2 } else { 1 };
    let [pt, pb, pl, pr] = opts.pad;
    let s = opts.stride.max(1);
    (
        (h * up + pt + pb).saturating_sub(k) / s + 1,
        (w * up + pl + pr).saturating_sub(k) / s + 1,
    )
}

/// What the gather applies to each input value: `x * scale[c] + shift[c]` (a GroupNorm
/// with its statistics folded in), then SiLU when `silu`.
#[derive(Clone, Copy, Debug)]
pub struct PreAct<'a> {
    pub scale: &'a [f32],
    pub shift: &'a [f32],
    pub silu: bool,
}

/// Per-group sums of a GroupNorm's input, in f64: what its statistics are made of, and
/// what an edit updates from the values it changed.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSums {
    pub groups: usize,
    /// Elements per group.
    pub count: usize,
    pub sum: Vec<f64>,
    pub sumsq: Vec<f64>,
}

impl GroupSums {
    /// The sums of `x` (`[1, C, H, W]`) over `groups` groups of channels.
    pub fn of(x: &Tensor, groups: usize) -> Result<GroupSums> {
        let Plane { c, h, w, .. } = Plane::of(x)?;
        if groups == 0 || c % groups != 0 {
            return Err(Error::shape(
                "group sums",
                format!("{c} channels are not divisible into {groups} groups"),
            ));
        }
        let glen = c / groups * h * w;
        let (sum, sumsq) = x
            .data()
            .par_chunks(glen)
            .map(|g| {
                g.iter().fold((0.0f64, 0.0f64), |(s, q), &v| {
                    (s + v as f64, q + v as f64 * v as f64)
                })
            })
            .unzip();
        Ok(GroupSums {
            groups,
            count: glen,
            sum,
            sumsq,
        })
    }

    /// Updates the sums with the recomputed tiles of a value (`new`) against the
    /// cached values they replace (`old`, the tiles' plane; its own tiles, if it has
    /// any, are not read).
    pub fn update(&mut self, old: Plane<'_>, new: &TileData) -> Result<()> {
        let Plane { c, h, w, .. } = old;
        if (new.c, new.tiles.h, new.tiles.w) != (c, h, w) || c % self.groups != 0 {
            return Err(Error::shape(
                "group sums",
                format!(
                    "old {:?}, tiles of [{}, {}, {}] in {} groups",
                    [c, h, w],
                    new.c,
                    new.tiles.h,
                    new.tiles.w,
                    self.groups
                ),
            ));
        }
        let cpg = c / self.groups;
        let od = old.base;
        let tiles = &new.tiles;
        let deltas: Vec<(f64, f64)> = (0..self.groups)
            .into_par_iter()
            .map(|g| {
                let (mut ds, mut dq) = (0.0f64, 0.0f64);
                for i in 0..tiles.active.len() {
                    let (y0, y1, x0, x1) = tiles.rect(i);
                    let tw = x1 - x0;
                    let block = new.block(i);
                    for ch in g * cpg..(g + 1) * cpg {
                        let rows = block[ch * (y1 - y0) * tw..].chunks_exact(tw);
                        for (y, nrow) in (y0..y1).zip(rows) {
                            let orow = &od[(ch * h + y) * w + x0..][..tw];
                            let (s, q) = delta_sums(orow, nrow);
                            ds += s;
                            dq += q;
                        }
                    }
                }
                (ds, dq)
            })
            .collect();
        for (g, (ds, dq)) in deltas.into_iter().enumerate() {
            self.sum[g] += ds;
            self.sumsq[g] += dq;
        }
        Ok(())
    }

    /// Per-channel `(scale, shift)` of the GroupNorm with these statistics and affine
    /// `weight`, `bias`: `y = x * scale + shift`, as [`super::conv::group_norm`] applies it.
    pub fn scale_shift(&self, weight: &[f32], bias: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
        let cpg = weight.len() / self.groups;
        let n = self.count.max(1) as f64;
        let (mut scale, mut shift) = (vec![0.0; weight.len()], vec![0.0; weight.len()]);
        for ch in 0..weight.len() {
            let g = ch / cpg;
            let mean = self.sum[g] / n;
            let var = (self.sumsq[g] / n - mean * mean).max(0.0);
            let (mean, rstd) = (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32);
            scale[ch] = rstd * weight[ch];
            shift[ch] = bias[ch] - mean * scale[ch];
        }
        (scale, shift)
    }
}

/// `(Σ (n - o), Σ (n² - o²))` in f64, over a row of old and new values.
fn delta_sums(old: &[f32], new: &[f32]) -> (f64, f64) {
    old.iter().zip(new).fold((0.0, 0.0), |(s, q), (&o, &n)| {
        let (o, n) = (o as f64, n as f64);
        (s + (n - o), q + (n * n - o * o))
    })
}

/// `conv2d(pre(x), w, bias) (+ residual)` at the active tiles of `tiles` (over the
/// output plane), as [`TileData`]: the layer's output is then the cached output with
/// these tiles over it. `x` is `[1, I, H, W]`, `w` `[O, I, k, k]`, `residual`
/// `[1, O, OH, OW]`.
pub fn sparse_conv2d(
    x: Plane<'_>,
    w: &Tensor,
    bias: Option<&Tensor>,
    opts: Conv2dOpts,
    pre: Option<PreAct<'_>>,
    residual: Option<Plane<'_>>,
    tiles: Tiles,
) -> Result<TileData> {
    const OP: &str = "sparse_conv2d";
    let (ci, h, wd) = (x.c, x.h, x.w);
    let (co, k) = match *w.shape() {
        [co, wci, kh, kw] if wci == ci && kh == kw && kh > 0 => (co, kh),
        ref s => {
            return Err(Error::shape(
                OP,
                format!("weight {s:?} for input {:?} (square kernels)", x.shape()),
            ))
        }
    };
    let (oh, ow) = out_size(h, wd, k, opts);
    let want = [1, co, oh, ow];
    if residual.is_some_and(|r| r.shape() != want) {
        return Err(Error::shape(
            OP,
            format!(
                "residual {:?}, expected {want:?}",
                residual.map(|r| r.shape())
            ),
        ));
    }
    if (tiles.h, tiles.w) != (oh, ow) {
        return Err(Error::shape(
            OP,
            format!("tiles of {}x{} for a {oh}x{ow} output", tiles.h, tiles.w),
        ));
    }
    if bias.is_some_and(|b| b.len() != co)
        || pre.is_some_and(|p| p.scale.len() != ci || p.shift.len() != ci)
    {
        return Err(Error::shape(OP, "bias or GroupNorm of the wrong size"));
    }
    let g = Window {
        ci,
        h,
        w: wd,
        k,
        stride: opts.stride.max(1),
        up: if opts.upsample2x { 2 } else { 1 },
        pad_top: opts.pad[0],
        pad_left: opts.pad[2],
    };
    let wdat = w.data();
    let bias = bias.map(|b| b.data());
    let kk = ci * k * k;
    // Consecutive tiles share one GEMM (a group's pixels are its rows), so small tiles
    // do not mean small GEMMs; groups are sized like conv2d's bands, with enough of
    // them for every thread.
    let groups = group_tiles(&tiles, kk);
    // Each group computed into its own [O, group pixels] block, then copied tile by
    // tile into the output's tiles.
    let blocks: Vec<Vec<f32>> = groups
        .par_iter()
        .map_init(
            || (Vec::<f32>::new(), Vec::<f32>::new()),
            |(win, col), range| {
                let rects: Vec<_> = range.clone().map(|i| tiles.rect(i)).collect();
                let np: usize = rects.iter().map(|r| (r.1 - r.0) * (r.3 - r.2)).sum();
                let mut block = vec![0.0f32; co * np];
                col.resize(kk * np, 0.0);
                let mut off = 0;
                for &(y0, y1, x0, x1) in &rects {
                    let tw = x1 - x0;
                    for o in 0..co {
                        let dst = &mut block[o * np + off..][..(y1 - y0) * tw];
                        let bv = bias.map_or(0.0, |b| b[o]);
                        match residual {
                            Some(r) => {
                                for (y, d) in (y0..y1).zip(dst.chunks_exact_mut(tw)) {
                                    r.read_row(o, y, x0, x1, d);
                                    d.iter_mut().for_each(|d| *d += bv);
                                }
                            }
                            None => dst.fill(bv),
                        }
                    }
                    let span = g.gather(x, pre, (y0, y1, x0, x1), win);
                    g.im2col(win, span, (y0, y1, x0, x1), col, np, off);
                    off += (y1 - y0) * tw;
                }
                // out[pixel, o] += patches[pixel, kk] @ w[o, kk]ᵀ, column-major in the
                // block (see conv2d for the orientation).
                // SAFETY: lhs (p, j) = col[j*np + p] for p < np, j < kk; rhs (j, o) =
                // w[o*kk + j]; dst (p, o) = block[o*np + p]: all inside their buffers.
                unsafe {
                    patches_times_weight(
                        np,
                        co,
                        kk,
                        block.as_mut_ptr(),
                        np,
                        true,
                        col.as_ptr(),
                        np,
                        wdat.as_ptr(),
                    )
                };
                block
            },
        )
        .collect();
    let mut out = TileData::new(tiles, co);
    for (range, block) in groups.iter().zip(&blocks) {
        let np = block.len() / co;
        let mut off = 0;
        for i in range.clone() {
            let dst = out.block_mut(i);
            let tp = dst.len() / co;
            for (o, d) in dst.chunks_exact_mut(tp).enumerate() {
                d.copy_from_slice(&block[o * np + off..][..tp]);
            }
            off += tp;
        }
    }
    Ok(out)
}

/// Patch-matrix elements a group of tiles aims for (conv2d's band size: 1 MB of f32).
const GROUP_ELEMS: usize = 1 << 18;

/// Runs of consecutive active tiles, each about [`GROUP_ELEMS`] of patch matrix (`kk`
/// rows per pixel), at least one tile, and enough runs for ~4 tasks per thread.
fn group_tiles(tiles: &Tiles, kk: usize) -> Vec<std::ops::Range<usize>> {
    let n = tiles.active.len();
    let per_tile = tiles.size * tiles.size;
    let by_size = (GROUP_ELEMS / (kk * per_tile).max(1)).max(1);
    let by_tasks = n.div_ceil(4 * rayon::current_num_threads()).max(1);
    let len = by_size.min(by_tasks);
    (0..n.div_ceil(len))
        .map(|g| g * len..((g + 1) * len).min(n))
        .collect()
}

/// The input geometry of one sparse convolution.
struct Window {
    ci: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    up: usize,
    pad_top: usize,
    pad_left: usize,
}

/// The input rows and columns (before upsampling) a tile's window holds.
#[derive(Clone, Copy)]
struct Span {
    y0: usize,
    y1: usize,
    x0: usize,
    x1: usize,
}

impl Window {
    /// Input range (pre-upsampling, clipped) read by outputs `o0..o1` along one axis.
    fn range(&self, o0: usize, o1: usize, pad: usize, n: usize) -> (usize, usize) {
        let lo = (o0 * self.stride).saturating_sub(pad) / self.up;
        let hi_up = ((o1 - 1) * self.stride + self.k).saturating_sub(pad);
        let hi = hi_up.div_ceil(self.up).min(n);
        (lo.min(hi), hi)
    }

    /// Copies the input window of output tile `(y0, y1, x0, x1)` into `win`
    /// (`[ci, rows, cols]`), the GroupNorm and SiLU applied once per value.
    fn gather(
        &self,
        x: Plane<'_>,
        pre: Option<PreAct<'_>>,
        (y0, y1, x0, x1): (usize, usize, usize, usize),
        win: &mut Vec<f32>,
    ) -> Span {
        let (sy0, sy1) = self.range(y0, y1, self.pad_top, self.h);
        let (sx0, sx1) = self.range(x0, x1, self.pad_left, self.w);
        let (rows, cols) = (sy1 - sy0, sx1 - sx0);
        win.resize(self.ci * rows * cols, 0.0);
        for c in 0..self.ci {
            for (r, y) in (sy0..sy1).enumerate() {
                let dst = &mut win[(c * rows + r) * cols..][..cols];
                x.read_row(c, y, sx0, sx1, dst);
                if let Some(p) = pre {
                    // The dense GroupNorm's own (vectorised) pass, so both agree to
                    // the bit.
                    scale_shift_in_place(dst, p.scale[c], p.shift[c], p.silu);
                }
            }
        }
        Span {
            y0: sy0,
            y1: sy1,
            x0: sx0,
            x1: sx1,
        }
    }

    /// im2col of output tile `(y0, y1, x0, x1)` from its gathered window: row
    /// `(c, ky, kx)` of `col` holds, per output pixel, the (upsampled, zero-padded)
    /// input it multiplies with weight `[:, c, ky, kx]`.
    /// The tile's pixels go to columns `off..` of `col`'s rows of length `ld`.
    #[allow(clippy::too_many_arguments)]
    fn im2col(
        &self,
        win: &[f32],
        s: Span,
        (y0, y1, x0, x1): (usize, usize, usize, usize),
        col: &mut [f32],
        ld: usize,
        off: usize,
    ) {
        let (rows, cols) = (s.y1 - s.y0, s.x1 - s.x0);
        let (hv, wv) = (self.h * self.up, self.w * self.up);
        let np = (y1 - y0) * (x1 - x0);
        let tw = x1 - x0;
        let mut dst_rows = col.chunks_exact_mut(ld).map(|r| &mut r[off..off + np]);
        for c in 0..self.ci {
            let wc = &win[c * rows * cols..(c + 1) * rows * cols];
            for ky in 0..self.k {
                for kx in 0..self.k {
                    let drow = dst_rows.next().expect("col sized for ci*k*k rows");
                    // Output columns whose input column `ox*s + kx - pad_left` is
                    // inside the image (the rest read the zero padding).
                    let st = self.stride;
                    let lo = self.pad_left.saturating_sub(kx).div_ceil(st).clamp(x0, x1);
                    let hi = (wv + self.pad_left)
                        .saturating_sub(kx)
                        .div_ceil(st)
                        .clamp(lo, x1);
                    for (oy, dst) in (y0..y1).zip(drow.chunks_exact_mut(tw)) {
                        let uy = (oy * st + ky).wrapping_sub(self.pad_top);
                        if uy >= hv {
                            dst.fill(0.0);
                            continue;
                        }
                        let src = &wc[(uy / self.up - s.y0) * cols..][..cols];
                        dst[..lo - x0].fill(0.0);
                        dst[hi - x0..].fill(0.0);
                        if lo == hi {
                            continue;
                        }
                        let ux0 = lo * st + kx - self.pad_left;
                        let d = &mut dst[lo - x0..hi - x0];
                        if st == 1 && self.up == 1 {
                            d.copy_from_slice(&src[ux0 - s.x0..][..hi - lo]);
                        } else {
                            for (j, d) in d.iter_mut().enumerate() {
                                *d = src[(ux0 + j * st) / self.up - s.x0];
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
