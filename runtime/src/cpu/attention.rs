//! Multi-head attention on the CPU, tiled like FlashAttention.
//!
//! For each (sequence, head, chunk of up to 1024 queries) the kernel streams keys and
//! values in tiles of 256: read in place from a range of a fresh buffer, or gathered
//! through an index from a cached one into a small packed tile. Every query sub-tile
//! of the chunk consumes the tile while it is hot in cache, with an online softmax
//! (running max and sum) so no score matrix is ever built. The two products per tile go
//! through gemm, reading queries and fresh keys through strides, without copies. This is the CPU reference of the CUDA
//! masked-query attention kernel and has the same contract: keys may come from any mix
//! of sources, which is what mask-aware editing needs, and the output overwrites the
//! queries in place.

use std::ops::Range;

use rayon::prelude::*;

use super::matmul::matmul_raw;
use super::simd;
use crate::backend::Rows;

/// Query rows per gemm call (one sub-tile of a unit's queries).
const BQ: usize = 128;
/// Keys per streamed tile.
const BK: usize = 256;
/// Query rows per work unit. Each unit streams every key of its sequence once, so
/// bigger units gather cached keys fewer times; the cap bounds the unit's softmax
/// state (`QCHUNK x head_dim` floats) and keeps enough units for all cores.
const QCHUNK: usize = 1024;

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

/// A work unit: (sequence, head, pieces of query rows as (buffer, rows)).
type Unit = (usize, usize, Vec<(usize, Range<usize>)>);

/// Runs attention; call [`validate`] first.
pub fn attention(bufs: &[Buf], q_col: usize, width: usize, heads: usize, seqs: &[Seq<'_>]) {
    let hd = width / heads;
    // Units: (sequence, head, pieces of query rows totalling at most QCHUNK).
    let mut units: Vec<Unit> = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        let mut chunks: Vec<Vec<(usize, Range<usize>)>> = vec![vec![]];
        let mut fill = 0;
        for (b, rows) in &s.q {
            let mut r = rows.start;
            while r < rows.end {
                if fill == QCHUNK {
                    chunks.push(vec![]);
                    fill = 0;
                }
                let e = (r + QCHUNK - fill).min(rows.end);
                chunks.last_mut().expect("non-empty").push((*b, r..e));
                fill += e - r;
                r = e;
            }
        }
        for h in 0..heads {
            for c in &chunks {
                if !c.is_empty() {
                    units.push((si, h, c.clone()));
                }
            }
        }
    }
    units.par_iter().for_each_init(
        || Scratch::new(hd),
        |scratch, (si, h, pieces)| {
            attend_unit(bufs, q_col + h * hd, hd, *h, pieces, &seqs[*si].kv, scratch)
        },
    );
}

struct Scratch {
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
            kt: vec![0.0; BK * hd],
            vt: vec![0.0; BK * hd],
            s: vec![0.0; BQ * BK],
            acc: vec![0.0; QCHUNK * hd],
            m: vec![0.0; QCHUNK],
            l: vec![0.0; QCHUNK],
        }
    }
}

