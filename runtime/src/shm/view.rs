//! [`ArenaView`]: a mapping of an arena in any process; reads and writes slices
//! through handles after checking them against the slot table.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, Ordering};

use half::{bf16, f16};
use memmap2::{MmapOptions, MmapRaw};

use super::layout::{Header, HEADER_SIZE, HEADER_WORDS, SLOT_SIZE, S_GEN, S_LEN, S_OFF};
use super::{arena_path, check_name, check_namespace, Handle, Result, ShmError, ALIGN};
use crate::host::{HostMemory, HostSlice};
use crate::tensor::{DType, Tensor};

/// A mapping of an arena: read (and, if attached read-write, write) slices via handles.
///
/// Obtained with [`ArenaView::attach`] / [`ArenaView::attach_rw`] in any process; the
/// owner's [`Arena`](super::Arena) derefs to its own (read-write) view. Dropping a view
/// only unmaps.
pub struct ArenaView {
    pub(super) name: String,
    pub(super) path: PathBuf,
    pub(super) map: MmapRaw,
    pub(super) writable: bool,
    pub(super) header: Header,
}

impl std::fmt::Debug for ArenaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaView")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("writable", &self.writable)
            .field("header", &self.header)
            .finish()
    }
}

impl ArenaView {
    /// Attach read-only to arena `name` of `namespace` in `dir`.
    pub fn attach(dir: &Path, namespace: &str, name: &str) -> Result<ArenaView> {
        Self::open(dir, namespace, name, false)
    }

    /// Attach read-write (to fill slices the owner allocated for this process).
    pub fn attach_rw(dir: &Path, namespace: &str, name: &str) -> Result<ArenaView> {
        Self::open(dir, namespace, name, true)
    }

