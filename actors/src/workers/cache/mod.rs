//! The cache actor: the host's template index and the host and disk tiers of the
//! template cache (the device tier is each denoise worker's; see
//! `denoised_models::flux::stepper`).
//!
//! - **Host**: this process's shared-memory arena (`[workers] cache_arena_bytes`), which
//!   denoise workers map read-only and stream from (a GPU page-locks it). Every
//!   template's image bytes live here; its cache (K/V and latents) and its VAE traces
//!   (which pre- and postprocess workers read in place) when it is in use.
//! - **Disk**: `[cache] dir`, up to `[cache] disk_bytes` ([`disk`]). Every new template
//!   is written through in the background: at start the index is rebuilt from the
//!   directory (templates then load from disk on first use). A slab whose checksum
//!   fails drops its template, with a log line.
//!
//! A registration is answered once the template is in the host tier, before its write
//! to disk (tens of seconds for a FLUX.1 template of tens of GB) is done; a crash of this
//! process in between loses no acknowledged template. The copy into the host tier
//! takes the CRC-32 of what it stored, and before the answer a pending record
//! (`disk::Pending`: the template's slices in this arena and their checksums) goes to
//! the disk tier. The supervisor keeps a dead cache process's arena, and its
//! replacement, before it creates its own, finishes every pending write from it
//! ([`recover`]): slices still allocated and with the bytes their checksums say, or the
//! template is reported lost. The template is then on disk like any other.
//!
//! Policy ([`index`]): least recently used first, host → disk → dropped; never a
//! template an edit has pinned. An edit pins its template when it arrives; a template
//! only on disk starts loading then, while the request is preprocessed, and the router
//! asks for its cache (`Load`) only when the denoise stage needs it.
//!
//! Copies and disk I/O (a template is hundreds of MB to tens of GB) run on blocking
//! tasks, never on this actor's message loop: they report back with `Copied`,
//! `Loaded` and `Written`, and the requests that wait for them are answered then.
//!
//! Edits pin the template version they read: deleting or replacing a template takes
//! it out of the index at once (new edits get 404, or the new version), but a pinned
//! version's slices stay until the last edit reading it is done. Pins belong to the
//! router's requests, so when the router is lost they all go.

mod copy;
pub mod disk;
mod found;
pub mod index;
pub mod noise;
pub mod recover;
mod register;
pub mod start;

use std::collections::HashMap;
use std::sync::Arc;

use denoised_models::flux::template::{TemplateCache, TemplateLayout, TemplateModel};
use denoised_runtime::shm::Handle;
use denoised_runtime::HostSlice;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use self::disk::{Checked, DiskTier, Pending};
use self::index::{Disk, Index};
use crate::metrics::cache::{CacheMetrics, DISK, HOST};
use crate::node::Shm;
use crate::wire::{
    CacheMsg, ErrorKind, PutTemplate, Reply, TemplateEntry, TemplateInfo, TierBytes, Wire,
    WireError,
};

pub struct CacheActor;

pub struct CacheArgs {
    pub shm: Arc<Shm>,
    pub metrics: CacheMetrics,
    /// The served model (the layout of its templates) and its fingerprint.
    pub model: TemplateModel,
    pub fingerprint: String,
    /// `[cache] dir` resolved, and `[cache] disk_bytes` (0: no disk tier).
    pub dir: std::path::PathBuf,
    pub disk_bytes: u64,
    /// The approximate cache of text-to-image noise states and its tiers (`None`: off,
    /// or a Fill model).
    pub noise: Option<(crate::approx::ApproxCache, noise::Tiers)>,
    /// Faults to inject (tests and drills; none when serving): `slow_read` and
    /// `no_prefetch` are this process's.
    pub faults: crate::fault::Faults,
}

/// What the cache keeps of a version besides its place in the index.
struct Entry {
    info: TemplateInfo,
    layout: TemplateLayout,
    image: Handle,
    /// Its cache in the host tier.
    blob: Option<Handle>,
    /// Its VAE traces in the host tier (`info.vae_trace_bytes` of them): there when
    /// `blob` is, if it has any.
    vae_traces: Option<Handle>,
}

