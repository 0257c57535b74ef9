//! Masked-query attention against the CPU: every tensor-core kernel and the library
//! path (`AttnKernel::Cudnn`), sequences over two buffers with cached K/V by index (bf16
//! and fp8 caches), in place (a single block's layout), and many templates at once.

use std::ops::Range;

use denoised_runtime::backend::{AttnSeq, Backend, KvSource, QSpan, Rows, Src};
use denoised_runtime::{CpuBackend, Error, Result, Tensor};

use super::{close, Check, Rng};
use crate::attention::AttnKernel;
use crate::exec::{Dt, Exec};
use crate::GpuBackend;

/// Every attention check on `gpu` (its kernel restored after).
pub(super) fn check_attention_ops<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    cpu: &CpuBackend,
    rng: &mut Rng,
) -> Result<()> {
    let dt = gpu.dtype();
    // attention: head dims 64 and 128 take the tensor-core kernel in bf16; 16 the
    // SIMT one. Queries span two buffers; keys come from both (by range) and from an
    // external "cache" by index, in two sequences of different lengths.
    // In bf16 every tensor-core kernel is checked (the FA2 one runs by default).
    // `Cudnn` runs the executor's attention library where it has one (cuDNN; the
    // emulator's stand-in), and our fa2w kernel where not.
    let kernels: &[AttnKernel] = match dt {
        Dt::Bf16 => &[
            AttnKernel::Cudnn,
            AttnKernel::Fa2,
            AttnKernel::Fa2Wide,
            AttnKernel::Mma,
        ],
        Dt::F32 => &[AttnKernel::Fa2],
    };
    let before = gpu.attn_kernel();
    for &k in kernels {
        gpu.set_attn_kernel(k);
        let tag = if dt == Dt::Bf16 {
            format!(" [{k:?}]")
        } else {
            String::new()
        };
        for (heads, hd) in [(2, 64), (1, 128), (3, 16)] {
            if hd == 16 && k == AttnKernel::Mma {
                continue; // the SIMT kernel, checked once
            }
            check_attention(out, gpu, cpu, rng, heads, hd, &tag)?;
        }
        check_attention_in_place(out, gpu, cpu, rng, &tag)?;
    }
    gpu.set_attn_kernel(before);
    check_attention_many_caches(out, gpu, cpu, rng)
}

/// Two sequences as a single block of a full step lays them out: queries, keys and
/// values in columns of one buffer over the same consecutive rows, which a library
/// reads where they lie (`crate::sdpa`'s dense route) and our kernels through row
/// references like any other.
fn check_attention_in_place<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    cpu: &CpuBackend,
    rng: &mut Rng,
    tag: &str,
) -> Result<()> {
    let (heads, hd) = (2, 64);
    let w = heads * hd;
    // [k | v | q | mlp], as the single blocks' fused projection.
    let t = rng.tensor(&[77, 4 * w], 1.5);
    fn both<'a, T>(w: usize) -> Vec<AttnSeq<'a, T>> {
        let seq = |rows: Range<usize>| AttnSeq {
            q: vec![QSpan {
                buf: 0,
                rows: rows.clone(),
            }],
            kv: vec![KvSource {
                src: Src::Own(0),
                k_col: 0,
                v_col: w,
                rows: Rows::Range(rows),
            }],
        };
        vec![seq(0..40), seq(40..77)]
    }
    let mut c = t.clone();
    cpu.attention(&mut [&mut c], 2 * w, w, heads, &both(w))?;
    let mut g = gpu.upload(&t)?;
    gpu.attention(&mut [&mut g], 2 * w, w, heads, &both(w))?;
    close(
        out,
        &format!("attention in place {heads}x{hd}{tag}"),
        gpu.dtype(),
        &gpu.download(&g)?,
        &c,
    );
    Ok(())
}

/// A batch of 12 edits of 12 different templates: 13 distinct buffers, more than one
/// launch addresses, so the backend splits the sequences over launches.
fn check_attention_many_caches<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    cpu: &CpuBackend,
    rng: &mut Rng,
) -> Result<()> {
    let (heads, hd, n, rows) = (2, 64, 12, 4);
    let w = heads * hd;
    let t = rng.tensor(&[n * rows, 3 * w], 1.5);
    let caches: Vec<Tensor> = (0..n).map(|i| rng.tensor(&[20 + i, 2 * w], 1.5)).collect();
    let idx: Vec<Vec<u32>> = (0..n)
        .map(|i| (0..(20 + i) as u32).step_by(2).collect())
        .collect();
    fn seqs<'a, T>(
        caches: &'a [T],
        idx: &'a [Vec<u32>],
        rows: usize,
        w: usize,
    ) -> Vec<AttnSeq<'a, T>> {
        caches
            .iter()
            .zip(idx)
            .enumerate()
            .map(|(i, (c, ix))| AttnSeq {
                q: vec![QSpan {
                    buf: 0,
                    rows: i * rows..(i + 1) * rows,
                }],
                kv: vec![
                    KvSource {
                        src: Src::Own(0),
                        k_col: w,
                        v_col: 2 * w,
                        rows: Rows::Range(i * rows..(i + 1) * rows),
                    },
                    KvSource {
                        src: Src::Ext(c),
                        k_col: 0,
                        v_col: w,
                        rows: Rows::Index(ix),
                    },
                ],
            })
            .collect()
    }
    let mut c = t.clone();
    cpu.attention(&mut [&mut c], 0, w, heads, &seqs(&caches, &idx, rows, w))?;
    let mut g = gpu.upload(&t)?;
    let gc = caches
        .iter()
        .map(|c| gpu.upload(c))
        .collect::<Result<Vec<_>>>()?;
    gpu.attention(&mut [&mut g], 0, w, heads, &seqs(&gc, &idx, rows, w))?;
    close(
        out,
        "attention, 12 caches in one call",
        gpu.dtype(),
        &gpu.download(&g)?,
        &c,
    );
    Ok(())
}

