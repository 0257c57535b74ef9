//! The fused passes of the Flux blocks against the CPU backend's unfused ops, at the
//! tolerances of the other ops (see the parent module): each at a width that takes
//! the kernels' 16-byte runs and at one that is not a multiple of 8 (the scalar
//! fallback).

use denoised_runtime::backend::{Backend, HeadNorm};
use denoised_runtime::{CpuBackend, Result, Tensor};

use super::{close, modl, Check, Rng};
use crate::exec::Exec;
use crate::GpuBackend;

/// Each check's name says the width, so a failure names its path.
pub(super) fn check_fused_ops<E: Exec>(out: &mut Vec<Check>, gpu: &GpuBackend<E>) -> Result<()> {
    let cpu = CpuBackend::new();
    let dt = gpu.dtype();
    let mut rng = Rng(17);
    let up = |t: &Tensor| gpu.upload(t);
    let down = |t: &<GpuBackend<E> as Backend>::Tensor| gpu.download(t);

    for width in [96, 45] {
        // The gated residual, alone and with the LayerNorm + modulation it precedes
        // (adaLN chunks 2, then 3 and 4, as the double block takes them).
        let rows = 9;
        let table = rng.tensor(&[3, 5 * width], 0.5);
        let seg: Vec<u32> = (0..rows).map(|r| (r % 3) as u32).collect();
        let (x, y) = (
            rng.tensor(&[rows, width], 1.0),
            rng.tensor(&[rows, width], 1.0),
        );
        let gt = up(&table)?;
        let (mut xc, mut xg) = (x.clone(), up(&x)?);
        cpu.gated_residual(&mut xc, &y, modl(&table, 1, &seg))?;
        gpu.gated_residual(&mut xg, &up(&y)?, modl(&gt, 1, &seg))?;
        close(
            out,
            &format!("gated_residual w{width}"),
            dt,
            &down(&xg)?,
            &xc,
        );

        let (mut xc, mut xg) = (x.clone(), up(&x)?);
        let want = cpu.residual_layer_norm_modulate(
            &mut xc,
            &y,
            modl(&table, 2, &seg),
            1e-6,
            modl(&table, 3, &seg),
            modl(&table, 4, &seg),
        )?;
        let got = gpu.residual_layer_norm_modulate(
            &mut xg,
            &up(&y)?,
            modl(&gt, 2, &seg),
            1e-6,
            modl(&gt, 3, &seg),
            modl(&gt, 4, &seg),
        )?;
        let what = format!("gated_residual+layer_norm_modulate w{width}");
        close(out, &format!("{what} (x)"), dt, &down(&xg)?, &xc);
        close(out, &format!("{what} (out)"), dt, &down(&got)?, &want);

        let ln_c =
            cpu.layer_norm_modulate(&x, 1e-6, modl(&table, 0, &seg), modl(&table, 1, &seg))?;
        let ln_g =
            gpu.layer_norm_modulate(&up(&x)?, 1e-6, modl(&gt, 0, &seg), modl(&gt, 1, &seg))?;
        close(
            out,
            &format!("layer_norm_modulate w{width}"),
            dt,
            &down(&ln_g)?,
            &ln_c,
        );
    }

    // RMSNorm + RoPE of q and k, each with its own weight, in one launch: heads of
    // 32 (runs of 8) and of 6 (pairs); k before q in the columns, as the single block has them.
    for hd in [32, 6] {
        let rows = 5;
        let (wq, wk) = (rng.tensor(&[hd], 1.0), rng.tensor(&[hd], 1.0));
        let (cos, sin) = (rng.tensor(&[rows, hd], 1.0), rng.tensor(&[rows, hd], 1.0));
        let x = rng.tensor(&[rows, 7 * hd], 3.0);
        let (q, k) = (4 * hd..6 * hd, 0..2 * hd);
        let mut xc = x.clone();
        let heads = [
            HeadNorm {
                cols: q.clone(),
                weight: &wq,
            },
            HeadNorm {
                cols: k.clone(),
                weight: &wk,
            },
        ];
        cpu.rms_norm_rope(&mut xc, &heads, 1e-6, Some((&cos, &sin)))?;
        let mut xg = up(&x)?;
        let (gq, gk, gc, gs) = (up(&wq)?, up(&wk)?, up(&cos)?, up(&sin)?);
        let heads = [
            HeadNorm {
                cols: q,
                weight: &gq,
            },
            HeadNorm {
                cols: k,
                weight: &gk,
            },
        ];
        gpu.rms_norm_rope(&mut xg, &heads, 1e-6, Some((&gc, &gs)))?;
        close(
            out,
            &format!("rms_norm+rope of q and k hd{hd}"),
            dt,
            &down(&xg)?,
            &xc,
        );
    }

    // A projection whose tail is GELU'd: two GEMMs into one output on a device.
    let x = rng.tensor(&[13, 16], 1.0);
    let (w, b) = (rng.tensor(&[28, 16], 0.3), rng.tensor(&[28], 0.5));
    let want = cpu.linear_gelu(&x, &cpu.upload_weight(&w)?, Some(&b), 12)?;
    let got = gpu.linear_gelu(&up(&x)?, &gpu.upload_weight(&w)?, Some(&up(&b)?), 12)?;
    close(
        out,
        "linear+bias, gelu_tanh from column 12",
        dt,
        &down(&got)?,
        &want,
    );

    // GELU over a column range in runs of 8 (the range at 8..40 of 48).
    let x = rng.tensor(&[7, 48], 4.0);
    let (mut xc, mut xg) = (x.clone(), up(&x)?);
    cpu.gelu_tanh(&mut xc, 8..40)?;
    gpu.gelu_tanh(&mut xg, 8..40)?;
    close(out, "gelu_tanh(cols 8..40)", dt, &down(&xg)?, &xc);
    Ok(())
}
