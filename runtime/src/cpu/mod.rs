//! The CPU backend: f32 compute on host memory, parallel over all cores with rayon.
//!
//! It is the numerical reference for every device kernel (docs/design.md §Devices), and the
//! backend the daemon uses on machines without a GPU. GEMMs go through the `gemm`
//! crate; the other ops are hand-written loops, vectorised through [`simd`].

pub mod attention;
pub mod conv;
pub mod image_attention;
pub mod matmul;
pub mod norm;
pub mod qlinear;
pub mod simd;
pub mod sparse_conv;
pub mod stream;
pub mod text;

use rayon::prelude::*;

use std::ops::Range;
use std::sync::Arc;

use crate::backend::{AttnSeq, Backend, Conv2dOpts, HeadNorm, Modulation, Src, TextMask};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    /// `[device] weight_dtype = "fp8"` on the CPU: the transformer's large Linears
    /// compute the fp8 reference (`Backend::upload_weight_fp8`). It saves neither
    /// memory nor time here (the weights stay f32, and each linear rounds its input
    /// first); it is how fp8 weights' quality is measured without a GPU. `None`:
    /// no fp8 weights; else how they and their inputs are scaled.
    fp8_weights: Option<crate::fp8::Scaling>,
}

/// A Linear weight stored transposed, `[in, out]` row-major: gemm streams it with unit
/// stride along the output dimension, measurably faster than reading the PyTorch
/// `[out, in]` layout through strides (up to ~25% on 2-thread flux-small GEMMs).
///
/// A GGUF-quantised weight ([`CpuBackend::upload_weight_stored`] of quantised parts)
/// stays quantised instead (`quant`, `t` then empty): its linears dequantise tiles
/// of output rows on the fly ([`qlinear`]).
#[derive(Clone, Debug)]
pub struct CpuWeight {
    /// `[in, out]`; `[0, 0]` for a quantised weight.
    t: Tensor,
    /// An fp8 weight's reference: `t` holds the E4M3-rounded values (a scale per
    /// output channel, or one for the matrix), and each linear rounds its input the
    /// same way first (`crate::fp8::Scaling::round`).
    fp8: Option<crate::fp8::Scaling>,
    /// The `[out, in]` GGUF blocks of a quantised weight.
    quant: Option<Arc<qlinear::QuantMatrix>>,
}

impl CpuWeight {
    pub fn in_features(&self) -> usize {
        match &self.quant {
            Some(q) => q.cols,
            None => self.t.shape()[0],
        }
    }
    pub fn out_features(&self) -> usize {
        match &self.quant {
            Some(q) => q.rows,
            None => self.t.shape()[1],
        }
    }
    /// Whether the weight is held as GGUF blocks.
    pub fn is_quantised(&self) -> bool {
        self.quant.is_some()
    }
    /// Bytes the weight occupies in memory (its blocks, or its f32 values).
    pub fn resident_bytes(&self) -> u64 {
        match &self.quant {
            Some(q) => q.bytes.len() as u64,
            None => 4 * self.t.len() as u64,
        }
    }
    /// The `[in, out]` f32 values (dequantised and transposed for a quantised weight:
    /// the ops without a quantised path, e.g. the VAE's image attention).
    fn transposed_f32(&self) -> Result<std::borrow::Cow<'_, Tensor>> {
        match &self.quant {
            None => Ok(std::borrow::Cow::Borrowed(&self.t)),
            Some(q) => Ok(std::borrow::Cow::Owned(
                CpuBackend::new().upload_weight(&q.to_f32()?)?.t,
            )),
        }
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }
    /// This backend with the transformer's large Linears as the fp8 reference, scaled
    /// per `scaling`.
    pub fn with_fp8_weights(self, scaling: crate::fp8::Scaling) -> Self {
        CpuBackend {
            fp8_weights: Some(scaling),
        }
    }
}

/// The `chunk`-th block of `width` columns of row `s` of a modulation table.
fn mod_row<'a>(m: &Modulation<'a, Tensor>, width: usize) -> impl Fn(usize) -> &'a [f32] + Sync {
    let table: &'a Tensor = m.table;
    let tw = table.cols();
    let off = m.chunk * width;
    move |s| &table.data()[s * tw + off..s * tw + off + width]
}

