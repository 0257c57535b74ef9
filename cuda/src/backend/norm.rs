//! The Flux blocks' row norms as launches: LayerNorm + modulation (alone, or after the
//! gated residual it follows, in one pass), per-head RMSNorm + RoPE of q and k in one
//! launch, and the gated residual alone.

use denoised_runtime::backend::{HeadNorm, Modulation};
use denoised_runtime::{Error, Result};

use super::{matrix, GpuBackend, GpuTensor, ROW_BLOCK};
use crate::exec::{Exec, Grid};
use crate::params::{EwParams, LnModParams, RmsRopeParams};

/// The gated residual a LayerNorm follows: `x += gate[seg] * y` first.
pub(super) type Residual<'a, E> = (&'a GpuTensor<E>, Modulation<'a, GpuTensor<E>>);

impl<E: Exec> GpuBackend<E> {
    /// `LN(x) * (1 + scale) + shift` per row segment, one warp per row; with
    /// `residual`, x is first updated in place by it (`residual_ln_modulate`).
    pub(super) fn ln_modulate(
        &self,
        x: &GpuTensor<E>,
        residual: Option<Residual<'_, E>>,
        eps: f32,
        shift: Modulation<'_, GpuTensor<E>>,
        scale: Modulation<'_, GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        const OP: &str = "layer_norm_modulate";
        let (rows, width) = matrix(OP, x)?;
        let (sh, tc) = self.seg_table(OP, &shift, rows, width)?;
        let (sc, tc2) = self.seg_table(OP, &scale, rows, width)?;
        if tc != tc2 || shift.seg != scale.seg {
            return Err(Error::shape(
                OP,
                "shift and scale must share a table layout and segment ids",
            ));
        }
        let (mut y, mut gate) = (0, 0);
        if let Some((yt, g)) = &residual {
            let (ga, gc) = self.seg_table(OP, g, rows, width)?;
            if yt.shape != x.shape || gc != tc || g.seg != shift.seg {
                return Err(Error::shape(
                    OP,
                    format!(
                        "residual {:?} onto {:?}: the gate must share the modulation's table layout and segment ids",
                        yt.shape, x.shape
                    ),
                ));
            }
            (y, gate) = (yt.addr, ga);
        }
        let out = self.empty(vec![rows, width])?;
        let (_seg, seg) = self.segments(shift.seg)?;
        let p = LnModParams {
            x: x.addr,
            out: out.addr,
            shift: sh,
            scale: sc,
            seg,
            y,
            gate,
            rows: rows as i32,
            width: width as i32,
            table_cols: tc,
            eps,
            ..Default::default()
        };
        let name = match residual {
            Some(_) => self.kernel("residual_ln_modulate"),
            None => self.kernel("ln_modulate"),
        };
        self.launch(name, Grid::linear(rows * 32, ROW_BLOCK), &p)?;
        Ok(out)
    }

    /// Per-head RMSNorm (+ RoPE) of column ranges of `x`, two ranges a launch.
    pub(super) fn rms_rope(
        &self,
        x: &GpuTensor<E>,
        heads: &[HeadNorm<'_, GpuTensor<E>>],
        eps: f32,
        rope: Option<(&GpuTensor<E>, &GpuTensor<E>)>,
    ) -> Result<()> {
        const OP: &str = "rms_norm_rope";
        let (rows, width) = matrix(OP, x)?;
        let hd = heads.first().map_or(0, |h| h.weight.len());
        for HeadNorm { cols, weight } in heads {
            if cols.end > width
                || hd == 0
                || weight.len() != hd
                || cols.len() % hd != 0
                || hd % 2 != 0
            {
                return Err(Error::shape(
                    OP,
                    format!(
                        "columns {cols:?} of {width} in heads of {}, every range's {hd}",
                        weight.len()
                    ),
                ));
            }
        }
        if let Some((c, s)) = rope {
            if c.shape != [rows, hd] || s.shape != [rows, hd] {
                return Err(Error::shape(
                    OP,
                    format!(
                        "rope tables {:?}/{:?}, expected [{rows}, {hd}]",
                        c.shape, s.shape
                    ),
                ));
            }
        }
        for pair in heads.chunks(2) {
            let mut p = RmsRopeParams {
                x: x.addr,
                cos: rope.map_or(0, |r| r.0.addr),
                sin: rope.map_or(0, |r| r.1.addr),
                rows: rows as i32,
                stride: width as i32,
                head_dim: hd as i32,
                eps,
                ..Default::default()
            };
            for (i, h) in pair.iter().enumerate() {
                p.weight[i] = h.weight.addr;
                p.c0[i] = h.cols.start as i32;
                p.heads[i] = (h.cols.len() / hd) as i32;
            }
            let units = rows * (p.heads[0] + p.heads[1]) as usize;
            self.launch(
                self.kernel("rms_rope"),
                Grid::linear(units * 32, ROW_BLOCK),
                &p,
            )?;
        }
        Ok(())
    }

    /// `x += gate[seg] * y`.
    pub(super) fn gated_residual_rows(
        &self,
        x: &GpuTensor<E>,
        y: &GpuTensor<E>,
        gate: Modulation<'_, GpuTensor<E>>,
    ) -> Result<()> {
        let (rows, width) = matrix("gated_residual", x)?;
        if x.shape != y.shape {
            return Err(Error::shape(
                "gated_residual",
                format!("{:?} vs {:?}", x.shape, y.shape),
            ));
        }
        let (table, table_cols) = self.seg_table("gated_residual", &gate, rows, width)?;
        let (_seg, seg) = self.segments(gate.seg)?;
        let p = EwParams {
            x: x.addr,
            y: y.addr,
            table,
            seg,
            rows: rows as i32,
            cols: width as i32,
            table_cols,
            ..Default::default()
        };
        // A thread per run of 8 values (the kernel's 16-byte path).
        let g = Grid::linear((rows * width).div_ceil(8), 256);
        self.launch(self.kernel("gated_residual"), g, &p)
    }
}
