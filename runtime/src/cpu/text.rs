//! The text encoders' kernels on the CPU (the reference of the Backend's text ops):
//! LayerNorm with affine weight and bias, T5's RMSNorm, per-head attention with an
//! additive bias (T5) or a causal mask (CLIP), and the activations. The encoders run
//! once per prompt on at most 512 tokens; the norms accumulate in f64 so that they sit
//! closer to exact math than torch's float32 kernels do (the fixtures' tolerances are
//! measured against float64, so that only helps).

use rayon::prelude::*;

use crate::cpu::matmul::{matmul, MatRef};

/// LayerNorm over the last dimension with affine weight and bias.
pub fn layer_norm(x: &[f32], d: usize, w: &[f32], b: &[f32], eps: f64) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = xr
            .iter()
            .map(|&v| (v as f64 - mean) * (v as f64 - mean))
            .sum::<f64>()
            / d as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            or[i] = (((xr[i] as f64 - mean) * inv) as f32) * w[i] + b[i];
        }
    }
    out
}

/// T5's RMSNorm: `w * x / sqrt(mean(x²) + eps)`, no mean subtraction and no bias.
pub fn rms_norm(x: &[f32], d: usize, w: &[f32], eps: f64) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            or[i] = w[i] * ((xr[i] as f64 * inv) as f32);
        }
    }
    out
}

/// Where q, k and v live in a row-major buffer: row stride and the column of head 0.
#[derive(Clone, Copy)]
pub struct Qkv<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
}

/// How the score matrix is adjusted before the softmax.
pub enum Mask<'a> {
    /// CLIP: position i sees positions 0..=i.
    Causal,
    /// T5: an additive `[heads, len, len]` bias; everything attends to everything.
    Bias(&'a [f32]),
}

/// `softmax(scale · q kᵀ + mask) v` for every head, over one sequence of `len`
/// tokens. Returns `[len, heads*hd]` with the heads side by side (head-major), as
/// the output projection expects. Heads run in parallel; each uses two GEMMs.
pub fn attention(
    x: Qkv<'_>,
    len: usize,
    heads: usize,
    hd: usize,
    scale: f32,
    mask: Mask<'_>,
) -> Vec<f32> {
    let per_head: Vec<Vec<f32>> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let mut s = vec![0.0f32; len * len];
            matmul(
                len,
                len,
                hd,
                &mut s,
                len,
                MatRef {
                    data: &x.data[x.q + h * hd..],
                    rs: x.rs,
                    cs: 1,
                },
                MatRef {
                    data: &x.data[x.k + h * hd..],
                    rs: 1,
                    cs: x.rs,
                },
                false,
                false,
            );
            for (i, row) in s.chunks_exact_mut(len).enumerate() {
                let visible = match mask {
                    Mask::Causal => i + 1,
                    Mask::Bias(_) => len,
                };
                if scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
                if let Mask::Bias(bias) = mask {
                    let br = &bias[(h * len + i) * len..(h * len + i + 1) * len];
                    row.iter_mut().zip(br).for_each(|(v, b)| *v += b);
                }
                softmax_prefix(row, visible);
            }
            let mut o = vec![0.0f32; len * hd];
            matmul(
                len,
                hd,
                len,
                &mut o,
                hd,
                MatRef::row_major(&s, len),
                MatRef {
                    data: &x.data[x.v + h * hd..],
                    rs: x.rs,
                    cs: 1,
                },
                false,
                false,
            );
            o
        })
        .collect();
    let d = heads * hd;
    let mut out = vec![0.0f32; len * d];
    for (h, o) in per_head.iter().enumerate() {
        for i in 0..len {
            out[i * d + h * hd..i * d + (h + 1) * hd].copy_from_slice(&o[i * hd..(i + 1) * hd]);
        }
    }
    out
}

/// Softmax over `row[..n]`; the rest of the row (masked positions) becomes 0.
fn softmax_prefix(row: &mut [f32], n: usize) {
    let (live, dead) = row.split_at_mut(n);
    dead.fill(0.0);
    let m = live.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0.0f64;
    for v in live.iter_mut() {
        *v = (*v - m).exp();
        sum += *v as f64;
    }
    live.iter_mut().for_each(|v| *v = (*v as f64 / sum) as f32);
}

/// transformers' `NewGELUActivation` (T5's gated-GELU): `0.5 x (1 + tanh(sqrt(2/π)(x +
/// 0.044715 x³)))`, evaluated in f64 and rounded once.
pub fn gelu_new(x: f32) -> f32 {
    let x = x as f64;
    let c = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// CLIP's quick_gelu, written as transformers does: `x * sigmoid(1.702 x)`.
pub fn quick_gelu(x: f32) -> f32 {
    x * (1.0 / (1.0 + (-1.702f32 * x).exp()))
}
