//! The approximate cache's noise states in the cache process ([`crate::approx`] is the
//! index and eviction; this holds the bytes) in two tiers:
//!
//! - **Host**: this process's arena, beside the templates, up to `[approx_cache]
//!   host_bytes`. Denoise workers read a hit's state in place, as they read templates.
//! - **Disk**: `noise/` under the cache directory, up to `[approx_cache] disk_bytes`.
//!   The least recently used states leave the host tier for it; a hit on one reads it
//!   back into the host tier first. The index's capacity is both tiers together, and
//!   its eviction policy decides which states leave the cache altogether.
//!
//! A hit is pinned until the router says the denoise worker has read it
//! (`ApproxUnpin`): a state evicted or moved to disk meanwhile keeps its slice until
//! then. States are small (the packed latents: 1 MiB for FLUX.1 at 1024x1024), so their
//! copies and file reads and writes run on the message loop.
//!
//! The index lives in memory only: a restart of the cache process starts the
//! approximate cache empty (the directory is cleared), and the next misses refill it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use denoised_runtime::shm::Handle;
use denoised_runtime::Tensor;

use crate::approx::{ApproxCache, ExactKey, PromptId};
use crate::node::Shm;
use crate::wire::{ApproxHit, ApproxPut, ApproxQuery, WireError};

/// Where a state is.
enum Place {
    Host(Handle),
    /// Its file holds `[rows, cols]` f32 latents.
    Disk {
        rows: usize,
        cols: usize,
    },
}

/// The tiers' limits: `[approx_cache] host_bytes` and, with a directory,
/// `disk_bytes`.
pub struct Tiers {
    pub host_bytes: u64,
    pub disk: Option<(PathBuf, u64)>,
}

pub struct NoiseStates {
    index: ApproxCache,
    held: HashMap<(PromptId, usize), (Place, u64)>,
    tiers: Tiers,
    host_used: u64,
    /// Use clock: `held`'s second field is each state's last use.
    clock: u64,
    /// Pinned hits: the slice each one reads.
    pins: HashMap<u64, Handle>,
    /// Slices a pin still reads that left the host tier: released at their last unpin.
    unheld: Vec<Handle>,
    next_pin: u64,
}

impl NoiseStates {
    /// The store of `index`, whose capacity must be both tiers' (see [`Tiers`]).
    pub fn new(index: ApproxCache, tiers: Tiers) -> Self {
        if let Some((dir, _)) = &tiers.disk {
            // States of an earlier run are not indexed: cleared.
            let _ = std::fs::remove_dir_all(dir);
            if let Err(e) = std::fs::create_dir_all(dir) {
                tracing::warn!(
                    "approximate cache: no disk tier, cannot create {}: {e}",
                    dir.display()
                );
            }
        }
        NoiseStates {
            index,
            held: HashMap::new(),
            tiers,
            host_used: 0,
            clock: 0,
            pins: HashMap::new(),
            unheld: Vec::new(),
            next_pin: 1,
        }
    }

    /// Bytes of the states held (both tiers), and in the host tier.
    pub fn used(&self) -> (u64, u64) {
        (self.index.used(), self.host_used)
    }

    fn path(&self, (prompt, k): (PromptId, usize)) -> Option<PathBuf> {
        let (dir, _) = self.tiers.disk.as_ref()?;
        Some(dir.join(format!("{prompt:016x}-{k}.f32")))
    }

    pub fn lookup(&mut self, shm: &Shm, q: &ApproxQuery) -> Option<ApproxHit> {
        let hit = self.index.lookup(
            ExactKey(q.key),
            q.text,
            &q.embedding,
            q.steps as usize,
            q.exact,
        )?;
        let at = (hit.prompt, hit.k);
        let state = match self.to_host(shm, at) {
            Ok(h) => h,
            Err(e) => {
                // A damaged or vanished file: the state goes, the request misses.
                tracing::warn!("approximate cache: state lost: {e}");
                self.index.remove(hit.prompt, hit.k);
                self.drop_state(shm, at);
                return None;
            }
        };
        self.clock += 1;
        if let Some(s) = self.held.get_mut(&at) {
            s.1 = self.clock;
        }
        let pin = self.next_pin;
        self.next_pin += 1;
        self.pins.insert(pin, state.clone());
        self.make_room(shm);
        Some(ApproxHit {
            k: hit.k as u32,
            // Rounding makes a prompt's own similarity 1 + 1e-7.
            similarity: hit.similarity.min(1.0),
            state,
            pin,
        })
    }

