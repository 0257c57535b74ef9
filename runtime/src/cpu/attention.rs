//! Multi-head attention on the CPU, tiled like FlashAttention.
//!
//! For each (query span, head, tile of queries) the kernel streams keys and values in
//! tiles, gathering each tile from its source rows (a range of a fresh buffer or an
//! index into a cached one) into a small packed buffer that stays in L1/L2, and keeps
//! an online softmax (running max and sum) so no score matrix is ever built. The two
//! products per tile go through gemm. This is the CPU reference of the CUDA
//! masked-query attention kernel and has the same contract: keys may come from any mix
//! of sources, which is what mask-aware editing needs, and the output overwrites the
//! queries in place.

use std::ops::Range;

use rayon::prelude::*;

use super::matmul::{matmul, MatRef};
use super::simd;
use crate::backend::Rows;

/// Query rows per work unit.
const BQ: usize = 128;
/// Keys per streamed tile.
const BK: usize = 256;

/// A row-major matrix reachable from several threads. Work units read K/V columns of
/// any row and read-then-write the query columns of their own rows and head only; the
/// caller guarantees (and `attention` checks) that query columns never overlap K/V
/// columns of the same buffer and that query spans do not overlap, so no element is
/// written by one unit while another touches it.
#[derive(Clone, Copy)]
pub struct Buf {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
}
// SAFETY: see the type's documentation.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

impl Buf {
    pub fn new(data: &mut [f32], cols: usize) -> Self {
        Buf {
            ptr: data.as_mut_ptr(),
            rows: data.len() / cols.max(1),
            cols,
        }
    }
    /// Read-only use only (the pointer is never written through for K/V sources).
    pub fn external(data: &[f32], cols: usize) -> Self {
        Buf {
            ptr: data.as_ptr() as *mut f32,
            rows: data.len() / cols.max(1),
            cols,
        }
    }
    #[inline]
    fn row(&self, r: usize, col: usize, len: usize) -> *mut f32 {
        debug_assert!(r < self.rows && col + len <= self.cols);
        // SAFETY: callers pass rows and columns validated by `attention`.
        unsafe { self.ptr.add(r * self.cols + col) }
    }
}

pub struct Kv<'a> {
    pub buf: Buf,
    pub k_col: usize,
    pub v_col: usize,
    pub rows: Rows<'a>,
}

pub struct Seq<'a> {
    /// (buffer index, rows) of the queries.
    pub q: Vec<(usize, Range<usize>)>,
    pub kv: Vec<Kv<'a>>,
}

