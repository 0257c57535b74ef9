//! Spatially sparse convolution (SIGE) on the CPU: a convolution evaluated only at the
//! region's pixels of its output, on top of a cached output.
//!
//! An edit changes its image only inside the mask, so at every layer of the VAE the
//! activations differ from the template's only in a region: the mask grown by the
//! receptive field of the layers so far ([`grow`]). A sparse layer starts from the
//! template's cached output and recomputes the runs of region pixels in the tiles of
//! its output that the region touches ([`Tiles`]; a tile is the unit a value is stored
//! in, a run the unit of work, so the ragged edge of a region costs no MACs), with
//! three things fused that a dense layer does in separate passes:
//!
//! - the **gather** reads the input window of a tile's runs (their receptive field,
//!   clipped to the image) once, applying the preceding GroupNorm as a per-channel
//!   scale and shift and the SiLU on the way ([`PreAct`]); the zero padding of the
//!   convolution stays zero, as in the dense layer, where the convolution pads its
//!   already normalised input;
//! - the **convolution** runs on the gathered windows: im2col of the runs of a group
//!   of consecutive tiles, then one GEMM with the whole weight, the layout
//!   [`super::conv::conv2d`] uses (pixels as the GEMM's rows, so the product lands
//!   column-major, channel by channel);
//! - the **scatter** writes the runs into their tiles, bias and the residual (read at
//!   the runs' pixels) added in the same pass, and the tiles' other pixels from the
//!   cached output.
//!
//! Every geometry the FLUX VAE has is covered: 3x3 stride 1, 3x3 stride 2 with the
//! (0,1,0,1) padding of diffusers' `Downsample2D`, nearest 2x upsampling folded into a
//! 3x3 convolution (`Upsample2D`), and 1x1 shortcuts. GroupNorm statistics for the
//! gather come from [`GroupSums`]: the template's (frozen, as the SIGE paper does), or
//! updated exactly from the changed runs' old and new values (incremental).
//!
//! Only batches of one image: an edit is one image against one template.

mod plane;
mod tiles;

pub use plane::{Plane, TileData};
pub use tiles::{Run, Tiles};

use rayon::prelude::*;

