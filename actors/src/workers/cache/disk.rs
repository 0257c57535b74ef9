//! The disk tier of the template cache: one directory per template version under
//! `[cache] dir/<model fingerprint>/`, named `<id>@<version>`, holding the template file
//! (`template.json` + `cache.bin`, with a checksum per slab: see
//! `denoised_models::flux::template_file`), its VAE traces when it has them (`vae.bin`,
//! a checksum per trace: `denoised_models::vae::sparse::stored`), the encoded image
//! (`image.bin`) and the API description (`info.json`). A version is written to `<id>@<version>.tmp` and
//! renamed when complete, so a crash mid-write leaves no half template behind; versions
//! are unique, so a replacement never overwrites a directory another write may still
//! be filling. `scan` rebuilds the index after a restart: the newest version of each
//! id, with everything else (older versions, unfinished writes, unreadable ones)
//! removed and logged.
//!
//! `.pending/<version>.json` (a name no template id can take) records a version that
//! was registered but is not on disk yet: where its bytes are in the cache process's
//! arena and their checksums ([`Pending`]). It is written before the registration is
//! answered and removed once the version's directory is complete (or the version is
//! deleted or replaced), so that a cache process restarted after a crash finishes the
//! write from the arena the dead one left (`super::recover`).

use std::path::{Path, PathBuf};

use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::flux::template_file::{self, TemplateMeta};
use denoised_runtime::shm::Handle;
use denoised_runtime::HostSlice;

use crate::wire::{TemplateInfo, WireError, WireLora};

const INFO: &str = "info.json";
const IMAGE: &str = "image.bin";
use template_file::VAE_TRACES;

/// A template found on disk at start.
pub struct Found {
    pub info: TemplateInfo,
    pub version: u64,
    pub layout: TemplateLayout,
    /// Bytes of its directory.
    pub bytes: u64,
    pub image: Vec<u8>,
}

/// The directory of pending records, under the tier's root.
const PENDING: &str = ".pending";
/// The directory of deleted versions' markers, under the tier's root.
const DELETED: &str = ".deleted";

/// A slice of the cache process's arena and the CRC-32 of its bytes when they were
/// stored there.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Checked {
    pub handle: Handle,
    pub crc32: u32,
}

/// A registered version whose write to disk has not finished: everything needed to
/// finish it from the arena of the process that registered it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Pending {
    pub version: u64,
    /// As the disk tier stores it (`cache_bytes` and `vae_trace_bytes` are the
    /// stored slices').
    pub info: TemplateInfo,
    pub cache: Checked,
    pub vae_traces: Option<Checked>,
    pub image: Checked,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    version: u64,
    info: TemplateInfo,
}

/// The description in a version's `info.json` (as a peer exports it).
pub fn stored_info(bytes: &[u8]) -> Result<TemplateInfo, String> {
    serde_json::from_slice::<Stored>(bytes)
        .map(|s| TemplateInfo {
            version: s.version,
            ..s.info
        })
        .map_err(|e| format!("not a template's description: {e}"))
}

/// The tier. Its writing methods are the cache process's alone (`pub(super)`): the
/// router reads it (copies to peers) and stages copies from peers beside it.
#[derive(Clone)]
pub struct DiskTier {
    root: PathBuf,
}

fn io(path: &Path, e: impl std::fmt::Display) -> WireError {
    WireError::internal(format!("{}: {e}", path.display()))
}

