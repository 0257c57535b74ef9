//! cuBLASLt for the CUDA executor: one handle and workspace, GEMM plans cached by shape,
//! alignment, epilogue and fp8 form, and the GEMMs it refuses as asked reported as
//! [`CudaError::Unsupported`] (remembered per key) for the backend's bare path
//! (docs/gpu.md, "fp8 weights").

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::exec::{Dt, Gemm, Result};
use crate::CudaError;

fn blas(what: &str) -> impl Fn(lt::CublasError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e:?}"))
}

/// cuBLASLt refusing a GEMM as asked (no algorithm from the heuristic, or a launch
/// answered NOT_SUPPORTED or INVALID_VALUE): what the backend's bare path takes over.
fn refused(what: &str, e: lt::CublasError) -> CudaError {
    use ltsys::cublasStatus_t::*;
    match e.0 {
        CUBLAS_STATUS_NOT_SUPPORTED | CUBLAS_STATUS_INVALID_VALUE => {
            CudaError::Unsupported(format!("{what}: {e:?}"))
        }
        _ => CudaError::Driver(format!("{what}: {e:?}")),
    }
}

/// cuBLASLt workspace (what it needs for split-K on large GEMMs).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Most cached GEMM plans. The row count is part of a plan's key and varies with each
/// batch's active tokens, so the cache is emptied when it reaches this size rather
/// than growing without bound (a miss costs one heuristic query, microseconds).
const MAX_PLANS: usize = 4096;

pub(crate) struct Blas {
    handle: ltsys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// Plans by key; `None` where cuBLASLt had no algorithm, so a GEMM it refused
    /// once is refused again without asking (the backend runs those bare).
    plans: HashMap<PlanKey, Option<Plan>>,
}
// SAFETY: the handle is used only under the executor's mutex.
unsafe impl Send for Blas {}

