//! The CPU backend: f32 compute on host memory, parallel over all cores with rayon.
//!
//! It is the numerical reference for every device kernel (DESIGN.md §Devices), and the
//! backend the daemon uses on machines without a GPU. GEMMs go through the `gemm`
//! crate; the other ops are hand-written loops, vectorised through [`simd`].

pub mod attention;
pub mod matmul;
pub mod norm;
pub mod simd;

use rayon::prelude::*;

use crate::backend::{AttnSeq, Backend, Modulation};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

/// The `chunk`-th block of `width` columns of row `s` of a modulation table.
fn mod_row<'a>(m: &Modulation<'a, Tensor>, width: usize) -> impl Fn(usize) -> &'a [f32] + Sync {
    let table: &'a Tensor = m.table;
    let tw = table.cols();
    let off = m.chunk * width;
    move |s| &table.data()[s * tw + off..s * tw + off + width]
}

fn check_mod(op: &'static str, m: &Modulation<'_, Tensor>, rows: usize, width: usize) -> Result<()> {
    let segs = m.table.rows();
    if m.seg.len() != rows {
        return Err(Error::shape(op, format!("{} segment ids for {rows} rows", m.seg.len())));
    }
    if (m.chunk + 1) * width > m.table.cols() {
        return Err(Error::shape(op, format!("chunk {} of width {width} beyond table width {}", m.chunk, m.table.cols())));
    }
    if let Some(&bad) = m.seg.iter().find(|&&s| s as usize >= segs) {
        return Err(Error::shape(op, format!("segment id {bad} but the table has {segs} rows")));
    }
    Ok(())
}

fn matrix_dims(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    if t.shape().len() != 2 {
        return Err(Error::shape(op, format!("expected a matrix, got shape {:?}", t.shape())));
    }
    Ok((t.shape()[0], t.shape()[1]))
}

impl Backend for CpuBackend {
    type Tensor = Tensor;

