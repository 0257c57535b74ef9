//! Matrix products through the `gemm` crate (AVX-512 kernels with the `x86-v4` feature).
//!
//! Everything is row-major f32. `gemm` takes explicit row and column strides, so a
//! PyTorch-layout weight `[out, in]` is used as its own transpose without a copy.

use gemm::Parallelism;

/// Row-major matrix view: element `(i, j)` lives at `ptr[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    pub fn row_major(data: &'a [f32], cols: usize) -> Self {
        MatRef {
            data,
            rs: cols,
            cs: 1,
        }
    }
    /// The transpose of a row-major `[rows, cols]` matrix.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        MatRef {
            data,
            rs: 1,
            cs: cols,
        }
    }
}

/// Raw-pointer form of [`matmul`] with a scale on the product:
/// `dst = (accumulate ? dst : 0) + scale * lhs @ rhs`, single-threaded.
///
/// # Safety
/// Every element `lhs[i*lhs_rs + j*lhs_cs]` (i < m, j < k), `rhs[..]` (k x n) and
/// `dst[i*dst_rs + j]` (i < m, j < n) must be valid, `dst` must not alias `lhs` or
/// `rhs`, and no other thread may write the elements read or touch those written.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
    scale: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs.0,
        lhs.2 as isize,
        lhs.1 as isize,
        rhs.0,
        rhs.2 as isize,
        rhs.1 as isize,
        1.0,
        scale,
        false,
        false,
        false,
        Parallelism::None,
    )
}

/// `dst[m,n] = (accumulate ? dst : 0) + lhs[m,k] @ rhs[k,n]`, with `dst` row-major with
/// row stride `dst_rs`. `parallel` lets gemm split the work over the rayon pool; pass
/// false when already inside a parallel loop.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(0.0);
            }
        }
        return;
    }
    // Bounds are checked here once so the unsafe call below cannot read or write
    // outside the slices.
    assert!(dst.len() >= (m - 1) * dst_rs + n, "matmul: dst too small");
    assert!(
        lhs.data.len() > (m - 1) * lhs.rs + (k - 1) * lhs.cs,
        "matmul: lhs too small"
    );
    assert!(
        rhs.data.len() > (k - 1) * rhs.rs + (n - 1) * rhs.cs,
        "matmul: rhs too small"
    );
    let par = if parallel && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above bound every index gemm touches, and dst does not alias
    // lhs or rhs (it is a unique borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// Linear over a column block of `x`: `out[n,o] = x[:, col..col+k] @ wt[k,o] + b`, where
/// `x` is row-major with `x_cols` columns and `wt` is (a column block of) the
/// transposed (`[in, out]`) weight. Returns the new `[n, o]` buffer.
pub fn linear(
    x: &[f32],
    x_cols: usize,
    col: usize,
    k: usize,
    wt: MatRef<'_>,
    o: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let n = x.len() / x_cols.max(1);
    // Start from the bias (or zeros) without a separate memset pass.
    let mut out = Vec::with_capacity(n * o);
    match bias {
        Some(b) => (0..n).for_each(|_| out.extend_from_slice(b)),
        None => out.resize(n * o, 0.0),
    }
    if n > 0 {
        matmul(
            n,
            o,
            k,
            &mut out,
            o,
            MatRef {
                data: &x[col..],
                rs: x_cols,
                cs: 1,
            },
            wt,
            bias.is_some(),
            true,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], k: usize, w: &[f32], b: &[f32]) -> Vec<f32> {
        let o = b.len();
        let n = x.len() / k;
        let mut out = vec![0.0; n * o];
        for i in 0..n {
            for j in 0..o {
                let mut s = b[j] as f64;
                for t in 0..k {
                    s += x[i * k + t] as f64 * w[j * k + t] as f64;
                }
                out[i * o + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn linear_matches_naive() {
        for &(n, k, o) in &[(1, 1, 1), (3, 5, 7), (65, 130, 33), (200, 64, 300)] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
                .collect();
            let w: Vec<f32> = (0..o * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0)
                .collect();
            let b: Vec<f32> = (0..o).map(|i| i as f32 * 0.01).collect();
            let wt: Vec<f32> = (0..k * o).map(|i| w[(i % o) * k + i / o]).collect();
            let out = linear(&x, k, 0, k, MatRef::row_major(&wt, o), o, Some(&b));
            let want = naive(&x, k, &w, &b);
            for (a, e) in out.iter().zip(&want) {
                assert!(
                    (a - e).abs() < 1e-4 * (1.0 + e.abs()),
                    "{n}x{k}x{o}: {a} vs {e}"
                );
            }
        }
    }
}

#[test]
fn linear_over_a_column_block() {
    // x is [3, 7]; use its columns 2..5 as the input.
    let x: Vec<f32> = (0..21).map(|i| i as f32).collect();
    // w = [[1, 0, -1], [0.5, 0.5, 0.5]] stored transposed as [3, 2].
    let wt = vec![1.0, 0.5, 0.0, 0.5, -1.0, 0.5];
    let out = linear(&x, 7, 2, 3, MatRef::row_major(&wt, 2), 2, None);
    for r in 0..3 {
        let v = &x[r * 7 + 2..r * 7 + 5];
        assert_eq!(out[r * 2], v[0] - v[2]);
        assert_eq!(out[r * 2 + 1], 0.5 * (v[0] + v[1] + v[2]));
    }
}

#[test]
fn backend_linear_out_is_a_column_block_of_linear() {
    use crate::{Backend, CpuBackend, Tensor};
    let cpu = CpuBackend::new();
    let (n, k, o) = (37, 40, 24);
    let x = Tensor::new(
        [n, k],
        (0..n * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect(),
    )
    .unwrap();
    let w = Tensor::new(
        [o, k],
        (0..o * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0)
            .collect(),
    )
    .unwrap();
    let b = Tensor::new([o], (0..o).map(|i| i as f32 * 0.01).collect()).unwrap();
    let w = cpu.upload_weight(&w).unwrap();
    let all = cpu.linear(&x, &w, Some(&b)).unwrap();
    for outs in [0..o, 5..13, 23..24, 7..7] {
        let part = cpu.linear_out(&x, &w, Some(&b), outs.clone()).unwrap();
        assert_eq!(part.shape(), [n, outs.len()]);
        for r in 0..n {
            // The same products in the same order: equal bit for bit.
            assert_eq!(
                &part.data()[r * outs.len()..(r + 1) * outs.len()],
                &all.data()[r * o + outs.start..r * o + outs.end],
                "outputs {outs:?} row {r}"
            );
        }
    }
    assert!(cpu.linear_out(&x, &w, Some(&b), 20..25).is_err());
}
