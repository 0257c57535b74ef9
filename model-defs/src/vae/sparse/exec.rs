//! Running a [`Program`]: densely while recording a template's trace, or sparsely on
//! top of one.

use std::borrow::Cow;

use denoised_runtime::cpu::conv::{conv2d, group_norm};
use denoised_runtime::cpu::sparse_conv::{
    sparse_conv2d, GroupSums, Plane, PreAct, Run, TileData, Tiles,
};
use denoised_runtime::{Error, Result, Tensor};

use super::super::config::GN_EPS;
use super::super::model::AutoencoderKL;
use super::super::weights::Norm;
use super::attention::sparse_attention;
use super::program::{Op, Program};
use super::{SparseReport, StatsMode, TraceValue, VaeTrace};

/// The dense pass, recording every value, the sums of every GroupNorm's input and the
/// attention's K and V. The ops are the dense forward's own calls in its order, so the
/// trace's output is bit for bit what `decode` / `encode` give.
pub(crate) fn capture(vae: &AutoencoderKL, prog: &Program<'_>, input: &Tensor) -> Result<VaeTrace> {
    let groups = vae.config().norm_num_groups;
    let mut values = vec![input.clone()];
    let mut sums = vec![None];
    let mut kv = None;
    for op in &prog.ops {
        let x = &values[op.input()];
        let (out, s) = match op {
            Op::Conv {
                conv,
                opts,
                pre,
                residual,
                ..
            } => {
                let (h, s) = match pre {
                    Some((n, silu)) => {
                        let h = group_norm(x, groups, &n.w, &n.b, GN_EPS, *silu)?;
                        (Cow::Owned(h), Some(GroupSums::of(x, groups)?))
                    }
                    None => (Cow::Borrowed(x), None),
                };
                let r = residual.map(|r| &values[r]);
                (conv2d(&h, &conv.w, Some(&conv.b), *opts, r)?, s)
            }
            Op::Attn { attn, .. } => {
                let (out, qkv) = vae.attention_traced(x, attn)?;
                let c = x.shape()[1];
                let rows: Vec<f32> = qkv
                    .chunks_exact(3 * c)
                    .flat_map(|r| &r[c..])
                    .copied()
                    .collect();
                kv = Some(Tensor::new([rows.len() / (2 * c), 2 * c], rows)?);
                (out, Some(GroupSums::of(x, groups)?))
            }
        };
        values.push(out);
        sums.push(s);
    }
    Ok(VaeTrace {
        values: values.into_iter().map(TraceValue::from).collect(),
        sums,
        kv: kv.map(TraceValue::from),
    })
}

/// A value of the sparse pass: the template's, with the tiles the edit recomputed over
/// it (see `denoised_runtime::cpu::sparse_conv::Plane`).
struct Value<'a> {
    base: Plane<'a>,
    new: Option<TileData>,
}

impl Value<'_> {
    fn plane(&self) -> Result<Plane<'_>> {
        self.base.with(self.new.as_ref())
    }
}

/// The tiles covering each value's region (or, with `crop`, its bounding box; None:
/// the value is the template's), computing the region's runs or, with `whole`, every
/// pixel of each tile; and the MACs of the dense pass, of what the tiles compute and of
/// the regions alone.
///
/// `whole` is SIGE's own granularity, for `dilated` regions: the paper computes every
/// block its dilated mask touches, so a block's pixels beyond the dilation are part of
/// what that mode is (computing the dilated pixels alone cuts the receptive field to
/// exactly N pixels a level: measured 8-80 levels off at 256x256, against 1.5-12.5).
pub(crate) fn tiles(
    prog: &Program<'_>,
    regions: &[Vec<bool>],
    tile: usize,
    crop: bool,
    whole: bool,
) -> Result<(Vec<Option<Tiles>>, SparseReport)> {
    let mut r = SparseReport::default();
    let mut tiles = vec![None];
    for (i, op) in prog.ops.iter().enumerate() {
        let [co, h, w] = prog.shapes[i + 1];
        let [ci, ih, iw] = prog.shapes[op.input()];
        let per_px = match op {
            Op::Conv { k, .. } => ci * k * k * co,
            // q, k, v and out projections, q·k and p·v against every pixel.
            Op::Attn { .. } => 4 * ci * ci + 2 * ci * ih * iw,
        } as u64;
        let region = &regions[i + 1];
        let on = region.iter().filter(|&&b| b).count();
        r.dense_macs += per_px * (h * w) as u64;
        r.region_macs += per_px * on as u64;
        let boxed;
        let covered = if crop {
            boxed = bounding_box(region, w);
            &boxed
        } else {
            region
        };
        let t = (on > 0)
            .then(|| {
                let t = Tiles::covering(covered, h, w, level_tile(tile, h, w))?;
                Ok::<_, denoised_runtime::Error>(if whole { t.whole() } else { t })
            })
            .transpose()?;
        r.sparse_macs += per_px * t.as_ref().map_or(0, |t| t.computed()) as u64;
        tiles.push(t);
    }
    Ok((tiles, r))
}

