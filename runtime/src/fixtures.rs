//! Access to the reference fixtures (diffusers golden outputs) in `tests/fixtures`.
//!
//! Used by the numerical tests of every crate and by bring-up tools. The fixtures are
//! data copied from the shared reference set (see `tests/fixtures/REFERENCE.md`):
//! `cases/cases.json` describes every tensor with its tolerances, and the
//! `cases/*.safetensors` files hold the tensors.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::weights::SafetensorsFile;

/// `tests/fixtures` of this repository (override with `DENOISED_FIXTURES`).
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("DENOISED_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures")))
}

/// The tiny reference model directory (diffusers layout).
pub fn tiny_model_dir() -> PathBuf {
    fixtures_dir().join("flux-fill-tiny")
}

/// Which tolerance of `cases.json` to compare with.
#[derive(Clone, Copy, Debug)]
pub enum Tier {
    /// `strict_atol`: achievable when float32 islands are reproduced exactly.
    Strict,
    /// `suggested_atol`: 10x torch-float32's distance from float64 math.
    Suggested,
}

pub struct RefCase {
    file: SafetensorsFile,
    tensors: serde_json::Value,
    pub params: serde_json::Value,
}

impl RefCase {
    /// Opens a case by its key in `cases.json` (e.g. `transformer_case1`).
    pub fn open(key: &str) -> Result<Self> {
        let dir = fixtures_dir().join("cases");
        let manifest_path = dir.join("cases.json");
        let text =
            std::fs::read_to_string(&manifest_path).map_err(|e| Error::io(&manifest_path, e))?;
        let manifest: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::BadConfig {
                path: manifest_path.clone(),
                reason: e.to_string(),
            })?;
        let case = manifest["cases"].get(key).ok_or_else(|| {
            Error::Invalid(format!("no case `{key}` in {}", manifest_path.display()))
        })?;
        let file = case["file"].as_str().unwrap_or_default();
        Ok(RefCase {
            file: SafetensorsFile::open(dir.join(file))?,
            tensors: case["tensors"].clone(),
            params: case["params"].clone(),
        })
    }

    pub fn file(&self) -> &SafetensorsFile {
        &self.file
    }

    pub fn tensor(&self, name: &str) -> Tensor {
        self.file.tensor_f32(name).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn atol(&self, name: &str, tier: Tier) -> f32 {
        let field = match tier {
            Tier::Strict => "strict_atol",
            Tier::Suggested => "suggested_atol",
        };
        self.tensors[name][field]
            .as_f64()
            .unwrap_or_else(|| panic!("no {field} for `{name}`")) as f32
    }

    /// Asserts `max |got - golden| <= atol(name, tier)` (shapes compared without
    /// leading 1-dims) and returns the max difference.
    pub fn assert_close(&self, name: &str, got: &Tensor, tier: Tier) -> f32 {
        let want = self.tensor(name);
        let squeeze = |s: &[usize]| {
            s.iter()
                .copied()
                .skip_while(|&d| d == 1)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            squeeze(got.shape()),
            squeeze(want.shape()),
            "shape of `{name}`"
        );
        let got = got.clone().reshape(want.shape().to_vec()).unwrap();
        let diff = got.max_abs_diff(&want).unwrap();
        let tol = self.atol(name, tier);
        assert!(
            diff <= tol,
            "`{name}`: max abs diff {diff:.3e} > atol {tol:.1e} ({tier:?})"
        );
        diff
    }
}