fn check_mod(
    op: &'static str,
    m: &Modulation<'_, Tensor>,
    rows: usize,
    width: usize,
) -> Result<()> {
    let segs = m.table.rows();
    if m.seg.len() != rows {
        return Err(Error::shape(
            op,
            format!("{} segment ids for {rows} rows", m.seg.len()),
        ));
    }
    if (m.chunk + 1) * width > m.table.cols() {
        return Err(Error::shape(
            op,
            format!(
                "chunk {} of width {width} beyond table width {}",
                m.chunk,
                m.table.cols()
            ),
        ));
    }
    if let Some(&bad) = m.seg.iter().find(|&&s| s as usize >= segs) {
        return Err(Error::shape(
            op,
            format!("segment id {bad} but the table has {segs} rows"),
        ));
    }
    Ok(())
}

fn matrix_dims(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    if t.shape().len() != 2 {
        return Err(Error::shape(
            op,
            format!("expected a matrix, got shape {:?}", t.shape()),
        ));
    }
    Ok((t.shape()[0], t.shape()[1]))
}

/// The input of an fp8 linear: columns `cols` of each row of `x` (rows `width` apart),
/// rounded to E4M3 with a scale per row or one for the block, as the device's
/// activation kernels do.
fn fp8_input(
    x: &[f32],
    width: usize,
    cols: Range<usize>,
    scaling: crate::fp8::Scaling,
) -> std::borrow::Cow<'_, [f32]> {
    let k = cols.len();
    let mut block = Vec::with_capacity(x.len() / width.max(1) * k);
    for row in x.chunks_exact(width.max(1)) {
        block.extend_from_slice(&row[cols.clone()]);
    }
    if k == 0 {
        return block.into();
    }
    scaling.round(&block, k).into()
}

impl Backend for CpuBackend {
    type Tensor = Tensor;
    type Weight = CpuWeight;