impl Entry {
    /// Its host-tier slices.
    fn host_slices(&mut self) -> Vec<Handle> {
        self.blob
            .take()
            .into_iter()
            .chain(self.vae_traces.take())
            .collect()
    }

    /// Bytes of its cache and traces, in the host tier when they are there.
    fn bytes(&self) -> u64 {
        self.layout.total_bytes() as u64 + self.info.vae_trace_bytes
    }
}

pub struct CacheState {
    shm: Arc<Shm>,
    index: Index,
    entries: HashMap<u64, Entry>,
    disk: Option<DiskTier>,
    disk_bytes: u64,
    model: TemplateModel,
    metrics: CacheMetrics,
    myself: ActorRef<CacheMsg>,
    /// Registrations whose copy into the host tier is running: who to answer, and
    /// whether the registration replaces the id's template.
    copying: HashMap<u64, (Reply<TemplateEntry>, bool)>,
    /// Registrations copied in and being written to disk: they are answered (and
    /// served) once the write is synced.
    acking: HashMap<u64, (Reply<TemplateEntry>, bool)>,
    /// Loads from disk running: the slices they fill (cache, traces).
    loading: HashMap<u64, (Handle, Option<Handle>)>,
    /// Who waits for a version's load.
    waiting: HashMap<u64, Vec<Reply<TemplateEntry>>>,
    /// Versions dropped because their bytes on disk were damaged, newest first, with
    /// the error their edits get (an edit that pinned one asks for it later).
    damaged: std::collections::VecDeque<(u64, WireError)>,
    next_version: u64,
    noise: Option<noise::NoiseStates>,
    faults: crate::fault::Faults,
}

/// Damaged versions remembered (more than edits can have pinned at once).
const DAMAGED_KEPT: usize = 256;

