//! [`CudaExec`]: the executor on a real GPU, through cudarc.
//!
//! - **Kernels**: NVRTC modules compiled at first use for this device's architecture
//!   ([`crate::compile`]), loaded once per context; functions cached by name.
//! - **Memory**: stream-ordered allocations (`cuMemAllocAsync`) from the device's
//!   default pool, whose release threshold is raised to "never", so steady-state
//!   allocations are pool hits, not driver calls. Frees are stream-ordered too, so a
//!   temporary may be dropped as soon as its kernels are queued.
//! - **Uploads**: host data is copied into a pinned ring ([`crate::ring`]) and queued
//!   as asynchronous copies with an event each; the host waits only to reuse bytes a
//!   queued copy still reads, never for the compute stream as a whole. (The driver
//!   would copy pageable memory through its own small bounce buffer, at a fraction of
//!   PCIe speed, and may synchronise the stream to do it.)
//! - **GEMMs**: cuBLASLt with f32 compute (bf16 or f32 storage) and a bias epilogue;
//!   descriptors and the heuristic's algorithm are cached per shape. fp8 weights
//!   (sm_89 and newer) run E4M3 x E4M3 with a f32 scale per row of each operand
//!   (`OUTER_VEC_32F`), writing bf16.
//! - **Streams**: `compute` runs kernels and GEMMs in order; `copy` is for cache loads
//!   (the planner's prefetch), synchronised with events.
//!
//! Pointers travel in kernel parameter structs as raw addresses, so cudarc's per-slice
//! event tracking (which only sees slices passed as arguments) is switched off; one
//! compute stream orders everything, and cross-stream waits are explicit events.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::{
    result as dr, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::compile;
use crate::cublaslt::Blas;
use crate::cudnn::{self, Cudnn};
use crate::device::{probe, GpuInfo};
use crate::exec::{Conv, Dt, Exec, Gemm, Grid, MemInfo, Result, Sdpa, Stream};
use crate::kernels;
use crate::params::KernelParams;
use crate::ring::Ring;
use crate::CudaError;

fn drv(what: &str) -> impl Fn(dr::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e:?}"))
}
/// Bytes of the pinned upload ring (copies of up to a quarter of it each).
const RING_BYTES: usize = 64 << 20;
/// Dynamic shared memory a launch may use without raising the kernel's limit.
const DEFAULT_SMEM: u32 = 48 << 10;

pub struct CudaExec {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    info: GpuInfo,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Kernels whose dynamic shared memory limit was raised, and to what.
    smem_allowed: Mutex<HashMap<&'static str, u32>>,
    uploads: Mutex<Uploads>,
    blas: Mutex<Blas>,
    /// cuDNN, opened at the first convolution or attention; `None` where it is absent
    /// or failed to open (the backend's im2col path and our attention kernel run then).
    cudnn: OnceLock<Option<Mutex<Cudnn>>>,
}

/// The pinned upload ring, its placement, and events free for reuse.
struct Uploads {
    pinned: PinnedHostSlice<u8>,
    ring: Ring<CudaEvent>,
    spare: Vec<CudaEvent>,
}

impl Drop for Uploads {
    fn drop(&mut self) {
        // The pinned bytes are freed next: no copy may still read them.
        if let Some(last) = self.ring.drained().last() {
            let _ = last.synchronize();
        }
    }
}

/// The priority of an executor's compute stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// The denoise loop.
    High,
    /// Pre- and postprocessing (text encoders, VAE) beside it.
    Low,
}

impl CudaExec {
    /// Opens device `ordinal`: context, streams, pool, upload ring, cuBLASLt. Its compute
    /// stream has the device's highest priority: the denoise loop's.
    pub fn new(ordinal: usize) -> Result<CudaExec> {
        Self::open(ordinal, Priority::High)
    }

