//! Spatially sparse VAE (SIGE) for edits of a template.
//!
//! A template's capture also records a [`VaeTrace`] of each VAE pass: every
//! convolution's output (what a sparse layer scatters into), the sums behind every
//! GroupNorm's statistics, and the mid-block attention's K and V. An edit's pass then
//! differs from the template's only in a region of each layer; it recomputes those
//! pixels, tile by tile (`denoised_runtime::cpu::sparse_conv`), and takes the rest from
//! the trace.
//!
//! - **Regions** ([`RegionMode`]): what differs (the input's difference mask grown
//!   through each layer, or SIGE's fixed dilation), intersected with what the kept
//!   output reads (the pixel mask for the decoder, the active tokens for the encoder,
//!   grown back through the layers after it).
//! - **GroupNorm statistics** ([`StatsMode`]): the template's, as SIGE does, or updated
//!   from the cached sums with the recomputed tiles' old and new values.
//!
//! Once a GroupNorm's statistics move, every pixel after it moves a little. `exact`
//! regions follow that (everything after the first such GroupNorm is recomputed, so
//! `exact` + `incremental` is the dense VAE, at about its cost); `local` regions and
//! SIGE's dilation keep the template's values outside the region, which is where
//! their savings come from. How far each is from dense is measured
//! (docs/performance.md); the serving default is `local`.

mod attention;
mod device;
mod exec;
mod program;
mod stored;
mod trace;

use std::fmt;
use std::str::FromStr;

use denoised_runtime::cpu::sparse_conv::Tiles;
use denoised_runtime::{Error, Result, Tensor};

use super::model::{split_moments, AutoencoderKL};
use program::Program;

pub use attention::sparse_attention;
pub use device::DeviceTrace;
pub use stored::{check_traces, map_trace, read_trace};
pub use trace::{TraceValue, VaeTrace};

/// Which pixels of each layer an edit recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionMode {
    /// Every pixel whose value the edit can change: no cut-off of any receptive field.
    /// With `incremental` statistics a GroupNorm's is the whole image, so this
    /// recomputes nearly everything and equals the dense VAE: the reference the cheaper
    /// modes are measured against, never picked for speed.
    Exact,
    /// The convolutions' receptive fields (and the attention's, the whole image), a
    /// GroupNorm counted as pixelwise: what the edit moves beyond that is only the
    /// statistics' small global shift. The same as `Exact` under `frozen` statistics.
    Local,
    /// SIGE's: the difference mask on each layer's plane, dilated by N pixels there.
    Dilated(usize),
}

impl FromStr for RegionMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.split_once(':') {
            None if s == "exact" => Ok(RegionMode::Exact),
            None if s == "local" => Ok(RegionMode::Local),
            Some(("dilated", n)) => n
                .parse()
                .map(RegionMode::Dilated)
                .map_err(|_| format!("dilated:{n}: the dilation must be a pixel count")),
            _ => Err(format!(
                "sparse VAE region {s:?}: expected exact, local or dilated:N"
            )),
        }
    }
}

impl fmt::Display for RegionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegionMode::Exact => write!(f, "exact"),
            RegionMode::Local => write!(f, "local"),
            RegionMode::Dilated(n) => write!(f, "dilated:{n}"),
        }
    }
}

/// Where a sparse layer's GroupNorm statistics come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsMode {
    /// The template's (SIGE).
    Frozen,
    /// The template's sums, updated with the recomputed tiles' old and new values.
    Incremental,
}

impl FromStr for StatsMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "frozen" => Ok(StatsMode::Frozen),
            "incremental" => Ok(StatsMode::Incremental),
            _ => Err(format!(
                "GroupNorm statistics {s:?}: expected frozen or incremental"
            )),
        }
    }
}

impl fmt::Display for StatsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StatsMode::Frozen => "frozen",
            StatsMode::Incremental => "incremental",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseOpts {
    pub region: RegionMode,
    pub stats: StatsMode,
    /// Tile side in pixels on the large planes (half of it on planes narrower than 16
    /// tiles).
    pub tile: usize,
    /// Crop-with-halo: each layer computes its region's bounding box (the kept
    /// pixels' box grown by the receptive-field halo) as one rectangle of tiles, with
    /// the template's trace outside it as for any sparse pass. More MACs than the
    /// region's own tiles, in fewer and larger GEMMs. (A plain crop, the dense decoder
    /// on the window alone, takes its GroupNorm statistics and attention from the
    /// window: measured 10-38 levels off inside the mask; docs/performance.md.)
    pub crop: bool,
}

