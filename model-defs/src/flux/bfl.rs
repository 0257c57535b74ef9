//! The original (Black Forest Labs) key layout of the FLUX transformer, as the
//! single-file checkpoints (`flux1-fill-dev.safetensors`), the GGUF quantisations made
//! from them, and kohya/XLabs/BFL LoRAs name it: `double_blocks.N.img_attn.qkv`,
//! `single_blocks.N.linear1`, `final_layer.adaLN_modulation.1`, ...
//!
//! [`linears`] and [`vectors`] are the one table between that layout and diffusers'
//! (the names [`super::weights::param_specs`] lists), read off diffusers'
//! `convert_flux_transformer_checkpoint_to_diffusers`. A BFL Linear holds one or more
//! diffusers Linears stacked along its output: the fused `qkv` projections hold
//! `to_q|to_k|to_v`, a single block's `linear1` holds `to_q|to_k|to_v|proj_mlp`.
//! Each diffusers part is a row range of the BFL weight, so a loader hands it out as
//! a borrowed slice of the mapped file, with no copy. The one exception is
//! `final_layer.adaLN_modulation.1`, whose two halves (shift, scale) diffusers stores
//! the other way round (scale, shift).

use std::ops::Range;

use super::config::{FluxConfig, TIME_PROJ_DIM};

/// A Linear of the BFL layout and the diffusers Linears it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BflLinear {
    /// The BFL module name, without `.weight`/`.bias`.
    pub name: String,
    /// The diffusers modules it stacks, in the BFL row order, each with its rows of
    /// the BFL weight.
    pub parts: Vec<(String, Range<usize>)>,
    pub input: usize,
    /// Whether the two halves of the output are swapped against diffusers (the
    /// final layer's modulation: BFL `shift|scale`, diffusers `scale|shift`).
    pub swap_halves: bool,
}

impl BflLinear {
    pub fn out(&self) -> usize {
        self.parts.last().map_or(0, |p| p.1.end)
    }
}

/// The rows of a BFL weight that diffusers' tensor `part` of `lin` reads, in
/// diffusers' order: one range, or two for a half-swapped Linear.
pub fn part_rows(lin: &BflLinear, part: usize) -> Vec<Range<usize>> {
    let rows = lin.parts[part].1.clone();
    if !lin.swap_halves {
        return vec![rows];
    }
    let half = lin.out() / 2;
    // diffusers `scale|shift` = BFL rows `half..out` then `0..half`.
    vec![half..lin.out(), 0..half]
}

/// Every Linear of `c`'s model in the BFL layout.
pub fn linears(c: &FluxConfig) -> Vec<BflLinear> {
    let d = c.hidden();
    let one = |name: &str, diffusers: &str, out: usize, input: usize| BflLinear {
        name: name.to_string(),
        parts: vec![(diffusers.to_string(), 0..out)],
        input,
        swap_halves: false,
    };
    let stacked = |name: String, prefix: &str, parts: &[(&str, usize)]| {
        let mut at = 0;
        let parts = parts
            .iter()
            .map(|&(n, o)| {
                at += o;
                (format!("{prefix}.{n}"), at - o..at)
            })
            .collect();
        BflLinear {
            name,
            parts,
            input: d,
            swap_halves: false,
        }
    };
    let tte = "time_text_embed";
    let mut v = vec![
        one("img_in", "x_embedder", d, c.in_channels),
        one("txt_in", "context_embedder", d, c.joint_attention_dim),
        one(
            "time_in.in_layer",
            &format!("{tte}.timestep_embedder.linear_1"),
            d,
            TIME_PROJ_DIM,
        ),
        one(
            "time_in.out_layer",
            &format!("{tte}.timestep_embedder.linear_2"),
            d,
            d,
        ),
        one(
            "vector_in.in_layer",
            &format!("{tte}.text_embedder.linear_1"),
            d,
            c.pooled_projection_dim,
        ),
        one(
            "vector_in.out_layer",
            &format!("{tte}.text_embedder.linear_2"),
            d,
            d,
        ),
    ];
    if c.guidance_embeds {
        v.push(one(
            "guidance_in.in_layer",
            &format!("{tte}.guidance_embedder.linear_1"),
            d,
            TIME_PROJ_DIM,
        ));
        v.push(one(
            "guidance_in.out_layer",
            &format!("{tte}.guidance_embedder.linear_2"),
            d,
            d,
        ));
    }
    for i in 0..c.num_layers {
        let b = format!("double_blocks.{i}");
        let t = format!("transformer_blocks.{i}");
        let a = format!("{t}.attn");
        v.push(one(
            &format!("{b}.img_mod.lin"),
            &format!("{t}.norm1.linear"),
            6 * d,
            d,
        ));
        v.push(one(
            &format!("{b}.txt_mod.lin"),
            &format!("{t}.norm1_context.linear"),
            6 * d,
            d,
        ));
        v.push(stacked(
            format!("{b}.img_attn.qkv"),
            &a,
            &[("to_q", d), ("to_k", d), ("to_v", d)],
        ));
        v.push(stacked(
            format!("{b}.txt_attn.qkv"),
            &a,
            &[("add_q_proj", d), ("add_k_proj", d), ("add_v_proj", d)],
        ));
        v.push(one(
            &format!("{b}.img_attn.proj"),
            &format!("{a}.to_out.0"),
            d,
            d,
        ));
        v.push(one(
            &format!("{b}.txt_attn.proj"),
            &format!("{a}.to_add_out"),
            d,
            d,
        ));
        v.push(one(
            &format!("{b}.img_mlp.0"),
            &format!("{t}.ff.net.0.proj"),
            4 * d,
            d,
        ));
        v.push(one(
            &format!("{b}.img_mlp.2"),
            &format!("{t}.ff.net.2"),
            d,
            4 * d,
        ));
        v.push(one(
            &format!("{b}.txt_mlp.0"),
            &format!("{t}.ff_context.net.0.proj"),
            4 * d,
            d,
        ));
        v.push(one(
            &format!("{b}.txt_mlp.2"),
            &format!("{t}.ff_context.net.2"),
            d,
            4 * d,
        ));
    }
    for i in 0..c.num_single_layers {
        let b = format!("single_blocks.{i}");
        let t = format!("single_transformer_blocks.{i}");
        v.push(one(
            &format!("{b}.modulation.lin"),
            &format!("{t}.norm.linear"),
            3 * d,
            d,
        ));
        let mut l1 = stacked(
            format!("{b}.linear1"),
            &t,
            &[
                ("attn.to_q", d),
                ("attn.to_k", d),
                ("attn.to_v", d),
                ("proj_mlp", 4 * d),
            ],
        );
        l1.input = d;
        v.push(l1);
        v.push(one(
            &format!("{b}.linear2"),
            &format!("{t}.proj_out"),
            d,
            5 * d,
        ));
    }
    v.push(one(
        "final_layer.linear",
        "proj_out",
        c.patch_size * c.patch_size * c.out_channels(),
        d,
    ));
    let mut m = one(
        "final_layer.adaLN_modulation.1",
        "norm_out.linear",
        2 * d,
        d,
    );
    m.swap_halves = true;
    v.push(m);
    v
}

