//! One half of the VAE as a flat list of operations, and the regions of each value an
//! edit must recompute.
//!
//! The dense forward (`model.rs`) nests blocks; the sparse one needs every
//! convolution's input, output and residual by position, because the template trace
//! is indexed by them and the regions are propagated along them. A ResnetBlock2D is
//! `conv1(silu(gn1(x)))`, its optional 1x1 shortcut of `x`, and `conv2(silu(gn2(h)))`
//! with the residual: three [`Op::Conv`]s. GroupNorms are not ops: each is folded into
//! the gather of the convolution that reads it.
//!
//! Value 0 is the pass's input; value `i + 1` is the output of op `i`; the last value
//! is the pass's output (the decoded image, or the encoder's moments).

use denoised_runtime::cpu::conv::Conv2dOpts;
use denoised_runtime::cpu::sparse_conv::{grow, grow_back, out_size};
use denoised_runtime::{Error, Result};

use super::super::model::{AutoencoderKL, DOWNSAMPLE, UPSAMPLE};
use super::super::weights::{Attention, Coder, Conv, Norm, Resnet};
use super::{Half, RegionMode, StatsMode};

pub(crate) enum Op<'w> {
    /// `conv(pre(x)) + bias (+ residual)`, where `pre` is a GroupNorm (with SiLU when
    /// the flag says so).
    Conv {
        conv: &'w Conv,
        k: usize,
        opts: Conv2dOpts,
        input: usize,
        pre: Option<(&'w Norm, bool)>,
        residual: Option<usize>,
    },
    /// The mid block's attention, its residual included.
    Attn { attn: &'w Attention, input: usize },
}

impl Op<'_> {
    pub(crate) fn input(&self) -> usize {
        match self {
            Op::Conv { input, .. } | Op::Attn { input, .. } => *input,
        }
    }
}

pub(crate) struct Program<'w> {
    pub ops: Vec<Op<'w>>,
    /// `[C, H, W]` of every value.
    pub shapes: Vec<[usize; 3]>,
}

impl<'w> Program<'w> {
    /// The program of `half` for an input of `[C, H, W]`.
    pub(crate) fn new(vae: &'w AutoencoderKL, half: Half, input: [usize; 3]) -> Result<Self> {
        let w = vae.weights();
        let coder = match half {
            Half::Encoder => w.encoder.as_ref(),
            Half::Decoder => w.decoder.as_ref(),
        }
        .ok_or_else(|| Error::Invalid(format!("the VAE {half:?} is not loaded in this process")))?;
        let mut p = Program {
            ops: Vec::new(),
            shapes: vec![input],
        };
        let x = p.conv(&coder.conv_in, Conv2dOpts::same(3), 0, None, None);
        let x = match half {
            Half::Encoder => {
                let x = p.blocks(coder, x, DOWNSAMPLE);
                p.mid(coder, x)
            }
            Half::Decoder => {
                let x = p.mid(coder, x);
                p.blocks(coder, x, UPSAMPLE)
            }
        };
        let pre = Some((&coder.norm_out, true));
        p.conv(&coder.conv_out, Conv2dOpts::same(3), x, pre, None);
        Ok(p)
    }

    pub(crate) fn output(&self) -> usize {
        self.ops.len()
    }

