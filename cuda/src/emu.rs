//! [`EmuExec`]: the executor that runs the kernel sources on the CPU (see emu/emu.h).
//!
//! "Device memory" is 64-byte-aligned host memory, addresses are host pointers, and a
//! launch runs the named kernel through the emulator. GEMMs are a plain f32 host loop
//! (with bf16 rounding of the result, as cuBLASLt writes bf16). Each GPU thread is
//! a fiber, so it is far slower than a GPU and meant for tests on small shapes.

use std::alloc::{alloc, dealloc, Layout};
#[cfg(denoised_emu)]
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::exec::{Conv, Dt, Exec, Gemm, Grid, MemInfo, Result, Sdpa};
use crate::params::KernelParams;
use crate::CudaError;

#[cfg(denoised_emu)]
extern "C" {
    fn denoised_emu_launch(
        name: *const std::ffi::c_char,
        grid: *const u32,
        block: *const u32,
        smem: std::ffi::c_ulong,
        params: *const c_void,
    ) -> i32;
    fn denoised_emu_param_sizes(out: *mut std::ffi::c_ulong);
    fn denoised_emu_count_shared(on: i32);
    fn denoised_emu_shared_stats(
        i: std::ffi::c_ulong,
        name: *mut std::ffi::c_char,
        cap: std::ffi::c_ulong,
        out: *mut u64,
    ) -> i32;
}

/// What the emulator counted for one kernel since [`count_shared`] turned counting on:
/// launches, and its shared-memory access instructions (per warp) with the
/// wavefronts the hardware would serve them in (emu.h, "bank conflicts").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelCounters {
    pub kernel: String,
    pub launches: u64,
    pub shared_accesses: u64,
    pub wavefronts: u64,
    /// Wavefronts beyond one per access phase.
    pub bank_conflicts: u64,
}

/// Turns the emulator's per-kernel counting on (clearing earlier counts) or off. It
/// slows kernels down (every shared access is logged), so it is off by default.
pub fn count_shared(on: bool) {
    COUNTING.store(on, Ordering::Relaxed);
    GEMMS.store(0, Ordering::Relaxed);
    // SAFETY: plain flag and map behind the emulator's launch lock.
    #[cfg(denoised_emu)]
    unsafe {
        denoised_emu_count_shared(on as i32)
    }
}

/// GEMMs (a cuBLASLt launch on a GPU) run while counting was on.
static GEMMS: AtomicU64 = AtomicU64::new(0);
static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The counters of every kernel launched while counting was on, by name.
pub fn shared_counters() -> Vec<KernelCounters> {
    let mut all = vec![];
    #[cfg(denoised_emu)]
    for i in 0.. {
        let mut name = [0 as std::ffi::c_char; 128];
        let mut out = [0u64; 4];
        // SAFETY: name has 128 bytes, out 4 values, as the C side writes at most.
        let rc = unsafe {
            denoised_emu_shared_stats(i, name.as_mut_ptr(), name.len() as _, out.as_mut_ptr())
        };
        if rc != 0 {
            break;
        }
        // SAFETY: the C side wrote a NUL-terminated string.
        let kernel = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        all.push(KernelCounters {
            kernel,
            launches: out[0],
            shared_accesses: out[1],
            wavefronts: out[2],
            bank_conflicts: out[3],
        });
    }
    let gemms = GEMMS.load(Ordering::Relaxed);
    if gemms > 0 {
        all.push(KernelCounters {
            kernel: "gemm".into(),
            launches: gemms,
            shared_accesses: 0,
            wavefronts: 0,
            bank_conflicts: 0,
        });
    }
    all
}

/// Whether this build has the emulator (x86-64 hosts; see build.rs).
pub const AVAILABLE: bool = cfg!(denoised_emu);