impl Actor for CacheActor {
    type Msg = CacheMsg;
    type State = CacheState;
    type Arguments = CacheArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        a: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let disk = match a.disk_bytes {
            0 => None,
            _ => Some(DiskTier::open(&a.dir, &a.fingerprint)?),
        };
        // Versions count up from the clock (microseconds), so they never repeat, not
        // even across restarts of this process.
        let now = (crate::daemon::unix_now() * 1e6) as u64;
        let mut st = CacheState {
            shm: a.shm,
            index: Index::default(),
            entries: HashMap::new(),
            disk,
            disk_bytes: a.disk_bytes,
            model: a.model,
            metrics: a.metrics,
            myself,
            copying: HashMap::new(),
            acking: HashMap::new(),
            loading: HashMap::new(),
            waiting: HashMap::new(),
            damaged: Default::default(),
            next_version: now,
            noise: a
                .noise
                .map(|(index, tiers)| noise::NoiseStates::new(index, tiers)),
            faults: a.faults,
        };
        st.rebuild(&a.fingerprint);
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CacheMsg::Put(Wire(put), reply) => st.put(put, reply),
            CacheMsg::Copied(Wire((version, r))) => st.copied(version, r),
            CacheMsg::Written(Wire((version, r))) => st.written(version, r),
            CacheMsg::Get(Wire(id), reply) => {
                let r = st.entry_of(&id);
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Adopt(Wire((id, staged)), reply) => {
                let _ = reply.send(Wire(st.adopt(&id, &staged)));
            }
            CacheMsg::List(_, reply) => {
                let mut list: Vec<TemplateInfo> = st
                    .index
                    .versions()
                    .filter(|(_, s)| s.current)
                    .map(|(v, _)| st.describe(v))
                    .collect();
                list.sort_by(|a, b| a.id.cmp(&b.id));
                let _ = reply.send(Wire(Ok(list)));
            }
            CacheMsg::Delete(Wire((id, up_to)), reply) => {
                // Marked deleted on disk before the answer: a restart does not bring it
                // back, even while edits that read it keep its directory.
                let current = st.index.version_of(&id);
                if current.is_some_and(|v| up_to.is_some_and(|max| v > max)) {
                    let _ = reply.send(Wire(Err(not_found(&id))));
                    return Ok(());
                }
                let marked = match (current, &st.disk) {
                    (Some(v), Some(disk)) => disk.tombstone(&id, v),
                    _ => Ok(()),
                };
                let r = match marked.map(|()| st.index.retire(&id)) {
                    Ok(Some(v)) => {
                        // Deleted: a restart must not finish its write.
                        st.forget_pending(v);
                        let info = st.describe(v);
                        st.collect_unreachable();
                        Ok(info)
                    }
                    Ok(None) => Err(not_found(&id)),
                    Err(e) => Err(e),
                };
                st.report();
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Pin(Wire(id), reply) => {
                let r = st.pin(&id);
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Load(Wire(version), reply) => st.load(version, reply),
            CacheMsg::Loaded(Wire((version, r))) => st.loaded(version, r),
            CacheMsg::Unpin(Wire(version)) => {
                if let Some(s) = st.index.get_mut(version) {
                    s.pins = s.pins.saturating_sub(1);
                }
                st.collect_unreachable();
            }
            CacheMsg::ApproxLookup(Wire(q), reply) => {
                let hit = st.noise.as_mut().and_then(|n| n.lookup(&st.shm, &q));
                let _ = reply.send(Wire(Ok(hit)));
            }
            CacheMsg::ApproxUnpin(Wire(pin)) => {
                if let Some(n) = &mut st.noise {
                    n.unpin(&st.shm, pin);
                }
            }
            CacheMsg::ApproxPut(Wire(put), reply) => {
                let r = match &mut st.noise {
                    Some(n) => n.put(&st.shm, &put),
                    None => Ok(0),
                };
                let _ = reply.send(Wire(r));
            }
            CacheMsg::RouterLost(_) => {
                if let Some(n) = &mut st.noise {
                    n.unpin_all(&st.shm);
                }
                let versions: Vec<u64> = st.index.versions().map(|(v, _)| v).collect();
                for v in versions {
                    if let Some(s) = st.index.get_mut(v) {
                        s.pins = 0;
                    }
                }
                st.collect_unreachable();
            }
        }
        Ok(())
    }
}

fn not_found(id: &str) -> WireError {
    WireError::new(ErrorKind::NotFound, format!("unknown template `{id}`"))
}

fn dtype_name(l: &TemplateLayout) -> String {
    denoised_models::flux::template::storage_name(l.dtype).into()
}

impl CacheState {
    fn new_version(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    /// A version's description, with where it is now.
    fn describe(&self, version: u64) -> TemplateInfo {
        let e = &self.entries[&version];
        let s = self.index.get(version).expect("an indexed version");
        TemplateInfo {
            version,
            kv_dtype: dtype_name(&e.layout),
            cache_mode: e.layout.mode.name().into(),
            kv_step_stride: e.layout.step_stride as u32,
            tiers: TierBytes {
                host: s.host,
                disk: match s.disk {
                    Disk::Stored(b) => b,
                    _ => 0,
                },
            },
            ..e.info.clone()
        }
    }

    fn entry(&self, version: u64) -> TemplateEntry {
        let e = &self.entries[&version];
        TemplateEntry {
            info: self.describe(version),
            version,
            blob: e.blob.clone(),
            vae_traces: e.vae_traces.clone(),
            image: e.image.clone(),
        }
    }

    fn entry_of(&self, id: &str) -> Result<TemplateEntry, WireError> {
        let v = self.index.version_of(id).ok_or_else(|| not_found(id))?;
        Ok(self.entry(v))
    }

    /// Allocates `len` bytes in the host tier, evicting the least recently used
    /// templates that are safe on disk until it fits.
    fn alloc(&mut self, len: usize) -> Result<(Handle, HostSlice), WireError> {
        loop {
            match self.shm.alloc_host(len) {
                Ok(a) => return Ok(a),
                Err(e) if e.kind == ErrorKind::Overloaded || e.kind == ErrorKind::TooLarge => {
                    let Some(&v) = self.index.host_victims().first() else {
                        let (_, capacity) = self.shm.room();
                        let kind = if len as u64 > capacity {
                            ErrorKind::TooLarge
                        } else {
                            ErrorKind::Overloaded
                        };
                        return Err(WireError::new(
                            kind,
                            format!(
                                "the template cache's memory ({:.0} MB) has no room for {:.0} MB: every template in it is in use or not yet on disk ({})",
                                capacity as f64 / 1e6,
                                len as f64 / 1e6,
                                e.message
                            ),
                        ));
                    };
                    self.evict_host(v);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Drops a version's host copy (it stays on disk).
    fn evict_host(&mut self, version: u64) {
        if let Some(e) = self.entries.get_mut(&version) {
            self.shm.release(&e.host_slices());
        }
        if let Some(s) = self.index.get_mut(version) {
            s.host = 0;
        }
        self.metrics.evicted(HOST);
    }

    /// A version no longer to be written to disk by a restarted process (deleted,
    /// replaced, or never registered).
    fn forget_pending(&self, version: u64) {
        if let Some(disk) = &self.disk {
            disk.remove_pending(version);
        }
    }

    /// Drops the least recently used templates while the disk tier, with the copies
    /// being received and the recipes kept beside it, is over capacity.
    fn enforce_disk_capacity(&mut self) {
        let beside = self.disk.as_ref().map_or(0, |d| d.beside_bytes());
        for v in self
            .index
            .disk_victims(self.disk_bytes.saturating_sub(beside))
        {
            tracing::info!(
                "template cache: dropping `{}` (the disk tier is full)",
                self.entries[&v].info.id
            );
            self.metrics.evicted(DISK);
            self.drop_version(v);
        }
    }

    /// Forgets a version: its slices, its disk directory, its index entry.
    fn drop_version(&mut self, version: u64) {
        let slot = self.index.remove(version);
        if let Some(mut e) = self.entries.remove(&version) {
            let mut slices = e.host_slices();
            slices.push(e.image.clone());
            self.shm.release(&slices);
            if let (Some(disk), Some(Disk::Stored(_))) = (&self.disk, slot.map(|s| s.disk)) {
                disk.remove(&e.info.id, version);
            }
        }
    }

    /// Versions deleted or replaced, once no edit reads them, go (one being written
    /// goes when its write is done: the write reads its slices).
    fn collect_unreachable(&mut self) {
        for v in self.index.unreachable() {
            if self.index.get(v).is_some_and(|s| s.disk != Disk::Writing) {
                self.drop_version(v);
            }
        }
        self.report();
    }

    /// Pins `id`'s current version for an edit; one only on disk starts loading.
    fn pin(&mut self, id: &str) -> Result<TemplateEntry, WireError> {
        let Some(v) = self.index.version_of(id) else {
            self.metrics.lookup(HOST, false);
            return Err(not_found(id));
        };
        self.index.touch(v);
        if let Some(s) = self.index.get_mut(v) {
            s.pins += 1;
        }
        let in_memory = self.entries[&v].blob.is_some();
        self.metrics.lookup(HOST, in_memory);
        if !in_memory {
            self.metrics.lookup(DISK, true);
        }
        // (Fault injection: `no_prefetch` leaves the read to the router's `Load`.)
        if !in_memory && !self.faults.no_prefetch {
            if let Err(e) = self.start_load(v) {
                tracing::warn!("template cache: cannot load `{id}` now: {}", e.message);
            }
        }
        Ok(self.entry(v))
    }

    /// Starts reading a version from disk into the host tier (once).
    fn start_load(&mut self, version: u64) -> Result<(), WireError> {
        if self.loading.contains_key(&version) || self.entries[&version].blob.is_some() {
            return Ok(());
        }
        let Some(disk) = self.disk.clone() else {
            return Err(WireError::internal(
                "a template neither in memory nor on disk",
            ));
        };
        let len = self.entries[&version].layout.total_bytes();
        let trace_len = self.entries[&version].info.vae_trace_bytes as usize;
        let (dst, bytes) = self.alloc(len)?;
        // Without room for its traces the template loads without them (its edits
        // record them when they need them).
        let traces = match trace_len {
            0 => None,
            n => self
                .alloc(n)
                .inspect_err(|e| {
                    tracing::warn!(
                        "template cache: `{}` loads without its VAE traces: {}",
                        self.entries[&version].info.id,
                        e.message
                    )
                })
                .ok(),
        };
        self.loading
            .insert(version, (dst, traces.as_ref().map(|t| t.0.clone())));
        if let Some(s) = self.index.get_mut(version) {
            s.loading = true;
        }
        let id = self.entries[&version].info.id.clone();
        let me = self.myself.clone();
        let metrics = self.metrics.clone();
        let slow_read = self.faults.slow_read;
        tokio::task::spawn_blocking(move || {
            let t0 = std::time::Instant::now();
            if let Some(d) = slow_read {
                std::thread::sleep(d);
            }
            let r = disk
                .read_into(&id, version, &bytes)
                .and_then(|()| match &traces {
                    Some((_, t)) => disk.read_traces_into(&id, version, t),
                    None => Ok(()),
                });
            metrics.disk_load(t0.elapsed().as_secs_f64());
            let _ = me.cast(CacheMsg::Loaded(Wire((version, r))));
        });
        Ok(())
    }

    fn load(&mut self, version: u64, reply: Reply<TemplateEntry>) {
        let Some(e) = self.entries.get(&version) else {
            let e = match self.damaged.iter().find(|(v, _)| *v == version) {
                Some((_, e)) => e.clone(),
                None => WireError::new(ErrorKind::NotFound, "the template is gone"),
            };
            let _ = reply.send(Wire(Err(e)));
            return;
        };
        if e.blob.is_some() {
            let _ = reply.send(Wire(Ok(self.entry(version))));
            return;
        }
        match self.start_load(version) {
            Ok(()) => self.waiting.entry(version).or_default().push(reply),
            Err(e) => {
                let _ = reply.send(Wire(Err(e)));
            }
        }
    }

    fn loaded(&mut self, version: u64, r: Result<(), WireError>) {
        let Some((dst, traces)) = self.loading.remove(&version) else {
            return;
        };
        let waiters = self.waiting.remove(&version).unwrap_or_default();
        if let Some(s) = self.index.get_mut(version) {
            s.loading = false;
        }
        let answer = match r {
            Ok(()) => {
                let bytes = dst.len + traces.as_ref().map_or(0, |t| t.len);
                if let Some(e) = self.entries.get_mut(&version) {
                    e.blob = Some(dst);
                    e.vae_traces = traces;
                }
                if let Some(s) = self.index.get_mut(version) {
                    s.host = bytes;
                }
                self.metrics.loaded(HOST, bytes);
                Ok(self.entry(version))
            }
            Err(e) => {
                // A template whose bytes on disk are not what was written is never
                // used: it is dropped, and its edits fail as if it were unknown.
                self.shm
                    .release(&[dst].into_iter().chain(traces).collect::<Vec<_>>());
                let id = self.entries[&version].info.id.clone();
                tracing::error!(
                    "template cache: `{id}` on disk is damaged ({}); it is dropped and must be registered again",
                    e.message
                );
                // Out of the index at once; its image stays until the edits that
                // pinned it (and may be preprocessing from it) are done.
                self.index.retire(&id);
                if let Some(disk) = &self.disk {
                    disk.remove(&id, version);
                }
                if let Some(s) = self.index.get_mut(version) {
                    s.disk = Disk::None;
                }
                let err = WireError::new(
                    ErrorKind::NotFound,
                    format!("template `{id}` was damaged on disk and dropped: register it again"),
                );
                self.damaged.push_front((version, err.clone()));
                self.damaged.truncate(DAMAGED_KEPT);
                Err(err)
            }
        };
        for w in waiters {
            let _ = w.send(Wire(answer.clone()));
        }
        self.collect_unreachable();
    }

    /// Updates the gauges of what each tier holds.
    fn report(&self) {
        let (mut host, mut disk) = ((0, 0), (0, 0));
        for (_, s) in self.index.versions() {
            if s.host > 0 {
                host = (host.0 + 1, host.1 + s.host);
            }
            if let Disk::Stored(b) = s.disk {
                disk = (disk.0 + 1, disk.1 + b);
            }
        }
        self.metrics.set_held(HOST, host.0, host.1);
        self.metrics.set_held(DISK, disk.0, disk.1);
    }
}
