//! [`GpuBackend`]: the `Backend` trait on a device, over any [`Exec`].
//!
//! Tensors live in device memory as f32 (the "f32 mode", for matching the reference
//! fixtures) or bf16 (production: half the bytes, tensor-core GEMMs and attention),
//! always with f32 accumulation. Host-side this module only builds descriptors:
//! per-row segment ids, packed row references for attention, launch geometry. It
//! uploads them once per call and launches; it never touches tensor data on the host.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use denoised_runtime::backend::{stacked_shape, AttnSeq, Backend, HeadNorm, Modulation};
use denoised_runtime::cpu::sparse_conv::PreAct;
use denoised_runtime::{Conv2dOpts, DeviceTimer, TextMask};
use denoised_runtime::{DType, Error, HostMemory, HostSlice, Result, SlabProvider, Stored, Tensor};

use crate::exec::{Dt, Exec, Grid};
use crate::host::HostIo;
use crate::params::{EwParams, GatherParams, KernelParams};
pub use crate::tensor::GpuTensor;
use crate::tensor::{from_bytes, to_bytes};
use crate::CudaError;

mod gemm;
mod norm;
mod timer;

pub struct GpuBackend<E: Exec> {
    /// Shared with the template streams, which queue loads on the same device.
    exec: Arc<E>,
    dt: Dt,
    /// Segment-id arrays already on the device, by content. A step's forward passes
    /// the same few arrays (text, image, joint rows) to every modulated op of every
    /// block; without this each op would upload its copy again.
    segments: Mutex<Vec<DeviceSegments<E>>>,
    pub(crate) host: HostIo<E>,
    /// Bytes of patch matrix or attention scores one chunk of an image op takes
    /// (`crate::image`).
    pub(crate) image_workspace: usize,
    /// Whether convolutions may go to the executor's library (cuDNN); off, every
    /// convolution runs as im2col + GEMM (the self-test checks both paths).
    pub(crate) conv_library: bool,
    /// Which tensor-core attention kernel runs (`crate::attention::AttnKernel`).
    pub(crate) attn_kernel: std::sync::atomic::AtomicU8,
    /// Attention launches run by the executor's library and by our kernels, since
    /// start (benchmarks and the self-test say which path ran).
    pub(crate) attn_launches: [std::sync::atomic::AtomicU64; 2],
    /// `[device] weight_dtype = "fp8"`: the transformer's large Linears go to the
    /// device as fp8 (`crate::fp8`).
    /// How (`None`: not at all).
    fp8_weights: Option<denoised_runtime::fp8::Scaling>,
    /// Output rows of a GGUF-quantised weight one GEMM expands at a time
    /// (`crate::quant`); 0: as many as fit [`crate::quant::TILE_BYTES`].
    pub(crate) quant_tile_rows: usize,
}

/// A segment-id array, its device copy and that copy's address.
type DeviceSegments<E> = (Vec<u32>, Arc<<E as Exec>::Mem>, u64);

/// Distinct segment-id arrays kept on the device (a batch has about three).
const SEGMENT_CACHE: usize = 8;

pub(crate) fn dev(e: CudaError) -> Error {
    Error::Device(e.to_string())
}

/// Elements converted per host chunk when a stored dtype differs from the device's.
const UPLOAD_CHUNK: usize = 1 << 20;

/// Threads per block of the one-warp-per-row kernels (4 warps).
const ROW_BLOCK: u32 = 128;

