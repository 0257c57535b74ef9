//! [`DirectFile`]: reads of large, aligned regions that bypass the OS page cache
//! (`O_DIRECT`), each checksummed as it is copied out.
//!
//! A template streamed from the disk tier is read once per step of an edit, hundreds
//! of MB per step, on the same cores that compute. A buffered read costs the CPU a
//! page-cache fill and a kernel copy, then the checksum reads the data once more.
//! Here the device writes into an aligned staging buffer by DMA, and one pass over it
//! computes the CRC-32 and copies into the destination while each chunk is in cache:
//! about a third of the memory traffic, and no page-cache churn that would evict
//! hotter data. Where the filesystem refuses `O_DIRECT` (tmpfs) or a region is not
//! aligned, reads are buffered, with the same result.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Alignment of offsets and lengths for `O_DIRECT` (a page: every block size divides
/// it).
const ALIGN: usize = 4096;
/// Alignment of the staging buffer: a huge page.
const BUF_ALIGN: usize = 2 << 20;
/// Chunk of the checksum-and-copy pass (fits in L2 with room to spare).
const CHUNK: usize = 256 << 10;

/// A zeroed heap buffer aligned to a huge page.
struct Aligned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain owned allocation.
unsafe impl Send for Aligned {}

impl Aligned {
    fn new(len: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(ALIGN), BUF_ALIGN)
            .map_err(|e| Error::Invalid(format!("staging of {len} bytes: {e}")))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Invalid(format!(
                "cannot allocate {len} bytes of staging"
            )));
        }
        // Huge pages where the kernel offers them: a direct read pins its buffer's
        // pages for the device, 512 times fewer of them.
        // SAFETY: advice on memory this struct owns.
        unsafe { libc::madvise(ptr.cast(), layout.size(), libc::MADV_HUGEPAGE) };
        Ok(Aligned {
            ptr,
            len: layout.size(),
        })
    }
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.len);
        // SAFETY: in bounds of an owned allocation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, BUF_ALIGN).expect("made in new");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

pub struct DirectFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    staging: Mutex<Option<Aligned>>,
}

impl DirectFile {
    pub fn open(path: &Path) -> Result<Self> {
        let buffered = File::open(path).map_err(|e| Error::io(path, e))?;
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        Ok(DirectFile {
            path: path.to_path_buf(),
            buffered,
            direct,
            staging: Mutex::new(None),
        })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Drops the file's pages from the OS page cache (for benchmarks of buffered
    /// reads; direct reads never fill it).
    pub fn drop_page_cache(&self) -> Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: an advisory call on a descriptor this struct owns.
        let rc = unsafe {
            libc::posix_fadvise(self.buffered.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
        };
        if rc != 0 {
            return Err(Error::io(&self.path, std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// Reads `dst.len()` bytes at `offset` and returns their CRC-32.
    pub fn read_crc(&self, offset: u64, dst: &mut [u8]) -> Result<u32> {
        let aligned = offset as usize % ALIGN == 0 && dst.len() % ALIGN == 0;
        if let (Some(direct), true) = (&self.direct, aligned) {
            let mut staging = self.staging.lock().unwrap();
            if staging.as_ref().is_none_or(|s| s.len < dst.len()) {
                *staging = Some(Aligned::new(dst.len())?);
            }
            let buf = staging.as_mut().expect("allocated above").bytes(dst.len());
            match direct.read_exact_at(buf, offset) {
                Ok(()) => {
                    let mut h = crc32fast::Hasher::new();
                    for (s, d) in buf.chunks(CHUNK).zip(dst.chunks_mut(CHUNK)) {
                        h.update(s);
                        d.copy_from_slice(s);
                    }
                    return Ok(h.finalize());
                }
                // Some filesystems accept the flag at open and refuse the read.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(Error::io(&self.path, e)),
            }
        }
        self.buffered
            .read_exact_at(dst, offset)
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(crc32fast::hash(dst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn direct_and_buffered_reads_agree_with_the_file_and_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let data: Vec<u8> = (0..5 * ALIGN + 100).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let f = DirectFile::open(&path).unwrap();
        println!("O_DIRECT here: {}", f.is_direct());
        // Aligned (direct where the filesystem allows it) and unaligned (buffered).
        for (off, len) in [
            (0, 2 * ALIGN),
            (ALIGN, 3 * ALIGN),
            (100, 777),
            (5 * ALIGN, 100),
        ] {
            let mut got = vec![0u8; len];
            let crc = f.read_crc(off as u64, &mut got).unwrap();
            assert_eq!(got, &data[off..off + len], "{off}+{len}");
            assert_eq!(crc, crc32fast::hash(&data[off..off + len]));
        }
        f.drop_page_cache().unwrap();
        let mut past = vec![0u8; ALIGN];
        assert!(
            f.read_crc(5 * ALIGN as u64, &mut past).is_err(),
            "a short read is an error"
        );
    }
}
