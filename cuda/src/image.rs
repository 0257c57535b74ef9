//! The image ops of [`GpuBackend`] (the VAE's): convolution, GroupNorm and the mid
//! block's attention, on NHWC activations (`kernels/image.cu`).
//!
//! An image tensor is `[B, C, H, W]` to the model and `[B*H*W, C]` in memory: every
//! pixel is a row, so a convolution is one GEMM over a patch matrix with the bias in
//! its epilogue, a 1x1 convolution is a Linear, and the attention's projections are
//! Linears over pixel rows. Convolutions with symmetric padding and no fused upsample go
//! to the executor's convolution library when it has one (cuDNN on a GPU, see
//! `cudnn.rs`), with bias and residual added in one pass after; the rest, and every
//! convolution where there is no library (the emulator), run as im2col + GEMM.
//! Patch matrices and attention scores are built a bounded chunk of rows at a time, so
//! their workspace stays under [`WORKSPACE_BYTES`] (by default) at any resolution.

use denoised_runtime::{Conv2dOpts, Error, Result, Tensor};

use crate::backend::{dev, matrix, GpuBackend, GpuTensor};
use crate::exec::{Conv, Exec, Gemm, Grid};
use crate::params::{EwParams, ImgParams};

/// The most bytes of patch matrix or attention scores one chunk of rows takes, by
/// default.
pub const WORKSPACE_BYTES: usize = 128 << 20;

/// Threads per block of the reduction kernels.
const BLOCK: u32 = 256;

/// Elements of a GroupNorm split: enough per block to hide latency, few enough that
/// there are blocks for every SM at any resolution.
const GN_SPLIT_ELEMS: usize = 1 << 14;

fn dims4(op: &'static str, what: &str, s: &[usize]) -> Result<[usize; 4]> {
    match *s {
        [a, b, c, d] => Ok([a, b, c, d]),
        _ => Err(Error::shape(op, format!("{what} must be 4-D, got {s:?}"))),
    }
}

pub(crate) fn i32_of(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::shape(op, format!("{v} elements exceed a kernel's i32 index")))
}

/// An image's NCHW host data as `[B, H, W, C]` rows, or back (`to_rows = false`).
fn relayout(x: &[f32], [b, c, h, w]: [usize; 4], to_rows: bool) -> Vec<f32> {
    let hw = h * w;
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x
        .chunks_exact(c * hw)
        .zip(out.chunks_exact_mut(c * hw))
        .take(b)
    {
        for ch in 0..c {
            for p in 0..hw {
                if to_rows {
                    dst[p * c + ch] = src[ch * hw + p];
                } else {
                    dst[ch * hw + p] = src[p * c + ch];
                }
            }
        }
    }
    out
}

impl<E: Exec> GpuBackend<E> {
    /// This backend with every convolution on its own im2col + GEMM path, even where
    /// the executor has a convolution library.
    pub fn im2col_only(mut self) -> Self {
        self.conv_library = false;
        self
    }
    /// Which path this backend's convolutions take, in words (logs, the self-test).
    pub fn conv_path(&self) -> String {
        match self.exec().conv_library().filter(|_| self.conv_library) {
            Some(lib) => {
                format!("{lib} (symmetric padding), im2col + GEMM (upsample, asymmetric padding)")
            }
            None => "im2col + GEMM".into(),
        }
    }

    pub(crate) fn upload_image_rows(&self, t: &Tensor) -> Result<GpuTensor<E>> {
        let [b, c, h, w] = dims4("upload_image", "an image", t.shape())?;
        let rows = Tensor::new([b * h * w, c], relayout(t.data(), [b, c, h, w], true))?;
        Ok(denoised_runtime::Backend::upload(self, &rows)?.view(vec![b, c, h, w]))
    }

    pub(crate) fn download_image_rows(&self, t: &GpuTensor<E>) -> Result<Tensor> {
        let [b, c, h, w] = dims4("download_image", "an image", t.shape())?;
        let rows = denoised_runtime::Backend::download(self, &t.view(vec![b * h * w, c]))?;
        Tensor::new([b, c, h, w], relayout(rows.data(), [b, c, h, w], false))
    }

    /// `[O, I, kh, kw]` as `[O, kh, kw, I]`: each output channel's row in the order
    /// of a patch matrix row.
    pub(crate) fn upload_conv_rows(&self, w: &Tensor) -> Result<GpuTensor<E>> {
        let [o, i, kh, kw] = dims4("upload_conv", "a convolution weight", w.shape())?;
        let x = w.data();
        let mut t = vec![0f32; x.len()];
        for oc in 0..o {
            for ic in 0..i {
                for k in 0..kh * kw {
                    t[(oc * kh * kw + k) * i + ic] = x[(oc * i + ic) * kh * kw + k];
                }
            }
        }
        let up = denoised_runtime::Backend::upload(self, &Tensor::new([o, kh * kw * i], t)?)?;
        Ok(up.view(vec![o, kh, kw, i]))
    }