    /// [`new`](Self::new) with the compute stream at `priority`: the pre- and
    /// postprocess workers open their device at [`Priority::Low`], so that where
    /// their work and the denoise loop's meet in one scheduler (one process, or
    /// processes sharing an MPS server) the denoise loop's kernels go first.
    pub fn open(ordinal: usize, priority: Priority) -> Result<CudaExec> {
        let info = probe()?
            .into_iter()
            .find(|g| g.ordinal == ordinal)
            .ok_or_else(|| CudaError::NoDevice(format!("cuda:{ordinal} not present")))?;
        if info.compute_capability.0 < 8 {
            return Err(CudaError::NoDevice(format!(
                "{} is sm_{}{}; the bf16 tensor-core kernels need sm_80 or newer",
                info.name, info.compute_capability.0, info.compute_capability.1
            )));
        }
        if !compile::nvrtc_available() {
            return Err(CudaError::NoDevice(
                "libnvrtc is not installed (the kernels are compiled at run time)".into(),
            ));
        }
        // SAFETY: only tries to dlopen the library by its usual names.
        if !unsafe { ltsys::is_culib_present() } {
            return Err(CudaError::NoDevice(
                "libcublasLt is not installed (the CUDA toolkit, or `pip install nvidia-cublas`)"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuCtxCreate"))?;
        // SAFETY: called before any allocation; we order work ourselves (module docs).
        unsafe { ctx.disable_event_tracking() };
        // Lower numbers are higher priorities: (least, greatest) = (0, -5) on recent GPUs.
        // The range is the current context's.
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(drv("cuCtxGetStreamPriorityRange"))?;
        let level = match priority {
            Priority::High => greatest,
            Priority::Low => least,
        };
        let compute = ctx
            .new_stream_with_priority(level)
            .map_err(drv("cuStreamCreateWithPriority"))?;
        let copy = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        // Keep freed pool memory for reuse instead of returning it at every sync.
        // SAFETY: plain driver calls on this context's device.
        unsafe {
            let mut pool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                == sys::CUresult::CUDA_SUCCESS
            {
                let mut threshold = u64::MAX;
                let _ = sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut c_void,
                );
            }
        }
        // SAFETY: plain host allocation; bytes are written before being read.
        let pinned =
            unsafe { ctx.alloc_pinned::<u8>(RING_BYTES) }.map_err(drv("cuMemHostAlloc"))?;
        let blas = Blas::new(&compute)?;
        let arch = compile::arch_for(info.compute_capability);
        Ok(CudaExec {
            ctx,
            compute,
            copy,
            info,
            arch,
            modules: Mutex::default(),
            functions: Mutex::default(),
            smem_allowed: Mutex::default(),
            uploads: Mutex::new(Uploads {
                pinned,
                ring: Ring::new(RING_BYTES),
                spare: Vec::new(),
            }),
            blas: Mutex::new(blas),
            cudnn: OnceLock::new(),
        })
    }

    fn cudnn(&self) -> Option<&Mutex<Cudnn>> {
        self.cudnn
            .get_or_init(|| {
                if !cudnn::wanted_and_present() {
                    return None;
                }
                let opened = self
                    .ctx
                    .bind_to_thread()
                    .map_err(drv("cuCtxSetCurrent"))
                    .and_then(|_| {
                        // A library missing a symbol panics in cudarc: no cuDNN, then.
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            Cudnn::new(&self.compute)
                        }))
                        .unwrap_or_else(|_| {
                            Err(CudaError::Driver("libcudnn lacks a function".into()))
                        })
                    });
                match opened {
                    Ok(d) => {
                        tracing::info!("convolutions and attention run on {}", d.describe());
                        Some(Mutex::new(d))
                    }
                    Err(e) => {
                        tracing::warn!("cuDNN is installed but did not open ({e}); convolutions run on im2col + cuBLASLt");
                        None
                    }
                }
            })
            .as_ref()
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }
    /// The stream for cache loads; order against compute with events.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Compiles (or fetches) every module now, so the first request does not pay it.
    pub fn warm_up(&self) -> Result<()> {
        for m in kernels::MODULES {
            for k in m.kernels {
                self.function(k)?;
            }
        }
        Ok(())
    }

    /// Raises a kernel's dynamic shared memory limit above the 48 KB every launch may
    /// take without asking (once per kernel and size).
    fn allow_smem(&self, name: &'static str, f: &CudaFunction, bytes: u32) -> Result<()> {
        let mut set = self.smem_allowed.lock().unwrap();
        if set.get(name).is_some_and(|&b| b >= bytes) {
            return Ok(());
        }
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(drv("cuFuncSetAttribute"))?;
        set.insert(name, bytes);
        Ok(())
    }

    fn function(&self, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap().get(name) {
            return Ok(f.clone());
        }
        let module = kernels::module_of(name)
            .ok_or_else(|| CudaError::Driver(format!("no kernel named {name}")))?;
        let loaded = {
            let mut mods = self.modules.lock().unwrap();
            match mods.get(module.name) {
                Some(m) => m.clone(),
                None => {
                    let bin = compile::cubin(module, &self.arch)?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(bin.to_vec()))
                        .map_err(drv("cuModuleLoadData"))?;
                    mods.insert(module.name, m.clone());
                    m
                }
            }
        };
        let f = loaded.load_function(name).map_err(drv(name))?;
        self.functions.lock().unwrap().insert(name, f.clone());
        Ok(f)
    }
}

