//! The approximate cache of text-to-image noise states (NIRVANA; docs/design.md
//! §"Approximate caching"): which earlier prompt's intermediate latents a new request
//! can start from, at which step, and which states to keep.
//!
//! This is the cache's pure core, without tensors: the caller keeps the states' bytes
//! (in the cache's host and disk tiers) under the ids this hands out.
//!
//! - **Keys.** A state serves a request only if the exact fields match ([`ExactKey`]:
//!   model fingerprint, resolution, steps, guidance, scheduler, adapters, hashed by the
//!   caller); among those, the prompt is matched by the cosine similarity of its CLIP
//!   pooled embedding.
//! - **Which K.** A miss stores the latents after the steps of [`store_steps`] (the
//!   paper's 5..25 of 50, scaled to the request's steps); a lookup picks K from the
//!   nearest prompt's similarity ([`Thresholds`]) and takes the largest state it still
//!   has at or below K (evicted states leave holes).
//! - **Index.** An exact scan of the prompts with the same exact key (unit vectors,
//!   one SIMD dot product each), and above [`ann::ANN_FROM`] prompts under a key an HNSW
//!   graph ([`ann`]) whose candidates are then scored exactly.
//! - **Eviction** by [`EvictionPolicy`] within a byte capacity; a prompt whose states are all
//!   evicted leaves the index.

pub mod ann;
pub mod policy;
mod rows;
pub mod trace;

use std::collections::{BTreeMap, HashMap};

use denoised_runtime::cpu::simd;

use policy::{score, Counters};
pub use policy::{EvictionPolicy, HALF_LIFE_LOOKUPS};

/// The cache `[approx_cache]` describes (policy and thresholds checked; `None`
/// when its memory is 0). Its capacity is both tiers', host and disk.
pub fn from_config(
    c: &denoised_runtime::config::ApproxCacheConfig,
) -> Result<Option<ApproxCache>, String> {
    let policy: EvictionPolicy = c.policy.parse()?;
    let thresholds = Thresholds::new(c.thresholds.clone())?;
    let capacity = c.host_bytes.saturating_add(c.disk_bytes);
    Ok(
        (c.host_bytes > 0)
            .then(|| ApproxCache::new(capacity, policy, thresholds, &STORE_FRACTIONS)),
    )
}

/// The fields a cached state and a request must share exactly, hashed by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExactKey(pub u64);

/// A cached prompt (all its states share it).
pub type PromptId = u64;

/// The paper's stored steps, as fractions of the step count: 5, 10, 15, 20, 25 of 50.
pub const STORE_FRACTIONS: [f64; 5] = [0.1, 0.2, 0.3, 0.4, 0.5];

/// The steps after which a miss of `steps` steps stores its latents: `fractions` of
/// `steps`, rounded, distinct, within `1..steps` (for 28 steps: 3, 6, 8, 11, 14).
pub fn store_steps(steps: usize, fractions: &[f64]) -> Vec<usize> {
    let mut ks: Vec<usize> = fractions
        .iter()
        .map(|f| (f * steps as f64).round() as usize)
        .filter(|&k| k >= 1 && k < steps)
        .collect();
    ks.sort_unstable();
    ks.dedup();
    ks
}

/// The similarity thresholds that pick K: the first row whose similarity the match
/// exceeds gives K as a fraction of the steps; below every row, a miss.
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// `(similarity, fraction of the steps)`, similarity descending.
    rows: Vec<(f32, f64)>,
}

impl Default for Thresholds {
    /// The paper's table (profiled on a DDIM UNet model; to be re-profiled for FLUX):
    /// > 0.95: 25/50, > 0.90: 20/50, > 0.85: 15/50, > 0.75: 10/50, > 0.65: 5/50.
    fn default() -> Self {
        Thresholds {
            rows: vec![
                (0.95, 0.5),
                (0.90, 0.4),
                (0.85, 0.3),
                (0.75, 0.2),
                (0.65, 0.1),
            ],
        }
    }
}

