//! The executor: what the GPU backend needs from a device, and nothing more.
//!
//! [`crate::backend::GpuBackend`] is written once against this trait. Two executors
//! implement it:
//! - [`crate::gpu::CudaExec`]: a real GPU through cudarc (NVRTC modules, cuBLASLt,
//!   stream-ordered pool allocations, pinned staging);
//! - [`crate::emu::EmuExec`]: host memory, the *same kernel sources* built for the CPU
//!   emulator, and a host GEMM. It runs everywhere, so CI exercises the whole GPU
//!   backend (descriptors, row references, launch geometry, the kernels themselves)
//!   on machines without a GPU.

use crate::params::KernelParams;
use crate::CudaError;

pub type Result<T> = std::result::Result<T, CudaError>;

/// Storage type of a device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    F32,
    Bf16,
}

impl Dt {
    pub fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::Bf16 => 2,
        }
    }
    /// The suffix of kernel names for this type.
    pub fn suffix(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
        }
    }
}

/// Launch geometry.
#[derive(Clone, Copy, Debug)]
pub struct Grid {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem: u32,
}

impl Grid {
    /// A 1-D launch of `n` work items, `per_block` threads each block.
    pub fn linear(n: usize, per_block: u32) -> Grid {
        let blocks = n.div_ceil(per_block as usize).clamp(1, 65535 * 32) as u32;
        Grid {
            grid: [blocks, 1, 1],
            block: [per_block, 1, 1],
            smem: 0,
        }
    }
}

/// `C[n, m] = X[n, k] @ W[m, k]^T (+ bias[m])`, then GELU (tanh) when `gelu`,
/// row-major, all of type `dt`, f32 accumulation. `x` rows are `ldx` elements apart (a
/// column block of a wider matrix), and `out` rows `ldo` apart (a column block of a
/// wider output: one projection split into GEMMs with different epilogues).
///
/// With `fp8`, X and W are E4M3 bytes with a f32 scale per row of each (a token's,
/// an output channel's): `C[r, c] = sx[r] * sw[c] * sum_i X[r, i] W[c, i]` (+ bias,
/// GELU), written in `dt` as before (the bias is `dt` too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gemm {
    pub dt: Dt,
    pub n: usize,
    pub m: usize,
    pub k: usize,
    pub x: u64,
    pub ldx: usize,
    pub w: u64,
    pub bias: Option<u64>,
    pub gelu: bool,
    pub out: u64,
    pub ldo: usize,
    pub fp8: Option<Fp8Scales>,
}

/// The scales of an fp8 [`Gemm`]: `n` f32 values for X's rows and `m` for W's, or with
/// `tensor` one f32 each (`C = sx * sw * sum`, which cuBLASLt applies inside the GEMM
/// with its epilogues); both 0 for unit scales (a bare GEMM, whose scales a pass
/// applies after).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Scales {
    pub x: u64,
    pub w: u64,
    pub tensor: bool,
}

/// A 2-D convolution for a vendor library (cuDNN), without bias: input `x` `[n, h, w, c]`
/// (NHWC), weight `[o, kh, kw, c]`, symmetric zero padding `pad = [rows, cols]`, output
/// `[n, oh, ow, o]`, all of type `dt`, f32 accumulation. The backend adds the bias and
/// any residual after it (one elementwise pass); shapes the library form cannot say
/// (FLUX's asymmetric padding, a fused upsample) never reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv {
    pub dt: Dt,
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: [usize; 2],
    pub x: u64,
    pub weight: u64,
    pub out: u64,
}

impl Conv {
    /// Output rows and columns.
    pub fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad[0] - self.kh) / self.stride + 1,
            (self.w + 2 * self.pad[1] - self.kw) / self.stride + 1,
        )
    }
}

/// One tensor of an [`Sdpa`]: its first element's device address and the strides, in
/// elements, of its `[batch, heads, seq, head_dim]` dimensions (head_dim's is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strided {
    pub addr: u64,
    pub strides: [usize; 3],
}

/// Fused attention for a vendor library (cuDNN's SDPA forward):
/// `O = softmax(QKᵀ / sqrt(head_dim)) V` per (batch, head), no mask, bf16 tensors, f32
/// softmax and accumulation. Q and O are `[batch, heads, sq, head_dim]`, K and V
/// `[batch, heads, skv, head_dim]`, each a strided view (columns of a wider buffer),
/// so the backend hands it its buffers where they lie (`crate::sdpa` plans them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sdpa {
    pub batch: usize,
    pub heads: usize,
    pub sq: usize,
    pub skv: usize,
    pub head_dim: usize,
    pub q: Strided,
    pub k: Strided,
    pub v: Strided,
    pub o: Strided,
}

impl Sdpa {
    /// What a plan depends on: everything but the addresses (a library's plans are
    /// built once per shape and run on any buffers of that shape).
    pub fn shape(&self) -> [usize; 17] {
        let s = |t: &Strided| t.strides;
        let [q, k, v, o] = [s(&self.q), s(&self.k), s(&self.v), s(&self.o)];
        [
            self.batch,
            self.heads,
            self.sq,
            self.skv,
            self.head_dim,
            q[0],
            q[1],
            q[2],
            k[0],
            k[1],
            k[2],
            v[0],
            v[1],
            v[2],
            o[0],
            o[1],
            o[2],
        ]
    }
}

/// The executor's two queues: kernels and GEMMs run in order on `Compute`; cache loads
/// run on `Copy`, ordered against compute only through events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Compute,
    Copy,
}

