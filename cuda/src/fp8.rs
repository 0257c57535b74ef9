//! fp8 E4M3 on the device.
//!
//! - Template slabs: uploaded as they are (E4M3 bytes, then a f32 scale per column
//!   group, the host slab's own layout, which the attention kernels read), and
//!   quantised on the device when a capture stores one.
//! - Linear weights (`[device] weight_dtype = "fp8"`): quantised once at load, on the
//!   host, with a scale per output channel (`fp8::quantize_rows`); each GEMM on one
//!   quantises its input per row on the device (`fp8_rows_*`) and runs the fp8 GEMM
//!   (`Gemm::fp8`), whose output is the device dtype.

use denoised_runtime::fp8::{check_matrix, quantize_rows, quantize_tensor, Scaling, DECODE};
use denoised_runtime::{Error, HostSlice, Result, Stored, Tensor};

use crate::backend::{dev, kernel_name, matrix, GpuBackend, GpuTensor};
use crate::exec::Dt;
use crate::exec::{Exec, Grid};
use crate::params::EwParams;
use crate::tensor::from_bytes;

impl<E: Exec> GpuBackend<E> {
    /// `Backend::upload_fp8`: the slab's bytes and scales in one upload.
    pub(crate) fn upload_fp8_slab(
        &self,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scales: &[f32],
    ) -> Result<GpuTensor<E>> {
        check_matrix("upload_fp8", rows, cols, bytes.len(), scales.len())?;
        let out = GpuTensor::alloc_fp8(&**self.exec(), rows, cols, scales.len())?;
        let mut all = Vec::with_capacity(bytes.len() + 4 * scales.len());
        all.extend_from_slice(bytes);
        all.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
        self.exec().upload(out.mem(), 0, &all).map_err(dev)?;
        Ok(out)
    }

    /// `Backend::store_fp8`, quantised on the device (a block per scale group for the
    /// scales, then one pass for the bytes), so the copy engine moves a quarter of the
    /// f32 bytes and the capture never waits on the host.
    pub(crate) fn store_fp8_slab(
        &self,
        t: &GpuTensor<E>,
        dst: &HostSlice,
        groups: usize,
    ) -> Result<()> {
        let (rows, cols) = matrix("store_fp8", t)?;
        check_matrix("store_fp8", rows, cols, rows * cols, groups)?;
        let bytes = rows * cols + 4 * groups;
        if !dst.writable() || dst.len() != bytes {
            return Err(Error::Invalid(format!(
                "storing {bytes} bytes of fp8 into a host slice of {} bytes (writable: {})",
                dst.len(),
                dst.writable()
            )));
        }
        let q = GpuTensor::alloc_fp8(&**self.exec(), rows, cols, groups)?;
        let p = EwParams {
            x: t.addr(),
            y: q.addr(),
            table: q.fp8_scales(),
            rows: rows as i32,
            cols: cols as i32,
            c0: groups as i32,
            ..Default::default()
        };
        let per_group = Grid {
            grid: [groups as u32, 1, 1],
            block: [128, 1, 1],
            smem: 0,
        };
        self.launch(kernel_name("fp8_scales", t.dtype()), per_group, &p)?;
        self.launch(
            kernel_name("fp8_quantize", t.dtype()),
            Grid::linear(rows * cols, 256),
            &p,
        )?;
        self.host.store(self.exec(), q.shared_mem(), 0, dst)
    }
}