/// One (sequence, head, query chunk): streams the sequence's keys tile by tile; each
/// tile is used by every query sub-tile of the chunk while it is hot in cache.
fn attend_unit(
    bufs: &[Buf],
    col: usize,
    hd: usize,
    h: usize,
    pieces: &[(usize, Range<usize>)],
    kv: &[Kv<'_>],
    sc: &mut Scratch,
) {
    let n: usize = pieces.iter().map(|(_, r)| r.len()).sum();
    let scale = 1.0 / (hd as f32).sqrt();
    sc.m[..n].fill(f32::NEG_INFINITY);
    sc.l[..n].fill(0.0);
    sc.acc[..n * hd].fill(0.0);

    for src in kv {
        let total = src.rows.len();
        let (kc, vc) = (src.k_col + h * hd, src.v_col + h * hd);
        let mut t0 = 0;
        while t0 < total {
            let bk = (total - t0).min(BK);
            // Keys and values of this tile: read in place from a range of rows, or
            // gathered through the index into the packed scratch tiles.
            let (kp, vp, rs) = match &src.rows {
                Rows::Range(r) => (
                    src.buf.row(r.start + t0, kc, hd) as *const f32,
                    src.buf.row(r.start + t0, vc, hd) as *const f32,
                    src.buf.cols,
                ),
                Rows::Index(_) => {
                    for j in 0..bk {
                        let r = src.rows.get(t0 + j);
                        // SAFETY: validated rows and columns; K/V columns are never
                        // written during the call.
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
                    (sc.kt.as_ptr(), sc.vt.as_ptr(), hd)
                }
            };
            let mut i0 = 0; // row offset of the sub-tile in the unit's state
            for (b, rows) in pieces {
                let q = bufs[*b];
                let mut r = rows.start;
                while r < rows.end {
                    let bq = (rows.end - r).min(BQ);
                    // SAFETY: validated rows/columns; this unit is the only one that
                    // touches these query elements, and reads K/V columns nobody writes.
                    unsafe {
                        matmul_raw(
                            bq,
                            bk,
                            hd,
                            sc.s.as_mut_ptr(),
                            bk,
                            (q.row(r, col, hd), q.cols, 1),
                            (kp, 1, rs),
                            scale,
                            false,
                        );
                    }
                    for i in 0..bq {
                        let srow = &mut sc.s[i * bk..(i + 1) * bk];
                        let si = i0 + i;
                        let m_old = sc.m[si];
                        let m_new = m_old.max(simd::max(srow));
                        let corr = if m_old == f32::NEG_INFINITY {
                            0.0
                        } else {
                            simd::exp(m_old - m_new)
                        };
                        let sum = simd::exp_sub_sum(srow, m_new);
                        sc.l[si] = sc.l[si] * corr + sum;
                        if corr != 1.0 {
                            simd::scale(&mut sc.acc[si * hd..(si + 1) * hd], corr);
                        }
                        sc.m[si] = m_new;
                    }
                    // SAFETY: scratch buffers are sized for BQ x BK and QCHUNK x hd.
                    unsafe {
                        matmul_raw(
                            bq,
                            hd,
                            bk,
                            sc.acc.as_mut_ptr().add(i0 * hd),
                            hd,
                            (sc.s.as_ptr(), bk, 1),
                            (vp, rs, 1),
                            1.0,
                            true,
                        );
                    }
                    i0 += bq;
                    r += bq;
                }
            }
            t0 += bk;
        }
    }
    let mut i0 = 0;
    for (b, rows) in pieces {
        for r in rows.clone() {
            let inv = if sc.l[i0] > 0.0 { 1.0 / sc.l[i0] } else { 0.0 };
            // SAFETY: this unit owns columns col..col+hd of its query rows (see Buf).
            let dst = unsafe { std::slice::from_raw_parts_mut(bufs[*b].row(r, col, hd), hd) };
            for (d, a) in dst.iter_mut().zip(&sc.acc[i0 * hd..(i0 + 1) * hd]) {
                *d = a * inv;
            }
            i0 += 1;
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

    /// Queries in two buffers (text and image streams of a double block) whose total
    /// crosses the QCHUNK boundary, keys from both plus a cache.
    #[test]
    fn chunks_spanning_two_buffers() {
        let (heads, hd) = (2, 8);
        let width = heads * hd;
        let fw = 3 * width;
        let (nt, ni) = (300, 900);
        let mut txt = data(nt * fw, 7);
        let mut img = data(ni * fw, 8);
        let (txt0, img0) = (txt.clone(), img.clone());
        let cache = data(50 * 2 * width, 9);
        let idx: Vec<u32> = (0..50).rev().collect();
        let (tb, ib) = (Buf::new(&mut txt, fw), Buf::new(&mut img, fw));
        let cb = Buf::external(&cache, 2 * width);
        let seq = Seq {
            q: vec![(0, 0..nt), (1, 0..ni)],
            kv: vec![
                Kv {
                    buf: tb,
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..nt),
                },
                Kv {
                    buf: ib,
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..ni),
                },
                Kv {
                    buf: cb,
                    k_col: 0,
                    v_col: width,
                    rows: Rows::Index(&idx),
                },
            ],
        };
        validate(&[tb, ib], 0, width, heads, std::slice::from_ref(&seq)).unwrap();
        attention(&[tb, ib], 0, width, heads, &[seq]);
        // Reference over the joint [txt; img] matrix.
        let joint: Vec<f32> = txt0.iter().chain(&img0).copied().collect();
        let kv_view: Vec<f32> = joint.chunks(fw).flat_map(|r| r[width..].to_vec()).collect();
        let idxu: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
        let want = naive(
            &joint,
            fw,
            0..nt + ni,
            &[
                (&kv_view, 2 * width, (0..nt + ni).collect()),
                (&cache, 2 * width, idxu),
            ],
            width,
            heads,
        );
        let got: Vec<f32> = txt
            .chunks(fw)
            .chain(img.chunks(fw))
            .flat_map(|r| r[..width].to_vec())
            .collect();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 2e-5, "max abs diff {worst}");
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