pub trait Exec: Send + Sync + 'static {
    /// One device allocation; freed when dropped.
    type Mem: Send + Sync;
    /// A registration of host memory for asynchronous copies (page-locked on a GPU).
    type Pinned: Send + Sync;
    /// A point in a stream's work that another stream can wait for.
    type Event: Send + Sync;

    fn describe(&self) -> String;
    /// Whether an error message of this executor reports a sticky error, after which
    /// the context is unusable (see [`crate::device::is_sticky`]).
    fn is_sticky(&self, _message: &str) -> bool {
        false
    }
    fn alloc(&self, bytes: usize) -> Result<Self::Mem>;
    /// Device address of the allocation's first byte.
    fn addr(&self, m: &Self::Mem) -> u64;
    /// Copies host bytes to `dst + offset` (ordered before later launches).
    fn upload(&self, dst: &Self::Mem, offset: usize, bytes: &[u8]) -> Result<()>;
    /// Copies device bytes to the host once all earlier work has finished.
    fn download(&self, src: &Self::Mem, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Launches kernel `name` (see `kernels::MODULES`) with one parameter struct.
    fn launch<P: KernelParams>(&self, name: &'static str, g: Grid, params: &P) -> Result<()>;
    /// Runs `g`; [`CudaError::Unsupported`](crate::CudaError::Unsupported) where the
    /// library has no algorithm for it as asked (the backend then runs it bare).
    fn gemm(&self, g: &Gemm) -> Result<()>;
    /// Whether this device runs fp8 GEMMs ([`Gemm::fp8`]) writing `out`: an error
    /// saying why not (the device and its compute capability) where it has no fp8
    /// tensor cores.
    fn check_fp8(&self, _out: Dt) -> Result<()> {
        Err(CudaError::NoDevice(format!(
            "{} has no fp8 GEMM",
            self.describe()
        )))
    }
    /// The convolution library [`conv`](Self::conv) runs on, if this executor has one
    /// (for logs and the self-test: docs/gpu.md says which path ran).
    fn conv_library(&self) -> Option<String> {
        None
    }
    /// Runs `c` with the convolution library. `Ok(false)` when there is none, or it has
    /// no algorithm for this shape within its workspace: the backend then runs its own
    /// im2col + GEMM path, which every executor has.
    fn conv(&self, _c: &Conv) -> Result<bool> {
        Ok(false)
    }
    /// The fused-attention library [`sdpa`](Self::sdpa) runs on, if this executor has
    /// one (cuDNN on a GPU): for logs, `/readyz` and `denoised devices`.
    fn attn_library(&self) -> Option<String> {
        None
    }
    /// Whether the attention library has a plan for `a`'s shape (built now if new,
    /// then kept): `Ok(false)` when there is no library or it refuses the shape, and
    /// the backend runs its own kernel. A refusal's reason is logged once per shape.
    fn sdpa_plan(&self, _a: &Sdpa) -> Result<bool> {
        Ok(false)
    }
    /// Runs `a`, whose shape [`sdpa_plan`](Self::sdpa_plan) accepted.
    fn sdpa(&self, a: &Sdpa) -> Result<()> {
        Err(CudaError::Unsupported(format!(
            "{} has no attention library for {a:?}",
            self.describe()
        )))
    }
    /// Waits for all queued work.
    fn synchronize(&self) -> Result<()>;

    /// Page-locks `len` bytes of host memory at `base` for asynchronous copies, until
    /// the returned value is dropped.
    ///
    /// # Safety
    /// The memory stays mapped at `base` for as long as the registration lives.
    unsafe fn register(&self, base: *mut u8, len: usize, read_only: bool) -> Result<Self::Pinned>;
    /// Queues a copy of `len` host bytes at `src` to `dst + offset` on the copy stream.
    ///
    /// # Safety
    /// `src` lies in registered memory (else the copy is synchronous but still
    /// correct) that stays valid and unchanged until the copy is done (an event
    /// recorded on the copy stream after it).
    unsafe fn load(&self, dst: &Self::Mem, offset: usize, src: *const u8, len: usize)
        -> Result<()>;
    /// Queues a copy of `len` device bytes at `src + offset` to host `dst` on the copy
    /// stream.
    ///
    /// # Safety
    /// As [`load`](Self::load), and nobody reads `dst` or frees `src` until the copy
    /// is done.
    unsafe fn store(&self, dst: *mut u8, src: &Self::Mem, offset: usize, len: usize) -> Result<()>;
    /// Whether the work before `e` has finished (never waits).
    fn is_done(&self, e: &Self::Event) -> Result<bool>;
    /// Blocks the calling thread until the work before `e` has finished.
    fn sync_event(&self, e: &Self::Event) -> Result<()>;
    /// Marks the work queued so far on `on`.
    fn record(&self, on: Stream) -> Result<Self::Event>;
    /// Makes later work on `on` wait for `e`.
    fn wait(&self, on: Stream, e: &Self::Event) -> Result<()>;
    /// The device's memory now: what the device memory budget starts from.
    fn memory(&self) -> Result<MemInfo>;
    /// An event with timing recorded on the compute stream now, for measuring device
    /// time between two of them ([`elapsed_ms`](Self::elapsed_ms)): CUDA events on a
    /// GPU, the host clock on the emulator (whose work is done when a call returns);
    /// `None` where an executor has no clock.
    fn timing_event(&self) -> Result<Option<Self::Event>> {
        Ok(None)
    }
    /// Milliseconds of device time between two timing events (waits for the second).
    fn elapsed_ms(&self, _start: &Self::Event, _end: &Self::Event) -> Result<f64> {
        Err(CudaError::Driver("this executor has no GPU clock".into()))
    }
}

/// Device memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}
