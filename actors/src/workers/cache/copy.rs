//! The copy of a registered template into the cache's arena (on a blocking task, off
//! the actor), with a CRC-32 of what was copied, and the pending record from which a
//! restarted cache process finishes the write to disk (see the module docs of `super`).

use denoised_runtime::shm::Handle;
use denoised_runtime::HostSlice;

use super::disk::{DiskTier, Pending};
use crate::node::Shm;
use crate::wire::WireError;

/// What one registration copies: the capture's cache and its VAE traces (one after
/// another into one slice).
pub(super) struct CopyIn {
    pub src: Handle,
    pub dst: HostSlice,
    pub trace_srcs: Vec<Handle>,
    pub traces_dst: Option<HostSlice>,
}

/// Copies `job` and, with a disk tier, writes `pending` with the copies' checksums:
/// before the registration is answered. A disk tier that cannot take the record will
/// not take the template either: it is kept in memory only, as when its write fails.
pub(super) fn copy_in(
    shm: &Shm,
    job: &CopyIn,
    disk: Option<&DiskTier>,
    pending: Option<&mut Pending>,
) -> Result<(), WireError> {
    let copy = |src: &Handle, dst: &HostSlice, crc: &mut crc32fast::Hasher| {
        let s = shm.host_slice(src)?;
        if s.len() != dst.len() {
            return Err(WireError::internal("a template changed size in flight"));
        }
        // SAFETY: `dst` was allocated for this copy alone; `src` is the capture's
        // slice, which the router holds until this reply.
        copy_summed(unsafe { dst.bytes_mut() }, s.bytes(), crc);
        // Still the capture's after the copy: a router lost meanwhile has its slices
        // freed (and maybe reused) under it.
        shm.with(src, |v| v.check(src))
    };
    let mut crc = crc32fast::Hasher::new();
    copy(&job.src, &job.dst, &mut crc)?;
    let mut traces_crc = None;
    if let Some(t) = &job.traces_dst {
        let mut h = crc32fast::Hasher::new();
        let mut at = 0;
        for src in &job.trace_srcs {
            let part = t
                .sub(at, src.len as usize)
                .map_err(|e| WireError::internal(e.to_string()))?;
            copy(src, &part, &mut h)?;
            at += src.len as usize;
        }
        traces_crc = Some(h.finalize());
    }
    let (Some(disk), Some(p)) = (disk, pending) else {
        return Ok(());
    };
    p.cache.crc32 = crc.finalize();
    if let (Some(t), Some(c)) = (&mut p.vae_traces, traces_crc) {
        t.crc32 = c;
    }
    if let Err(e) = disk.write_pending(p) {
        tracing::error!(
            "template cache: `{}` has no pending record ({}); a crash before it is on disk loses it",
            p.info.id,
            e.message
        );
    }
    Ok(())
}

/// Copies `src` into `dst` (the same length), adding the bytes to `crc` while they are
/// still in the CPU's cache.
fn copy_summed(dst: &mut [u8], src: &[u8], crc: &mut crc32fast::Hasher) {
    const CHUNK: usize = 1 << 20;
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        d.copy_from_slice(s);
        crc.update(d);
    }
}
