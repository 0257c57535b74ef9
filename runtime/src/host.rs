//! Host memory that a device copies to and from while it computes: template images
//! (K/V slabs read by edits, written by captures) and the latents handed over at the
//! end of a request.
//!
//! A [`HostMemory`] is a region at a fixed address for its whole life: a shared-memory
//! arena mapped by this process, or an anonymous mapping this process owns
//! ([`OwnedHost`]). Both are page-aligned mappings, so a GPU backend can register a
//! whole region as page-locked once (`Backend::pin_host`) and then copy any slice of it
//! asynchronously on its copy stream, with no staging copy; the CPU reads it in place.
//! A [`HostSlice`] is a window of a region that keeps the region alive.
//!
//! Aliasing contract (as for shared-memory handles, see [`crate::shm`]): a slice has at
//! most one writer at a time (the capture filling it), and nobody reads what is being
//! written until the writer is done (for a device, until its stores are flushed).

use std::sync::Arc;

use crate::error::{Error, Result};

/// A region of host memory at a fixed address, valid while the object lives.
pub trait HostMemory: Send + Sync {
    /// The first byte.
    fn base(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether this process may write the region (a peer's arena is mapped read-only).
    fn writable(&self) -> bool;
}

/// Zero-filled, page-aligned memory owned by this process: an anonymous mapping.
pub struct OwnedHost {
    map: memmap2::MmapMut,
}

impl OwnedHost {
    pub fn new(len: usize) -> Result<Arc<Self>> {
        let map = memmap2::MmapMut::map_anon(len.max(1))
            .map_err(|e| Error::Invalid(format!("cannot map {len} bytes of host memory: {e}")))?;
        Ok(Arc::new(OwnedHost { map }))
    }
}

impl HostMemory for OwnedHost {
    fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn writable(&self) -> bool {
        true
    }
}

/// `len` bytes at `offset` of a region; cheap to clone, keeps the region alive.
#[derive(Clone)]
pub struct HostSlice {
    mem: Arc<dyn HostMemory>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for HostSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSlice")
            .field("base", &self.mem.base())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl HostSlice {
    pub fn new(mem: Arc<dyn HostMemory>, offset: usize, len: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(Error::Invalid(format!(
                "host slice {offset}+{len} outside a region of {} bytes",
                mem.len()
            )));
        }
        Ok(HostSlice { mem, offset, len })
    }

    /// A new zero-filled slice of its own region.
    pub fn zeroed(len: usize) -> Result<Self> {
        let mem: Arc<dyn HostMemory> = OwnedHost::new(len)?;
        Self::new(mem, 0, len)
    }

    /// A slice of its own region holding a copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Result<Self> {
        let s = Self::zeroed(bytes.len())?;
        // SAFETY: a fresh region nobody else has seen.
        unsafe { s.bytes_mut() }.copy_from_slice(bytes);
        Ok(s)
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The region this slice lies in.
    pub fn memory(&self) -> &Arc<dyn HostMemory> {
        &self.mem
    }
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset <= region length (checked in `new`).
        unsafe { self.mem.base().add(self.offset) }
    }
    pub fn writable(&self) -> bool {
        self.mem.writable()
    }

    /// `len` bytes at `offset` of this slice.
    pub fn sub(&self, offset: usize, len: usize) -> Result<HostSlice> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::Invalid(format!(
                "host slice {offset}+{len} outside a slice of {} bytes",
                self.len
            )));
        }
        Self::new(self.mem.clone(), self.offset + offset, len)
    }

    /// The `index`-th 32-bit word of the slice, for atomic access: how processes that
    /// map the same region signal each other (`shm::futex`). Every user of the word must
    /// access it atomically.
    pub fn word(&self, index: usize) -> Result<&std::sync::atomic::AtomicU32> {
        let at = index
            .checked_mul(4)
            .filter(|&at| at + 4 <= self.len)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "word {index} outside a slice of {} bytes",
                    self.len
                ))
            })?;
        // SAFETY: in bounds of a live mapping (checked above; the Arc keeps it), and
        // aligned (checked below); AtomicU32 has u32's layout.
        let p = unsafe { self.as_ptr().add(at) };
        if p as usize % 4 != 0 {
            return Err(Error::Invalid("an unaligned word".into()));
        }
        Ok(unsafe { &*(p as *const std::sync::atomic::AtomicU32) })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: in bounds of a live mapping (checked in `new`; the Arc keeps it);
        // concurrent writers are excluded by the aliasing contract (module docs).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// The region is writable, and the caller is the slice's only user while the
    /// borrow lives (the module's aliasing contract).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        debug_assert!(self.writable());
        std::slice::from_raw_parts_mut(self.as_ptr(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_inside_their_region() {
        let s = HostSlice::copy_of(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!(s.sub(1, 3).unwrap().bytes(), &[2, 3, 4]);
        assert!(s.sub(3, 3).is_err());
        assert!(s.sub(usize::MAX, 2).is_err());
        assert!(s.word(1).is_err(), "5 bytes hold one word");
        s.word(0)
            .unwrap()
            .store(7, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(&s.bytes()[..4], &7u32.to_ne_bytes());
        let page = s.memory().base() as usize;
        assert_eq!(page % 4096, 0, "regions are page-aligned");
    }
}
