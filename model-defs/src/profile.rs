//! Latency models of a device (docs/design.md §Planner): compute time as a linear function
//! of FLOPs and load time as a linear function of bytes, per cache tier, fitted by
//! `denoised profile` on the real device and stored in a profile file that
//! `config.toml` references (`[planner] profile`).
//!
//! The planner prices each block of a step with these: a block's compute with the
//! cache (the batch's active tokens) and in full (every token) from its FLOPs, and the
//! load of its cached K/V from the bytes of the slabs and the tier they come from.
//! Without a profile the planner uses [`Profile::defaults`], conservative figures for
//! the device kind, and the worker logs that it does.

use std::path::Path;

use denoised_runtime::{Error, Result};
use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "denoised-profile";
pub const VERSION: u32 = 1;

/// `seconds = intercept_s + slope_s * x`, fitted by least squares over `samples`
/// measurements with coefficient of determination `r2`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub intercept_s: f64,
    pub slope_s: f64,
    pub r2: f64,
    pub samples: usize,
}

impl Fit {
    /// A model with no fit behind it (the defaults: no samples, R² 0).
    pub const fn assumed(intercept_s: f64, slope_s: f64) -> Self {
        Fit {
            intercept_s,
            slope_s,
            r2: 0.0,
            samples: 0,
        }
    }

    pub fn predict(&self, x: f64) -> f64 {
        (self.intercept_s + self.slope_s * x).max(0.0)
    }

    /// Ordinary least squares of `y` on `x`. Needs two distinct `x`.
    pub fn least_squares(x: &[f64], y: &[f64]) -> Result<Self> {
        let n = x.len();
        if n != y.len() || n < 2 {
            return Err(Error::Invalid(format!(
                "a fit needs two or more (x, y) pairs, got {n} x and {} y",
                y.len()
            )));
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / n as f64;
        let (mx, my) = (mean(x), mean(y));
        let sxx: f64 = x.iter().map(|a| (a - mx) * (a - mx)).sum();
        let sxy: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
        if sxx <= 0.0 {
            return Err(Error::Invalid("a fit needs two distinct x values".into()));
        }
        let slope = sxy / sxx;
        let intercept = my - slope * mx;
        let ss_tot: f64 = y.iter().map(|b| (b - my) * (b - my)).sum();
        let ss_res: f64 = x
            .iter()
            .zip(y)
            .map(|(a, b)| {
                let e = b - (intercept + slope * a);
                e * e
            })
            .sum();
        Ok(Fit {
            intercept_s: intercept,
            slope_s: slope,
            r2: if ss_tot > 0.0 {
                1.0 - ss_res / ss_tot
            } else {
                1.0
            },
            samples: n,
        })
    }
}

/// Where a block's cached K/V come from in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Already on the device: no load.
    Device,
    Host,
    Disk,
}

/// A device's fitted latency models.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub format: String,
    pub version: u32,
    /// The device it was measured on (`Backend::name`), and the model config.
    pub device: String,
    pub model: String,
    /// Seconds of a step's compute against its FLOPs (the planner gives each block
    /// its FLOPs' share of the slope and an equal share of the intercept).
    pub compute: Fit,
    /// Seconds of one block's K/V load against its bytes, from the host tier and from
    /// the disk tier.
    pub load_host: Fit,
    pub load_disk: Fit,
}

impl Profile {
    /// Conservative figures for a device kind without a profile: compute at a modest
    /// share of what such a device sustains, and loads at a pessimistic bandwidth, so
    /// the planner rather computes a block more than waits for a load it
    /// underestimated.
    pub fn defaults(device: &str) -> Self {
        let gpu = !device.starts_with("cpu");
        let (flops_per_s, host_bps, disk_bps) = if gpu {
            (2e14, 8e9, 1e9)
        } else {
            (5e10, 4e9, 3e8)
        };
        Profile {
            format: FORMAT.into(),
            version: VERSION,
            device: device.into(),
            model: String::new(),
            compute: Fit::assumed(0.0, 1.0 / flops_per_s),
            load_host: Fit::assumed(0.0, 1.0 / host_bps),
            load_disk: Fit::assumed(0.0, 1.0 / disk_bps),
        }
    }

    /// Whether these figures were measured (else they are [`Profile::defaults`]).
    pub fn fitted(&self) -> bool {
        self.compute.samples > 0
    }

    pub fn compute_s(&self, flops: f64) -> f64 {
        self.compute.predict(flops)
    }

    pub fn load_s(&self, tier: Tier, bytes: f64) -> f64 {
        match tier {
            Tier::Device => 0.0,
            Tier::Host => self.load_host.predict(bytes),
            Tier::Disk => self.load_disk.predict(bytes),
        }
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let p: Profile = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("{}: not a profile: {e}", path.display())))?;
        if p.format != FORMAT || p.version != VERSION {
            return Err(Error::Invalid(format!(
                "{}: {} version {}, this build reads {FORMAT} version {VERSION}",
                path.display(),
                p.format,
                p.version
            )));
        }
        Ok(p)
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares_recovers_a_line_and_reports_r2() {
        let x: Vec<f64> = (1..=8).map(|v| v as f64 * 1e9).collect();
        let y: Vec<f64> = x.iter().map(|v| 0.01 + 2e-11 * v).collect();
        let f = Fit::least_squares(&x, &y).unwrap();
        assert!((f.intercept_s - 0.01).abs() < 1e-12, "{f:?}");
        assert!((f.slope_s - 2e-11).abs() < 1e-20, "{f:?}");
        assert!((f.r2 - 1.0).abs() < 1e-12);
        // Noise lowers R²; a constant x cannot be fitted.
        let noisy: Vec<f64> = y
            .iter()
            .enumerate()
            .map(|(i, v)| v * if i % 2 == 0 { 1.3 } else { 0.7 })
            .collect();
        assert!(Fit::least_squares(&x, &noisy).unwrap().r2 < 0.95);
        assert!(Fit::least_squares(&[1.0, 1.0], &[1.0, 2.0]).is_err());
        assert!(Fit::least_squares(&[1.0], &[1.0]).is_err());
    }

    #[test]
    fn a_profile_round_trips_through_its_file_and_other_formats_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        let mut p = Profile::defaults("cpu-avx2");
        assert!(!p.fitted());
        p.compute = Fit::least_squares(&[1.0, 2.0, 3.0], &[1.0, 2.1, 2.9]).unwrap();
        p.write(&path).unwrap();
        assert_eq!(Profile::read(&path).unwrap(), p);
        assert!(Profile::read(&path).unwrap().fitted());
        std::fs::write(&path, r#"{"format": "other"}"#).unwrap();
        assert!(Profile::read(&path).is_err());
        assert_eq!(p.load_s(Tier::Device, 1e9), 0.0);
        assert!(p.load_s(Tier::Disk, 1e9) > p.load_s(Tier::Host, 1e9));
    }
}
