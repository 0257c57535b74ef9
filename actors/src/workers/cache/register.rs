//! A template's registration in the cache process: its copy into the host tier (a
//! blocking task), then, with a disk tier, its write to disk (files and directories
//! synced); the registration is answered, and the version served, once that write is
//! done. Without a disk tier it is answered once in memory (documented as such).

use super::*;

impl CacheState {
    /// Stores a capture: copied into the host tier off the message loop, answered when
    /// that is done, then written to disk in the background.
    pub(super) fn put(&mut self, put: PutTemplate, reply: Reply<TemplateEntry>) {
        // The version, the capture's cache, where it goes, where its traces go, and
        // the pending record.
        type Placed = (u64, Handle, HostSlice, Option<HostSlice>, Option<Pending>);
        let r = (|| -> Result<Placed, WireError> {
            if !put.replace && self.index.version_of(&put.info.id).is_some() {
                return Err(WireError::template_exists(&put.info.id));
            }
            let version = match put.version {
                // The registry's: unique per id, and not one this process holds.
                Some(v) if self.entries.contains_key(&v) => {
                    return Err(WireError::internal(format!(
                        "template `{}`: version {v} is held here already",
                        put.info.id
                    )));
                }
                Some(v) => {
                    self.next_version = self.next_version.max(v);
                    v
                }
                None => self.new_version(),
            };
            let i = &put.info;
            let layout = (self.model)
                .infer(
                    i.tokens as usize,
                    i.steps as usize,
                    i.kv_step_stride as usize,
                    put.blob.len,
                )
                .ok_or_else(|| {
                    WireError::internal(format!(
                        "a template of {} bytes matches no layout of {} tokens x {} steps",
                        put.blob.len, i.tokens, i.steps
                    ))
                })?;
            let (dst, bytes) = self.alloc(put.blob.len as usize)?;
            let mut trace_len: u64 = put.vae_traces.iter().map(|h| h.len).sum();
            // Traces are an optimisation: without room for them the template is stored
            // without (its edits record them when they need them).
            let traces = match trace_len {
                0 => None,
                n => match self.alloc(n as usize) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(
                            "template cache: `{}` is stored without its VAE traces ({:.0} MB): {}",
                            put.info.id,
                            n as f64 / 1e6,
                            e.message
                        );
                        trace_len = 0;
                        None
                    }
                },
            };
            let image = self.shm.read_bytes(&put.image).and_then(|b| {
                let crc32 = crc32fast::hash(&b);
                self.shm
                    .write_bytes(&b)
                    .map(|handle| Checked { handle, crc32 })
            });
            let image = match image {
                Ok(c) => c,
                Err(e) => {
                    let mut held = vec![dst];
                    held.extend(traces.map(|t| t.0));
                    self.shm.release(&held);
                    return Err(e);
                }
            };
            let info = TemplateInfo {
                version,
                cache_bytes: put.blob.len,
                vae_trace_bytes: trace_len,
                ..put.info.clone()
            };
            // What a restarted cache process needs to finish the write to disk; the
            // checksums of the copies are filled in as they are made.
            let pending = self.disk.as_ref().map(|_| Pending {
                version,
                info: info.clone(),
                cache: Checked {
                    handle: dst.clone(),
                    crc32: 0,
                },
                vae_traces: traces.as_ref().map(|t| Checked {
                    handle: t.0.clone(),
                    crc32: 0,
                }),
                image: image.clone(),
            });
            self.entries.insert(
                version,
                Entry {
                    info,
                    layout,
                    image: image.handle,
                    blob: Some(dst),
                    vae_traces: traces.as_ref().map(|t| t.0.clone()),
                },
            );
            Ok((
                version,
                put.blob.clone(),
                bytes,
                traces.map(|t| t.1),
                pending,
            ))
        })();
        let (version, src, dst, traces_dst, mut pending) = match r {
            Ok(x) => x,
            Err(e) => {
                let _ = reply.send(Wire(Err(e)));
                return;
            }
        };
        self.copying.insert(version, (reply, put.replace));
        let (shm, me, disk) = (self.shm.clone(), self.myself.clone(), self.disk.clone());
        let job = copy::CopyIn {
            src,
            dst,
            trace_srcs: put.vae_traces,
            traces_dst,
        };
        tokio::task::spawn_blocking(move || {
            let r = copy::copy_in(&shm, &job, disk.as_ref(), pending.as_mut());
            let _ = me.cast(CacheMsg::Copied(Wire((version, r))));
        });
    }

    pub(super) fn copied(&mut self, version: u64, r: Result<(), WireError>) {
        let Some((reply, replace)) = self.copying.remove(&version) else {
            return;
        };
        if let Err(err) = r.and_then(|()| self.id_free(version, replace)) {
            self.discard(version);
            let _ = reply.send(Wire(Err(err)));
            return;
        }
        if self.disk.is_some() {
            // Acknowledged once on disk, files and directories synced: after the
            // answer, a crash of any process (or of the host) loses nothing.
            self.acking.insert(version, (reply, replace));
            self.write_to_disk(version);
            return;
        }
        self.publish(version, Disk::None);
        let _ = reply.send(Wire(Ok(self.entry(version))));
    }

    /// Whether a registration of `version`'s id may complete: another one of the id may
    /// have completed meanwhile.
    fn id_free(&self, version: u64, replace: bool) -> Result<(), WireError> {
        let id = &self.entries[&version].info.id;
        match self.index.version_of(id) {
            Some(_) if !replace => Err(WireError::template_exists(id)),
            _ => Ok(()),
        }
    }

    /// Forgets a registration that will not complete: its slices and pending record.
    fn discard(&mut self, version: u64) {
        self.forget_pending(version);
        if let Some(mut e) = self.entries.remove(&version) {
            let mut slices = e.host_slices();
            slices.push(e.image);
            self.shm.release(&slices);
        }
    }

    /// Makes a registered version the id's current one (superseding an older one).
    fn publish(&mut self, version: u64, disk: Disk) {
        let e = &self.entries[&version];
        let (id, bytes) = (e.info.id.clone(), e.bytes());
        if let Some(old) = self.index.insert(version, &id, bytes, disk) {
            self.forget_pending(old);
            self.collect_unreachable();
        }
        self.metrics.loaded(HOST, bytes);
        self.report();
    }

    /// Writes a version through to disk on a blocking task.
    fn write_to_disk(&self, version: u64) {
        let Some(disk) = self.disk.clone() else {
            return;
        };
        let e = &self.entries[&version];
        let (Some(blob), image) = (e.blob.clone(), e.image.clone()) else {
            return;
        };
        let traces = e.vae_traces.clone();
        let (info, layout) = (e.info.clone(), e.layout);
        let (shm, me) = (self.shm.clone(), self.myself.clone());
        let slow_write = self.faults.slow_write;
        tokio::task::spawn_blocking(move || {
            if let Some(d) = slow_write {
                std::thread::sleep(d);
            }
            // A registration being written is not in the index yet, and a version the
            // index marks as being written is not evictable before it is stored: either
            // way its slices stay valid for this write.
            let r = shm.host_slice(&blob).and_then(|bytes| {
                let cache = TemplateCache::view(layout, bytes)
                    .map_err(|e| WireError::internal(e.to_string()))?;
                let image = shm.read_bytes(&image)?;
                let traces = traces.map(|t| shm.host_slice(&t)).transpose()?;
                disk.write(
                    version,
                    &info,
                    &cache,
                    &image,
                    traces.as_ref().map(|t| t.bytes()),
                )
            });
            if r.is_ok() {
                disk.remove_pending(version);
            }
            let _ = me.cast(CacheMsg::Written(Wire((version, r))));
        });
    }

    pub(super) fn written(&mut self, version: u64, r: Result<u64, WireError>) {
        if let Some((reply, replace)) = self.acking.remove(&version) {
            let r = r.and_then(|bytes| self.id_free(version, replace).map(|()| bytes));
            match r {
                Ok(bytes) => {
                    self.publish(version, Disk::Stored(bytes));
                    self.metrics.loaded(DISK, bytes);
                    let _ = reply.send(Wire(Ok(self.entry(version))));
                    self.enforce_disk_capacity();
                }
                Err(e) => {
                    if let Some(disk) = &self.disk {
                        disk.remove(&self.entries[&version].info.id, version);
                    }
                    self.discard(version);
                    let e = match e.kind {
                        crate::wire::ErrorKind::Conflict => e,
                        _ => WireError::internal(format!(
                            "the template could not be stored on disk, so it was not registered: {}",
                            e.message
                        )),
                    };
                    let _ = reply.send(Wire(Err(e)));
                }
            }
            return;
        }
        let Some(s) = self.index.get_mut(version) else {
            return;
        };
        match r {
            Ok(bytes) => {
                s.disk = Disk::Stored(bytes);
                self.metrics.loaded(DISK, bytes);
            }
            Err(e) => {
                s.disk = Disk::None;
                tracing::error!(
                    "template cache: writing version {version} to disk failed ({}); it stays in memory only",
                    e.message
                );
            }
        }
        self.enforce_disk_capacity();
        self.collect_unreachable();
        self.report();
    }
}
