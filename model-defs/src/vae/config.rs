//! `AutoencoderKL` configuration, as diffusers writes it to `vae/config.json`.
//!
//! Only the variant FLUX.1 uses is supported: SiLU, `DownEncoderBlock2D` /
//! `UpDecoderBlock2D` blocks, and no `quant_conv` / `post_quant_conv` (diffusers
//! defaults both to true, so a config that omits them describes an SD-style VAE and is
//! rejected rather than loaded with the wrong graph). Validation names the offending
//! field, so a wrong directory fails at load time instead of producing noise.

use std::path::Path;

use denoised_runtime::Result;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VaeConfig {
    #[serde(default = "three")]
    pub in_channels: usize,
    #[serde(default = "three")]
    pub out_channels: usize,
    pub latent_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    #[serde(default = "thirty_two")]
    pub norm_num_groups: usize,
    pub scaling_factor: f64,
    /// `null` (SD-style VAEs) means no shift.
    #[serde(default)]
    pub shift_factor: Option<f64>,
    #[serde(default = "yes")]
    pub use_quant_conv: bool,
    #[serde(default = "yes")]
    pub use_post_quant_conv: bool,
    #[serde(default = "yes")]
    pub mid_block_add_attention: bool,
    #[serde(default = "silu")]
    pub act_fn: String,
    #[serde(default)]
    pub down_block_types: Vec<String>,
    #[serde(default)]
    pub up_block_types: Vec<String>,
    /// Per-channel latent statistics (SD3-style); FLUX has none.
    #[serde(default)]
    pub latents_mean: Option<serde_json::Value>,
    #[serde(default)]
    pub latents_std: Option<serde_json::Value>,
}

fn three() -> usize {
    3
}
fn thirty_two() -> usize {
    32
}
fn yes() -> bool {
    true
}
fn silu() -> String {
    "silu".into()
}

/// GroupNorm epsilon of every norm in the VAE (diffusers' `resnet_eps` default).
pub const GN_EPS: f32 = 1e-6;
/// diffusers' `DiagonalGaussianDistribution` clamps the log-variance to this range.
pub const LOGVAR_RANGE: (f32, f32) = (-30.0, 20.0);

impl VaeConfig {
    /// Spatial downsampling factor between image and latent: `2^(levels-1)`.
    pub fn vae_scale_factor(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    pub fn shift(&self) -> f32 {
        self.shift_factor.unwrap_or(0.0) as f32
    }

    pub fn scale(&self) -> f32 {
        self.scaling_factor as f32
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        denoised_runtime::config::read_json_validated(path.as_ref(), |c: &VaeConfig| c.validate())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.use_quant_conv || self.use_post_quant_conv {
            return Err(format!(
                "use_quant_conv={} / use_post_quant_conv={}: quant convs are not supported \
                 (FLUX's VAE has neither; both must be false)",
                self.use_quant_conv, self.use_post_quant_conv
            ));
        }
        if self.act_fn != "silu" {
            return Err(format!(
                "act_fn `{}` is not supported (only silu)",
                self.act_fn
            ));
        }
        if self.latents_mean.as_ref().is_some_and(|v| !v.is_null())
            || self.latents_std.as_ref().is_some_and(|v| !v.is_null())
        {
            return Err("latents_mean / latents_std are not supported (must be null)".into());
        }
        let positive = [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("layers_per_block", self.layers_per_block),
            ("norm_num_groups", self.norm_num_groups),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        let levels = self.block_out_channels.len();
        if levels == 0 {
            return Err("block_out_channels is empty".into());
        }
        if levels > 8 {
            return Err(format!(
                "{levels} levels in block_out_channels is not plausible"
            ));
        }
        if let Some(&c) = self
            .block_out_channels
            .iter()
            .find(|&&c| c == 0 || c % self.norm_num_groups != 0)
        {
            return Err(format!(
                "block_out_channels {:?}: {c} is not a positive multiple of norm_num_groups {}",
                self.block_out_channels, self.norm_num_groups
            ));
        }
        let check_types = |field: &str, types: &[String], want: &str| {
            if types.is_empty() {
                return Ok(()); // diffusers would use its own defaults: these types
            }
            if types.len() != levels {
                return Err(format!(
                    "{field} has {} entries but block_out_channels has {levels}",
                    types.len()
                ));
            }
            match types.iter().find(|t| *t != want) {
                Some(t) => Err(format!("{field}: `{t}` is not supported (only {want})")),
                None => Ok(()),
            }
        };
        check_types(
            "down_block_types",
            &self.down_block_types,
            "DownEncoderBlock2D",
        )?;
        check_types("up_block_types", &self.up_block_types, "UpDecoderBlock2D")?;
        if !(self.scaling_factor.is_finite() && self.scaling_factor > 0.0) {
            return Err(format!(
                "scaling_factor {} must be finite and positive",
                self.scaling_factor
            ));
        }
        if self.shift_factor.is_some_and(|s| !s.is_finite()) {
            return Err("shift_factor must be finite".into());
        }
        Ok(())
    }

    /// black-forest-labs/FLUX.1-dev (and Fill-dev) `vae/config.json`.
    pub fn flux1() -> Self {
        Self::with_levels(vec![128, 256, 512, 512], 32)
    }

    /// The tiny VAE of the reference fixtures (`flux-fill-tiny/vae`); also the built-in
    /// model's VAE config.
    pub fn tiny() -> Self {
        Self::with_levels(vec![32, 64], 8)
    }

    /// The FLUX VAE with other widths: 16 latent channels, 2 resnets per block, FLUX's
    /// scaling and shift.
    fn with_levels(block_out_channels: Vec<usize>, norm_num_groups: usize) -> Self {
        let levels = block_out_channels.len();
        VaeConfig {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 16,
            block_out_channels,
            layers_per_block: 2,
            norm_num_groups,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            use_quant_conv: false,
            use_post_quant_conv: false,
            mid_block_add_attention: true,
            act_fn: "silu".into(),
            down_block_types: vec!["DownEncoderBlock2D".into(); levels],
            up_block_types: vec!["UpDecoderBlock2D".into(); levels],
            latents_mean: None,
            latents_std: None,
        }
    }
}