/// The per-head RMSNorm weights: BFL tensor name, diffusers tensor name (`[head_dim]`).
pub fn vectors(c: &FluxConfig) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for i in 0..c.num_layers {
        let (b, a) = (
            format!("double_blocks.{i}"),
            format!("transformer_blocks.{i}.attn"),
        );
        for (bfl, ours) in [
            ("img_attn.norm.query_norm", "norm_q"),
            ("img_attn.norm.key_norm", "norm_k"),
            ("txt_attn.norm.query_norm", "norm_added_q"),
            ("txt_attn.norm.key_norm", "norm_added_k"),
        ] {
            v.push((format!("{b}.{bfl}.scale"), format!("{a}.{ours}.weight")));
        }
    }
    for i in 0..c.num_single_layers {
        let (b, a) = (
            format!("single_blocks.{i}"),
            format!("single_transformer_blocks.{i}.attn"),
        );
        for (bfl, ours) in [("norm.query_norm", "norm_q"), ("norm.key_norm", "norm_k")] {
            v.push((format!("{b}.{bfl}.scale"), format!("{a}.{ours}.weight")));
        }
    }
    v
}

/// Whether a tensor name list is in the BFL layout (rather than diffusers').
pub fn is_bfl<'a>(names: impl IntoIterator<Item = &'a str>) -> bool {
    names
        .into_iter()
        .any(|n| strip_prefix(n).starts_with("double_blocks.") || n.starts_with("img_in."))
}

/// A BFL name without the prefixes some single files carry (ComfyUI saves the
/// transformer as `model.diffusion_model.*`).
pub fn strip_prefix(name: &str) -> &str {
    name.strip_prefix("model.diffusion_model.").unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flux::weights::param_specs;
    use std::collections::BTreeSet;

    /// The table covers every diffusers parameter exactly once, with the shapes
    /// `param_specs` expects: a BFL file mapped through it is a complete model.
    #[test]
    fn table_covers_every_parameter_once() {
        for c in [
            FluxConfig::tiny(),
            FluxConfig::small(),
            FluxConfig::flux1_schnell(),
        ] {
            let d = c.hidden();
            let mut got: Vec<(String, Vec<usize>)> = Vec::new();
            for l in linears(&c) {
                let mut at = 0;
                for (p, rows) in &l.parts {
                    assert_eq!(rows.start, at, "{} parts are contiguous", l.name);
                    at = rows.end;
                    got.push((format!("{p}.weight"), vec![rows.len(), l.input]));
                    got.push((format!("{p}.bias"), vec![rows.len()]));
                }
            }
            for (_, ours) in vectors(&c) {
                got.push((ours, vec![c.attention_head_dim]));
            }
            let want: BTreeSet<_> = param_specs(&c).into_iter().collect();
            assert_eq!(got.len(), want.len(), "no part is listed twice");
            assert_eq!(got.into_iter().collect::<BTreeSet<_>>(), want);
            let single = linears(&c)
                .into_iter()
                .find(|l| l.name == "single_blocks.0.linear1")
                .unwrap();
            assert_eq!(single.out(), 7 * d);
            assert_eq!(single.parts[3].1, 3 * d..7 * d);
        }
    }

    #[test]
    fn swapped_halves_read_scale_then_shift() {
        let c = FluxConfig::tiny();
        let l = linears(&c)
            .into_iter()
            .find(|l| l.swap_halves)
            .expect("the final modulation");
        let d = c.hidden();
        assert_eq!(part_rows(&l, 0), vec![d..2 * d, 0..d]);
        assert!(is_bfl([
            "model.diffusion_model.double_blocks.0.img_mod.lin.weight"
        ]));
        assert!(!is_bfl(["transformer_blocks.0.norm1.linear.weight"]));
    }
}
