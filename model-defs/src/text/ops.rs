//! CPU building blocks shared by the CLIP and T5 text encoders.
//!
//! The text encoders run once per prompt on at most 512 tokens, so they do not go
//! through the `Backend` trait (which is shaped around the Flux transformer's packed
//! batches). What they need is small: a bias-optional Linear over `gemm`, an
//! embedding lookup that rejects bad ids instead of panicking, per-head attention
//! with an optional additive bias or causal mask, and two norms. The norms accumulate
//! in f64 so that they sit closer to exact math than torch's float32 kernels do;
//! the fixtures' tolerances are measured against float64, so that only helps.

use denoised_runtime::cpu::matmul::{matmul, MatRef};
use denoised_runtime::{Error, Result, Tensor};
use rayon::prelude::*;

use crate::flux::weights::Source;

/// A PyTorch Linear kept in its on-disk `[out, in]` layout; `gemm` reads it as its
/// own transpose through strides, so no copy is made at load time.
pub(crate) struct Linear {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    in_f: usize,
    out_f: usize,
}

impl Linear {
    /// Loads one or more Linears that read the same input and stacks them along the
    /// output dimension (`q|k|v` become one GEMM). `names` are parameter prefixes
    /// (without `.weight`); each has `rows` outputs. Every loaded name is pushed onto
    /// `used` so the caller can reject unexpected tensors afterwards.
    pub(crate) fn load(
        src: &dyn Source,
        names: &[(&str, usize)],
        in_f: usize,
        bias: bool,
        used: &mut Vec<String>,
    ) -> Result<Self> {
        let mut w = Vec::new();
        let mut b = Vec::new();
        let mut out_f = 0;
        for &(name, rows) in names {
            let wn = format!("{name}.weight");
            w.extend_from_slice(src.get(&wn, &[rows, in_f])?.data());
            used.push(wn);
            if bias {
                let bn = format!("{name}.bias");
                b.extend_from_slice(src.get(&bn, &[rows])?.data());
                used.push(bn);
            }
            out_f += rows;
        }
        Ok(Linear {
            w,
            b: bias.then_some(b),
            in_f,
            out_f,
        })
    }

    pub(crate) fn out_features(&self) -> usize {
        self.out_f
    }

    /// `x [rows, in] -> [rows, out]`.
    pub(crate) fn forward(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.in_f;
        let mut out = Vec::with_capacity(rows * self.out_f);
        match &self.b {
            Some(b) => (0..rows).for_each(|_| out.extend_from_slice(b)),
            None => out.resize(rows * self.out_f, 0.0),
        }
        matmul(
            rows,
            self.out_f,
            self.in_f,
            &mut out,
            self.out_f,
            MatRef::row_major(x, self.in_f),
            MatRef::transposed(&self.w, self.in_f),
            self.b.is_some(),
            true,
        );
        out
    }
}

/// Loads a parameter of any shape and records its name.
pub(crate) fn load_tensor(
    src: &dyn Source,
    name: &str,
    shape: &[usize],
    used: &mut Vec<String>,
) -> Result<Tensor> {
    let t = src.get(name, shape)?;
    used.push(name.to_string());
    Ok(t)
}

/// Loads a 1-D parameter (a norm weight or bias) and records its name.
pub(crate) fn load_vec(
    src: &dyn Source,
    name: &str,
    len: usize,
    used: &mut Vec<String>,
) -> Result<Vec<f32>> {
    let t = src.get(name, &[len])?;
    used.push(name.to_string());
    Ok(t.into_data())
}

/// Rows of `table [vocab, d]` for `ids`. An id outside the table is an input error
/// (a tokenizer/model mismatch), reported rather than panicking.
pub(crate) fn embed(table: &Tensor, ids: &[i64], what: &str) -> Result<Vec<f32>> {
    let (vocab, d) = (table.rows(), table.cols());
    let mut out = Vec::with_capacity(ids.len() * d);
    for (pos, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(Error::Invalid(format!(
                "{what}: token id {id} at position {pos} is outside the embedding table \
                 ({vocab} rows); the tokenizer does not match the model"
            )));
        }
        out.extend_from_slice(table.row(id as usize));
    }
    Ok(out)
}

/// LayerNorm over the last dimension with affine weight and bias.
pub(crate) fn layer_norm(x: &[f32], d: usize, w: &[f32], b: &[f32], eps: f64) -> Vec<f32> {
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
pub(crate) fn rms_norm(x: &[f32], d: usize, w: &[f32], eps: f64) -> Vec<f32> {
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
pub(crate) struct Qkv<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
}

/// How the score matrix is adjusted before the softmax.
pub(crate) enum Mask<'a> {
    /// CLIP: position i sees positions 0..=i.
    Causal,
    /// T5: an additive `[heads, len, len]` bias; everything attends to everything.
    Bias(&'a [f32]),
}

/// `softmax(scale · q kᵀ + mask) v` for every head, over one sequence of `len`
/// tokens. Returns `[len, heads*hd]` with the heads side by side (head-major), as
/// the output projection expects. Heads run in parallel; each uses two GEMMs.
pub(crate) fn attention(
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

pub(crate) use denoised_runtime::config::read_json;
