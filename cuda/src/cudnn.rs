//! cuDNN for the VAE's plain convolutions on a real GPU ([`crate::gpu::CudaExec::conv`]).
//!
//! cuDNN is loaded dynamically (cudarc's `cudnn` feature with `dynamic-loading`), on
//! the first convolution, and only if `libcudnn.so.9` (or an unversioned
//! `libcudnn.so`) can be opened: the CUDA toolkit's, or `pip install nvidia-cudnn-cu13`
//! with its `lib/` on `LD_LIBRARY_PATH`. Where it is absent, or `DENOISED_CUDNN=0`, or
//! it has no algorithm for a shape within [`WORKSPACE_CAP`], the backend's own
//! im2col + cuBLASLt path runs instead; the result is the same up to summation order.
//!
//! Layout: activations are NHWC and convolution weights `[O, kh, kw, I]` already (the
//! im2col path's order), which are cuDNN's `CUDNN_TENSOR_NHWC` tensor and filter
//! formats, so nothing is copied. f32 convolutions run with `CUDNN_FMA_MATH` (no TF32:
//! the same arithmetic as the f32 GEMM path, which the f32 tolerances assume); bf16
//! with tensor cores, f32 accumulation.
//!
//! Plans (descriptors and the heuristic's algorithm) are cached per shape, as the GEMM
//! plans are; a VAE has a few dozen distinct shapes per resolution.
//!
//! The same handle runs fused attention (`sdpa`: the backend graph API's SDPA forward
//! operation) for [`crate::exec::Exec::sdpa`].

mod sdpa;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cudnn::{result as dnn, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::exec::{Conv, Dt, Sdpa};
use crate::CudaError;

/// The most workspace one convolution may use. Algorithms that need more are skipped
/// (the heuristic lists several per shape); the device memory budget counts this much
/// for every process that runs a VAE on the device.
pub const WORKSPACE_CAP: usize = 64 << 20;

fn err(what: &str) -> impl Fn(dnn::CudnnError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e:?}"))
}

/// Whether cuDNN may be used: `DENOISED_CUDNN=0` turns it off (to compare the two
/// paths on one GPU), and the library must be loadable.
pub fn wanted_and_present() -> bool {
    !turned_off() && present()
}

/// `DENOISED_CUDNN=0` (or `off`).
fn turned_off() -> bool {
    std::env::var("DENOISED_CUDNN").is_ok_and(|v| v == "0" || v == "off")
}

