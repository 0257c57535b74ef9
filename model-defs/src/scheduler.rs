//! The flow-match Euler scheduler, as FluxFillPipeline drives
//! `FlowMatchEulerDiscreteScheduler`.
//!
//! The arithmetic reproduces diffusers' dtypes exactly (fixture README, "Scheduler"):
//! `mu` in float64, sigmas in float32 with NumPy 2's weak-scalar rules, a terminal 0,
//! and the Euler update `x + (sigma[i+1] - sigma[i]) * v` in float32. The scheduler is
//! plain data and code with no device and no I/O, so the denoise loop can advance many
//! requests, each at its own step.

use std::path::Path;

use denoised_runtime::{Error, Result};
use serde::Deserialize;

/// `scheduler/scheduler_config.json`. Defaults are FLUX.1's.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default)]
pub struct SchedulerConfig {
    pub num_train_timesteps: usize,
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub base_shift: f64,
    pub max_shift: f64,
    pub base_image_seq_len: usize,
    pub max_image_seq_len: usize,
    pub time_shift_type: String,
    pub shift_terminal: Option<f64>,
    pub invert_sigmas: bool,
    pub stochastic_sampling: bool,
    pub use_karras_sigmas: bool,
    pub use_exponential_sigmas: bool,
    pub use_beta_sigmas: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_train_timesteps: 1000,
            shift: 3.0,
            use_dynamic_shifting: true,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            time_shift_type: "exponential".into(),
            shift_terminal: None,
            invert_sigmas: false,
            stochastic_sampling: false,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
        }
    }
}

impl SchedulerConfig {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        denoised_runtime::config::read_json_validated(path.as_ref(), |c: &SchedulerConfig| {
            c.check()
        })
    }

    /// Rejects options FluxFillPipeline's scheduler does not use and that are not
    /// implemented here, rather than silently computing something else.
    pub fn check(&self) -> Result<(), String> {
        let unsupported = [
            ("invert_sigmas", self.invert_sigmas),
            ("stochastic_sampling", self.stochastic_sampling),
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
            ("shift_terminal", self.shift_terminal.is_some()),
        ];
        if let Some((name, _)) = unsupported.iter().find(|(_, on)| *on) {
            return Err(format!("scheduler option `{name}` is not supported"));
        }
        if self.time_shift_type != "exponential" {
            return Err(format!(
                "time_shift_type `{}` is not supported (only exponential)",
                self.time_shift_type
            ));
        }
        if self.max_image_seq_len <= self.base_image_seq_len {
            return Err("max_image_seq_len must exceed base_image_seq_len".into());
        }
        Ok(())
    }

    /// `calculate_shift` of the Flux pipelines, in float64.
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }
}

/// The schedule of one request: `steps` timesteps and `steps + 1` sigmas.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchEuler {
    pub timesteps: Vec<f32>,
    pub sigmas: Vec<f32>,
}

impl FlowMatchEuler {
    /// The schedule FluxFillPipeline builds for `steps` steps at `image_seq_len` tokens.
    pub fn new(cfg: &SchedulerConfig, steps: usize, image_seq_len: usize) -> Result<Self> {
        if steps == 0 {
            return Err(Error::Invalid("steps must be at least 1".into()));
        }
        // np.linspace(1.0, 1/n, n) in float64, then float32.
        // NumPy's linspace: `arange(n) * step + start`, with the last point set to `stop`.
        let n = steps as f64;
        let end = 1.0 / n;
        let step = if steps > 1 {
            (end - 1.0) / (n - 1.0)
        } else {
            0.0
        };
        let base: Vec<f32> = (0..steps)
            .map(|i| if i + 1 == steps && steps > 1 { end } else { i as f64 * step + 1.0 } as f32)
            .collect();
        let sigmas: Vec<f32> = if cfg.use_dynamic_shifting {
            let e = cfg.mu(image_seq_len).exp() as f32;
            base.iter().map(|&s| e / (e + (1.0 / s - 1.0))).collect()
        } else {
            let sh = cfg.shift as f32;
            base.iter()
                .map(|&s| sh * s / (1.0 + (sh - 1.0) * s))
                .collect()
        };
        let ntt = cfg.num_train_timesteps as f32;
        let timesteps = sigmas.iter().map(|s| s * ntt).collect();
        let mut sigmas = sigmas;
        sigmas.push(0.0);
        Ok(FlowMatchEuler { timesteps, sigmas })
    }

    pub fn steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The timestep the transformer receives at `step` (scheduler timestep / 1000).
    pub fn model_timestep(&self, step: usize) -> f32 {
        self.timesteps[step] / 1000.0
    }

    /// The Euler update of step `step`, in place: `x += (sigma[i+1] - sigma[i]) * v`.
    pub fn step(&self, step: usize, x: &mut [f32], v: &[f32]) {
        let dt = self.sigmas[step + 1] - self.sigmas[step];
        for (x, v) in x.iter_mut().zip(v) {
            *x += dt * v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_unknown_options() {
        let cfg = SchedulerConfig {
            use_karras_sigmas: true,
            ..Default::default()
        };
        assert!(cfg.check().unwrap_err().contains("use_karras_sigmas"));
        assert!(FlowMatchEuler::new(&SchedulerConfig::default(), 0, 256).is_err());
    }

    #[test]
    fn schedule_is_monotone_and_ends_at_zero() {
        let s = FlowMatchEuler::new(&SchedulerConfig::default(), 28, 4096).unwrap();
        assert_eq!(s.sigmas.len(), 29);
        assert_eq!(s.sigmas[0], 1.0);
        assert_eq!(*s.sigmas.last().unwrap(), 0.0);
        assert!(s.sigmas.windows(2).all(|w| w[0] > w[1]));
    }
}