/// The bytes of fp8 parts stacked, with each part's scale for each of its rows.
fn fp8_parts(parts: &[Stored<'_>]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut scales = Vec::new();
    for p in parts {
        bytes.extend_from_slice(&p.bytes);
        scales.extend(std::iter::repeat_n(p.scale, p.shape[0]));
    }
    (bytes, scales)
}

impl<E: Exec> GpuBackend<E> {
    /// `Backend::upload_weight_fp8`: the stacked parts quantised on the host (once, at
    /// load), bytes and scales in one upload; parts already fp8 keep their bytes. Refused where the device has no fp8
    /// GEMM, naming it.
    pub(crate) fn upload_fp8_weight(&self, parts: &[Stored<'_>]) -> Result<GpuTensor<E>> {
        self.exec().check_fp8(self.dtype()).map_err(dev)?;
        let shape = denoised_runtime::backend::stacked_shape(parts)?;
        let (rows, cols) = match shape[..] {
            [r, c] => (r, c),
            _ => return Err(Error::shape("upload_weight_fp8", format!("{shape:?}"))),
        };
        let scaling = self.fp8_scaling();
        let one_scale = parts.windows(2).all(|w| w[0].scale == w[1].scale);
        let (bytes, scales) = match (crate::quant::all_fp8(parts), scaling) {
            // A checkpoint's own E4M3 bytes (ComfyUI's fp8 files) are used as they
            // are, its per-tensor scale broadcast over the part's rows: no second
            // rounding (per tensor too where every part has the same scale).
            (true, Scaling::Channel) => fp8_parts(parts),
            (true, Scaling::Tensor) if one_scale => fp8_parts(parts),
            _ => {
                let mut values = Vec::with_capacity(rows * cols);
                for p in parts {
                    values.extend_from_slice(p.to_f32()?.data());
                }
                match scaling {
                    Scaling::Channel => quantize_rows(&values, cols),
                    // One scale, stored for every row: the layout (and a block of
                    // outputs' offset into it) is the per-channel one.
                    Scaling::Tensor => {
                        let (bytes, s) = quantize_tensor(&values);
                        (bytes, vec![s; rows])
                    }
                }
            }
        };
        let w = GpuTensor::alloc_fp8_rows(&**self.exec(), rows, cols, self.dtype())?;
        let mut all = bytes;
        all.resize(w.row_scales_offset(), 0);
        all.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
        self.exec().upload(w.mem(), 0, &all).map_err(dev)?;
        Ok(w)
    }

    /// The values an fp8 weight stands for, `[out, in]` f32 (a merged adapter starts
    /// from them).
    pub(crate) fn download_fp8_weight(&self, w: &GpuTensor<E>) -> Result<Tensor> {
        let (rows, cols) = matrix("download_weight", w)?;
        let mut all = vec![0u8; w.row_scales_offset() + 4 * rows];
        self.exec().download(w.mem(), 0, &mut all).map_err(dev)?;
        let scales = from_bytes(Dt::F32, &all[w.row_scales_offset()..]);
        let values = all[..rows * cols]
            .chunks_exact(cols.max(1))
            .zip(&scales)
            .flat_map(|(row, s)| row.iter().map(move |&b| DECODE[b as usize] * s))
            .collect();
        Tensor::new([rows, cols], values)
    }

    /// The input of an fp8 GEMM on this backend's weights: columns `cols` of `x`'s
    /// rows as packed E4M3 rows, scaled as the weights are
    /// ([`quantize_rows`](Self::quantize_rows) or
    /// [`quantize_tensor`](Self::quantize_tensor)).
    pub(crate) fn quantize_input(
        &self,
        x: &GpuTensor<E>,
        cols: std::ops::Range<usize>,
    ) -> Result<GpuTensor<E>> {
        match self.fp8_scaling() {
            Scaling::Channel => self.quantize_rows(x, cols),
            Scaling::Tensor => self.quantize_tensor(x, cols),
        }
    }

    /// Columns `cols` of `x`'s rows as packed E4M3 rows under one scale, the block's
    /// `amax / 448`, in the first of the tensor's row scales: a reduction over a fixed
    /// grid of blocks, then the quantisation (`fp8_amax_*`, `fp8_tensor_*`).
    pub(crate) fn quantize_tensor(
        &self,
        x: &GpuTensor<E>,
        cols: std::ops::Range<usize>,
    ) -> Result<GpuTensor<E>> {
        /// `FP8_AMAX_BLOCKS` in elementwise.cu.
        const BLOCKS: u32 = 256;
        let (rows, width) = matrix("linear", x)?;
        let q = GpuTensor::alloc_fp8_rows(&**self.exec(), rows, cols.len(), x.dtype())?;
        let maxima = self.exec().alloc(4 * BLOCKS as usize).map_err(dev)?;
        let p = EwParams {
            x: x.addr(),
            y: q.addr(),
            table: self.exec().addr(&maxima),
            seg: q.row_scales,
            rows: rows as i32,
            cols: width as i32,
            c0: cols.start as i32,
            c1: cols.end as i32,
            ..Default::default()
        };
        let reduce = Grid {
            grid: [BLOCKS, 1, 1],
            block: [256, 1, 1],
            smem: 0,
        };
        self.launch(kernel_name("fp8_amax", x.dtype()), reduce, &p)?;
        let n = rows * cols.len();
        self.launch(
            kernel_name("fp8_tensor", x.dtype()),
            Grid::linear(n, 256),
            &p,
        )?;
        Ok(q)
    }

    /// The input of an fp8 GEMM: columns `cols` of `x`'s rows as packed E4M3 rows with
    /// a scale each, one block per row.
    pub(crate) fn quantize_rows(
        &self,
        x: &GpuTensor<E>,
        cols: std::ops::Range<usize>,
    ) -> Result<GpuTensor<E>> {
        let (rows, width) = matrix("linear", x)?;
        let q = GpuTensor::alloc_fp8_rows(&**self.exec(), rows, cols.len(), x.dtype())?;
        let p = EwParams {
            x: x.addr(),
            y: q.addr(),
            table: q.row_scales,
            rows: rows as i32,
            cols: width as i32,
            c0: cols.start as i32,
            c1: cols.end as i32,
            ..Default::default()
        };
        let per_row = Grid {
            grid: [rows as u32, 1, 1],
            block: [256, 1, 1],
            smem: 0,
        };
        self.launch(kernel_name("fp8_rows", x.dtype()), per_row, &p)?;
        Ok(q)
    }
}
