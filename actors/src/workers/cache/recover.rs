//! Finishing the writes to disk that a cache process left unfinished when it died.
//!
//! A registration is answered once its template is in the cache's arena, before it is
//! on disk (see the module docs of `super`); what is not on disk yet has a pending
//! record in the disk tier ([`Pending`]). The supervisor keeps the arena of a cache
//! process that died, and its replacement runs [`finish_writes`] before it creates its
//! own arena under the same name (which removes the old one; a copy beside it would
//! need the arena's capacity a second time): every pending version whose slices are
//! still allocated in the old arena (the slot table still holds their generations) and
//! hold the bytes their CRC-32s say is written to disk from there, and then the index
//! is rebuilt from the disk tier as after any restart. A version whose bytes are gone
//! (the daemon stopped before the write, so its arena went with it) or damaged is
//! logged as lost, never served.

use std::sync::Arc;
use std::time::Instant;

use denoised_models::flux::template::{TemplateCache, TemplateModel};
use denoised_runtime::shm::ArenaView;
use denoised_runtime::HostSlice;

use super::disk::{Checked, DiskTier, Pending};
use crate::node::WorkerEnv;

/// Writes to disk every version the cache process before this one registered and had
/// not written yet; run before this process creates its arena. Returns how many were
/// written and how many are lost.
pub fn finish_writes(env: &WorkerEnv) -> (usize, usize) {
    let cache = &env.config.cache;
    if cache.disk_bytes == 0 {
        return (0, 0);
    }
    let source = env.model_source();
    let (model, fingerprint) = match (TemplateModel::of(&source), source.fingerprint()) {
        (Ok(m), Ok(f)) => (m, f),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("template cache: cannot check for unfinished writes: {e}");
            return (0, 0);
        }
    };
    let disk = match DiskTier::open(&cache.resolved_dir(), &fingerprint) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!("template cache: cannot check for unfinished writes: {e}");
            return (0, 0);
        }
    };
    if disk.pending().is_empty() {
        return (0, 0);
    }
    let arena = ArenaView::attach(&env.shm_dir, &env.namespace, &env.name())
        .map(Arc::new)
        .map_err(|e| e.to_string());
    finish_all(&disk, &model, &arena)
}

/// Writes every pending version of `disk` from `arena` (the dead process's, or why
/// there is none); removes their records.
fn finish_all(
    disk: &DiskTier,
    model: &TemplateModel,
    arena: &Result<Arc<ArenaView>, String>,
) -> (usize, usize) {
    let pending = disk.pending();
    let (mut written, mut lost) = (0, 0);
    for p in pending {
        let (id, version) = (&p.info.id, p.version);
        // Written, but the process died before it removed the record.
        if disk.has(id, version) {
            disk.remove_pending(version);
            continue;
        }
        let t0 = Instant::now();
        let r = match arena {
            Ok(a) => finish(disk, model, a, &p),
            Err(e) => Err(format!("the memory that held it is gone ({e})")),
        };
        match r {
            Ok(bytes) => {
                written += 1;
                tracing::warn!(
                    "template cache: `{id}` (version {version}) was not on disk yet when the cache process stopped; written from the memory it left ({:.1} MB in {:.2} s)",
                    bytes as f64 / 1e6,
                    t0.elapsed().as_secs_f64()
                );
            }
            Err(why) => {
                lost += 1;
                tracing::error!(
                    "template cache: `{id}` (version {version}) is lost: it was not on disk yet when the cache process stopped, and {why}; register it again"
                );
            }
        }
        disk.remove_pending(version);
    }
    (written, lost)
}

/// Writes one pending version from the old arena; its bytes on disk.
fn finish(
    disk: &DiskTier,
    model: &TemplateModel,
    arena: &Arc<ArenaView>,
    p: &Pending,
) -> Result<u64, String> {
    let slice = |c: &Checked, what: &str| -> Result<HostSlice, String> {
        let s = arena
            .host_slice(&c.handle)
            .map_err(|e| format!("its {what} is no longer in memory ({e})"))?;
        let got = crc32fast::hash(s.bytes());
        if got != c.crc32 {
            return Err(format!(
                "its {what} in memory is damaged (crc32 {got:08x}, {:08x} when stored)",
                c.crc32
            ));
        }
        Ok(s)
    };
    let i = &p.info;
    let layout = model
        .infer(
            i.tokens as usize,
            i.steps as usize,
            i.kv_step_stride as usize,
            p.cache.handle.len,
        )
        .ok_or_else(|| format!("its cache of {} bytes fits no layout", p.cache.handle.len))?;
    let cache =
        TemplateCache::view(layout, slice(&p.cache, "cache")?).map_err(|e| e.to_string())?;
    let image = slice(&p.image, "image")?;
    let traces = p
        .vae_traces
        .as_ref()
        .map(|t| slice(t, "VAE traces"))
        .transpose()?;
    disk.write(
        p.version,
        i,
        &cache,
        image.bytes(),
        traces.as_ref().map(|t| t.bytes()),
    )
    .map_err(|e| format!("writing it failed ({})", e.message))
}

