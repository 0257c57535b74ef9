//! Which cached noise state the approximate cache evicts: a score per state, the lowest
//! goes first. Pure functions of a state's counters, so that the property tests can
//! recompute every score from a brute-force model.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The eviction policy (`[approx_cache] policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionPolicy {
    /// NIRVANA's LCBFU: score = access frequency x K (the steps a hit saves). Its
    /// faults, as the paper's own figures show them: frequencies never age, a new state
    /// (frequency 0) is the first to go however useful it would be, and the benefit
    /// ignores how likely a hit at that K is.
    Lcbfu,
    /// Least recently used (for the policy study).
    Lru,
    /// Least frequently used (for the policy study).
    Lfu,
    /// The default: GDSF-style. Score = L + decayed frequency x K/N x the observed hit
    /// rate at that K, where L ("inflation") is the score of the last state evicted, so
    /// a new state starts above the stale ones instead of below them; frequencies halve
    /// every `half_life` lookups (aging); and a K whose hits are rare (high similarity
    /// thresholds) weighs less than its step count alone says.
    #[default]
    Gdsf,
}

impl EvictionPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicy::Lcbfu => "lcbfu",
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::Gdsf => "gdsf",
        }
    }
}

impl FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lcbfu" => Ok(EvictionPolicy::Lcbfu),
            "lru" => Ok(EvictionPolicy::Lru),
            "lfu" => Ok(EvictionPolicy::Lfu),
            "gdsf" => Ok(EvictionPolicy::Gdsf),
            _ => Err(format!(
                "approximate cache policy {s:?}: expected lcbfu, lru, lfu or gdsf"
            )),
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A cached state's counters, as the policies read them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Counters {
    /// Steps a hit on it skips, of `steps`.
    pub k: usize,
    pub steps: usize,
    /// Hits (LCBFU and LFU count them plainly).
    pub hits: u64,
    /// GDSF's frequency at `touched`: 1 at insertion, +1 per hit, halving every
    /// half-life since.
    pub freq: f64,
    /// The lookup clock at the last insertion or hit.
    pub touched: u64,
    /// GDSF's inflation L when it was last touched.
    pub base: f64,
}

/// How many lookups halve a GDSF frequency.
pub const HALF_LIFE_LOOKUPS: f64 = 1000.0;

/// `c`'s score under `policy` at lookup clock `now`; `hit_rate` is the observed share of
/// lookups a state at `c.k / c.steps` served (GDSF only).
pub fn score(policy: EvictionPolicy, c: &Counters, now: u64, hit_rate: f64) -> f64 {
    match policy {
        EvictionPolicy::Lcbfu => c.hits as f64 * c.k as f64,
        EvictionPolicy::Lru => c.touched as f64,
        EvictionPolicy::Lfu => c.hits as f64,
        EvictionPolicy::Gdsf => {
            c.base
                + decayed(c.freq, now.saturating_sub(c.touched))
                    * (c.k as f64 / c.steps.max(1) as f64)
                    * hit_rate
        }
    }
}

/// `freq` after `age` lookups.
pub fn decayed(freq: f64, age: u64) -> f64 {
    freq * (-(age as f64) / HALF_LIFE_LOOKUPS).exp2()
}