/// The tile side on an `h x w` plane: `tile`, halved on planes narrower than 16 tiles.
/// On the deep, small planes a region grown by the receptive field is a thin ring, and
/// large tiles around it would copy mostly cached pixels. (When tiles were computed
/// whole this halving bought 0.42-0.58 -> 0.49-0.61 of the MAC bound at 512x512; with
/// runs, measured at tile 32, it is within this machine's noise of one size for all,
/// 0.65-0.68 against 0.60-0.69, and kept.)
fn level_tile(tile: usize, h: usize, w: usize) -> usize {
    if h.min(w) < 16 * tile {
        (tile / 2).max(1)
    } else {
        tile
    }
}

/// The bounding box of a plane's set pixels (`w` per row), as a plane.
fn bounding_box(region: &[bool], w: usize) -> Vec<bool> {
    let (mut y0, mut y1, mut x0, mut x1) = (usize::MAX, 0, usize::MAX, 0);
    for (i, _) in region.iter().enumerate().filter(|(_, &b)| b) {
        let (y, x) = (i / w, i % w);
        (y0, y1, x0, x1) = (y0.min(y), y1.max(y + 1), x0.min(x), x1.max(x + 1));
    }
    (0..region.len())
        .map(|i| (y0..y1).contains(&(i / w)) && (x0..x1).contains(&(i % w)))
        .collect()
}

/// The sparse pass of `input` against `trace`, recomputing each value's `tiles` (from
/// [`tiles`]).
pub(crate) fn run(
    prog: &Program<'_>,
    trace: &VaeTrace,
    input: &Tensor,
    tiles: &[Option<Tiles>],
    stats_mode: StatsMode,
) -> Result<Tensor> {
    // The input is whole (the edit's own); every later value starts as the template's.
    let mut values: Vec<Value<'_>> = vec![Value {
        base: Plane::of(input)?,
        new: None,
    }];
    let last_read = prog.last_reads();
    for (i, op) in prog.ops.iter().enumerate() {
        // Tiles nothing reads any more go (a pass would otherwise hold every layer's).
        for (v, &last) in last_read.iter().enumerate() {
            if last == Some(i.wrapping_sub(1)) {
                values[v].new = None;
            }
        }
        let v = i + 1;
        let [_, ih, iw] = prog.shapes[op.input()];
        let base = trace.values[v].plane()?;
        let Some(tiles) = tiles[v].clone() else {
            values.push(Value { base, new: None });
            continue;
        };
        let x = &values[op.input()];
        let stats = |norm: &Norm| -> Result<(Vec<f32>, Vec<f32>)> {
            let mut sums = trace.sums[v].clone().ok_or_else(|| {
                Error::Invalid(format!("VAE trace: no GroupNorm sums for value {v}"))
            })?;
            if let (StatsMode::Incremental, Some(t)) = (stats_mode, &x.new) {
                sums.update(trace.values[op.input()].plane()?, t)?;
            }
            Ok(sums.scale_shift(norm.w.data(), norm.b.data(), GN_EPS))
        };
        let new = match op {
            Op::Conv {
                conv,
                opts: geo,
                pre,
                residual,
                ..
            } => {
                let ss = pre.map(|(n, _)| stats(n)).transpose()?;
                let pre = pre
                    .zip(ss.as_ref())
                    .map(|((_, silu), (scale, shift))| PreAct { scale, shift, silu });
                let r = residual.map(|r| values[r].plane()).transpose()?;
                let (w, b) = (&conv.w, Some(&conv.b));
                sparse_conv2d(x.plane()?, w, b, *geo, pre, r, base, tiles)?
            }
            Op::Attn { attn, .. } => {
                let (scale, shift) = stats(&attn.norm)?;
                let kv = trace
                    .kv
                    .as_ref()
                    .ok_or_else(|| Error::Invalid("VAE trace: no attention K/V".into()))?;
                // Changed statistics move every pixel's K and V: recompute them all (one
                // GEMM at the smallest level). Frozen ones move only the changed pixels'.
                let refresh = match (&x.new, stats_mode) {
                    (None, _) => Vec::new(),
                    (Some(_), StatsMode::Incremental) => {
                        (0..ih).map(|y| Run { y, x0: 0, x1: iw }).collect()
                    }
                    (Some(t), StatsMode::Frozen) => t.tiles.all_runs().to_vec(),
                };
                let x = x.plane()?;
                sparse_attention(x, attn, &scale, &shift, kv.data(), &refresh, base, tiles)?
            }
        };
        values.push(Value {
            base,
            new: Some(new),
        });
    }
    Ok(values
        .last()
        .expect("the input at least")
        .plane()?
        .to_tensor())
}
