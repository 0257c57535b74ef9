//! fp8 template slabs on the device: uploaded as they are (E4M3 bytes, then a f32
//! scale per column group, the host slab's own layout, which the attention kernels
//! read), and quantised on the device when a capture stores one.

use denoised_runtime::fp8::check_matrix;
use denoised_runtime::{Error, HostSlice, Result};

use crate::backend::{dev, kernel_name, matrix, GpuBackend, GpuTensor};
use crate::exec::{Exec, Grid};
use crate::params::EwParams;

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
