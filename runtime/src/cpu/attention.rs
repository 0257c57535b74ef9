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
//!
//! A cached source may be an fp8 matrix (a compressed template's slab, with a scale per
//! head's K and V): its tile load decodes the bytes through a 256-entry table into the
//! packed tile, and the two scales are folded into the products' factors (the score
//! scale and the `P V` accumulation), so the slab is never expanded and no value is
//! multiplied by its scale.

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

/// A read-only fp8 matrix: `rows x cols` bytes, with `groups` column groups of
/// `cols / groups` columns, each with a scale.
#[derive(Clone, Copy)]
pub struct Fp8Buf {
    ptr: *const u8,
    rows: usize,
    cols: usize,
    scales: *const f32,
    groups: usize,
}
// SAFETY: read-only, and the caller keeps the matrix alive for the call.
unsafe impl Send for Fp8Buf {}
unsafe impl Sync for Fp8Buf {}

impl Fp8Buf {
    pub fn new(m: &crate::tensor::Fp8Matrix, cols: usize) -> Self {
        Fp8Buf {
            ptr: m.bytes.as_ptr(),
            rows: m.bytes.len() / cols.max(1),
            cols,
            scales: m.scales.as_ptr(),
            groups: m.scales.len(),
        }
    }
    fn group_width(&self) -> usize {
        self.cols / self.groups.max(1)
    }
    /// The scale of the group holding columns `col..col+len` (one group, validated).
    fn scale(&self, col: usize) -> f32 {
        // SAFETY: the group index is below `groups` for validated columns.
        unsafe { *self.scales.add(col / self.group_width()) }
    }
}

/// Where a sequence's keys and values are read from.
#[derive(Clone, Copy)]
pub enum KvBuf {
    F32(Buf),
    Fp8(Fp8Buf),
}

impl KvBuf {
    fn dims(&self) -> (usize, usize) {
        match self {
            KvBuf::F32(b) => (b.rows, b.cols),
            KvBuf::Fp8(b) => (b.rows, b.cols),
        }
    }
}