    /// The state's slice in the host tier, read back from disk when it is there.
    fn to_host(&mut self, shm: &Shm, at: (PromptId, usize)) -> Result<Handle, WireError> {
        let (rows, cols) = match self.held.get(&at) {
            Some((Place::Host(h), _)) => return Ok(h.clone()),
            Some((Place::Disk { rows, cols }, _)) => (*rows, *cols),
            None => return Err(WireError::internal("an indexed state without bytes")),
        };
        let path = self.path(at).expect("a state on disk has a directory");
        let io = |e: std::io::Error| WireError::internal(format!("{}: {e}", path.display()));
        let bytes = std::fs::read(&path).map_err(io)?;
        if bytes.len() != rows * cols * 4 {
            return Err(WireError::internal(format!(
                "{}: {} bytes, expected {}",
                path.display(),
                bytes.len(),
                rows * cols * 4
            )));
        }
        let data = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let t = Tensor::new([rows, cols], data).map_err(|e| WireError::internal(e.to_string()))?;
        let h = shm.write_tensor(&t)?;
        let _ = std::fs::remove_file(&path);
        self.host_used += h.len;
        if let Some(s) = self.held.get_mut(&at) {
            s.0 = Place::Host(h.clone());
        }
        Ok(h)
    }

    /// Moves the least recently used unpinned states to disk (or, without one, nowhere:
    /// the index's capacity is then the host tier's) until the host tier fits.
    fn make_room(&mut self, shm: &Shm) {
        while self.host_used > self.tiers.host_bytes {
            let victim = self
                .held
                .iter()
                .filter_map(|(at, (p, t))| match p {
                    Place::Host(h) if !self.pins.values().any(|x| x == h) => Some((*t, *at)),
                    _ => None,
                })
                .min();
            let Some((_, at)) = victim else { return };
            if let Err(e) = self.demote(shm, at) {
                tracing::warn!("approximate cache: state dropped, not written to disk: {e}");
                self.index.remove(at.0, at.1);
                self.drop_state(shm, at);
            }
        }
    }

    fn demote(&mut self, shm: &Shm, at: (PromptId, usize)) -> Result<(), WireError> {
        let path = self
            .path(at)
            .ok_or_else(|| WireError::internal("no disk tier"))?;
        let Some((Place::Host(h), _)) = self.held.get(&at) else {
            return Ok(());
        };
        let h = h.clone();
        let t = shm.read_tensor(&h)?;
        let bytes: Vec<u8> = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(&path, bytes)
            .map_err(|e| WireError::internal(format!("{}: {e}", path.display())))?;
        let (rows, cols) = (t.rows(), t.cols());
        if let Some(s) = self.held.get_mut(&at) {
            s.0 = Place::Disk { rows, cols };
        }
        self.host_used -= h.len;
        shm.release(&[h]);
        Ok(())
    }

    /// Forgets a state's bytes wherever they are (a pinned slice stays until unpinned).
    fn drop_state(&mut self, shm: &Shm, at: (PromptId, usize)) {
        match self.held.remove(&at) {
            Some((Place::Host(h), _)) => {
                self.host_used -= h.len;
                self.unheld.push(h.clone());
                self.release_if_unread(shm, h);
            }
            Some((Place::Disk { .. }, _)) => {
                if let Some(p) = self.path(at) {
                    let _ = std::fs::remove_file(p);
                }
            }
            None => {}
        }
    }

    pub fn unpin(&mut self, shm: &Shm, pin: u64) {
        if let Some(h) = self.pins.remove(&pin) {
            self.release_if_unread(shm, h);
        }
        self.make_room(shm);
    }

    /// Every pin goes (the router that held them is gone).
    pub fn unpin_all(&mut self, shm: &Shm) {
        self.pins.clear();
        shm.release(&std::mem::take(&mut self.unheld));
        self.make_room(shm);
    }

    fn release_if_unread(&mut self, shm: &Shm, h: Handle) {
        if self.pins.values().any(|p| *p == h) {
            return;
        }
        if let Some(i) = self.unheld.iter().position(|e| *e == h) {
            shm.release(&[self.unheld.swap_remove(i)]);
        }
    }

    /// Indexes a missed generation and copies the states the index keeps into the host
    /// tier (moving older ones to disk); returns how many it kept.
    pub fn put(&mut self, shm: &Arc<Shm>, put: &ApproxPut) -> Result<u32, WireError> {
        let Some((_, first)) = put.states.first() else {
            return Ok(0);
        };
        let q = &put.query;
        let (id, evicted) = self.index.insert(
            ExactKey(q.key),
            q.text,
            &q.embedding,
            q.steps as usize,
            first.len,
        );
        for e in evicted {
            self.drop_state(shm, (e.prompt, e.k));
        }
        let Some(id) = id else { return Ok(0) };
        let mut kept = 0;
        for k in self.index.states_of(id) {
            let copied = put
                .states
                .iter()
                .find(|(s, _)| *s as usize == k)
                .ok_or_else(|| WireError::internal(format!("no state after step {k}")))
                .and_then(|(_, h)| shm.write_tensor(&shm.read_tensor(h)?));
            match copied {
                Ok(h) => {
                    self.clock += 1;
                    self.host_used += h.len;
                    self.held.insert((id, k), (Place::Host(h), self.clock));
                    kept += 1;
                }
                Err(e) => {
                    // No room in the arena (templates fill it too): the state is not
                    // kept; the generation itself succeeded.
                    tracing::warn!("approximate cache: state after step {k} not kept: {e}");
                    self.index.remove(id, k);
                }
            }
        }
        self.make_room(shm);
        Ok(kept)
    }
}