    fn open(dir: &Path, namespace: &str, name: &str, writable: bool) -> Result<ArenaView> {
        check_namespace(namespace)?;
        check_name(name)?;
        let path = arena_path(dir, namespace, name);
        let file = match OpenOptions::new().read(true).write(writable).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ShmError::UnknownArena {
                    name: name.to_string(),
                    path,
                })
            }
            Err(e) => return Err(ShmError::io(&path, "open", e)),
        };
        let len = file
            .metadata()
            .map_err(|e| ShmError::io(&path, "stat", e))?
            .len();
        if len < HEADER_SIZE as u64 {
            return Err(ShmError::BadArena {
                path,
                reason: format!("{len} bytes, shorter than the header"),
            });
        }
        let map = map(&file, writable).map_err(|e| ShmError::io(&path, "mmap", e))?;
        let mut words = [0u64; HEADER_WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            *w = word(&map, i * 8).load(Ordering::Acquire);
        }
        let header =
            Header::from_words(&words, map.len() as u64).map_err(|reason| ShmError::BadArena {
                path: path.clone(),
                reason,
            })?;
        Ok(ArenaView {
            name: name.to_string(),
            path,
            map,
            writable,
            header,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Bytes of the data region.
    pub fn capacity(&self) -> u64 {
        self.header.capacity
    }
    pub fn max_slices(&self) -> u32 {
        self.header.slots
    }
    pub fn owner_pid(&self) -> u32 {
        self.header.pid
    }
    pub fn is_writable(&self) -> bool {
        self.writable
    }
    /// Live slices and their bytes, read from the slot table (any process can tell how
    /// much of an arena is in use, e.g. to check that nothing leaks).
    pub fn live(&self) -> (u32, u64) {
        (0..self.header.slots)
            .filter(|&s| self.slot_word(s, S_GEN).load(Ordering::Acquire) != 0)
            .fold((0, 0), |(n, b), s| {
                (n + 1, b + self.slot_word(s, S_LEN).load(Ordering::Relaxed))
            })
    }

    pub(super) fn slot_word(&self, slot: u32, w: usize) -> &AtomicU64 {
        debug_assert!(slot < self.header.slots && w < SLOT_SIZE / 8);
        word(&self.map, HEADER_SIZE + slot as usize * SLOT_SIZE + w * 8)
    }

    /// Current generation of a slot (0 = free).
    fn generation(&self, slot: u32) -> u64 {
        self.slot_word(slot, S_GEN).load(Ordering::Acquire)
    }

    /// Validate a handle against this arena: arena name, dtype/shape/len consistency,
    /// bounds, and that its slot still holds its `(generation, offset, len)`.
    pub fn check(&self, h: &Handle) -> Result<()> {
        if h.arena != self.name {
            return Err(ShmError::WrongArena {
                expected: self.name.clone(),
                got: h.arena.clone(),
            });
        }
        if h.expected_len() != Some(h.len) {
            return Err(self.len_mismatch(
                h,
                format!(
                    "dtype and shape need {} bytes",
                    h.expected_len()
                        .map_or("more than u64::MAX".into(), |n| n.to_string())
                ),
            ));
        }
        let cap = self.header.capacity;
        if h.slot >= self.header.slots
            || h.offset % ALIGN != 0
            || h.offset.checked_add(h.len).is_none_or(|end| end > cap)
        {
            return Err(ShmError::OutOfBounds {
                arena: self.name.clone(),
                offset: h.offset,
                len: h.len,
                slot: h.slot,
                capacity: cap,
                slots: self.header.slots,
            });
        }
        let current = self.generation(h.slot);
        let off = self.slot_word(h.slot, S_OFF).load(Ordering::Relaxed);
        let len = self.slot_word(h.slot, S_LEN).load(Ordering::Relaxed);
        if current != h.generation || off != h.offset || len != h.len || current == 0 {
            return Err(self.stale(h, current));
        }
        Ok(())
    }

    /// Whether the handle is valid now (see [`check`](Self::check)).
    pub fn is_live(&self, h: &Handle) -> bool {
        self.check(h).is_ok()
    }

    /// Where a slice lies in this mapping, as a [`HostSlice`] that keeps the mapping
    /// alive: how a device reads a template in place (or a capture writes one) without
    /// a copy. The handle is checked now; the aliasing contract of the module docs
    /// holds for the slice as for the handle.
    pub fn host_slice(self: &std::sync::Arc<Self>, h: &Handle) -> Result<HostSlice> {
        self.check(h)?;
        let at = self.header.data_off as usize + h.offset as usize;
        let mem: std::sync::Arc<dyn HostMemory> = self.clone();
        HostSlice::new(mem, at, h.len as usize).map_err(|e| self.len_mismatch(h, e.to_string()))
    }

    /// Zero-copy borrow of a slice's bytes. See the module docs for the aliasing
    /// contract: the slice must not be freed or written while the borrow is held.
    pub fn slice_bytes(&self, h: &Handle) -> Result<&[u8]> {
        self.check(h)?;
        // SAFETY: check() proved offset + len <= capacity, so the range lies inside the
        // mapping, which lives as long as &self. Concurrent mutation is excluded by the
        // handle protocol (module docs); any bit pattern is a valid u8.
        Ok(unsafe { std::slice::from_raw_parts(self.data_ptr(h), h.len as usize) })
    }

    /// Zero-copy borrow of an F32 slice as `&[f32]` (same contract as
    /// [`slice_bytes`](Self::slice_bytes)).
    pub fn slice_f32(&self, h: &Handle) -> Result<&[f32]> {
        self.check(h)?;
        self.want_dtype(h, DType::F32)?;
        // SAFETY: as in slice_bytes; the pointer is 64-byte aligned (page-aligned data
        // region + ALIGN-multiple offset) and len is numel * 4; every bit pattern is a
        // valid f32.
        Ok(unsafe {
            std::slice::from_raw_parts(self.data_ptr(h) as *const f32, h.len as usize / 4)
        })
    }

    /// Copy a byte slice out (any dtype: the raw bytes). Like
    /// [`read_tensor`](Self::read_tensor), the generation is re-checked after the copy.
    pub fn read_bytes(&self, h: &Handle) -> Result<Vec<u8>> {
        let out = self.slice_bytes(h)?.to_vec();
        fence(Ordering::Acquire);
        let current = self.generation(h.slot);
        if current != h.generation {
            return Err(self.stale(h, current));
        }
        Ok(out)
    }

    /// Copy a slice out into a host tensor, converting BF16/F16 to f32. The generation is
    /// checked again after the copy, so a concurrent free or reuse is reported as
    /// [`ShmError::StaleHandle`] instead of returning torn data.
    pub fn read_tensor(&self, h: &Handle) -> Result<Tensor> {
        self.check(h)?;
        let numel = h.len as usize / h.dtype.size_bytes();
        let ptr = self.data_ptr(h);
        // SAFETY: as in slice_f32; the u16 views are 2-byte aligned.
        let data: Vec<f32> = unsafe {
            match h.dtype {
                DType::F32 => std::slice::from_raw_parts(ptr as *const f32, numel).to_vec(),
                DType::BF16 => std::slice::from_raw_parts(ptr as *const u16, numel)
                    .iter()
                    .map(|&b| bf16::from_bits(b).to_f32())
                    .collect(),
                DType::F16 => std::slice::from_raw_parts(ptr as *const u16, numel)
                    .iter()
                    .map(|&b| f16::from_bits(b).to_f32())
                    .collect(),
                DType::U8 => std::slice::from_raw_parts(ptr, numel)
                    .iter()
                    .map(|&b| b as f32)
                    .collect(),
                // Unscaled elements (scales travel beside fp8 data, never in a view).
                DType::F8E4M3 => std::slice::from_raw_parts(ptr, numel)
                    .iter()
                    .map(|&b| crate::fp8::DECODE[b as usize])
                    .collect(),
            }
        };
        fence(Ordering::Acquire);
        let current = self.generation(h.slot);
        if current != h.generation {
            return Err(self.stale(h, current));
        }
        Tensor::new(h.shape.clone(), data).map_err(|e| self.len_mismatch(h, e.to_string()))
    }

    /// Mutable zero-copy borrow of an F32 slice (read-write views and the owner only).
    pub fn slice_f32_mut(&mut self, h: &Handle) -> Result<&mut [f32]> {
        // SAFETY: &mut self excludes other borrows of this view.
        unsafe { self.slice_f32_mut_shared(h) }
    }

    /// [`slice_f32_mut`](Self::slice_f32_mut) through a shared view.
    ///
    /// # Safety
    /// The caller holds the slice exclusively (the owner's `&mut Arena`, which also
    /// shares its view with [`HostSlice`]s of other slices).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_f32_mut_shared(&self, h: &Handle) -> Result<&mut [f32]> {
        self.want_writable()?;
        self.check(h)?;
        self.want_dtype(h, DType::F32)?;
        // SAFETY: as in slice_f32; the mapping is writable and &mut self prevents other
        // borrows of this view; other processes are excluded by the handle protocol.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.data_ptr(h) as *mut f32, h.len as usize / 4)
        })
    }

    /// Copy `data` into an F32 slice; `data.len()` must equal the handle's element count.
    pub fn write_f32(&mut self, h: &Handle, data: &[f32]) -> Result<()> {
        // SAFETY: &mut self excludes other borrows of this view.
        unsafe { self.write_f32_shared(h, data) }
    }

    /// # Safety
    /// As [`slice_f32_mut_shared`](Self::slice_f32_mut_shared).
    pub(super) unsafe fn write_f32_shared(&self, h: &Handle, data: &[f32]) -> Result<()> {
        let n = h.len as usize / 4;
        if self.check(h).is_ok() && h.dtype == DType::F32 && data.len() != n {
            return Err(self.len_mismatch(h, format!("{} f32 values supplied", data.len())));
        }
        self.slice_f32_mut_shared(h)?.copy_from_slice(data);
        Ok(())
    }

    /// Copy a tensor into the slice, converting to the handle's dtype. The tensor's shape
    /// must equal the handle's shape.
    pub fn write_tensor_into(&mut self, h: &Handle, t: &Tensor) -> Result<()> {
        // SAFETY: &mut self excludes other borrows of this view.
        unsafe { self.write_tensor_into_shared(h, t) }
    }

    /// # Safety
    /// As [`slice_f32_mut_shared`](Self::slice_f32_mut_shared).
    pub(super) unsafe fn write_tensor_into_shared(&self, h: &Handle, t: &Tensor) -> Result<()> {
        self.want_writable()?;
        self.check(h)?;
        if t.shape() != h.shape.as_slice() {
            return Err(self.len_mismatch(h, format!("tensor has shape {:?}", t.shape())));
        }
        let ptr = self.data_ptr(h) as *mut u8;
        let src = t.data();
        // SAFETY: as in slice_f32_mut; numel elements of the handle's dtype fit in len.
        unsafe {
            match h.dtype {
                DType::F32 => {
                    std::slice::from_raw_parts_mut(ptr as *mut f32, src.len()).copy_from_slice(src)
                }
                DType::BF16 => {
                    let dst = std::slice::from_raw_parts_mut(ptr as *mut u16, src.len());
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = bf16::from_f32(s).to_bits();
                    }
                }
                DType::F16 => {
                    let dst = std::slice::from_raw_parts_mut(ptr as *mut u16, src.len());
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = f16::from_f32(s).to_bits();
                    }
                }
                DType::U8 => {
                    let dst = std::slice::from_raw_parts_mut(ptr, src.len());
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = s.round().clamp(0.0, 255.0) as u8;
                    }
                }
                DType::F8E4M3 => {
                    let dst = std::slice::from_raw_parts_mut(ptr, src.len());
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = crate::fp8::encode(s);
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) fn data_ptr(&self, h: &Handle) -> *const u8 {
        // SAFETY: callers have validated h (offset + len <= capacity) and the header
        // guarantees data_off + capacity <= the mapping length.
        unsafe {
            self.map
                .as_ptr()
                .add(self.header.data_off as usize + h.offset as usize)
        }
    }

    fn want_writable(&self) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(ShmError::ReadOnly {
                arena: self.name.clone(),
            })
        }
    }

    fn want_dtype(&self, h: &Handle, expected: DType) -> Result<()> {
        if h.dtype == expected {
            Ok(())
        } else {
            Err(ShmError::DTypeMismatch {
                arena: self.name.clone(),
                expected,
                actual: h.dtype,
            })
        }
    }

    fn stale(&self, h: &Handle, current: u64) -> ShmError {
        ShmError::StaleHandle {
            arena: self.name.clone(),
            slot: h.slot,
            offset: h.offset,
            generation: h.generation,
            current,
        }
    }

    fn len_mismatch(&self, h: &Handle, reason: String) -> ShmError {
        ShmError::LenMismatch {
            arena: self.name.clone(),
            len: h.len,
            dtype: h.dtype,
            shape: h.shape.clone(),
            reason,
        }
    }
}

pub(super) fn map(file: &File, writable: bool) -> std::io::Result<MmapRaw> {
    if writable {
        MmapOptions::new().map_raw(file)
    } else {
        MmapOptions::new().map_raw_read_only(file)
    }
}

/// The `u64` word at byte offset `off` of the mapping, as an atomic.
fn word(map: &MmapRaw, off: usize) -> &AtomicU64 {
    assert!(
        off % 8 == 0 && off + 8 <= map.len(),
        "word {off} outside mapping"
    );
    // SAFETY: in bounds (asserted) and 8-byte aligned (the mapping is page-aligned).
    // AtomicU64 has the layout of u64; the memory is shared with other processes, which
    // access these words only atomically. On a read-only mapping only loads happen.
    unsafe { &*(map.as_ptr().add(off) as *const AtomicU64) }
}

impl HostMemory for ArenaView {
    fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn writable(&self) -> bool {
        self.writable
    }
}
