//! FLOP accounting for the Flux transformer, per block and per request.
//!
//! The planner and the router price work with these numbers, and `bench step` turns
//! them into GFLOP/s. Counts are multiply-adds x 2, for the Linear layers and for the
//! two attention products (QK^T and PV); norms, activations and modulation of a few
//! rows are left out (well under 1% of a step).

use denoised_runtime::DType;

use super::config::FluxConfig;

/// The shape of one request's step: `text` tokens, `active` image tokens computed,
/// `image` image tokens in total (keys include cached ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub text: usize,
    pub active: usize,
    pub image: usize,
}

impl StepShape {
    pub fn full(text: usize, image: usize) -> Self {
        StepShape {
            text,
            active: image,
            image,
        }
    }
}

/// FLOPs of one block, split by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockFlops {
    pub linear: f64,
    pub attention: f64,
}

impl BlockFlops {
    pub fn total(&self) -> f64 {
        self.linear + self.attention
    }
}

/// Per-block FLOPs (double blocks first, then single blocks) of one forward.
pub fn block_flops(c: &FluxConfig, s: StepShape) -> Vec<BlockFlops> {
    let d = c.hidden() as f64;
    let rows = (s.text + s.active) as f64;
    let keys = (s.text + s.image) as f64;
    // Each block has 12 d² weights per token row: double blocks qkv 3 + out 1 + ff 8
    // (per stream), single blocks qkv+mlp 7 + proj_out 5.
    let linear = 2.0 * rows * 12.0 * d * d;
    let attention = 2.0 * 2.0 * rows * keys * d;
    vec![BlockFlops { linear, attention }; c.num_layers + c.num_single_layers]
}

/// FLOPs per block of recomputing the K and V of `rows` tokens from their cached
/// input (a Y-mode template's cached block): the K|V columns of the block's
/// projection, `2d x d` weights per row.
pub fn kv_recompute_flops(c: &FluxConfig, rows: usize) -> f64 {
    let d = c.hidden() as f64;
    2.0 * rows as f64 * 2.0 * d * d
}

/// Total FLOPs of one forward, embedders and output head included.
pub fn forward_flops(c: &FluxConfig, s: StepShape) -> f64 {
    let d = c.hidden() as f64;
    let edges = 2.0
        * (s.active as f64 * (c.in_channels + c.out_channels()) as f64 * d
            + s.text as f64 * c.joint_attention_dim as f64 * d);
    block_flops(c, s).iter().map(BlockFlops::total).sum::<f64>() + edges
}

/// Bytes of template cache one step of a request reads: the K|V rows of its inactive
/// tokens for every block, and their latent after the step.
pub fn cache_read_bytes(c: &FluxConfig, s: StepShape, dtype: DType) -> usize {
    let inactive = s.image - s.active;
    let blocks = c.num_layers + c.num_single_layers;
    inactive * (blocks * 2 * c.hidden() + c.out_channels()) * dtype.size_bytes()
}

/// The per-step speedup bound of a masked step over a full one: the FLOP ratio, about
/// `(T+L)/(T+A)` (docs/design.md §Costs).
pub fn flop_bound(c: &FluxConfig, s: StepShape) -> f64 {
    forward_flops(c, StepShape::full(s.text, s.image)) / forward_flops(c, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speedup_bound_matches_design() {
        // docs/design.md: the per-step bound is about (T+L)/(T+A), 3.46x at T=512, L=4096, m=0.2.
        let c = FluxConfig::flux1_fill_dev();
        let full = forward_flops(&c, StepShape::full(512, 4096));
        let masked = forward_flops(
            &c,
            StepShape {
                text: 512,
                active: 819,
                image: 4096,
            },
        );
        let ratio = full / masked;
        assert!((ratio - 4608.0 / 1331.0).abs() < 0.05, "{ratio}");
        assert_eq!(
            ratio,
            flop_bound(
                &c,
                StepShape {
                    text: 512,
                    active: 819,
                    image: 4096
                }
            )
        );
        // An empty edit reads every token's K/V; a full one reads nothing.
        let none = cache_read_bytes(
            &c,
            StepShape {
                text: 512,
                active: 0,
                image: 4096,
            },
            DType::BF16,
        );
        assert_eq!(none, 4096 * (57 * 2 * 3072 + 64) * 2);
        assert_eq!(
            cache_read_bytes(&c, StepShape::full(512, 4096), DType::BF16),
            0
        );
    }
}
