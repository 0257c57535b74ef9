//! The text-encoder ops (T5's and CLIP's) against the CPU backend, at the tolerances
//! of the other ops (see the parent module).

use denoised_runtime::backend::Backend;
use denoised_runtime::{CpuBackend, Result, Tensor, TextMask};

use super::{close, Check, Rng};
use crate::exec::Exec;
use crate::GpuBackend;

/// Row norms on offset data, both GELUs, and the attention with a causal mask and
/// with an additive bias, over sequences of 21 to 45 tokens, head dims 16, 64 and 144.
pub(super) fn check_text_ops<E: Exec>(out: &mut Vec<Check>, gpu: &GpuBackend<E>) -> Result<()> {
    let cpu = CpuBackend::new();
    let dt = gpu.dtype();
    let mut rng = Rng(13);
    let down = |t: &<GpuBackend<E> as Backend>::Tensor| gpu.download(t);

    let x = rng.tensor(&[37, 96], 1.0);
    // An offset mean, so a one-pass variance would lose digits.
    let x = Tensor::new(
        x.shape().to_vec(),
        x.data().iter().map(|v| v + 2.0).collect(),
    )?;
    let (w, b) = (rng.tensor(&[96], 1.0), rng.tensor(&[96], 0.5));
    let gx = gpu.upload(&x)?;
    let (gw, gb) = (gpu.upload(&w)?, gpu.upload(&b)?);
    let want = cpu.layer_norm_affine(&x, &w, &b, 1e-5)?;
    close(
        out,
        "layer_norm_affine",
        dt,
        &down(&gpu.layer_norm_affine(&gx, &gw, &gb, 1e-5)?)?,
        &want,
    );
    let want = cpu.rms_norm(&x, &w, 1e-6)?;
    close(
        out,
        "rms_norm",
        dt,
        &down(&gpu.rms_norm(&gx, &gw, 1e-6)?)?,
        &want,
    );

    let g = rng.tensor(&[37, 2 * 40], 2.0);
    let want = cpu.gated_gelu(&g)?;
    close(
        out,
        "gated_gelu",
        dt,
        &down(&gpu.gated_gelu(&gpu.upload(&g)?)?)?,
        &want,
    );
    let mut want = g.clone();
    cpu.quick_gelu(&mut want)?;
    let mut got = gpu.upload(&g)?;
    gpu.quick_gelu(&mut got)?;
    close(out, "quick_gelu", dt, &down(&got)?, &want);

    // One launch per layer (`text_attn_*`) up to head dim 128, with CLIP's and T5's
    // head dim (64) among them; above, the per-head GEMM form.
    for (len, heads, hd) in [(37, 3, 16), (45, 2, 64), (21, 1, 144)] {
        let qkv = rng.tensor(&[len, 3 * heads * hd], 1.0);
        let bias = rng.tensor(&[heads * len, len], 2.0);
        let gq = gpu.upload(&qkv)?;
        let geometry = format!("{heads}x{hd}, {len} tokens");
        let want = cpu.text_attention(&qkv, heads, hd, 0.25, TextMask::Causal)?;
        let got = gpu.text_attention(&gq, heads, hd, 0.25, TextMask::Causal)?;
        close(
            out,
            &format!("text attention, causal (CLIP), {geometry}"),
            dt,
            &down(&got)?,
            &want,
        );
        let want = cpu.text_attention(&qkv, heads, hd, 1.0, TextMask::Bias(&bias))?;
        let gb = gpu.upload(&bias)?;
        let got = gpu.text_attention(&gq, heads, hd, 1.0, TextMask::Bias(&gb))?;
        close(
            out,
            &format!("text attention, position bias (T5), {geometry}"),
            dt,
            &down(&got)?,
            &want,
        );
    }
    Ok(())
}