    fn name(&self) -> String {
        let isa = if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx512f") {
            "avx512"
        } else if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx2") {
            "avx2"
        } else {
            "baseline"
        };
        format!("cpu ({} threads, {isa})", rayon::current_num_threads())
    }

    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn download(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn shape<'a>(&self, t: &'a Tensor) -> &'a [usize] {
        t.shape()
    }

    fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let (n, k) = matrix_dims("linear", x)?;
        let (o, wk) = matrix_dims("linear", w)?;
        if wk != k {
            return Err(Error::shape("linear", format!("input {:?} vs weight {:?}", x.shape(), w.shape())));
        }
        if let Some(b) = b {
            if b.len() != o {
                return Err(Error::shape("linear", format!("bias {:?} for {o} outputs", b.shape())));
            }
        }
        let mut out = vec![0.0; n * o];
        matmul::linear(x.data(), k, w.data(), b.map(|b| b.data()), &mut out);
        Tensor::new([n, o], out)
    }

    fn layer_norm_modulate(
        &self,
        x: &Tensor,
        eps: f32,
        shift: Modulation<'_, Tensor>,
        scale: Modulation<'_, Tensor>,
    ) -> Result<Tensor> {
        let (n, d) = matrix_dims("layer_norm_modulate", x)?;
        check_mod("layer_norm_modulate", &shift, n, d)?;
        check_mod("layer_norm_modulate", &scale, n, d)?;
        let mut out = vec![0.0; n * d];
        norm::layer_norm_modulate(x.data(), d, eps, mod_row(&shift, d), mod_row(&scale, d), shift.seg, &mut out);
        Tensor::new([n, d], out)
    }

    fn rms_norm_rope(&self, x: &mut Tensor, weight: &Tensor, eps: f32, rope: Option<(&Tensor, &Tensor)>) -> Result<()> {
        let (n, width) = matrix_dims("rms_norm_rope", x)?;
        let hd = weight.len();
        if hd == 0 || width % hd != 0 || hd % 2 != 0 {
            return Err(Error::shape("rms_norm_rope", format!("width {width} vs head_dim {hd}")));
        }
        if let Some((c, s)) = rope {
            if c.shape() != [n, hd] || s.shape() != [n, hd] {
                return Err(Error::shape("rms_norm_rope", format!("rope tables {:?}/{:?} for {n} rows of head_dim {hd}", c.shape(), s.shape())));
            }
        }
        norm::rms_norm_rope(x.data_mut(), weight.data(), eps, rope.map(|(c, s)| (c.data(), s.data())), width);
        Ok(())
    }

    fn attention(&self, q: &Tensor, heads: usize, seqs: &[AttnSeq<'_, Tensor>]) -> Result<Tensor> {
        let (n, width) = matrix_dims("attention", q)?;
        if heads == 0 || width % heads != 0 {
            return Err(Error::shape("attention", format!("width {width} not divisible by {heads} heads")));
        }
        let mut cpu_seqs = Vec::with_capacity(seqs.len());
        for s in seqs {
            if s.q.end > n {
                return Err(Error::shape("attention", format!("query rows {:?} beyond {n}", s.q)));
            }
            let mut kv = Vec::with_capacity(s.kv.len());
            for src in &s.kv {
                let (kn, kw) = matrix_dims("attention", src.k)?;
                if kw != width || src.v.shape() != src.k.shape() {
                    return Err(Error::shape("attention", format!("k {:?} / v {:?} for q width {width}", src.k.shape(), src.v.shape())));
                }
                let max_row = match &src.rows {
                    crate::Rows::Range(r) => r.end,
                    crate::Rows::Index(i) => i.iter().map(|&x| x as usize + 1).max().unwrap_or(0),
                };
                if max_row > kn {
                    return Err(Error::shape("attention", format!("kv row {max_row} beyond {kn} rows")));
                }
                kv.push(attention::Kv { k: src.k.data(), v: src.v.data(), rows: src.rows.clone() });
            }
            cpu_seqs.push(attention::Seq { q: s.q.clone(), kv });
        }
        let mut out = vec![0.0; n * width];
        attention::attention(q.data(), &mut out, width, heads, &cpu_seqs);
        Tensor::new([n, width], out)
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        if x.shape() != y.shape() {
            return Err(Error::shape("add", format!("{:?} vs {:?}", x.shape(), y.shape())));
        }
        x.data_mut()
            .par_chunks_mut(16384)
            .zip(y.data().par_chunks(16384))
            .for_each(|(a, b)| simd::axpy(a, 1.0, b));
        Ok(())
    }

    fn gelu_tanh(&self, x: &mut Tensor) -> Result<()> {
        x.data_mut().par_chunks_mut(16384).for_each(simd::gelu_tanh_inplace);
        Ok(())
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        y.data_mut().par_chunks_mut(16384).for_each(simd::silu_inplace);
        Ok(y)
    }

    fn gated_residual(&self, x: &mut Tensor, y: &Tensor, gate: Modulation<'_, Tensor>) -> Result<()> {
        let (n, d) = matrix_dims("gated_residual", x)?;
        if y.shape() != x.shape() {
            return Err(Error::shape("gated_residual", format!("{:?} vs {:?}", x.shape(), y.shape())));
        }
        check_mod("gated_residual", &gate, n, d)?;
        norm::gated_residual(x.data_mut(), y.data(), d, mod_row(&gate, d), gate.seg);
        Ok(())
    }

    fn gather_rows(&self, srcs: &[&Tensor], index: &[(u32, u32)]) -> Result<Tensor> {
        let width = srcs.first().map(|t| t.cols()).unwrap_or(0);
        for s in srcs {
            if s.cols() != width {
                return Err(Error::shape("gather_rows", "sources differ in width".to_string()));
            }
        }
        for &(s, r) in index {
            let src = srcs.get(s as usize).ok_or_else(|| Error::shape("gather_rows", format!("source {s} of {}", srcs.len())))?;
            if r as usize >= src.rows() {
                return Err(Error::shape("gather_rows", format!("row {r} of source {s} with {} rows", src.rows())));
            }
        }
        let mut out = vec![0.0; index.len() * width];
        out.par_chunks_mut(width.max(1)).zip(index.par_iter()).for_each(|(dst, &(s, r))| {
            dst.copy_from_slice(srcs[s as usize].row(r as usize));
        });
        Tensor::new([index.len(), width], out)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let (n, d) = matrix_dims("split_cols", x)?;
        if widths.iter().sum::<usize>() != d {
            return Err(Error::shape("split_cols", format!("widths {widths:?} for {d} columns")));
        }
        let mut outs = Vec::with_capacity(widths.len());
        let mut off = 0;
        for &w in widths {
            let mut data = vec![0.0; n * w];
            if w > 0 {
                data.par_chunks_mut(w).enumerate().for_each(|(r, dst)| {
                    dst.copy_from_slice(&x.data()[r * d + off..r * d + off + w]);
                });
            }
            outs.push(Tensor::new([n, w], data)?);
            off += w;
        }
        Ok(outs)
    }

    fn concat_cols(&self, xs: &[&Tensor]) -> Result<Tensor> {
        let n = xs.first().map(|t| t.rows()).unwrap_or(0);
        let mut widths = Vec::with_capacity(xs.len());
        for t in xs {
            let (rows, w) = matrix_dims("concat_cols", t)?;
            if rows != n {
                return Err(Error::shape("concat_cols", format!("row counts {n} vs {rows}")));
            }
            widths.push(w);
        }
        let d: usize = widths.iter().sum();
        let mut out = vec![0.0; n * d];
        if d > 0 {
            out.par_chunks_mut(d).enumerate().for_each(|(r, dst)| {
                let mut off = 0;
                for (t, &w) in xs.iter().zip(&widths) {
                    dst[off..off + w].copy_from_slice(t.row(r));
                    off += w;
                }
            });
        }
        Tensor::new([n, d], out)
    }
}
