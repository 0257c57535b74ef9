//! [`Arena`]: the owner of an arena; creates the file, allocates and frees slices.

use std::fs::OpenOptions;
use std::io::Write;
use std::mem::ManuallyDrop;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};

use memmap2::MmapRaw;

use super::alloc::FreeList;
use super::layout::{self, Header, HEADER_SIZE, S_GEN, S_LEN, S_OFF};
use super::view::{map, ArenaView};
use super::{
    arena_path, byte_len, check_name, check_namespace, owner_alive, Handle, Result, ShmError,
    ALIGN, DEFAULT_MAX_SLICES,
};
use crate::tensor::{DType, Tensor};

/// Sizing of a new arena.
#[derive(Clone, Copy, Debug)]
pub struct ArenaOptions {
    /// Bytes available for slices (rounded up to [`ALIGN`]).
    pub capacity: u64,
    /// Slots: how many slices may be live at once.
    pub max_slices: u32,
}

impl ArenaOptions {
    pub fn new(capacity: u64) -> Self {
        ArenaOptions {
            capacity,
            max_slices: DEFAULT_MAX_SLICES,
        }
    }
}

/// The owner of an arena: allocates and frees slices. Derefs to its [`ArenaView`] for
/// reading; writing goes through the owner's own methods.
///
/// Dropping the owner unmaps and removes the file (only if the file at the path is still
/// this incarnation).
pub struct Arena {
    /// Shared so that a [`HostSlice`](crate::HostSlice) of a slice (a device reading
    /// or writing it in place) keeps the mapping alive; the file goes with the arena.
    view: ManuallyDrop<std::sync::Arc<ArenaView>>,
    alloc: FreeList,
    free_slots: Vec<u32>,
    next_gen: u64,
    torn_down: bool,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("view", &*self.view)
            .field("free_bytes", &self.alloc.free_bytes())
            .field("live_slices", &self.live_slices())
            .finish()
    }
}

impl std::ops::Deref for Arena {
    type Target = ArenaView;
    fn deref(&self) -> &ArenaView {
        &self.view
    }
}

impl Arena {
    /// This arena's own mapping, shared (see [`ArenaView::host_slice`]).
    pub fn shared_view(&self) -> std::sync::Arc<ArenaView> {
        std::sync::Arc::clone(&self.view)
    }
}

impl Arena {
    /// Create arena `name` in `namespace` under `dir` with `capacity` bytes for slices
    /// and [`DEFAULT_MAX_SLICES`] slots.
    pub fn create(dir: &Path, namespace: &str, name: &str, capacity: u64) -> Result<Arena> {
        Self::create_with(dir, namespace, name, ArenaOptions::new(capacity))
    }

    /// Create an arena. The file is built under a temporary name (`….tmp<pid>`), fully
    /// written (so a full `/dev/shm` fails here with ENOSPC, not later with SIGBUS) and
    /// renamed into place, so attachers never see a half-written header. An existing
    /// arena of the same name is replaced only if its owner is dead; a live owner
    /// (including this process) gives [`ShmError::InUse`].
    pub fn create_with(
        dir: &Path,
        namespace: &str,
        name: &str,
        opts: ArenaOptions,
    ) -> Result<Arena> {
        check_namespace(namespace)?;
        check_name(name)?;
        if opts.capacity == 0 || opts.max_slices == 0 {
            return Err(ShmError::Invalid(format!(
                "arena `{name}`: capacity ({}) and max_slices ({}) must be positive",
                opts.capacity, opts.max_slices
            )));
        }
        let capacity = opts
            .capacity
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| ShmError::Invalid(format!("capacity {} too large", opts.capacity)))?;
        let data_off = Header::data_off_for(opts.max_slices);
        let file_len = data_off
            .checked_add(capacity)
            .filter(|&l| usize::try_from(l).is_ok())
            .ok_or_else(|| ShmError::Invalid(format!("capacity {capacity} too large")))?;
        std::fs::create_dir_all(dir).map_err(|e| ShmError::io(dir, "create directory", e))?;

