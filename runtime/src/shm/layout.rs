//! The on-file layout of an arena.
//!
//! ```text
//! [0, 4096)                 header: u64 words, see the W_* constants
//! [4096, 4096 + 32*slots)   slot table: per slot [generation, offset, len, reserved]
//! [data_off, +capacity)     data region, data_off a multiple of 4096
//! ```
//! All words are native-endian `u64` accessed atomically in the mapping (the header is
//! written before the file is renamed into place, so attachers never see it change;
//! slots are written by the owner and read by everyone). Handle offsets are relative to
//! the start of the data region.

use std::io::Read;
use std::path::Path;

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"DNSDSHM\x01");
pub(crate) const VERSION: u64 = 1;
pub(crate) const PAGE: usize = 4096;
pub(crate) const HEADER_SIZE: usize = PAGE;
pub(crate) const SLOT_SIZE: usize = 32;

// Header word indices (byte offset = 8 * index).
pub(crate) const W_MAGIC: usize = 0;
pub(crate) const W_VERSION: usize = 1;
pub(crate) const W_PID: usize = 2;
pub(crate) const W_START: usize = 3;
pub(crate) const W_NONCE: usize = 4;
pub(crate) const W_CAPACITY: usize = 5;
pub(crate) const W_SLOTS: usize = 6;
pub(crate) const W_DATA_OFF: usize = 7;
pub(crate) const W_FILE_LEN: usize = 8;
pub(crate) const HEADER_WORDS: usize = 9;

// Slot word indices.
pub(crate) const S_GEN: usize = 0;
pub(crate) const S_OFF: usize = 1;
pub(crate) const S_LEN: usize = 2;

/// Decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub pid: u32,
    /// Owner's start time in clock ticks since boot (`/proc/<pid>/stat` field 22); 0 when
    /// unknown. Guards against pid reuse.
    pub start_time: u64,
    /// Random-ish id of this incarnation of the arena.
    pub nonce: u64,
    pub capacity: u64,
    pub slots: u32,
    pub data_off: u64,
    pub file_len: u64,
}

impl Header {
    pub(crate) fn data_off_for(slots: u32) -> u64 {
        ((HEADER_SIZE + slots as usize * SLOT_SIZE).next_multiple_of(PAGE)) as u64
    }

    pub(crate) fn words(&self) -> [u64; HEADER_WORDS] {
        let mut w = [0u64; HEADER_WORDS];
        w[W_MAGIC] = MAGIC;
        w[W_VERSION] = VERSION;
        w[W_PID] = self.pid as u64;
        w[W_START] = self.start_time;
        w[W_NONCE] = self.nonce;
        w[W_CAPACITY] = self.capacity;
        w[W_SLOTS] = self.slots as u64;
        w[W_DATA_OFF] = self.data_off;
        w[W_FILE_LEN] = self.file_len;
        w
    }

    /// Decode and validate header words against the actual file length.
    pub(crate) fn from_words(w: &[u64; HEADER_WORDS], actual_len: u64) -> Result<Header, String> {
        if w[W_MAGIC] != MAGIC {
            return Err(format!("bad magic {:#018x}", w[W_MAGIC]));
        }
        if w[W_VERSION] != VERSION {
            return Err(format!(
                "version {} (this build reads {VERSION})",
                w[W_VERSION]
            ));
        }
        let slots = u32::try_from(w[W_SLOTS]).map_err(|_| "slot count too large".to_string())?;
        let h = Header {
            pid: u32::try_from(w[W_PID]).map_err(|_| "bad pid".to_string())?,
            start_time: w[W_START],
            nonce: w[W_NONCE],
            capacity: w[W_CAPACITY],
            slots,
            data_off: w[W_DATA_OFF],
            file_len: w[W_FILE_LEN],
        };
        let end = h.data_off.checked_add(h.capacity);
        if h.data_off != Self::data_off_for(slots)
            || end.is_none_or(|e| e > h.file_len)
            || h.capacity % super::ALIGN != 0
        {
            return Err(format!(
                "inconsistent layout: {slots} slots, data at {} + {} bytes, file length {}",
                h.data_off, h.capacity, h.file_len
            ));
        }
        if actual_len < h.file_len {
            return Err(format!(
                "truncated: header says {} bytes, file has {actual_len}",
                h.file_len
            ));
        }
        Ok(h)
    }

    /// Read the header of an arena file with plain file I/O (no mapping).
    pub(crate) fn read_file(path: &Path) -> std::io::Result<Result<Header, String>> {
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        let mut buf = [0u8; HEADER_WORDS * 8];
        if len < HEADER_SIZE as u64 {
            return Ok(Err(format!("{len} bytes, shorter than the header")));
        }
        f.read_exact(&mut buf)?;
        let mut w = [0u64; HEADER_WORDS];
        for (i, c) in buf.chunks_exact(8).enumerate() {
            w[i] = u64::from_ne_bytes(c.try_into().unwrap());
        }
        Ok(Header::from_words(&w, len))
    }
}

/// `(state, start_time)` of a process from `/proc/<pid>/stat`; Ok(None) if it has no
/// entry there.
pub(crate) fn proc_stat(pid: u32) -> std::io::Result<Option<(char, u64)>> {
    let text = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next()).unwrap_or('?');
    // field 22 overall = index 19 after "pid (comm)"
    let start = fields.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(Some((state, start)))
}

/// This process's start time (0 where `/proc` is unavailable).
pub(crate) fn self_start_time() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        proc_stat(std::process::id())
            .ok()
            .flatten()
            .map_or(0, |(_, s)| s)
    })
}

/// A value that differs between arena incarnations: time, pid and a process counter
/// mixed with splitmix64.
pub(crate) fn fresh_nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = now_nanos();
    let mut z = t
        ^ ((std::process::id() as u64) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(crate) fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_validation() {
        let h = Header {
            pid: 42,
            start_time: 7,
            nonce: 9,
            capacity: 1 << 20,
            slots: 16,
            data_off: Header::data_off_for(16),
            file_len: Header::data_off_for(16) + (1 << 20),
        };
        assert_eq!(h.data_off, 8192);
        assert_eq!(Header::from_words(&h.words(), h.file_len), Ok(h));
        assert!(Header::from_words(&h.words(), h.file_len - 1)
            .unwrap_err()
            .contains("truncated"));
        let mut w = h.words();
        w[W_MAGIC] = 0;
        assert!(Header::from_words(&w, h.file_len)
            .unwrap_err()
            .contains("magic"));
        let mut w = h.words();
        w[W_CAPACITY] = u64::MAX;
        assert!(Header::from_words(&w, h.file_len).is_err());
    }

    #[test]
    fn proc_stat_of_self() {
        if Path::new("/proc/self/stat").exists() {
            let (state, start) = proc_stat(std::process::id()).unwrap().unwrap();
            assert!(state == 'R' || state == 'S', "state {state}");
            assert!(start > 0);
            assert_eq!(self_start_time(), start);
        }
        assert_ne!(fresh_nonce(), fresh_nonce());
    }
}
