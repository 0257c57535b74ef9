//! A VAE in one file: Black Forest Labs' `ae.safetensors` (the original LDM key
//! layout: `encoder.down.0.block.0.conv1`, `decoder.up.3.upsample.conv`,
//! `mid.attn_1.q` as 1x1 convolutions), with or without a `first_stage_model.` or
//! `vae.` prefix, or a diffusers-layout single file.
//!
//! [`VaeFile`] infers the config from the shapes and is a [`Source`] of diffusers'
//! names (the mapping of diffusers' `convert_ldm_vae_checkpoint`, read the other way):
//! the up blocks are numbered from the other end, `nin_shortcut` is `conv_shortcut`,
//! and the mid attention's 1x1 convolutions are Linears. GroupNorm's group count and
//! the latent scaling and shift are not in the shapes: they come from the model
//! directory's `vae/config.json` when there is one, else FLUX.1's (32, 0.3611, 0.1159).

use std::collections::BTreeSet;
use std::path::Path;

use denoised_runtime::checkpoint::{self, first_few, TensorFile};
use denoised_runtime::{Error, Result, Tensor};

use super::config::VaeConfig;
use super::weights::VaeWeights;
use crate::flux::weights::{released, Source};

/// The key layout of a VAE file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The original LDM / BFL names.
    Ldm,
    Diffusers,
}

pub struct VaeFile {
    file: Box<dyn TensorFile>,
    pub layout: Layout,
    pub prefix: String,
    pub config: VaeConfig,
}

impl VaeFile {
    pub fn open(path: &Path, hint: Option<&VaeConfig>) -> Result<Self> {
        let file = checkpoint::open(path)?;
        let names = file.names();
        let bad = |reason: String| Error::BadCheckpoint {
            path: path.to_path_buf(),
            reason,
        };
        let prefix = ["first_stage_model.", "vae."]
            .into_iter()
            .find(|p| names.iter().all(|n| n.starts_with(p)))
            .unwrap_or("")
            .to_string();
        let key = |n: &str| format!("{prefix}{n}");
        let layout = if file
            .info(&key("encoder.down.0.block.0.conv1.weight"))
            .is_some()
        {
            Layout::Ldm
        } else if file
            .info(&key("encoder.down_blocks.0.resnets.0.conv1.weight"))
            .is_some()
        {
            Layout::Diffusers
        } else {
            return Err(bad(format!(
                "not an AutoencoderKL: no `encoder.down.0.block.0.conv1.weight` (original layout) or `encoder.down_blocks.0.resnets.0.conv1.weight` (diffusers layout); it has {}",
                first_few(names.iter().map(String::as_str).collect())
            )));
        };
        let config = infer_config(layout, &names, &prefix, file.as_ref(), hint).map_err(bad)?;
        let vae = VaeFile {
            file,
            layout,
            prefix,
            config,
        };
        let mapped: BTreeSet<String> = VaeWeights::param_names(&vae.config)?
            .iter()
            .map(|n| vae.key_of(n))
            .collect();
        let unknown: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| !mapped.contains(*n))
            .collect();
        if !unknown.is_empty() {
            return Err(bad(format!(
                "keys no VAE of the inferred config (channels {:?}, {} layers a block, {} latent channels) has: {}",
                vae.config.block_out_channels,
                vae.config.layers_per_block,
                vae.config.latent_channels,
                first_few(unknown)
            )));
        }
        Ok(vae)
    }

    pub fn file(&self) -> &dyn TensorFile {
        self.file.as_ref()
    }

    /// The file's key of diffusers' tensor `name`.
    fn key_of(&self, name: &str) -> String {
        match self.layout {
            Layout::Diffusers => format!("{}{name}", self.prefix),
            Layout::Ldm => format!(
                "{}{}",
                self.prefix,
                ldm_name(name, self.config.block_out_channels.len())
            ),
        }
    }
}

/// diffusers' VAE tensor name in the LDM layout of a VAE with `levels` levels.
fn ldm_name(name: &str, levels: usize) -> String {
    let p: Vec<&str> = name.split('.').collect();
    let rest = |from: usize| p[from..].join(".");
    let resnet_rest = |from: usize| rest(from).replace("conv_shortcut", "nin_shortcut");
    let coder = p[0];
    match p.get(1).copied() {
        Some("down_blocks") => match p[3] {
            "resnets" => format!("{coder}.down.{}.block.{}.{}", p[2], p[4], resnet_rest(5)),
            // `downsamplers.0.conv.*`
            _ => format!("{coder}.down.{}.downsample.{}", p[2], rest(5)),
        },
        Some("up_blocks") => {
            let i: usize = p[2].parse().unwrap_or(0);
            let level = levels.saturating_sub(1 + i);
            match p[3] {
                "resnets" => format!("{coder}.up.{level}.block.{}.{}", p[4], resnet_rest(5)),
                _ => format!("{coder}.up.{level}.upsample.{}", rest(5)),
            }
        }
        Some("mid_block") => match p[2] {
            "resnets" => {
                let b = if p[3] == "0" { "block_1" } else { "block_2" };
                format!("{coder}.mid.{b}.{}", resnet_rest(4))
            }
            // `attentions.0.<layer>.*`
            _ => {
                let (layer, from) = match p[4] {
                    "group_norm" => ("norm", 5),
                    "to_q" => ("q", 5),
                    "to_k" => ("k", 5),
                    "to_v" => ("v", 5),
                    _ => ("proj_out", 6), // `to_out.0`
                };
                format!("{coder}.mid.attn_1.{layer}.{}", rest(from))
            }
        },
        Some("conv_norm_out") => format!("{coder}.norm_out.{}", rest(2)),
        _ => name.to_string(),
    }
}