/// Checks every row and column the kernel will touch. Returns a description of the
/// first problem.
pub fn validate(
    bufs: &[Buf],
    q_col: usize,
    width: usize,
    heads: usize,
    seqs: &[Seq<'_>],
) -> Result<(), String> {
    if heads == 0 || width % heads != 0 {
        return Err(format!("width {width} not divisible by {heads} heads"));
    }
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    for b in bufs {
        if q_col + width > b.cols {
            return Err(format!(
                "query columns {q_col}..{} beyond buffer width {}",
                q_col + width,
                b.cols
            ));
        }
    }
    for (si, s) in seqs.iter().enumerate() {
        for (b, r) in &s.q {
            let buf = bufs
                .get(*b)
                .ok_or_else(|| format!("sequence {si}: query buffer {b} of {}", bufs.len()))?;
            if r.end > buf.rows {
                return Err(format!(
                    "sequence {si}: query rows {r:?} beyond {} rows",
                    buf.rows
                ));
            }
            spans.push((*b, r.start, r.end));
        }
        for kv in &s.kv {
            let b = kv.buf;
            for col in [kv.k_col, kv.v_col] {
                if col + width > b.cols {
                    return Err(format!(
                        "sequence {si}: kv columns {col}..{} beyond width {}",
                        col + width,
                        b.cols
                    ));
                }
                if bufs.iter().any(|o| o.ptr == b.ptr) && col < q_col + width && q_col < col + width
                {
                    return Err(format!("sequence {si}: kv columns {col}.. overlap the query columns {q_col}.. of the same buffer"));
                }
            }
            let need = match &kv.rows {
                Rows::Range(r) => r.end,
                Rows::Index(i) => i.iter().map(|&x| x as usize + 1).max().unwrap_or(0),
            };
            if need > b.rows {
                return Err(format!(
                    "sequence {si}: kv row {} beyond {} rows",
                    need - 1,
                    b.rows
                ));
            }
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            return Err(format!(
                "query spans overlap in buffer {}: rows {}..{} and {}..{}",
                w[0].0, w[0].1, w[0].2, w[1].1, w[1].2
            ));
        }
    }
    Ok(())
}

/// Runs attention; call [`validate`] first.
pub fn attention(bufs: &[Buf], q_col: usize, width: usize, heads: usize, seqs: &[Seq<'_>]) {
    let hd = width / heads;
    let mut units = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for (b, rows) in &s.q {
            for h in 0..heads {
                let mut r = rows.start;
                while r < rows.end {
                    let e = (r + BQ).min(rows.end);
                    units.push((si, *b, h, r, e));
                    r = e;
                }
            }
        }
    }
    units.par_iter().for_each_init(
        || Scratch::new(hd),
        |scratch, &(si, b, h, r0, r1)| {
            attend_tile(
                bufs[b],
                q_col + h * hd,
                hd,
                h,
                r0..r1,
                &seqs[si].kv,
                scratch,
            );
        },
    );
}

struct Scratch {
    qt: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn new(hd: usize) -> Self {
        Scratch {
            qt: vec![0.0; BQ * hd],
            kt: vec![0.0; BK * hd],
            vt: vec![0.0; BK * hd],
            s: vec![0.0; BQ * BK],
            acc: vec![0.0; BQ * hd],
            m: vec![0.0; BQ],
            l: vec![0.0; BQ],
        }
    }
}

fn attend_tile(
    q: Buf,
    col: usize,
    hd: usize,
    h: usize,
    rows: Range<usize>,
    kv: &[Kv<'_>],
    sc: &mut Scratch,
) {
    let bq = rows.len();
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, r) in rows.clone().enumerate() {
        // SAFETY: validated row/column; this unit owns these query elements.
        let src = unsafe { std::slice::from_raw_parts(q.row(r, col, hd), hd) };
        for (d, s) in sc.qt[i * hd..(i + 1) * hd].iter_mut().zip(src) {
            *d = s * scale;
        }
    }
    sc.m[..bq].fill(f32::NEG_INFINITY);
    sc.l[..bq].fill(0.0);
    sc.acc[..bq * hd].fill(0.0);

    for src in kv {
        let n = src.rows.len();
        let (kc, vc) = (src.k_col + h * hd, src.v_col + h * hd);
        let mut t0 = 0;
        while t0 < n {
            let bk = (n - t0).min(BK);
            for j in 0..bk {
                let r = src.rows.get(t0 + j);
                // SAFETY: validated rows and columns; K/V columns are never written
                // during the call.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.buf.row(r, kc, hd),
                        sc.kt.as_mut_ptr().add(j * hd),
                        hd,
                    );
                    std::ptr::copy_nonoverlapping(
                        src.buf.row(r, vc, hd),
                        sc.vt.as_mut_ptr().add(j * hd),
                        hd,
                    );
                }
            }
            matmul(
                bq,
                bk,
                hd,
                &mut sc.s,
                bk,
                MatRef::row_major(&sc.qt, hd),
                MatRef::transposed(&sc.kt[..bk * hd], hd),
                false,
                false,
            );
            for i in 0..bq {
                let srow = &mut sc.s[i * bk..(i + 1) * bk];
                let m_old = sc.m[i];
                let m_new = m_old.max(simd::max(srow));
                let corr = if m_old == f32::NEG_INFINITY {
                    0.0
                } else {
                    simd::exp(m_old - m_new)
                };
                let sum = simd::exp_sub_sum(srow, m_new);
                sc.l[i] = sc.l[i] * corr + sum;
                if corr != 1.0 {
                    simd::scale(&mut sc.acc[i * hd..(i + 1) * hd], corr);
                }
                sc.m[i] = m_new;
            }
            matmul(
                bq,
                hd,
                bk,
                &mut sc.acc,
                hd,
                MatRef::row_major(&sc.s[..bq * bk], bk),
                MatRef::row_major(&sc.vt[..bk * hd], hd),
                true,
                false,
            );
            t0 += bk;
        }
    }
    for (i, r) in rows.enumerate() {
        let inv = if sc.l[i] > 0.0 { 1.0 / sc.l[i] } else { 0.0 };
        // SAFETY: this unit owns columns col..col+hd of rows `rows` (see Buf).
        let dst = unsafe { std::slice::from_raw_parts_mut(q.row(r, col, hd), hd) };
        for (d, a) in dst.iter_mut().zip(&sc.acc[i * hd..(i + 1) * hd]) {
            *d = a * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 softmax attention over explicit key rows of `[k|v]` buffers.
    fn naive(
        q: &[f32],
        qw: usize,
        qrows: Range<usize>,
        kvs: &[(&[f32], usize, Vec<usize>)],
        width: usize,
        heads: usize,
    ) -> Vec<f32> {
        let hd = width / heads;
        let mut out = vec![0.0f32; qrows.len() * width];
        for (oi, r) in qrows.enumerate() {
            for h in 0..heads {
                let qv = &q[r * qw + h * hd..r * qw + (h + 1) * hd];
                let mut scores = vec![];
                let mut vals = vec![];
                for (buf, bw, rows) in kvs {
                    for &kr in rows {
                        let kk = &buf[kr * bw + h * hd..kr * bw + (h + 1) * hd];
                        let s: f64 = qv
                            .iter()
                            .zip(kk)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt();
                        scores.push(s);
                        vals.push(&buf[kr * bw + width + h * hd..kr * bw + width + (h + 1) * hd]);
                    }
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let o: f64 = w
                        .iter()
                        .zip(&vals)
                        .map(|(w, v)| w * v[d] as f64)
                        .sum::<f64>()
                        / z;
                    out[oi * width + h * hd + d] = o as f32;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0)
                    * 4.0
                    - 2.0
            })
            .collect()
    }

    #[test]
    fn matches_naive_with_mixed_sources_in_place() {
        let (heads, hd) = (3, 16);
        let width = heads * hd;
        // A fused [q | k | v] buffer of 150 rows (several query tiles) and a cached
        // [k | v] buffer of 600 rows (several key tiles) read through an index.
        let nq = 150;
        let fw = 3 * width;
        let mut fused = data(nq * fw, 1);
        let orig = fused.clone();
        let cache = data(600 * 2 * width, 4);
        let idx: Vec<u32> = (0..600u32).filter(|i| i % 3 != 1).rev().collect();
        let fb = Buf::new(&mut fused, fw);
        let cb = Buf::external(&cache, 2 * width);
        let seqs = vec![
            Seq {
                q: vec![(0, 0..40)],
                kv: vec![Kv {
                    buf: fb,
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..40),
                }],
            },
            Seq {
                q: vec![(0, 40..nq)],
                kv: vec![
                    Kv {
                        buf: fb,
                        k_col: width,
                        v_col: 2 * width,
                        rows: Rows::Range(40..nq),
                    },
                    Kv {
                        buf: cb,
                        k_col: 0,
                        v_col: width,
                        rows: Rows::Index(&idx),
                    },
                ],
            },
        ];
        validate(&[fb], 0, width, heads, &seqs).unwrap();
        attention(&[fb], 0, width, heads, &seqs);
        // The reference reads k at columns [width..2w) and v at [2w..3w) of the
        // original fused buffer: shift the view by `width` so [k|v] starts at 0.
        let kv_view: Vec<f32> = orig.chunks(fw).flat_map(|r| r[width..].to_vec()).collect();
        let want0 = naive(
            &orig,
            fw,
            0..40,
            &[(&kv_view, 2 * width, (0..40).collect())],
            width,
            heads,
        );
        let idxu: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
        let want1 = naive(
            &orig,
            fw,
            40..nq,
            &[
                (&kv_view, 2 * width, (40..nq).collect()),
                (&cache, 2 * width, idxu),
            ],
            width,
            heads,
        );
        let got: Vec<f32> = fused.chunks(fw).flat_map(|r| r[..width].to_vec()).collect();
        let worst = got
            .iter()
            .zip(want0.iter().chain(&want1))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 2e-5, "max abs diff {worst}");
        // K and V columns are untouched.
        for (a, b) in fused.chunks(fw).zip(orig.chunks(fw)) {
            assert_eq!(a[width..], b[width..]);
        }
    }

    #[test]
    fn rejects_overlaps() {
        let mut a = vec![0.0; 10 * 12];
        let b = Buf::new(&mut a, 12);
        let kv = |k_col| {
            vec![Kv {
                buf: b,
                k_col,
                v_col: 8,
                rows: Rows::Range(0..10),
            }]
        };
        let seq = |q, k_col| Seq { q, kv: kv(k_col) };
        assert!(validate(&[b], 0, 4, 2, &[seq(vec![(0, 0..10)], 4)]).is_ok());
        assert!(validate(&[b], 0, 4, 2, &[seq(vec![(0, 0..10)], 2)])
            .unwrap_err()
            .contains("overlap"));
        assert!(validate(
            &[b],
            0,
            4,
            2,
            &[seq(vec![(0, 0..6)], 4), seq(vec![(0, 5..10)], 4)]
        )
        .unwrap_err()
        .contains("overlap"));
        assert!(validate(&[b], 0, 4, 2, &[seq(vec![(0, 0..11)], 4)])
            .unwrap_err()
            .contains("beyond"));
    }
}
