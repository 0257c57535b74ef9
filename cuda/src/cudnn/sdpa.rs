//! cuDNN's fused flash attention (the backend graph API's SDPA forward operation,
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR`) for [`crate::exec::Exec::sdpa`].
//!
//! One graph per shape ([`Sdpa::shape`]: dims and strides, not addresses) with a single
//! operation: Q, K, V and O as strided bf16 tensors `[batch, heads, seq, head_dim]`, the
//! softmax scale passed by value, no mask, no statistics output (inference). The
//! heuristics' engine configurations are tried in order and the first that finalizes
//! is the plan, kept for the process's life; a shape none takes is remembered as
//! refused, logged once with cuDNN's own reason, and runs on our kernel.
//!
//! Each call builds a variant pack (the tensors' addresses, the workspace) and
//! executes the plan on the handle's stream, the executor's compute stream.

use std::ffi::c_void;

use cudarc::cudnn::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::exec::{Sdpa, Strided};
use crate::CudaError;

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;

/// The most workspace one attention plan may use (its engines use little or none).
const WORKSPACE_CAP: usize = 256 << 20;

/// Tensor ids within a graph: the variant pack names its pointers by them.
const UID_Q: i64 = 1;
const UID_K: i64 = 2;
const UID_V: i64 = 3;
const UID_O: i64 = 4;
const UID_SCALE: i64 = 5;

/// One backend descriptor, destroyed when dropped.
struct Desc(sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create`, destroyed once; nothing uses it after its plan.
        unsafe {
            let _ = sys::cudnnBackendDestroyDescriptor(self.0);
        }
    }
}

/// cuDNN's last error message (it says which attribute or engine refused and why).
fn last_error() -> String {
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: writes at most `buf.len()` bytes, NUL-terminated.
    unsafe {
        sys::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len());
        std::ffi::CStr::from_ptr(buf.as_ptr())
            .to_string_lossy()
            .into_owned()
    }
}

fn check(what: &str, s: sys::cudnnStatus_t) -> Result<(), CudaError> {
    if s == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Unsupported(format!(
        "{what}: {s:?} ({})",
        last_error()
    )))
}

/// The descriptors of one graph, kept (in creation order) for as long as its plan.
struct Builder {
    descs: Vec<Desc>,
}

impl Drop for Builder {
    /// Newest first: a plan before the configurations, graph and tensors it was built
    /// from, as cuDNN's samples destroy them.
    fn drop(&mut self) {
        while self.descs.pop().is_some() {}
    }
}

impl Builder {
    fn create(&mut self, ty: D) -> Result<sys::cudnnBackendDescriptor_t, CudaError> {
        let mut d = std::ptr::null_mut();
        // SAFETY: writes one descriptor handle.
        check("create descriptor", unsafe {
            sys::cudnnBackendCreateDescriptor(ty, &mut d)
        })?;
        self.descs.push(Desc(d));
        Ok(d)
    }

    /// Sets attribute `name` to `values`, of backend type `ty`.
    fn set<V>(
        d: sys::cudnnBackendDescriptor_t,
        name: A,
        ty: T,
        values: &[V],
    ) -> Result<(), CudaError> {
        // SAFETY: `values` holds `len` elements of the type `ty` names.
        check(&format!("{name:?}"), unsafe {
            sys::cudnnBackendSetAttribute(
                d,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        })
    }

    fn finalize(d: sys::cudnnBackendDescriptor_t, what: &str) -> Result<(), CudaError> {
        // SAFETY: a descriptor whose required attributes were set.
        check(what, unsafe { sys::cudnnBackendFinalize(d) })
    }

    /// A finalized tensor descriptor: 4-D `dims` with `strides`, 16-byte aligned.
    fn tensor(
        &mut self,
        uid: i64,
        dt: sys::cudnnDataType_t,
        dims: [i64; 4],
        strides: [i64; 4],
        by_value: bool,
    ) -> Result<sys::cudnnBackendDescriptor_t, CudaError> {
        let d = self.create(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_UNIQUE_ID,
            T::CUDNN_TYPE_INT64,
            &[uid],
        )?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_DATA_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[dt],
        )?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_DIMENSIONS,
            T::CUDNN_TYPE_INT64,
            &dims,
        )?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_STRIDES,
            T::CUDNN_TYPE_INT64,
            &strides,
        )?;
        let align: i64 = if by_value { 4 } else { 16 };
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            T::CUDNN_TYPE_INT64,
            &[align],
        )?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            T::CUDNN_TYPE_BOOLEAN,
            &[false],
        )?;
        Self::set(
            d,
            A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
            T::CUDNN_TYPE_BOOLEAN,
            &[by_value],
        )?;
        Self::finalize(d, "tensor")?;
        Ok(d)
    }

    /// A bf16 tensor of `a`: `[batch, heads, seq, head_dim]` with its view's strides.
    fn view(
        &mut self,
        uid: i64,
        a: &Sdpa,
        t: &Strided,
        seq: usize,
    ) -> Result<sys::cudnnBackendDescriptor_t, CudaError> {
        let dims = [a.batch, a.heads, seq, a.head_dim].map(|v| v as i64);
        let s = t.strides;
        let strides = [s[0] as i64, s[1] as i64, s[2] as i64, 1];
        self.tensor(
            uid,
            sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
            dims,
            strides,
            false,
        )
    }
}