/// `sizeof` of the C++ parameter structs, in `params.rs` order.
#[cfg(denoised_emu)]
pub fn param_sizes() -> [usize; 10] {
    let mut out = [0 as std::ffi::c_ulong; 10];
    // SAFETY: writes exactly 10 values.
    unsafe { denoised_emu_param_sizes(out.as_mut_ptr()) };
    out.map(|v| v as usize)
}

/// The emulated device. Its memory is accounted like a GPU's: allocations beyond its
/// capacity fail with an out-of-memory error, and [`EmuExec::peak_bytes`] tells what a
/// computation needed at most, which is how the device memory budget's estimates are
/// checked in CI.
#[derive(Clone)]
pub struct EmuExec {
    usage: Arc<Usage>,
    /// Whether [`Exec::conv`] runs (a host convolution standing in for cuDNN); off by
    /// default, so the backend's im2col path is what the emulator exercises.
    conv_library: bool,
    /// The stand-in for cuDNN's fused attention behind [`Exec::sdpa`], if on: the most
    /// keys a plan takes (it refuses longer sequences, as a library refuses a shape).
    attn_library: Option<usize>,
    /// Whether GEMMs are refused where cuBLASLt refused them on the first H100 run.
    cublaslt_limits: bool,
}

struct Usage {
    capacity: u64,
    in_use: AtomicU64,
    peak: AtomicU64,
    /// Host bytes registered for asynchronous copies, as a GPU would page-lock them.
    pinned: AtomicU64,
    /// Convolutions run by the stand-in library ([`EmuExec::with_conv_library`]).
    library_convs: AtomicU64,
    /// Attention calls run by the stand-in library ([`EmuExec::with_attn_library`]).
    library_attention: AtomicU64,
}

impl Default for EmuExec {
    /// An emulated device of `DENOISED_EMU_MEMORY` bytes, or of the host's memory;
    /// `DENOISED_EMU_ATTN_LIBRARY=N` gives it the stand-in attention library taking up
    /// to N keys ([`EmuExec::with_attn_library`]: how the one-shot script's rehearsal
    /// runs its cuDNN columns).
    fn default() -> Self {
        let env = |name| std::env::var(name).ok().and_then(|v| v.trim().parse().ok());
        let capacity = env("DENOISED_EMU_MEMORY").unwrap_or_else(host_memory);
        let mut e = EmuExec::with_capacity(capacity);
        e.attn_library = env("DENOISED_EMU_ATTN_LIBRARY").map(|n: u64| n as usize);
        e
    }
}

/// The host's physical memory (the emulated device's default capacity).
fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(u64::MAX, |kb| kb * 1024)
}

impl EmuExec {
    /// The emulator, where it is built (x86-64 hosts: its fibers switch in assembly).
    pub fn open() -> Result<Self> {
        if cfg!(denoised_emu) {
            Ok(EmuExec::default())
        } else {
            Err(CudaError::NoDevice(
                "the CUDA emulator is built on x86-64 hosts only".into(),
            ))
        }
    }

    /// An emulated device with `bytes` of memory.
    pub fn with_capacity(bytes: u64) -> Self {
        EmuExec {
            usage: Arc::new(Usage {
                capacity: bytes,
                in_use: AtomicU64::new(0),
                peak: AtomicU64::new(0),
                pinned: AtomicU64::new(0),
                library_convs: AtomicU64::new(0),
                library_attention: AtomicU64::new(0),
            }),
            conv_library: false,
            attn_library: None,
            cublaslt_limits: false,
        }
    }

    /// This emulator refusing, with [`CudaError::Unsupported`], the GEMMs cuBLASLt 13.0
    /// refused on an H100 (docs/performance.md, "The first GPU run"): fp8 with
    /// outer-vector scales (per-tensor ones it takes), a bias not 16-byte aligned, an output or row stride not a
    /// multiple of 16 bytes. How tests run the backend's bare-GEMM path without one.
    pub fn with_cublaslt_limits(mut self) -> Self {
        self.cublaslt_limits = true;
        self
    }

