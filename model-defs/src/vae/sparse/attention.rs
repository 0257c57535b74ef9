//! The VAE mid-block attention of a sparse pass: queries only at the pixels the edit
//! recomputes, keys and values the template's but where the input changed.
//!
//! The attention is one head of 512 channels over every pixel of the smallest level
//! (64x64 at 512x512), so its cost is the queries' `2 C N` plus the refreshed keys'
//! projections. What the dense pass does per element (the GroupNorm, the residual) is
//! done here per row segment, and the template's K/V are read in place: the kernel
//! takes the cached rows that stay and the refreshed ones as two sources of one
//! softmax, so the 16 MB K/V matrix is never copied.

use denoised_runtime::backend::Rows;
use denoised_runtime::cpu::attention::{self, Buf, Kv, KvBuf, Seq};
use denoised_runtime::cpu::matmul::{matmul, MatRef};
use denoised_runtime::cpu::sparse_conv::{Plane, Run, TileData, Tiles};
use denoised_runtime::{Error, Result};

use super::super::weights::Attention;

/// Queries per attention work unit: the kernel runs one unit per (head, query chunk),
/// and this attention has one head, so a few hundred queries in one chunk would run
/// on one core. Units of this size keep every core busy (each unit streams all keys
/// once, which at this size is still a fraction of its products).
const QUERIES_PER_UNIT: usize = 128;

/// The mid-block attention (with its residual) at the computed pixels of `tiles`, for
/// `x` (`[1, C, H, W]`): K and V are the template's (`kv`, `[H*W, 2C]`) with the
/// pixels of the `refresh` runs (disjoint) recomputed from `x`; the GroupNorm is
/// `x * scale + shift`; the tiles' other pixels keep `cached`, the attention's cached
/// output.
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention(
    x: Plane<'_>,
    a: &Attention,
    scale: &[f32],
    shift: &[f32],
    kv: &[f32],
    refresh: &[Run],
    cached: Plane<'_>,
    tiles: Tiles,
) -> Result<TileData> {
    let (c, n) = (x.c, x.h * x.w);
    if kv.len() != n * 2 * c
        || scale.len() != c
        || (tiles.h, tiles.w) != (x.h, x.w)
        || cached.shape() != x.shape()
    {
        return Err(Error::shape(
            "vae sparse attention",
            format!(
                "x {:?}, cached K/V {:?}, tiles of {}x{}",
                x.shape(),
                kv.len(),
                tiles.h,
                tiles.w
            ),
        ));
    }
    if let Some(bad) = refresh
        .iter()
        .find(|r| r.y >= x.h || r.x1 > x.w || r.x0 > r.x1)
    {
        return Err(Error::shape(
            "vae sparse attention",
            format!("refresh run {bad:?} on a {}x{} plane", x.h, x.w),
        ));
    }
    let queries: Vec<Run> = (0..tiles.active.len())
        .flat_map(|i| tiles.runs(i).iter().copied())
        .collect();
    let nq: usize = queries.iter().map(Run::len).sum();

    // Fresh K/V of the refreshed pixels, and the cached rows of all the others.
    let fresh = project(a, &normed(x, refresh, scale, shift), c, c, 2 * c);
    let mut stale = vec![true; n];
    for r in refresh {
        stale[r.y * x.w + r.x0..r.y * x.w + r.x1].fill(false);
    }
    let kept: Vec<u32> = (0..n as u32).filter(|&p| stale[p as usize]).collect();
    if kept.len() + fresh.len() / (2 * c) != n {
        // A pixel in two runs would be two keys of one softmax.
        return Err(Error::shape(
            "vae sparse attention",
            "refresh runs overlap".to_string(),
        ));
    }

    let mut q = project(a, &normed(x, &queries, scale, shift), c, 0, c);
    let bufs = [Buf::new(&mut q, c)];
    let mut kv_sources = Vec::new();
    if !kept.is_empty() {
        kv_sources.push((KvBuf::F32(Buf::external(kv, 2 * c)), Rows::Index(&kept)));
    }
    if !fresh.is_empty() {
        let rows = fresh.len() / (2 * c);
        kv_sources.push((
            KvBuf::F32(Buf::external(&fresh, 2 * c)),
            Rows::Range(0..rows),
        ));
    }
    let seqs: Vec<Seq<'_>> = (0..nq)
        .step_by(QUERIES_PER_UNIT)
        .map(|q0| Seq {
            q: vec![(0, q0..(q0 + QUERIES_PER_UNIT).min(nq))],
            kv: kv_sources
                .iter()
                .map(|(buf, rows)| Kv {
                    buf: *buf,
                    k_col: 0,
                    v_col: c,
                    rows: rows.clone(),
                })
                .collect(),
        })
        .collect();
    attention::validate(&bufs, 0, c, 1, &seqs)
        .map_err(|e| Error::shape("vae sparse attention", e))?;
    attention::attention(&bufs, 0, c, 1, &seqs);
    // y[p, :] = attn[p, :] @ out_wᵀ + out_b.
    let mut y: Vec<f32> = Vec::with_capacity(nq * c);
    for _ in 0..nq {
        y.extend_from_slice(a.out_b.data());
    }
    let wt = MatRef::transposed(a.out_w.data(), c);
    matmul(
        nq,
        c,
        c,
        &mut y,
        c,
        MatRef::row_major(&q, c),
        wt,
        true,
        true,
    );

    // out[:, p] = x[:, p] + y[p, :] at the queries (tile by tile, run by run: row j of
    // y is the j-th of them); the tiles' other pixels keep the cached output.
    let mut out = TileData::new(tiles, c);
    let mut j = 0;
    let mut xrow = Vec::new();
    for i in 0..out.tiles.active.len() {
        let (y0, y1, x0, x1) = out.tiles.rect(i);
        let (tw, full) = (x1 - x0, out.tiles.is_full(i));
        let tp = (y1 - y0) * tw;
        let runs = out.tiles.runs(i).to_vec();
        let block = out.block_mut(i);
        if !full {
            cached.read_rect((y0, y1, x0, x1), block);
        }
        for (ch, plane) in block.chunks_exact_mut(tp).enumerate() {
            let mut jj = j;
            for r in &runs {
                xrow.resize(r.len(), 0.0);
                x.read_row(ch, r.y, r.x0, r.x1, &mut xrow);
                let d = &mut plane[(r.y - y0) * tw + r.x0 - x0..][..r.len()];
                for ((d, xv), k) in d.iter_mut().zip(&xrow).zip(jj..) {
                    *d = xv + y[k * c + ch];
                }
                jj += r.len();
            }
        }
        j += runs.iter().map(Run::len).sum::<usize>();
    }
    Ok(out)
}

