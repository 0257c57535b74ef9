//! A step's plan for the Flux transformer: per-block costs from the device's latency
//! models ([`Profile`]), priced on the batch's FLOPs and on the template slabs the
//! step must load, then the planner's choice (DESIGN.md §Planner).

use super::config::FluxConfig;
use super::cost::{block_flops, forward_flops, StepShape};
use crate::planner::{plan, BlockCost, CacheMode, Plan};
use crate::profile::{Profile, Tier};

/// One template slab stream a step reads: every block's slab of one (template, step),
/// `bytes` each, from `tier`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlabLoad {
    pub tier: Tier,
    pub bytes: usize,
}

/// The per-block costs of a step over requests of `shapes` (edits with their active
/// tokens; full runs and captures with every token) reading `loads`.
pub fn block_costs(
    c: &FluxConfig,
    profile: &Profile,
    shapes: &[StepShape],
    loads: &[SlabLoad],
) -> Vec<BlockCost> {
    let blocks = c.num_layers + c.num_single_layers;
    let share = profile.compute.intercept_s / blocks as f64;
    let slope = profile.compute.slope_s;
    let mut cached = vec![0.0; blocks];
    let mut full = vec![0.0; blocks];
    for s in shapes {
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
    let load: f64 = loads
        .iter()
        .map(|l| profile.load_s(l.tier, l.bytes as f64))
        .sum();
    (0..blocks)
        .map(|b| BlockCost {
            cached: (share + slope * cached[b]).max(0.0),
            full: (share + slope * full[b]).max(0.0),
            load,
        })
        .collect()
}

/// The plan of one step (KV mode: a full prefix) and its predicted latency, the
/// embedders and output head included.
pub fn plan_step(
    c: &FluxConfig,
    profile: &Profile,
    shapes: &[StepShape],
    loads: &[SlabLoad],
) -> Plan {
    let mut p = plan(&block_costs(c, profile, shapes, loads), CacheMode::Kv);
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
        let p = plan_step(&c, &profile(1e11, 1e10), &shapes, &[]);
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
                &shapes,
                &[SlabLoad {
                    tier: Tier::Host,
                    bytes: slab,
                }],
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
}
