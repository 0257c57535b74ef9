//! Where a model comes from: a diffusers directory on disk, or the built-in tiny model.
//!
//! The built-in model has the fixture model's config and deterministic seeded weights,
//! so the daemon and every CLI command run on a fresh machine with no model files.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use denoised_runtime::{Backend, Error, Result};

use crate::flux::{FluxConfig, FluxTransformer};

/// Seed of the built-in model's weights. Changing it changes every built-in output.
pub const BUILTIN_SEED: u64 = 0x00de_0015_ed00_0001;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Builtin,
    /// A diffusers pipeline directory (with `transformer/`) or a transformer
    /// directory itself.
    Dir(PathBuf),
}

impl FromStr for ModelSource {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(if s == "builtin" {
            ModelSource::Builtin
        } else {
            ModelSource::Dir(PathBuf::from(s))
        })
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Builtin => write!(f, "builtin"),
            ModelSource::Dir(p) => write!(f, "{}", p.display()),
        }
    }
}

/// The `transformer/` directory of a pipeline directory, or `dir` itself when it holds
/// a transformer `config.json`.
pub fn transformer_dir(dir: &Path) -> Result<PathBuf> {
    let sub = dir.join("transformer");
    if sub.join("config.json").exists() {
        Ok(sub)
    } else if dir.join("config.json").exists() {
        Ok(dir.to_path_buf())
    } else if !dir.exists() {
        Err(Error::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "model directory does not exist",
            ),
        ))
    } else {
        Err(Error::BadConfig {
            path: dir.to_path_buf(),
            reason: "neither transformer/config.json nor config.json found (expected a diffusers model directory)".into(),
        })
    }
}

impl ModelSource {
    pub fn load_transformer<B: Backend>(&self, backend: B) -> Result<FluxTransformer<B>> {
        match self {
            ModelSource::Builtin => {
                FluxTransformer::seeded(backend, FluxConfig::tiny(), BUILTIN_SEED)
            }
            ModelSource::Dir(d) => FluxTransformer::load(backend, transformer_dir(d)?),
        }
    }
}