    pub(crate) fn conv2d_rows(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: &GpuTensor<E>,
        opts: Conv2dOpts,
        add: Option<&GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        const OP: &str = "conv2d";
        let [n, c, h, wd] = dims4(OP, "input", x.shape())?;
        let [o, kh, kw, wc] = dims4(OP, "weight", w.shape())?;
        let u = if opts.upsample2x { 2 } else { 1 };
        let [pt, pb, pl, pr] = opts.pad;
        let (hp, wp) = (h * u + pt + pb, wd * u + pl + pr);
        if wc != c || b.shape() != [o] || opts.stride == 0 || hp < kh || wp < kw {
            return Err(Error::shape(
                OP,
                format!(
                    "input {:?}, weight [O, kh, kw, I] {:?}, bias {:?}, {opts:?}",
                    x.shape(),
                    w.shape(),
                    b.shape()
                ),
            ));
        }
        let (oh, ow) = ((hp - kh) / opts.stride + 1, (wp - kw) / opts.stride + 1);
        let out = self.empty(vec![n, o, oh, ow])?;
        if let Some(a) = add {
            if a.shape() != out.shape() {
                return Err(Error::shape(
                    OP,
                    format!("residual {:?} for an output {:?}", a.shape(), out.shape()),
                ));
            }
        }
        if self.conv_library && pt == pb && pl == pr && !opts.upsample2x {
            let conv = Conv {
                dt: self.dtype(),
                n,
                h,
                w: wd,
                c,
                o,
                kh,
                kw,
                stride: opts.stride,
                pad: [pt, pl],
                x: x.addr(),
                weight: w.addr(),
                out: out.addr(),
            };
            if self.exec().conv(&conv).map_err(dev)? {
                // The library writes the bare convolution; bias and residual in one pass.
                let p = EwParams {
                    x: out.addr(),
                    y: add.map_or(0, |a| a.addr()),
                    table: b.addr(),
                    rows: i32_of(OP, n * oh * ow)?,
                    cols: o as i32,
                    ..Default::default()
                };
                self.launch(self.kernel("bias_rows"), Grid::linear(out.len(), BLOCK), &p)?;
                return Ok(out);
            }
        }
        let pixels = n * oh * ow;
        let k = kh * kw * c;
        let sz = self.dtype().size();
        let gemm = |x: u64, rows: usize, p0: usize| {
            self.run_gemm(&Gemm {
                dt: self.dtype(),
                n: rows,
                m: o,
                k,
                x,
                ldx: k,
                w: w.addr(),
                bias: Some(b.addr()),
                gelu: false,
                out: out.addr() + (p0 * o * sz) as u64,
                ldo: o,
                fp8: None,
            })
        };
        if kh * kw == 1 && opts.stride == 1 && !opts.upsample2x && opts.pad == [0; 4] {
            // A 1x1 convolution reads the pixel rows as they are.
            gemm(x.addr(), pixels, 0)?;
        } else {
            let chunk = (self.image_workspace / (k * sz)).clamp(1, pixels);
            let cols = self.empty(vec![chunk, k])?;
            for p0 in (0..pixels).step_by(chunk) {
                let rows = chunk.min(pixels - p0);
                let p = ImgParams {
                    x: x.addr(),
                    y: cols.addr(),
                    batch: n as i32,
                    h: h as i32,
                    w: wd as i32,
                    c: c as i32,
                    oh: oh as i32,
                    ow: ow as i32,
                    kh: kh as i32,
                    kw: kw as i32,
                    stride: opts.stride as i32,
                    pad_t: pt as i32,
                    pad_l: pl as i32,
                    up: u as i32,
                    p0: i32_of(OP, p0)?,
                    rows: rows as i32,
                    ..Default::default()
                };
                i32_of(OP, rows * k)?;
                self.launch(self.kernel("im2col"), Grid::linear(rows * k, BLOCK), &p)?;
                gemm(cols.addr(), rows, p0)?;
            }
        }
        let mut out = out;
        if let Some(a) = add {
            denoised_runtime::Backend::add(self, &mut out, a)?;
        }
        Ok(out)
    }

