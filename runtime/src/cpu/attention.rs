//! Multi-head attention on the CPU, tiled like FlashAttention.
//!
//! For each (sequence, head, tile of queries) the kernel streams keys and values in
//! tiles, gathering each tile from its source rows (a range of a fresh buffer or an
//! index into a cached one) into a small packed buffer that stays in L1/L2, and keeps
//! an online softmax (running max and sum) so no full score matrix is ever built. The
//! two products per tile go through gemm. This is the CPU reference of the CUDA
//! masked-query attention kernel and has the same contract: keys may come from any mix
//! of sources, which is what mask-aware editing needs.

use rayon::prelude::*;

use super::matmul::{matmul, MatRef};
use super::simd;
use crate::backend::Rows;

/// Query rows per work unit.
const BQ: usize = 128;
/// Keys per streamed tile.
const BK: usize = 256;

/// A key/value source with host buffers.
pub struct Kv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub rows: Rows<'a>,
}

pub struct Seq<'a> {
    pub q: std::ops::Range<usize>,
    pub kv: Vec<Kv<'a>>,
}

/// Output pointer shared by the work units; each unit writes a disjoint
/// (rows x head-columns) block, so there is no overlap.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: see above; units never write the same element.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `q` and `out` are `[rows, heads*hd]`; every K/V buffer has the same width.
pub fn attention(q: &[f32], out: &mut [f32], width: usize, heads: usize, seqs: &[Seq<'_>]) {
    let hd = width / heads;
    assert_eq!(q.len(), out.len());
    for s in seqs {
        assert!(s.q.end * width <= q.len(), "attention: query rows out of range");
        for kv in &s.kv {
            let need = match &kv.rows {
                Rows::Range(r) => r.end,
                Rows::Index(i) => i.iter().map(|&x| x as usize + 1).max().unwrap_or(0),
            };
            assert!(need * width <= kv.k.len() && need * width <= kv.v.len(), "attention: kv rows out of range");
        }
    }
    let mut units = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for h in 0..heads {
            let mut r = s.q.start;
            while r < s.q.end {
                let e = (r + BQ).min(s.q.end);
                units.push((si, h, r, e));
                r = e;
            }
        }
    }
    let outp = OutPtr(out.as_mut_ptr());
    units.par_iter().for_each_init(
        || Scratch::new(hd),
        |scratch, &(si, h, r0, r1)| {
            let p = outp;
            attend_tile(q, p, width, hd, h, r0..r1, &seqs[si].kv, scratch);
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

#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    out: OutPtr,
    width: usize,
    hd: usize,
    h: usize,
    rows: std::ops::Range<usize>,
    kv: &[Kv<'_>],
    sc: &mut Scratch,
) {
    let bq = rows.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let col = h * hd;
    for (i, r) in rows.clone().enumerate() {
        let src = &q[r * width + col..r * width + col + hd];
        for (d, s) in sc.qt[i * hd..(i + 1) * hd].iter_mut().zip(src) {
            *d = s * scale;
        }
    }
    sc.m[..bq].fill(f32::NEG_INFINITY);
    sc.l[..bq].fill(0.0);
    sc.acc[..bq * hd].fill(0.0);

    for src in kv {
        let n = src.rows.len();
        let mut t0 = 0;
        while t0 < n {
            let bk = (n - t0).min(BK);
            for j in 0..bk {
                let r = src.rows.get(t0 + j);
                let off = r * width + col;
                sc.kt[j * hd..(j + 1) * hd].copy_from_slice(&src.k[off..off + hd]);
                sc.vt[j * hd..(j + 1) * hd].copy_from_slice(&src.v[off..off + hd]);
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
                let corr = if m_old == f32::NEG_INFINITY { 0.0 } else { simd::exp(m_old - m_new) };
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
        // SAFETY: this unit owns columns col..col+hd of rows `rows` (see OutPtr).
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * width + col), hd) };
        for (d, a) in dst.iter_mut().zip(&sc.acc[i * hd..(i + 1) * hd]) {
            *d = a * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 softmax attention over an explicit key list.
    fn naive(q: &[f32], kvs: &[(&[f32], &[f32], Vec<usize>)], qrows: std::ops::Range<usize>, width: usize, heads: usize) -> Vec<f32> {
        let hd = width / heads;
        let mut out = vec![0.0f32; qrows.len() * width];
        for (oi, r) in qrows.enumerate() {
            for h in 0..heads {
                let qv = &q[r * width + h * hd..r * width + (h + 1) * hd];
                let mut scores = vec![];
                let mut vals = vec![];
                for (k, v, rows) in kvs {
                    for &kr in rows {
                        let kk = &k[kr * width + h * hd..kr * width + (h + 1) * hd];
                        let s: f64 = qv.iter().zip(kk).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (hd as f64).sqrt();
                        scores.push(s);
                        vals.push(&v[kr * width + h * hd..kr * width + (h + 1) * hd]);
                    }
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let o: f64 = w.iter().zip(&vals).map(|(w, v)| w * v[d] as f64).sum::<f64>() / z;
                    out[oi * width + h * hd + d] = o as f32;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0) * 4.0 - 2.0).collect()
    }

    #[test]
    fn matches_naive_with_mixed_sources() {
        let (heads, hd) = (3, 16);
        let width = heads * hd;
        let nq = 150; // spans several query tiles
        let q = data(nq * width, 1);
        let fresh_k = data(nq * width, 2);
        let fresh_v = data(nq * width, 3);
        let ncache = 600; // spans several key tiles
        let cache_k = data(ncache * width, 4);
        let cache_v = data(ncache * width, 5);
        let idx: Vec<u32> = (0..ncache as u32).filter(|i| i % 3 != 1).rev().collect();
        let seqs = vec![
            Seq { q: 0..40, kv: vec![Kv { k: &fresh_k, v: &fresh_v, rows: Rows::Range(0..40) }] },
            Seq {
                q: 40..nq,
                kv: vec![
                    Kv { k: &fresh_k, v: &fresh_v, rows: Rows::Range(40..nq) },
                    Kv { k: &cache_k, v: &cache_v, rows: Rows::Index(&idx) },
                ],
            },
        ];
        let mut out = vec![0.0; nq * width];
        attention(&q, &mut out, width, heads, &seqs);
        let want0 = naive(&q, &[(&fresh_k, &fresh_v, (0..40).collect())], 0..40, width, heads);
        let idxu: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
        let want1 = naive(&q, &[(&fresh_k, &fresh_v, (40..nq).collect()), (&cache_k, &cache_v, idxu)], 40..nq, width, heads);
        let got = &out;
        let mut worst = 0.0f32;
        for (a, b) in got.iter().zip(want0.iter().chain(&want1)) {
            worst = worst.max((a - b).abs());
        }
        assert!(worst < 2e-5, "max abs diff {worst}");
    }
}