fn present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// "cuDNN 9.5.1" for `CUDNN_VERSION` 90501.
fn version_name(v: usize) -> String {
    format!("cuDNN {}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// The loaded library's version (`CUDNN_VERSION`: 90501 for 9.5.1); an error unless it
/// is cuDNN 9, the API these bindings are for. Needs no GPU.
pub(crate) fn library_version() -> Result<usize, CudaError> {
    // cudarc resolves each symbol at its first call and panics if it is missing: a
    // broken install must mean "no cuDNN", not a dead worker.
    let v = std::panic::catch_unwind(dnn::get_version)
        .map_err(|_| CudaError::Driver("libcudnn lacks cudnnGetVersion".into()))?;
    if v / 10000 != 9 {
        return Err(CudaError::Driver(format!(
            "cuDNN {v} found; these bindings are for cuDNN 9"
        )));
    }
    Ok(v)
}

/// The cuDNN this process would load, as "cuDNN 9.14.0", or why none (absent, off,
/// or not cuDNN 9). Needs no GPU: `denoised devices` prints it.
pub fn library() -> Result<String, String> {
    if turned_off() {
        return Err("off (DENOISED_CUDNN=0)".into());
    }
    if !present() {
        return Err("libcudnn.so.9 not found on the library path".into());
    }
    library_version()
        .map(version_name)
        .map_err(|e| e.to_string())
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    dt: Dt,
    dims: [usize; 8],
    pad: [usize; 2],
}

struct Plan {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    workspace: usize,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `plan`, used by nobody once the cache drops them; a null
        // descriptor (a plan that failed half way) is skipped.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

/// A cuDNN handle on the executor's compute stream, its plans and its workspace.
/// Used only under the executor's mutex (cuDNN handles are not thread-safe).
pub(crate) struct Cudnn {
    handle: sys::cudnnHandle_t,
    version: usize,
    /// `None`: cuDNN has no algorithm for the shape within the cap (the fallback runs).
    plans: HashMap<Key, Option<Plan>>,
    /// Attention plans by shape; `None`: refused (our kernel runs it), logged once.
    attn: HashMap<[usize; 17], Option<sdpa::SdpaPlan>>,
    workspace: Option<CudaSlice<u8>>,
}

// SAFETY: the handle and descriptors are used only under the executor's mutex.
unsafe impl Send for Cudnn {}

impl Drop for Cudnn {
    fn drop(&mut self) {
        self.plans.clear();
        self.attn.clear();
        // SAFETY: last use of the handle.
        unsafe {
            let _ = dnn::destroy_handle(self.handle);
        }
    }
}

fn data_type(dt: Dt) -> sys::cudnnDataType_t {
    match dt {
        Dt::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        Dt::Bf16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Driver(format!("{v} exceeds cuDNN's int")))
}

impl Cudnn {
    /// A handle whose work goes on `stream` (the caller has bound the context).
    pub(crate) fn new(stream: &CudaStream) -> Result<Cudnn, CudaError> {
        let version = library_version()?;
        let handle = dnn::create_handle().map_err(err("cudnnCreate"))?;
        let me = Cudnn {
            handle,
            version,
            plans: HashMap::new(),
            attn: HashMap::new(),
            workspace: None,
        };
        // SAFETY: a live handle and the executor's live stream.
        unsafe { dnn::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(err("cudnnSetStream"))?;
        Ok(me)
    }

    /// "cuDNN 9.5.1", from the loaded library.
    pub(crate) fn describe(&self) -> String {
        version_name(self.version)
    }

    fn plan(c: &Conv, handle: sys::cudnnHandle_t) -> Result<Option<Plan>, CudaError> {
        let (oh, ow) = c.out_hw();
        let dt = data_type(c.dt);
        let nhwc = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        let mut p = Plan {
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            algo: sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
            workspace: 0,
        };
        // SAFETY: descriptors are created here and owned by `p` (freed on every path).
        unsafe {
            p.x = dnn::create_tensor_descriptor().map_err(err("cudnnCreateTensorDescriptor"))?;
            dnn::set_tensor4d_descriptor(p.x, nhwc, dt, [c.n, c.c, c.h, c.w].map(|v| v as i32))
                .map_err(err("input descriptor"))?;
            p.y = dnn::create_tensor_descriptor().map_err(err("cudnnCreateTensorDescriptor"))?;
            dnn::set_tensor4d_descriptor(p.y, nhwc, dt, [c.n, c.o, oh, ow].map(|v| v as i32))
                .map_err(err("output descriptor"))?;
            p.w = dnn::create_filter_descriptor().map_err(err("cudnnCreateFilterDescriptor"))?;
            dnn::set_filter4d_descriptor(p.w, dt, nhwc, [c.o, c.c, c.kh, c.kw].map(|v| v as i32))
                .map_err(err("filter descriptor"))?;
            p.conv = dnn::create_convolution_descriptor()
                .map_err(err("cudnnCreateConvolutionDescriptor"))?;
            let s = c.stride as i32;
            dnn::set_convolution2d_descriptor(
                p.conv,
                c.pad[0] as i32,
                c.pad[1] as i32,
                s,
                s,
                1,
                1,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(err("convolution descriptor"))?;
            let math = match c.dt {
                Dt::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
                Dt::Bf16 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            };
            dnn::set_convolution_math_type(p.conv, math).map_err(err("math type"))?;
            const ALGOS: usize = 8;
            let mut count = 0;
            let mut perf: [sys::cudnnConvolutionFwdAlgoPerf_t; ALGOS] = std::mem::zeroed();
            dnn::get_convolution_forward_algorithm(
                handle,
                p.x,
                p.w,
                p.conv,
                p.y,
                ALGOS as i32,
                &mut count,
                perf.as_mut_ptr(),
            )
            .map_err(err("cudnnGetConvolutionForwardAlgorithm_v7"))?;
            // The heuristic's list is best first; take the first that runs within the
            // cap and keeps the math type asked for (FMA for f32).
            let pick = perf[..(count.max(0) as usize).min(ALGOS)].iter().find(|r| {
                r.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                    && r.memory <= WORKSPACE_CAP
                    && (c.dt == Dt::Bf16 || r.mathType == math)
            });
            let Some(r) = pick else { return Ok(None) };
            p.algo = r.algo;
            p.workspace =
                dnn::get_convolution_forward_workspace_size(handle, p.x, p.w, p.conv, p.y, p.algo)
                    .map_err(err("cudnnGetConvolutionForwardWorkspaceSize"))?;
            if p.workspace > WORKSPACE_CAP {
                return Ok(None);
            }
        }
        Ok(Some(p))
    }

    /// Runs `c` on the handle's stream; `Ok(false)` when cuDNN has no algorithm for it.
    pub(crate) fn run(&mut self, stream: &Arc<CudaStream>, c: &Conv) -> Result<bool, CudaError> {
        let (oh, ow) = c.out_hw();
        for v in [c.n * c.h * c.w * c.c, c.n * oh * ow * c.o] {
            int(v)?;
        }
        let key = Key {
            dt: c.dt,
            dims: [c.n, c.h, c.w, c.c, c.o, c.kh, c.kw, c.stride],
            pad: c.pad,
        };
        if !self.plans.contains_key(&key) {
            let plan = Self::plan(c, self.handle)?;
            self.plans.insert(key, plan);
        }
        let Some(plan) = self.plans.get(&key).and_then(Option::as_ref) else {
            return Ok(false);
        };
        let ws_bytes = plan.workspace;
        let ws = Self::workspace(&mut self.workspace, stream, ws_bytes)?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the pointers come from live allocations the backend sized for these
        // shapes; the workspace holds at least `plan.workspace` bytes.
        let launched = unsafe {
            dnn::convolution_forward(
                self.handle,
                &alpha as *const f32 as *const c_void,
                plan.x,
                c.x as *const c_void,
                plan.w,
                c.weight as *const c_void,
                plan.conv,
                plan.algo,
                ws.device_ptr(stream).0 as *mut c_void,
                plan.workspace,
                &beta as *const f32 as *const c_void,
                plan.y,
                c.out as *mut c_void,
            )
        };
        // A refusal at launch (a shape the heuristic offered but the engine rejects)
        // leaves the output unwritten: this shape goes to the fallback from now on.
        if let Err(e) = launched {
            tracing::warn!("cuDNN refused a convolution {c:?} ({e:?}); it runs on im2col + GEMM");
            self.plans.insert(key, None);
            return Ok(false);
        }
        Ok(true)
    }
}

impl Cudnn {
    /// The shared workspace, grown to at least `need` bytes.
    fn workspace<'a>(
        slot: &'a mut Option<CudaSlice<u8>>,
        stream: &Arc<CudaStream>,
        need: usize,
    ) -> Result<&'a CudaSlice<u8>, CudaError> {
        let need = need.max(1);
        if slot.as_ref().is_none_or(|w| w.len() < need) {
            *slot = None; // freed (stream-ordered) before the larger one is taken
            *slot = Some(stream.alloc_zeros::<u8>(need).map_err(|e| {
                CudaError::Driver(format!("cuDNN workspace of {need} bytes: {e:?}"))
            })?);
        }
        Ok(slot.as_ref().expect("allocated above"))
    }

    /// Whether fused attention has a plan for `a`'s shape: built at its first sight and
    /// kept; a refusal is logged once, with cuDNN's reason, and remembered.
    pub(crate) fn sdpa_plan(&mut self, a: &Sdpa) -> bool {
        let key = a.shape();
        if let Some(p) = self.attn.get(&key) {
            return p.is_some();
        }
        let handle = self.handle;
        // cudarc panics on a symbol the library lacks (a cuDNN older than the op).
        let built =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sdpa::plan(handle, a)))
                .unwrap_or_else(|_| {
                    Err(CudaError::Unsupported("libcudnn lacks a function".into()))
                });
        let what = format!(
            "{}x{} heads of {}, {} queries, {} keys",
            a.batch, a.heads, a.head_dim, a.sq, a.skv
        );
        let plan = match built {
            Ok(p) => {
                tracing::debug!("{}: fused attention plan for {what}", self.describe());
                Some(p)
            }
            Err(e) => {
                tracing::warn!(
                    "{} refused fused attention for {what} ({e}); our fa2w kernel runs it",
                    self.describe()
                );
                None
            }
        };
        let ok = plan.is_some();
        self.attn.insert(key, plan);
        ok
    }

    /// Runs `a`, whose shape [`sdpa_plan`](Self::sdpa_plan) accepted, on the handle's stream.
    pub(crate) fn sdpa_run(&mut self, stream: &Arc<CudaStream>, a: &Sdpa) -> Result<(), CudaError> {
        let Some(Some(plan)) = self.attn.get(&a.shape()) else {
            return Err(CudaError::Unsupported(format!(
                "no attention plan for {a:?}"
            )));
        };
        let need = plan.workspace_bytes();
        let ws = if need > 0 {
            Some(Self::workspace(&mut self.workspace, stream, need)?)
        } else {
            None
        };
        plan.run(self.handle, stream, a, ws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loading and the version check, which need no GPU: run with cuDNN's `lib/` on
    /// `LD_LIBRARY_PATH` (e.g. from `pip download nvidia-cudnn-cu13`) to check an install.
    #[test]
    fn loads_cudnn_9_where_installed() {
        if !wanted_and_present() {
            println!("skipping: libcudnn.so.9 is not on the library path (or DENOISED_CUDNN=0)");
            return;
        }
        let v = library_version().unwrap();
        println!("cuDNN {v}");
        assert_eq!(v / 10000, 9);
    }
}
