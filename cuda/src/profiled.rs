//! [`Profiled`]: an executor that times every kernel, GEMM, convolution and attention
//! call of another one, for a per-kernel table of a step (`bench step --kernel-table`,
//! the one-shot GPU run's `kernels`) where no profiler is installed: the lent GPU
//! machines have neither Nsight Systems nor a network to fetch it.
//!
//! Each call is bracketed by two timing events of the inner executor (CUDA events on
//! the compute stream on a GPU, the host clock on the emulator, whose calls finish
//! before they return), read when the table is taken. Two events per launch cost a few
//! microseconds of host time each, so a profiled step runs slower than a plain one:
//! the table is for shares, and the step's own time comes from an unprofiled run. The
//! serving path never sees this type: it is a decorator, not a flag in the launch path.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::exec::{Conv, Exec, Gemm, Grid, MemInfo, Result, Sdpa, Stream};
use crate::params::KernelParams;

/// A kernel's (or library call's) time over the profiled calls.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: usize,
    pub ms: f64,
}

pub struct Profiled<E: Exec> {
    inner: E,
    on: std::sync::atomic::AtomicBool,
    calls: Mutex<Vec<Timed<E>>>,
}

/// A timed call: its name and the timing events around it.
type Timed<E> = (&'static str, <E as Exec>::Event, <E as Exec>::Event);

impl<E: Exec> Profiled<E> {
    /// `inner`, not timing until [`start`](Self::start).
    pub fn new(inner: E) -> Self {
        Profiled {
            inner,
            on: false.into(),
            calls: Mutex::new(Vec::new()),
        }
    }

    pub fn inner(&self) -> &E {
        &self.inner
    }

    /// Times every call from now on, forgetting earlier ones.
    pub fn start(&self) {
        self.calls.lock().unwrap().clear();
        self.on.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops timing and returns the calls since [`start`](Self::start) by name, the
    /// most time first (waits for the last of them). GEMMs count as `gemm`, library
    /// convolutions as `conv`, fused attention as `sdpa`.
    pub fn stop(&self) -> Result<Vec<KernelTime>> {
        self.on.store(false, std::sync::atomic::Ordering::SeqCst);
        let calls = std::mem::take(&mut *self.calls.lock().unwrap());
        let mut by: HashMap<&str, (usize, f64)> = HashMap::new();
        for (name, a, b) in &calls {
            let e = by.entry(name).or_default();
            e.0 += 1;
            e.1 += self.inner.elapsed_ms(a, b)?;
        }
        let mut t: Vec<KernelTime> = by
            .into_iter()
            .map(|(name, (calls, ms))| KernelTime {
                name: name.into(),
                calls,
                ms,
            })
            .collect();
        t.sort_by(|a, b| b.ms.total_cmp(&a.ms).then(a.name.cmp(&b.name)));
        Ok(t)
    }

    fn timed<R>(&self, name: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.on.load(std::sync::atomic::Ordering::Relaxed) {
            return f();
        }
        let a = self.inner.timing_event()?;
        let r = f()?;
        if let (Some(a), Some(b)) = (a, self.inner.timing_event()?) {
            self.calls.lock().unwrap().push((name, a, b));
        }
        Ok(r)
    }
}

impl<E: Exec> Exec for Profiled<E> {
    type Mem = E::Mem;
    type Pinned = E::Pinned;
    type Event = E::Event;

    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn is_sticky(&self, message: &str) -> bool {
        self.inner.is_sticky(message)
    }
    fn alloc(&self, bytes: usize) -> Result<Self::Mem> {
        self.inner.alloc(bytes)
    }
    fn addr(&self, m: &Self::Mem) -> u64 {
        self.inner.addr(m)
    }
    fn upload(&self, dst: &Self::Mem, offset: usize, bytes: &[u8]) -> Result<()> {
        self.inner.upload(dst, offset, bytes)
    }
    fn download(&self, src: &Self::Mem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.inner.download(src, offset, out)
    }
    fn launch<P: KernelParams>(&self, name: &'static str, g: Grid, params: &P) -> Result<()> {
        self.timed(name, || self.inner.launch(name, g, params))
    }
    fn gemm(&self, g: &Gemm) -> Result<()> {
        self.timed("gemm", || self.inner.gemm(g))
    }
    fn check_fp8(&self, out: crate::exec::Dt) -> Result<()> {
        self.inner.check_fp8(out)
    }
    fn conv_library(&self) -> Option<String> {
        self.inner.conv_library()
    }
    fn conv(&self, c: &Conv) -> Result<bool> {
        self.timed("conv", || self.inner.conv(c))
    }
    fn attn_library(&self) -> Option<String> {
        self.inner.attn_library()
    }
    fn sdpa_plan(&self, a: &Sdpa) -> Result<bool> {
        self.inner.sdpa_plan(a)
    }
    fn sdpa(&self, a: &Sdpa) -> Result<()> {
        self.timed("sdpa", || self.inner.sdpa(a))
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    unsafe fn register(&self, base: *mut u8, len: usize, read_only: bool) -> Result<Self::Pinned> {
        self.inner.register(base, len, read_only)
    }
    unsafe fn load(
        &self,
        dst: &Self::Mem,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        self.inner.load(dst, offset, src, len)
    }
    unsafe fn store(&self, dst: *mut u8, src: &Self::Mem, offset: usize, len: usize) -> Result<()> {
        self.inner.store(dst, src, offset, len)
    }
    fn is_done(&self, e: &Self::Event) -> Result<bool> {
        self.inner.is_done(e)
    }
    fn sync_event(&self, e: &Self::Event) -> Result<()> {
        self.inner.sync_event(e)
    }
    fn record(&self, on: Stream) -> Result<Self::Event> {
        self.inner.record(on)
    }
    fn wait(&self, on: Stream, e: &Self::Event) -> Result<()> {
        self.inner.wait(on, e)
    }
    fn memory(&self) -> Result<MemInfo> {
        self.inner.memory()
    }
    fn timing_event(&self) -> Result<Option<Self::Event>> {
        self.inner.timing_event()
    }
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f64> {
        self.inner.elapsed_ms(start, end)
    }
}

#[cfg(all(test, target_arch = "x86_64"))] // the emulator (see build.rs)
mod tests {
    use denoised_runtime::{Backend, Tensor};

    use super::*;
    use crate::{Dt, EmuExec, GpuBackend};

    #[test]
    fn a_profile_times_the_calls_between_start_and_stop_by_kernel() {
        let be = GpuBackend::new(Profiled::new(EmuExec::default()), Dt::F32);
        let x = be
            .upload(&Tensor::new([4, 8], vec![0.5; 32]).unwrap())
            .unwrap();
        let w = be
            .upload_weight(&Tensor::new([16, 8], vec![0.25; 128]).unwrap())
            .unwrap();
        be.linear(&x, &w, None).unwrap(); // before start: not counted
        be.exec().start();
        be.linear(&x, &w, None).unwrap();
        be.linear(&x, &w, None).unwrap();
        be.silu(&x).unwrap();
        let table = be.exec().stop().unwrap();
        be.linear(&x, &w, None).unwrap(); // after stop: not counted
        let calls = |name: &str| table.iter().find(|k| k.name == name).map(|k| k.calls);
        assert_eq!(calls("gemm"), Some(2), "{table:?}");
        assert_eq!(calls("silu_f32"), Some(1), "{table:?}");
        assert_eq!(table.len(), 2, "{table:?}");
        assert!(table.iter().all(|k| k.ms >= 0.0));
        assert!(
            table.windows(2).all(|p| p[0].ms >= p[1].ms),
            "most time first"
        );
    }
}