/// A built plan: the execution plan descriptor and what it keeps alive.
pub(crate) struct SdpaPlan {
    plan: sys::cudnnBackendDescriptor_t,
    workspace: usize,
    /// Every descriptor the plan was built from (tensors, operation, graph, engine
    /// configurations) and the plan itself, destroyed newest first.
    _descs: Builder,
}

// SAFETY: used only under the executor's mutex, like the handle.
unsafe impl Send for SdpaPlan {}

/// The finalized SDPA forward operation of `a`'s shape, in `b`. Needs no GPU (only the
/// graph and its plan do), so a test checks it wherever cuDNN is installed.
fn operation(b: &mut Builder, a: &Sdpa) -> Result<sys::cudnnBackendDescriptor_t, CudaError> {
    let q = b.view(UID_Q, a, &a.q, a.sq)?;
    let k = b.view(UID_K, a, &a.k, a.skv)?;
    let v = b.view(UID_V, a, &a.v, a.skv)?;
    let o = b.view(UID_O, a, &a.o, a.sq)?;
    let f32_t = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    let scale = b.tensor(UID_SCALE, f32_t, [1; 4], [1; 4], true)?;
    let op = b.create(D::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR)?;
    let link = |name, t: sys::cudnnBackendDescriptor_t| {
        Builder::set(op, name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[t])
    };
    link(A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, q)?;
    link(A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, k)?;
    link(A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, v)?;
    link(A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, o)?;
    link(A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, scale)?;
    Builder::finalize(op, "SDPA forward operation")?;
    Ok(op)
}

