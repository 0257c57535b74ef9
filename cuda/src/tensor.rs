//! [`GpuTensor`]: a tensor in device memory, the [`crate::GpuBackend`]'s buffer type.

use std::sync::Arc;

use denoised_runtime::Result;

use crate::backend::dev;
use crate::exec::{Dt, Exec};

pub struct GpuTensor<E: Exec> {
    /// Shared only with stores in flight (see `crate::host`).
    pub(crate) mem: Arc<E::Mem>,
    pub(crate) addr: u64,
    pub(crate) shape: Vec<usize>,
    pub(crate) dt: Dt,
    /// An fp8 template slab (`rows x cols` E4M3 bytes, then a f32 scale per column
    /// group, the host slab's own layout): the address of its scales. Only attention
    /// reads such a tensor (as a K/V source); 0 for every other tensor.
    pub(crate) fp8_scales: u64,
    /// An fp8 Linear weight, or the quantised input of its GEMM (`rows x cols` E4M3
    /// bytes, then a f32 scale per row at [`ROW_SCALES_ALIGN`]): the address of its
    /// scales; `dt` is then the dtype the GEMM writes. 0 for every other tensor.
    pub(crate) row_scales: u64,
    /// A GGUF-quantised Linear weight: `shape` is its `[out, in]` values, the memory
    /// holds their blocks (`crate::quant`), and `dt` is the dtype its GEMMs
    /// dequantise into. `None` for every other tensor.
    pub(crate) quant: Option<denoised_runtime::QuantType>,
}

/// Where an fp8-rows tensor's scales start: cuBLASLt wants its scale vectors aligned
/// (16 bytes at least); 256 is what every allocation already has.
const ROW_SCALES_ALIGN: usize = 256;

impl<E: Exec> GpuTensor<E> {
    /// A tensor of undefined contents.
    pub(crate) fn alloc(exec: &E, shape: Vec<usize>, dt: Dt) -> Result<Self> {
        let n: usize = shape.iter().product();
        let mem = exec.alloc(n * dt.size()).map_err(dev)?;
        let addr = exec.addr(&mem);
        Ok(GpuTensor {
            mem: Arc::new(mem),
            addr,
            shape,
            dt,
            fp8_scales: 0,
            row_scales: 0,
            quant: None,
        })
    }

    /// A matrix of fp8 rows of undefined contents: `rows x cols` E4M3 bytes, then a
    /// f32 scale per row; a GEMM on it writes `dt`.
    pub(crate) fn alloc_fp8_rows(exec: &E, rows: usize, cols: usize, dt: Dt) -> Result<Self> {
        let at = (rows * cols).next_multiple_of(ROW_SCALES_ALIGN);
        let mem = exec.alloc(at + 4 * rows).map_err(dev)?;
        let addr = exec.addr(&mem);
        Ok(GpuTensor {
            mem: Arc::new(mem),
            addr,
            shape: vec![rows, cols],
            dt,
            fp8_scales: 0,
            row_scales: addr + at as u64,
            quant: None,
        })
    }
    /// Byte offset of an fp8-rows tensor's scales in its allocation.
    pub(crate) fn row_scales_offset(&self) -> usize {
        (self.row_scales - self.addr) as usize
    }

    /// An fp8 slab of undefined contents: `rows x cols` bytes, then `groups` f32
    /// scales.
    pub(crate) fn alloc_fp8(exec: &E, rows: usize, cols: usize, groups: usize) -> Result<Self> {
        let mem = exec.alloc(rows * cols + 4 * groups).map_err(dev)?;
        let addr = exec.addr(&mem);
        Ok(GpuTensor {
            mem: Arc::new(mem),
            addr,
            shape: vec![rows, cols],
            dt: Dt::Bf16,
            fp8_scales: addr + (rows * cols) as u64,
            row_scales: 0,
            quant: None,
        })
    }
    /// The address of an fp8 slab's scales (0 for other tensors).
    pub(crate) fn fp8_scales(&self) -> u64 {
        self.fp8_scales
    }
    pub(crate) fn mem(&self) -> &E::Mem {
        &self.mem
    }
    /// The allocation, shared (with a store in flight, see `crate::host`).
    pub(crate) fn shared_mem(&self) -> Arc<E::Mem> {
        self.mem.clone()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> Dt {
        self.dt
    }
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }
    pub(crate) fn rows(&self) -> usize {
        if self.shape.len() <= 1 {
            1
        } else {
            self.shape[..self.shape.len() - 1].iter().product()
        }
    }
    pub(crate) fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// Elements `start..start + len` of a vector (a bias's block), sharing its memory.
    pub(crate) fn offset_view(&self, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= self.len() && self.quant.is_none() && self.row_scales == 0);
        GpuTensor {
            addr: self.addr + (start * self.dt.size()) as u64,
            shape: vec![len],
            ..self.view(self.shape.clone())
        }
    }
    /// The same memory under another shape of as many elements (image tensors are
    /// `[B, C, H, W]` to the model and `[B*H*W, C]` matrices to the GEMMs).
    pub(crate) fn view(&self, shape: Vec<usize>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.len());
        GpuTensor {
            mem: self.mem.clone(),
            addr: self.addr,
            shape,
            dt: self.dt,
            fp8_scales: self.fp8_scales,
            row_scales: self.row_scales,
            quant: self.quant,
        }
    }
}

/// Host f32 values as the bytes of a device tensor of `dt`.
pub(crate) fn to_bytes(dt: Dt, data: &[f32]) -> Vec<u8> {
    match dt {
        Dt::F32 => data.iter().flat_map(|v| v.to_ne_bytes()).collect(),
        Dt::Bf16 => data
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_ne_bytes())
            .collect(),
    }
}

/// The bytes of a device tensor of `dt` as host f32 values.
pub(crate) fn from_bytes(dt: Dt, bytes: &[u8]) -> Vec<f32> {
    match dt {
        Dt::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
        Dt::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}