    /// This emulator with a host convolution standing in for cuDNN behind
    /// [`Exec::conv`]: what tests use to run the backend's library path (the shapes it
    /// sends, the bias and residual epilogue, the fallback for the rest) without a GPU.
    pub fn with_conv_library(mut self) -> Self {
        self.conv_library = true;
        self
    }

    /// This emulator with a host attention standing in for cuDNN's fused SDPA behind
    /// [`Exec::sdpa`], taking sequences of at most `max_keys` keys and refusing longer
    /// ones: how tests run the backend's library path (the views it hands over in
    /// place, the pack and unpack kernels, the padded queries) and its fallback to our
    /// kernel without a GPU.
    pub fn with_attn_library(mut self, max_keys: usize) -> Self {
        self.attn_library = Some(max_keys);
        self
    }

    /// Bytes allocated now.
    pub fn in_use_bytes(&self) -> u64 {
        self.usage.in_use.load(Ordering::Relaxed)
    }

    /// The most bytes allocated at once since the last [`reset_peak`](Self::reset_peak).
    pub fn peak_bytes(&self) -> u64 {
        self.usage.peak.load(Ordering::Relaxed)
    }

    /// Host bytes registered now (`Exec::register`): what a GPU would have page-locked.
    pub fn pinned_bytes(&self) -> u64 {
        self.usage.pinned.load(Ordering::Relaxed)
    }

    /// How many convolutions the stand-in library has run.
    pub fn library_convs(&self) -> u64 {
        self.usage.library_convs.load(Ordering::Relaxed)
    }

    /// How many attention calls the stand-in library has run.
    pub fn library_attention(&self) -> u64 {
        self.usage.library_attention.load(Ordering::Relaxed)
    }

    /// Starts a new peak from what is allocated now.
    pub fn reset_peak(&self) {
        self.usage
            .peak
            .store(self.in_use_bytes(), Ordering::Relaxed);
    }
}

pub struct EmuMem {
    ptr: *mut u8,
    layout: Layout,
    usage: Arc<Usage>,
}
// SAFETY: the allocation is owned; kernels and copies address it only through the
// executor, which callers order (as on a GPU stream).
unsafe impl Send for EmuMem {}
unsafe impl Sync for EmuMem {}
/// A registration of host memory (nothing to lock: the emulator's copies are memcpy),
/// counted so that tests can see what a GPU would have page-locked.
pub struct EmuPinned {
    len: u64,
    usage: Arc<Usage>,
}

impl Drop for EmuPinned {
    fn drop(&mut self) {
        self.usage.pinned.fetch_sub(self.len, Ordering::Relaxed);
    }
}

impl Drop for EmuMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `alloc`.
        unsafe { dealloc(self.ptr, self.layout) }
        self.usage
            .in_use
            .fetch_sub(self.layout.size() as u64, Ordering::Relaxed);
    }
}

fn load(dt: Dt, base: u64, i: usize) -> f32 {
    // SAFETY: callers index inside allocations described by a checked Gemm.
    unsafe {
        match dt {
            Dt::F32 => *(base as *const f32).add(i),
            Dt::Bf16 => half::bf16::from_bits(*(base as *const u16).add(i)).to_f32(),
        }
    }
}

/// The value of the E4M3 byte at `base + i`.
fn fp8_load(base: u64, i: usize) -> f32 {
    // SAFETY: as in `load`.
    denoised_runtime::fp8::DECODE[unsafe { *(base as *const u8).add(i) } as usize]
}