impl DiskTier {
    /// The tier under `dir` for templates of `model`, created if needed.
    pub fn open(dir: &Path, model: &str) -> Result<DiskTier, String> {
        let root = dir.join(model);
        std::fs::create_dir_all(&root)
            .map_err(|e| format!("the template cache's disk tier {}: {e}", root.display()))?;
        Ok(DiskTier { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, id: &str, version: u64) -> PathBuf {
        self.root.join(crate::wire::version_name(id, version))
    }

    /// Writes a version; returns its bytes on disk.
    pub(super) fn write(
        &self,
        version: u64,
        info: &TemplateInfo,
        cache: &TemplateCache,
        image: &[u8],
        vae_traces: Option<&[u8]>,
    ) -> Result<u64, WireError> {
        let dir = self.dir(&info.id, version);
        let tmp = dir.with_extension("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        let meta = TemplateMeta {
            model: info.model.clone(),
            height: info.height as usize,
            width: info.width as usize,
            steps: info.steps as usize,
            guidance: info.guidance,
            seed: info.seed,
            prompt: info.prompt.clone(),
            adapters: WireLora::set_key(&info.loras),
        };
        let write = || -> Result<(), WireError> {
            template_file::save(&tmp, cache, &meta, cache.layout().dtype)
                .map_err(|e| WireError::internal(e.to_string()))?;
            std::fs::write(tmp.join(IMAGE), image).map_err(|e| io(&tmp, e))?;
            if let Some(t) = vae_traces {
                template_file::save_vae_traces(&tmp, t)
                    .map_err(|e| WireError::internal(e.to_string()))?;
            }
            let stored = Stored {
                version,
                info: TemplateInfo {
                    tiers: Default::default(),
                    ..info.clone()
                },
            };
            let text = serde_json::to_vec_pretty(&stored).map_err(|e| io(&tmp, e))?;
            std::fs::write(tmp.join(INFO), text).map_err(|e| io(&tmp, e))?;
            // On the device before the name: every file and the directory synced, then
            // renamed into place and the rename synced, so that once the write returns
            // (and the registration is answered) a crash of the host loses nothing.
            sync_dir_and_files(&tmp).map_err(|e| io(&tmp, e))?;
            std::fs::rename(&tmp, &dir).map_err(|e| io(&dir, e))?;
            sync_path(&self.root).map_err(|e| io(&self.root, e))
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Ok(dir_bytes(&dir))
    }

    /// Reads a version's cache into `dst`, checking every slab.
    pub fn read_into(&self, id: &str, version: u64, dst: &HostSlice) -> Result<(), WireError> {
        let dir = self.dir(id, version);
        let h = template_file::read_header(&dir).map_err(|e| WireError::internal(e.to_string()))?;
        template_file::read_into(&dir, &h, dst).map_err(|e| WireError::internal(e.to_string()))
    }

    /// Reads a version's VAE traces into `dst` (their size), checking every trace.
    pub fn read_traces_into(
        &self,
        id: &str,
        version: u64,
        dst: &HostSlice,
    ) -> Result<(), WireError> {
        let path = self.dir(id, version).join(VAE_TRACES);
        let mut f = std::fs::File::open(&path).map_err(|e| io(&path, e))?;
        let len = f.metadata().map_err(|e| io(&path, e))?.len();
        if len != dst.len() as u64 {
            return Err(io(&path, format!("{len} bytes, expected {}", dst.len())));
        }
        // SAFETY: `dst` was allocated for this read alone.
        let buf = unsafe { dst.bytes_mut() };
        std::io::Read::read_exact(&mut f, buf).map_err(|e| io(&path, e))?;
        denoised_models::vae::sparse::check_traces(buf).map_err(|e| io(&path, e))?;
        Ok(())
    }

    fn pending_path(&self, version: u64) -> PathBuf {
        self.root.join(PENDING).join(format!("{version}.json"))
    }

    /// Records a version as pending (written to a temporary file and renamed, so a
    /// crash leaves either the whole record or none).
    pub(super) fn write_pending(&self, p: &Pending) -> Result<(), WireError> {
        let path = self.pending_path(p.version);
        let dir = path.parent().expect("a pending record's directory");
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec(p).map_err(|e| io(&tmp, e))?;
        std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
        sync_path(&tmp).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        sync_path(dir).map_err(|e| io(dir, e))
    }

    /// Forgets a version's pending record (its write finished, or it is gone).
    pub(super) fn remove_pending(&self, version: u64) {
        let path = self.pending_path(version);
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("removing {}: {e}", path.display());
            }
        }
    }

    /// The pending records, oldest version first. Unreadable ones are removed (and
    /// logged).
    pub fn pending(&self) -> Vec<Pending> {
        let Ok(rd) = std::fs::read_dir(self.root.join(PENDING)) else {
            return Vec::new();
        };
        let mut out: Vec<Pending> = Vec::new();
        for e in rd.flatten() {
            let path = e.path();
            let read = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Pending>(&b).map_err(|e| e.to_string()));
            match read {
                Ok(p) if path.extension().is_some_and(|x| x == "json") => out.push(p),
                r => {
                    let why = r.err().unwrap_or_else(|| "an unfinished record".into());
                    tracing::warn!("template cache: removing {}: {why}", path.display());
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        out.sort_by_key(|p| p.version);
        out
    }

    /// Whether a version's directory is complete on disk.
    pub fn has(&self, id: &str, version: u64) -> bool {
        self.dir(id, version).join(INFO).is_file()
    }

    /// Removes a version's directory.
    pub(super) fn remove(&self, id: &str, version: u64) {
        let dir = self.dir(id, version);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("removing {}: {e}", dir.display());
            }
        }
        let _ = std::fs::remove_file(self.tombstone_path(id, version));
    }

    fn tombstone_path(&self, id: &str, version: u64) -> PathBuf {
        self.root
            .join(DELETED)
            .join(crate::wire::version_name(id, version))
    }

    /// Marks a version deleted, durably (the marker and its directory synced), before
    /// its directory goes (edits that read it may hold it a while): a restart removes a
    /// marked version instead of serving it again ([`scan`](Self::scan)).
    pub(super) fn tombstone(&self, id: &str, version: u64) -> Result<(), WireError> {
        let path = self.tombstone_path(id, version);
        let dir = path.parent().expect("a tombstone's directory");
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        std::fs::File::create(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&path, e))?;
        sync_path(dir).map_err(|e| io(dir, e))
    }

