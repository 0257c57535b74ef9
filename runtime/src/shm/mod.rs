//! Shared-memory arenas: how bulk tensors travel between the serving processes.
//!
//! docs/design.md: bulk data never travels inside messages. Latents, conditioning tensors,
//! images and cached activations live in arenas (memmap2 over files in `/dev/shm`); a
//! message carries a [`Handle`] (arena, slot, offset, length, dtype, shape, generation).
//!
//! * An [`Arena`] is created by exactly one process, its **owner**. Only the owner
//!   allocates and frees; the allocator state (a best-fit free list with coalescing,
//!   64-byte alignment) lives in the owner's private memory.
//! * Any process may [`ArenaView::attach`] to an arena by name, read-only or read-write,
//!   and read or write the slices that handles point at. The owner's [`Arena`] is itself
//!   an [`ArenaView`] (via `Deref`), so it can read what others wrote.
//! * Every live slice occupies a **slot** in a table inside the arena file. A slot holds
//!   `(generation, offset, len)`; generations come from a per-arena counter seeded with
//!   the creation time in nanoseconds, so a generation is never reused, not even by a
//!   later incarnation of an arena with the same name. Freeing a slice clears its slot;
//!   every access through a handle first checks that the slot still holds the handle's
//!   `(generation, offset, len)`, so a handle to a freed (or freed and reused) slice is
//!   an error ([`ShmError::StaleHandle`]), never silently wrong data. Copies
//!   ([`ArenaView::read_tensor`]) re-check the generation after copying, so a free that
//!   races with the copy is detected as well.
//!
//! ## Aliasing contract for zero-copy borrows
//!
//! [`ArenaView::slice_f32`] returns a `&[f32]` straight into shared memory. The
//! generation check happens once, when the borrow is taken. While a reader holds such a
//! borrow the owner must not free the slice and no other process may write it: the
//! protocol is that a handle is released (by message, back to the owner) only after the
//! reader is done with it. Violating this does not corrupt the arena, but the reader may
//! observe torn data. Use [`ArenaView::read_tensor`] when that protocol cannot be
//! guaranteed.
//!
//! ## Files and cleanup
//!
//! An arena is the file `<dir>/denoised-<namespace>-<name>`, where `dir` is normally
//! [`default_dir`] (`/dev/shm`, or the temp dir where `/dev/shm` does not exist) and is
//! an explicit argument so that tests can use a private directory. The file begins with a
//! header that records the owner's pid and process start time. The owner removes the file
//! when the [`Arena`] is dropped; [`cleanup_namespace`] removes every arena of a namespace
//! (for start-up after a crash); [`reclaim_dead`] removes only the arenas whose owner
//! process is gone (the supervisor calls it after a child died).

mod alloc;
mod arena;
pub mod futex;
mod layout;
mod reclaim;
mod view;

pub use arena::{Arena, ArenaOptions};
pub use reclaim::{cleanup_namespace, list_arenas, owner_alive, reclaim_dead, ArenaInfo};
pub use view::ArenaView;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::tensor::DType;

/// Every slice starts at a multiple of this many bytes (a cache line; also enough for
/// any SIMD load of f32/bf16 data).
pub const ALIGN: u64 = 64;

/// Default number of slots, i.e. of slices that can be live at once in one arena.
pub const DEFAULT_MAX_SLICES: u32 = 4096;

/// Errors of the shared-memory layer. Each names the arena and the numbers involved.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid {what} `{value}`: {reason}")]
    InvalidName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("unknown arena `{name}`: {path} does not exist")]
    UnknownArena { name: String, path: PathBuf },
    #[error("{path}: not a valid arena file: {reason}")]
    BadArena { path: PathBuf, reason: String },
    #[error("{path}: arena is owned by live process {pid}; refusing to replace it")]
    InUse { path: PathBuf, pid: u32 },
    #[error(
        "arena `{arena}`: out of space: requested {requested} bytes ({rounded} after \
         {ALIGN}-byte alignment), {free} bytes free in total, largest free block {largest} \
         bytes, capacity {capacity}"
    )]
    OutOfSpace {
        arena: String,
        requested: u64,
        rounded: u64,
        free: u64,
        largest: u64,
        capacity: u64,
    },
    #[error("arena `{arena}`: all {max} slots are in use (too many live slices)")]
    TooManySlices { arena: String, max: u32 },
    #[error("handle for arena `{got}` used with arena `{expected}`")]
    WrongArena { expected: String, got: String },
    #[error(
        "arena `{arena}`: stale handle: slot {slot} at offset {offset} has generation \
         {current} (0 = free), the handle has {generation}; the slice was freed or reused"
    )]
    StaleHandle {
        arena: String,
        slot: u32,
        offset: u64,
        generation: u64,
        current: u64,
    },
    #[error(
        "arena `{arena}`: handle out of bounds: offset {offset} len {len} (slot {slot}) in \
         an arena of {capacity} bytes and {slots} slots"
    )]
    OutOfBounds {
        arena: String,
        offset: u64,
        len: u64,
        slot: u32,
        capacity: u64,
        slots: u32,
    },
    #[error("arena `{arena}`: handle has dtype {actual:?}, this access needs {expected:?}")]
    DTypeMismatch {
        arena: String,
        expected: DType,
        actual: DType,
    },
    #[error(
        "arena `{arena}`: length mismatch: handle len {len} bytes, dtype {dtype:?} shape \
         {shape:?}: {reason}"
    )]
    LenMismatch {
        arena: String,
        len: u64,
        dtype: DType,
        shape: Vec<usize>,
        reason: String,
    },
    #[error("arena `{arena}`: attached read-only; cannot write")]
    ReadOnly { arena: String },
}