impl<E: Exec> GpuBackend<E> {
    pub fn new(exec: E, dt: Dt) -> Self {
        GpuBackend {
            exec: Arc::new(exec),
            dt,
            segments: Mutex::new(Vec::new()),
            host: HostIo::new(),
            image_workspace: crate::image::WORKSPACE_BYTES,
            conv_library: true,
            attn_kernel: std::sync::atomic::AtomicU8::new(
                crate::attention::AttnKernel::from_env() as u8
            ),
            attn_launches: Default::default(),
            fp8_weights: None,
            quant_tile_rows: 0,
        }
    }
    /// This backend expanding quantised weights `rows` output rows at a time (tests
    /// use a few to run the many-tile path on small weights).
    pub fn with_quant_tile_rows(mut self, rows: usize) -> Self {
        self.quant_tile_rows = rows.max(1);
        self
    }
    /// This backend with the transformer's large Linears in fp8
    /// (`Backend::fp8_weights`); loading them fails on a device without fp8 GEMMs.
    /// `scaling` says how weights and their inputs are scaled (`None`: no fp8).
    pub fn with_fp8_weights(mut self, scaling: Option<denoised_runtime::fp8::Scaling>) -> Self {
        self.fp8_weights = scaling;
        self
    }
    /// This backend with image ops chunked to `bytes` of workspace (tests use a few
    /// KiB to run the many-chunk path on small images).
    pub fn with_image_workspace(mut self, bytes: usize) -> Self {
        self.image_workspace = bytes;
        self
    }
    /// How fp8 weights are scaled on this backend (channel where none are asked for).
    pub fn fp8_scaling(&self) -> denoised_runtime::fp8::Scaling {
        self.fp8_weights.unwrap_or_default()
    }
    pub fn exec(&self) -> &Arc<E> {
        &self.exec
    }
    pub fn dtype(&self) -> Dt {
        self.dt
    }
    /// The runtime dtype of this device's storage type.
    pub fn storage_dtype(&self) -> DType {
        match self.dt {
            Dt::F32 => DType::F32,
            Dt::Bf16 => DType::BF16,
        }
    }

    pub(crate) fn empty(&self, shape: Vec<usize>) -> Result<GpuTensor<E>> {
        GpuTensor::alloc(&*self.exec, shape, self.dt)
    }

    /// Uploads a small host array (indices, descriptors); freed when dropped, which
    /// on a GPU is stream-ordered after the kernels that read it.
    pub(crate) fn upload_u32(&self, v: &[u32]) -> Result<(E::Mem, u64)> {
        let mem = self.exec.alloc(v.len() * 4).map_err(dev)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.exec.upload(&mem, 0, &bytes).map_err(dev)?;
        let a = self.exec.addr(&mem);
        Ok((mem, a))
    }

    /// The device copy of a segment-id array, uploaded on first sight. Entries are
    /// never written after upload, so a kernel still reading an evicted one is safe
    /// (frees are stream-ordered).
    fn segments(&self, seg: &[u32]) -> Result<(Arc<E::Mem>, u64)> {
        let mut cache = self.segments.lock().unwrap();
        if let Some((_, mem, addr)) = cache.iter().find(|(v, _, _)| v.as_slice() == seg) {
            return Ok((mem.clone(), *addr));
        }
        let (mem, addr) = self.upload_u32(seg)?;
        let mem = Arc::new(mem);
        if cache.len() == SEGMENT_CACHE {
            cache.remove(0);
        }
        cache.push((seg.to_vec(), mem.clone(), addr));
        Ok((mem, addr))
    }

    /// A copy of `t` in the storage type of `dtype` (f32 or bf16).
    fn convert(&self, t: &GpuTensor<E>, dtype: DType) -> Result<GpuTensor<E>> {
        let (to, name) = match (t.dt, dtype) {
            (Dt::Bf16, DType::F32) => (Dt::F32, "convert_bf16_f32"),
            (Dt::F32, DType::BF16) => (Dt::Bf16, "convert_f32_bf16"),
            (from, to) => {
                return Err(Error::Invalid(format!(
                    "no device conversion from {from:?} to {to:?}"
                )))
            }
        };
        let out = GpuTensor::alloc(&*self.exec, t.shape.clone(), to)?;
        let p = EwParams {
            x: t.addr,
            y: out.addr,
            n: t.len() as i32,
            ..Default::default()
        };
        self.launch(name, Grid::linear(t.len().div_ceil(8), 256), &p)?;
        Ok(out)
    }