    /// The templates on disk: the newest complete version of each id. Everything else
    /// is removed (and logged): unfinished writes, older versions, unreadable ones,
    /// ones whose layout `check` refuses.
    pub(super) fn scan(
        &self,
        check: impl Fn(&TemplateLayout, &TemplateInfo) -> bool,
    ) -> Vec<Found> {
        // Versions deleted before a crash go first.
        if let Ok(rd) = std::fs::read_dir(self.root.join(DELETED)) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if let Some((id, v)) = name
                    .rsplit_once('@')
                    .and_then(|(id, v)| Some((id, v.parse().ok()?)))
                {
                    tracing::info!(
                        "template cache: removing `{id}` (version {v}), deleted before a restart"
                    );
                    self.remove(id, v);
                }
            }
        }
        let Ok(rd) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut found: Vec<Found> = Vec::new();
        for e in rd.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            let drop = |why: &str| {
                tracing::warn!("template cache: removing {}: {why}", path.display());
                let _ = std::fs::remove_dir_all(&path);
            };
            // Not a template: the pending records (ids never start with a dot).
            if name.starts_with('.') {
                continue;
            }
            if name.ends_with(".tmp") {
                drop("an unfinished write");
                continue;
            }
            match read_found(&path) {
                Ok(f) if name == format!("{}@{}", f.info.id, f.version) => {
                    if !check(&f.layout, &f.info) {
                        drop("it does not match the served model");
                    } else if let Some(i) = found.iter().position(|o| o.info.id == f.info.id) {
                        // Two versions of one id: a replacement whose older version was
                        // not removed yet. The newer one stands.
                        let old = if found[i].version < f.version {
                            std::mem::replace(&mut found[i], f)
                        } else {
                            f
                        };
                        self.remove(&old.info.id, old.version);
                    } else {
                        found.push(f);
                    }
                }
                Ok(_) => drop("its name does not match its contents"),
                Err(e) => drop(&e),
            }
        }
        found
    }
}

/// Bytes of the files in `dir`.
/// A version's directory as it is on disk.
fn read_found(path: &Path) -> Result<Found, String> {
    let text = std::fs::read(path.join(INFO)).map_err(|e| e.to_string())?;
    let s: Stored = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    let h = template_file::read_header(path).map_err(|e| e.to_string())?;
    let image = std::fs::read(path.join(IMAGE)).map_err(|e| e.to_string())?;
    Ok(Found {
        info: TemplateInfo {
            version: s.version,
            ..s.info
        },
        version: s.version,
        layout: h.layout,
        bytes: dir_bytes(path),
        image,
    })
}