fn store(dt: Dt, base: u64, i: usize, v: f32) {
    // SAFETY: callers index inside allocations described by a checked Gemm or Conv.
    unsafe {
        match dt {
            Dt::F32 => *(base as *mut f32).add(i) = v,
            Dt::Bf16 => *(base as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
        }
    }
}

fn load_rounded(dt: Dt, v: f32) -> f32 {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

impl Exec for EmuExec {
    type Mem = EmuMem;
    type Pinned = EmuPinned;
    /// One stream in effect: every operation completes before the call returns, so an
    /// event is the host's clock when it was recorded, and the time between two of
    /// them is the emulated work's.
    type Event = Instant;

    fn describe(&self) -> String {
        "cuda-emulator (the kernels on CPU fibers)".into()
    }
    fn alloc(&self, bytes: usize) -> Result<EmuMem> {
        let layout = Layout::from_size_align(bytes.max(64), 64)
            .map_err(|e| CudaError::Driver(format!("bad allocation of {bytes} bytes: {e}")))?;
        let size = layout.size() as u64;
        let u = &self.usage;
        let now = u.in_use.fetch_add(size, Ordering::Relaxed) + size;
        // As cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY is not sticky, the device stays usable.
        let oom = || {
            u.in_use.fetch_sub(size, Ordering::Relaxed);
            CudaError::Driver(format!(
                "CUDA_ERROR_OUT_OF_MEMORY: allocating {bytes} bytes with {} of {} in use (emulated device)",
                now - size,
                u.capacity
            ))
        };
        if now > u.capacity {
            return Err(oom());
        }
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        u.peak.fetch_max(now, Ordering::Relaxed);
        // Device memory starts undefined; all-ones bytes are NaN in f32 and bf16, so an
        // op that leaves part of its output unwritten fails the tests loudly.
        // SAFETY: the allocation holds layout.size() bytes.
        unsafe { std::ptr::write_bytes(ptr, 0xff, layout.size()) };
        Ok(EmuMem {
            ptr,
            layout,
            usage: u.clone(),
        })
    }
    fn addr(&self, m: &EmuMem) -> u64 {
        m.ptr as u64
    }
    fn upload(&self, dst: &EmuMem, offset: usize, bytes: &[u8]) -> Result<()> {
        assert!(offset + bytes.len() <= dst.layout.size());
        // SAFETY: bounds checked above; host memory does not overlap the allocation.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.ptr.add(offset), bytes.len()) };
        Ok(())
    }
    fn download(&self, src: &EmuMem, offset: usize, out: &mut [u8]) -> Result<()> {
        assert!(offset + out.len() <= src.layout.size());
        // SAFETY: as in upload.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    #[cfg(not(denoised_emu))]
    fn launch<P: KernelParams>(&self, name: &'static str, _: Grid, _: &P) -> Result<()> {
        Err(CudaError::Driver(format!(
            "cannot run {name}: the CUDA emulator is built on x86-64 hosts only"
        )))
    }
    #[cfg(denoised_emu)]
    fn launch<P: KernelParams>(&self, name: &'static str, g: Grid, params: &P) -> Result<()> {
        let cname = CString::new(name).unwrap();
        // SAFETY: params is a live #[repr(C)] struct matching the kernel's (checked by
        // the param-size test); grid/block point at 3 values each.
        let rc = unsafe {
            denoised_emu_launch(
                cname.as_ptr(),
                g.grid.as_ptr(),
                g.block.as_ptr(),
                g.smem as _,
                params as *const P as *const c_void,
            )
        };
        if rc != 0 {
            return Err(CudaError::Driver(format!("no kernel named {name}")));
        }
        Ok(())
    }
    fn gemm(&self, g: &Gemm) -> Result<()> {
        if COUNTING.load(Ordering::Relaxed) {
            GEMMS.fetch_add(1, Ordering::Relaxed);
        }
        let sz = g.dt.size() as u64;
        if self.cublaslt_limits
            && (g.fp8.is_some_and(|s| s.x != 0 && !s.tensor)
                || g.bias.is_some_and(|b| b % 16 != 0)
                || g.out % 16 != 0
                || (g.ldo as u64 * sz) % 16 != 0)
        {
            return Err(CudaError::Unsupported(format!(
                "{}x{}x{} as asked (emulated cuBLASLt limits)",
                g.m, g.n, g.k
            )));
        }
        // The operands: elements of `dt`, or E4M3 bytes whose row scales multiply the
        // sum (exact products: two 4-bit significands), as cuBLASLt's outer-vector
        // scaling does.
        let operand = |base: u64, i: usize| match g.fp8 {
            None => load(g.dt, base, i),
            Some(_) => fp8_load(base, i),
        };
        let rows: Vec<Vec<f32>> = (0..g.n)
            .into_par_iter()
            .map(|r| {
                (0..g.m)
                    .map(|c| {
                        let mut acc = 0f32;
                        for i in 0..g.k {
                            acc += operand(g.x, r * g.ldx + i) * operand(g.w, c * g.k + i);
                        }
                        if let Some(s) = g.fp8.filter(|s| s.x != 0) {
                            let (i, j) = if s.tensor { (0, 0) } else { (r, c) };
                            acc = acc * load(Dt::F32, s.x, i) * load(Dt::F32, s.w, j);
                        }
                        let v = acc + g.bias.map_or(0.0, |b| load(g.dt, b, c));
                        if g.gelu {
                            // Rounded to the storage type first, as a separate
                            // kernel would see it.
                            let v = load_rounded(g.dt, v);
                            denoised_runtime::cpu::simd::gelu_tanh(v)
                        } else {
                            v
                        }
                    })
                    .collect()
            })
            .collect();
        for (r, row) in rows.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                store(g.dt, g.out, r * g.ldo + c, v);
            }
        }
        Ok(())
    }
    /// The emulator runs fp8 GEMMs as an sm_90 device would (its host GEMM above),
    /// into f32 too: the reference mode compares them with the CPU's.
    fn check_fp8(&self, _out: Dt) -> Result<()> {
        Ok(())
    }
    fn conv_library(&self) -> Option<String> {
        self.conv_library
            .then(|| "the emulator's host convolution (standing in for cuDNN)".into())
    }
    fn conv(&self, c: &Conv) -> Result<bool> {
        if !self.conv_library {
            return Ok(false);
        }
        self.usage.library_convs.fetch_add(1, Ordering::Relaxed);
        let (oh, ow) = c.out_hw();
        let pixels: Vec<Vec<f32>> = (0..c.n * oh * ow)
            .into_par_iter()
            .map(|p| {
                let (b, y, x) = (p / (oh * ow), p / ow % oh, p % ow);
                (0..c.o)
                    .map(|o| {
                        let mut acc = 0f32;
                        for i in 0..c.kh {
                            for j in 0..c.kw {
                                let yy = (y * c.stride + i) as isize - c.pad[0] as isize;
                                let xx = (x * c.stride + j) as isize - c.pad[1] as isize;
                                if yy < 0 || xx < 0 || yy >= c.h as isize || xx >= c.w as isize {
                                    continue;
                                }
                                let px = ((b * c.h + yy as usize) * c.w + xx as usize) * c.c;
                                let wk = ((o * c.kh + i) * c.kw + j) * c.c;
                                for ch in 0..c.c {
                                    acc += load(c.dt, c.x, px + ch) * load(c.dt, c.weight, wk + ch);
                                }
                            }
                        }
                        acc
                    })
                    .collect()
            })
            .collect();
        for (p, row) in pixels.iter().enumerate() {
            for (o, &v) in row.iter().enumerate() {
                store(c.dt, c.out, p * c.o + o, v);
            }
        }
        Ok(true)
    }
    fn attn_library(&self) -> Option<String> {
        self.attn_library
            .map(|_| "the emulator's host attention (standing in for cuDNN)".into())
    }
    fn sdpa_plan(&self, a: &Sdpa) -> Result<bool> {
        Ok(self.attn_library.is_some_and(|max| a.skv <= max))
    }
    /// `softmax(QKᵀ / sqrt(d)) V` in f32 from the bf16 views, rounded once to bf16, as
    /// a fused kernel keeps its scores and accumulators in f32.
    fn sdpa(&self, a: &Sdpa) -> Result<()> {
        if !self.sdpa_plan(a)? {
            return Err(CudaError::Unsupported(format!("emulated library: {a:?}")));
        }
        self.usage.library_attention.fetch_add(1, Ordering::Relaxed);
        let at = |t: &crate::exec::Strided, b: usize, h: usize, s: usize| {
            b * t.strides[0] + h * t.strides[1] + s * t.strides[2]
        };
        let scale = 1.0 / (a.head_dim as f32).sqrt();
        let rows: Vec<(usize, Vec<f32>)> = (0..a.batch * a.heads * a.sq)
            .into_par_iter()
            .map(|i| {
                let (b, h, s) = (i / (a.heads * a.sq), i / a.sq % a.heads, i % a.sq);
                let (q0, d) = (at(&a.q, b, h, s), a.head_dim);
                let q: Vec<f32> = (0..d).map(|c| load(Dt::Bf16, a.q.addr, q0 + c)).collect();
                let scores: Vec<f32> = (0..a.skv)
                    .map(|j| {
                        let k0 = at(&a.k, b, h, j);
                        let dot: f32 = (0..d)
                            .map(|c| q[c] * load(Dt::Bf16, a.k.addr, k0 + c))
                            .sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let p: Vec<f32> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f32 = p.iter().sum();
                let mut o = vec![0f32; d];
                for (j, pj) in p.iter().enumerate() {
                    let v0 = at(&a.v, b, h, j);
                    for (c, oc) in o.iter_mut().enumerate() {
                        *oc += pj * load(Dt::Bf16, a.v.addr, v0 + c);
                    }
                }
                o.iter_mut().for_each(|x| *x /= sum);
                (at(&a.o, b, h, s), o)
            })
            .collect();
        // Every output after every read: O may be Q's own memory (in place).
        for (o0, o) in rows {
            for (c, v) in o.into_iter().enumerate() {
                store(Dt::Bf16, a.o.addr, o0 + c, v);
            }
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    unsafe fn register(&self, _base: *mut u8, len: usize, _read_only: bool) -> Result<EmuPinned> {
        self.usage.pinned.fetch_add(len as u64, Ordering::Relaxed);
        Ok(EmuPinned {
            len: len as u64,
            usage: self.usage.clone(),
        })
    }
    unsafe fn load(&self, dst: &EmuMem, offset: usize, src: *const u8, len: usize) -> Result<()> {
        self.upload(dst, offset, std::slice::from_raw_parts(src, len))
    }
    unsafe fn store(&self, dst: *mut u8, src: &EmuMem, offset: usize, len: usize) -> Result<()> {
        self.download(src, offset, std::slice::from_raw_parts_mut(dst, len))
    }
    fn is_done(&self, _: &Instant) -> Result<bool> {
        Ok(true)
    }
    fn sync_event(&self, _: &Instant) -> Result<()> {
        Ok(())
    }
    fn record(&self, _: crate::exec::Stream) -> Result<Instant> {
        Ok(Instant::now())
    }
    fn wait(&self, _: crate::exec::Stream, _: &Instant) -> Result<()> {
        Ok(())
    }
    fn timing_event(&self) -> Result<Option<Instant>> {
        Ok(Some(Instant::now()))
    }
    fn elapsed_ms(&self, start: &Instant, end: &Instant) -> Result<f64> {
        Ok(end.duration_since(*start).as_secs_f64() * 1e3)
    }
    fn memory(&self) -> Result<MemInfo> {
        let total = self.usage.capacity;
        Ok(MemInfo {
            free: total.saturating_sub(self.in_use_bytes()),
            total,
        })
    }
}