impl Thresholds {
    /// A table from `(similarity, fraction)` rows in any order. Refused unless the
    /// fractions do not decrease with the similarity (a closer prompt never skips less)
    /// and lie in (0, 1).
    pub fn new(mut rows: Vec<(f32, f64)>) -> Result<Self, String> {
        rows.sort_by(|a, b| b.0.total_cmp(&a.0));
        if let Some(bad) = rows
            .iter()
            .find(|r| !(r.1 > 0.0 && r.1 < 1.0 && r.0.is_finite()))
        {
            return Err(format!(
                "approximate cache threshold {bad:?}: the fraction must be in (0, 1)"
            ));
        }
        if rows.windows(2).any(|w| w[0].1 < w[1].1) {
            return Err(format!(
                "approximate cache thresholds {rows:?}: a higher similarity must not skip fewer steps"
            ));
        }
        Ok(Thresholds { rows })
    }

    /// K for a match of similarity `s` in a run of `steps` steps (None: a miss).
    pub fn skip_for(&self, s: f32, steps: usize) -> Option<usize> {
        let (_, f) = self.rows.iter().find(|(t, _)| s > *t)?;
        let k = (f * steps as f64).round() as usize;
        (k >= 1 && k < steps).then_some(k)
    }
}

/// A lookup's answer: start from `prompt`'s state after step `k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hit {
    pub prompt: PromptId,
    pub k: usize,
    /// The cosine similarity of the matched prompt.
    pub similarity: f32,
    /// The K the similarity allowed (`k` is smaller where that state was evicted).
    pub wanted: usize,
}

/// A state evicted to make room: the caller drops its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub prompt: PromptId,
    pub k: usize,
}

struct Prompt {
    key: ExactKey,
    /// The caller's hash of what an `exact` lookup matches (the router's: prompt and seed).
    text: u64,
    states: BTreeMap<usize, (Counters, u64)>,
}

/// The cache's index and eviction state (see the module docs).
pub struct ApproxCache {
    capacity: u64,
    used: u64,
    policy: EvictionPolicy,
    thresholds: Thresholds,
    fractions: Vec<f64>,
    /// Lookups so far: the clock of recency and aging.
    clock: u64,
    /// GDSF's inflation: the score of the last state evicted.
    inflation: f64,
    prompts: HashMap<PromptId, Prompt>,
    /// Each key's prompts and their unit embeddings.
    by_key: HashMap<ExactKey, rows::Rows>,
    /// The graphs of the keys with many prompts, from `ann_from` prompts.
    ann: HashMap<ExactKey, ann::Ann>,
    ann_from: usize,
    /// Hits served by states at each K, in fiftieths of the steps (the paper's scale).
    hits_at: BTreeMap<usize, u64>,
    next: PromptId,
}

fn unit(v: &[f32]) -> Vec<f32> {
    let n = simd::dot(v, v).sqrt();
    if n > 0.0 {
        v.iter().map(|x| x / n).collect()
    } else {
        v.to_vec()
    }
}

fn fiftieths(k: usize, steps: usize) -> usize {
    (50.0 * k as f64 / steps.max(1) as f64).round() as usize
}

impl ApproxCache {
    pub fn new(
        capacity: u64,
        policy: EvictionPolicy,
        thresholds: Thresholds,
        fractions: &[f64],
    ) -> Self {
        ApproxCache {
            capacity,
            used: 0,
            policy,
            thresholds,
            fractions: fractions.to_vec(),
            clock: 0,
            inflation: 0.0,
            prompts: HashMap::new(),
            by_key: HashMap::new(),
            ann: HashMap::new(),
            ann_from: ann::ANN_FROM,
            hits_at: BTreeMap::new(),
            next: 1,
        }
    }

    /// The same cache with the graph index from `prompts` prompts under a key (tests
    /// and benches; serving uses [`ann::ANN_FROM`]).
    pub fn with_ann_from(mut self, prompts: usize) -> Self {
        self.ann_from = prompts.max(1);
        self
    }

    /// Whether lookups under `key` use the graph.
    pub fn uses_graph(&self, key: ExactKey) -> bool {
        self.ann.contains_key(&key)
    }

