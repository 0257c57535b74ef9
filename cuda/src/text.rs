//! The text-encoder ops of [`GpuBackend`] (T5's and CLIP's): row norms, the gated and
//! quick GELUs, and attention with T5's position bias or CLIP's causal mask.
//!
//! A prompt is at most 512 tokens, so its attention is one launch per layer,
//! `text_attn_*` (every head and query row, T5's bias or CLIP's causal mask, an online
//! softmax in f32): T5-XXL's 64 heads took about 6 launches a head (9,200 a prompt) in
//! the per-head form. That form stays for head dims above 128: K and V of the head
//! copied out of the fused `q | k | v` rows (V transposed, the second GEMM's
//! `[head_dim, len]` operand), the scores `[len, len]` softmaxed in place with the bias
//! or mask, and the head's output copied into its columns. The FLUX attention kernels
//! are not reused: they have neither an additive bias nor a causal mask.

use denoised_runtime::{Error, Result, TextMask};

use crate::backend::{matrix, GpuBackend, GpuTensor};
use crate::exec::{Exec, Gemm, Grid};
use crate::params::{EwParams, ImgParams, LnModParams, TextAttnParams};

const BLOCK: u32 = 256;
/// One warp per row, four warps a block.
const ROW_BLOCK: u32 = 128;

impl<E: Exec> GpuBackend<E> {
    /// LayerNorm with affine (`bias` given) or RMSNorm, one warp per row.
    pub(crate) fn row_norm(
        &self,
        x: &GpuTensor<E>,
        weight: &GpuTensor<E>,
        bias: Option<&GpuTensor<E>>,
        eps: f64,
    ) -> Result<GpuTensor<E>> {
        let op = if bias.is_some() {
            "ln_affine"
        } else {
            "rms_norm"
        };
        let (rows, d) = matrix(op, x)?;
        if weight.shape() != [d] || bias.is_some_and(|b| b.shape() != [d]) {
            return Err(Error::shape(
                op,
                format!("weights for rows of {d}, got {:?}", weight.shape()),
            ));
        }
        let out = self.empty(vec![rows, d])?;
        let p = LnModParams {
            x: x.addr(),
            out: out.addr(),
            scale: weight.addr(),
            shift: bias.map_or(0, |b| b.addr()),
            rows: rows as i32,
            width: d as i32,
            eps: eps as f32,
            ..Default::default()
        };
        self.launch(
            self.kernel(op),
            Grid::linear(rows.div_ceil(4) * 128, ROW_BLOCK),
            &p,
        )?;
        Ok(out)
    }

    pub(crate) fn gated_gelu_rows(&self, x: &GpuTensor<E>) -> Result<GpuTensor<E>> {
        let (rows, w2) = matrix("gated_gelu", x)?;
        if w2 % 2 != 0 {
            return Err(Error::shape("gated_gelu", format!("odd width {w2}")));
        }
        let out = self.empty(vec![rows, w2 / 2])?;
        let p = EwParams {
            x: x.addr(),
            y: out.addr(),
            rows: rows as i32,
            cols: (w2 / 2) as i32,
            ..Default::default()
        };
        self.launch(
            self.kernel("gated_gelu"),
            Grid::linear(rows * w2 / 2, BLOCK),
            &p,
        )?;
        Ok(out)
    }

    pub(crate) fn quick_gelu_n(&self, x: &GpuTensor<E>) -> Result<()> {
        let n: usize = x.shape().iter().product();
        let p = EwParams {
            x: x.addr(),
            n: n as i32,
            ..Default::default()
        };
        self.launch(self.kernel("quick_gelu"), Grid::linear(n, BLOCK), &p)
    }

    /// `y[r, ..cols] = x[r, ..cols]` for `rows` rows, row strides `ldx` and `ldy`
    /// (addresses already at the blocks).
    fn copy2d(
        &self,
        x: u64,
        ldx: usize,
        y: u64,
        ldy: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let p = ImgParams {
            x,
            y,
            rows: rows as i32,
            cols: cols as i32,
            ld: ldx as i32,
            ldy: ldy as i32,
            ..Default::default()
        };
        self.launch(self.kernel("copy2d"), Grid::linear(rows * cols, BLOCK), &p)
    }

    pub(crate) fn text_attention_heads(
        &self,
        qkv: &GpuTensor<E>,
        heads: usize,
        hd: usize,
        scale: f32,
        mask: TextMask<'_, GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        const OP: &str = "text_attention";
        let (len, w) = matrix(OP, qkv)?;
        let inner = heads * hd;
        let bias = match mask {
            TextMask::Bias(b) if b.shape() != [heads * len, len] => {
                return Err(Error::shape(
                    OP,
                    format!("bias {:?} for {heads} heads of {len}", b.shape()),
                ))
            }
            TextMask::Bias(b) => Some(b),
            TextMask::Causal => None,
        };
        if w != 3 * inner {
            return Err(Error::shape(
                OP,
                format!("q|k|v {:?} for {heads} heads of {hd}", qkv.shape()),
            ));
        }
        let out = self.empty(vec![len, inner])?;
        if hd <= 128 {
            let p = TextAttnParams {
                qkv: qkv.addr(),
                out: out.addr(),
                bias: bias.map_or(0, |b| b.addr()),
                len: len as i32,
                heads: heads as i32,
                head_dim: hd as i32,
                causal: matches!(mask, TextMask::Causal) as i32,
                scale,
                pad: 0,
            };
            let g = Grid {
                grid: [len.div_ceil(4) as u32, heads as u32, 1],
                block: [ROW_BLOCK, 1, 1],
                smem: 0,
            };
            self.launch(self.kernel("text_attn"), g, &p)?;
            return Ok(out);
        }
        let sz = self.dtype().size() as u64;
        let k = self.empty(vec![len, hd])?;
        let vt = self.empty(vec![hd, len])?;
        let scores = self.empty(vec![len, len])?;
        let o = self.empty(vec![len, hd])?;
        let gemm = |x: u64, ldx: usize, n: usize, m: usize, kk: usize, w: u64, out: u64| {
            self.run_gemm(&Gemm {
                dt: self.dtype(),
                n,
                m,
                k: kk,
                x,
                ldx,
                w,
                bias: None,
                gelu: false,
                out,
                ldo: m,
                fp8: None,
            })
        };
        for h in 0..heads {
            let col = |c: usize| qkv.addr() + (c + h * hd) as u64 * sz;
            self.copy2d(col(inner), w, k.addr(), hd, len, hd)?;
            let t = ImgParams {
                x: col(2 * inner),
                y: vt.addr(),
                rows: len as i32,
                cols: hd as i32,
                ld: w as i32,
                ..Default::default()
            };
            self.launch(self.kernel("transpose"), Grid::linear(len * hd, BLOCK), &t)?;
            gemm(col(0), w, len, len, hd, k.addr(), scores.addr())?;
            let s = ImgParams {
                x: scores.addr(),
                bias: bias.map_or(0, |b| b.addr() + (h * len * len) as u64 * sz),
                causal: matches!(mask, TextMask::Causal) as i32,
                rows: len as i32,
                cols: len as i32,
                scale,
                ..Default::default()
            };
            self.launch(
                self.kernel("softmax_rows"),
                Grid::linear(len.div_ceil(4) * 128, 128),
                &s,
            )?;
            gemm(scores.addr(), len, len, hd, len, vt.addr(), o.addr())?;
            self.copy2d(
                o.addr(),
                hd,
                out.addr() + (h * hd) as u64 * sz,
                inner,
                len,
                hd,
            )?;
        }
        Ok(out)
    }
}
