//! The template index: every registered template version, where it is (host memory,
//! disk), how recently edits used it, and who reads it; and which to evict. Plain
//! data and code, no I/O: the cache actor applies its decisions, and property tests
//! check them against a brute-force reference.
//!
//! Policy: least recently used first, demoting host → disk → dropped.
//! - A template leaves the host tier only once it is on disk (so nothing is lost), and
//!   never while pinned (an edit reads it) or while it is being loaded.
//! - When the disk tier is over its capacity, templates are dropped entirely (from the
//!   index and every tier), least recently used first, never one that is pinned.

use std::collections::{BTreeMap, BTreeSet};

/// Where a version's cache is on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disk {
    /// Not on disk (no disk tier, or its write failed).
    None,
    /// Being written.
    Writing,
    /// Written: these bytes on disk.
    Stored(u64),
}

#[derive(Clone, Debug)]
pub struct Slot {
    /// The template id of this version.
    pub id: String,
    /// Bytes of its cache in the host tier (0 when it is not there).
    pub host: u64,
    pub disk: Disk,
    pub pins: u32,
    /// Being loaded from disk into the host tier.
    pub loading: bool,
    /// Still the version its id names (a deleted or replaced one lingers while pinned).
    pub current: bool,
    last_used: u64,
}

/// The index of versions, with their use order.
#[derive(Default)]
pub struct Index {
    slots: BTreeMap<u64, Slot>,
    /// Id → its current version.
    ids: BTreeMap<String, u64>,
    /// (last use, version): the least recently used first.
    lru: BTreeSet<(u64, u64)>,
    clock: u64,
}

impl Index {
    pub fn get(&self, version: u64) -> Option<&Slot> {
        self.slots.get(&version)
    }
    pub fn get_mut(&mut self, version: u64) -> Option<&mut Slot> {
        self.slots.get_mut(&version)
    }
    /// The current version of `id`.
    pub fn version_of(&self, id: &str) -> Option<u64> {
        self.ids.get(id).copied()
    }
    pub fn versions(&self) -> impl Iterator<Item = (u64, &Slot)> {
        self.slots.iter().map(|(v, s)| (*v, s))
    }

    /// Adds `version` as the current one of `id` (just used). The version it replaces,
    /// if any, is no longer current and is returned.
    pub fn insert(&mut self, version: u64, id: &str, host: u64, disk: Disk) -> Option<u64> {
        let old = self.ids.insert(id.to_string(), version);
        if let Some(s) = old.and_then(|o| self.slots.get_mut(&o)) {
            s.current = false;
        }
        self.clock += 1;
        self.slots.insert(
            version,
            Slot {
                id: id.to_string(),
                host,
                disk,
                pins: 0,
                loading: false,
                current: true,
                last_used: self.clock,
            },
        );
        self.lru.insert((self.clock, version));
        old
    }

    /// Marks a use (an edit of it): it becomes the most recently used.
    pub fn touch(&mut self, version: u64) {
        self.clock += 1;
        if let Some(s) = self.slots.get_mut(&version) {
            self.lru.remove(&(s.last_used, version));
            s.last_used = self.clock;
            self.lru.insert((self.clock, version));
        }
    }

    /// Takes `id`'s current version out of the index of ids (it lingers, not
    /// current, while pinned); returns it.
    pub fn retire(&mut self, id: &str) -> Option<u64> {
        let v = self.ids.remove(id)?;
        if let Some(s) = self.slots.get_mut(&v) {
            s.current = false;
        }
        Some(v)
    }

    /// Forgets a version entirely.
    pub fn remove(&mut self, version: u64) -> Option<Slot> {
        let s = self.slots.remove(&version)?;
        self.lru.remove(&(s.last_used, version));
        if self.ids.get(&s.id) == Some(&version) {
            self.ids.remove(&s.id);
        }
        Some(s)
    }

    /// Versions not current and not pinned: nothing can reach them any more.
    pub fn unreachable(&self) -> Vec<u64> {
        self.slots
            .iter()
            .filter(|(_, s)| !s.current && s.pins == 0 && !s.loading)
            .map(|(v, _)| *v)
            .collect()
    }

    /// The versions whose host copy may go, least recently used first: on disk, not
    /// pinned, not loading.
    pub fn host_victims(&self) -> Vec<u64> {
        self.lru
            .iter()
            .map(|&(_, v)| v)
            .filter(|v| {
                let s = &self.slots[v];
                s.host > 0 && matches!(s.disk, Disk::Stored(_)) && s.pins == 0 && !s.loading
            })
            .collect()
    }

    /// Bytes on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.slots
            .values()
            .map(|s| match s.disk {
                Disk::Stored(b) => b,
                _ => 0,
            })
            .sum()
    }

    /// Bytes in the host tier.
    pub fn host_bytes(&self) -> u64 {
        self.slots.values().map(|s| s.host).sum()
    }

    /// The versions to drop so that the disk tier holds at most `capacity` bytes:
    /// least recently used first, never a pinned or loading one.
    pub fn disk_victims(&self, capacity: u64) -> Vec<u64> {
        let mut over = self.disk_bytes().saturating_sub(capacity);
        let mut out = Vec::new();
        for &(_, v) in &self.lru {
            if over == 0 {
                break;
            }
            let s = &self.slots[&v];
            if let (Disk::Stored(b), 0, false) = (s.disk, s.pins, s.loading) {
                out.push(v);
                over = over.saturating_sub(b);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