/// Copies between pods (docs/cluster.md): a version leaves as its directory's name,
/// its description and image ([`DiskTier::export`]) and its template file (moved by
/// `template_transfer`, which checks it slab by slab); it arrives under `.incoming/`
/// and moves into the tier complete ([`DiskTier::install`]), for the cache process to
/// index ([`DiskTier::find`]).
impl DiskTier {
    /// The directory of version `name` (`<id>@<version>`, complete), if this tier has it.
    pub fn version_dir(&self, name: &str) -> Option<PathBuf> {
        let ok = !name.contains('/') && !name.starts_with('.') && name.contains('@');
        let dir = self.root.join(name);
        // A deleted version whose directory an edit still holds is not exported.
        let deleted = self.root.join(DELETED).join(name).exists();
        (ok && !deleted && dir.join(INFO).is_file()).then_some(dir)
    }

    /// The directory name of the newest complete version of `id`.
    fn newest(&self, id: &str) -> Option<String> {
        let prefix = format!("{id}@");
        let (_, name) = std::fs::read_dir(&self.root)
            .ok()?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                let v: u64 = name.strip_prefix(&prefix)?.parse().ok()?;
                Some((v, name))
            })
            .filter(|(_, name)| self.version_dir(name).is_some())
            .max()?;
        Some(name)
    }

    /// The newest complete version of `id`: its directory's name, description and image.
    pub fn export(&self, id: &str) -> Option<(String, Vec<u8>, Vec<u8>)> {
        let name = self.newest(id)?;
        let dir = self.root.join(&name);
        let info = std::fs::read(dir.join(INFO)).ok()?;
        let image = std::fs::read(dir.join(IMAGE)).ok()?;
        Some((name, info, image))
    }

    /// Where the router receives copies from peers for this tier: beside it, not in it
    /// (`<dir>/.incoming/<model>/`), so that the cache process stays the only writer of
    /// the tier; on the same filesystem, so that a copy moves in by a rename.
    pub fn staging(dir: &Path, model: &str) -> PathBuf {
        dir.join(".incoming").join(model)
    }

    /// The bytes beside the tier that its capacity (`[cache] disk_bytes`) covers too:
    /// the copies from peers being received (and what one cut short left) and the
    /// recipes the router keeps (`<cache dir>/.recipes/`).
    pub fn beside_bytes(&self) -> u64 {
        let (Some(dir), Some(model)) = (self.root.parent(), self.root.file_name()) else {
            return 0;
        };
        let staging = Self::staging(dir, &model.to_string_lossy());
        tree_bytes(&staging) + tree_bytes(&dir.join(".recipes"))
    }

    /// Moves a copy of a version of template `id`, received complete at `staged` (its
    /// template file, description and image), into the tier: checked first (its name
    /// and description), synced, renamed into place.
    pub(super) fn install(&self, id: &str, staged: &Path) -> Result<(), String> {
        let name = staged
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        crate::wire::check_version_name(id, &name)?;
        let found = read_found(staged).map_err(|e| format!("{}: {e}", staged.display()))?;
        if found.info.id != id {
            return Err(format!(
                "{}: a copy of `{}`, not `{id}`",
                staged.display(),
                found.info.id
            ));
        }
        let dest = self.root.join(&name);
        if dest.exists() {
            // This version is here already (a copy raced another).
            let _ = std::fs::remove_dir_all(staged);
            return Ok(());
        }
        let fail = |e: std::io::Error| format!("{}: {e}", dest.display());
        sync_dir_and_files(staged).map_err(fail)?;
        std::fs::rename(staged, &dest).map_err(fail)?;
        sync_path(&self.root).map_err(fail)
    }

    /// Writes a received copy's description and image beside its template file (the
    /// router does, in its staging directory, before the cache installs it).
    pub fn stage(staged: &Path, info: &[u8], image: &[u8]) -> std::io::Result<()> {
        std::fs::write(staged.join(IMAGE), image)?;
        std::fs::write(staged.join(INFO), info)
    }

    /// The newest complete version of `id` on disk (a copy just installed).
    pub fn find(&self, id: &str) -> Option<Found> {
        read_found(&self.root.join(self.newest(id)?)).ok()
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// `fsync` of a file or a directory (a directory's entries: the names in it).
fn sync_path(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// Every file directly in `dir`, then `dir` itself, synced.
fn sync_dir_and_files(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            sync_path(&entry.path())?;
        }
    }
    sync_path(dir)
}

/// The bytes of the files under `path` (0 where there is none).
fn tree_bytes(path: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(path) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}