        let path = arena_path(dir, namespace, name);
        if let Ok(Ok(old)) = Header::read_file(&path) {
            if owner_alive(old.pid, old.start_time) {
                return Err(ShmError::InUse { path, pid: old.pid });
            }
        }
        let header = Header {
            pid: std::process::id(),
            start_time: layout::self_start_time(),
            nonce: layout::fresh_nonce(),
            capacity,
            slots: opts.max_slices,
            data_off,
            file_len,
        };
        let tmp = dir.join(format!(
            "{}.tmp{}",
            path.file_name().unwrap().to_string_lossy(),
            header.pid
        ));
        let built = build_file(&tmp, &header);
        let map = match built {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &path) {
            drop(map);
            let _ = std::fs::remove_file(&tmp);
            return Err(ShmError::io(&path, "rename into place", e));
        }
        Ok(Arena {
            view: ManuallyDrop::new(std::sync::Arc::new(ArenaView {
                name: name.to_string(),
                path,
                map,
                writable: true,
                header,
            })),
            alloc: FreeList::new(capacity),
            free_slots: (0..opts.max_slices).rev().collect(),
            // Seeded with the time so that generations are never reused, not even by a
            // later incarnation of this arena name.
            next_gen: layout::now_nanos().max(1),
            torn_down: false,
        })
    }

    /// Allocate a slice for `shape` elements of `dtype`. Its contents are unspecified
    /// (whatever a previous slice left there).
    pub fn alloc(&mut self, dtype: DType, shape: &[usize]) -> Result<Handle> {
        let len = byte_len(dtype, shape).ok_or_else(|| ShmError::LenMismatch {
            arena: self.view.name.clone(),
            len: u64::MAX,
            dtype,
            shape: shape.to_vec(),
            reason: "byte length overflows u64".into(),
        })?;
        let Some(&slot) = self.free_slots.last() else {
            return Err(ShmError::TooManySlices {
                arena: self.view.name.clone(),
                max: self.view.header.slots,
            });
        };
        let Some(offset) = self.alloc.alloc(len) else {
            return Err(ShmError::OutOfSpace {
                arena: self.view.name.clone(),
                requested: len,
                rounded: FreeList::block_size(len).unwrap_or(u64::MAX),
                free: self.alloc.free_bytes(),
                largest: self.alloc.largest_free(),
                capacity: self.alloc.capacity(),
            });
        };
        self.free_slots.pop();
        let generation = self.next_gen;
        self.next_gen += 1;
        let v = &*self.view;
        v.slot_word(slot, S_OFF).store(offset, Ordering::Relaxed);
        v.slot_word(slot, S_LEN).store(len, Ordering::Relaxed);
        v.slot_word(slot, S_GEN)
            .store(generation, Ordering::Release);
        Ok(Handle {
            arena: v.name.clone(),
            slot,
            offset,
            len,
            dtype,
            shape: shape.to_vec(),
            generation,
        })
    }

    /// Allocate an F32 slice and copy the tensor in.
    pub fn write_tensor(&mut self, t: &Tensor) -> Result<Handle> {
        self.write_tensor_as(t, DType::F32)
    }

    /// Allocate a slice of `dtype` and copy the tensor in, converting (BF16/F16 halve the
    /// bytes moved; [`ArenaView::read_tensor`] converts back to f32).
    pub fn write_tensor_as(&mut self, t: &Tensor, dtype: DType) -> Result<Handle> {
        let h = self.alloc(dtype, t.shape())?;
        // SAFETY: the slice was just allocated; &mut self is the only allocator.
        if let Err(e) = unsafe { self.view.write_tensor_into_shared(&h, t) } {
            let _ = self.free(&h);
            return Err(e);
        }
        Ok(h)
    }

    /// Allocate a `U8` slice of shape `[bytes.len()]` and copy the bytes in (images,
    /// encoded files).
    pub fn write_bytes(&mut self, bytes: &[u8]) -> Result<Handle> {
        let h = self.alloc(DType::U8, &[bytes.len()])?;
        let dst = self.view.data_ptr(&h) as *mut u8;
        // SAFETY: alloc just reserved h.len == bytes.len() bytes at this offset inside
        // the owner's writable mapping; nobody else has the handle yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        Ok(h)
    }

    /// See [`ArenaView::write_f32`].
    pub fn write_f32(&mut self, h: &Handle, data: &[f32]) -> Result<()> {
        // SAFETY: &mut self is the owner; slices are used under the handle protocol.
        unsafe { self.view.write_f32_shared(h, data) }
    }

    /// See [`ArenaView::write_tensor_into`].
    pub fn write_tensor_into(&mut self, h: &Handle, t: &Tensor) -> Result<()> {
        // SAFETY: as in write_f32.
        unsafe { self.view.write_tensor_into_shared(h, t) }
    }

    /// See [`ArenaView::slice_f32_mut`].
    pub fn slice_f32_mut(&mut self, h: &Handle) -> Result<&mut [f32]> {
        // SAFETY: as in write_f32.
        unsafe { self.view.slice_f32_mut_shared(h) }
    }

    /// Free a slice. The handle (and every copy of it, in any process) becomes stale:
    /// the slot's generation is cleared before the space returns to the free list.
    /// Freeing twice gives [`ShmError::StaleHandle`].
    pub fn free(&mut self, h: &Handle) -> Result<()> {
        self.view.check(h)?;
        self.view
            .slot_word(h.slot, S_GEN)
            .store(0, Ordering::Release);
        fence(Ordering::SeqCst);
        self.alloc
            .free(h.offset, h.len)
            .map_err(|reason| ShmError::BadArena {
                path: self.view.path.clone(),
                reason: format!("allocator inconsistency freeing slot {}: {reason}", h.slot),
            })?;
        self.free_slots.push(h.slot);
        Ok(())
    }

    /// Frees every live slice (e.g. all those lent to a client that is gone); returns
    /// how many. Every handle to them becomes stale, as with [`Arena::free`].
    pub fn free_all(&mut self) -> Result<u32> {
        let mut n = 0;
        for slot in 0..self.view.header.slots {
            let v = &*self.view;
            if v.slot_word(slot, S_GEN).load(Ordering::Acquire) == 0 {
                continue;
            }
            let (offset, len) = (
                v.slot_word(slot, S_OFF).load(Ordering::Relaxed),
                v.slot_word(slot, S_LEN).load(Ordering::Relaxed),
            );
            v.slot_word(slot, S_GEN).store(0, Ordering::Release);
            fence(Ordering::SeqCst);
            self.alloc
                .free(offset, len)
                .map_err(|reason| ShmError::BadArena {
                    path: self.view.path.clone(),
                    reason: format!("allocator inconsistency freeing slot {slot}: {reason}"),
                })?;
            self.free_slots.push(slot);
            n += 1;
        }
        Ok(n)
    }

    /// Bytes not allocated (across all free blocks).
    pub fn free_bytes(&self) -> u64 {
        self.alloc.free_bytes()
    }
    /// Bytes allocated, including alignment padding.
    pub fn used_bytes(&self) -> u64 {
        self.alloc.capacity() - self.alloc.free_bytes()
    }
    /// The largest single allocation that would succeed now.
    pub fn largest_free(&self) -> u64 {
        self.alloc.largest_free()
    }
    pub fn live_slices(&self) -> u32 {
        self.view.header.slots - self.free_slots.len() as u32
    }

    /// Unmap and remove the file now, reporting errors (Drop does the same silently).
    pub fn destroy(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        let path = self.view.path.clone();
        let nonce = self.view.header.nonce;
        // SAFETY: torn_down guarantees this runs once, and nothing uses view afterwards
        // (Drop calls teardown, destroy consumes self).
        unsafe { ManuallyDrop::drop(&mut self.view) };
        match Header::read_file(&path) {
            Ok(Ok(h)) if h.nonce == nonce => {
                std::fs::remove_file(&path).map_err(|e| ShmError::io(&path, "remove", e))
            }
            // Replaced by another incarnation or already removed: not ours to delete.
            _ => Ok(()),
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}

/// Write the whole file (header, zeroed slots and data) and map it read-write.
/// Makes the file `len` bytes long with every page allocated, so that a full
/// filesystem fails here and not later, with SIGBUS, on a write to the mapping.
/// `posix_fallocate` does it without copying (tmpfs supports it; 3x faster than
/// writing zeros for a 1 GiB arena, which is most of a worker's restart time);
/// filesystems without it get zeros written.
fn reserve(file: &mut std::fs::File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    // SAFETY: a plain syscall on an open file descriptor we own.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) } {
        0 => return Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => {}
        e => return Err(std::io::Error::from_raw_os_error(e)),
    }
    let zeros = vec![0u8; 1 << 20];
    let mut left = len - HEADER_SIZE as u64;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    Ok(())
}

