//! GGUF-quantised weights (`crate::quant`) against the CPU: the `dequant_*` kernels
//! value for value against `denoised_runtime::quant::dequantize` (bit-exact in f32
//! mode; its round to nearest even in bf16 mode), and the linears on a quantised
//! weight (dequantised rows + GEMM, with bias, a column block, a block of outputs,
//! GELU from a column) within the dtype's bound against the CPU's tile-dequantising
//! linears; the resident bytes are the blocks'. And a checkpoint's own fp8 E4M3
//! parts with per-tensor scales as fp8 weights (used as they are, no re-rounding)
//! against the CPU's fp8 reference.

use denoised_runtime::backend::Backend;
use denoised_runtime::quant::{dequantize_vec, random_blocks};
use denoised_runtime::{CpuBackend, DType, QuantType, Result, Stored};

use super::{close, Check, Rng};
use crate::exec::{Dt, Exec};
use crate::GpuBackend;

/// The value a `dt` store of `v` keeps.
fn stored(dt: Dt, v: f32) -> f32 {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => half::bf16::from_f32(v).to_f32(),
    }
}

pub(super) fn check_quant_linear<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    rng: &mut Rng,
    how: &str,
) -> Result<()> {
    let dt = gpu.dtype();
    let cpu = CpuBackend::new();
    for (i, ty) in QuantType::ALL.into_iter().enumerate() {
        // Two parts (a fused projection), 40 outputs, in 512: K-quants have two
        // super-blocks per row.
        let (o1, o2, k) = (24, 16, 512);
        let (b1, b2) = (
            random_blocks(ty, o1 * k, 31 + i as u64),
            random_blocks(ty, o2 * k, 57 + i as u64),
        );
        let parts = [
            Stored::quantised("a", vec![o1, k], ty, &b1)?,
            Stored::quantised("b", vec![o2, k], ty, &b2)?,
        ];
        let (wc, wg) = (
            cpu.upload_weight_stored(&parts)?,
            gpu.upload_weight_stored(&parts)?,
        );
        let bytes = (b1.len() + b2.len()) as u64;
        out.push(Check::within(
            format!("{ty} weight resident bytes over its blocks' ({dt:?}){how}"),
            "extra bytes",
            gpu.weight_bytes(&wg).abs_diff(bytes) as f64,
            0.0,
        ));

        // The kernel, rows 3..37 (an offset into the blocks), value for value.
        let dense = gpu.download(&gpu.dequantize_rows(&wg, 3..37)?)?;
        let all: Vec<f32> = [dequantize_vec(ty, &b1), dequantize_vec(ty, &b2)].concat();
        let want: Vec<f32> = all[3 * k..37 * k].iter().map(|&v| stored(dt, v)).collect();
        let wrong = dense
            .data()
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
            + want.len().abs_diff(dense.len());
        out.push(Check::within(
            format!(
                "dequant_{} kernel vs host, bits ({dt:?}){how}",
                ty.name().to_lowercase()
            ),
            "values differing",
            wrong as f64,
            0.0,
        ));

        let (x, b) = (rng.tensor(&[19, 530], 1.0), rng.tensor(&[o1 + o2], 0.5));
        let (xg, bg) = (gpu.upload(&x)?, gpu.upload(&b)?);
        let want = cpu.linear_cols(&x, 9..9 + k, &wc, Some(&b))?;
        let got = gpu.linear_cols(&xg, 9..9 + k, &wg, Some(&bg))?;
        close(
            out,
            &format!("{ty} linear_cols+bias{how}"),
            dt,
            &gpu.download(&got)?,
            &want,
        );

        let x = rng.tensor(&[13, k], 1.0);
        let xg = gpu.upload(&x)?;
        let want = cpu.linear_out(&x, &wc, Some(&b), 5..33)?;
        let got = gpu.linear_out(&xg, &wg, Some(&bg), 5..33)?;
        close(
            out,
            &format!("{ty} linear_out+bias{how}"),
            dt,
            &gpu.download(&got)?,
            &want,
        );
        let want = cpu.linear_gelu(&x, &wc, Some(&b), 11)?;
        let got = gpu.linear_gelu(&xg, &wg, Some(&bg), 11)?;
        close(
            out,
            &format!("{ty} linear+bias, gelu_tanh from column 11{how}"),
            dt,
            &gpu.download(&got)?,
            &want,
        );
        let same = gpu.download_weight(&wg)?.data() == all.as_slice();
        out.push(Check::within(
            format!("{ty} weight download ({dt:?}){how}"),
            "values differing",
            if same { 0.0 } else { 1.0 },
            0.0,
        ));
    }
    Ok(())
}

/// A checkpoint's fp8 parts (E4M3 bytes, a scale per tensor) as an fp8 weight.
pub(super) fn check_stored_fp8_weight<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    rng: &mut Rng,
) -> Result<()> {
    let dt = gpu.dtype();
    if gpu.exec().check_fp8(dt).is_err() {
        return Ok(());
    }
    let cpu = CpuBackend::new().with_fp8_weights(gpu.fp8_scaling());
    // Every finite E4M3 code but the largest few, in two parts of different scales.
    let code = |i: usize| ((i * 37) % 0x7c) as u8 | if i % 3 == 0 { 0x80 } else { 0 };
    let (a, b): (Vec<u8>, Vec<u8>) = (
        (0..20 * 64).map(code).collect(),
        (20 * 64..36 * 64).map(code).collect(),
    );
    let parts = [
        Stored::new("a", vec![20, 64], DType::F8E4M3, &a)?.with_scale(0.013)?,
        Stored::new("b", vec![16, 64], DType::F8E4M3, &b)?.with_scale(0.0021)?,
    ];
    let (wc, wg) = (
        cpu.upload_weight_fp8(&parts)?,
        gpu.upload_weight_fp8(&parts)?,
    );
    let want_w: Vec<f32> = [
        parts[0].to_f32()?.into_data(),
        parts[1].to_f32()?.into_data(),
    ]
    .concat();
    let same = gpu.download_weight(&wg)?.data() == want_w.as_slice()
        && cpu.download_weight(&wc)?.data() == want_w.as_slice();
    out.push(Check::within(
        format!("stored fp8 weight kept as stored ({dt:?})"),
        "values differing",
        if same { 0.0 } else { 1.0 },
        0.0,
    ));
    let (x, bias) = (rng.tensor(&[11, 64], 1.0), rng.tensor(&[36], 0.5));
    let want = cpu.linear(&x, &wc, Some(&bias))?;
    let got = gpu.linear(&gpu.upload(&x)?, &wg, Some(&gpu.upload(&bias)?))?;
    close(
        out,
        "stored fp8 linear+bias",
        dt,
        &gpu.download(&got)?,
        &want,
    );
    Ok(())
}
