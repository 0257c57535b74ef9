//! GGUF-quantised Linear weights on the device: the blocks are uploaded as they are
//! (Q4_K: 4.5 bits a weight), and a GEMM with such a weight first expands the output
//! rows it needs into a scratch matrix of the device dtype with the `dequant_*`
//! kernel (kernels/quant.cu, bit-exact with `denoised_runtime::quant::dequantize`,
//! then rounded to bf16 on a bf16 device) and runs the usual GEMM on it, a tile of
//! output rows at a time ([`tile_rows`]: as many as fit [`TILE_BYTES`], a multiple of
//! 256). Each tile's scratch is allocated from the stream-ordered pool
//! (cuMemAllocAsync) and freed after its GEMM, so the next tile reuses it: at most
//! about 32 MiB of dense values are live per GEMM, whatever the weight's size (FLUX's
//! bf16 rows of in = 3072: 5376 rows a tile, so its largest projection, 21504 outputs,
//! is four GEMMs, each still large enough to fill the device).

use std::ops::Range;

use denoised_runtime::cpu::qlinear::stacked_quant;
use denoised_runtime::{quant, Error, QuantType, Result, Stored, StoredFormat, Tensor};

use crate::backend::{dev, matrix, GpuBackend};
use crate::exec::{Dt, Exec, Grid};
use crate::params::EwParams;
use crate::tensor::GpuTensor;

/// Bytes of dense scratch one tile of a quantised GEMM may take.
pub(crate) const TILE_BYTES: usize = 32 << 20;

/// Output rows expanded per tile for rows of `k` values of `elem` bytes: `fixed` if
/// set (tests), else as many as fit [`TILE_BYTES`], rounded down to a multiple of
/// 256 (at least 256).
pub(crate) fn tile_rows(fixed: usize, k: usize, elem: usize) -> usize {
    match fixed {
        0 => (TILE_BYTES / (k * elem).max(1) / 256 * 256).max(256),
        n => n,
    }
}

/// The dequantising kernel of `ty` writing `dt`.
fn kernel(ty: QuantType, dt: Dt) -> &'static str {
    match (ty, dt) {
        (QuantType::Q8_0, Dt::F32) => "dequant_q8_0_f32",
        (QuantType::Q8_0, Dt::Bf16) => "dequant_q8_0_bf16",
        (QuantType::Q4_0, Dt::F32) => "dequant_q4_0_f32",
        (QuantType::Q4_0, Dt::Bf16) => "dequant_q4_0_bf16",
        (QuantType::Q5_0, Dt::F32) => "dequant_q5_0_f32",
        (QuantType::Q5_0, Dt::Bf16) => "dequant_q5_0_bf16",
        (QuantType::Q4_K, Dt::F32) => "dequant_q4_k_f32",
        (QuantType::Q4_K, Dt::Bf16) => "dequant_q4_k_bf16",
        (QuantType::Q5_K, Dt::F32) => "dequant_q5_k_f32",
        (QuantType::Q5_K, Dt::Bf16) => "dequant_q5_k_bf16",
        (QuantType::Q6_K, Dt::F32) => "dequant_q6_k_f32",
        (QuantType::Q6_K, Dt::Bf16) => "dequant_q6_k_bf16",
    }
}

impl<E: Exec> GpuBackend<E> {
    /// `parts` (GGUF blocks of one type, `[rows, in]` each) stacked along rows as one
    /// quantised weight, or `None` where they are not all such.
    pub(crate) fn upload_quant_weight(&self, parts: &[Stored<'_>]) -> Result<Option<GpuTensor<E>>> {
        let Some((ty, rows, cols)) = stacked_quant(parts)? else {
            return Ok(None);
        };
        let mem = self
            .exec()
            .alloc(rows * ty.bytes_for(cols, &parts[0].name)?)
            .map_err(dev)?;
        let mut offset = 0;
        for p in parts {
            self.exec().upload(&mem, offset, &p.bytes).map_err(dev)?;
            offset += p.bytes.len();
        }
        let addr = self.exec().addr(&mem);
        Ok(Some(GpuTensor {
            mem: std::sync::Arc::new(mem),
            addr,
            shape: vec![rows, cols],
            dt: self.dtype(),
            fp8_scales: 0,
            row_scales: 0,
            quant: Some(ty),
        }))
    }

    /// Rows `r` of a quantised weight, dequantised into a new `[r.len(), in]` matrix
    /// of the device dtype.
    pub(crate) fn dequantize_rows(
        &self,
        w: &GpuTensor<E>,
        r: Range<usize>,
    ) -> Result<GpuTensor<E>> {
        let ty = w
            .quant
            .ok_or_else(|| Error::Invalid("dequantize_rows: not a quantised weight".into()))?;
        let (rows, cols) = matrix("dequantize_rows", w)?;
        if r.end > rows || r.start > r.end {
            return Err(Error::shape(
                "dequantize_rows",
                format!("rows {r:?} of {:?}", w.shape),
            ));
        }
        let out = self.empty(vec![r.len(), cols])?;
        if r.is_empty() || cols == 0 {
            return Ok(out);
        }
        let row_bytes = cols / ty.block_elems() * ty.block_bytes();
        let p = EwParams {
            x: w.addr + (r.start * row_bytes) as u64,
            y: out.addr,
            rows: r.len() as i32,
            cols: cols as i32,
            ..Default::default()
        };
        self.launch(
            kernel(ty, self.dtype()),
            Grid::linear(r.len() * cols, 256),
            &p,
        )?;
        Ok(out)
    }

    /// A quantised weight's values as the host reference computes them (its blocks
    /// downloaded and dequantised on the host, exactly).
    pub(crate) fn download_quant_weight(&self, w: &GpuTensor<E>) -> Result<Tensor> {
        let ty = w.quant.expect("a quantised weight");
        let (rows, cols) = matrix("download_weight", w)?;
        let mut bytes = vec![0u8; ty.bytes_for(rows * cols, "download_weight")?];
        self.exec().download(&w.mem, 0, &mut bytes).map_err(dev)?;
        Tensor::new([rows, cols], quant::dequantize_vec(ty, &bytes))
    }

    /// Bytes the weight holds on the device.
    pub(crate) fn resident_weight_bytes(&self, w: &GpuTensor<E>) -> u64 {
        let (rows, cols) = (w.rows(), w.cols());
        match (w.quant, w.row_scales) {
            (Some(ty), _) => ty.bytes_for(rows * cols, "").unwrap_or(0) as u64,
            (None, 0) => (w.len() * w.dt.size()) as u64,
            (None, _) => (rows * cols + 4 * rows) as u64,
        }
    }
}

/// Whether every part is fp8 E4M3 (a checkpoint's own fp8 bytes, with a per-tensor
/// scale each).
pub(crate) fn all_fp8(parts: &[Stored<'_>]) -> bool {
    !parts.is_empty()
        && parts
            .iter()
            .all(|p| matches!(p.format(), StoredFormat::Fp8 { .. }) && p.shape.len() == 2)
}

#[cfg(test)]
mod tests {
    #[test]
    fn tiles_fit_their_byte_budget() {
        use super::{tile_rows, TILE_BYTES};
        // FLUX rows (in 3072) in bf16: 5376 rows, its 21504-output projection in four.
        assert_eq!(tile_rows(0, 3072, 2), 5376);
        assert!(tile_rows(0, 15360, 2) * 15360 * 2 <= TILE_BYTES);
        assert_eq!(tile_rows(0, 1 << 30, 4), 256);
        assert_eq!(tile_rows(16, 3072, 2), 16);
    }
}