/// Host memory page-locked by [`Exec::register`], unregistered when dropped.
pub struct CudaPinned {
    base: *mut u8,
    ctx: Arc<CudaContext>,
}

// SAFETY: only the address is kept, to unregister it; the memory's owner keeps it.
unsafe impl Send for CudaPinned {}
unsafe impl Sync for CudaPinned {}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        // SAFETY: registered in `register` and unregistered once, here.
        unsafe {
            if self.ctx.bind_to_thread().is_ok() {
                let _ = sys::cuMemHostUnregister(self.base as *mut c_void);
            }
        }
    }
}

impl CudaExec {
    fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        match s {
            Stream::Compute => &self.compute,
            Stream::Copy => &self.copy,
        }
    }
}

impl Exec for CudaExec {
    type Mem = CudaSlice<u8>;
    type Pinned = CudaPinned;
    type Event = CudaEvent;

    fn describe(&self) -> String {
        format!(
            "cuda:{} {} ({})",
            self.info.ordinal, self.info.name, self.arch
        )
    }
    fn is_sticky(&self, message: &str) -> bool {
        crate::device::is_sticky(message)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: uninitialised device memory; every op writes its outputs in full
        // (the emulator fills fresh memory with NaN to catch ops that do not).
        unsafe { self.compute.alloc::<u8>(bytes.max(1)) }.map_err(drv("cuMemAllocAsync"))
    }

    fn addr(&self, m: &CudaSlice<u8>) -> u64 {
        m.device_ptr(&self.compute).0
    }

    fn upload(&self, dst: &CudaSlice<u8>, offset: usize, bytes: &[u8]) -> Result<()> {
        // Raw driver calls need the context current on this thread (cudarc's own
        // calls bind it themselves).
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let base = self.addr(dst) + offset as u64;
        let mut up = self.uploads.lock().unwrap();
        let Uploads {
            pinned,
            ring,
            spare,
        } = &mut *up;
        let mut at_dst = base;
        for chunk in bytes.chunks(ring.chunk()) {
            let (at, retired) = ring.reserve(chunk.len());
            // The newest copy that read these bytes; the older ones finished before it.
            if let Some(last) = retired.last() {
                last.synchronize().map_err(drv("cuEventSynchronize"))?;
            }
            spare.extend(retired);
            let st = &mut pinned.as_mut_slice().map_err(drv("pinned"))?[at..at + chunk.len()];
            st.copy_from_slice(chunk);
            // SAFETY: in bounds (callers size allocations); the pinned bytes stay
            // unchanged until the event recorded below has passed (the ring's contract).
            unsafe { dr::memcpy_htod_async(at_dst, st, self.compute.cu_stream()) }
                .map_err(drv("cuMemcpyHtoDAsync"))?;
            let event = match spare.pop() {
                Some(e) => e,
                None => self
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(drv("cuEventCreate"))?,
            };
            event.record(&self.compute).map_err(drv("cuEventRecord"))?;
            ring.queued(at..at + chunk.len(), event);
            at_dst += chunk.len() as u64;
        }
        Ok(())
    }

    fn download(&self, src: &CudaSlice<u8>, offset: usize, out: &mut [u8]) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let base = self.addr(src) + offset as u64;
        // SAFETY: in bounds; the stream sync below completes the copy before return.
        unsafe { dr::memcpy_dtoh_async(out, base, self.compute.cu_stream()) }
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        self.compute
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    fn launch<P: KernelParams>(&self, name: &'static str, g: Grid, params: &P) -> Result<()> {
        let f = self.function(name)?;
        if g.smem > DEFAULT_SMEM {
            self.allow_smem(name, &f, g.smem)?;
        }
        let cfg = LaunchConfig {
            grid_dim: (g.grid[0], g.grid[1], g.grid[2]),
            block_dim: (g.block[0], g.block[1], g.block[2]),
            shared_mem_bytes: g.smem,
        };
        let mut b = self.compute.launch_builder(&f);
        b.arg(params);
        // SAFETY: the params struct matches the kernel's C signature (size-checked in
        // tests) and every address in it was validated by the backend.
        unsafe { b.launch(cfg) }.map_err(drv(name))?;
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        self.blas.lock().unwrap().run(g, &self.compute)
    }

