//! The planner against brute force over every valid pattern, and the two regimes the
//! design describes.

use proptest::prelude::*;

use super::*;

/// Every valid pattern's latency; the best one and its latency.
fn brute_force(costs: &[BlockCost], mode: CacheMode) -> (Vec<Choice>, f64, bool) {
    let n = costs.len();
    let mut all: Vec<(f64, Vec<Choice>)> = (0..1u32 << n)
        .map(|bits| {
            (0..n)
                .map(|b| {
                    if bits >> b & 1 == 1 {
                        Choice::Full
                    } else {
                        Choice::Cached
                    }
                })
                .collect::<Vec<_>>()
        })
        .filter(|c| valid(mode, c))
        .map(|c| (latency(costs, &c).0, c))
        .collect();
    all.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Whether the best is clearly the only best (else the planner may pick a tie).
    let unique = all.len() < 2 || all[1].0 - all[0].0 > 1e-9 * all[0].0.max(1e-9);
    (all[0].1.clone(), all[0].0, unique)
}

fn costs_strategy() -> impl Strategy<Value = Vec<BlockCost>> {
    prop::collection::vec(
        (0.001f64..1.0, 0.001f64..1.0, 0.0f64..2.0).prop_map(|(cached, extra, load)| BlockCost {
            cached,
            // Computing every token costs at least as much as the active ones.
            full: cached + extra,
            load,
        }),
        0..=12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn equals_brute_force_in_both_modes(costs in costs_strategy()) {
        for mode in [CacheMode::Kv, CacheMode::Y] {
            let p = plan(&costs, mode);
            let (best, best_t, unique) = brute_force(&costs, mode);
            prop_assert!(valid(mode, &p.choices), "{mode:?}: {:?}", p.choices);
            prop_assert_eq!(p.choices.len(), costs.len());
            // The predicted latency is the pattern's, and no valid pattern beats it.
            let (t, bubble) = latency(&costs, &p.choices);
            prop_assert_eq!(p.latency, t);
            prop_assert_eq!(p.bubble, bubble);
            prop_assert!((p.latency - best_t).abs() <= 1e-9 * best_t.max(1.0),
                "{mode:?}: planner {} vs brute force {best_t}", p.latency);
            if unique {
                prop_assert_eq!(&p.choices, &best, "{:?}", mode);
            }
            if mode == CacheMode::Kv {
                // A prefix: every full block comes before every cached one.
                let k = p.full_blocks();
                prop_assert!(p.choices[..k].iter().all(|&c| c == Choice::Full));
            }
        }
    }
}

fn uniform(n: usize, cached: f64, full: f64, load: f64) -> Vec<BlockCost> {
    vec![BlockCost { cached, full, load }; n]
}

#[test]
fn when_compute_dominates_every_block_reads_its_cache() {
    // Loads far shorter than a block's compute hide behind it (after the first).
    let costs = uniform(57, 0.010, 0.035, 0.002);
    for mode in [CacheMode::Kv, CacheMode::Y] {
        let p = plan(&costs, mode);
        assert_eq!(p.full_blocks(), 0, "{mode:?}");
        // The only wait is the first block's load.
        assert!((p.bubble - 0.002).abs() < 1e-12, "{mode:?}: {}", p.bubble);
    }
}

#[test]
fn when_loading_dominates_a_prefix_computes_fully_and_hides_the_loads() {
    // Loading a block takes 3x its cached compute: reading every cache would wait on
    // the copy path most of the step. Computing the first blocks fully (each 2.5x a
    // cached block) gives the loads time to land.
    let n = 20;
    let costs = uniform(n, 0.010, 0.025, 0.030);
    let all_cached = latency(&costs, &vec![Choice::Cached; n]).0;
    let all_full = latency(&costs, &vec![Choice::Full; n]).0;
    let p = plan(&costs, CacheMode::Kv);
    let k = p.full_blocks();
    println!(
        "all cached {all_cached:.3} s, all full {all_full:.3} s, planner {k} full blocks: {:.3} s (bubble {:.3} s)",
        p.latency, p.bubble
    );
    assert!(k > 0 && k < n, "{k}");
    assert!(p.latency < all_cached && p.latency < all_full);
    // Y mode may interleave, and is never slower.
    let y = plan(&costs, CacheMode::Y);
    assert!(y.latency <= p.latency + 1e-12);
}

#[test]
fn resident_caches_load_nothing() {
    let costs = uniform(8, 0.01, 0.03, 0.0);
    let p = plan(&costs, CacheMode::Kv);
    assert_eq!((p.full_blocks(), p.bubble), (0, 0.0));
    assert!((p.latency - 0.08).abs() < 1e-12);
    assert_eq!(plan(&[], CacheMode::Y).latency, 0.0);
}

/// FLUX.1 has 57 blocks: the planner runs for every step, so it must stay small. Prints
/// the Y-mode time on random costs (not asserted: tests never assert wall-clock time).
#[test]
fn plans_57_blocks() {
    let mut seed = 7u64;
    let mut r = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let costs: Vec<BlockCost> = (0..57)
        .map(|_| {
            let cached = 0.005 + 0.01 * r();
            BlockCost {
                cached,
                full: cached * (1.5 + 2.0 * r()),
                load: 0.02 * r(),
            }
        })
        .collect();
    let t0 = std::time::Instant::now();
    let y = plan(&costs, CacheMode::Y);
    let ty = t0.elapsed();
    let t0 = std::time::Instant::now();
    let kv = plan(&costs, CacheMode::Kv);
    let tkv = t0.elapsed();
    println!(
        "57 blocks: KV {} full, {:.4} s in {tkv:?}; Y {} full, {:.4} s in {ty:?}",
        kv.full_blocks(),
        kv.latency,
        y.full_blocks(),
        y.latency
    );
    assert!(y.latency <= kv.latency + 1e-12);
}