pub struct Kv<'a> {
    pub buf: KvBuf,
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
            let (b_rows, b_cols) = kv.buf.dims();
            for col in [kv.k_col, kv.v_col] {
                if col + width > b_cols {
                    return Err(format!(
                        "sequence {si}: kv columns {col}..{} beyond width {b_cols}",
                        col + width,
                    ));
                }
                match kv.buf {
                    KvBuf::F32(b) => {
                        if bufs.iter().any(|o| o.ptr == b.ptr)
                            && col < q_col + width
                            && q_col < col + width
                        {
                            return Err(format!("sequence {si}: kv columns {col}.. overlap the query columns {q_col}.. of the same buffer"));
                        }
                    }
                    KvBuf::Fp8(b) => {
                        // Each head's keys (and values) must share one scale.
                        let (gw, hd) = (b.group_width(), width / heads);
                        if b.groups == 0 || b.cols % b.groups != 0 || gw % hd != 0 || col % hd != 0
                        {
                            return Err(format!(
                                "sequence {si}: fp8 kv of {} columns in {} scale groups does not align with {heads} heads at column {col}",
                                b.cols, b.groups
                            ));
                        }
                    }
                }
            }
            let need = match &kv.rows {
                Rows::Range(r) => r.end,
                Rows::Index(i) => i.iter().map(|&x| x as usize + 1).max().unwrap_or(0),
            };
            if need > b_rows {
                return Err(format!(
                    "sequence {si}: kv row {} beyond {b_rows} rows",
                    need - 1,
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
    /// An fp8 tile's bytes, gathered before one decode pass over the tile.
    k8: Vec<u8>,
    v8: Vec<u8>,
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
            k8: vec![0; BK * hd],
            v8: vec![0; BK * hd],
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
        // fp8 sources: the scales of this head's K and V, folded into the products.
        let (k_scale, v_scale) = match &src.buf {
            KvBuf::F32(_) => (1.0, 1.0),
            KvBuf::Fp8(b) => (b.scale(kc), b.scale(vc)),
        };
        while t0 < total {
            let bk = (total - t0).min(BK);
            // Keys and values of this tile: read in place from a range of rows, or
            // gathered through the index (and, for fp8, decoded) into the packed
            // scratch tiles.
            let (kp, vp, rs) = match (&src.buf, &src.rows) {
                (KvBuf::F32(b), Rows::Range(r)) => (
                    b.row(r.start + t0, kc, hd) as *const f32,
                    b.row(r.start + t0, vc, hd) as *const f32,
                    b.cols,
                ),
                (KvBuf::F32(b), Rows::Index(_)) => {
                    for j in 0..bk {
                        let r = src.rows.get(t0 + j);
                        // SAFETY: validated rows and columns; K/V columns are never
                        // written during the call.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                b.row(r, kc, hd),
                                sc.kt.as_mut_ptr().add(j * hd),
                                hd,
                            );
                            std::ptr::copy_nonoverlapping(
                                b.row(r, vc, hd),
                                sc.vt.as_mut_ptr().add(j * hd),
                                hd,
                            );
                        }
                    }
                    (sc.kt.as_ptr(), sc.vt.as_ptr(), hd)
                }
                (KvBuf::Fp8(b), rows) => {
                    for j in 0..bk {
                        let r = rows.get(t0 + j);
                        // SAFETY: validated rows and columns of a live matrix.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                b.ptr.add(r * b.cols + kc),
                                sc.k8.as_mut_ptr().add(j * hd),
                                hd,
                            );
                            std::ptr::copy_nonoverlapping(
                                b.ptr.add(r * b.cols + vc),
                                sc.v8.as_mut_ptr().add(j * hd),
                                hd,
                            );
                        }
                    }
                    simd::fp8_decode(&sc.k8[..bk * hd], &mut sc.kt[..bk * hd]);
                    simd::fp8_decode(&sc.v8[..bk * hd], &mut sc.vt[..bk * hd]);
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
                            scale * k_scale,
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
                            v_scale,
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
                    buf: KvBuf::F32(fb),
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..40),
                }],
            },
            Seq {
                q: vec![(0, 40..nq)],
                kv: vec![
                    Kv {
                        buf: KvBuf::F32(fb),
                        k_col: width,
                        v_col: 2 * width,
                        rows: Rows::Range(40..nq),
                    },
                    Kv {
                        buf: KvBuf::F32(cb),
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
                    buf: KvBuf::F32(tb),
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..nt),
                },
                Kv {
                    buf: KvBuf::F32(ib),
                    k_col: width,
                    v_col: 2 * width,
                    rows: Rows::Range(0..ni),
                },
                Kv {
                    buf: KvBuf::F32(cb),
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
                buf: KvBuf::F32(b),
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

    /// An fp8 cached source (a compressed template slab, scaled per head's K and V):
    /// equal to the f32 kernel on the dequantised values, and close to the unquantised
    /// ones.
    #[test]
    fn fp8_source_equals_its_dequantised_values() {
        let (heads, hd) = (4, 16);
        let width = heads * hd;
        let nq = 70;
        let fw = 3 * width;
        // Per-head magnitudes differ (as real K/V do): one scale per (K|V, head).
        let mut cache = data(700 * 2 * width, 9);
        for (i, v) in cache.iter_mut().enumerate() {
            *v *= [0.05, 1.0, 7.0, 0.4][(i % width) / hd];
        }
        let (bytes, scales) = crate::fp8::quantize(&cache, 2 * width, 2 * heads);
        let deq = crate::fp8::dequantize(&bytes, 2 * width, &scales);
        let m = crate::tensor::Fp8Matrix { bytes, scales };
        let idx: Vec<u32> = (0..700u32).filter(|i| i % 4 != 2).collect();
        let run = |kv: KvBuf| {
            let mut fused = data(nq * fw, 2);
            let fb = Buf::new(&mut fused, fw);
            let seqs = vec![Seq {
                q: vec![(0, 0..nq)],
                kv: vec![
                    Kv {
                        buf: KvBuf::F32(fb),
                        k_col: width,
                        v_col: 2 * width,
                        rows: Rows::Range(0..nq),
                    },
                    Kv {
                        buf: kv,
                        k_col: 0,
                        v_col: width,
                        rows: Rows::Index(&idx),
                    },
                ],
            }];
            validate(&[fb], 0, width, heads, &seqs).unwrap();
            attention(&[fb], 0, width, heads, &seqs);
            fused
                .chunks(fw)
                .flat_map(|r| r[..width].to_vec())
                .collect::<Vec<f32>>()
        };
        let got = run(KvBuf::Fp8(Fp8Buf::new(&m, 2 * width)));
        let same = run(KvBuf::F32(Buf::external(&deq, 2 * width)));
        let exact = run(KvBuf::F32(Buf::external(&cache, 2 * width)));
        let rel = |a: &[f32], b: &[f32]| {
            let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            a.iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale
        };
        let (d_same, d_exact) = (rel(&got, &same), rel(&got, &exact));
        println!("fp8 vs dequantised f32: {d_same:.1e}; vs unquantised: {d_exact:.1e}");
        assert!(d_same <= 1e-5, "{d_same:.2e}");
        // Each K and V element is within 2^-4 of itself (3 mantissa bits, half a unit),
        // so the output, a convex combination of V rows, moves by at most 1/16 of the
        // largest |V| through V, plus what the scores' error moves the weights: 0.1 of
        // the output scale bounds both here.
        assert!(d_exact <= 0.1, "{d_exact:.2e}");
        assert!(d_exact > 0.0);
        // A scale group must hold whole heads.
        let bad = crate::tensor::Fp8Matrix {
            bytes: vec![0; 10 * 2 * width],
            scales: vec![1.0; 3],
        };
        let mut fused = data(4 * fw, 3);
        let fb = Buf::new(&mut fused, fw);
        let seqs = vec![Seq {
            q: vec![(0, 0..4)],
            kv: vec![Kv {
                buf: KvBuf::Fp8(Fp8Buf::new(&bad, 2 * width)),
                k_col: 0,
                v_col: width,
                rows: Rows::Range(0..10),
            }],
        }];
        assert!(validate(&[fb], 0, width, heads, &seqs).is_err());
    }
}