/// The tile side (a storage unit: a layer computes only the region's runs inside its
/// tiles, and consecutive tiles share one GEMM, see `sparse_conv`). Larger tiles mean
/// fewer, longer runs and fewer input windows; the cost is the cached pixels copied
/// into a partly computed tile. Measured at 512x512, m = 0.05 / 0.1 (bench pipeline
/// --sparse-vae, local/frozen, share of the MAC bound): tile 8 0.53-0.65, 16 0.60-0.72,
/// 32 0.65-0.77, 64 0.63-0.74.
pub const DEFAULT_TILE: usize = 32;

impl Default for SparseOpts {
    fn default() -> Self {
        SparseOpts {
            region: RegionMode::Local,
            stats: StatsMode::Incremental,
            tile: DEFAULT_TILE,
            crop: false,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseReport {
    /// Multiply-accumulates of the dense pass.
    pub dense_macs: u64,
    /// Those the sparse pass computes: the region's (or, with `crop`, its bounding
    /// boxes').
    pub sparse_macs: u64,
    /// Those of the region's pixels alone: the MAC bound.
    pub region_macs: u64,
}

/// Which half of the VAE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    Encoder,
    Decoder,
}

impl AutoencoderKL {
    /// `encode`, recording the template's trace (`image` is `[1, C, H, W]`).
    pub fn trace_encode(&self, image: &Tensor) -> Result<VaeTrace> {
        let prog = Program::new(self, Half::Encoder, one(image, "encode")?)?;
        exec::capture(self, &prog, image)
    }

    /// `decode`, recording the template's trace (`z` is `[1, C, h, w]`).
    pub fn trace_decode(&self, z: &Tensor) -> Result<VaeTrace> {
        let prog = Program::new(self, Half::Decoder, one(z, "decode")?)?;
        exec::capture(self, &prog, z)
    }

    /// The encoder's `(mean, logvar)` for `image`, which differs from the template's
    /// traced image only at the `diff` pixels (`[H * W]`); exact (see [`RegionMode`])
    /// only at the latent pixels of `keep` (`[H/f * W/f]`).
    pub fn encode_sparse(
        &self,
        image: &Tensor,
        template: &VaeTrace,
        diff: &[bool],
        keep: &[bool],
        opts: SparseOpts,
    ) -> Result<((Tensor, Tensor), SparseReport)> {
        let plan = self.plan_sparse(Half::Encoder, one(image, "encode")?, diff, keep, opts)?;
        let m = self.run_sparse(&plan, image, template)?;
        Ok((
            split_moments(&m, self.config().latent_channels)?,
            plan.report,
        ))
    }

    /// The decoded image of `z`, which differs from the template's traced latent only at
    /// the `diff` latent pixels (`[h * w]`); exact only at the `keep` pixels
    /// (`[H * W]`), the template's decoded image elsewhere.
    pub fn decode_sparse(
        &self,
        z: &Tensor,
        template: &VaeTrace,
        diff: &[bool],
        keep: &[bool],
        opts: SparseOpts,
    ) -> Result<(Tensor, SparseReport)> {
        let plan = self.plan_sparse(Half::Decoder, one(z, "decode")?, diff, keep, opts)?;
        Ok((self.run_sparse(&plan, z, template)?, plan.report))
    }

    /// What a sparse pass of `half` on an input of `[C, H, W]` recomputes, and its
    /// MACs: cheap (no tensor is touched), so a caller can choose dense or sparse from
    /// it before any trace exists.
    pub fn plan_sparse(
        &self,
        half: Half,
        input: [usize; 3],
        diff: &[bool],
        keep: &[bool],
        opts: SparseOpts,
    ) -> Result<SparsePlan> {
        if opts.tile == 0 {
            return Err(Error::Invalid("sparse VAE tile size 0".into()));
        }
        let prog = Program::new(self, half, input)?;
        let plane = |v: usize| prog.shapes[v][1] * prog.shapes[v][2];
        if diff.len() != plane(0) || keep.len() != plane(prog.output()) {
            return Err(Error::shape(
                "sparse VAE",
                format!(
                    "difference mask of {} and kept region of {} pixels, expected {} and {}",
                    diff.len(),
                    keep.len(),
                    plane(0),
                    plane(prog.output())
                ),
            ));
        }
        let regions = prog.regions(diff, keep, opts.region, opts.stats);
        let whole = matches!(opts.region, RegionMode::Dilated(_));
        let (tiles, report) = exec::tiles(&prog, &regions, opts.tile, opts.crop, whole)?;
        Ok(SparsePlan {
            half,
            input,
            stats: opts.stats,
            tiles,
            report,
            trace_bytes: prog.trace_floats() * 4,
        })
    }

    /// Bytes of the stored trace of `half` for an input of `[C, H, W]` (its payload:
    /// every value and the attention K/V in f32, the GroupNorm sums in f64; the header
    /// adds a few KB). Shapes only: a [`AutoencoderKL::shapes_only`] VAE will do.
    pub fn trace_bytes(&self, half: Half, input: [usize; 3]) -> Result<u64> {
        let prog = Program::new(self, half, input)?;
        let groups = self.config().norm_num_groups;
        let norms = prog
            .ops
            .iter()
            .filter(|op| match op {
                program::Op::Conv { pre, .. } => pre.is_some(),
                program::Op::Attn { .. } => true,
            })
            .count();
        Ok(prog.trace_floats() as u64 * 4 + (norms * groups * 16) as u64)
    }

    /// Runs a plan on `input` against the template's trace.
    pub fn run_sparse(
        &self,
        plan: &SparsePlan,
        input: &Tensor,
        template: &VaeTrace,
    ) -> Result<Tensor> {
        let prog = Program::new(self, plan.half, plan.input)?;
        if one(input, "sparse VAE")? != plan.input
            || template.values.len() != prog.shapes.len()
            || template.values[0].shape()[1..] != plan.input
        {
            return Err(Error::shape(
                "sparse VAE",
                format!(
                    "input {:?} and a trace of {} values on {:?} for a {:?} plan of {} values on {:?}",
                    input.shape(),
                    template.values.len(),
                    template.values[0].shape(),
                    plan.half,
                    prog.shapes.len(),
                    plan.input
                ),
            ));
        }
        exec::run(&prog, template, input, &plan.tiles, plan.stats)
    }
}

/// A sparse pass's regions and cost (see [`AutoencoderKL::plan_sparse`]).
pub struct SparsePlan {
    half: Half,
    input: [usize; 3],
    stats: StatsMode,
    /// Per value, the tiles the pass recomputes (None: the template's value as it is).
    tiles: Vec<Option<Tiles>>,
    pub report: SparseReport,
    trace_bytes: usize,
}

impl SparsePlan {
    /// The bytes of the trace this pass reads, but for the GroupNorm sums (a few KB):
    /// known before the trace is recorded.
    pub fn trace_bytes(&self) -> usize {
        self.trace_bytes
    }
}

impl SparseReport {
    /// The share of the dense pass's MACs the sparse pass computes.
    pub fn fraction(&self) -> f64 {
        self.sparse_macs as f64 / self.dense_macs.max(1) as f64
    }
}

/// Max abs difference of `a` and `b` (`[1, C, H, W]` alike) at the `keep` pixels
/// (`[H * W]`) of every channel, and the max abs value of `b` there: how the sparse
/// passes' error against dense is measured (tests, `bench pipeline --sparse-vae`).
pub fn kept_error(a: &Tensor, b: &Tensor, keep: &[bool]) -> (f32, f32) {
    let plane = keep.len();
    a.data()
        .iter()
        .zip(b.data())
        .enumerate()
        .filter(|(i, _)| keep[i % plane])
        .fold((0.0, 0.0), |(d, m), (_, (x, y))| {
            (f32::max(d, (x - y).abs()), f32::max(m, y.abs()))
        })
}

fn one(x: &Tensor, op: &'static str) -> Result<[usize; 3]> {
    match *x.shape() {
        [1, c, h, w] => Ok([c, h, w]),
        ref s => Err(Error::shape(
            op,
            format!("expected one image [1, C, H, W], got {s:?}"),
        )),
    }
}

#[cfg(test)]
mod tests;
