//! `FluxTransformer2DModel` configuration, as diffusers writes it to `config.json`.
//!
//! The named constructors mirror real upstream configs (so that a directory can be
//! checked against what it claims to be) and the scaled-down benchmark configs used
//! across the project.

use std::path::Path;

use denoised_runtime::Result;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FluxConfig {
    #[serde(default = "one")]
    pub patch_size: usize,
    pub in_channels: usize,
    /// `null` in some configs means "same as in_channels".
    #[serde(default)]
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub num_single_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    pub pooled_projection_dim: usize,
    #[serde(default)]
    pub guidance_embeds: bool,
    pub axes_dims_rope: Vec<usize>,
}

fn one() -> usize {
    1
}

/// Dimension of the sinusoidal timestep projection (`Timesteps(256, ...)` in diffusers).
pub const TIME_PROJ_DIM: usize = 256;

impl FluxConfig {
    pub fn hidden(&self) -> usize {
        self.attention_head_dim * self.num_attention_heads
    }
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }
    pub fn mlp_hidden(&self) -> usize {
        self.hidden() * 4
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        denoised_runtime::config::read_json_validated(path.as_ref(), |c: &FluxConfig| c.validate())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.patch_size != 1 {
            return Err(format!(
                "patch_size {} is not supported (Flux uses 1)",
                self.patch_size
            ));
        }
        let positive = [
            ("in_channels", self.in_channels),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("joint_attention_dim", self.joint_attention_dim),
            ("pooled_projection_dim", self.pooled_projection_dim),
            ("out_channels", self.out_channels()),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.axes_dims_rope.len() != 3 {
            return Err(format!(
                "axes_dims_rope must have 3 entries, got {:?}",
                self.axes_dims_rope
            ));
        }
        if self.axes_dims_rope.iter().any(|d| d % 2 != 0) {
            return Err(format!(
                "axes_dims_rope entries must be even, got {:?}",
                self.axes_dims_rope
            ));
        }
        let sum: usize = self.axes_dims_rope.iter().sum();
        if sum != self.attention_head_dim {
            return Err(format!(
                "axes_dims_rope {:?} sums to {sum}, but attention_head_dim is {}",
                self.axes_dims_rope, self.attention_head_dim
            ));
        }
        Ok(())
    }

    /// black-forest-labs/FLUX.1-dev `transformer/config.json`.
    pub fn flux1_dev() -> Self {
        FluxConfig {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: true,
            axes_dims_rope: vec![16, 56, 56],
        }
    }

    /// black-forest-labs/FLUX.1-schnell: dev without the guidance embedder.
    pub fn flux1_schnell() -> Self {
        FluxConfig {
            guidance_embeds: false,
            ..Self::flux1_dev()
        }
    }

    /// black-forest-labs/FLUX.1-Fill-dev: 384 input channels (latents, masked-image
    /// latents, 8x8 space-to-depth mask), 64 output channels.
    pub fn flux1_fill_dev() -> Self {
        FluxConfig {
            in_channels: 384,
            out_channels: Some(64),
            ..Self::flux1_dev()
        }
    }

    /// The tiny model of the reference fixtures (`flux-fill-tiny/transformer`); also the
    /// built-in model's config.
    pub fn tiny() -> Self {
        FluxConfig {
            patch_size: 1,
            in_channels: 144,
            out_channels: Some(64),
            num_layers: 2,
            num_single_layers: 3,
            attention_head_dim: 16,
            num_attention_heads: 4,
            joint_attention_dim: 32,
            pooled_projection_dim: 32,
            guidance_embeds: true,
            axes_dims_rope: vec![4, 6, 6],
        }
    }

    /// The same transformer as a text-to-image model (FluxPipeline): its input is the
    /// packed latents alone, as FLUX.1-dev's (`in_channels` 64 for 16 latent channels).
    pub fn text_to_image(self) -> Self {
        FluxConfig {
            in_channels: self.out_channels(),
            ..self
        }
    }

    /// `flux-small`: a scaled-down Fill model for CPU benchmarks (hidden 768, 12 heads
    /// of 64, 4 double and 8 single blocks).
    pub fn small() -> Self {
        FluxConfig {
            patch_size: 1,
            in_channels: 384,
            out_channels: Some(64),
            num_layers: 4,
            num_single_layers: 8,
            attention_head_dim: 64,
            num_attention_heads: 12,
            joint_attention_dim: 768,
            pooled_projection_dim: 768,
            guidance_embeds: true,
            axes_dims_rope: vec![16, 24, 24],
        }
    }

    /// Looks up a named config: `flux1-dev`, `flux1-schnell`, `flux1-fill-dev`,
    /// `flux-tiny`, `flux-small`.
    pub fn named(name: &str) -> Option<Self> {
        Some(match name {
            "flux1-dev" => Self::flux1_dev(),
            "flux1-schnell" => Self::flux1_schnell(),
            "flux1-fill-dev" => Self::flux1_fill_dev(),
            "flux-tiny" => Self::tiny(),
            "flux-small" => Self::small(),
            _ => return None,
        })
    }

    pub const NAMES: &'static [&'static str] = &[
        "flux1-dev",
        "flux1-schnell",
        "flux1-fill-dev",
        "flux-tiny",
        "flux-small",
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_configs_are_valid() {
        for n in FluxConfig::NAMES {
            let c = FluxConfig::named(n).unwrap();
            c.validate().unwrap();
        }
        assert_eq!(FluxConfig::flux1_fill_dev().hidden(), 3072);
        assert_eq!(FluxConfig::small().hidden(), 768);
    }

    #[test]
    fn rejects_inconsistent_rope_axes() {
        let mut c = FluxConfig::tiny();
        c.axes_dims_rope = vec![4, 6, 8];
        assert!(c.validate().unwrap_err().contains("sums to 18"));
    }
}
