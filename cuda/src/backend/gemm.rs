//! The GEMM launch (with its bias and GELU epilogues) and the modulation-table lookup
//! that the backend's ops share.

use std::ops::Range;

use denoised_runtime::backend::Modulation;
use denoised_runtime::{Error, Result};

use super::{dev, kernel_name, matrix, GpuBackend, GpuTensor};
use crate::exec::{Exec, Fp8Scales, Gemm, Grid};
use crate::params::EpilogueParams;

impl<E: Exec> GpuBackend<E> {
    /// One GEMM into a new `[rows, outputs]` matrix (see [`gemm_into`](Self::gemm_into);
    /// `outs` is the row block a Y-mode step recomputes).
    pub(super) fn gemm(
        &self,
        x: &GpuTensor<E>,
        cols: Range<usize>,
        w: &GpuTensor<E>,
        outs: Option<Range<usize>>,
        b: Option<&GpuTensor<E>>,
        gelu: bool,
    ) -> Result<GpuTensor<E>> {
        let (n, m) = (x.rows(), outs.as_ref().map_or(w.rows(), |o| o.len()));
        let out = self.empty(vec![n, m])?;
        self.gemm_into(x, cols, w, outs, b, gelu, (&out, 0))?;
        Ok(out)
    }

    /// `linear(x, w, b)` with GELU over the output columns `gelu_from..`: two GEMMs
    /// into one output where both parts are non-empty, the second with the GELU
    /// epilogue, so the GELU costs no pass of its own.
    pub(super) fn gemm_gelu_from(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: Option<&GpuTensor<E>>,
        gelu_from: usize,
    ) -> Result<GpuTensor<E>> {
        let (k, m) = (x.cols(), w.rows());
        let from = gelu_from.min(m);
        if from == 0 || from == m {
            return self.gemm(x, 0..k, w, None, b, from == 0);
        }
        // With fp8 weights both parts read x in fp8: quantised once, here.
        let quantised;
        let x = match w.row_scales {
            0 => x,
            _ => {
                quantised = self.quantize_input(x, 0..k)?;
                &quantised
            }
        };
        let mut out = self.empty(vec![x.rows(), m])?;
        // cuBLASLt's fp8 GEMMs on an H100 refused a block of 7 outputs, even bare
        // (14 and 24 ran): an fp8 split whose parts are not multiples of 16 wide (no
        // FLUX width is) is one GEMM and a GELU pass over its columns instead.
        if w.row_scales != 0 && (from % 16 != 0 || (m - from) % 16 != 0) {
            self.gemm_into(x, 0..k, w, None, b, false, (&out, 0))?;
            use denoised_runtime::backend::Backend;
            self.gelu_tanh(&mut out, from..m)?;
            return Ok(out);
        }
        self.gemm_into(x, 0..k, w, Some(0..from), b, false, (&out, 0))?;
        self.gemm_into(x, 0..k, w, Some(from..m), b, true, (&out, from))?;
        Ok(out)
    }

