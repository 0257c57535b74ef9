//! The bubble-free planner (docs/design.md §Planner): for one step of a batch, which blocks
//! read their cached activations and which compute every token.
//!
//! A cached block costs a load of its cache on the copy path, `load`, and the compute
//! of the batch's active tokens against it, `cached`; a full block computes every token,
//! `full`, and loads nothing. Loads run back to back on the copy path from the start of
//! the step, in block order, while compute runs block after block; a cached block
//! starts when the block before it has finished and its own load has landed. The step
//! takes the time its last block finishes ([`latency`]); what it spends waiting for
//! loads is its bubble. Computing the first blocks fully gives the loads of the later
//! ones time to land: the planner finds the cheapest trade.
//!
//! - **KV mode** (the template caches K and V): a full block needs the full hidden
//!   state, which only full blocks before it produce, so the full blocks form a prefix.
//!   There are `n + 1` candidates; each is evaluated.
//! - **Y mode** (the template caches each block's output): any pattern is valid. The
//!   planner keeps, block by block, the Pareto front of (compute end, load end) over
//!   the patterns so far: a pattern whose two times are both no better than another's
//!   can never finish first, so the front holds an optimal pattern and stays small.
//!
//! Both are exact for this cost model: property tests compare them with brute force
//! over every valid pattern. The planner is a pure function: costs in, choices and
//! the predicted latency out.

/// The costs of one block at one step of a batch, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockCost {
    /// Compute with the cache: the batch's active tokens only.
    pub cached: f64,
    /// Compute of every token.
    pub full: f64,
    /// Loading the block's cache (zero when it is resident).
    pub load: f64,
}

/// What a template caches per block (`kv` or `y` in config, requests and files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// K and V: full blocks must form a prefix.
    #[default]
    Kv,
    /// Block outputs: any pattern.
    Y,
}

impl CacheMode {
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Kv => "kv",
            CacheMode::Y => "y",
        }
    }
}

impl std::str::FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kv" => Ok(CacheMode::Kv),
            "y" => Ok(CacheMode::Y),
            other => Err(format!(
                "cache mode `{other}`: expected `kv` (K and V per block) or `y` (block outputs)"
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Cached,
    Full,
}

/// The planner's answer for one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub choices: Vec<Choice>,
    /// Predicted step latency.
    pub latency: f64,
    /// Of which, waiting for loads.
    pub bubble: f64,
}

impl Plan {
    /// Blocks that compute every token (in KV mode, a prefix of this length).
    pub fn full_blocks(&self) -> usize {
        self.choices.iter().filter(|&&c| c == Choice::Full).count()
    }
}

/// The step latency of `choices` and its bubble.
pub fn latency(costs: &[BlockCost], choices: &[Choice]) -> (f64, f64) {
    let (mut compute_end, mut load_end, mut busy) = (0.0f64, 0.0f64, 0.0f64);
    for (c, &x) in costs.iter().zip(choices) {
        match x {
            Choice::Cached => {
                load_end += c.load;
                compute_end = compute_end.max(load_end) + c.cached;
                busy += c.cached;
            }
            Choice::Full => {
                compute_end += c.full;
                busy += c.full;
            }
        }
    }
    (compute_end, (compute_end - busy).max(0.0))
}

/// Whether `choices` is a pattern `mode` can run.
pub fn valid(mode: CacheMode, choices: &[Choice]) -> bool {
    match mode {
        CacheMode::Y => true,
        CacheMode::Kv => choices
            .windows(2)
            .all(|w| w != [Choice::Cached, Choice::Full]),
    }
}

/// The fastest valid pattern for `costs` in `mode` (in KV mode, among equally fast
/// prefixes the shortest: it computes least).
pub fn plan(costs: &[BlockCost], mode: CacheMode) -> Plan {
    let choices = match mode {
        CacheMode::Kv => plan_prefix(costs),
        CacheMode::Y => plan_any(costs),
    };
    let (latency, bubble) = latency(costs, &choices);
    Plan {
        choices,
        latency,
        bubble,
    }
}

/// The pattern of `n` blocks whose first `k` are full (a KV-mode plan).
pub fn prefix(n: usize, k: usize) -> Vec<Choice> {
    (0..n)
        .map(|b| if b < k { Choice::Full } else { Choice::Cached })
        .collect()
}

fn plan_prefix(costs: &[BlockCost]) -> Vec<Choice> {
    let n = costs.len();
    let mut best = (f64::INFINITY, 0);
    for k in 0..=n {
        let t = latency(costs, &prefix(n, k)).0;
        if t < best.0 {
            best = (t, k);
        }
    }
    prefix(n, best.1)
}

/// One pattern of the Pareto front: its compute and load end times, and how it was
/// reached (the block's choice and the index of the state before it).
#[derive(Clone, Copy)]
struct State {
    compute_end: f64,
    load_end: f64,
    full_count: usize,
    choice: Choice,
    parent: usize,
}

fn plan_any(costs: &[BlockCost]) -> Vec<Choice> {
    let root = State {
        compute_end: 0.0,
        load_end: 0.0,
        full_count: 0,
        choice: Choice::Cached,
        parent: usize::MAX,
    };
    let mut layers: Vec<Vec<State>> = vec![vec![root]];
    for c in costs {
        let prev = layers.last().expect("the root layer");
        let mut next: Vec<State> = Vec::with_capacity(2 * prev.len());
        for (i, s) in prev.iter().enumerate() {
            let load_end = s.load_end + c.load;
            next.push(State {
                compute_end: s.compute_end.max(load_end) + c.cached,
                load_end,
                full_count: s.full_count,
                choice: Choice::Cached,
                parent: i,
            });
            next.push(State {
                compute_end: s.compute_end + c.full,
                load_end: s.load_end,
                full_count: s.full_count + 1,
                choice: Choice::Full,
                parent: i,
            });
        }
        layers.push(pareto(next));
    }
    let last = layers.last().expect("at least the root");
    let mut at = (0..last.len())
        .min_by(|&a, &b| {
            let (x, y) = (&last[a], &last[b]);
            x.compute_end
                .total_cmp(&y.compute_end)
                .then(x.full_count.cmp(&y.full_count))
        })
        .expect("a non-empty front");
    let mut choices = vec![Choice::Cached; costs.len()];
    for b in (0..costs.len()).rev() {
        let s = layers[b + 1][at];
        choices[b] = s.choice;
        at = s.parent;
    }
    choices
}

/// The states no other state beats on both compute end and load end.
fn pareto(mut states: Vec<State>) -> Vec<State> {
    states.sort_by(|a, b| {
        a.compute_end
            .total_cmp(&b.compute_end)
            .then(a.load_end.total_cmp(&b.load_end))
            .then(a.full_count.cmp(&b.full_count))
    });
    let mut front: Vec<State> = Vec::with_capacity(states.len());
    let mut best_load = f64::INFINITY;
    for s in states {
        // Sorted by compute end: a state survives only with a strictly earlier load end
        // than every state before it.
        if s.load_end < best_load {
            best_load = s.load_end;
            front.push(s);
        }
    }
    front
}

#[cfg(test)]
mod tests;