impl Blas {
    /// A handle and its workspace on `stream`'s device.
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| CudaError::Driver(format!("cuBLASLt workspace: {e:?}")))?;
        let handle = lt::create_handle().map_err(blas("cublasLtCreate"))?;
        Ok(Blas {
            handle,
            workspace,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, g: &Gemm) -> Result<&Plan> {
        let b = self;
        let key = PlanKey::of(g);
        if !b.plans.contains_key(&key) {
            if b.plans.len() >= MAX_PLANS {
                b.plans.clear();
            }
            let plan = match build_plan(b.handle, &key) {
                Ok(p) => Some(p),
                Err(CudaError::Unsupported(why)) => {
                    tracing::debug!("GEMM {}x{}x{}: {why}", key.m, key.n, key.k);
                    None
                }
                Err(e) => return Err(e),
            };
            b.plans.insert(key, plan);
        }
        b.plans[&key].as_ref().ok_or_else(|| {
            CudaError::Unsupported(format!(
                "no cuBLASLt algorithm for GEMM {}x{}x{} (bias {}, GELU {}, fp8 {}, scaled {}, per tensor {})",
                key.m, key.n, key.k, key.bias, key.gelu, key.fp8, key.scaled, key.tensor
            ))
        })
    }

    /// Runs `g` on `stream` ([`CudaError::Unsupported`] where cuBLASLt refuses it
    /// as asked; the key is then refused without asking again).
    pub(crate) fn run(&mut self, g: &Gemm, stream: &Arc<CudaStream>) -> Result<()> {
        let handle = self.handle;
        let ws = self.workspace.device_ptr(stream).0;
        let plan = self.plan(g)?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: pointers come from live allocations sized by the backend's checks.
        unsafe {
            if let Some(bias) = g.bias {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    8,
                )
                .map_err(blas("BIAS_POINTER"))?;
            }
            if let Some(s) = g.fp8.filter(|s| s.x != 0) {
                use ltsys::cublasLtMatmulDescAttributes_t::*;
                for (attr, ptr) in [
                    (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, s.w),
                    (CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, s.x),
                ] {
                    lt::set_matmul_desc_attribute(
                        plan.desc,
                        attr,
                        &ptr as *const u64 as *const c_void,
                        8,
                    )
                    .map_err(blas("SCALE_POINTER"))?;
                }
            }
            lt::matmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.w as *const c_void,
                plan.a,
                g.x as *const c_void,
                plan.b,
                g.out as *const c_void,
                plan.c,
                g.out as *mut c_void,
                plan.c,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| refused("cublasLtMatmul", e))
        .inspect_err(|e| {
            // A launch refused it: ask no more for this key.
            if matches!(e, CudaError::Unsupported(_)) {
                self.plans.insert(PlanKey::of(g), None);
            }
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    dt: Dt,
    n: usize,
    m: usize,
    k: usize,
    ldx: usize,
    ldo: usize,
    bias: bool,
    gelu: bool,
    fp8: bool,
    /// fp8 with scales (else unit scales: a bare fp8 GEMM): one each (`tensor`,
    /// cuBLASLt's default scalar mode) or outer vectors.
    scaled: bool,
    tensor: bool,
    /// Byte alignment of W, X, the output (cuBLASLt may pick kernels that assume
    /// more alignment than a column-block view of X has, unless told) and the bias
    /// (which it cannot be told: a launch refused for a misaligned bias refuses only
    /// that alignment's key).
    align: [u32; 4],
}

impl PlanKey {
    fn of(g: &Gemm) -> PlanKey {
        PlanKey {
            dt: g.dt,
            n: g.n,
            m: g.m,
            k: g.k,
            ldx: g.ldx,
            ldo: g.ldo,
            bias: g.bias.is_some(),
            gelu: g.gelu,
            fp8: g.fp8.is_some(),
            scaled: g.fp8.is_some_and(|s| s.x != 0),
            tensor: g.fp8.is_some_and(|s| s.tensor),
            align: [
                alignment(g.w),
                alignment(g.x),
                alignment(g.out),
                g.bias.map_or(256, alignment),
            ],
        }
    }
}

/// The largest power of two (up to 256) dividing a device address.
fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    a: ltsys::cublasLtMatrixLayout_t,
    b: ltsys::cublasLtMatrixLayout_t,
    c: ltsys::cublasLtMatrixLayout_t,
    algo: ltsys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `plan` and used by nobody after the cache drops them.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: last use of the handle.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// A cuBLASLt plan for `key`: its epilogue, and for fp8 its scale mode, asked for as
/// they are ([`CudaError::Unsupported`] where cuBLASLt has no algorithm).
fn build_plan(handle: ltsys::cublasLtHandle_t, key: &PlanKey) -> Result<Plan> {
    let ty = match key.dt {
        Dt::F32 => ltsys::cudaDataType_t::CUDA_R_32F,
        Dt::Bf16 => ltsys::cudaDataType_t::CUDA_R_16BF,
    };
    // Column-major view of row-major data: D^T[m, n] = W[m, k] * X^T[k, n],
    // with W read as the transpose of its [k, m] column-major storage.
    let desc = lt::create_matmul_desc(
        ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ltsys::cudaDataType_t::CUDA_R_32F,
    )
    .map_err(blas("cublasLtMatmulDescCreate"))?;
    // fp8: the same "TN" form, which is the only one cuBLASLt's fp8 kernels
    // take (both operands k-major). A is W, so its outer scale vector is W's
    // per-output-channel scales (m) and B's is X's per-token scales (n).
    let operand = match key.fp8 {
        true => ltsys::cudaDataType_t::CUDA_R_8F_E4M3,
        false => ty,
    };
    let a = lt::create_matrix_layout(operand, key.k as u64, key.m as u64, key.k as i64)
        .map_err(blas("layout A"))?;
    let bl = lt::create_matrix_layout(operand, key.k as u64, key.n as u64, key.ldx as i64)
        .map_err(blas("layout B"))?;
    let c = lt::create_matrix_layout(ty, key.m as u64, key.n as u64, key.ldo as i64)
        .map_err(blas("layout C"))?;
    let mut plan = Plan {
        desc,
        a,
        b: bl,
        c,
        algo: unsafe { std::mem::zeroed() },
    };
    // SAFETY: attributes are plain values of the documented types.
    unsafe {
        let t: i32 = 1; // CUBLAS_OP_T
        lt::set_matmul_desc_attribute(
            desc,
            ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &t as *const _ as *const c_void,
            std::mem::size_of_val(&t),
        )
        .map_err(blas("TRANSA"))?;
        if key.fp8 {
            // Hopper's fp8 MMA accumulates in fewer bits than f32 unless cuBLASLt
            // promotes the partial sums every few k-steps; fast accumulation skips the
            // promotion, as inference fp8 GEMMs do (TensorRT, Transformer Engine's
            // forward pass). The self-test holds the result to the CPU's fp8
            // reference.
            let fast: i8 = 1;
            lt::set_matmul_desc_attribute(
                desc,
                ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &fast as *const _ as *const c_void,
                std::mem::size_of_val(&fast),
            )
            .map_err(blas("FAST_ACCUM"))?;
        }
        // Per-tensor scales are cuBLASLt's default (scalar) mode: only the pointers
        // are set, per call.
        if key.scaled && !key.tensor {
            let mode =
                ltsys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
            use ltsys::cublasLtMatmulDescAttributes_t::*;
            for attr in [
                CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            ] {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &mode as *const _ as *const c_void,
                    std::mem::size_of_val(&mode),
                )
                .map_err(blas("SCALE_MODE"))?;
            }
        }
        use ltsys::cublasLtEpilogue_t::*;
        // cuBLASLt's GELU is the tanh approximation, as Flux uses; the
        // linear_gelu check in tests/kernels.rs holds it to the CPU reference.
        let epi = match (key.bias, key.gelu) {
            (true, true) => CUBLASLT_EPILOGUE_GELU_BIAS,
            (true, false) => CUBLASLT_EPILOGUE_BIAS,
            (false, true) => CUBLASLT_EPILOGUE_GELU,
            (false, false) => CUBLASLT_EPILOGUE_DEFAULT,
        };
        lt::set_matmul_desc_attribute(
            desc,
            ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epi as *const _ as *const c_void,
            std::mem::size_of_val(&epi),
        )
        .map_err(blas("EPILOGUE"))?;
        let pref = lt::create_matmul_pref().map_err(blas("pref"))?;
        let ws = WORKSPACE_BYTES as u64;
        lt::set_matmul_pref_attribute(
            pref,
            ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            8,
        )
        .map_err(blas("pref workspace"))?;
        use ltsys::cublasLtMatmulPreferenceAttributes_t::*;
        for (attr, a) in [
            (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
            (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
            (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
            (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
        ] {
            lt::set_matmul_pref_attribute(pref, attr, &a as *const u32 as *const c_void, 4)
                .map_err(blas("pref alignment"))?;
        }
        let h = lt::get_matmul_algo_heuristic(handle, desc, a, bl, c, c, pref);
        let _ = lt::destroy_matmul_pref(pref);
        plan.algo = h
            .map_err(|e| refused("no cuBLASLt algorithm for this GEMM", e))?
            .algo;
    }
    Ok(plan)
}
