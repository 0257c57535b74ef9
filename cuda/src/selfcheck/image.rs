//! The image ops (the VAE's: `kernels/image.cu` and its GEMMs) against the CPU
//! backend, at the tolerances of the other ops (see the parent module).

use denoised_runtime::backend::Backend;
use denoised_runtime::{Conv2dOpts, CpuBackend, Result, Tensor};

use super::{close, Check, Rng};
use crate::exec::Exec;
use crate::GpuBackend;

/// Every convolution geometry of the FLUX VAE, GroupNorm with and without SiLU, and
/// the mid-block attention, on small odd-sized images of two per batch (shapes that
/// leave partial tiles and blocks everywhere). `tag` is appended to each check's name.
pub(super) fn check_image_ops<E: Exec>(
    out: &mut Vec<Check>,
    gpu: &GpuBackend<E>,
    tag: &str,
) -> Result<()> {
    let first = out.len();
    image_ops(out, gpu)?;
    for c in &mut out[first..] {
        c.name.push_str(tag);
    }
    Ok(())
}

fn image_ops<E: Exec>(out: &mut Vec<Check>, gpu: &GpuBackend<E>) -> Result<()> {
    let cpu = CpuBackend::new();
    let dt = gpu.dtype();
    let mut rng = Rng(11);
    let x = rng.tensor(&[2, 12, 9, 7], 1.0);
    let gx = gpu.upload_image(&x)?;
    // The layout change alone must be exact.
    close(
        out,
        "image upload/download",
        dt,
        &gpu.download_image(&gx)?,
        &x,
    );

    let geometries: [(&str, usize, Conv2dOpts); 5] = [
        ("conv 3x3 stride 1", 3, Conv2dOpts::same(3)),
        (
            "conv 3x3 stride 2, pad (0,1,0,1)",
            3,
            Conv2dOpts {
                stride: 2,
                pad: [0, 1, 0, 1],
                upsample2x: false,
            },
        ),
        (
            "conv 3x3 on nearest 2x upsample",
            3,
            Conv2dOpts {
                stride: 1,
                pad: [1; 4],
                upsample2x: true,
            },
        ),
        ("conv 1x1", 1, Conv2dOpts::same(1)),
        // Not a FLUX shape: a stride the library path is given.
        (
            "conv 3x3 stride 2, pad 1",
            3,
            Conv2dOpts {
                stride: 2,
                pad: [1; 4],
                upsample2x: false,
            },
        ),
    ];
    let library = gpu.conv_library && gpu.exec().conv_library().is_some();
    for (name, k, opts) in geometries {
        let [pt, pb, pl, pr] = opts.pad;
        let path = if library && pt == pb && pl == pr && !opts.upsample2x {
            "library"
        } else {
            "im2col"
        };
        let name = &format!("{name} [{path}]");
        let w = rng.tensor(&[10, 12, k, k], 0.3);
        let b = rng.tensor(&[10], 0.5);
        let want = cpu.conv2d(&x, &w, &b, opts, None)?;
        let (gw, gb) = (gpu.upload_conv(&w)?, gpu.upload(&b)?);
        let got = gpu.conv2d(&gx, &gw, &gb, opts, None)?;
        close(out, name, dt, &gpu.download_image(&got)?, &want);
        // The residual add, on the same geometry.
        let r = rng.tensor(want.shape(), 1.0);
        let want = cpu.conv2d(&x, &w, &b, opts, Some(&r))?;
        let got = gpu.conv2d(&gx, &gw, &gb, opts, Some(&gpu.upload_image(&r)?))?;
        close(
            out,
            &format!("{name} + residual"),
            dt,
            &gpu.download_image(&got)?,
            &want,
        );
    }

    let (gw, gb) = (rng.tensor(&[12], 1.0), rng.tensor(&[12], 0.5));
    // An offset mean, so a one-pass variance would lose digits.
    let shifted = Tensor::new(
        x.shape().to_vec(),
        x.data().iter().map(|v| v + 3.0).collect(),
    )?;
    // A larger image as well, whose groups the statistics kernel splits over blocks.
    let large = rng.tensor(&[2, 12, 100, 70], 1.0);
    for (what, img) in [("", &shifted), (", 2 splits per group", &large)] {
        let gs = gpu.upload_image(img)?;
        for silu in [false, true] {
            let want = cpu.group_norm(img, 4, &gw, &gb, 1e-6, silu)?;
            let got = gpu.group_norm(&gs, 4, &gpu.upload(&gw)?, &gpu.upload(&gb)?, 1e-6, silu)?;
            let name = format!("group_norm{}{what}", if silu { " + silu" } else { "" });
            close(out, &name, dt, &gpu.download_image(&got)?, &want);
        }
    }

    let c = 12;
    let normed = cpu.group_norm(&x, 4, &gw, &gb, 1e-6, false)?;
    let qkv = rng.tensor(&[3 * c, c], 0.3);
    let qkv_b = rng.tensor(&[3 * c], 0.2);
    let ow = rng.tensor(&[c, c], 0.3);
    let ob = rng.tensor(&[c], 0.2);
    let want = cpu.image_attention(
        &x,
        &normed,
        &cpu.upload_weight(&qkv)?,
        &qkv_b,
        &cpu.upload_weight(&ow)?,
        &ob,
    )?;
    let got = gpu.image_attention(
        &gx,
        &gpu.upload_image(&normed)?,
        &gpu.upload_weight(&qkv)?,
        &gpu.upload(&qkv_b)?,
        &gpu.upload_weight(&ow)?,
        &gpu.upload(&ob)?,
    )?;
    close(
        out,
        "image attention (1 head of 12, 63 pixels)",
        dt,
        &gpu.download_image(&got)?,
        &want,
    );
    Ok(())
}
