//! The approximate cache against a brute-force model of it: random inserts and lookups
//! under every policy, with the model recomputing what each step must have done.

use std::collections::HashMap;

use proptest::prelude::*;

use super::policy::{score, Counters};
use super::*;

const DIM: usize = 16;

/// A prompt family's embedding: a base direction per family, nudged per variant, so
/// that similarities spread over the thresholds' range.
fn embedding(family: u64, variant: u64) -> Vec<f32> {
    let mut state = family.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5851_F42D;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let base: Vec<f32> = (0..DIM).map(|_| next()).collect();
    let mut v2 = variant.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    base.iter()
        .map(|b| {
            v2 = v2.wrapping_mul(6364136223846793005).wrapping_add(1);
            b + 0.25 * ((v2 >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Insert {
        key: u64,
        family: u64,
        variant: u64,
    },
    Lookup {
        key: u64,
        family: u64,
        variant: u64,
        exact: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2u64, 0..6u64, 0..4u64).prop_map(|(key, family, variant)| Op::Insert {
            key,
            family,
            variant
        }),
        (0..2u64, 0..6u64, 0..4u64, any::<bool>()).prop_map(|(key, family, variant, exact)| {
            Op::Lookup {
                key,
                family,
                variant,
                exact,
            }
        }),
    ]
}

fn policy() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![
        Just(EvictionPolicy::Lcbfu),
        Just(EvictionPolicy::Lru),
        Just(EvictionPolicy::Lfu),
        Just(EvictionPolicy::Gdsf)
    ]
}

/// The model: per state, what the policies read, counted independently of the cache.
#[derive(Clone, Copy)]
struct State {
    hits: u64,
    touched: u64,
}

struct Model {
    states: HashMap<(PromptId, usize), State>,
    prompts: HashMap<PromptId, (u64, u64, Vec<f32>)>, // key, text, embedding
    clock: u64,
}

impl Model {
    /// The brute-force score of LCBFU, LRU and LFU; GDSF's from its counters (its
    /// decay and hit rates are the cache's own arithmetic, checked by the ordering).
    fn score(
        &self,
        cache: &ApproxCache,
        policy: EvictionPolicy,
        id: PromptId,
        c: &Counters,
    ) -> f64 {
        let s = self.states[&(id, c.k)];
        match policy {
            EvictionPolicy::Lcbfu => s.hits as f64 * c.k as f64,
            EvictionPolicy::Lru => s.touched as f64,
            EvictionPolicy::Lfu => s.hits as f64,
            EvictionPolicy::Gdsf => score(policy, c, cache.clock, cache.hit_rate(c.k, c.steps)),
        }
    }
}

const STEPS: usize = 28;
const BYTES: u64 = 100;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_cache_agrees_with_a_brute_force_model(
        policy in policy(),
        capacity_states in 0u64..24,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut cache = ApproxCache::new(capacity_states * BYTES, policy, Thresholds::default(), &STORE_FRACTIONS);
        let mut m = Model { states: HashMap::new(), prompts: HashMap::new(), clock: 0 };
        let all_ks = store_steps(STEPS, &STORE_FRACTIONS);
        prop_assert_eq!(&all_ks, &vec![3, 6, 8, 11, 14]);
        for op in ops {
            match op {
                Op::Insert { key, family, variant } => {
                    let text = family * 16 + variant;
                    let before: Vec<(PromptId, Counters, f64)> = cache
                        .counters()
                        .into_iter()
                        .map(|(id, c)| (id, c, m.score(&cache, policy, id, &c)))
                        .collect();
                    let (id, evicted) =
                        cache.insert(ExactKey(key), text, &embedding(family, variant), STEPS, BYTES);
                    // Each victim had the lowest score of what was there (ties aside).
                    let mut left = before.clone();
                    for e in &evicted {
                        let (i, &(_, _, s)) = left
                            .iter()
                            .enumerate()
                            .find(|(_, (p, c, _))| *p == e.prompt && c.k == e.k)
                            .expect("a victim the cache held");
                        let min = left.iter().map(|x| x.2).fold(f64::INFINITY, f64::min);
                        prop_assert!(s <= min, "{policy}: evicted score {s} above the minimum {min}");
                        left.remove(i);
                        m.states.remove(&(e.prompt, e.k));
                        if !m.states.keys().any(|(p, _)| *p == e.prompt) {
                            m.prompts.remove(&e.prompt);
                        }
                    }
                    // A miss inserts all |K| states, or the deepest that fit.
                    let fit = (capacity_states as usize).min(all_ks.len());
                    match id {
                        Some(id) => {
                            let ks = cache.states_of(id);
                            prop_assert_eq!(&ks[..], &all_ks[all_ks.len() - fit..]);
                            for k in ks {
                                m.states.insert((id, k), State { hits: 0, touched: m.clock });
                            }
                            m.prompts.insert(id, (key, text, unit(&embedding(family, variant))));
                        }
                        None => prop_assert_eq!(fit, 0),
                    }
                }
                Op::Lookup { key, family, variant, exact } => {
                    m.clock += 1;
                    let text = family * 16 + variant;
                    let q = unit(&embedding(family, variant));
                    let got = cache.lookup(ExactKey(key), text, &embedding(family, variant), STEPS, exact);
                    // The nearest prompts of the same key (and text, when exact): a
                    // prompt inserted twice, or a near tie in the last bit, may be
                    // either, so every prompt within 1e-5 of the best is a candidate.
                    let sims: Vec<(PromptId, f32)> = m
                        .prompts
                        .iter()
                        .filter(|(_, (k, t, _))| *k == key && (!exact || *t == text))
                        .map(|(id, (_, _, e))| (*id, e.iter().zip(&q).map(|(a, b)| a * b).sum::<f32>()))
                        .collect();
                    let best = sims.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
                    let candidates: Vec<(PromptId, f32)> =
                        sims.into_iter().filter(|x| x.1 >= best - 1e-5).collect();
                    // What a candidate would give: K from its similarity, and a hole
                    // resolves to the largest K' <= K it still holds.
                    let hit_of = |id: PromptId, s: f32| {
                        let wanted = Thresholds::default().skip_for(s, STEPS)?;
                        let k = m
                            .states
                            .keys()
                            .filter(|(p, k)| *p == id && *k <= wanted)
                            .map(|(_, k)| *k)
                            .max()?;
                        Some((k, wanted))
                    };
                    match got {
                        Some(h) => {
                            let &(_, s) = candidates
                                .iter()
                                .find(|c| c.0 == h.prompt)
                                .expect("the hit is a nearest prompt");
                            prop_assert!((h.similarity - s).abs() < 1e-4);
                            prop_assert_eq!(Some((h.k, h.wanted)), hit_of(h.prompt, h.similarity));
                            let st = m.states.get_mut(&(h.prompt, h.k)).expect("a held state");
                            st.hits += 1;
                            st.touched = m.clock;
                        }
                        None => prop_assert!(
                            candidates.is_empty()
                                || candidates.iter().any(|&(id, s)| hit_of(id, s).is_none()),
                            "a miss where every nearest prompt has a state: {candidates:?}"
                        ),
                    }
                }
            }
            // Capacity, and the index holds exactly the prompts with states.
            prop_assert!(cache.used() <= cache.capacity());
            prop_assert_eq!(cache.used(), m.states.len() as u64 * BYTES);
            prop_assert_eq!(cache.prompts(), m.prompts.len());
        }
    }

    #[test]
    fn the_k_selector_is_monotone_in_the_similarity(
        a in -1.0f32..1.0,
        b in -1.0f32..1.0,
        steps in 2usize..100,
    ) {
        let t = Thresholds::default();
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        // None (a miss) orders below every K.
        prop_assert!(t.skip_for(lo, steps) <= t.skip_for(hi, steps));
    }
}

#[test]
fn the_papers_table_scales_to_the_requests_steps() {
    assert_eq!(store_steps(50, &STORE_FRACTIONS), vec![5, 10, 15, 20, 25]);
    assert_eq!(store_steps(28, &STORE_FRACTIONS), vec![3, 6, 8, 11, 14]);
    assert_eq!(store_steps(4, &STORE_FRACTIONS), vec![1, 2]);
    let t = Thresholds::default();
    assert_eq!(t.skip_for(0.96, 50), Some(25));
    assert_eq!(
        t.skip_for(0.95, 50),
        Some(20),
        "strictly above the threshold"
    );
    assert_eq!(t.skip_for(0.70, 28), Some(3));
    assert_eq!(t.skip_for(0.65, 28), None);
    assert!(Thresholds::new(vec![(0.9, 0.2), (0.8, 0.4)]).is_err());
    assert!(Thresholds::new(vec![(0.9, 1.5)]).is_err());
}

#[test]
fn lcbfu_evicts_new_states_first_and_gdsf_does_not() {
    // One prompt hit often at K = 14, then a stream of one-off prompts: LCBFU keeps
    // the old prompt's states (score hits x K) and evicts each newcomer's at once on
    // the next insert; GDSF's inflation lets newcomers displace the stale states.
    for policy in [EvictionPolicy::Lcbfu, EvictionPolicy::Gdsf] {
        let mut c = ApproxCache::new(8 * BYTES, policy, Thresholds::default(), &STORE_FRACTIONS);
        let e = embedding(1, 0);
        let (old, _) = c.insert(ExactKey(0), 1, &e, STEPS, BYTES);
        for _ in 0..3 {
            assert!(c.lookup(ExactKey(0), 1, &e, STEPS, false).is_some());
        }
        let mut newest = None;
        for f in 2..40 {
            (newest, _) = c.insert(ExactKey(0), f, &embedding(f, 0), STEPS, BYTES);
            // Time passes between newcomers.
            for _ in 0..200 {
                c.lookup(ExactKey(1), 0, &e, STEPS, false);
            }
        }
        let old_left = c.states_of(old.unwrap()).len();
        let new_left = c.states_of(newest.unwrap()).len();
        match policy {
            EvictionPolicy::Lcbfu => assert!(old_left > 0, "LCBFU keeps the frequent prompt"),
            _ => assert!(
                old_left == 0 && new_left == 5,
                "GDSF ages it out: {old_left}, {new_left}"
            ),
        }
    }
}

/// Above its threshold a key's lookups go through the HNSW graph: against the exact
/// scan over the live prompts (brute force), the prompt it picks gives the same K
/// nearly always and never loses much similarity, and it never picks an evicted
/// prompt (evictions leave dead nodes in the graph, filtered out, until a rebuild).
#[test]
fn the_graph_index_agrees_with_the_exact_scan() {
    use super::trace::{generate, TraceSpec};
    let spec = TraceSpec {
        requests: 1600,
        families: 400,
        dim: 64,
        ..TraceSpec::default()
    };
    let trace = generate(&spec);
    let (key, steps) = (ExactKey(1), 28);
    // Room for 300 prompts of 5 states: evictions start after 300 misses, and the graph
    // (from 100 prompts) is rebuilt as the dead pile up.
    let mut cache = ApproxCache::new(
        1500,
        EvictionPolicy::Lru,
        Thresholds::default(),
        &STORE_FRACTIONS,
    )
    .with_ann_from(100);
    let t = Thresholds::default();
    let (mut compared, mut same_k, mut worst) = (0, 0, 0f32);
    for (i, r) in trace.iter().enumerate() {
        if cache.uses_graph(key) {
            let q = unit(&r.embedding);
            let rows = &cache.by_key[&key];
            let brute = rows
                .iter()
                .map(|(id, e)| (id, simd::dot(e, &q)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap();
            let (id, s) = cache
                .nearest(key, &r.embedding, None)
                .expect("a live prompt");
            assert!(cache.prompts.contains_key(&id), "an evicted prompt");
            assert!((s - simd::dot(rows.get(id).unwrap(), &q)).abs() < 1e-6);
            compared += 1;
            same_k += (t.skip_for(s, steps) == t.skip_for(brute.1, steps)) as usize;
            worst = worst.max(brute.1 - s);
        }
        if cache
            .lookup(key, i as u64, &r.embedding, steps, false)
            .is_none()
        {
            cache.insert(key, i as u64, &r.embedding, steps, 1);
        }
        assert!(cache.used() <= cache.capacity());
    }
    let agree = same_k as f64 / compared as f64;
    println!(
        "graph vs scan: {compared} lookups, same K {agree:.3}, worst similarity loss {worst:.4}"
    );
    assert!(compared > 1000, "the graph served {compared} lookups");
    assert!(agree >= 0.95, "same K in {agree:.3} of lookups");
    assert!(worst < 0.1, "similarity lost: {worst}");
}
