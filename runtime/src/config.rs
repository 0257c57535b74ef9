//! The configuration schema: what `config.toml` may hold.
//!
//! Unknown keys are errors (a typo must not silently fall back to a default), and every
//! key has a default, so an empty file is a valid configuration. The repository's
//! `config.toml` documents each key; a test keeps it in step with this schema.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub device: DeviceConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A diffusers model directory, or `builtin`.
    pub source: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            source: "builtin".into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceConfig {
    /// `auto`, `cpu` or `cuda:N`.
    pub device: String,
    /// CPU compute threads; 0 = one per core.
    pub threads: usize,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            device: "auto".into(),
            threads: 0,
        }
    }
}

impl Config {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text).map_err(|reason| Error::BadConfig {
            path: path.to_path_buf(),
            reason,
        })
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

/// Reads a JSON config file (a diffusers `config.json`, a tokenizer config, ...);
/// errors name the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadConfig {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// [`read_json`], then a validation whose message becomes a `BadConfig` naming the file.
pub fn read_json_validated<T: serde::de::DeserializeOwned>(
    path: &Path,
    validate: impl FnOnce(&T) -> Result<(), String>,
) -> Result<T> {
    let cfg = read_json(path)?;
    validate(&cfg).map_err(|reason| Error::BadConfig {
        path: path.to_path_buf(),
        reason,
    })?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_config_is_the_default() {
        let shipped =
            Config::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../config.toml")).unwrap();
        assert_eq!(shipped, Config::default());
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = Config::parse("[device]\ndevise = \"cpu\"\n").unwrap_err();
        assert!(e.contains("devise"), "{e}");
    }
}
