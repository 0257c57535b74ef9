//! Convolutional kernels of the CPU backend, on NCHW f32 tensors: 2-D convolution,
//! GroupNorm (optionally fused with SiLU) and nearest-neighbour 2x upsampling.
//!
//! The transformer never needs these; the VAE is built from nothing else. They are
//! free functions on host [`Tensor`]s rather than `Backend` methods because only the
//! CPU VAE uses them so far.
//!
//! Convolution is im2col + gemm, tiled: the output of each image is cut into bands of
//! whole output rows, and each band's patch matrix `[I*kh*kw, band pixels]` (about 1 MB,
//! so it stays in L2) is built in per-thread scratch and multiplied by the weight
//! `[O, I*kh*kw]` straight into the NCHW output. Bands run in parallel over rayon; each
//! gemm is single-threaded. The full patch matrix is never built (at 512x512 with 64
//! channels it would be 600 MB). Zero padding and the decoder's nearest 2x upsampling
//! are folded into the gather, so neither a padded nor an upsampled copy of the input
//! exists either.
//!
//! GroupNorm follows PyTorch's CPU kernel: per-group mean and variance (accumulated
//! here in f64, which is closer to exact than PyTorch's own f32 sums), then per channel
//! `y = x*scale + shift` with `scale = rstd*gamma`, `shift = beta - mean*scale`.

use std::cell::RefCell;

use rayon::prelude::*;

use super::simd::{self, multiversion};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub use crate::backend::Conv2dOpts;

/// Elements of the per-band patch matrix to aim for (1 MB of f32: fits in L2 next to
/// the weight and output tile).
const BAND_ELEMS: usize = 1 << 18;

/// `*mut f32` that parallel tasks may share: each task writes only its own columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: see `conv2d`: tasks write disjoint elements and nothing reads them meanwhile.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Through a method, so closures capture the whole `Send` wrapper rather than the
    /// raw pointer field (edition-2021 closures capture disjoint fields).
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn dims4(op: &'static str, what: &str, t: &Tensor) -> Result<[usize; 4]> {
    match *t.shape() {
        [a, b, c, d] => Ok([a, b, c, d]),
        ref s => Err(Error::shape(
            op,
            format!("{what} must be 4-D [N, C, H, W], got {s:?}"),
        )),
    }
}