    /// The f32 values a trace of this program holds: every value and the attention's
    /// K and V.
    pub(crate) fn trace_floats(&self) -> usize {
        let kv: usize = self
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Attn { input, .. } => {
                    let [c, h, w] = self.shapes[*input];
                    Some(h * w * 2 * c)
                }
                _ => None,
            })
            .sum();
        kv + self.shapes.iter().map(|[c, h, w]| c * h * w).sum::<usize>()
    }

    /// Per value, the last op that reads it (as input or residual); None for the
    /// output.
    pub(crate) fn last_reads(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.shapes.len()];
        for (i, op) in self.ops.iter().enumerate() {
            last[op.input()] = Some(i);
            if let Op::Conv {
                residual: Some(r), ..
            } = op
            {
                last[*r] = Some(i);
            }
        }
        last
    }

    fn blocks(&mut self, coder: &'w Coder, mut x: usize, resample: Conv2dOpts) -> usize {
        for b in &coder.blocks {
            for r in &b.resnets {
                x = self.resnet(r, x);
            }
            if let Some(c) = &b.resample {
                x = self.conv(c, resample, x, None, None);
            }
        }
        x
    }

    fn mid(&mut self, coder: &'w Coder, x: usize) -> usize {
        let mut x = self.resnet(&coder.mid.resnet0, x);
        if let Some(a) = &coder.mid.attn {
            self.shapes.push(self.shapes[x]);
            self.ops.push(Op::Attn { attn: a, input: x });
            x = self.ops.len();
        }
        self.resnet(&coder.mid.resnet1, x)
    }

    /// In the order the dense forward runs them: conv1, shortcut, conv2.
    fn resnet(&mut self, r: &'w Resnet, x: usize) -> usize {
        let same3 = Conv2dOpts::same(3);
        let h = self.conv(&r.conv1, same3, x, Some((&r.norm1, true)), None);
        let sc = r
            .shortcut
            .as_ref()
            .map(|s| self.conv(s, Conv2dOpts::same(1), x, None, None));
        self.conv(
            &r.conv2,
            same3,
            h,
            Some((&r.norm2, true)),
            Some(sc.unwrap_or(x)),
        )
    }

    fn conv(
        &mut self,
        conv: &'w Conv,
        opts: Conv2dOpts,
        input: usize,
        pre: Option<(&'w Norm, bool)>,
        residual: Option<usize>,
    ) -> usize {
        let (o, k) = (conv.w.shape()[0], conv.w.shape()[2]);
        let [_, h, w] = self.shapes[input];
        let (oh, ow) = out_size(h, w, k, opts);
        self.shapes.push([o, oh, ow]);
        self.ops.push(Op::Conv {
            conv,
            k,
            opts,
            input,
            pre,
            residual,
        });
        self.ops.len()
    }

    /// The pixels of every value that an edit recomputes: those that differ from the
    /// template (forward, from `diff` over the input plane) and that the output's
    /// `keep` region depends on (backward). Plane-shaped, row-major.
    ///
    /// - `Exact` grows the difference through each layer's whole receptive field: the
    ///   attention mixes every pixel, and with `incremental` statistics so does a
    ///   GroupNorm (once its statistics move, all its outputs do; and they read all
    ///   its inputs), so after the first one nearly everything is recomputed. Under
    ///   `frozen` statistics a GroupNorm is pixelwise, as in `Local`.
    /// - `Local` grows the difference through the convolutions and the attention only,
    ///   a GroupNorm counted as pixelwise even where its statistics are updated: the
    ///   statistics' small global shift is left out beyond the region.
    /// - `Dilated(n)` is SIGE's fixed region: the difference mask resampled to each
    ///   value's plane and dilated by `n` pixels there; the attention's output differs
    ///   only where its input does (its other queries keep their cached output).
    pub(crate) fn regions(
        &self,
        diff: &[bool],
        keep: &[bool],
        mode: RegionMode,
        stats: StatsMode,
    ) -> Vec<Vec<bool>> {
        let plane = |v: usize| {
            let [_, h, w] = self.shapes[v];
            (h, w)
        };
        let global_norms = mode == RegionMode::Exact && stats == StatsMode::Incremental;
        let any = |r: &[bool]| r.iter().any(|&b| b);
        let n = self.shapes.len();
        let mut fwd: Vec<Vec<bool>> = Vec::with_capacity(n);
        fwd.push(diff.to_vec());
        for (i, op) in self.ops.iter().enumerate() {
            let (h, w) = plane(i + 1);
            let f = match (mode, op) {
                (RegionMode::Dilated(d), _) => {
                    let (ih, iw) = plane(0);
                    dilate(&resample(diff, ih, iw, h, w), h, w, d)
                }
                (
                    _,
                    Op::Conv {
                        k,
                        opts,
                        input,
                        pre,
                        residual,
                        ..
                    },
                ) => {
                    let (ih, iw) = plane(*input);
                    let mut f = if global_norms && pre.is_some() && any(&fwd[*input]) {
                        vec![true; h * w]
                    } else {
                        grow(&fwd[*input], ih, iw, *k, *opts).0
                    };
                    if let Some(r) = residual {
                        or(&mut f, &fwd[*r]);
                    }
                    f
                }
                (_, Op::Attn { input, .. }) => vec![any(&fwd[*input]); h * w],
            };
            fwd.push(f);
        }
        let mut back: Vec<Vec<bool>> = (0..n)
            .map(|v| {
                let (h, w) = plane(v);
                vec![false; h * w]
            })
            .collect();
        back[n - 1] = keep.to_vec();
        for (i, op) in self.ops.iter().enumerate().rev() {
            let out = std::mem::take(&mut back[i + 1]);
            match op {
                Op::Conv {
                    k,
                    opts,
                    input,
                    pre,
                    residual,
                    ..
                } => {
                    let (ih, iw) = plane(*input);
                    if global_norms && pre.is_some() && any(&out) {
                        // The statistics read every input pixel.
                        back[*input].fill(true);
                    }
                    let need = grow_back(&out, ih, iw, *k, *opts);
                    or(&mut back[*input], &need);
                    if let Some(r) = residual {
                        or(&mut back[*r], &out);
                    }
                }
                Op::Attn { input, .. } => {
                    // Exact and local: a query reads every key; SIGE's approximation
                    // takes the keys of pixels outside the region from the template.
                    if !matches!(mode, RegionMode::Dilated(_)) && any(&out) {
                        back[*input].fill(true);
                    }
                    or(&mut back[*input], &out);
                }
            }
            back[i + 1] = out;
        }
        fwd.iter_mut().zip(&back).for_each(|(f, b)| {
            f.iter_mut().zip(b).for_each(|(f, b)| *f &= *b);
        });
        fwd
    }
}

fn or(a: &mut [bool], b: &[bool]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a |= *b);
}

/// `src` (`sh x sw`) on an `h x w` plane: a pixel is set when any source pixel under
/// it is (a box for a smaller plane, the nearest source pixel for a larger one).
pub(crate) fn resample(src: &[bool], sh: usize, sw: usize, h: usize, w: usize) -> Vec<bool> {
    let span = |o: usize, s: usize, n: usize| {
        let lo = o * s / n;
        lo..((o + 1) * s).div_ceil(n).max(lo + 1).min(s)
    };
    let mut out = vec![false; h * w];
    for y in 0..h {
        for x in 0..w {
            out[y * w + x] = span(y, sh, h).any(|sy| span(x, sw, w).any(|sx| src[sy * sw + sx]));
        }
    }
    out
}

/// Square (Chebyshev) dilation by `d` pixels.
pub(crate) fn dilate(src: &[bool], h: usize, w: usize, d: usize) -> Vec<bool> {
    if d == 0 {
        return src.to_vec();
    }
    let mut rows = vec![false; h * w];
    for y in 0..h {
        for x in (0..w).filter(|&x| src[y * w + x]) {
            rows[y * w + x.saturating_sub(d)..y * w + (x + d + 1).min(w)].fill(true);
        }
    }
    let mut out = vec![false; h * w];
    for y in 0..h {
        for yy in y.saturating_sub(d)..(y + d + 1).min(h) {
            for x in 0..w {
                out[y * w + x] |= rows[yy * w + x];
            }
        }
    }
    out
}