use super::conv::{
    patches_times_weight, scale_shift_in_place, spread_row, with_scratch, Conv2dOpts,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

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

    /// Updates the sums with the recomputed runs of a value (`new`) against the cached
    /// values they replace (`old`, the tiles' plane; its own tiles, if it has any, are
    /// not read). A tile's pixels outside its runs must hold `old`'s values, as a
    /// sparse layer leaves them.
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
                    // Only the runs changed: a tile's other pixels hold the cached
                    // values.
                    let (y0, y1, x0, x1) = tiles.rect(i);
                    let (tw, tp) = (x1 - x0, (y1 - y0) * (x1 - x0));
                    let block = new.block(i);
                    for ch in g * cpg..(g + 1) * cpg {
                        for r in tiles.runs(i) {
                            let orow = &od[(ch * h + r.y) * w + r.x0..][..r.len()];
                            let at = ch * tp + (r.y - y0) * tw + r.x0 - x0;
                            let (s, q) = delta_sums(orow, &block[at..at + r.len()]);
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

/// `(Σ (n - o), Σ (n² - o²))` in f64, over a row of old and new values: in four
/// independent lanes, so the adds pipeline (one chain of f64 adds is latency-bound).
fn delta_sums(old: &[f32], new: &[f32]) -> (f64, f64) {
    let (mut s, mut q) = ([0.0f64; 4], [0.0f64; 4]);
    let (oc, nc) = (old.chunks_exact(4), new.chunks_exact(4));
    let tail = oc.remainder().iter().zip(nc.remainder());
    for (o, n) in oc.zip(nc) {
        for l in 0..4 {
            let (o, n) = (o[l] as f64, n[l] as f64);
            s[l] += n - o;
            q[l] += n * n - o * o;
        }
    }
    for (&o, &n) in tail {
        let (o, n) = (o as f64, n as f64);
        s[0] += n - o;
        q[0] += n * n - o * o;
    }
    (s.iter().sum(), q.iter().sum())
}

/// `conv2d(pre(x), w, bias) (+ residual)` at the runs of `tiles` (over the output
/// plane), as [`TileData`]: the layer's output is then the cached output with these
/// tiles over it, and the tiles' pixels outside the runs keep `cached` (the layer's
/// cached output). `x` is `[1, I, H, W]`, `w` `[O, I, k, k]`, `residual` and `cached`
/// `[1, O, OH, OW]`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_conv2d(
    x: Plane<'_>,
    w: &Tensor,
    bias: Option<&Tensor>,
    opts: Conv2dOpts,
    pre: Option<PreAct<'_>>,
    residual: Option<Plane<'_>>,
    cached: Plane<'_>,
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
    if residual.is_some_and(|r| r.shape() != want) || cached.shape() != want {
        return Err(Error::shape(
            OP,
            format!(
                "residual {:?} and cached output {:?}, expected {want:?}",
                residual.map(|r| r.shape()),
                cached.shape()
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
    // Consecutive tiles share one GEMM (their computed pixels are its rows), so small
    // tiles and ragged ones do not mean small GEMMs.
    let groups = group_tiles(&tiles);
    let mut out = TileData::new(tiles, co);
    let (tiles, parts) = out.parts_mut(&groups);
    parts.into_par_iter().zip(&groups).for_each(|(dst, range)| {
        with_scratch(|[win, col, block]| {
            let np: usize = range.clone().map(|i| tiles.computed_in(i)).sum();
            block.clear();
            block.resize(co * np, 0.0);
            col.resize(kk * np, 0.0);
            let mut off = 0;
            for i in range.clone() {
                let runs = tiles.runs(i);
                for o in 0..co {
                    let bv = bias.map_or(0.0, |b| b[o]);
                    let mut at = o * np + off;
                    for r in runs {
                        let d = &mut block[at..at + r.len()];
                        match residual {
                            Some(res) => {
                                res.read_row(o, r.y, r.x0, r.x1, d);
                                d.iter_mut().for_each(|d| *d += bv);
                            }
                            None => d.fill(bv),
                        }
                        at += r.len();
                    }
                }
                let span = g.gather(x, pre, bounds(runs), win);
                g.im2col(win, span, runs, col, np, off);
                off += tiles.computed_in(i);
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
            scatter_runs(tiles, range.clone(), block, np, cached, dst);
        })
    });
    Ok(out)
}

/// Writes a group's computed pixels (`block`, `[co, np]`, run by run) into its tiles'
/// storage (`dst`, the tiles' `[co, th, tw]` blocks one after another), the tiles'
/// other pixels from `cached`.
fn scatter_runs(
    tiles: &Tiles,
    range: std::ops::Range<usize>,
    block: &[f32],
    np: usize,
    cached: Plane<'_>,
    dst: &mut [f32],
) {
    let co = cached.c;
    let (mut off, mut at) = (0, 0);
    for i in range {
        let (y0, y1, x0, x1) = tiles.rect(i);
        let tw = x1 - x0;
        let tp = (y1 - y0) * tw;
        let tile = &mut dst[at..at + co * tp];
        if !tiles.is_full(i) {
            cached.read_rect((y0, y1, x0, x1), tile);
        }
        for (o, plane) in tile.chunks_exact_mut(tp).enumerate() {
            let mut src = o * np + off;
            for r in tiles.runs(i) {
                let d = (r.y - y0) * tw + r.x0 - x0;
                plane[d..d + r.len()].copy_from_slice(&block[src..src + r.len()]);
                src += r.len();
            }
        }
        off += tiles.computed_in(i);
        at += co * tp;
    }
}

/// The bounding rectangle `(y0, y1, x0, x1)` of some runs.
fn bounds(runs: &[Run]) -> (usize, usize, usize, usize) {
    runs.iter()
        .fold((usize::MAX, 0, usize::MAX, 0), |(y0, y1, x0, x1), r| {
            (y0.min(r.y), y1.max(r.y + 1), x0.min(r.x0), x1.max(r.x1))
        })
}

/// Computed pixels a group of tiles aims for, as GEMM rows. The dense convolution's
/// bands on the VAE's 512-channel planes are 64-128 pixels and run at full speed, and
/// groups this small leave a small region's layer enough tasks for the cores (sizing
/// them by the thread count measured no different at 512x512).
///
/// Fixed, not derived from the thread count: the GEMM's blocking follows its shape, so
/// grouping by threads made the same edit's bits depend on how many threads its
/// process has (the daemon's workers have a share of the cores, the CLI all of them),
/// and the daemon must give the CLI's image byte for byte.
const GROUP_PIXELS: usize = 128;

/// Runs of consecutive active tiles of about [`GROUP_PIXELS`] computed pixels each (at
/// least one tile).
fn group_tiles(tiles: &Tiles) -> Vec<std::ops::Range<usize>> {
    let n = tiles.active.len();
    let mut groups = Vec::new();
    let (mut start, mut px) = (0, 0);
    for i in 0..n {
        px += tiles.computed_in(i);
        if px >= GROUP_PIXELS || i + 1 == n {
            groups.push(start..i + 1);
            (start, px) = (i + 1, 0);
        }
    }
    groups
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

    /// Copies the input window of the output rectangle `(y0, y1, x0, x1)` into `win`
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

    /// im2col of some runs of output pixels from their gathered window: row
    /// `(c, ky, kx)` of `col` holds, per output pixel, the (upsampled, zero-padded)
    /// input it multiplies with weight `[:, c, ky, kx]`.
    /// The runs' pixels go to columns `off..` of `col`'s rows of length `ld`.
    fn im2col(&self, win: &[f32], s: Span, runs: &[Run], col: &mut [f32], ld: usize, off: usize) {
        let (rows, cols) = (s.y1 - s.y0, s.x1 - s.x0);
        let (hv, wv) = (self.h * self.up, self.w * self.up);
        let np: usize = runs.iter().map(Run::len).sum();
        let st = self.stride;
        let mut dst_rows = col.chunks_exact_mut(ld).map(|r| &mut r[off..off + np]);
        for c in 0..self.ci {
            let wc = &win[c * rows * cols..(c + 1) * rows * cols];
            for ky in 0..self.k {
                for kx in 0..self.k {
                    let drow = dst_rows.next().expect("col sized for ci*k*k rows");
                    // Output columns whose input column `ox*s + kx - pad_left` is
                    // inside the image (the rest read the zero padding).
                    let lo_all = self.pad_left.saturating_sub(kx).div_ceil(st);
                    let hi_all = (wv + self.pad_left).saturating_sub(kx).div_ceil(st);
                    let mut at = 0;
                    for r in runs {
                        let dst = &mut drow[at..at + r.len()];
                        at += r.len();
                        let uy = (r.y * st + ky).wrapping_sub(self.pad_top);
                        if uy >= hv {
                            dst.fill(0.0);
                            continue;
                        }
                        let lo = lo_all.clamp(r.x0, r.x1);
                        let hi = hi_all.clamp(lo, r.x1);
                        let src = &wc[(uy / self.up - s.y0) * cols..][..cols];
                        dst[..lo - r.x0].fill(0.0);
                        dst[hi - r.x0..].fill(0.0);
                        if lo == hi {
                            continue;
                        }
                        // In upsampled coordinates from the window's first column.
                        let u0 = lo * st + kx - self.pad_left - s.x0 * self.up;
                        spread_row(&mut dst[lo - r.x0..hi - r.x0], src, u0, st, self.up);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