fn infer_config(
    layout: Layout,
    names: &[String],
    prefix: &str,
    file: &dyn TensorFile,
    hint: Option<&VaeConfig>,
) -> std::result::Result<VaeConfig, String> {
    let (down, block, attn_norm) = match layout {
        Layout::Ldm => ("encoder.down.", "block", "encoder.mid.attn_1.norm.weight"),
        Layout::Diffusers => (
            "encoder.down_blocks.",
            "resnets",
            "encoder.mid_block.attentions.0.group_norm.weight",
        ),
    };
    let shape = |k: &str| file.info(&format!("{prefix}{k}")).map(|(s, _)| s);
    let need =
        |k: &str| shape(k).ok_or_else(|| format!("no `{prefix}{k}`: not a complete AutoencoderKL"));
    let count = |under: &str| checkpoint::indexed_count(names, &format!("{prefix}{under}"));
    let levels = count(down);
    let block_out_channels = (0..levels)
        .map(|i| need(&format!("{down}{i}.{block}.0.conv1.weight")).map(|s| s[0]))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let flux = VaeConfig::flux1();
    let from_hint = hint.unwrap_or(&flux);
    let c = VaeConfig {
        in_channels: need("encoder.conv_in.weight")?[1],
        out_channels: need("decoder.conv_out.weight")?[0],
        latent_channels: need("decoder.conv_in.weight")?[1],
        block_out_channels,
        layers_per_block: count(&format!("{down}0.{block}.")),
        norm_num_groups: from_hint.norm_num_groups,
        scaling_factor: from_hint.scaling_factor,
        shift_factor: from_hint.shift_factor,
        use_quant_conv: shape("quant_conv.weight").is_some(),
        use_post_quant_conv: shape("post_quant_conv.weight").is_some(),
        mid_block_add_attention: shape(attn_norm).is_some(),
        down_block_types: vec!["DownEncoderBlock2D".into(); levels],
        up_block_types: vec!["UpDecoderBlock2D".into(); levels],
        ..flux.clone()
    };
    c.validate()?;
    Ok(c)
}

impl Source for VaeFile {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let key = self.key_of(name);
        let t = self.file.stored(&key)?.to_f32()?;
        // The LDM mid attention's projections are 1x1 convolutions: [C, C, 1, 1].
        let t = match t.shape() {
            [o, i, 1, 1] if shape.len() == 2 => {
                let s = vec![*o, *i];
                t.reshape(s)?
            }
            _ => t,
        };
        if t.shape() != shape {
            return Err(Error::BadCheckpoint {
                path: self.file.path().to_path_buf(),
                reason: format!(
                    "`{key}` has shape {:?}; the inferred config needs {shape:?} for `{name}`",
                    t.shape()
                ),
            });
        }
        Ok(t)
    }

    fn release(&self) {
        released(self.file.path(), self.file.release_pages());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldm_names_follow_diffusers_converter() {
        let cases = [
            (
                "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
                "encoder.down.1.block.0.nin_shortcut.weight",
            ),
            (
                "encoder.down_blocks.0.downsamplers.0.conv.bias",
                "encoder.down.0.downsample.conv.bias",
            ),
            (
                "decoder.up_blocks.0.resnets.2.norm1.weight",
                "decoder.up.3.block.2.norm1.weight",
            ),
            (
                "decoder.up_blocks.2.upsamplers.0.conv.weight",
                "decoder.up.1.upsample.conv.weight",
            ),
            (
                "decoder.mid_block.resnets.1.conv2.weight",
                "decoder.mid.block_2.conv2.weight",
            ),
            (
                "encoder.mid_block.attentions.0.to_out.0.weight",
                "encoder.mid.attn_1.proj_out.weight",
            ),
            (
                "encoder.mid_block.attentions.0.group_norm.bias",
                "encoder.mid.attn_1.norm.bias",
            ),
            ("decoder.conv_norm_out.weight", "decoder.norm_out.weight"),
            ("encoder.conv_in.weight", "encoder.conv_in.weight"),
        ];
        for (ours, theirs) in cases {
            assert_eq!(ldm_name(ours, 4), theirs, "{ours}");
        }
    }
}