#[cfg(test)]
mod tests {
    use denoised_models::flux::template::TemplateLayout;
    use denoised_models::ModelSource;
    use denoised_runtime::shm::Arena;
    use denoised_runtime::DType;

    use super::*;
    use crate::wire::{TemplateInfo, TierBytes};

    fn info(id: &str, l: &TemplateLayout) -> TemplateInfo {
        TemplateInfo {
            id: id.into(),
            model: "m".into(),
            width: 16,
            height: 16,
            tokens: l.tokens as u32,
            steps: l.steps as u32,
            guidance: 30.0,
            seed: 3,
            prompt: "a room".into(),
            max_sequence_length: 32,
            cache_bytes: l.total_bytes() as u64,
            created_unix: 1.0,
            kv_dtype: "f32".into(),
            cache_mode: "kv".into(),
            kv_step_stride: 1,
            vae_trace_bytes: 0,
            tiers: TierBytes::default(),
            loras: Vec::new(),
            ..Default::default()
        }
    }

    /// Pending versions are written from the dead process's arena when their slices
    /// are there with the bytes their checksums say; one whose bytes changed, one whose
    /// slice was freed, and every one without the arena are lost, never written.
    #[test]
    fn pending_templates_are_written_from_the_arena_only_when_intact() {
        let model = TemplateModel::of(&ModelSource::Builtin).unwrap();
        let (shm, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut arena = Arena::create(shm.path(), "t", "cache0", 64 << 20).unwrap();
        let layout = TemplateLayout::for_model(&model.config, 16, 2, DType::F32);
        let bytes: Vec<u8> = (0..layout.total_bytes())
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let disk = DiskTier::open(dir.path(), "m").unwrap();
        let record = |arena: &mut Arena, id: &str, version: u64| {
            let cache = arena.write_bytes(&bytes).unwrap();
            let image = arena.write_bytes(b"an image").unwrap();
            let p = Pending {
                version,
                info: info(id, &layout),
                cache: Checked {
                    handle: cache,
                    crc32: crc32fast::hash(&bytes),
                },
                vae_traces: None,
                image: Checked {
                    handle: image,
                    crc32: crc32fast::hash(b"an image"),
                },
            };
            disk.write_pending(&p).unwrap();
            p
        };
        record(&mut arena, "good", 1);
        let damaged = record(&mut arena, "damaged", 2);
        let freed = record(&mut arena, "freed", 3);
        // A byte of `damaged` changes in memory; `freed` goes back to the allocator.
        let view = Arc::new(ArenaView::attach_rw(shm.path(), "t", "cache0").unwrap());
        unsafe { view.host_slice(&damaged.cache.handle).unwrap().bytes_mut()[100] ^= 1 };
        arena.free(&freed.cache.handle).unwrap();

        assert_eq!(finish_all(&disk, &model, &Ok(view)), (1, 2));
        assert!(disk.pending().is_empty(), "every record is done with");
        let found = disk.scan(|_, _| true);
        let ids: Vec<&str> = found.iter().map(|f| f.info.id.as_str()).collect();
        assert_eq!(ids, ["good"]);
        assert_eq!(found[0].image, b"an image");

        // What was written reads back, checksums and all.
        let out = arena.write_bytes(&vec![0; bytes.len()]).unwrap();
        let out = arena.shared_view().host_slice(&out).unwrap();
        disk.read_into("good", 1, &out).unwrap();
        assert!(out.bytes() == &bytes[..]);

        // Without the arena (the daemon stopped before the write), nothing is written.
        record(&mut arena, "gone", 4);
        let none = Err("no arena".to_string());
        assert_eq!(finish_all(&disk, &model, &none), (0, 1));
        assert!(!disk.has("gone", 4) && disk.pending().is_empty());
    }
}