    /// One GEMM over the column block `cols` of `x` and the output features `outs` of
    /// `w` (all of them, or a row block: the weight is `[out, in]` row-major, so a
    /// block of outputs is read in place at an offset), with the bias and GELU
    /// epilogues, written to `out.0` from its column `out.1` on. An fp8 weight runs
    /// the fp8 GEMM, on x quantised here unless it already is (fp8 rows).
    #[allow(clippy::too_many_arguments)]
    fn gemm_into(
        &self,
        x: &GpuTensor<E>,
        cols: Range<usize>,
        w: &GpuTensor<E>,
        outs: Option<Range<usize>>,
        b: Option<&GpuTensor<E>>,
        gelu: bool,
        (out, out_col): (&GpuTensor<E>, usize),
    ) -> Result<()> {
        let (n, kx) = matrix("linear", x)?;
        let (m, k) = matrix("linear", w)?;
        let outs = outs.unwrap_or(0..m);
        let (on, ow) = matrix("linear", out)?;
        if cols.end > kx
            || cols.len() != k
            || outs.end > m
            || b.is_some_and(|b| b.len() != m)
            || on != n
            || out_col + outs.len() > ow
        {
            return Err(Error::shape(
                "linear",
                format!(
                    "x {:?} columns {cols:?} against outputs {outs:?} of weight {:?} into {:?} at column {out_col}",
                    x.shape, w.shape, out.shape
                ),
            ));
        }
        let sz = self.dt.size() as u64;
        if n == 0 || outs.is_empty() {
            return Ok(());
        }
        // A quantised weight: its rows `outs` expanded a tile at a time into a scratch
        // matrix (freed in stream order after its GEMM, so the pool hands the next
        // tile the same memory), each tile one GEMM into its columns of `out`.
        if w.quant.is_some() {
            let tile = crate::quant::tile_rows(self.quant_tile_rows, k, self.dt.size());
            for t0 in outs.clone().step_by(tile) {
                let t = t0..(t0 + tile).min(outs.end);
                let dense = self.dequantize_rows(w, t.clone())?;
                let bias = b.map(|b| b.offset_view(t.start, t.len()));
                self.gemm_into(
                    x,
                    cols.clone(),
                    &dense,
                    None,
                    bias.as_ref(),
                    gelu,
                    (out, out_col + (t.start - outs.start)),
                )?;
            }
            return Ok(());
        }
        let mut g = Gemm {
            dt: self.dt,
            n,
            m: outs.len(),
            k,
            x: x.addr + cols.start as u64 * sz,
            ldx: kx,
            w: w.addr + (outs.start * k) as u64 * sz,
            bias: b.map(|b| b.addr + outs.start as u64 * sz),
            gelu,
            out: out.addr + out_col as u64 * sz,
            ldo: ow,
            fp8: None,
        };
        // An fp8 weight multiplies fp8 inputs: x's column block quantised per row
        // into a packed temporary (freed in stream order after the GEMM). A block of
        // output channels is an offset into the bytes and into the scales.
        let quantised;
        if w.row_scales != 0 {
            let q = match x.row_scales {
                0 => {
                    quantised = self.quantize_input(x, cols)?;
                    &quantised
                }
                _ => x,
            };
            g.x = q.addr;
            g.ldx = k;
            g.w = w.addr + (outs.start * k) as u64;
            g.fp8 = Some(Fp8Scales {
                x: q.row_scales,
                w: w.row_scales + 4 * outs.start as u64,
                tensor: self.fp8_scaling() == denoised_runtime::fp8::Scaling::Tensor,
            });
        }
        self.run_gemm(&g)
    }

    /// Runs `g` on the executor, or bare with the epilogue as a pass of its own where
    /// the GEMM library refuses it as asked.
    pub(crate) fn run_gemm(&self, g: &Gemm) -> Result<()> {
        match self.exec.gemm(g) {
            Err(crate::CudaError::Unsupported(_)) => self.gemm_bare(g),
            other => other.map_err(dev),
        }
    }

    /// `g` where the GEMM library refused it as asked (cuBLASLt on an H100 has no
    /// outer-vector-scaled fp8 and refused some misaligned biases and outputs,
    /// docs/gpu.md): the bare GEMM (unit scales, no epilogue) into an aligned scratch
    /// matrix from the pool, then one pass applying scales, bias and GELU on the way
    /// to `g`'s output.
    fn gemm_bare(&self, g: &Gemm) -> Result<()> {
        let ld = g.m.next_multiple_of(8);
        let raw = self.empty(vec![g.n, ld])?;
        let bare = Gemm {
            bias: None,
            gelu: false,
            out: raw.addr,
            ldo: ld,
            fp8: g.fp8.map(|s| Fp8Scales { x: 0, w: 0, ..s }),
            ..*g
        };
        self.exec.gemm(&bare).map_err(dev)?;
        let scales = g.fp8.filter(|s| s.x != 0);
        let p = EpilogueParams {
            src: raw.addr,
            dst: g.out,
            xs: scales.map_or(0, |s| s.x),
            ws: scales.map_or(0, |s| s.w),
            bias: g.bias.unwrap_or(0),
            rows: g.n as i32,
            cols: g.m as i32,
            ld_src: ld as i32,
            ld_dst: g.ldo as i32,
            gelu: g.gelu as i32,
            scalar: scales.is_some_and(|s| s.tensor) as i32,
        };
        self.launch(
            kernel_name("linear_epilogue", self.dt),
            Grid::linear(g.n * g.m, 256),
            &p,
        )
    }

    /// The device address and row stride of a modulation chunk, its segments checked.
    pub(super) fn seg_table(
        &self,
        op: &'static str,
        m: &Modulation<'_, GpuTensor<E>>,
        rows: usize,
        width: usize,
    ) -> Result<(u64, i32)> {
        let t = m.table;
        if m.seg.len() != rows || (m.chunk + 1) * width > t.cols() {
            return Err(Error::shape(
                op,
                format!(
                    "{} segment ids for {rows} rows; chunk {} of width {width} in a table of width {}",
                    m.seg.len(),
                    m.chunk,
                    t.cols()
                ),
            ));
        }
        if let Some(bad) = m.seg.iter().find(|&&s| s as usize >= t.rows()) {
            return Err(Error::shape(op, format!("segment {bad} of {}", t.rows())));
        }
        Ok((
            t.addr + (m.chunk * width * self.dt.size()) as u64,
            t.cols() as i32,
        ))
    }
}