    fn check_fp8(&self, out: Dt) -> Result<()> {
        if out != Dt::Bf16 {
            return Err(CudaError::Driver(
                "fp8 weights write bf16 activations: use them with dtype bf16".into(),
            ));
        }
        let (major, minor) = self.info.compute_capability;
        if (major, minor) < (8, 9) {
            return Err(CudaError::NoDevice(format!(
                "fp8 weights need fp8 tensor cores (sm_89 or newer); cuda:{} {} is sm_{major}{minor}",
                self.info.ordinal, self.info.name
            )));
        }
        Ok(())
    }

    fn conv_library(&self) -> Option<String> {
        self.cudnn().map(|d| d.lock().unwrap().describe())
    }

    fn conv(&self, c: &Conv) -> Result<bool> {
        let Some(d) = self.cudnn() else {
            return Ok(false);
        };
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        d.lock().unwrap().run(&self.compute, c)
    }

    fn attn_library(&self) -> Option<String> {
        self.cudnn()
            .map(|d| format!("{} fused attention (SDPA)", d.lock().unwrap().describe()))
    }

    fn sdpa_plan(&self, a: &Sdpa) -> Result<bool> {
        let Some(d) = self.cudnn() else {
            return Ok(false);
        };
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        Ok(d.lock().unwrap().sdpa_plan(a))
    }

    fn sdpa(&self, a: &Sdpa) -> Result<()> {
        let d = self
            .cudnn()
            .ok_or_else(|| CudaError::Unsupported("cuDNN is not loaded".into()))?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        d.lock().unwrap().sdpa_run(&self.compute, a)
    }

    fn synchronize(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))?;
        // Every queued upload has been made: its events are free again.
        let mut up = self.uploads.lock().unwrap();
        let done = up.ring.drained();
        up.spare.extend(done);
        Ok(())
    }

    unsafe fn register(&self, base: *mut u8, len: usize, read_only: bool) -> Result<CudaPinned> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // A peer's arena is mapped read-only, which the driver must be told (it would
        // otherwise ask for write access to pin the pages).
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE
            | if read_only {
                sys::CU_MEMHOSTREGISTER_READ_ONLY
            } else {
                0
            };
        sys::cuMemHostRegister_v2(base as *mut c_void, len, flags)
            .result()
            .map_err(drv("cuMemHostRegister"))?;
        Ok(CudaPinned {
            base,
            ctx: self.ctx.clone(),
        })
    }

    unsafe fn load(
        &self,
        dst: &CudaSlice<u8>,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        assert!(offset + len <= dst.len());
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        sys::cuMemcpyHtoDAsync_v2(
            self.addr(dst) + offset as u64,
            src as *const c_void,
            len,
            self.copy.cu_stream(),
        )
        .result()
        .map_err(drv("cuMemcpyHtoDAsync (copy stream)"))
    }

    unsafe fn store(
        &self,
        dst: *mut u8,
        src: &CudaSlice<u8>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        assert!(offset + len <= src.len());
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        sys::cuMemcpyDtoHAsync_v2(
            dst as *mut c_void,
            self.addr(src) + offset as u64,
            len,
            self.copy.cu_stream(),
        )
        .result()
        .map_err(drv("cuMemcpyDtoHAsync (copy stream)"))
    }

    fn is_done(&self, e: &CudaEvent) -> Result<bool> {
        e.try_is_complete().map_err(drv("cuEventQuery"))
    }

    fn sync_event(&self, e: &CudaEvent) -> Result<()> {
        e.synchronize().map_err(drv("cuEventSynchronize"))
    }

    fn timing_event(&self) -> Result<Option<CudaEvent>> {
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventCreate"))?;
        e.record(&self.compute).map_err(drv("cuEventRecord"))?;
        Ok(Some(e))
    }

    fn elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f64> {
        Ok(start.elapsed_ms(end).map_err(drv("cuEventElapsedTime"))? as f64)
    }

    fn record(&self, on: Stream) -> Result<CudaEvent> {
        let s = self.stream(on);
        let e = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv("cuEventCreate"))?;
        e.record(s).map_err(drv("cuEventRecord"))?;
        Ok(e)
    }

    fn wait(&self, on: Stream, e: &CudaEvent) -> Result<()> {
        self.stream(on).wait(e).map_err(drv("cuStreamWaitEvent"))
    }
    fn memory(&self) -> Result<MemInfo> {
        let (free, total) = self.ctx.mem_get_info().map_err(drv("cuMemGetInfo"))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }
}
