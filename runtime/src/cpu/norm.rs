//! Normalisations of the Flux blocks: LayerNorm fused with adaLN modulation, and
//! per-head RMSNorm fused with rotary position embedding.
//!
//! Both are row-local, so they run in parallel over rows. The arithmetic follows the
//! PyTorch order of operations (two-pass mean and variance, `x*rsqrt(var+eps)*w`,
//! `x*cos + rot(x)*sin`) so the results match the reference fixtures closely.

use rayon::prelude::*;

use super::simd::multiversion;

/// Rows per parallel task: enough work per task to amortise scheduling.
fn rows_per_task(cols: usize) -> usize {
    (16384 / cols.max(1)).max(1)
}

/// Sum with 16 independent partial sums, so the loop vectorises (a plain fold has a
/// strict order LLVM may not reassociate).
#[inline(always)]
fn sum16(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += f(*v);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| f(*v)).sum();
    acc.iter().sum::<f32>() + tail
}

multiversion! {
    fn layer_norm_row(x: &[f32], eps: f32, shift: &[f32], scale: &[f32], out: &mut [f32]) {
        let d = x.len() as f32;
        let mean = sum16(x, |v| v) / d;
        let var = sum16(x, |v| (v - mean) * (v - mean)) / d;
        let rstd = 1.0 / (var + eps).sqrt();
        for (((o, v), sh), sc) in out.iter_mut().zip(x).zip(shift).zip(scale) {
            *o = (v - mean) * rstd * (1.0 + sc) + sh;
        }
    }
}

/// `out[r] = LN(x[r]) * (1 + scale[seg[r]]) + shift[seg[r]]`, where `shift(s)` and
/// `scale(s)` give the modulation rows of segment `s`.
pub fn layer_norm_modulate<'a>(
    x: &[f32],
    d: usize,
    eps: f32,
    shift: impl Fn(usize) -> &'a [f32] + Sync,
    scale: impl Fn(usize) -> &'a [f32] + Sync,
    seg: &[u32],
    out: &mut [f32],
) {
    let rpt = rows_per_task(d);
    out.par_chunks_mut(d * rpt)
        .zip(x.par_chunks(d * rpt))
        .enumerate()
        .for_each(|(t, (o, xi))| {
            for (i, (orow, xrow)) in o.chunks_exact_mut(d).zip(xi.chunks_exact(d)).enumerate() {
                let s = seg[t * rpt + i] as usize;
                layer_norm_row(xrow, eps, shift(s), scale(s), orow);
            }
        });
}

multiversion! {
    fn rms_rope_row(row: &mut [f32], w: &[f32], eps: f32, cos: &[f32], sin: &[f32]) {
        let hd = w.len();
        for head in row.chunks_exact_mut(hd) {
            let ms = head.iter().map(|v| v * v).sum::<f32>() / hd as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for (v, wv) in head.iter_mut().zip(w) {
                *v = (*v * r) * wv;
            }
            if !cos.is_empty() {
                for ((pair, c), s) in head
                    .chunks_exact_mut(2)
                    .zip(cos.chunks_exact(2))
                    .zip(sin.chunks_exact(2))
                {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * c[0] + (-b) * s[0];
                    pair[1] = b * c[1] + a * s[1];
                }
            }
        }
    }
}

/// Per-head RMSNorm of columns `cols` of `x` (row width `width`) in place, then (if
/// `rope` is given) RoPE with tables `cos`/`sin` of shape `[rows, hd]`.
pub fn rms_norm_rope(
    x: &mut [f32],
    width: usize,
    cols: std::ops::Range<usize>,
    w: &[f32],
    eps: f32,
    rope: Option<(&[f32], &[f32])>,
) {
    let hd = w.len();
    let rpt = rows_per_task(width);
    x.par_chunks_mut(width * rpt)
        .enumerate()
        .for_each(|(t, chunk)| {
            for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
                let r = t * rpt + i;
                let part = &mut row[cols.clone()];
                match rope {
                    Some((c, s)) => rms_rope_row(
                        part,
                        w,
                        eps,
                        &c[r * hd..(r + 1) * hd],
                        &s[r * hd..(r + 1) * hd],
                    ),
                    None => rms_rope_row(part, w, eps, &[], &[]),
                }
            }
        });
}

multiversion! {
    fn gated_row(x: &mut [f32], gate: &[f32], y: &[f32]) {
        for ((x, g), y) in x.iter_mut().zip(gate).zip(y) {
            *x += g * y;
        }
    }
}

/// `x[r] += gate[seg[r]] * y[r]`.
pub fn gated_residual<'a>(
    x: &mut [f32],
    y: &[f32],
    d: usize,
    gate: impl Fn(usize) -> &'a [f32] + Sync,
    seg: &[u32],
) {
    let rpt = rows_per_task(d);
    x.par_chunks_mut(d * rpt)
        .zip(y.par_chunks(d * rpt))
        .enumerate()
        .for_each(|(t, (xc, yc))| {
            for (i, (xr, yr)) in xc.chunks_exact_mut(d).zip(yc.chunks_exact(d)).enumerate() {
                gated_row(xr, gate(seg[t * rpt + i] as usize), yr);
            }
        });
}
