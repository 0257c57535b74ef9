//! `--controlnet DIR:IMAGE[:SCALE]` of `denoised generate` and `denoised edit`
//! (docs/design.md §Adapters): the
//! ControlNets run in process, each step's residuals before the step (`LocalControl`),
//! on the host's CPU. The daemon streams the same residuals from its ControlNet
//! service's processes; both sum them alike, so they agree bit for bit.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use denoised_models::flux::control_feed::{ControlFeed, ControlInputs, ControlUse, LocalControl};
use denoised_models::flux::controlnet::ControlNet;
use denoised_models::flux::edit::DenoiseInputs;
use denoised_models::pipeline::control::{control_rng, ControlEncoder};
use denoised_models::pipeline::image::{decode_image, ImageLimits};
use denoised_models::scheduler::FlowMatchEuler;
use denoised_models::ModelSource;
use denoised_runtime::CpuBackend;

use super::CliResult;

/// One `--controlnet`.
#[derive(Clone, Debug)]
pub struct ControlNetSpec {
    /// A diffusers `FluxControlNetModel` directory.
    pub dir: PathBuf,
    /// Its control image (the output image's size).
    pub image: PathBuf,
    pub scale: f32,
}

impl FromStr for ControlNetSpec {
    type Err = String;
    /// `DIR:IMAGE` or `DIR:IMAGE:SCALE` (the scale is what follows the last `:` when
    /// it is a number).
    fn from_str(s: &str) -> Result<Self, String> {
        let (rest, scale) = match s.rsplit_once(':') {
            Some((r, sc)) if sc.parse::<f32>().is_ok() => (r, sc.parse::<f32>().unwrap_or(1.0)),
            _ => (s, 1.0),
        };
        if !scale.is_finite() {
            return Err(format!("`{s}`: the scale must be a finite number"));
        }
        let (dir, image) = rest
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: expected DIR:IMAGE[:SCALE]"))?;
        Ok(ControlNetSpec {
            dir: dir.into(),
            image: image.into(),
            scale,
        })
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ControlNetArgs {
    /// A FLUX ControlNet (a diffusers `FluxControlNetModel` directory), its control
    /// image (a PNG or JPEG of the output's size) and its conditioning scale (default
    /// 1): `DIR:IMAGE[:SCALE]`. Repeatable; the residuals add up (diffusers'
    /// `FluxMultiControlNetModel`). It runs on the host's CPU.
    #[arg(long = "controlnet", value_name = "DIR:IMAGE[:SCALE]")]
    pub controlnets: Vec<ControlNetSpec>,
}

impl ControlNetArgs {
    /// The feed of a request's residuals, or `None` without ControlNets (or with
    /// every scale 0). `active`: a template edit's active tokens, the only rows its
    /// residuals carry.
    pub fn feed(
        &self,
        model: &ModelSource,
        inputs: &DenoiseInputs,
        schedule: &FlowMatchEuler,
        (seed, width, height): (u64, usize, usize),
        limits: &ImageLimits,
        active: Option<Vec<u32>>,
    ) -> CliResult<Option<Arc<dyn ControlFeed>>> {
        if self.controlnets.is_empty() {
            return Ok(None);
        }
        let encoder = ControlEncoder::load(model)?;
        let mut rng = control_rng(seed);
        let mut uses = Vec::new();
        for c in &self.controlnets {
            let net = ControlNet::load(CpuBackend::new(), &c.dir)
                .map_err(|e| format!("{}: {e}", c.dir.display()))?;
            let bytes =
                std::fs::read(&c.image).map_err(|e| format!("{}: {e}", c.image.display()))?;
            let image = decode_image(&bytes, limits)?;
            if (image.width, image.height) != (width, height) {
                return Err(format!(
                    "{}: the control image is {}x{}; the output is {width}x{height}",
                    c.image.display(),
                    image.width,
                    image.height
                )
                .into());
            }
            let control = encoder
                .encode(&image, None, &mut rng)
                .map_err(|e| format!("{}: {e}", c.image.display()))?;
            uses.push(ControlUse {
                net: Arc::new(net),
                control,
                scale: c.scale,
            });
        }
        let mut control = ControlInputs::new(inputs, schedule);
        if let Some(active) = active {
            control = control.keeping(active);
        }
        let feed = LocalControl::new(uses, control)?;
        Ok(feed.map(|f| Arc::new(f) as Arc<dyn ControlFeed>))
    }
}