fn build_file(tmp: &Path, header: &Header) -> Result<MmapRaw> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(tmp)
        .map_err(|e| ShmError::io(tmp, "create", e))?;
    let mut first = vec![0u8; HEADER_SIZE];
    for (i, w) in header.words().iter().enumerate() {
        first[i * 8..i * 8 + 8].copy_from_slice(&w.to_ne_bytes());
    }
    file.write_all(&first)
        .map_err(|e| ShmError::io(tmp, "write header", e))?;
    reserve(&mut file, header.file_len).map_err(|e| {
        ShmError::io(
            tmp,
            "reserve space (is the shared-memory filesystem full?)",
            e,
        )
    })?;
    map(&file, true).map_err(|e| ShmError::io(tmp, "mmap", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tensor(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::new(
            shape.to_vec(),
            (0..n).map(|i| seed + i as f32 * 0.5).collect(),
        )
        .unwrap()
    }

    #[test]
    fn write_attach_read_free() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Arena::create(dir.path(), "t", "lat", 1 << 20).unwrap();
        assert!(a.path().exists());
        let t = tensor(&[16, 8], 1.0);
        let h = a.write_tensor(&t).unwrap();
        assert_eq!((h.offset, h.len, h.dtype), (0, 16 * 8 * 4, DType::F32));

        let v = ArenaView::attach(dir.path(), "t", "lat").unwrap();
        assert_eq!(v.owner_pid(), std::process::id());
        assert_eq!(v.read_tensor(&h).unwrap(), t);
        assert_eq!(v.slice_f32(&h).unwrap(), t.data());
        assert_eq!(a.read_tensor(&h).unwrap(), t);

        a.free(&h).unwrap();
        let e = v.read_tensor(&h).unwrap_err();
        assert!(matches!(e, ShmError::StaleHandle { current: 0, .. }), "{e}");
        assert!(matches!(a.free(&h), Err(ShmError::StaleHandle { .. })));

        // the space and slot are reused; the old handle stays stale
        let h2 = a.write_tensor(&tensor(&[16, 8], 9.0)).unwrap();
        assert_eq!((h2.offset, h2.slot), (h.offset, h.slot));
        assert!(h2.generation > h.generation);
        assert!(matches!(v.slice_f32(&h), Err(ShmError::StaleHandle { .. })));
        assert_eq!(v.read_tensor(&h2).unwrap().data()[0], 9.0);

        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists(), "owner drop removes the file");
        // an existing mapping still reads (the memory lives until unmapped)
        assert_eq!(v.read_tensor(&h2).unwrap().data()[0], 9.0);
        assert!(matches!(
            ArenaView::attach(dir.path(), "t", "lat"),
            Err(ShmError::UnknownArena { .. })
        ));
    }

    #[test]
    fn half_precision_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Arena::create(dir.path(), "t", "half", 1 << 16).unwrap();
        let t = tensor(&[3, 5], -2.0);
        for dt in [DType::BF16, DType::F16] {
            let h = a.write_tensor_as(&t, dt).unwrap();
            assert_eq!(h.len, 30);
            let back = a.read_tensor(&h).unwrap();
            assert!(back.max_abs_diff(&t).unwrap() < 0.02, "{dt:?}");
            assert!(matches!(
                a.slice_f32(&h),
                Err(ShmError::DTypeMismatch { .. })
            ));
            a.free(&h).unwrap();
        }
    }

    #[test]
    fn errors_are_specific() {
        let dir = tempfile::tempdir().unwrap();
        let opts = ArenaOptions {
            capacity: 1000,
            max_slices: 2,
        };
        let mut a = Arena::create_with(dir.path(), "t", "small", opts).unwrap();
        assert_eq!(a.capacity(), 1024);

        let e = a.alloc(DType::F32, &[300]).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                ShmError::OutOfSpace {
                    requested: 1200,
                    free: 1024,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("requested 1200") && msg.contains("1024 bytes free"),
            "{msg}"
        );

        let h = a.alloc(DType::F32, &[4]).unwrap();
        let _h2 = a.alloc(DType::F32, &[4]).unwrap();
        assert!(matches!(
            a.alloc(DType::F32, &[1]),
            Err(ShmError::TooManySlices { max: 2, .. })
        ));
        assert!(matches!(
            a.alloc(DType::F32, &[usize::MAX, 4]),
            Err(ShmError::LenMismatch { .. })
        ));

        let mut bad = h.clone();
        bad.arena = "other".into();
        assert!(matches!(a.check(&bad), Err(ShmError::WrongArena { .. })));
        let mut bad = h.clone();
        bad.shape = vec![5];
        assert!(matches!(a.check(&bad), Err(ShmError::LenMismatch { .. })));
        let mut bad = h.clone();
        bad.offset = 1024;
        assert!(matches!(a.check(&bad), Err(ShmError::OutOfBounds { .. })));
        let mut bad = h.clone();
        bad.slot = 2;
        assert!(matches!(a.check(&bad), Err(ShmError::OutOfBounds { .. })));
        let mut bad = h.clone();
        bad.offset = 128; // in bounds, but not what the slot records
        assert!(matches!(a.check(&bad), Err(ShmError::StaleHandle { .. })));
        let mut bad = h.clone();
        bad.generation += 1;
        assert!(matches!(
            a.read_tensor(&bad),
            Err(ShmError::StaleHandle { .. })
        ));

        assert!(matches!(
            a.write_f32(&h, &[1.0; 3]),
            Err(ShmError::LenMismatch { .. })
        ));
        a.write_f32(&h, &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!(matches!(
            a.write_tensor_into(&h, &tensor(&[2, 2], 0.0)),
            Err(ShmError::LenMismatch { .. })
        ));

        let mut ro = ArenaView::attach(dir.path(), "t", "small").unwrap();
        assert!(matches!(
            ro.write_f32(&h, &[0.0; 4]),
            Err(ShmError::ReadOnly { .. })
        ));
        let mut rw = ArenaView::attach_rw(dir.path(), "t", "small").unwrap();
        rw.slice_f32_mut(&h).unwrap()[0] = 42.0;
        assert_eq!(ro.slice_f32(&h).unwrap(), &[42.0, 2.0, 3.0, 4.0]);

        assert!(matches!(
            Arena::create(dir.path(), "t", "small", 64),
            Err(ShmError::InUse { .. })
        ));
        assert!(matches!(
            Arena::create(dir.path(), "t", "x", 0),
            Err(ShmError::Invalid(_))
        ));
        assert!(matches!(
            ArenaView::attach(dir.path(), "t", "nope"),
            Err(ShmError::UnknownArena { .. })
        ));
        std::fs::write(dir.path().join("denoised-t-junk"), b"not an arena").unwrap();
        assert!(matches!(
            ArenaView::attach(dir.path(), "t", "junk"),
            Err(ShmError::BadArena { .. })
        ));
    }

    #[test]
    fn zero_sized_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Arena::create(dir.path(), "t", "z", 256).unwrap();
        let h = a.write_tensor(&Tensor::zeros(vec![0, 4])).unwrap();
        let h2 = a.write_tensor(&Tensor::zeros(vec![0])).unwrap();
        assert_ne!(h.offset, h2.offset);
        assert_eq!(a.read_tensor(&h).unwrap().shape(), &[0, 4]);
        a.free(&h).unwrap();
        a.free(&h2).unwrap();
        assert_eq!(a.largest_free(), 256);
    }

    #[test]
    fn destroy_removes_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "t", "d", 256).unwrap();
        let p = a.path().to_path_buf();
        a.destroy().unwrap();
        assert!(!p.exists());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "no temp files left"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize, bool),
        Free(usize),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Real arena + a second mapping: every live slice keeps its contents whatever is
        /// allocated and freed around it, and every freed handle reads as stale.
        #[test]
        fn arena_contents_and_staleness(ops in prop::collection::vec(
            prop_oneof![
                (0usize..300, any::<bool>()).prop_map(|(n, h)| Op::Alloc(n, h)),
                any::<usize>().prop_map(Op::Free),
            ], 1..80))
        {
            let dir = tempfile::tempdir().unwrap();
            let opts = ArenaOptions { capacity: 4096, max_slices: 12 };
            let mut a = Arena::create_with(dir.path(), "p", "a", opts).unwrap();
            let v = ArenaView::attach(dir.path(), "p", "a").unwrap();
            let mut live: Vec<(Handle, Tensor)> = Vec::new();
            let mut dead: Vec<Handle> = Vec::new();
            for (k, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Alloc(n, half) => {
                        let t = Tensor::new(vec![n], vec![k as f32; n]).unwrap();
                        let dt = if half { DType::BF16 } else { DType::F32 };
                        match a.write_tensor_as(&t, dt) {
                            Ok(h) => live.push((h, t)),
                            Err(ShmError::OutOfSpace { .. }) => {
                                prop_assert!(a.largest_free() < FreeList::block_size((n * dt.size_bytes()) as u64).unwrap());
                            }
                            Err(ShmError::TooManySlices { .. }) => prop_assert_eq!(live.len(), 12),
                            Err(e) => prop_assert!(false, "{}", e),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (h, _) = live.swap_remove(i % live.len());
                        a.free(&h).unwrap();
                        dead.push(h);
                    }
                    Op::Free(_) => {}
                }
                for (h, t) in &live {
                    prop_assert_eq!(&v.read_tensor(h).unwrap(), t);
                }
                for h in &dead {
                    let stale = matches!(v.read_tensor(h), Err(ShmError::StaleHandle { .. }));
                    prop_assert!(stale);
                }
            }
            for (h, _) in live {
                a.free(&h).unwrap();
            }
            prop_assert_eq!(a.largest_free(), 4096);
            prop_assert_eq!(a.live_slices(), 0);
        }
    }
}
