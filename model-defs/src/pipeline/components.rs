//! Where each component of a pipeline comes from: a directory's config files, a single
//! file in place of a component (`crate::source::ComponentFiles`), or a built-in
//! model's seeded weights and embedded tokenizers.

use std::sync::Arc;

use denoised_runtime::{Error, Result};

use super::flux_fill::TextEncoders;
use crate::scheduler::SchedulerConfig;
use crate::source::{ModelSource, BUILTIN_SEED};
use crate::text::{ClipTextConfig, ClipTextModel, ClipTokenizer, T5Config, T5Encoder, T5Tokenizer};
use crate::vae::single_file::VaeFile;
use crate::vae::{AutoencoderKL, VaeConfig, VaeHalves};

/// Seeded text encoders with the built-in tokenizers.
pub(crate) fn seeded_text(clip: ClipTextConfig, t5: T5Config, seed: u64) -> Result<TextEncoders> {
    use builtin_files::*;
    Ok(TextEncoders {
        clip_tokenizer: ClipTokenizer::from_parts(
            CLIP_VOCAB,
            CLIP_MERGES,
            Some(CLIP_TOKENIZER_CONFIG),
        )?,
        clip: Arc::new(ClipTextModel::seeded(clip, seed ^ 2)?),
        t5_tokenizer: T5Tokenizer::from_parts(T5_TOKENIZER, Some(T5_TOKENIZER_CONFIG))?,
        t5: Arc::new(T5Encoder::seeded(t5, seed ^ 3)?),
    })
}

/// The T5 of `builtin:flux-small`: width 768, the flux-small transformer's joint
/// dimension.
pub(crate) fn small_t5() -> T5Config {
    T5Config {
        d_model: 768,
        d_kv: 64,
        d_ff: 2048,
        num_layers: 12,
        num_heads: 12,
        ..T5Config::t5_v1_1_xxl()
    }
}

/// The text encoders' configs of `source`, without their weights.
pub(crate) fn text_configs(source: &ModelSource) -> Result<(ClipTextConfig, T5Config)> {
    let parse =
        |what: &str, e: serde_json::Error| Error::Invalid(format!("built-in {what} config: {e}"));
    Ok(match source {
        ModelSource::Dir(d) => (
            ClipTextConfig::from_file(d.root.join("text_encoder/config.json"))?,
            T5Config::from_file(d.root.join("text_encoder_2/config.json"))?,
        ),
        ModelSource::BuiltinFillDev => (ClipTextConfig::clip_l(), T5Config::t5_v1_1_xxl()),
        _ if source.builtin_small() == Some(true) => (ClipTextConfig::clip_l(), small_t5()),
        _ => (
            serde_json::from_str(builtin_files::CLIP_CONFIG).map_err(|e| parse("CLIP", e))?,
            serde_json::from_str(builtin_files::T5_CONFIG).map_err(|e| parse("T5", e))?,
        ),
    })
}

/// The scheduler's config of `source`.
pub fn scheduler_config(source: &ModelSource) -> Result<SchedulerConfig> {
    match source {
        ModelSource::Dir(d) => {
            SchedulerConfig::from_file(d.root.join("scheduler/scheduler_config.json"))
        }
        _ => Ok(SchedulerConfig::default()),
    }
}

/// The VAE's config of `source`, without its weights.
pub fn vae_config(source: &ModelSource) -> Result<VaeConfig> {
    match source {
        ModelSource::Dir(d) => match &d.files.vae {
            Some(f) => Ok(VaeFile::open(f, vae_hint(&d.root).as_ref())?.config),
            None => VaeConfig::from_file(d.root.join("vae/config.json")),
        },
        _ if source.builtin_small() == Some(true) => Ok(VaeConfig::flux1()),
        _ => Ok(VaeConfig::tiny()),
    }
}

/// The `halves` of the VAE of `source`: a diffusers directory's `vae/`, or a built-in's
/// seeded VAE as its pipeline builds it.
pub fn load_vae(source: &ModelSource, halves: VaeHalves) -> Result<AutoencoderKL> {
    match source {
        ModelSource::Dir(d) => match &d.files.vae {
            Some(f) => AutoencoderKL::load_file(f, vae_hint(&d.root).as_ref(), halves),
            None => AutoencoderKL::load_halves(d.root.join("vae"), halves),
        },
        builtin => AutoencoderKL::seeded_halves(vae_config(builtin)?, BUILTIN_SEED ^ 1, halves),
    }
}

/// The directory's own VAE config, if it has one: what a single file's shapes cannot
/// tell (GroupNorm's groups, the latent scale and shift).
pub(crate) fn vae_hint(root: &std::path::Path) -> Option<VaeConfig> {
    VaeConfig::from_file(root.join("vae/config.json")).ok()
}

/// Files of the built-in model that cannot be generated from a seed: the configs and
/// the two tokenizers of the reference fixture model (trained on a small corpus; 400 KB).
mod builtin_files {
    pub const CLIP_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/text_encoder/config.json");
    pub const T5_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/text_encoder_2/config.json");
    pub const CLIP_VOCAB: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/vocab.json");
    pub const CLIP_MERGES: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/merges.txt");
    pub const CLIP_TOKENIZER_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer/tokenizer_config.json");
    pub const T5_TOKENIZER: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer_2/tokenizer.json");
    pub const T5_TOKENIZER_CONFIG: &str =
        include_str!("../../../tests/fixtures/flux-fill-tiny/tokenizer_2/tokenizer_config.json");
}
