//! The cache's index of what its disk tier holds: rebuilt after a restart, and a copy
//! of a template another pod sent (docs/cluster.md) taken in.

use denoised_models::flux::template::TemplateLayout;

use super::disk::Found;
use super::index::Disk;
use super::{not_found, CacheState, Entry};
use crate::wire::{TemplateInfo, WireError};

impl CacheState {
    /// The index of what the disk tier holds, after a restart: templates stay on disk
    /// until an edit needs them; their images come into memory now.
    pub(super) fn rebuild(&mut self, fingerprint: &str) {
        let Some(disk) = self.disk.clone() else {
            return;
        };
        let model = self.model.clone();
        let mut found = disk.scan(|l, info| {
            info.model == fingerprint
                && l.fits(&TemplateLayout::for_model(
                    &model.config,
                    l.tokens,
                    l.steps,
                    l.dtype,
                ))
        });
        // Oldest first, so that the use order starts as the registration order.
        found.sort_by(|a, b| a.info.created_unix.total_cmp(&b.info.created_unix));
        let n = found.len();
        for f in found {
            let _ = self.index_found(f);
        }
        if n > 0 {
            tracing::info!(
                "template cache: {n} templates found on disk in {} ({:.1} MB)",
                disk.root().display(),
                self.index.disk_bytes() as f64 / 1e6
            );
        }
        self.enforce_disk_capacity();
        self.report();
    }

    /// Indexes a version found on disk (it stays there until an edit needs it; its
    /// image comes into memory now).
    fn index_found(&mut self, f: Found) -> Result<(), WireError> {
        let image = self.shm.write_bytes(&f.image).map_err(|e| {
            tracing::error!(
                "template cache: no memory for the image of `{}` ({}); it stays on disk, unindexed",
                f.info.id,
                e.message
            );
            e
        })?;
        self.next_version = self.next_version.max(f.version);
        self.index
            .insert(f.version, &f.info.id, 0, Disk::Stored(f.bytes));
        self.entries.insert(
            f.version,
            Entry {
                info: f.info,
                layout: f.layout,
                image,
                blob: None,
                vae_traces: None,
            },
        );
        Ok(())
    }

    /// Moves a copy of template `id` from another pod, which this pod's router received
    /// at `staged`, into the disk tier (docs/cluster.md) and indexes it, unless this
    /// cache has that version or a newer one.
    pub(super) fn adopt(&mut self, id: &str, staged: &str) -> Result<TemplateInfo, WireError> {
        if let Some(d) = &self.disk {
            d.install(id, std::path::Path::new(staged))
                .map_err(WireError::internal)?;
        }
        let found = self.disk.as_ref().and_then(|d| d.find(id));
        let Some(f) = found else {
            return Err(not_found(id));
        };
        let current = self
            .index
            .versions()
            .find(|(v, s)| s.current && self.entries[v].info.id == id);
        if let Some((v, _)) = current {
            if v >= f.version {
                return Ok(self.describe(v));
            }
        }
        let v = f.version;
        self.index_found(f)?;
        self.enforce_disk_capacity();
        self.report();
        Ok(self.describe(v))
    }
}
