//! fp8 weights against the CPU's fp8 reference (`CpuBackend::with_fp8_weights`: the
//! weights and each input row rounded to E4M3 under their own scales, then the f32
//! GEMM): the activation kernel byte for byte against the host's quantisation, and
//! the whole linear (kernel + fp8 GEMM, with bias, GELU, a column block of the input
//! and a block of output channels) within the dtype's bound. In f32 mode only the
//! summation order differs (the device multiplies the row scales into the sum, the
//! reference into each operand), so the bound is f32 rounding: a wrong scale, a
//! swapped operand role or a byte off by one code fails by orders of magnitude.

use denoised_runtime::backend::Backend;
use denoised_runtime::fp8::{quantize_rows, quantize_tensor, Scaling};
use denoised_runtime::{CpuBackend, Result, Stored, Tensor};

use super::{close, Check, Rng};
use crate::exec::{Dt, Exec};
use crate::tensor::from_bytes;
use crate::GpuBackend;

/// Rows of very different magnitudes (a factor 2^-3 to 2^3 each), so that every row
/// has its own scale and exchanging the two scale vectors shows.
fn ragged(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Tensor {
    let t = rng.tensor(&[rows, cols], scale);
    let data = t
        .data()
        .chunks_exact(cols)
        .enumerate()
        .flat_map(|(r, row)| {
            let f = 2f32.powi((r * 5 % 7) as i32 - 3);
            row.iter().map(move |v| v * f)
        })
        .collect();
    Tensor::new([rows, cols], data).expect("shape matches")
}

pub(super) fn check_fp8_linear<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    rng: &mut Rng,
) -> Result<()> {
    let dt = gpu.dtype();
    if let Err(why) = gpu.exec().check_fp8(dt) {
        out.push(Check {
            name: format!("fp8 linear ({dt:?})"),
            measured: format!("skipped: {why}"),
            bound: String::new(),
            pass: true,
        });
        return Ok(());
    }
    let scaling = gpu.fp8_scaling();
    let tag = match scaling {
        Scaling::Channel => String::new(),
        Scaling::Tensor => ", per tensor".to_string(),
    };
    let cpu = CpuBackend::new().with_fp8_weights(scaling);
    let (x, w, b) = (
        ragged(rng, 37, 48, 1.0),
        ragged(rng, 24, 32, 0.3),
        rng.tensor(&[24], 0.5),
    );
    let parts = [Stored::from_tensor("w", &w)];
    let (wc, wg) = (
        cpu.upload_weight_fp8(&parts)?,
        gpu.upload_weight_fp8(&parts)?,
    );
    let (xg, bg) = (gpu.upload(&x)?, gpu.upload(&b)?);

    // The activation kernels: bytes and scales equal to the host's quantisation (a
    // scale per row, or one in the first row's place).
    let q = gpu.quantize_input(&xg, 8..40)?;
    let mut all = vec![0u8; q.row_scales_offset() + 4 * 37];
    gpu.exec()
        .download(q.mem(), 0, &mut all)
        .map_err(crate::backend::dev)?;
    let block: Vec<f32> = x
        .data()
        .chunks_exact(48)
        .flat_map(|r| r[8..40].to_vec())
        .collect();
    let got_scales = from_bytes(Dt::F32, &all[q.row_scales_offset()..]);
    let (bytes, scales_equal) = match scaling {
        Scaling::Channel => {
            let (bytes, scales) = quantize_rows(&block, 32);
            (bytes, got_scales == scales)
        }
        Scaling::Tensor => {
            let (bytes, scale) = quantize_tensor(&block);
            (bytes, got_scales[0] == scale)
        }
    };
    let wrong = bytes.iter().zip(&all).filter(|(a, b)| a != b).count();
    out.push(Check::within(
        format!(
            "fp8 activation bytes vs host ({dt:?}){tag}{}",
            if scales_equal { "" } else { ", SCALES DIFFER" }
        ),
        "bytes differing",
        (wrong + usize::from(!scales_equal) * bytes.len()) as f64,
        0.0,
    ));

    let want = cpu.linear_cols(&x, 8..40, &wc, Some(&b))?;
    let got = gpu.linear_cols(&xg, 8..40, &wg, Some(&bg))?;
    close(
        out,
        &format!("fp8 linear_cols+bias{tag}"),
        dt,
        &gpu.download(&got)?,
        &want,
    );

    let x = ragged(rng, 29, 32, 2.0);
    let xg = gpu.upload(&x)?;
    let want = cpu.linear_gelu(&x, &wc, Some(&b), 0)?;
    let got = gpu.linear_gelu(&xg, &wg, Some(&bg), 0)?;
    close(
        out,
        &format!("fp8 linear+bias+gelu_tanh{tag}"),
        dt,
        &gpu.download(&got)?,
        &want,
    );

    // GELU from an output column on: the single block's split GEMM, x quantised once
    // for both parts.
    let want = cpu.linear_gelu(&x, &wc, Some(&b), 7)?;
    let got = gpu.linear_gelu(&xg, &wg, Some(&bg), 7)?;
    close(
        out,
        &format!("fp8 linear+bias, gelu_tanh from column 7{tag}"),
        dt,
        &gpu.download(&got)?,
        &want,
    );

    let want = cpu.linear_out(&x, &wc, Some(&b), 5..19)?;
    let got = gpu.linear_out(&xg, &wg, Some(&bg), 5..19)?;
    close(
        out,
        &format!("fp8 linear_out+bias{tag}"),
        dt,
        &gpu.download(&got)?,
        &want,
    );

    // FLUX.1's inner dimensions, 3072 (most Linears) to 15360 (a single block's output
    // projection): fast accumulation (cuBLASLt's FAST_ACCUM, which on Hopper promotes
    // the tensor cores' partial sums to f32 less often) must hold over the longest
    // sums the model has, not only over the 32 terms above.
    for k in [3072, 15360] {
        let x = ragged(rng, 8, k, 1.0);
        let w = ragged(rng, 16, k, 0.05);
        let parts = [Stored::from_tensor("w", &w)];
        let (wc, wg) = (
            cpu.upload_weight_fp8(&parts)?,
            gpu.upload_weight_fp8(&parts)?,
        );
        let want = cpu.linear(&x, &wc, None)?;
        let got = gpu.linear(&gpu.upload(&x)?, &wg, None)?;
        close(
            out,
            &format!("fp8 linear at K = {k}{tag}"),
            dt,
            &gpu.download(&got)?,
            &want,
        );
    }

    // The weight as the device holds it is the reference's rounded weight.
    let back = gpu.download_weight(&wg)?;
    let same = back.data() == cpu.download_weight(&wc)?.data();
    out.push(Check::within(
        format!("fp8 weight download ({dt:?}){tag}"),
        "values differing",
        if same { 0.0 } else { 1.0 },
        0.0,
    ));
    Ok(())
}