    /// Bytes of the states held.
    pub fn used(&self) -> u64 {
        self.used
    }
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    /// Prompts in the index.
    pub fn prompts(&self) -> usize {
        self.prompts.len()
    }
    /// The steps `prompt` holds states after, ascending.
    pub fn states_of(&self, prompt: PromptId) -> Vec<usize> {
        self.prompts
            .get(&prompt)
            .map_or_else(Vec::new, |p| p.states.keys().copied().collect())
    }

    /// The nearest prompt under `key` to `embedding`, and its similarity: the exact
    /// scan. With `text`, only that prompt's own entry (an `exact` request).
    fn nearest(
        &self,
        key: ExactKey,
        embedding: &[f32],
        text: Option<u64>,
    ) -> Option<(PromptId, f32)> {
        let q = unit(embedding);
        let rows = self.by_key.get(&key)?;
        if rows.dim() != q.len() {
            return None;
        }
        let best =
            |a: &(PromptId, f32), b: &(PromptId, f32)| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0));
        let score = |id: PromptId| Some((id, simd::dot(rows.get(id)?, &q)));
        match (self.ann.get(&key), text) {
            (Some(ann), None) => ann
                .candidates(&q, |id| rows.get(id).is_some())
                .into_iter()
                .filter_map(score)
                .max_by(best),
            (_, Some(t)) => rows
                .iter()
                .filter(|(id, _)| self.prompts[id].text == t)
                .map(|(id, e)| (id, simd::dot(e, &q)))
                .max_by(best),
            (None, None) => rows
                .iter()
                .map(|(id, e)| (id, simd::dot(e, &q)))
                .max_by(best),
        }
    }

    /// A request of `steps` steps under `key`: the state to start from, if any. `exact`
    /// (a request with an explicit seed that asked for exact hits only) takes only a
    /// prompt of the same text (`text`), at the K its similarity gives.
    pub fn lookup(
        &mut self,
        key: ExactKey,
        text: u64,
        embedding: &[f32],
        steps: usize,
        exact: bool,
    ) -> Option<Hit> {
        self.clock += 1;
        let (id, s) = self.nearest(key, embedding, exact.then_some(text))?;
        let wanted = self.thresholds.skip_for(s, steps)?;
        let now = self.clock;
        let inflation = self.inflation;
        let p = self.prompts.get_mut(&id)?;
        let (&k, (c, _)) = p.states.range_mut(..=wanted).next_back()?;
        if c.steps != steps {
            return None; // steps are part of the exact key; a mismatch is the caller's bug
        }
        c.freq = policy::decayed(c.freq, now - c.touched) + 1.0;
        c.hits += 1;
        c.touched = now;
        c.base = inflation;
        *self.hits_at.entry(fiftieths(k, steps)).or_default() += 1;
        Some(Hit {
            prompt: id,
            k,
            similarity: s,
            wanted,
        })
    }

    /// The observed share of lookups that a state at `k` of `steps` served, smoothed
    /// (no lookups yet: 1/2).
    pub fn hit_rate(&self, k: usize, steps: usize) -> f64 {
        let served = self.hits_at.get(&fiftieths(k, steps)).copied().unwrap_or(0);
        (served as f64 + 1.0) / (self.clock as f64 + 2.0)
    }

    /// `c`'s eviction score now.
    pub fn score(&self, c: &Counters) -> f64 {
        score(self.policy, c, self.clock, self.hit_rate(c.k, c.steps))
    }

    /// A miss: makes room for its states, `state_bytes` each, after the steps of
    /// [`store_steps`], and indexes the prompt. Returns the new prompt's id (None when
    /// no state fits the whole capacity) and the states evicted for it.
    pub fn insert(
        &mut self,
        key: ExactKey,
        text: u64,
        embedding: &[f32],
        steps: usize,
        state_bytes: u64,
    ) -> (Option<PromptId>, Vec<Evicted>) {
        let ks = store_steps(steps, &self.fractions);
        let n = (self.capacity / state_bytes.max(1)).min(ks.len() as u64) as usize;
        if n == 0 {
            return (None, Vec::new());
        }
        // Where the whole set does not fit, the deepest states: a hit at K saves K steps.
        let ks = &ks[ks.len() - n..];
        let need = state_bytes * n as u64;
        let mut evicted = Vec::new();
        while self.used + need > self.capacity {
            match self.evict_one() {
                Some(e) => evicted.push(e),
                None => break,
            }
        }
        let id = self.next;
        self.next += 1;
        let c = Counters {
            k: 0,
            steps,
            hits: 0,
            freq: 1.0,
            touched: self.clock,
            base: self.inflation,
        };
        let states = ks
            .iter()
            .map(|&k| (k, (Counters { k, ..c }, state_bytes)))
            .collect();
        let rows = self.by_key.entry(key).or_default();
        if !rows.push(id, &unit(embedding)) {
            // Another width under the same key: a caller's bug; not indexed.
            if rows.is_empty() {
                self.by_key.remove(&key);
            }
            return (None, evicted);
        }
        self.prompts.insert(id, Prompt { key, text, states });
        self.index(key, id);
        self.used += need;
        (Some(id), evicted)
    }

    /// Adds a new prompt to its key's graph, building it when the key reaches
    /// `ann_from` prompts and rebuilding it when its evicted prompts outnumber the
    /// live ones.
    fn index(&mut self, key: ExactKey, id: PromptId) {
        let rows = &self.by_key[&key];
        let rebuild = match self.ann.get_mut(&key) {
            Some(a) if !a.stale(rows.len()) => {
                a.insert(id, rows.get(id).expect("just pushed"));
                false
            }
            Some(_) => true,
            None => rows.len() >= self.ann_from,
        };
        if rebuild {
            self.ann.insert(key, ann::Ann::build(rows.iter()));
        }
    }

    /// The state with the lowest score goes (ties: the least recently touched, then the
    /// oldest prompt, then the smallest K).
    fn evict_one(&mut self) -> Option<Evicted> {
        let victim = self
            .prompts
            .iter()
            .flat_map(|(&id, p)| p.states.values().map(move |(c, _)| (id, *c)))
            .map(|(id, c)| (self.score(&c), c.touched, id, c.k))
            .min_by(|a, b| {
                a.0.total_cmp(&b.0)
                    .then(a.1.cmp(&b.1))
                    .then(a.2.cmp(&b.2))
                    .then(a.3.cmp(&b.3))
            })?;
        let (s, _, id, k) = victim;
        if self.policy == EvictionPolicy::Gdsf {
            self.inflation = self.inflation.max(s);
        }
        self.remove(id, k);
        Some(Evicted { prompt: id, k })
    }

    /// Drops `prompt`'s state after step `k` (one the caller could not store); the
    /// prompt leaves the index with its last state. Whether it was there.
    pub fn remove(&mut self, prompt: PromptId, k: usize) -> bool {
        let Some(p) = self.prompts.get_mut(&prompt) else {
            return false;
        };
        let Some((_, bytes)) = p.states.remove(&k) else {
            return false;
        };
        self.used -= bytes;
        if p.states.is_empty() {
            let key = p.key;
            self.prompts.remove(&prompt);
            let rows = self.by_key.get_mut(&key).expect("indexed under its key");
            rows.remove(prompt);
            // Well below the graph's threshold the scan is the index again.
            if rows.len() < self.ann_from / 2 {
                self.ann.remove(&key);
            }
            if rows.is_empty() {
                self.by_key.remove(&key);
            }
        }
        true
    }

    /// Every state's counters, for the policy study and tests.
    pub fn counters(&self) -> Vec<(PromptId, Counters)> {
        let mut v: Vec<_> = self
            .prompts
            .iter()
            .flat_map(|(&id, p)| p.states.values().map(move |(c, _)| (id, *c)))
            .collect();
        v.sort_by_key(|(id, c)| (*id, c.k));
        v
    }
}

#[cfg(test)]
mod tests;