    pub(crate) fn group_norm_rows(
        &self,
        x: &GpuTensor<E>,
        groups: usize,
        weight: &GpuTensor<E>,
        bias: &GpuTensor<E>,
        eps: f32,
        silu: bool,
    ) -> Result<GpuTensor<E>> {
        const OP: &str = "group_norm";
        let [n, c, h, w] = dims4(OP, "input", x.shape())?;
        if groups == 0 || c % groups != 0 || weight.shape() != [c] || bias.shape() != [c] {
            return Err(Error::shape(
                OP,
                format!(
                    "{c} channels in {groups} groups, weight {:?}, bias {:?}",
                    weight.shape(),
                    bias.shape()
                ),
            ));
        }
        let hw = h * w;
        let per_group = hw * (c / groups);
        let splits = per_group.div_ceil(GN_SPLIT_ELEMS).clamp(1, hw.max(1));
        let partial = self
            .exec()
            .alloc(n * groups * splits * 3 * 4)
            .map_err(dev)?;
        let stats = self.exec().alloc(n * groups * 2 * 4).map_err(dev)?;
        let out = self.empty(x.shape().to_vec())?;
        let mut p = ImgParams {
            x: x.addr(),
            y: self.exec().addr(&partial),
            z: self.exec().addr(&stats),
            wt: weight.addr(),
            bias: bias.addr(),
            batch: n as i32,
            h: h as i32,
            w: w as i32,
            c: c as i32,
            groups: groups as i32,
            splits: splits as i32,
            silu: silu as i32,
            eps,
            ..Default::default()
        };
        let g = Grid {
            grid: [groups as u32, n as u32, splits as u32],
            block: [BLOCK, 1, 1],
            smem: 0,
        };
        self.launch(self.kernel("gn_stats"), g, &p)?;
        self.launch("gn_finalize", Grid::linear(n * groups, 64), &p)?;
        p.y = out.addr();
        i32_of(OP, x.shape().iter().product())?;
        self.launch(self.kernel("gn_apply"), Grid::linear(n * c * hw, BLOCK), &p)?;
        Ok(out)
    }

    pub(crate) fn image_attention_rows(
        &self,
        x: &GpuTensor<E>,
        normed: &GpuTensor<E>,
        qkv: &GpuTensor<E>,
        qkv_b: &GpuTensor<E>,
        out_w: &GpuTensor<E>,
        out_b: &GpuTensor<E>,
    ) -> Result<GpuTensor<E>> {
        use denoised_runtime::Backend;
        const OP: &str = "image attention";
        let [n, c, h, w] = dims4(OP, "input", x.shape())?;
        let (m3, k) = matrix(OP, qkv)?;
        if normed.shape() != x.shape() || m3 != 3 * c || k != c {
            return Err(Error::shape(
                OP,
                format!(
                    "x {:?}, normed {:?}, qkv {:?}",
                    x.shape(),
                    normed.shape(),
                    qkv.shape()
                ),
            ));
        }
        let px = h * w;
        let sz = self.dtype().size();
        // [B*N, q|k|v] for every pixel, then per image: K as a contiguous [N, C]
        // operand, V transposed to [C, N], and the scores a chunk of query rows at a
        // time, softmaxed in place.
        let proj = self.linear(&normed.view(vec![n * px, c]), qkv, Some(qkv_b))?;
        let attn = self.empty(vec![n * px, c])?;
        let chunk = (self.image_workspace / (px * sz)).clamp(1, px);
        let scores = self.empty(vec![chunk, px])?;
        let vt = self.empty(vec![c, px])?;
        for i in 0..n {
            let rows = i * px..(i + 1) * px;
            let kk = self.gather_cols(&proj, rows.clone(), c..2 * c)?;
            let t = ImgParams {
                x: proj.addr() + ((rows.start * 3 * c + 2 * c) * sz) as u64,
                y: vt.addr(),
                rows: i32_of(OP, px)?,
                cols: c as i32,
                ld: (3 * c) as i32,
                ..Default::default()
            };
            i32_of(OP, px * c)?;
            self.launch(self.kernel("transpose"), Grid::linear(px * c, BLOCK), &t)?;
            for q0 in (0..px).step_by(chunk) {
                let nq = chunk.min(px - q0);
                let qrow = (rows.start + q0) * 3 * c;
                self.run_gemm(&Gemm {
                    dt: self.dtype(),
                    n: nq,
                    m: px,
                    k: c,
                    x: proj.addr() + (qrow * sz) as u64,
                    ldx: 3 * c,
                    w: kk.addr(),
                    bias: None,
                    gelu: false,
                    out: scores.addr(),
                    ldo: px,
                    fp8: None,
                })?;
                let s = ImgParams {
                    x: scores.addr(),
                    rows: nq as i32,
                    cols: px as i32,
                    scale: 1.0 / (c as f32).sqrt(),
                    ..Default::default()
                };
                i32_of(OP, nq * px)?;
                let g = Grid::linear(nq.div_ceil(4) * 128, 128);
                self.launch(self.kernel("softmax_rows"), g, &s)?;
                self.run_gemm(&Gemm {
                    dt: self.dtype(),
                    n: nq,
                    m: c,
                    k: px,
                    x: scores.addr(),
                    ldx: px,
                    w: vt.addr(),
                    bias: None,
                    gelu: false,
                    out: attn.addr() + (((rows.start + q0) * c) * sz) as u64,
                    ldo: c,
                    fp8: None,
                })?;
            }
        }
        let mut y = self
            .linear(&attn, out_w, Some(out_b))?
            .view(x.shape().to_vec());
        self.add(&mut y, x)?;
        Ok(y)
    }
}
