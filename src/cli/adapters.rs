//! `--lora PATH[:SCALE]` and `--lora-mode` of `denoised generate`, `edit` and
//! `template capture` (docs/design.md §Adapters).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use denoised_actors::device::Placed;
use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::lora::{set_key, LoraFile};
use denoised_models::FluxConfig;

use super::CliResult;

/// One `--lora`: a path and the scale it is applied with.
#[derive(Clone, Debug)]
pub struct LoraSpec {
    pub path: PathBuf,
    /// As given (f64, so reports print it as typed); applied in f32.
    pub scale: f64,
}

impl FromStr for LoraSpec {
    type Err = String;
    /// `PATH` or `PATH:SCALE`: the scale is what follows the last `:` when it is a
    /// number, so paths with colons still work.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((p, sc)) = s.rsplit_once(':') {
            if let Ok(scale) = sc.parse::<f64>() {
                if !scale.is_finite() || scale.abs() > f32::MAX as f64 {
                    return Err(format!("`{s}`: the scale must be a finite number"));
                }
                return Ok(LoraSpec {
                    path: p.into(),
                    scale,
                });
            }
        }
        Ok(LoraSpec {
            path: s.into(),
            scale: 1.0,
        })
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraMode {
    /// The weights patched once before the run (`W += s·B A`): no cost per step.
    Merged,
    /// Each LoRA's low-rank product added per step over the request's rows: what the
    /// daemon batches, where requests with different LoRAs share a step.
    Unmerged,
}

#[derive(clap::Args, Debug, Clone)]
pub struct LoraArgs {
    /// A LoRA of the transformer in the PEFT/diffusers format (a `.safetensors` file,
    /// or a directory holding `pytorch_lora_weights.safetensors`), with an optional
    /// scale (default 1): `PATH[:SCALE]`. Repeatable; the deltas add up.
    #[arg(long = "lora", value_name = "PATH[:SCALE]")]
    pub loras: Vec<LoraSpec>,
    /// How the LoRAs are applied. Both give the same image within float rounding.
    #[arg(long, value_enum, default_value = "merged")]
    pub lora_mode: LoraMode,
}

/// The LoRAs of a run, applied to its placed model.
pub struct Applied {
    /// What the run's job names at each step (unmerged mode).
    pub uses: Vec<LoraUse>,
    /// The set's template key (`lora::set_key`): empty without LoRAs.
    pub key: String,
}

impl LoraArgs {
    /// Reads every LoRA, checked against the transformer `config`, and applies them to
    /// `placed`: merged into its weights, or uploaded for the run's job to name.
    pub fn apply(&self, placed: &mut Placed, config: &FluxConfig) -> CliResult<Applied> {
        if self.loras.is_empty() {
            return Ok(Applied {
                uses: vec![],
                key: String::new(),
            });
        }
        let t0 = Instant::now();
        let files = self
            .loras
            .iter()
            .map(|l| LoraFile::open(&l.path, config))
            .collect::<Result<Vec<_>, _>>()?;
        let set: Vec<(&LoraFile, f32)> = files
            .iter()
            .zip(&self.loras)
            .map(|(f, l)| (f, l.scale as f32))
            .collect();
        let read_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let st = &mut placed.stepper;
        let uses = match self.lora_mode {
            LoraMode::Merged => {
                let sites = st.merge_loras(&set)?;
                eprintln!(
                    "LoRA: {} merged into {sites} Linears (read {read_s:.2} s, merged {:.2} s)",
                    files.len(),
                    t0.elapsed().as_secs_f64()
                );
                vec![]
            }
            LoraMode::Unmerged => {
                let uses = set
                    .iter()
                    .map(|(f, scale)| {
                        Ok(LoraUse {
                            id: st.add_lora(f)?,
                            scale: *scale,
                        })
                    })
                    .collect::<CliResult<Vec<_>>>()?;
                eprintln!(
                    "LoRA: {} uploaded, applied per step (read {read_s:.2} s, uploaded {:.2} s)",
                    files.len(),
                    t0.elapsed().as_secs_f64()
                );
                uses
            }
        };
        Ok(Applied {
            uses,
            key: set_key(set.iter().copied()),
        })
    }
}