/// GN(x) at the pixels of `runs`, as rows `[pixels, C]`, read a row segment at a time.
fn normed(x: Plane<'_>, runs: &[Run], scale: &[f32], shift: &[f32]) -> Vec<f32> {
    let c = x.c;
    let total: usize = runs.iter().map(Run::len).sum();
    let mut rows = vec![0.0f32; total * c];
    let mut seg = Vec::new();
    let mut at = 0;
    for r in runs {
        seg.resize(r.len(), 0.0);
        for ch in 0..c {
            x.read_row(ch, r.y, r.x0, r.x1, &mut seg);
            for (j, v) in seg.iter().enumerate() {
                rows[(at + j) * c + ch] = v * scale[ch] + shift[ch];
            }
        }
        at += r.len();
    }
    rows
}

/// `rows @ qkv_t[:, col..col + width] + bias` for rows of `c` channels, as
/// `[rows, width]`.
fn project(a: &Attention, rows: &[f32], c: usize, col: usize, width: usize) -> Vec<f32> {
    let m = rows.len() / c;
    let mut dst: Vec<f32> = Vec::with_capacity(m * width);
    for _ in 0..m {
        dst.extend_from_slice(&a.qkv_b.data()[col..col + width]);
    }
    let w = MatRef {
        data: &a.qkv_t.data()[col..],
        rs: 3 * c,
        cs: 1,
    };
    matmul(
        m,
        width,
        c,
        &mut dst,
        width,
        MatRef::row_major(rows, c),
        w,
        true,
        true,
    );
    dst
}
