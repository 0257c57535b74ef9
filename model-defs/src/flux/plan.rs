//! A step's plan for the Flux transformer: per-block costs from the device's latency
//! models ([`Profile`]), priced on the batch's FLOPs and on the template slabs the
//! step must load, then the planner's choice (docs/design.md §Planner).

use super::config::FluxConfig;
use super::cost::{block_flops, forward_flops, kv_recompute_flops, StepShape};
use crate::planner::{plan, BlockCost, CacheMode, Plan};
use crate::profile::{Profile, Tier};

/// One template slab stream a step reads: the slab of each cached block of one
/// (template, step), `bytes` each, from `tier`. A Y-mode template has no slab for the
/// last block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlabLoad {
    pub tier: Tier,
    pub bytes: usize,
    pub mode: CacheMode,
}

/// What one step of a batch computes and reads.
#[derive(Clone, Copy, Debug)]
pub struct StepWork<'a> {
    /// Every job's shape: edits with their active tokens, full runs and captures
    /// with every token.
    pub shapes: &'a [StepShape],
    /// Inactive tokens of the edits of Y-mode templates: each cached block recomputes
    /// their K/V.
    pub recomputed: usize,
    pub loads: &'a [SlabLoad],
    /// The patterns the batch can run: KV (a full prefix) if any edit reads a KV-mode
    /// template, else Y (any).
    pub mode: CacheMode,
}

/// The per-block costs of a step.
pub fn block_costs(c: &FluxConfig, profile: &Profile, w: &StepWork<'_>) -> Vec<BlockCost> {
    let blocks = c.num_layers + c.num_single_layers;
    let share = profile.compute.intercept_s / blocks as f64;
    let slope = profile.compute.slope_s;
    let recompute = kv_recompute_flops(c, w.recomputed);
    let mut cached = vec![recompute; blocks];
    let mut full = vec![0.0; blocks];
    for s in w.shapes {
        for (b, f) in block_flops(c, *s).iter().enumerate() {
            cached[b] += f.total();
        }
        for (b, f) in block_flops(c, StepShape::full(s.text, s.image))
            .iter()
            .enumerate()
        {
            full[b] += f.total();
        }
    }
    (0..blocks)
        .map(|b| BlockCost {
            cached: (share + slope * cached[b]).max(0.0),
            full: (share + slope * full[b]).max(0.0),
            load: w
                .loads
                .iter()
                .filter(|l| l.mode == CacheMode::Kv || b + 1 < blocks)
                .map(|l| profile.load_s(l.tier, l.bytes as f64))
                .sum(),
        })
        .collect()
}

/// The plan of one step and its predicted latency, the embedders and output head
/// included.
pub fn plan_step(c: &FluxConfig, profile: &Profile, w: &StepWork<'_>) -> Plan {
    let mut p = plan(&block_costs(c, profile, w), w.mode);
    let shapes = w.shapes;
    let block_sum: f64 = shapes
        .iter()
        .flat_map(|s| block_flops(c, *s))
        .map(|f| f.total())
        .sum();
    let edges: f64 = shapes.iter().map(|s| forward_flops(c, *s)).sum::<f64>() - block_sum;
    p.latency += profile.compute.slope_s * edges;
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::Choice;
    use crate::profile::Fit;

    fn work<'a>(shapes: &'a [StepShape], loads: &'a [SlabLoad], mode: CacheMode) -> StepWork<'a> {
        StepWork {
            shapes,
            recomputed: 0,
            loads,
            mode,
        }
    }

    fn profile(flops_per_s: f64, host_bps: f64) -> Profile {
        let mut p = Profile::defaults("cpu");
        p.compute = Fit::assumed(0.0, 1.0 / flops_per_s);
        p.load_host = Fit::assumed(0.0, 1.0 / host_bps);
        p
    }

    #[test]
    fn resident_templates_are_read_from_cache_in_every_block() {
        let c = FluxConfig::small();
        let shapes = [StepShape {
            text: 256,
            active: 800,
            image: 4096,
        }];
        let p = plan_step(&c, &profile(1e11, 1e10), &work(&shapes, &[], CacheMode::Kv));
        assert_eq!(p.full_blocks(), 0);
        assert_eq!(p.bubble, 0.0);
        // The prediction is the FLOPs at the profile's rate.
        let want = forward_flops(&c, shapes[0]) / 1e11;
        assert!(
            (p.latency - want).abs() < 1e-9 * want,
            "{} vs {want}",
            p.latency
        );
    }

    #[test]
    fn slow_loads_move_blocks_to_full_compute_and_fast_ones_do_not() {
        let c = FluxConfig::small();
        let shapes = [StepShape {
            text: 256,
            active: 400,
            image: 4096,
        }];
        let slab = 4096 * 2 * c.hidden() * 2;
        let load = |bps: f64| {
            plan_step(
                &c,
                &profile(1e11, bps),
                &work(
                    &shapes,
                    &[SlabLoad {
                        tier: Tier::Host,
                        bytes: slab,
                        mode: CacheMode::Kv,
                    }],
                    CacheMode::Kv,
                ),
            )
        };
        let fast = load(1e11);
        assert_eq!(fast.full_blocks(), 0, "{fast:?}");
        let slow = load(2e6);
        assert!(slow.full_blocks() > 0, "{slow:?}");
        assert!(slow.choices[..slow.full_blocks()]
            .iter()
            .all(|&x| x == Choice::Full));
    }

    #[test]
    fn y_mode_prices_the_recompute_and_skips_the_last_load() {
        let c = FluxConfig::small();
        let shapes = [StepShape {
            text: 256,
            active: 400,
            image: 4096,
        }];
        let load = |mode| SlabLoad {
            tier: Tier::Host,
            bytes: 1 << 20,
            mode,
        };
        let p = profile(1e11, 1e10);
        let kv = block_costs(
            &c,
            &p,
            &work(&shapes, &[load(CacheMode::Kv)], CacheMode::Kv),
        );
        let y = block_costs(
            &c,
            &p,
            &StepWork {
                recomputed: 4096 - 400,
                ..work(&shapes, &[load(CacheMode::Y)], CacheMode::Y)
            },
        );
        let n = kv.len();
        let extra = kv_recompute_flops(&c, 4096 - 400) / 1e11;
        for b in 0..n {
            assert!((y[b].cached - kv[b].cached - extra).abs() < 1e-12);
            assert_eq!(y[b].full, kv[b].full);
        }
        assert_eq!(kv[n - 1].load, kv[0].load);
        assert_eq!((y[n - 2].load, y[n - 1].load), (kv[0].load, 0.0));
        // Slow loads: Y mode may compute any blocks in full, and is never slower.
        let slow = profile(1e11, 1e6);
        let ky = plan_step(
            &c,
            &slow,
            &work(&shapes, &[load(CacheMode::Kv)], CacheMode::Kv),
        );
        let yy = plan_step(
            &c,
            &slow,
            &StepWork {
                recomputed: 0,
                ..work(&shapes, &[load(CacheMode::Kv)], CacheMode::Y)
            },
        );
        assert!(yy.latency <= ky.latency + 1e-12, "{yy:?} vs {ky:?}");
    }
}