    pub(crate) fn kernel(&self, base: &'static str) -> &'static str {
        kernel_name(base, self.dt)
    }

    pub(crate) fn launch<P: KernelParams>(&self, name: &'static str, g: Grid, p: &P) -> Result<()> {
        self.exec.launch(name, g, p).map_err(dev)
    }
}

/// `base_f32` / `base_bf16` as a static name (kernel names are fixed strings).
pub(crate) fn kernel_name(base: &'static str, dt: Dt) -> &'static str {
    crate::kernels::MODULES
        .iter()
        .flat_map(|m| m.kernels.iter())
        .find(|k| k.strip_prefix(base).and_then(|s| s.strip_prefix('_')) == Some(dt.suffix()))
        .copied()
        .unwrap_or_else(|| panic!("no kernel {base}_{}", dt.suffix()))
}

pub(crate) fn matrix<E: Exec>(op: &'static str, t: &GpuTensor<E>) -> Result<(usize, usize)> {
    if t.shape.len() != 2 {
        return Err(Error::shape(
            op,
            format!("expected a matrix, got {:?}", t.shape),
        ));
    }
    Ok((t.shape[0], t.shape[1]))
}

impl<E: Exec> Backend for GpuBackend<E> {
    type Tensor = GpuTensor<E>;
    type Weight = GpuTensor<E>;

    fn name(&self) -> String {
        format!("{} ({:?})", self.exec.describe(), self.dt)
    }

    fn is_fatal(&self, e: &Error) -> bool {
        matches!(e, Error::Device(m) if self.exec.is_sticky(m))
    }

    fn upload(&self, t: &Tensor) -> Result<GpuTensor<E>> {
        let out = self.empty(t.shape().to_vec())?;
        self.exec
            .upload(&out.mem, 0, &to_bytes(self.dt, t.data()))
            .map_err(dev)?;
        Ok(out)
    }

    fn upload_fp8(
        &self,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scales: &[f32],
    ) -> Result<Option<GpuTensor<E>>> {
        self.upload_fp8_slab(rows, cols, bytes, scales).map(Some)
    }

    fn upload_weight(&self, w: &Tensor) -> Result<GpuTensor<E>> {
        // cuBLASLt reads the PyTorch [out, in] layout directly (as a transposed operand).
        self.upload(w)
    }

    fn upload_stored(&self, parts: &[Stored<'_>]) -> Result<GpuTensor<E>> {
        let out = self.empty(stacked_shape(parts)?)?;
        let target = self.storage_dtype();
        // Each part lands at its offset: bytes already in the device dtype go from
        // the (mapped) checkpoint straight to the device; others are converted a
        // bounded chunk at a time. Safetensors and both devices are little-endian.
        // Bytes in page-locked memory (a template in shared memory) are copied by the
        // copy engine from where they are, with no staging copy.
        let mut offset = 0;
        for p in parts {
            for chunk in p.chunks_as(target, UPLOAD_CHUNK)? {
                match &chunk {
                    Cow::Borrowed(b) if self.host.is_pinned(b.as_ptr(), b.len()) => {
                        // SAFETY: a pinned region is a template's, which its reader
                        // (an edit) keeps unchanged while it runs.
                        unsafe { self.host.load(&self.exec, &out.mem, offset, b) }?
                    }
                    _ => self.exec.upload(&out.mem, offset, &chunk).map_err(dev)?,
                }
                offset += chunk.len();
            }
        }
        Ok(out)
    }

    /// GGUF-quantised parts (all of one type) stay quantised on the device
    /// (`crate::quant`); others are copied or converted into the device dtype (fp8
    /// and mixed parts dequantised on the host, a chunk at a time).
    fn upload_weight_stored(&self, parts: &[Stored<'_>]) -> Result<GpuTensor<E>> {
        match self.upload_quant_weight(parts)? {
            Some(w) => Ok(w),
            None => self.upload_stored(parts),
        }
    }

    fn weight_bytes(&self, w: &GpuTensor<E>) -> u64 {
        self.resident_weight_bytes(w)
    }

    fn weight_form(&self, w: &GpuTensor<E>) -> &'static str {
        match (w.quant, w.row_scales, w.dt) {
            (Some(ty), _, _) => ty.name(),
            (None, 0, Dt::F32) => "f32",
            (None, 0, Dt::Bf16) => "bf16",
            (None, _, _) => "fp8",
        }
    }

    fn dense_dtype(&self) -> DType {
        match self.dt {
            Dt::F32 => DType::F32,
            Dt::Bf16 => DType::BF16,
        }
    }

    fn fp8_weights(&self) -> bool {
        self.fp8_weights.is_some()
    }

    fn upload_weight_fp8(&self, parts: &[Stored<'_>]) -> Result<GpuTensor<E>> {
        self.upload_fp8_weight(parts)
    }

    fn download(&self, t: &GpuTensor<E>) -> Result<Tensor> {
        let mut bytes = vec![0u8; t.len() * t.dt.size()];
        self.exec.download(&t.mem, 0, &mut bytes).map_err(dev)?;
        Tensor::new(t.shape.clone(), from_bytes(t.dt, &bytes))
    }

    fn shape<'a>(&self, t: &'a GpuTensor<E>) -> &'a [usize] {
        &t.shape
    }

    fn linear_cols(
        &self,
        x: &GpuTensor<E>,
        cols: Range<usize>,
        w: &GpuTensor<E>,
        b: Option<&GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        self.gemm(x, cols, w, None, b, false)
    }

    fn linear_out(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: Option<&GpuTensor<E>>,
        outs: Range<usize>,
    ) -> Result<GpuTensor<E>> {
        self.gemm(x, 0..x.cols(), w, Some(outs), b, false)
    }

    fn linear_gelu(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: Option<&GpuTensor<E>>,
        gelu_from: usize,
    ) -> Result<GpuTensor<E>> {
        self.gemm_gelu_from(x, w, b, gelu_from)
    }

    fn layer_norm_modulate(
        &self,
        x: &GpuTensor<E>,
        eps: f32,
        shift: Modulation<'_, GpuTensor<E>>,
        scale: Modulation<'_, GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        self.ln_modulate(x, None, eps, shift, scale)
    }

    fn residual_layer_norm_modulate(
        &self,
        x: &mut GpuTensor<E>,
        y: &GpuTensor<E>,
        gate: Modulation<'_, GpuTensor<E>>,
        eps: f32,
        shift: Modulation<'_, GpuTensor<E>>,
        scale: Modulation<'_, GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        self.ln_modulate(x, Some((y, gate)), eps, shift, scale)
    }

    fn rms_norm_rope(
        &self,
        x: &mut GpuTensor<E>,
        heads: &[HeadNorm<'_, GpuTensor<E>>],
        eps: f32,
        rope: Option<(&GpuTensor<E>, &GpuTensor<E>)>,
    ) -> Result<()> {
        self.rms_rope(x, heads, eps, rope)
    }

    fn attention(
        &self,
        bufs: &mut [&mut GpuTensor<E>],
        q_col: usize,
        width: usize,
        heads: usize,
        seqs: &[AttnSeq<'_, GpuTensor<E>>],
    ) -> Result<()> {
        let bufs: Vec<&GpuTensor<E>> = bufs.iter().map(|b| &**b).collect();
        crate::attention::run(self, &bufs, q_col, width, heads, seqs)
    }

    fn synchronize(&self) -> Result<()> {
        self.exec.synchronize().map_err(dev)
    }

    fn device_timer(&self) -> Result<Option<Box<dyn DeviceTimer>>> {
        self.start_timer()
    }

    fn add(&self, x: &mut GpuTensor<E>, y: &GpuTensor<E>) -> Result<()> {
        if x.shape != y.shape {
            return Err(Error::shape(
                "add",
                format!("{:?} + {:?}", x.shape, y.shape),
            ));
        }
        let p = EwParams {
            x: x.addr,
            y: y.addr,
            n: x.len() as i32,
            ..Default::default()
        };
        self.launch(
            self.kernel("add"),
            Grid::linear(x.len().div_ceil(8), 256),
            &p,
        )
    }

    fn gelu_tanh(&self, x: &mut GpuTensor<E>, cols: Range<usize>) -> Result<()> {
        let (rows, width) = matrix("gelu_tanh", x)?;
        if cols.end > width {
            return Err(Error::shape(
                "gelu_tanh",
                format!("columns {cols:?} of width {width}"),
            ));
        }
        let p = EwParams {
            x: x.addr,
            rows: rows as i32,
            cols: width as i32,
            c0: cols.start as i32,
            c1: cols.end as i32,
            ..Default::default()
        };
        self.launch(
            self.kernel("gelu_tanh"),
            Grid::linear((rows * cols.len()).div_ceil(8), 256),
            &p,
        )
    }

    fn silu(&self, x: &GpuTensor<E>) -> Result<GpuTensor<E>> {
        let out = self.empty(x.shape.clone())?;
        let p = EwParams {
            x: x.addr,
            y: out.addr,
            n: x.len() as i32,
            ..Default::default()
        };
        self.launch(
            self.kernel("silu"),
            Grid::linear(x.len().div_ceil(8), 256),
            &p,
        )?;
        Ok(out)
    }

    fn gated_residual(
        &self,
        x: &mut GpuTensor<E>,
        y: &GpuTensor<E>,
        gate: Modulation<'_, GpuTensor<E>>,
    ) -> Result<()> {
        self.gated_residual_rows(x, y, gate)
    }

    fn gather_rows(&self, srcs: &[&GpuTensor<E>], index: &[(u32, u32)]) -> Result<GpuTensor<E>> {
        let cols = srcs.first().map_or(0, |s| s.cols());
        if srcs.iter().any(|s| s.cols() != cols) {
            return Err(Error::shape(
                "gather_rows",
                format!("{} sources, not all of width {cols}", srcs.len()),
            ));
        }
        if let Some(&(s, r)) = index
            .iter()
            .find(|&&(s, r)| s as usize >= srcs.len() || r as usize >= srcs[s as usize].rows())
        {
            return Err(Error::shape(
                "gather_rows",
                format!("row ({s}, {r}) out of range"),
            ));
        }
        let out = self.empty(vec![index.len(), cols])?;
        if index.is_empty() {
            return Ok(out);
        }
        let flat: Vec<u32> = index.iter().flat_map(|&(s, r)| [s, r]).collect();
        let (_idx, idx) = self.upload_u32(&flat)?;
        let mut p = GatherParams {
            index: idx,
            out: out.addr,
            rows: index.len() as i32,
            cols: cols as i32,
            ..Default::default()
        };
        // Up to 8 sources travel in the parameters; more (a batch packing one tensor
        // per request) in a table of (address, row stride) pairs on the device.
        let _table;
        if srcs.len() <= p.srcs.len() {
            for (i, s) in srcs.iter().enumerate() {
                p.srcs[i] = s.addr;
                p.src_stride[i] = s.cols() as i32;
            }
        } else {
            let words: Vec<u32> = srcs
                .iter()
                .flat_map(|s| {
                    let (lo, hi) = (s.addr as u32, (s.addr >> 32) as u32);
                    [lo, hi, s.cols() as u32, 0]
                })
                .collect();
            let (mem, addr) = self.upload_u32(&words)?;
            _table = mem;
            p.src_table = addr;
        }
        self.launch(
            self.kernel("gather"),
            Grid::linear(index.len() * cols, 256),
            &p,
        )?;
        Ok(out)
    }

    fn axpy_cols(
        &self,
        x: &mut GpuTensor<E>,
        cols: Range<usize>,
        v: &GpuTensor<E>,
        v_rows: Range<usize>,
        alpha: f32,
    ) -> Result<()> {
        let (rows, width) = matrix("axpy_cols", x)?;
        let (vn, vw) = matrix("axpy_cols", v)?;
        // The first `n` rows of `x` move (see the trait): the kernel sees only them.
        let n = v_rows.len();
        if cols.end > width || vw != cols.len() || n > rows || v_rows.end > vn {
            return Err(Error::shape(
                "axpy_cols",
                format!(
                    "columns {cols:?} of {:?} += rows {v_rows:?} of {:?}",
                    x.shape, v.shape
                ),
            ));
        }
        if n == 0 || cols.is_empty() {
            return Ok(());
        }
        let p = EwParams {
            x: x.addr,
            y: v.addr + (v_rows.start * vw * self.dt.size()) as u64,
            rows: n as i32,
            cols: width as i32,
            c0: cols.start as i32,
            c1: cols.end as i32,
            alpha,
            ..Default::default()
        };
        self.launch(
            self.kernel("axpy_cols"),
            Grid::linear(n * cols.len(), 256),
            &p,
        )
    }

    fn add_block(
        &self,
        y: &mut GpuTensor<E>,
        rows: Range<usize>,
        cols: Range<usize>,
        d: &GpuTensor<E>,
        alpha: f32,
    ) -> Result<()> {
        let (n, width) = matrix("add_block", y)?;
        let (dn, dw) = matrix("add_block", d)?;
        if rows.end > n || cols.end > width || dn != rows.len() || dw != cols.len() {
            return Err(Error::shape(
                "add_block",
                format!(
                    "rows {rows:?}, columns {cols:?} of {:?} += {:?}",
                    y.shape, d.shape
                ),
            ));
        }
        if rows.is_empty() || cols.is_empty() {
            return Ok(());
        }
        // The axpy_cols kernel over the row window: its matrix starts at row
        // `rows.start` of `y`.
        let p = EwParams {
            x: y.addr + (rows.start * width * self.dt.size()) as u64,
            y: d.addr,
            rows: rows.len() as i32,
            cols: width as i32,
            c0: cols.start as i32,
            c1: cols.end as i32,
            alpha,
            ..Default::default()
        };
        self.launch(
            self.kernel("axpy_cols"),
            Grid::linear(rows.len() * cols.len(), 256),
            &p,
        )
    }

    fn download_weight(&self, w: &GpuTensor<E>) -> Result<Tensor> {
        if w.quant.is_some() {
            return self.download_quant_weight(w);
        }
        // Weights stay in PyTorch's [out, in] layout on the device (see upload_weight).
        match w.row_scales {
            0 => self.download(w),
            _ => self.download_fp8_weight(w),
        }
    }

    fn memory_in_use(&self) -> Option<u64> {
        self.exec
            .memory()
            .ok()
            .map(|m| m.total.saturating_sub(m.free))
    }

    fn pin_host(&self, mem: &Arc<dyn HostMemory>) -> Result<()> {
        self.host.pin(&self.exec, mem)
    }

    fn store(&self, t: &GpuTensor<E>, dst: &HostSlice, dtype: DType) -> Result<()> {
        // Converted on the device first when the host wants another dtype, so the copy
        // engine moves the final bytes.
        let converted;
        let src = if dtype == self.storage_dtype() {
            t
        } else {
            converted = self.convert(t, dtype)?;
            &converted
        };
        let bytes = src.len() * src.dt.size();
        if !dst.writable() || dst.len() != bytes {
            return Err(Error::Invalid(format!(
                "storing {bytes} bytes into a {} host slice of {} bytes",
                if dst.writable() {
                    "writable"
                } else {
                    "read-only"
                },
                dst.len()
            )));
        }
        self.host.store(&self.exec, src.mem.clone(), 0, dst)
    }

    fn flush_stores(&self) -> Result<()> {
        self.host.flush(&self.exec)
    }

    fn store_fp8(&self, t: &GpuTensor<E>, dst: &HostSlice, groups: usize) -> Result<()> {
        self.store_fp8_slab(t, dst, groups)
    }

    fn stream_slabs(
        &self,
        src: &HostSlice,
        slab: &denoised_runtime::SlabShape,
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Option<Box<dyn SlabProvider<GpuTensor<E>>>>> {
        if slab.dtype != self.storage_dtype() && slab.dtype != DType::F8E4M3 {
            // Streamed slabs are copied as they are: a template of another dtype (one
            // captured on another kind of device) is made resident instead. fp8 slabs
            // are read as they are by the attention kernel.
            return Ok(None);
        }
        let t =
            crate::stream::StreamedTemplate::new(self, src.clone(), slab, steps, blocks, lanes)?;
        Ok(Some(Box::new(t)))
    }

    fn gather_cols(
        &self,
        x: &GpuTensor<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<GpuTensor<E>> {
        let (r, c) = matrix("gather_cols", x)?;
        if rows.end > r || cols.end > c {
            return Err(Error::shape(
                "gather_cols",
                format!("{rows:?} x {cols:?} of {r} x {c}"),
            ));
        }
        let out = self.empty(vec![rows.len(), cols.len()])?;
        let mut p = GatherParams {
            out: out.addr,
            rows: rows.len() as i32,
            cols: cols.len() as i32,
            r0: rows.start as i32,
            c0: cols.start as i32,
            ..Default::default()
        };
        p.srcs[0] = x.addr;
        p.src_stride[0] = c as i32;
        self.launch(
            self.kernel("gather"),
            Grid::linear(rows.len() * cols.len(), 256),
            &p,
        )?;
        Ok(out)
    }

    fn upload_image(&self, t: &Tensor) -> Result<GpuTensor<E>> {
        self.upload_image_rows(t)
    }

    fn download_image(&self, t: &GpuTensor<E>) -> Result<Tensor> {
        self.download_image_rows(t)
    }

    fn upload_conv(&self, w: &Tensor) -> Result<GpuTensor<E>> {
        self.upload_conv_rows(w)
    }

    fn conv2d(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: &GpuTensor<E>,
        opts: Conv2dOpts,
        add: Option<&GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        self.conv2d_rows(x, w, b, opts, add)
    }

    fn group_norm(
        &self,
        x: &GpuTensor<E>,
        groups: usize,
        weight: &GpuTensor<E>,
        bias: &GpuTensor<E>,
        eps: f32,
        silu: bool,
    ) -> Result<GpuTensor<E>> {
        self.group_norm_rows(x, groups, weight, bias, eps, silu)
    }

    fn image_attention(
        &self,
        x: &GpuTensor<E>,
        normed: &GpuTensor<E>,
        qkv: &GpuTensor<E>,
        qkv_b: &GpuTensor<E>,
        out: &GpuTensor<E>,
        out_b: &GpuTensor<E>,
    ) -> Result<GpuTensor<E>> {
        self.image_attention_rows(x, normed, qkv, qkv_b, out, out_b)
    }

    fn sparse_conv2d(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: &GpuTensor<E>,
        opts: Conv2dOpts,
        pre: Option<PreAct<'_>>,
        add: Option<&GpuTensor<E>>,
        base: &GpuTensor<E>,
        pixels: &[u32],
    ) -> Result<GpuTensor<E>> {
        self.sige_conv2d(x, w, b, opts, pre, add, base, pixels)
    }

    fn put_pixels(
        &self,
        base: &GpuTensor<E>,
        src: &GpuTensor<E>,
        px: &[u32],
    ) -> Result<GpuTensor<E>> {
        self.sige_put_pixels(base, src, px)
    }

    fn channel_affine(&self, x: &GpuTensor<E>, pre: PreAct<'_>) -> Result<GpuTensor<E>> {
        self.sige_channel_affine(x, pre)
    }

    fn group_sum_deltas(
        &self,
        new: &GpuTensor<E>,
        old: &GpuTensor<E>,
        px: &[u32],
        groups: usize,
    ) -> Result<Vec<(f64, f64)>> {
        self.sige_group_sum_deltas(new, old, px, groups)
    }

    fn layer_norm_affine(
        &self,
        x: &GpuTensor<E>,
        weight: &GpuTensor<E>,
        bias: &GpuTensor<E>,
        eps: f64,
    ) -> Result<GpuTensor<E>> {
        self.row_norm(x, weight, Some(bias), eps)
    }

    fn rms_norm(&self, x: &GpuTensor<E>, weight: &GpuTensor<E>, eps: f64) -> Result<GpuTensor<E>> {
        self.row_norm(x, weight, None, eps)
    }

    fn gated_gelu(&self, x: &GpuTensor<E>) -> Result<GpuTensor<E>> {
        self.gated_gelu_rows(x)
    }

    fn quick_gelu(&self, x: &mut GpuTensor<E>) -> Result<()> {
        self.quick_gelu_n(x)
    }

    fn text_attention(
        &self,
        qkv: &GpuTensor<E>,
        heads: usize,
        head_dim: usize,
        scale: f32,
        mask: TextMask<'_, GpuTensor<E>>,
    ) -> Result<GpuTensor<E>> {
        self.text_attention_heads(qkv, heads, head_dim, scale, mask)
    }
}