/// Builds the plan of `a`'s shape on `handle`; an `Unsupported` error says why cuDNN
/// refused it (an older cuDNN without the operation, a shape no engine takes).
pub(crate) fn plan(handle: sys::cudnnHandle_t, a: &Sdpa) -> Result<SdpaPlan, CudaError> {
    let mut b = Builder { descs: Vec::new() };
    let op = operation(&mut b, a)?;
    let graph = b.create(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    Builder::set(
        graph,
        A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &[op],
    )?;
    Builder::set(
        graph,
        A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    Builder::finalize(graph, "operation graph")?;

    let heur = b.create(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    let graph_attr = A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH;
    Builder::set(heur, graph_attr, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[graph])?;
    let mode = sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A;
    Builder::set(
        heur,
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        &[mode],
    )?;
    Builder::finalize(heur, "heuristics")?;
    let mut count = 0i64;
    // SAFETY: asks only for the count.
    check("heuristic results", unsafe {
        sys::cudnnBackendGetAttribute(
            heur,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            0,
            &mut count,
            std::ptr::null_mut(),
        )
    })?;
    let mut cfgs = Vec::with_capacity(count.max(0) as usize);
    for _ in 0..count.max(0) {
        cfgs.push(b.create(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?);
    }
    // SAFETY: `cfgs` holds `count` created engine configuration descriptors to fill.
    check("heuristic results", unsafe {
        sys::cudnnBackendGetAttribute(
            heur,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            cfgs.len() as i64,
            &mut count,
            cfgs.as_mut_ptr() as *mut c_void,
        )
    })?;
    let mut reasons = vec![];
    for &cfg in cfgs.iter().take(count.max(0) as usize) {
        let plan = b.create(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        let built = Builder::set(
            plan,
            A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
            T::CUDNN_TYPE_HANDLE,
            &[handle],
        )
        .and_then(|_| {
            let cfg_attr = A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG;
            Builder::set(plan, cfg_attr, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[cfg])
        })
        .and_then(|_| Builder::finalize(plan, "execution plan"));
        if let Err(e) = built {
            reasons.push(e.to_string());
            continue;
        }
        let mut workspace = 0i64;
        let mut n = 0i64;
        // SAFETY: one INT64.
        check("plan workspace", unsafe {
            sys::cudnnBackendGetAttribute(
                plan,
                A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                T::CUDNN_TYPE_INT64,
                1,
                &mut n,
                &mut workspace as *mut i64 as *mut c_void,
            )
        })?;
        if workspace as usize > WORKSPACE_CAP {
            reasons.push(format!("an engine wants {workspace} bytes of workspace"));
            continue;
        }
        return Ok(SdpaPlan {
            plan,
            workspace: workspace.max(0) as usize,
            _descs: b,
        });
    }
    Err(CudaError::Unsupported(format!(
        "no engine of {} takes it: {}",
        count,
        reasons.join("; ")
    )))
}

impl SdpaPlan {
    /// Runs the plan on `a`'s buffers, on the handle's stream, with `workspace` (at
    /// least [`workspace_bytes`](Self::workspace_bytes)).
    pub(crate) fn run(
        &self,
        handle: sys::cudnnHandle_t,
        stream: &CudaStream,
        a: &Sdpa,
        workspace: Option<&CudaSlice<u8>>,
    ) -> Result<(), CudaError> {
        let scale = 1.0f32 / (a.head_dim as f32).sqrt();
        let ptrs: [*mut c_void; 5] = [
            a.q.addr as *mut c_void,
            a.k.addr as *mut c_void,
            a.v.addr as *mut c_void,
            a.o.addr as *mut c_void,
            &scale as *const f32 as *mut c_void,
        ];
        let uids = [UID_Q, UID_K, UID_V, UID_O, UID_SCALE];
        let ws: *mut c_void = match workspace {
            Some(w) if self.workspace > 0 => w.device_ptr(stream).0 as *mut c_void,
            _ => std::ptr::null_mut(),
        };
        let mut b = Builder { descs: Vec::new() };
        let pack = b.create(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        Builder::set(
            pack,
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            T::CUDNN_TYPE_INT64,
            &uids,
        )?;
        Builder::set(
            pack,
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            T::CUDNN_TYPE_VOID_PTR,
            &ptrs,
        )?;
        Builder::set(
            pack,
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            &[ws],
        )?;
        Builder::finalize(pack, "variant pack")?;
        // SAFETY: the plan was built for this shape; the pointers are live device
        // buffers of it (the backend's) and the scale lives until the call returns
        // (cuDNN reads by-value scalars when the work is enqueued).
        check("cudnnBackendExecute", unsafe {
            sys::cudnnBackendExecute(handle, self.plan, pack)
        })
    }

    pub(crate) fn workspace_bytes(&self) -> usize {
        self.workspace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operation our plans start from finalizes in the installed cuDNN: the
    /// attribute names, types and tensor layouts are what it takes (dense views of
    /// a single block's `[k | v | q | mlp]` buffer, and packed scratch). Needs no GPU;
    /// run with cuDNN's `lib/` on `LD_LIBRARY_PATH` (`.ci/run` installs
    /// `nvidia-cudnn-cu13` for it).
    #[test]
    fn the_sdpa_operation_finalizes_where_cudnn_is_installed() {
        if let Err(why) = super::super::library() {
            denoised_runtime::skip::skip(
                "denoised-cuda cudnn::sdpa::the_sdpa_operation_finalizes_where_cudnn_is_installed",
                denoised_runtime::skip::Need::Tool,
                &why,
            );
            return;
        }
        let (heads, hd) = (24, 128);
        let cols = 7 * heads * hd;
        let view = |col: usize, rows: usize| Strided {
            addr: (1 << 20) + 2 * col as u64,
            strides: [rows * cols, hd, cols],
        };
        let dense = Sdpa {
            batch: 1,
            heads,
            sq: 4608,
            skv: 4608,
            head_dim: hd,
            q: view(2 * heads * hd, 4608),
            k: view(0, 4608),
            v: view(heads * hd, 4608),
            o: view(2 * heads * hd, 4608),
        };
        let none = crate::sdpa::Scratch { q: 0, kv: 0, o: 0 };
        let packed = crate::sdpa::packed(none, 640, 4608, heads, hd);
        for a in [dense, packed] {
            let mut b = Builder { descs: Vec::new() };
            operation(&mut b, &a).unwrap_or_else(|e| panic!("{a:?}: {e}"));
        }
    }
}
