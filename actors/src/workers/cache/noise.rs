//! The approximate cache's noise states in the cache process ([`crate::approx`] is the
//! index and eviction; this holds the bytes): the host tier, this process's arena,
//! beside the templates. Denoise workers read a hit's state in place, as they read
//! templates.
//!
//! A hit is pinned until the router says the denoise worker has read it
//! (`ApproxUnpin`): a state evicted meanwhile keeps its bytes until then. States are
//! small (the packed latents: 1 MiB for FLUX.1 at 1024x1024), so a put copies them on
//! the message loop.
//!
//! States live in memory only: a restart of the cache process starts the approximate
//! cache empty (it refills with the next misses).

use std::collections::HashMap;
use std::sync::Arc;

use denoised_runtime::shm::Handle;

use crate::approx::{ApproxCache, ExactKey, PromptId};
use crate::node::Shm;
use crate::wire::{ApproxHit, ApproxPut, ApproxQuery, WireError};

pub struct NoiseStates {
    index: ApproxCache,
    held: HashMap<(PromptId, usize), Handle>,
    /// Pinned hits: the state each one read.
    pins: HashMap<u64, Handle>,
    /// Evicted states a pin still reads: released at their last unpin.
    evicted: Vec<Handle>,
    next_pin: u64,
}

impl NoiseStates {
    pub fn new(index: ApproxCache) -> Self {
        NoiseStates {
            index,
            held: HashMap::new(),
            pins: HashMap::new(),
            evicted: Vec::new(),
            next_pin: 1,
        }
    }

    /// Bytes of the states held, and prompts indexed.
    pub fn used(&self) -> (u64, usize) {
        (self.index.used(), self.index.prompts())
    }

    pub fn lookup(&mut self, q: &ApproxQuery) -> Option<ApproxHit> {
        let text = q.text;
        let hit = self.index.lookup(
            ExactKey(q.key),
            text,
            &q.embedding,
            q.steps as usize,
            q.exact,
        )?;
        let state = self.held.get(&(hit.prompt, hit.k))?.clone();
        let pin = self.next_pin;
        self.next_pin += 1;
        self.pins.insert(pin, state.clone());
        Some(ApproxHit {
            k: hit.k as u32,
            // Rounding makes a prompt's own similarity 1 + 1e-7.
            similarity: hit.similarity.min(1.0),
            state,
            pin,
        })
    }

    pub fn unpin(&mut self, shm: &Shm, pin: u64) {
        if let Some(h) = self.pins.remove(&pin) {
            self.release_if_unread(shm, h);
        }
    }

    /// Every pin goes (the router that held them is gone).
    pub fn unpin_all(&mut self, shm: &Shm) {
        self.pins.clear();
        shm.release(&std::mem::take(&mut self.evicted));
    }

    fn release_if_unread(&mut self, shm: &Shm, h: Handle) {
        if self.pins.values().any(|p| *p == h) {
            return;
        }
        if let Some(i) = self.evicted.iter().position(|e| *e == h) {
            shm.release(&[self.evicted.swap_remove(i)]);
        }
    }

    /// Indexes a missed generation and copies the states the index keeps into this
    /// process's arena; returns how many it kept.
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
            if let Some(h) = self.held.remove(&(e.prompt, e.k)) {
                self.evicted.push(h.clone());
                self.release_if_unread(shm, h);
            }
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
                    self.held.insert((id, k), h);
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
        Ok(kept)
    }
}