fn check_attention<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    cpu: &CpuBackend,
    rng: &mut Rng,
    heads: usize,
    hd: usize,
    tag: &str,
) -> Result<()> {
    let dt = gpu.dtype();
    let w = heads * hd;
    // buffers: [q | k | v] columns
    let t0 = rng.tensor(&[11, 3 * w], 1.5);
    let t1 = rng.tensor(&[83, 3 * w], 1.5);
    let cache = rng.tensor(&[150, 2 * w], 1.5);
    let idx_a: Vec<u32> = (0..150).step_by(3).map(|i| i as u32).collect();
    let idx_b: Vec<u32> = (0..150).rev().step_by(7).map(|i| i as u32).collect();
    fn seqs<'a, T>(cache: &'a T, ia: &'a [u32], ib: &'a [u32], w: usize) -> Vec<AttnSeq<'a, T>> {
        let own = |buf, rows: Range<usize>| KvSource {
            src: Src::Own(buf),
            k_col: w,
            v_col: 2 * w,
            rows: Rows::Range(rows),
        };
        let ext = |idx| KvSource {
            src: Src::Ext(cache),
            k_col: 0,
            v_col: w,
            rows: Rows::Index(idx),
        };
        vec![
            AttnSeq {
                q: vec![
                    QSpan { buf: 0, rows: 0..5 },
                    QSpan {
                        buf: 1,
                        rows: 0..70,
                    },
                ],
                kv: vec![own(0, 0..5), own(1, 0..70), ext(ia)],
            },
            AttnSeq {
                q: vec![
                    QSpan {
                        buf: 0,
                        rows: 5..11,
                    },
                    QSpan {
                        buf: 1,
                        rows: 70..83,
                    },
                ],
                kv: vec![ext(ib), own(1, 70..83), own(0, 5..11)],
            },
        ]
    }
    let (mut c0, mut c1) = (t0.clone(), t1.clone());
    cpu.attention(
        &mut [&mut c0, &mut c1],
        0,
        w,
        heads,
        &seqs(&cache, &idx_a, &idx_b, w),
    )?;
    let (mut g0, mut g1, gc) = (gpu.upload(&t0)?, gpu.upload(&t1)?, gpu.upload(&cache)?);
    gpu.attention(
        &mut [&mut g0, &mut g1],
        0,
        w,
        heads,
        &seqs(&gc, &idx_a, &idx_b, w),
    )?;
    let name = format!("attention {heads}x{hd}{tag}");
    close(
        out,
        &format!("{name}, buffer 0"),
        dt,
        &gpu.download(&g0)?,
        &c0,
    );
    close(
        out,
        &format!("{name}, buffer 1"),
        dt,
        &gpu.download(&g1)?,
        &c1,
    );

    // The same with the cache as an fp8 template slab (E4M3, a scale per head's K and
    // V), which the kernels decode in their tile loads: against the CPU's f32 kernel
    // on the dequantised values.
    let (bytes, scales) = denoised_runtime::fp8::quantize(cache.data(), 2 * w, 2 * heads);
    let c8 = Tensor::new(
        [150, 2 * w],
        denoised_runtime::fp8::dequantize(&bytes, 2 * w, &scales),
    )?;
    let g8 = gpu
        .upload_fp8(150, 2 * w, &bytes, &scales)?
        .ok_or_else(|| Error::Invalid("the device reads no fp8".into()))?;
    let (mut c0, mut c1) = (t0.clone(), t1.clone());
    cpu.attention(
        &mut [&mut c0, &mut c1],
        0,
        w,
        heads,
        &seqs(&c8, &idx_a, &idx_b, w),
    )?;
    let (mut g0, mut g1) = (gpu.upload(&t0)?, gpu.upload(&t1)?);
    gpu.attention(
        &mut [&mut g0, &mut g1],
        0,
        w,
        heads,
        &seqs(&g8, &idx_a, &idx_b, w),
    )?;
    for (b, g, c) in [(0, &g0, &c0), (1, &g1, &c1)] {
        close(
            out,
            &format!("{name}, fp8 cache, buffer {b}"),
            dt,
            &gpu.download(g)?,
            c,
        );
    }
    Ok(())
}