/// `conv2d(x, w, bias) (+ add)` with PyTorch semantics (`F.conv2d`, groups 1,
/// dilation 1), on `x: [B, I, H, W]` and `w: [O, I, kh, kw]`. `add`, when given, is a
/// tensor of the output's shape added to the result (a residual connection), which
/// saves a pass over memory.
pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    opts: Conv2dOpts,
    add: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let [b, ci, h, wd] = dims4(OP, "input", x)?;
    let [co, wci, kh, kw] = dims4(OP, "weight", w)?;
    if wci != ci {
        return Err(Error::shape(
            OP,
            format!(
                "input {:?} has {ci} channels, weight {:?} expects {wci}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if opts.stride == 0 || kh == 0 || kw == 0 {
        return Err(Error::shape(
            OP,
            format!(
                "stride {} and kernel {kh}x{kw} must be positive",
                opts.stride
            ),
        ));
    }
    if let Some(bias) = bias {
        if bias.len() != co {
            return Err(Error::shape(
                OP,
                format!("bias {:?} for {co} output channels", bias.shape()),
            ));
        }
    }
    let u = if opts.upsample2x { 2 } else { 1 };
    let [pt, pb, pl, pr] = opts.pad;
    let (hp, wp) = (h * u + pt + pb, wd * u + pl + pr);
    if hp < kh || wp < kw {
        return Err(Error::shape(
            OP,
            format!(
                "input {:?} (padded to {hp}x{wp}) is smaller than the {kh}x{kw} kernel",
                x.shape()
            ),
        ));
    }
    let s = opts.stride;
    let (oh, ow) = ((hp - kh) / s + 1, (wp - kw) / s + 1);
    let out_shape = [b, co, oh, ow];
    if let Some(a) = add {
        if a.shape() != out_shape {
            return Err(Error::shape(
                OP,
                format!("added tensor {:?} vs output {out_shape:?}", a.shape()),
            ));
        }
    }
    let k = ci * kh * kw;
    let p = oh * ow;
    let mut out = vec![0.0f32; b * co * p];
    if out.is_empty() {
        return Tensor::new(out_shape, out);
    }

    // A 1x1 stride-1 convolution without padding reads its input matrix `[I, H*W]` as
    // is: no patch matrix needed.
    let direct = kh == 1 && kw == 1 && s == 1 && u == 1 && opts.pad == [0; 4];
    // Bands of whole output rows, sized for L2, but at least ~4 tasks per thread.
    let mut rows_per_band = (BAND_ELEMS / (k * ow).max(1)).clamp(1, oh);
    let want_tasks = 4 * rayon::current_num_threads();
    while rows_per_band > 1 && b * oh.div_ceil(rows_per_band) < want_tasks {
        rows_per_band = rows_per_band.div_ceil(2);
    }
    let bands = oh.div_ceil(rows_per_band);
    let geo = Geometry {
        ci,
        h,
        w: wd,
        kh,
        kw,
        stride: s,
        up: u,
        pad_top: pt,
        pad_left: pl,
        ow,
    };

    let dst = SharedOut(out.as_mut_ptr());
    let (xd, wdat) = (x.data(), w.data());
    let (bias, add) = (bias.map(|t| t.data()), add.map(|t| t.data()));
    (0..b * bands).into_par_iter().for_each(|task| {
        with_scratch(|[col, ..]| {
            let (bi, band) = (task / bands, task % bands);
            let oy0 = band * rows_per_band;
            let oy1 = (oy0 + rows_per_band).min(oh);
            let (p0, np) = (oy0 * ow, (oy1 - oy0) * ow);
            let xb = &xd[bi * ci * h * wd..(bi + 1) * ci * h * wd];
            // SAFETY: this task is the only one touching columns p0..p0+np of rows
            // 0..co of image bi; `out` outlives the parallel loop.
            let ob = unsafe { dst.get().add(bi * co * p + p0) };
            let init = bias.is_some() || add.is_some();
            if init {
                for o in 0..co {
                    // SAFETY: as above; the row segment lies inside `out`.
                    let row = unsafe { std::slice::from_raw_parts_mut(ob.add(o * p), np) };
                    let bv = bias.map_or(0.0, |bs| bs[o]);
                    match add {
                        Some(a) => {
                            let a = &a[bi * co * p + o * p + p0..][..np];
                            for (r, av) in row.iter_mut().zip(a) {
                                *r = av + bv;
                            }
                        }
                        None => row.fill(bv),
                    }
                }
            }
            let rhs = if direct {
                (xb[p0..].as_ptr(), p)
            } else {
                col.resize(k * np, 0.0);
                im2col(xb, &geo, oy0, oy1, col);
                (col.as_ptr(), np)
            };
            // The product is computed as out[pixel, o] = patchesᵀ[pixel, k] @ wᵀ[k, o],
            // with pixels as gemm's row dimension and the NCHW output addressed as a
            // column-major matrix (rows are pixels, unit stride): gemm's kernels are
            // column-major, and this orientation measured 1.75x faster than
            // out[o, pixel] = w @ patches on 32-channel 512x512 convolutions.
            //
            // SAFETY: lhs element (i, j) = rhs.0[j*rhs.1 + i] lies inside `col` (or
            // `xb`) for i < np, j < k; rhs element (j, o) = w[o*k + j] inside the
            // weight; dst element (i, o) = ob[o*p + i] inside this task's columns of
            // `out`, which no other task touches.
            unsafe { patches_times_weight(np, co, k, ob, p, init, rhs.0, rhs.1, wdat.as_ptr()) };
        })
    });
    Tensor::new(out_shape, out)
}

/// `dst[i, o] (+)= Σ_j lhs[i, j] · w[o, j]` for `np` pixels `i`, `co` outputs and `kk`
/// patch rows `j`, with `dst` column-major (pixel `i` of output `o` at
/// `dst[o*ld_dst + i]`, an NCHW plane), `lhs` column-major (`lhs[j*ld_lhs + i]`, the
/// im2col layout) and `w` row-major `[co, kk]` (PyTorch's weight layout). The dense and
/// the sparse (`sparse_conv`) convolutions' one GEMM; `accumulate` adds to `dst`.
///
/// # Safety
/// Every element named above must lie inside its buffer, and no other thread may touch
/// the `dst` elements while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn patches_times_weight(
    np: usize,
    co: usize,
    kk: usize,
    dst: *mut f32,
    ld_dst: usize,
    accumulate: bool,
    lhs: *const f32,
    ld_lhs: usize,
    w: *const f32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            np,
            co,
            kk,
            dst,
            ld_dst as isize,
            1,
            accumulate,
            lhs,
            ld_lhs as isize,
            1,
            w,
            kk as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// What [`im2col`] needs to know about one convolution.
struct Geometry {
    ci: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    stride: usize,
    up: usize,
    pad_top: usize,
    pad_left: usize,
    ow: usize,
}

/// Fills `col` (`[ci*kh*kw, (oy1-oy0)*ow]`) with the patches of output rows
/// `oy0..oy1` of one image `x` (`[ci, h, w]`). Row `(c, ky, kx)` holds, for each output
/// pixel, the (upsampled, padded) input it multiplies with weight `[:, c, ky, kx]`.
fn im2col(x: &[f32], g: &Geometry, oy0: usize, oy1: usize, col: &mut [f32]) {
    let np = (oy1 - oy0) * g.ow;
    let (hv, wv) = (g.h * g.up, g.w * g.up); // input size after upsampling
    let s = g.stride;
    let mut dst_rows = col.chunks_exact_mut(np);
    for c in 0..g.ci {
        let xc = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        for ky in 0..g.kh {
            for kx in 0..g.kw {
                let drow = dst_rows.next().expect("col sized for ci*kh*kw rows");
                // Output columns whose input column `ox*s + kx - pad_left` is inside.
                let hi = (wv + g.pad_left).saturating_sub(kx).div_ceil(s).min(g.ow);
                let lo = g.pad_left.saturating_sub(kx).div_ceil(s).min(hi);
                for (oy, dst) in (oy0..oy1).zip(drow.chunks_exact_mut(g.ow)) {
                    let iy = (oy * s + ky).wrapping_sub(g.pad_top);
                    if iy >= hv {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &xc[(iy / g.up) * g.w..(iy / g.up + 1) * g.w];
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    if lo == hi {
                        continue;
                    }
                    spread_row(&mut dst[lo..hi], src, lo * s + kx - g.pad_left, s, g.up);
                }
            }
        }
    }
}

thread_local! {
    /// Each thread's scratch for the convolutions (patch matrices, input windows,
    /// output blocks), kept from call to call: rayon's `for_each_init` makes new
    /// buffers per split, and a multi-MB patch matrix made anew faults its pages in
    /// again (perf put about 5% of a sparse layer's samples in growing and freeing
    /// them; end to end at 512x512 the difference was within this machine's noise).
    static SCRATCH: RefCell<[Vec<f32>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// Runs `f` with this thread's convolution scratch. Not re-entrant: `f` must not run
/// a convolution itself (the convolutions' GEMMs are single-threaded, so none does).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut [Vec<f32>; 3]) -> R) -> R {
    SCRATCH.with(|s| f(&mut s.borrow_mut()))
}

/// `dst[j] = src[(u0 + j * s) / up]`: one im2col row segment of a convolution with
/// stride `s` on an input upsampled `up` times (nearest), `u0` in upsampled
/// coordinates. The common cases are copies (a division per element made the
/// upsampling convolutions' im2col cost as much as their GEMM).
pub(crate) fn spread_row(dst: &mut [f32], src: &[f32], u0: usize, s: usize, up: usize) {
    match (s, up) {
        (1, 1) => dst.copy_from_slice(&src[u0..u0 + dst.len()]),
        (1, 2) => {
            // Each source value twice, starting at its second copy when u0 is odd.
            let (mut d, mut i) = (&mut dst[..], u0 / 2);
            if u0 % 2 == 1 && !d.is_empty() {
                d[0] = src[i];
                d = &mut d[1..];
                i += 1;
            }
            let n = d.len() / 2;
            for (p, &v) in d.chunks_exact_mut(2).zip(&src[i..i + n]) {
                p[0] = v;
                p[1] = v;
            }
            if d.len() % 2 == 1 {
                d[2 * n] = src[i + n];
            }
        }
        (_, 1) => {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = src[u0 + j * s];
            }
        }
        _ => {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = src[(u0 + j * s) / up];
            }
        }
    }
}

/// Per-group `(mean, 1/sqrt(var + eps))` of a contiguous group, accumulated in f64.
fn group_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let (s, ss) = sums_f64(x);
    let n = x.len().max(1) as f64;
    let mean = s / n;
    // One-pass variance is safe in f64 at these sizes (relative error ~1e-16 of E[x^2]).
    let var = (ss / n - mean * mean).max(0.0);
    (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32)
}

multiversion! {
    /// `(sum x, sum x^2)` in f64, with 8 partial sums so the loop vectorises.
    fn sums_f64(x: &[f32]) -> (f64, f64) {
        let mut s = [0.0f64; 8];
        let mut ss = [0.0f64; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for i in 0..8 {
                let v = c[i] as f64;
                s[i] += v;
                ss[i] += v * v;
            }
        }
        let (mut ts, mut tss) = (0.0f64, 0.0f64);
        for &v in chunks.remainder() {
            ts += v as f64;
            tss += v as f64 * v as f64;
        }
        (ts + s.iter().sum::<f64>(), tss + ss.iter().sum::<f64>())
    }
}

multiversion! {
    /// `y = x*a + b`, then `y = silu(y)` when asked.
    fn scale_shift(x: &[f32], a: f32, b: f32, silu: bool, y: &mut [f32]) {
        if silu {
            for (y, x) in y.iter_mut().zip(x) {
                *y = simd::silu(*x * a + b);
            }
        } else {
            for (y, x) in y.iter_mut().zip(x) {
                *y = *x * a + b;
            }
        }
    }
}

multiversion! {
    /// [`scale_shift`] in place, the same expression (so a sparse layer's fused
    /// GroupNorm gives the dense one's values to the bit).
    pub(crate) fn scale_shift_in_place(y: &mut [f32], a: f32, b: f32, silu: bool) {
        if silu {
            for y in y.iter_mut() {
                *y = simd::silu(*y * a + b);
            }
        } else {
            for y in y.iter_mut() {
                *y = *y * a + b;
            }
        }
    }
}

/// `GroupNorm(groups, C, eps, affine=True)` on `x: [B, C, ...]` (any spatial rank),
/// followed by SiLU when `silu` is set (the `norm → act` pair every VAE block uses).
pub fn group_norm(
    x: &Tensor,
    groups: usize,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    silu: bool,
) -> Result<Tensor> {
    const OP: &str = "group_norm";
    let shape = x.shape();
    if shape.len() < 2 {
        return Err(Error::shape(
            OP,
            format!("input must be [B, C, ...], got {shape:?}"),
        ));
    }
    let c = shape[1];
    if groups == 0 || c % groups != 0 {
        return Err(Error::shape(
            OP,
            format!("{c} channels are not divisible into {groups} groups"),
        ));
    }
    if weight.len() != c || bias.len() != c {
        return Err(Error::shape(
            OP,
            format!(
                "weight {:?} / bias {:?} for {c} channels",
                weight.shape(),
                bias.shape()
            ),
        ));
    }
    let plane: usize = shape[2..].iter().product();
    let glen = (c / groups) * plane;
    let mut out = vec![0.0f32; x.len()];
    if out.is_empty() {
        return Tensor::new(shape.to_vec(), out);
    }
    // In NCHW a group's channels are contiguous, so each (image, group) is one slice.
    let stats: Vec<(f32, f32)> = x
        .data()
        .par_chunks(glen)
        .map(|g| group_stats(g, eps))
        .collect();
    let (wd, bd) = (weight.data(), bias.data());
    let cpg = c / groups;
    // Parallel over channel planes, in runs of several planes when planes are small.
    let ppt = (16384 / plane.max(1)).max(1);
    out.par_chunks_mut(plane * ppt)
        .zip(x.data().par_chunks(plane * ppt))
        .enumerate()
        .for_each(|(t, (o, xi))| {
            for (i, (orow, xrow)) in o.chunks_mut(plane).zip(xi.chunks(plane)).enumerate() {
                let bc = t * ppt + i; // image * c + channel
                let ch = bc % c;
                let (mean, rstd) = stats[bc / cpg];
                let a = rstd * wd[ch];
                let b = bd[ch] - mean * a;
                scale_shift(xrow, a, b, silu, orow);
            }
        });
    Tensor::new(shape.to_vec(), out)
}

/// Nearest-neighbour 2x upsampling of `[B, C, H, W]` (`F.interpolate(scale_factor=2)`).
/// [`conv2d`] can fold this into its gather (`Conv2dOpts::upsample2x`); this standalone
/// form is for callers that need the upsampled tensor itself.
pub fn upsample_nearest2x(x: &Tensor) -> Result<Tensor> {
    let [b, c, h, w] = dims4("upsample_nearest2x", "input", x)?;
    let mut out = vec![0.0f32; b * c * 4 * h * w];
    if !out.is_empty() {
        out.par_chunks_mut(4 * h * w)
            .zip(x.data().par_chunks(h * w))
            .for_each(|(o, xi)| {
                for (y, orow) in o.chunks_exact_mut(2 * w).enumerate() {
                    let src = &xi[(y / 2) * w..(y / 2 + 1) * w];
                    for (pair, v) in orow.chunks_exact_mut(2).zip(src) {
                        pair[0] = *v;
                        pair[1] = *v;
                    }
                }
            });
    }
    Tensor::new([b, c, 2 * h, 2 * w], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn tensor(shape: [usize; 4], seed: u64) -> Tensor {
        Tensor::new(shape, data(shape.iter().product(), seed)).unwrap()
    }

    /// Direct definition of the convolution, in f64.
    fn naive(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, o: Conv2dOpts) -> Tensor {
        let x = if o.upsample2x {
            upsample_nearest2x(x).unwrap()
        } else {
            x.clone()
        };
        let [b, ci, h, wd] = dims4("t", "x", &x).unwrap();
        let [co, _, kh, kw] = dims4("t", "w", w).unwrap();
        let [pt, pb, pl, pr] = o.pad;
        let oh = (h + pt + pb - kh) / o.stride + 1;
        let ow = (wd + pl + pr - kw) / o.stride + 1;
        let mut out = vec![0.0f32; b * co * oh * ow];
        for n in 0..b {
            for oc in 0..co {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias.map_or(0.0, |t| t.data()[oc] as f64);
                        for c in 0..ci {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (oy * o.stride + ky) as isize - pt as isize;
                                    let ix = (ox * o.stride + kx) as isize - pl as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                        continue;
                                    }
                                    let xv = x.data()
                                        [((n * ci + c) * h + iy as usize) * wd + ix as usize];
                                    let wv = w.data()[((oc * ci + c) * kh + ky) * kw + kx];
                                    acc += xv as f64 * wv as f64;
                                }
                            }
                        }
                        out[((n * co + oc) * oh + oy) * ow + ox] = acc as f32;
                    }
                }
            }
        }
        Tensor::new([b, co, oh, ow], out).unwrap()
    }

    #[test]
    fn conv2d_matches_definition() {
        let cases: &[([usize; 4], [usize; 4], Conv2dOpts)] = &[
            ([1, 3, 9, 7], [5, 3, 3, 3], Conv2dOpts::same(3)),
            ([2, 4, 8, 10], [6, 4, 1, 1], Conv2dOpts::same(1)),
            (
                [2, 4, 8, 10],
                [4, 4, 3, 3],
                Conv2dOpts {
                    stride: 2,
                    pad: [0, 1, 0, 1],
                    upsample2x: false,
                },
            ),
            (
                [1, 3, 9, 7],
                [3, 3, 3, 3],
                Conv2dOpts {
                    stride: 2,
                    pad: [0, 1, 0, 1],
                    upsample2x: false,
                },
            ),
            (
                [2, 5, 5, 6],
                [7, 5, 3, 3],
                Conv2dOpts {
                    upsample2x: true,
                    ..Conv2dOpts::same(3)
                },
            ),
            (
                [1, 2, 6, 5],
                [3, 2, 2, 3],
                Conv2dOpts {
                    stride: 3,
                    pad: [2, 0, 1, 3],
                    upsample2x: false,
                },
            ),
            // Tall enough to be split into several bands.
            ([1, 8, 70, 40], [8, 8, 3, 3], Conv2dOpts::same(3)),
        ];
        for (i, &(xs, ws, o)) in cases.iter().enumerate() {
            let x = tensor(xs, 1 + i as u64);
            let w = tensor(ws, 100 + i as u64);
            let b = Tensor::new([ws[0]], data(ws[0], 200 + i as u64)).unwrap();
            let want = naive(&x, &w, Some(&b), o);
            let got = conv2d(&x, &w, Some(&b), o, None).unwrap();
            assert_eq!(got.shape(), want.shape(), "case {i}");
            let d = got.max_abs_diff(&want).unwrap();
            assert!(d < 1e-5, "case {i}: {d}");
            // Without bias, plus a residual.
            let res = Tensor::new(want.shape().to_vec(), data(want.len(), 300)).unwrap();
            let got = conv2d(&x, &w, None, o, Some(&res)).unwrap();
            let nob = naive(&x, &w, None, o);
            let mut expect = nob.data().to_vec();
            for (e, r) in expect.iter_mut().zip(res.data()) {
                *e += r;
            }
            let expect = Tensor::new(want.shape().to_vec(), expect).unwrap();
            assert!(got.max_abs_diff(&expect).unwrap() < 1e-5, "case {i} (add)");
        }
    }

    #[test]
    fn spread_row_is_the_strided_upsampled_gather() {
        let src: Vec<f32> = (0..20).map(|v| v as f32).collect();
        for (s, up) in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)] {
            for u0 in 0..5 {
                for len in 0..8 {
                    let mut got = vec![-1.0; len];
                    spread_row(&mut got, &src, u0, s, up);
                    let want: Vec<f32> = (0..len).map(|j| src[(u0 + j * s) / up]).collect();
                    assert_eq!(got, want, "stride {s}, up {up}, u0 {u0}, len {len}");
                }
            }
        }
    }

    #[test]
    fn conv2d_rejects_bad_shapes() {
        let x = tensor([1, 3, 4, 4], 1);
        let w = tensor([2, 4, 3, 3], 2);
        assert!(conv2d(&x, &w, None, Conv2dOpts::same(3), None).is_err());
        let w = tensor([2, 3, 5, 5], 2);
        let tiny = Conv2dOpts {
            stride: 1,
            pad: [0; 4],
            upsample2x: false,
        };
        assert!(conv2d(&x, &w, None, tiny, None).is_err());
        let w = tensor([2, 3, 3, 3], 2);
        let b = Tensor::new([3], vec![0.0; 3]).unwrap();
        assert!(conv2d(&x, &w, Some(&b), Conv2dOpts::same(3), None).is_err());
    }

    #[test]
    fn group_norm_matches_definition() {
        let (b, c, h, w, g) = (2, 6, 5, 7, 3);
        let mut x = tensor([b, c, h, w], 7);
        x.data_mut().iter_mut().for_each(|v| *v = *v * 3.0 + 1.5);
        let gw = Tensor::new([c], data(c, 8)).unwrap();
        let gb = Tensor::new([c], data(c, 9)).unwrap();
        for silu in [false, true] {
            let got = group_norm(&x, g, &gw, &gb, 1e-6, silu).unwrap();
            let glen = c / g * h * w;
            for n in 0..b * g {
                let s = &x.data()[n * glen..(n + 1) * glen];
                let mean = s.iter().map(|&v| v as f64).sum::<f64>() / glen as f64;
                let var = s.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / glen as f64;
                for (j, &v) in s.iter().enumerate() {
                    let ch = (n % g) * (c / g) + j / (h * w);
                    let mut y = (v as f64 - mean) / (var + 1e-6).sqrt() * gw.data()[ch] as f64
                        + gb.data()[ch] as f64;
                    if silu {
                        y /= 1.0 + (-y).exp();
                    }
                    let d = (got.data()[n * glen + j] as f64 - y).abs();
                    assert!(d < 1e-5, "group {n} elem {j}: {d}");
                }
            }
        }
        assert!(group_norm(&x, 4, &gw, &gb, 1e-6, false).is_err());
    }

    #[test]
    fn upsample_repeats_pixels() {
        let x = Tensor::new([1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let y = upsample_nearest2x(&x).unwrap();
        assert_eq!(y.shape(), [1, 1, 4, 4]);
        assert_eq!(
            y.data(),
            [1., 1., 2., 2., 1., 1., 2., 2., 3., 3., 4., 4., 3., 3., 4., 4.]
        );
    }
}