    /// A loader thread copies each slab into staging one block ahead of compute (f32,
    /// or fp8 as it is stored).
    fn stream_slabs(
        &self,
        src: &crate::HostSlice,
        slab: &crate::SlabShape,
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Option<Box<dyn crate::SlabProvider<Tensor>>>> {
        let read = stream::HostSlabs {
            src: src.clone(),
            slab_bytes: slab.bytes(),
        };
        let s = stream::CpuStream::new(Arc::new(read), slab, steps, blocks, lanes)?;
        Ok(Some(Box::new(s)))
    }

    fn upload_fp8(
        &self,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scales: &[f32],
    ) -> Result<Option<Tensor>> {
        Tensor::fp8(rows, cols, bytes.to_vec(), scales.to_vec()).map(Some)
    }

    fn name(&self) -> String {
        let isa = if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx512f")
        {
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
    fn upload_weight(&self, w: &Tensor) -> Result<CpuWeight> {
        let (o, k) = matrix_dims("upload_weight", w)?;
        let mut t = vec![0.0; o * k];
        // Blocked transpose: both sides stay cache-resident per 64x64 tile.
        const B: usize = 64;
        for i0 in (0..o).step_by(B) {
            for j0 in (0..k).step_by(B) {
                for i in i0..(i0 + B).min(o) {
                    for j in j0..(j0 + B).min(k) {
                        t[j * o + i] = w.data()[i * k + j];
                    }
                }
            }
        }
        Ok(CpuWeight {
            t: Tensor::new([k, o], t)?,
            fp8: None,
            quant: None,
        })
    }

    /// GGUF-quantised parts (all of one type) stay quantised, stacked along rows;
    /// others (fp8 ones included) are converted to f32 once, here.
    fn upload_weight_stored(&self, parts: &[crate::Stored<'_>]) -> Result<CpuWeight> {
        match qlinear::QuantMatrix::from_parts(parts)? {
            Some(q) => Ok(CpuWeight {
                t: Tensor::zeros([0, 0]),
                fp8: None,
                quant: Some(Arc::new(q)),
            }),
            None => self.upload_weight(&crate::backend::stack_f32(parts)?),
        }
    }

    fn weight_bytes(&self, w: &CpuWeight) -> u64 {
        w.resident_bytes()
    }

    fn weight_form(&self, w: &CpuWeight) -> &'static str {
        // An fp8 weight's reference holds its rounded values in f32.
        w.quant.as_ref().map_or("f32", |q| q.ty.name())
    }

    fn fp8_weights(&self) -> bool {
        self.fp8_weights.is_some()
    }

    fn upload_weight_fp8(&self, parts: &[crate::Stored<'_>]) -> Result<CpuWeight> {
        let w = crate::backend::stack_f32(parts)?;
        let (_, k) = matrix_dims("upload_weight_fp8", &w)?;
        // Parts already fp8 (a checkpoint's E4M3 bytes and per-tensor scale) are the
        // values a device uses as they are; others are rounded per output row.
        let all_fp8 = parts
            .iter()
            .all(|p| matches!(p.format(), crate::StoredFormat::Fp8 { .. }));
        let scaling = self.fp8_weights.unwrap_or_default();
        let rounded = match all_fp8 {
            true => w,
            false => Tensor::new(w.shape().to_vec(), scaling.round(w.data(), k))?,
        };
        Ok(CpuWeight {
            fp8: Some(scaling),
            ..self.upload_weight(&rounded)?
        })
    }

    fn download(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn shape<'a>(&self, t: &'a Tensor) -> &'a [usize] {
        t.shape()
    }

    fn linear_cols(
        &self,
        x: &Tensor,
        cols: Range<usize>,
        w: &CpuWeight,
        b: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (n, xw) = matrix_dims("linear", x)?;
        let (k, o) = (w.in_features(), w.out_features());
        if cols.end > xw || cols.len() != k {
            return Err(Error::shape(
                "linear",
                format!(
                    "input columns {cols:?} of {:?} vs weight [out {o}, in {k}]",
                    x.shape()
                ),
            ));
        }
        if let Some(b) = b {
            if b.len() != o {
                return Err(Error::shape(
                    "linear",
                    format!("bias {:?} for {o} outputs", b.shape()),
                ));
            }
        }
        if let Some(q) = &w.quant {
            let out = qlinear::linear(x.data(), xw, cols.start, q, 0..o, b.map(|b| b.data()));
            return Tensor::new([n, o], out);
        }
        let (data, xw, c0) = match w.fp8 {
            Some(s) => (fp8_input(x.data(), xw, cols, s), k, 0),
            None => (std::borrow::Cow::Borrowed(x.data()), xw, cols.start),
        };
        let out = matmul::linear(
            &data,
            xw,
            c0,
            k,
            matmul::MatRef::row_major(w.t.data(), o),
            o,
            b.map(|b| b.data()),
        );
        Tensor::new([n, o], out)
    }

    fn linear_out(
        &self,
        x: &Tensor,
        w: &CpuWeight,
        b: Option<&Tensor>,
        outs: Range<usize>,
    ) -> Result<Tensor> {
        let (n, k) = matrix_dims("linear_out", x)?;
        let o = w.out_features();
        if k != w.in_features() || outs.end > o || b.is_some_and(|b| b.len() != o) {
            return Err(Error::shape(
                "linear_out",
                format!(
                    "x {:?}, outputs {outs:?} of weight [out {o}, in {}], bias {:?}",
                    x.shape(),
                    w.in_features(),
                    b.map(|b| b.shape())
                ),
            ));
        }
        if let Some(q) = &w.quant {
            let out = qlinear::linear(x.data(), k, 0, q, outs.clone(), b.map(|b| b.data()));
            return Tensor::new([n, outs.len()], out);
        }
        // The transposed weight's column block: a strided view, no copy.
        let wt = matmul::MatRef {
            data: &w.t.data()[outs.start..],
            rs: o,
            cs: 1,
        };
        let bias = b.map(|b| &b.data()[outs.clone()]);
        let data = match w.fp8 {
            Some(s) => fp8_input(x.data(), k, 0..k, s),
            None => std::borrow::Cow::Borrowed(x.data()),
        };
        let out = matmul::linear(&data, k, 0, k, wt, outs.len(), bias);
        Tensor::new([n, outs.len()], out)
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
        norm::layer_norm_modulate(
            x.data(),
            d,
            eps,
            mod_row(&shift, d),
            mod_row(&scale, d),
            shift.seg,
            &mut out,
        );
        Tensor::new([n, d], out)
    }

    fn rms_norm_rope(
        &self,
        x: &mut Tensor,
        heads: &[HeadNorm<'_, Tensor>],
        eps: f32,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<()> {
        let (n, width) = matrix_dims("rms_norm_rope", x)?;
        for HeadNorm { cols, weight } in heads {
            let hd = weight.len();
            if hd == 0 || cols.end > width || cols.len() % hd != 0 || hd % 2 != 0 {
                return Err(Error::shape(
                    "rms_norm_rope",
                    format!("columns {cols:?} of width {width} vs head_dim {hd}"),
                ));
            }
            if let Some((c, s)) = rope {
                if c.shape() != [n, hd] || s.shape() != [n, hd] {
                    return Err(Error::shape(
                        "rms_norm_rope",
                        format!(
                            "rope tables {:?}/{:?} for {n} rows of head_dim {hd}",
                            c.shape(),
                            s.shape()
                        ),
                    ));
                }
            }
        }
        for HeadNorm { cols, weight } in heads {
            norm::rms_norm_rope(
                x.data_mut(),
                width,
                cols.clone(),
                weight.data(),
                eps,
                rope.map(|(c, s)| (c.data(), s.data())),
            );
        }
        Ok(())
    }

    fn attention(
        &self,
        bufs: &mut [&mut Tensor],
        q_col: usize,
        width: usize,
        heads: usize,
        seqs: &[AttnSeq<'_, Tensor>],
    ) -> Result<()> {
        let mut raw = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            let (_, cols) = matrix_dims("attention", b)?;
            raw.push(attention::Buf::new(b.data_mut(), cols));
        }
        let mut cpu_seqs = Vec::with_capacity(seqs.len());
        for s in seqs {
            let mut kv = Vec::with_capacity(s.kv.len());
            for src in &s.kv {
                let buf = match src.src {
                    Src::Own(i) => attention::KvBuf::F32(*raw.get(i).ok_or_else(|| {
                        Error::shape("attention", format!("kv buffer {i} of {}", raw.len()))
                    })?),
                    Src::Ext(t) => match t.as_fp8() {
                        Some(m) => attention::KvBuf::Fp8(attention::Fp8Buf::new(m, t.cols())),
                        None => attention::KvBuf::F32(attention::Buf::external(
                            t.data(),
                            matrix_dims("attention", t)?.1,
                        )),
                    },
                };
                kv.push(attention::Kv {
                    buf,
                    k_col: src.k_col,
                    v_col: src.v_col,
                    rows: src.rows.clone(),
                });
            }
            cpu_seqs.push(attention::Seq {
                q: s.q.iter().map(|q| (q.buf, q.rows.clone())).collect(),
                kv,
            });
        }
        attention::validate(&raw, q_col, width, heads, &cpu_seqs)
            .map_err(|e| Error::shape("attention", e))?;
        attention::attention(&raw, q_col, width, heads, &cpu_seqs);
        Ok(())
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        if x.shape() != y.shape() {
            return Err(Error::shape(
                "add",
                format!("{:?} vs {:?}", x.shape(), y.shape()),
            ));
        }
        x.data_mut()
            .par_chunks_mut(16384)
            .zip(y.data().par_chunks(16384))
            .for_each(|(a, b)| simd::axpy(a, 1.0, b));
        Ok(())
    }

    fn gelu_tanh(&self, x: &mut Tensor, cols: Range<usize>) -> Result<()> {
        let (_, width) = matrix_dims("gelu_tanh", x)?;
        if cols.end > width {
            return Err(Error::shape(
                "gelu_tanh",
                format!("columns {cols:?} of width {width}"),
            ));
        }
        let rpt = (16384 / width.max(1)).max(1);
        x.data_mut().par_chunks_mut(width * rpt).for_each(|chunk| {
            for row in chunk.chunks_exact_mut(width) {
                simd::gelu_tanh_inplace(&mut row[cols.clone()]);
            }
        });
        Ok(())
    }

    fn silu(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        y.data_mut()
            .par_chunks_mut(16384)
            .for_each(simd::silu_inplace);
        Ok(y)
    }

    fn gated_residual(
        &self,
        x: &mut Tensor,
        y: &Tensor,
        gate: Modulation<'_, Tensor>,
    ) -> Result<()> {
        let (n, d) = matrix_dims("gated_residual", x)?;
        if y.shape() != x.shape() {
            return Err(Error::shape(
                "gated_residual",
                format!("{:?} vs {:?}", x.shape(), y.shape()),
            ));
        }
        check_mod("gated_residual", &gate, n, d)?;
        norm::gated_residual(x.data_mut(), y.data(), d, mod_row(&gate, d), gate.seg);
        Ok(())
    }

    fn gather_rows(&self, srcs: &[&Tensor], index: &[(u32, u32)]) -> Result<Tensor> {
        let width = srcs.first().map(|t| t.cols()).unwrap_or(0);
        for s in srcs {
            if s.cols() != width {
                return Err(Error::shape(
                    "gather_rows",
                    "sources differ in width".to_string(),
                ));
            }
        }
        for &(s, r) in index {
            let src = srcs.get(s as usize).ok_or_else(|| {
                Error::shape("gather_rows", format!("source {s} of {}", srcs.len()))
            })?;
            if r as usize >= src.rows() {
                return Err(Error::shape(
                    "gather_rows",
                    format!("row {r} of source {s} with {} rows", src.rows()),
                ));
            }
        }
        let mut out = vec![0.0; index.len() * width];
        out.par_chunks_mut(width.max(1))
            .zip(index.par_iter())
            .for_each(|(dst, &(s, r))| {
                dst.copy_from_slice(srcs[s as usize].row(r as usize));
            });
        Tensor::new([index.len(), width], out)
    }

    fn axpy_cols(
        &self,
        x: &mut Tensor,
        cols: Range<usize>,
        v: &Tensor,
        v_rows: Range<usize>,
        alpha: f32,
    ) -> Result<()> {
        let (n, width) = matrix_dims("axpy_cols", x)?;
        let (vn, vw) = matrix_dims("axpy_cols", v)?;
        if cols.end > width || vw != cols.len() || v_rows.len() > n || v_rows.end > vn {
            return Err(Error::shape(
                "axpy_cols",
                format!(
                    "columns {cols:?} of {:?} += rows {v_rows:?} of {:?}",
                    x.shape(),
                    v.shape()
                ),
            ));
        }
        let xd = x.data_mut();
        for (r, vr) in v_rows.enumerate() {
            let dst = &mut xd[r * width + cols.start..r * width + cols.end];
            for (d, s) in dst.iter_mut().zip(v.row(vr)) {
                *d += alpha * s;
            }
        }
        Ok(())
    }

    fn add_block(
        &self,
        y: &mut Tensor,
        rows: Range<usize>,
        cols: Range<usize>,
        d: &Tensor,
        alpha: f32,
    ) -> Result<()> {
        let (n, width) = matrix_dims("add_block", y)?;
        let (dn, dw) = matrix_dims("add_block", d)?;
        if rows.end > n || cols.end > width || dn != rows.len() || dw != cols.len() {
            return Err(Error::shape(
                "add_block",
                format!(
                    "rows {rows:?}, columns {cols:?} of {:?} += {:?}",
                    y.shape(),
                    d.shape()
                ),
            ));
        }
        let yd = y.data_mut();
        for (i, r) in rows.enumerate() {
            let dst = &mut yd[r * width + cols.start..r * width + cols.end];
            for (o, s) in dst.iter_mut().zip(d.row(i)) {
                *o += alpha * s;
            }
        }
        Ok(())
    }

    fn download_weight(&self, w: &CpuWeight) -> Result<Tensor> {
        if let Some(q) = &w.quant {
            return q.to_f32();
        }
        let (k, o) = (w.t.shape()[0], w.t.shape()[1]);
        let mut out = vec![0.0; o * k];
        for (j, row) in w.t.data().chunks_exact(o.max(1)).enumerate() {
            for (i, v) in row.iter().enumerate() {
                out[i * k + j] = *v;
            }
        }
        Tensor::new([o, k], out)
    }

    fn gather_cols(&self, x: &Tensor, rows: Range<usize>, cols: Range<usize>) -> Result<Tensor> {
        let (n, width) = matrix_dims("gather_cols", x)?;
        if rows.end > n || cols.end > width {
            return Err(Error::shape(
                "gather_cols",
                format!("rows {rows:?} cols {cols:?} of {:?}", x.shape()),
            ));
        }
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            out.extend_from_slice(&x.row(r)[cols.clone()]);
        }
        Tensor::new([rows.len(), cols.len()], out)
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        opts: Conv2dOpts,
        add: Option<&Tensor>,
    ) -> Result<Tensor> {
        conv::conv2d(x, w, Some(b), opts, add)
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Result<Tensor> {
        conv::group_norm(x, groups, weight, bias, eps, silu)
    }

    fn image_attention(
        &self,
        x: &Tensor,
        normed: &Tensor,
        qkv: &CpuWeight,
        qkv_b: &Tensor,
        out: &CpuWeight,
        out_b: &Tensor,
    ) -> Result<Tensor> {
        // `out.t` is `[C_in, C_out]`: its transposed view is the `[C_out, C_in]` matrix.
        let (qkv_t, out_t) = (qkv.transposed_f32()?, out.transposed_f32()?);
        let out_w = matmul::MatRef::transposed(out_t.data(), out.out_features());
        image_attention::image_attention(x, normed, qkv_t.data(), qkv_b.data(), out_w, out_b.data())
            .map(|(y, _)| y)
    }

    fn layer_norm_affine(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let (_, d) = matrix_dims("layer_norm_affine", x)?;
        check_vec("layer_norm_affine", d, &[weight, bias])?;
        Tensor::new(
            x.shape().to_vec(),
            text::layer_norm(x.data(), d, weight.data(), bias.data(), eps),
        )
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let (_, d) = matrix_dims("rms_norm", x)?;
        check_vec("rms_norm", d, &[weight])?;
        Tensor::new(
            x.shape().to_vec(),
            text::rms_norm(x.data(), d, weight.data(), eps),
        )
    }

    fn gated_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, w2) = matrix_dims("gated_gelu", x)?;
        if w2 % 2 != 0 {
            return Err(Error::shape("gated_gelu", format!("odd width {w2}")));
        }
        let f = w2 / 2;
        let mut out = Vec::with_capacity(rows * f);
        for r in x.data().chunks_exact(w2) {
            let (gate, lin) = r.split_at(f);
            out.extend(gate.iter().zip(lin).map(|(&g, &l)| text::gelu_new(g) * l));
        }
        Tensor::new([rows, f], out)
    }

    fn quick_gelu(&self, x: &mut Tensor) -> Result<()> {
        x.data_mut()
            .iter_mut()
            .for_each(|v| *v = text::quick_gelu(*v));
        Ok(())
    }

    fn text_attention(
        &self,
        qkv: &Tensor,
        heads: usize,
        head_dim: usize,
        scale: f32,
        mask: TextMask<'_, Tensor>,
    ) -> Result<Tensor> {
        let (len, w) = matrix_dims("text_attention", qkv)?;
        let inner = heads * head_dim;
        let bias_ok = match mask {
            TextMask::Bias(b) => b.shape() == [heads * len, len],
            TextMask::Causal => true,
        };
        if w != 3 * inner || !bias_ok {
            return Err(Error::shape(
                "text_attention",
                format!(
                    "q|k|v {:?} for {heads} heads of {head_dim}, or a bias of another shape",
                    qkv.shape()
                ),
            ));
        }
        let x = text::Qkv {
            data: qkv.data(),
            rs: w,
            q: 0,
            k: inner,
            v: 2 * inner,
        };
        let mask = match mask {
            TextMask::Causal => text::Mask::Causal,
            TextMask::Bias(b) => text::Mask::Bias(b.data()),
        };
        Tensor::new(
            [len, inner],
            text::attention(x, len, heads, head_dim, scale, mask),
        )
    }
}

/// Each of `vs` is a `[d]` vector.
fn check_vec(op: &'static str, d: usize, vs: &[&Tensor]) -> Result<()> {
    match vs.iter().find(|v| v.shape() != [d]) {
        Some(v) => Err(Error::shape(
            op,
            format!("a [{d}] vector, got {:?}", v.shape()),
        )),
        None => Ok(()),
    }
}