pub type Result<T, E = ShmError> = std::result::Result<T, E>;

impl ShmError {
    fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        ShmError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }
}

/// serde mirror of [`DType`] (which lives in `tensor.rs` and has no serde derive).
#[derive(Serialize, Deserialize)]
#[serde(remote = "DType")]
enum DTypeDef {
    F32,
    BF16,
    F16,
    U8,
    F8E4M3,
}

/// A reference to a slice of an arena. Cheap to clone; travels in messages (serde).
///
/// `arena` is the arena's name within the namespace (the namespace is implied by the
/// deployment). `len` is in bytes and always equals `product(shape) * dtype.size_bytes()`.
/// `slot` indexes the arena's slot table, where `generation` must still be recorded for
/// the handle to be valid.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Handle {
    pub arena: String,
    pub slot: u32,
    pub offset: u64,
    pub len: u64,
    #[serde(with = "DTypeDef")]
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub generation: u64,
}

impl Handle {
    /// Number of elements, `product(shape)` (None on overflow).
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// The byte length implied by dtype and shape (None on overflow).
    pub fn expected_len(&self) -> Option<u64> {
        byte_len(self.dtype, &self.shape)
    }
}

pub(crate) fn byte_len(dtype: DType, shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size_bytes() as u64, |n, &d| n.checked_mul(d as u64))
}

/// Where arenas live by default: `/dev/shm` when it exists, else the temp dir.
pub fn default_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// `denoised-<namespace>-`: every file of a namespace starts with this.
fn namespace_prefix(namespace: &str) -> String {
    format!("denoised-{namespace}-")
}

fn arena_path(dir: &Path, namespace: &str, name: &str) -> PathBuf {
    dir.join(format!("{}{name}", namespace_prefix(namespace)))
}

/// Namespaces are `[A-Za-z0-9_]{1,64}`: no `-`, so that the prefix of one namespace is
/// never the prefix of another.
fn check_namespace(namespace: &str) -> Result<()> {
    check_chars("namespace", namespace, 64, |c| {
        c.is_ascii_alphanumeric() || c == '_'
    })
}

/// Arena names are `[A-Za-z0-9_-]{1,128}` (no `.`: temporary files use it).
fn check_name(name: &str) -> Result<()> {
    check_chars("arena name", name, 128, |c| {
        c.is_ascii_alphanumeric() || c == '_' || c == '-'
    })
}

fn check_chars(
    what: &'static str,
    value: &str,
    max: usize,
    ok: impl Fn(char) -> bool,
) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > max {
        "too long"
    } else if !value.chars().all(ok) {
        if what == "namespace" {
            "only ASCII letters, digits and `_` are allowed"
        } else {
            "only ASCII letters, digits, `_` and `-` are allowed"
        }
    } else {
        return Ok(());
    };
    Err(ShmError::InvalidName {
        what,
        value: value.to_string(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_roundtrips_through_serde() {
        let h = Handle {
            arena: "latents".into(),
            slot: 3,
            offset: 128,
            len: 4096 * 64 * 2,
            dtype: DType::BF16,
            shape: vec![4096, 64],
            generation: 1_700_000_000_000_000_001,
        };
        let json = serde_json::to_string(&h).unwrap();
        assert!(json.contains("\"BF16\""), "{json}");
        let back: Handle = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h);
        assert_eq!(h.expected_len(), Some(h.len));
        assert_eq!(h.numel(), Some(4096 * 64));
    }

    #[test]
    fn names_are_validated() {
        assert!(check_namespace("prod_1").is_ok());
        assert!(check_namespace("a-b").is_err());
        assert!(check_namespace("").is_err());
        assert!(check_name("latents-0").is_ok());
        assert!(check_name("x.tmp1").is_err());
        assert!(check_name("../etc").is_err());
        let e = check_name("a/b").unwrap_err().to_string();
        assert!(e.contains("arena name") && e.contains("a/b"), "{e}");
    }

    #[test]
    fn byte_len_overflow_is_none() {
        assert_eq!(byte_len(DType::F32, &[usize::MAX, 2]), None);
        assert_eq!(byte_len(DType::F16, &[]), Some(2));
        assert_eq!(byte_len(DType::F32, &[0, 5]), Some(0));
    }
}

#[cfg(test)]
mod error_conversion_tests {
    /// Shared-memory errors flow into the runtime's error type with `?`, keeping their
    /// message.
    #[test]
    fn shm_errors_convert() {
        fn attach_missing() -> crate::Result<()> {
            let dir = tempfile::tempdir().expect("tempdir");
            super::ArenaView::attach(dir.path(), "conv", "nope")?;
            Ok(())
        }
        let e = attach_missing().unwrap_err();
        assert!(matches!(e, crate::Error::Shm(_)), "{e:?}");
        assert!(e.to_string().contains("nope"), "{e}");
    }
}
