//! Host memory as the GPU backend sees it: regions page-locked once, and stores (device
//! to host copies) queued on the copy stream.
//!
//! A GPU copies page-locked memory asynchronously at link speed; pageable memory goes
//! through a small driver bounce buffer and blocks the calling thread. The denoise
//! worker's host memory is a handful of large mappings (its own shared-memory arena,
//! the cache process's, anonymous regions), so each is registered whole on first use
//! ([`HostIo::pin`]) and every later copy of any slice of it is asynchronous. A region
//! whose registration fails (a driver without read-only registration, a memlock
//! limit) is still used: its copies are then synchronous, which is slower but correct,
//! and logged once.
//!
//! A store keeps its source allocation alive until the copy stream is past it: device
//! frees are ordered on the compute stream, which does not wait for the copy stream.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use denoised_runtime::{HostMemory, HostSlice, Result};

use crate::backend::dev;
use crate::exec::{Exec, Stream};

pub(crate) struct HostIo<E: Exec> {
    pinned: Mutex<Vec<Region<E>>>,
    pending: Mutex<VecDeque<Pending<E>>>,
}

/// A store not known to be done: its source, and the copy stream's event after it.
type Pending<E> = (Arc<<E as Exec>::Mem>, <E as Exec>::Event);

struct Region<E: Exec> {
    mem: Arc<dyn HostMemory>,
    /// `None` when registration failed (copies from it are synchronous).
    pinned: Option<E::Pinned>,
}

impl<E: Exec> HostIo<E> {
    pub fn new() -> Self {
        HostIo {
            pinned: Mutex::new(Vec::new()),
            pending: Mutex::new(VecDeque::new()),
        }
    }

    /// Registers `mem` unless it is already. Regions nobody else holds any more (a
    /// peer's arena replaced after its restart) are unregistered here.
    pub fn pin(&self, exec: &E, mem: &Arc<dyn HostMemory>) -> Result<()> {
        let mut pinned = self.pinned.lock().unwrap();
        if pinned.iter().any(|r| r.mem.base() == mem.base()) {
            return Ok(());
        }
        pinned.retain(|r| Arc::strong_count(&r.mem) > 1);
        // SAFETY: the region stays mapped while `mem` lives, and the registration is
        // dropped together with the Arc that keeps it.
        let reg = unsafe { exec.register(mem.base(), mem.len(), !mem.writable()) };
        let reg = match reg {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(
                    "cannot page-lock {} MB of host memory ({e}); copies from it will be synchronous",
                    mem.len() >> 20
                );
                None
            }
        };
        pinned.push(Region {
            mem: mem.clone(),
            pinned: reg,
        });
        Ok(())
    }

    /// Whether `len` bytes at `ptr` lie in a registered region.
    pub fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        let (a, pinned) = (ptr as usize, self.pinned.lock().unwrap());
        pinned.iter().any(|r| {
            let base = r.mem.base() as usize;
            r.pinned.is_some() && base <= a && a + len <= base + r.mem.len()
        })
    }

    /// Queues a copy of registered host bytes to `dst + offset` on the copy stream, and
    /// makes later compute wait for it.
    ///
    /// # Safety
    /// `src` stays valid and unchanged until the copy is done.
    pub unsafe fn load(&self, exec: &E, dst: &E::Mem, offset: usize, src: &[u8]) -> Result<()> {
        // `dst` comes from the compute stream's pool: the copy waits for its allocation.
        let ready = exec.record(Stream::Compute).map_err(dev)?;
        exec.wait(Stream::Copy, &ready).map_err(dev)?;
        exec.load(dst, offset, src.as_ptr(), src.len())
            .map_err(dev)?;
        let loaded = exec.record(Stream::Copy).map_err(dev)?;
        exec.wait(Stream::Compute, &loaded).map_err(dev)
    }

    /// Queues a copy of `len` bytes at `offset` of `src` into `dst`, behind the compute
    /// work queued so far.
    pub fn store(&self, exec: &E, src: Arc<E::Mem>, offset: usize, dst: &HostSlice) -> Result<()> {
        self.retire(exec)?;
        let ready = exec.record(Stream::Compute).map_err(dev)?;
        exec.wait(Stream::Copy, &ready).map_err(dev)?;
        // SAFETY: the caller checked that `dst` is writable and `len` long; `src`
        // stays alive in `pending` until the event after the copy has passed, and the
        // store contract keeps readers of `dst` away until `flush`.
        unsafe { exec.store(dst.as_ptr(), &src, offset, dst.len()) }.map_err(dev)?;
        let done = exec.record(Stream::Copy).map_err(dev)?;
        self.pending.lock().unwrap().push_back((src, done));
        Ok(())
    }

    /// Drops the sources of the stores that are done.
    fn retire(&self, exec: &E) -> Result<()> {
        let mut pending = self.pending.lock().unwrap();
        while let Some((_, e)) = pending.front() {
            if !exec.is_done(e).map_err(dev)? {
                break;
            }
            pending.pop_front();
        }
        Ok(())
    }

    /// Waits for every queued store.
    pub fn flush(&self, exec: &E) -> Result<()> {
        let mut pending = self.pending.lock().unwrap();
        if let Some((_, e)) = pending.back() {
            exec.sync_event(e).map_err(dev)?;
        }
        pending.clear();
        Ok(())
    }
}
