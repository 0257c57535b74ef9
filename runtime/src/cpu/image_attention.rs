//! The VAE mid-block's attention on NCHW host tensors: single-head self-attention over
//! the pixels of each image, plus the residual.
//!
//! Pixels become rows only here: one GEMM reads the normalised activations through a
//! transposed view into a `[pixels, q|k|v]` buffer, the tiled attention kernel (one
//! head of width C, no mask) runs on it in place, and the output projection writes
//! straight back into NCHW on top of the residual. No transposed copy of the
//! activations is made.

use crate::backend::Rows;
use crate::cpu::attention::{self, Buf, Kv, KvBuf, Seq};
use crate::cpu::matmul::{matmul, MatRef};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `x + out(softmax(q kᵀ / sqrt(C)) v)` with `[q | k | v] = normed @ qkv_t + qkv_b` per
/// pixel, for `x` and `normed` (its GroupNorm) `[B, C, H, W]`.
///
/// `qkv_t` is the fused projection transposed, `[C, 3C]`; `out_w` the output
/// projection as a `[C_out, C_in]` view. Also returns the `[B*H*W, 3C]` buffer: the
/// attention output in the q columns, then every pixel's K and V (what a template
/// trace keeps for the sparse VAE).
pub fn image_attention(
    x: &Tensor,
    normed: &Tensor,
    qkv_t: &[f32],
    qkv_b: &[f32],
    out_w: MatRef<'_>,
    out_b: &[f32],
) -> Result<(Tensor, Vec<f32>)> {
    const OP: &str = "image attention";
    let [b, c, h, w] = match *x.shape() {
        [b, c, h, w] => [b, c, h, w],
        ref s => {
            return Err(Error::shape(
                OP,
                format!("expected [B, C, H, W], got {s:?}"),
            ))
        }
    };
    if normed.shape() != x.shape()
        || qkv_t.len() != 3 * c * c
        || qkv_b.len() != 3 * c
        || out_b.len() != c
    {
        return Err(Error::shape(
            OP,
            format!(
                "x {:?}, normed {:?}, {} projection and {}/{} bias values for {c} channels",
                x.shape(),
                normed.shape(),
                qkv_t.len(),
                qkv_b.len(),
                out_b.len()
            ),
        ));
    }
    let n = h * w;
    // [B*N, 3C]: each row is one pixel's [q | k | v], starting from the bias.
    let mut qkv = Vec::with_capacity(b * n * 3 * c);
    for _ in 0..b * n {
        qkv.extend_from_slice(qkv_b);
    }
    for i in 0..b {
        // GN(x)[i] is [C, N]; read as its transpose [N, C] through strides.
        let xi = &normed.data()[i * c * n..(i + 1) * c * n];
        matmul(
            n,
            3 * c,
            c,
            &mut qkv[i * n * 3 * c..(i + 1) * n * 3 * c],
            3 * c,
            MatRef::transposed(xi, n),
            MatRef::row_major(qkv_t, 3 * c),
            true,
            true,
        );
    }
    let buf = Buf::new(&mut qkv, 3 * c);
    let seqs: Vec<Seq<'_>> = (0..b)
        .map(|i| Seq {
            q: vec![(0, i * n..(i + 1) * n)],
            kv: vec![Kv {
                buf: KvBuf::F32(buf),
                k_col: c,
                v_col: 2 * c,
                rows: Rows::Range(i * n..(i + 1) * n),
            }],
        })
        .collect();
    attention::validate(&[buf], 0, c, 1, &seqs).map_err(|e| Error::shape(OP, e))?;
    // The attention output overwrites the q columns in place.
    attention::attention(&[buf], 0, c, 1, &seqs);

    // out[C, N] = x + b_out + W_out[C, C] @ attnᵀ[C, N], per image.
    let mut out = x.data().to_vec();
    for (i, img) in out.chunks_exact_mut(c * n).enumerate() {
        for (row, bv) in img.chunks_exact_mut(n).zip(out_b) {
            row.iter_mut().for_each(|v| *v += bv);
        }
        let attn = &qkv[i * n * 3 * c..(i + 1) * n * 3 * c];
        matmul(
            c,
            n,
            c,
            img,
            n,
            out_w,
            MatRef {
                data: attn,
                rs: 1,
                cs: 3 * c,
            },
            true,
            true,
        );
    }
    Ok((Tensor::new(x.shape().to_vec(), out)?, qkv))
}
