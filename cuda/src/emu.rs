//! [`EmuExec`]: the executor that runs the kernel sources on the CPU (see emu/emu.h).
//!
//! "Device memory" is 64-byte-aligned host memory, addresses are host pointers, and a
//! launch runs the named kernel through the emulator. GEMMs are a plain f32 host loop
//! (with bf16 rounding of the result, as cuBLASLt writes bf16). Each GPU thread is
//! a fiber, so it is far slower than a GPU and meant for tests on small shapes.

use std::alloc::{alloc, dealloc, Layout};
#[cfg(denoised_emu)]
use std::ffi::{c_void, CString};

use rayon::prelude::*;

use crate::exec::{Dt, Exec, Gemm, Grid, Result};
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
}

/// Whether this build has the emulator (x86-64 hosts; see build.rs).
pub const AVAILABLE: bool = cfg!(denoised_emu);

/// `sizeof` of the C++ parameter structs, in `params.rs` order.
#[cfg(denoised_emu)]
pub fn param_sizes() -> [usize; 6] {
    let mut out = [0 as std::ffi::c_ulong; 6];
    // SAFETY: writes exactly 6 values.
    unsafe { denoised_emu_param_sizes(out.as_mut_ptr()) };
    out.map(|v| v as usize)
}

#[derive(Default, Debug, Clone)]
pub struct EmuExec;

impl EmuExec {
    /// The emulator, where it is built (x86-64 hosts: its fibers switch in assembly).
    pub fn open() -> Result<Self> {
        if cfg!(denoised_emu) {
            Ok(EmuExec)
        } else {
            Err(CudaError::NoDevice(
                "the CUDA emulator is built on x86-64 hosts only".into(),
            ))
        }
    }
}

pub struct EmuMem {
    ptr: *mut u8,
    layout: Layout,
}
// SAFETY: the allocation is owned; kernels and copies address it only through the
// executor, which callers order (as on a GPU stream).
unsafe impl Send for EmuMem {}
unsafe impl Sync for EmuMem {}
impl Drop for EmuMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `alloc`.
        unsafe { dealloc(self.ptr, self.layout) }
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

fn load_rounded(dt: Dt, v: f32) -> f32 {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

impl Exec for EmuExec {
    type Mem = EmuMem;
    type Host = Vec<u8>;
    /// One stream in effect: every operation completes before the call returns.
    type Event = ();

    fn describe(&self) -> String {
        "cuda-emulator (the kernels on CPU fibers)".into()
    }
    fn alloc(&self, bytes: usize) -> Result<EmuMem> {
        let layout = Layout::from_size_align(bytes.max(64), 64)
            .map_err(|e| CudaError::Driver(format!("bad allocation of {bytes} bytes: {e}")))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return Err(CudaError::Driver(format!(
                "out of memory allocating {bytes} bytes"
            )));
        }
        // Device memory starts undefined; all-ones bytes are NaN in f32 and bf16, so an
        // op that leaves part of its output unwritten fails the tests loudly.
        // SAFETY: the allocation holds layout.size() bytes.
        unsafe { std::ptr::write_bytes(ptr, 0xff, layout.size()) };
        Ok(EmuMem { ptr, layout })
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
        let out = g.out as usize;
        let rows: Vec<Vec<f32>> = (0..g.n)
            .into_par_iter()
            .map(|r| {
                (0..g.m)
                    .map(|c| {
                        let mut acc = 0f32;
                        for i in 0..g.k {
                            acc += load(g.dt, g.x, r * g.ldx + i) * load(g.dt, g.w, c * g.k + i);
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
                let i = r * g.m + c;
                // SAFETY: out holds n*m elements of dt (checked by the backend).
                unsafe {
                    match g.dt {
                        Dt::F32 => *(out as *mut f32).add(i) = v,
                        Dt::Bf16 => *(out as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
                    }
                }
            }
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn alloc_host(&self, bytes: usize) -> Result<Vec<u8>> {
        Ok(vec![0; bytes])
    }
    fn host_bytes<'a>(&self, h: &'a mut Vec<u8>) -> Result<&'a mut [u8]> {
        Ok(h)
    }
    fn load(&self, dst: &EmuMem, src: &Vec<u8>, src_offset: usize, len: usize) -> Result<()> {
        self.upload(dst, 0, &src[src_offset..src_offset + len])
    }
    fn record(&self, _: crate::exec::Stream) -> Result<()> {
        Ok(())
    }
    fn wait(&self, _: crate::exec::Stream, _: &()) -> Result<()> {
        Ok(())
    }
}
