//! Linears with GGUF-quantised weights that stay quantised: each GEMM dequantises
//! tiles of [`TILE`] output rows into a per-thread f32 scratch and runs the f32 GEMM
//! on the tile, in parallel over tiles (rayon). Memory holds only the blocks (Q4_K:
//! 4.5 bits a weight) plus one `TILE x in` f32 scratch per thread.
//!
//! The result is that of dequantising the whole weight and running the f32 linear,
//! up to the GEMM's summation order (tests below).

use rayon::prelude::*;

use crate::cpu::matmul;
use crate::error::{Error, Result};
use crate::quant::{self, QuantType};
use crate::stored::{Stored, StoredFormat};
use crate::tensor::Tensor;

/// Output rows dequantised at a time: 64 rows of a FLUX Linear (in 3072) are 768 KiB
/// of f32, about an L2's worth, and 3072 outputs give 48 tiles to share.
pub const TILE: usize = 64;

/// A `[rows (out), cols (in)]` matrix of `ty` blocks, row-major (each row is
/// `cols / block_elems` blocks).
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    pub ty: QuantType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

/// `(type, rows, cols)` of `parts` stacked along rows, if they are all 2-D GGUF blocks
/// of one type with one column count; `None` when any is not quantised or they
/// differ (the caller dequantises them then).
pub fn stacked_quant(parts: &[Stored<'_>]) -> Result<Option<(QuantType, usize, usize)>> {
    let Some(StoredFormat::Quant(ty)) = parts.first().map(|p| p.format()) else {
        return Ok(None);
    };
    let cols = match parts[0].shape[..] {
        [_, c] => c,
        _ => {
            return Err(Error::shape(
                "upload_weight_stored",
                format!(
                    "`{}`: a quantised weight of shape {:?}",
                    parts[0].name, parts[0].shape
                ),
            ))
        }
    };
    let mut rows = 0;
    for p in parts {
        match (p.format(), &p.shape[..]) {
            (StoredFormat::Quant(t), [r, c]) if t == ty && *c == cols => rows += r,
            _ => return Ok(None),
        }
    }
    Ok(Some((ty, rows, cols)))
}

impl QuantMatrix {
    /// The parts stacked along rows ([`stacked_quant`]), or `None`.
    pub fn from_parts(parts: &[Stored<'_>]) -> Result<Option<Self>> {
        let Some((ty, rows, cols)) = stacked_quant(parts)? else {
            return Ok(None);
        };
        let mut bytes = Vec::with_capacity(rows * ty.bytes_for(cols, &parts[0].name)?);
        for p in parts {
            bytes.extend_from_slice(&p.bytes);
        }
        Ok(Some(QuantMatrix {
            ty,
            rows,
            cols,
            bytes,
        }))
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_elems() * self.ty.block_bytes()
    }

    /// Dequantises rows `r` into `out` (`r.len() * cols` values, row-major).
    pub fn dequantize_rows(&self, r: std::ops::Range<usize>, out: &mut [f32]) {
        let rb = self.row_bytes();
        quant::dequantize(self.ty, &self.bytes[r.start * rb..r.end * rb], out);
    }

    /// The whole matrix as f32 `[rows, cols]`.
    pub fn to_f32(&self) -> Result<Tensor> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut((TILE * self.cols).max(1))
            .enumerate()
            .for_each(|(t, o)| {
                let r0 = t * TILE;
                self.dequantize_rows(r0..r0 + o.len() / self.cols.max(1), o)
            });
        Tensor::new([self.rows, self.cols], out)
    }
}

/// Raw output pointer shared by the tile jobs, each of which writes its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the tiles write disjoint column blocks of the output (see `linear`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[n, outs.len()] = x[:, c0..c0 + k] @ w[outs, :]^T + bias[outs]`, with `x`
/// row-major of `x_cols` columns and `k == w.cols`.
pub fn linear(
    x: &[f32],
    x_cols: usize,
    c0: usize,
    w: &QuantMatrix,
    outs: std::ops::Range<usize>,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let k = w.cols;
    let n = x.len() / x_cols.max(1);
    let o = outs.len();
    let mut out = Vec::with_capacity(n * o);
    match bias {
        Some(b) => (0..n).for_each(|_| out.extend_from_slice(&b[outs.clone()])),
        None => out.resize(n * o, 0.0),
    }
    if n == 0 || o == 0 {
        return out;
    }
    assert!(x.len() >= (n - 1) * x_cols + c0 + k, "qlinear: x too small");
    assert!(outs.end <= w.rows, "qlinear: outputs beyond the weight");
    let tiles = o.div_ceil(TILE);
    if tiles < rayon::current_num_threads() {
        // Too few tiles to share: one at a time, each GEMM split over the threads.
        let mut tile = vec![0f32; TILE.min(o) * k];
        for t in 0..tiles {
            let (a, b) = (t * TILE, ((t + 1) * TILE).min(o));
            let tile = &mut tile[..(b - a) * k];
            w.dequantize_rows(outs.start + a..outs.start + b, tile);
            matmul::matmul(
                n,
                b - a,
                k,
                &mut out[a..],
                o,
                matmul::MatRef {
                    data: &x[c0..],
                    rs: x_cols,
                    cs: 1,
                },
                matmul::MatRef::transposed(tile, k),
                bias.is_some(),
                true,
            );
        }
        return out;
    }
    let dst = OutPtr(out.as_mut_ptr());
    (0..tiles).into_par_iter().for_each_init(
        || vec![0f32; TILE * k],
        |scratch, t| {
            let (a, b) = (t * TILE, ((t + 1) * TILE).min(o));
            let tile = &mut scratch[..(b - a) * k];
            w.dequantize_rows(outs.start + a..outs.start + b, tile);
            let dst = dst;
            // SAFETY: `out` is `[n, o]` row-major and outlives the loop; this tile
            // writes only its columns a..b of each row, which no other tile touches.
            // `x` and the scratch are valid for the extents asserted above, and
            // neither aliases `out`.
            unsafe {
                matmul::matmul_raw(
                    n,
                    b - a,
                    k,
                    dst.0.add(a),
                    o,
                    (x.as_ptr().add(c0), x_cols, 1),
                    // The tile's transpose: element (j, i) = tile[i * k + j].
                    (tile.as_ptr(), 1, k),
                    1.0,
                    bias.is_some(),
                )
            }
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::cpu::CpuBackend;

    fn random_blocks(ty: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        quant::random_blocks(ty, rows * cols, seed)
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter()
            .zip(b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
    }

    #[test]
    fn quantised_linears_match_the_dequantised_f32_linear() {
        let be = CpuBackend::new();
        for (i, ty) in QuantType::ALL.into_iter().enumerate() {
            // 200 outputs: three whole tiles and a partial one, as two parts.
            let (o1, o2, k, n) = (120, 80, 512, 9);
            let b1 = random_blocks(ty, o1, k, i as u64);
            let b2 = random_blocks(ty, o2, k, 100 + i as u64);
            let parts = [
                Stored::quantised("a", vec![o1, k], ty, &b1).unwrap(),
                Stored::quantised("b", vec![o2, k], ty, &b2).unwrap(),
            ];
            let qw = be.upload_weight_stored(&parts).unwrap();
            assert!(qw.is_quantised(), "{ty}");
            assert_eq!(be.weight_bytes(&qw), (b1.len() + b2.len()) as u64);
            let dense = crate::backend::stack_f32(&parts).unwrap();
            let fw = be.upload_weight(&dense).unwrap();
            assert_eq!(be.weight_bytes(&fw), (4 * (o1 + o2) * k) as u64);
            assert_eq!(be.download_weight(&qw).unwrap(), dense, "{ty}");

            let x = Tensor::new(
                [n, k + 7],
                (0..n * (k + 7))
                    .map(|j| ((j * 37 % 101) as f32 - 50.0) * 0.01)
                    .collect(),
            )
            .unwrap();
            let bias =
                Tensor::new([o1 + o2], (0..o1 + o2).map(|j| j as f32 * 0.1).collect()).unwrap();
            let tol = 1e-5;
            let (got, want) = (
                be.linear_cols(&x, 3..3 + k, &qw, Some(&bias)).unwrap(),
                be.linear_cols(&x, 3..3 + k, &fw, Some(&bias)).unwrap(),
            );
            assert_eq!(got.shape(), want.shape());
            assert!(max_rel(got.data(), want.data()) < tol, "{ty} linear_cols");

            let xk = be.gather_cols(&x, 0..n, 0..k).unwrap();
            let (got, want) = (
                be.linear(&xk, &qw, None).unwrap(),
                be.linear(&xk, &fw, None).unwrap(),
            );
            assert!(max_rel(got.data(), want.data()) < tol, "{ty} linear");
            let (got, want) = (
                be.linear_out(&xk, &qw, Some(&bias), 70..190).unwrap(),
                be.linear_out(&xk, &fw, Some(&bias), 70..190).unwrap(),
            );
            assert_eq!(got.shape(), &[n, 120]);
            assert!(max_rel(got.data(), want.data()) < tol, "{ty} linear_out");
            let (got, want) = (
                be.linear_gelu(&xk, &qw, Some(&bias), 50).unwrap(),
                be.linear_gelu(&xk, &fw, Some(&bias), 50).unwrap(),
            );
            assert!(max_rel(got.data(), want.data()) < tol, "{ty} linear_gelu");
        }
    }

    #[test]
    fn a_weight_of_one_tile_splits_its_gemm_instead() {
        let be = CpuBackend::new();
        let (o, k, n) = (40, 256, 33);
        let b = random_blocks(QuantType::Q4_K, o, k, 9);
        let p = [Stored::quantised("w", vec![o, k], QuantType::Q4_K, &b).unwrap()];
        let (qw, fw) = (
            be.upload_weight_stored(&p).unwrap(),
            be.upload_weight(&crate::backend::stack_f32(&p).unwrap())
                .unwrap(),
        );
        let x = Tensor::new(
            [n, k],
            (0..n * k).map(|j| (j % 29) as f32 * 0.01 - 0.1).collect(),
        )
        .unwrap();
        let bias = Tensor::new([o], (0..o).map(|j| j as f32).collect()).unwrap();
        let (got, want) = (
            be.linear_out(&x, &qw, Some(&bias), 3..31).unwrap(),
            be.linear_out(&x, &fw, Some(&bias), 3..31).unwrap(),
        );
        assert!(max_rel(got.data(), want.data()) < 1e-5);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let one = pool.install(|| be.linear_out(&x, &qw, Some(&bias), 3..31).unwrap());
        assert!(max_rel(one.data(), want.data()) < 1e-5);
    }

    #[test]
    fn mixed_and_fp8_parts_are_dequantised_at_upload() {
        let be = CpuBackend::new();
        let b1 = random_blocks(QuantType::Q8_0, 4, 64, 1);
        let f = Tensor::new([2, 64], (0..128).map(|i| i as f32).collect()).unwrap();
        let parts = [
            Stored::quantised("a", vec![4, 64], QuantType::Q8_0, &b1).unwrap(),
            Stored::from_tensor("b", &f),
        ];
        let w = be.upload_weight_stored(&parts).unwrap();
        assert!(!w.is_quantised());
        assert_eq!(
            be.download_weight(&w).unwrap(),
            crate::backend::stack_f32(&parts).unwrap()
        );
        let fp8: Vec<u8> = (0..128).map(|i| (i % 127) as u8).collect();
        let p = Stored::new("f", vec![2, 64], crate::DType::F8E4M3, &fp8)
            .unwrap()
            .with_scale(0.5)
            .unwrap();
        let w = be.upload_weight_stored(std::slice::from_ref(&p)).unwrap();
        assert_eq!(be.download_weight(&w).unwrap(), p.to_f32().unwrap());
    }

    /// Timings, not a check: `cargo test --release -p denoised-runtime --lib
    /// qlinear_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn qlinear_timing() {
        let be = CpuBackend::new();
        let (o, k, n) = (3072, 3072, 256);
        let x = Tensor::new([n, k], (0..n * k).map(|j| (j % 13) as f32 * 0.01).collect()).unwrap();
        for ty in [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K] {
            let b = random_blocks(ty, o, k, 7);
            let p = [Stored::quantised("w", vec![o, k], ty, &b).unwrap()];
            let qw = be.upload_weight_stored(&p).unwrap();
            let fw = be
                .upload_weight(&crate::backend::stack_f32(&p).unwrap())
                .unwrap();
            let time = |w: &crate::cpu::CpuWeight| {
                be.linear(&x, w, None).unwrap();
                let t = std::time::Instant::now();
                for _ in 0..3 {
                    be.linear(&x, w, None).unwrap();
                }
                t.elapsed().as_secs_f64() / 3.0 * 1e3
            };
            let (tq, tf) = (time(&qw), time(&fw));
            let mut deq = vec![0f32; o * k];
            let t = std::time::Instant::now();
            quant::dequantize(ty, &b, &mut deq);
            let td = t.elapsed().as_secs_f64() * 1e3;
            println!(
                "{ty}: [{n}x{k}] @ [{o}x{k}]^T: quantised {tq:.1} ms, f32 {tf:.1} ms; \
                 dequantise whole (1 thread) {td:.1} ms; resident {} vs {} bytes ({} threads)",
                be.weight_bytes(&qw),
                be.weight_bytes(&fw),
                rayon::current_num_threads()
            );
        }
    }
}
