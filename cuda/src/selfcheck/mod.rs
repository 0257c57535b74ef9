//! Every GPU-backend op against the CPU backend (the numerical reference), as a list
//! of [`Check`]s: run by the crate's tests on the emulator and on `cuda:0`, and by
//! `denoised selftest` on whatever device an operator points it at.
//!
//! On the emulator the real kernel sources run on CPU threads, so this checks
//! indexing, tiling, online softmax, fragment layouts and descriptors on machines
//! without a GPU (CI).
//!
//! Tolerances, relative to the largest reference magnitude of each output:
//! f32 mode 1e-5 (summation order only); bf16 mode 1.6e-2 (inputs are pre-rounded to
//! bf16 for both sides, so what remains is bf16 rounding of outputs and intermediates:
//! 2^-8 = 3.9e-3 per rounding, a few roundings deep).

mod attention;
mod fp8;
mod fused;
mod image;
mod quant;
mod text;

use denoised_runtime::backend::{Backend, HeadNorm, Modulation};
use denoised_runtime::{CpuBackend, Result, Tensor};

use crate::backend::dev;
use crate::exec::{Dt, Exec, Grid};
use crate::params::TimestepParams;
use crate::GpuBackend;

/// One line of a self-check report: what was compared, the figure measured, and the
/// bound it must stay within.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    pub measured: String,
    pub bound: String,
    pub pass: bool,
}

impl Check {
    /// `value <= bound`, both shown in the report (NaN fails).
    pub fn within(name: String, what: &str, value: f64, bound: f64) -> Check {
        Check {
            name,
            measured: format!("{what} {}", figure(value)),
            bound: format!("<= {}", figure(bound)),
            pass: value <= bound,
        }
    }
    /// A comparison that could not be made (wrong shape, non-finite output, an error).
    pub fn fail(name: String, why: String) -> Check {
        Check {
            name,
            measured: why,
            bound: String::new(),
            pass: false,
        }
    }
}

/// Counts as integers, everything else in scientific notation.
fn figure(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{v:.0}")
    } else {
        format!("{v:.2e}")
    }
}

impl std::fmt::Display for Check {
    /// One aligned report line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = if self.pass { "ok" } else { "FAIL" };
        write!(
            f,
            "{:<58} {:<40} {:<10} {verdict}",
            self.name, self.measured, self.bound
        )
    }
}

/// Prints every check and panics naming the failed ones: how tests consume a report.
pub fn assert_all_pass(checks: &[Check]) {
    for c in checks {
        println!("  {c}");
    }
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.name.as_str())
        .collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// Every kernel on `gpu`'s executor in both dtypes against the CPU backend. `make`
/// opens the executor (one backend per dtype). A group of checks that stops on an
/// error is reported as a failed check of its own and the others still run.
pub fn kernels<E: Exec>(make: impl Fn() -> Result<E>) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let exec = make()?;
    group(&mut out, "timestep embedding", |o| check_timestep(o, &exec));
    group(&mut out, "fused LayerNorm", |o| {
        check_fused_ln_and_convert(o, &exec)
    });
    for dt in [Dt::F32, Dt::Bf16] {
        let gpu = GpuBackend::new(make()?, dt);
        group(&mut out, &format!("ops ({dt:?})"), |o| check_ops(o, &gpu));
        group(&mut out, &format!("fused ops ({dt:?})"), |o| {
            fused::check_fused_ops(o, &gpu)
        });
        // Convolutions on the executor's library where it has one (cuDNN), ...
        group(&mut out, &format!("image ops ({dt:?})"), |o| {
            image::check_image_ops(o, &gpu, "")
        });
        group(&mut out, &format!("text ops ({dt:?})"), |o| {
            text::check_text_ops(o, &gpu)
        });
        // fp8 weights and inputs with one scale each, which cuBLASLt applies inside the
        // GEMM (the other fp8 checks run per channel, in `check_ops`).
        let per_tensor = GpuBackend::new(make()?, dt)
            .with_fp8_weights(Some(denoised_runtime::fp8::Scaling::Tensor));
        group(&mut out, &format!("fp8 linear, per tensor ({dt:?})"), |o| {
            fp8::check_fp8_linear(o, &per_tensor, &mut Rng(9))
        });
        // Quantised weights expanded 16 output rows at a time: several tiles per GEMM,
        // the last one partial.
        let tiled = GpuBackend::new(make()?, dt).with_quant_tile_rows(16);
        group(
            &mut out,
            &format!("quantised linear, tiles ({dt:?})"),
            |o| quant::check_quant_linear(o, &tiled, &mut Rng(5), ", tiles of 16"),
        );
        // ... and on im2col + GEMM in chunks of a few rows: the patch-matrix and
        // score loops run many times.
        let small = GpuBackend::new(make()?, dt)
            .with_image_workspace(2048)
            .im2col_only();
        group(&mut out, &format!("image ops, chunked ({dt:?})"), |o| {
            image::check_image_ops(o, &small, ", chunked")
        });
    }
    Ok(out)
}

/// Runs one group of checks; an error it stops on becomes a failed check named after
/// the group (the first GPU run lost every kernel check to one cuBLASLt error).
fn group(out: &mut Vec<Check>, name: &str, run: impl FnOnce(&mut Vec<Check>) -> Result<()>) {
    if let Err(e) = run(out) {
        out.push(Check::fail(format!("{name}: stopped"), e.to_string()));
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Values already representable in bf16, so both backends see the same inputs.
    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n = shape.iter().product();
        let data = (0..n)
            .map(|_| half::bf16::from_f32(self.next() * scale).to_f32())
            .collect();
        Tensor::new(shape.to_vec(), data).expect("shape matches")
    }
}

fn tol(dt: Dt) -> f32 {
    match dt {
        Dt::F32 => 1e-5,
        Dt::Bf16 => 1.6e-2,
    }
}

fn close(out: &mut Vec<Check>, what: &str, dt: Dt, got: &Tensor, want: &Tensor) {
    let name = format!("{what} ({dt:?})");
    if got.shape() != want.shape() {
        out.push(Check::fail(
            name,
            format!("shape {:?}, want {:?}", got.shape(), want.shape()),
        ));
        return;
    }
    let scale = want
        .data()
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-6);
    let mut worst = (0f32, 0usize);
    for (i, (g, w)) in got.data().iter().zip(want.data()).enumerate() {
        let d = (g - w).abs();
        if !d.is_finite() {
            out.push(Check::fail(
                name,
                format!("non-finite at {i} (got {g}, want {w})"),
            ));
            return;
        }
        if d > worst.0 {
            worst = (d, i);
        }
    }
    out.push(Check::within(
        name,
        "max rel diff",
        (worst.0 / scale) as f64,
        tol(dt) as f64,
    ));
}

fn modl<'a, T>(table: &'a T, chunk: usize, seg: &'a [u32]) -> Modulation<'a, T> {
    Modulation { table, chunk, seg }
}

/// Runs every op on `gpu` and on the CPU backend with the same inputs.
fn check_ops<E: Exec>(out: &mut Vec<Check>, gpu: &GpuBackend<E>) -> Result<()> {
    let cpu = CpuBackend::new();
    let dt = gpu.dtype();
    let mut rng = Rng(7);
    let up = |t: &Tensor| gpu.upload(t);
    let down = |t: &<GpuBackend<E> as Backend>::Tensor| gpu.download(t);

    // linear over a column block, with bias
    let x = rng.tensor(&[37, 40], 1.0);
    let w = rng.tensor(&[24, 16], 0.3);
    let b = rng.tensor(&[24], 0.5);
    let want = cpu.linear_cols(&x, 8..24, &cpu.upload_weight(&w)?, Some(&b))?;
    let got = gpu.linear_cols(&up(&x)?, 8..24, &gpu.upload_weight(&w)?, Some(&up(&b)?))?;
    close(out, "linear_cols+bias", dt, &down(&got)?, &want);

    // linear + GELU (the fused epilogue on a GPU; it must be the tanh approximation)
    let x = rng.tensor(&[29, 16], 1.0);
    let want = cpu.linear_gelu(&x, &cpu.upload_weight(&w)?, Some(&b), 0)?;
    let got = gpu.linear_gelu(&up(&x)?, &gpu.upload_weight(&w)?, Some(&up(&b)?), 0)?;
    close(out, "linear+bias+gelu_tanh", dt, &down(&got)?, &want);

    // linear over a block of output features (Y-mode K/V recompute), with bias
    let want = cpu.linear_out(&x, &cpu.upload_weight(&w)?, Some(&b), 3..11)?;
    let got = gpu.linear_out(&up(&x)?, &gpu.upload_weight(&w)?, Some(&up(&b)?), 3..11)?;
    close(out, "linear_out+bias", dt, &down(&got)?, &want);

    group(out, &format!("fp8 linear ({dt:?})"), |o| {
        fp8::check_fp8_linear(o, gpu, &mut rng)
    });
    group(out, &format!("quantised linear ({dt:?})"), |o| {
        quant::check_quant_linear(o, gpu, &mut rng, "")
    });
    group(out, &format!("stored fp8 weight ({dt:?})"), |o| {
        quant::check_stored_fp8_weight(o, gpu, &mut rng)
    });

    // LayerNorm + modulation per segment
    let x = rng.tensor(&[9, 96], 2.0);
    let table = rng.tensor(&[3, 3 * 96], 0.5);
    let seg: Vec<u32> = (0..9).map(|r| (r % 3) as u32).collect();
    let want = cpu.layer_norm_modulate(&x, 1e-6, modl(&table, 0, &seg), modl(&table, 2, &seg))?;
    let gt = up(&table)?;
    let got = gpu.layer_norm_modulate(&up(&x)?, 1e-6, modl(&gt, 0, &seg), modl(&gt, 2, &seg))?;
    close(out, "layer_norm_modulate", dt, &down(&got)?, &want);

    // gated residual
    let mut xc = rng.tensor(&[9, 96], 1.0);
    let y = rng.tensor(&[9, 96], 1.0);
    let mut xg = up(&xc)?;
    cpu.gated_residual(&mut xc, &y, modl(&table, 1, &seg))?;
    gpu.gated_residual(&mut xg, &up(&y)?, modl(&gt, 1, &seg))?;
    close(out, "gated_residual", dt, &down(&xg)?, &xc);

    // RMSNorm (+ RoPE) over a column block of heads
    let wt = rng.tensor(&[32], 1.0);
    let cos = rng.tensor(&[6, 32], 1.0);
    let sin = rng.tensor(&[6, 32], 1.0);
    for rope in [false, true] {
        let mut xc = rng.tensor(&[6, 160], 3.0);
        let mut xg = up(&xc)?;
        let (gc, gs) = (up(&cos)?, up(&sin)?);
        let cpu_heads = [HeadNorm {
            cols: 32..128,
            weight: &wt,
        }];
        cpu.rms_norm_rope(&mut xc, &cpu_heads, 1e-6, rope.then_some((&cos, &sin)))?;
        let gw = up(&wt)?;
        let gpu_heads = [HeadNorm {
            cols: 32..128,
            weight: &gw,
        }];
        gpu.rms_norm_rope(&mut xg, &gpu_heads, 1e-6, rope.then_some((&gc, &gs)))?;
        close(
            out,
            if rope { "rms_norm+rope" } else { "rms_norm" },
            dt,
            &down(&xg)?,
            &xc,
        );
    }

    // elementwise
    let mut xc = rng.tensor(&[7, 50], 4.0);
    let mut xg = up(&xc)?;
    cpu.gelu_tanh(&mut xc, 10..45)?;
    gpu.gelu_tanh(&mut xg, 10..45)?;
    close(out, "gelu_tanh(cols)", dt, &down(&xg)?, &xc);
    let want = cpu.silu(&xc)?;
    close(out, "silu", dt, &down(&gpu.silu(&up(&xc)?)?)?, &want);
    let y = rng.tensor(&[7, 50], 1.0);
    let mut xg = up(&xc)?;
    cpu.add(&mut xc, &y)?;
    gpu.add(&mut xg, &up(&y)?)?;
    close(out, "add", dt, &down(&xg)?, &xc);

    // gathers
    let a = rng.tensor(&[5, 12], 1.0);
    let b2 = rng.tensor(&[4, 12], 1.0);
    let index = [(1, 3), (0, 0), (0, 4), (1, 0), (1, 3)];
    let want = cpu.gather_rows(&[&a, &b2], &index)?;
    let got = gpu.gather_rows(&[&up(&a)?, &up(&b2)?], &index)?;
    close(out, "gather_rows", dt, &down(&got)?, &want);
    let want = cpu.gather_cols(&a, 1..4, 3..11)?;
    close(
        out,
        "gather_cols",
        dt,
        &down(&gpu.gather_cols(&up(&a)?, 1..4, 3..11)?)?,
        &want,
    );
    // A batch's packing gathers one source per request: more than the launch
    // parameters hold, so they go through a table on the device.
    let many: Vec<Tensor> = (0..11).map(|i| rng.tensor(&[3 + i % 3, 12], 1.0)).collect();
    let index: Vec<(u32, u32)> = (0..11u32)
        .rev()
        .flat_map(|s| (0..3u32).map(move |r| (s, (r * 7 + s) % 3)))
        .collect();
    let want = cpu.gather_rows(&many.iter().collect::<Vec<_>>(), &index)?;
    let many_gpu = many.iter().map(up).collect::<Result<Vec<_>>>()?;
    let got = gpu.gather_rows(&many_gpu.iter().collect::<Vec<_>>(), &index)?;
    close(out, "gather_rows, 11 sources", dt, &down(&got)?, &want);

    // The Euler update: a column block of x += dt * a row window of the velocity.
    let mut xc = rng.tensor(&[6, 40], 2.0);
    let v = rng.tensor(&[10, 16], 1.0);
    let mut xg = up(&xc)?;
    cpu.axpy_cols(&mut xc, 0..16, &v, 3..9, -0.137)?;
    gpu.axpy_cols(&mut xg, 0..16, &up(&v)?, 3..9, -0.137)?;
    close(out, "axpy_cols", dt, &down(&xg)?, &xc);

    // Stores into host memory (asynchronous on a GPU), in the device's dtype and
    // converted to f32, then flushed.
    let host = denoised_runtime::HostSlice::zeroed(6 * 40 * (4 + dt.size()))?;
    gpu.pin_host(host.memory())?;
    let (own, f32s) = (
        host.sub(0, 6 * 40 * dt.size())?,
        host.sub(6 * 40 * dt.size(), 6 * 40 * 4)?,
    );
    gpu.store(&xg, &own, gpu.storage_dtype())?;
    gpu.store(&xg, &f32s, denoised_runtime::DType::F32)?;
    gpu.flush_stores()?;
    let back = |s: &denoised_runtime::HostSlice, d| {
        denoised_runtime::Stored::new("stored", vec![6, 40], d, s.bytes())?.to_f32()
    };
    let want = down(&xg)?;
    close(
        out,
        "store (device dtype)",
        dt,
        &back(&own, gpu.storage_dtype())?,
        &want,
    );
    close(
        out,
        "store (to f32)",
        dt,
        &back(&f32s, denoised_runtime::DType::F32)?,
        &want,
    );

    // An fp8 store (a compressed template's slab): quantised on the device, equal to
    // the host's quantisation of the same values byte for byte, scales included.
    let x8 = rng.tensor(&[37, 64], 3.0);
    let x8g = up(&x8)?;
    let slab = denoised_runtime::HostSlice::zeroed(37 * 64 + 4 * 8)?;
    gpu.pin_host(slab.memory())?;
    gpu.store_fp8(&x8g, &slab, 8)?;
    gpu.flush_stores()?;
    let (bytes, scales) = denoised_runtime::fp8::quantize(down(&x8g)?.data(), 64, 8);
    let mut want = bytes;
    want.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
    let differ = slab
        .bytes()
        .iter()
        .zip(&want)
        .filter(|(a, b)| a != b)
        .count();
    out.push(Check::within(
        format!("store fp8 ({dt:?})"),
        "bytes differing from the host's",
        differ as f64,
        0.0,
    ));

    attention::check_attention_ops(out, gpu, &cpu, &mut rng)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}
fn mem_with<E: Exec>(exec: &E, bytes: &[u8]) -> Result<E::Mem> {
    let m = exec.alloc(bytes.len()).map_err(dev)?;
    exec.upload(&m, 0, bytes).map_err(dev)?;
    Ok(m)
}
fn read_f32<E: Exec>(exec: &E, m: &E::Mem, n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0u8; 4 * n];
    exec.download(m, 0, &mut out).map_err(dev)?;
    Ok(out
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

/// Kernel features the Backend does not use yet, launched directly: LayerNorm +
/// modulation with fused row gather and scatter (f32), and the dtype conversions.
fn check_fused_ln_and_convert<E: Exec>(out: &mut Vec<Check>, exec: &E) -> Result<()> {
    use crate::params::{EwParams, LnModParams};
    let cpu = CpuBackend::new();
    let mut rng = Rng(11);
    let (rows_in, rows, width) = (10usize, 6usize, 40usize);
    let x = rng.tensor(&[rows_in, width], 2.0);
    let table = rng.tensor(&[2, 2 * width], 0.5);
    let seg: Vec<u32> = vec![0, 1, 1, 0, 1, 0];
    let in_index: Vec<u32> = vec![9, 0, 4, 4, 7, 2];
    let out_index: Vec<u32> = vec![5, 3, 0, 7, 1, 2];
    // Reference: gather, LN-modulate on the CPU backend, scatter.
    let gathered = cpu.gather_rows(&[&x], &in_index.iter().map(|&r| (0, r)).collect::<Vec<_>>())?;
    let ln = cpu.layer_norm_modulate(
        &gathered,
        1e-6,
        modl(&table, 0, &seg),
        modl(&table, 1, &seg),
    )?;
    let mut want = vec![7.0f32; 8 * width]; // rows nobody writes keep their value
    for (r, &o) in out_index.iter().enumerate() {
        want[o as usize * width..(o as usize + 1) * width].copy_from_slice(ln.row(r));
    }
    let u32_bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let (mx, mt) = (
        mem_with(exec, &f32_bytes(x.data()))?,
        mem_with(exec, &f32_bytes(table.data()))?,
    );
    let mo = mem_with(exec, &f32_bytes(&vec![7.0f32; 8 * width]))?;
    let (ms, mi, mj) = (
        mem_with(exec, &u32_bytes(&seg))?,
        mem_with(exec, &u32_bytes(&in_index))?,
        mem_with(exec, &u32_bytes(&out_index))?,
    );
    let p = LnModParams {
        x: exec.addr(&mx),
        out: exec.addr(&mo),
        shift: exec.addr(&mt),
        scale: exec.addr(&mt) + 4 * width as u64,
        seg: exec.addr(&ms),
        in_index: exec.addr(&mi),
        out_index: exec.addr(&mj),
        rows: rows as i32,
        width: width as i32,
        table_cols: 2 * width as i32,
        eps: 1e-6,
        ..Default::default()
    };
    exec.launch("ln_modulate_f32", Grid::linear(rows * 32, 128), &p)
        .map_err(dev)?;
    let got = Tensor::new([8, width], read_f32(exec, &mo, 8 * width)?)?;
    close(
        out,
        "ln_modulate gather+scatter",
        Dt::F32,
        &got,
        &Tensor::new([8, width], want)?,
    );

    // f32 -> bf16 -> f32 against the half crate (round to nearest even); 1003 values,
    // so the kernels' runs of 8 and their scalar tail both run.
    let v: Vec<f32> = (0..1003)
        .map(|i| (i as f32 - 500.0) * 0.37e-3 * (1.0 + i as f32))
        .collect();
    let (ma, mb, mc) = (
        mem_with(exec, &f32_bytes(&v))?,
        exec.alloc(2 * v.len()).map_err(dev)?,
        exec.alloc(4 * v.len()).map_err(dev)?,
    );
    let n = v.len() as i32;
    let p1 = EwParams {
        x: exec.addr(&ma),
        y: exec.addr(&mb),
        n,
        ..Default::default()
    };
    exec.launch("convert_f32_bf16", Grid::linear(v.len(), 256), &p1)
        .map_err(dev)?;
    let p2 = EwParams {
        x: exec.addr(&mb),
        y: exec.addr(&mc),
        n,
        ..Default::default()
    };
    exec.launch("convert_bf16_f32", Grid::linear(v.len(), 256), &p2)
        .map_err(dev)?;
    let back = read_f32(exec, &mc, v.len())?;
    let wrong = v
        .iter()
        .zip(&back)
        .filter(|(a, b)| half::bf16::from_f32(**a).to_f32() != **b)
        .count();
    out.push(Check::within(
        "convert f32->bf16->f32 (round to nearest even)".into(),
        "values differing from the half crate",
        wrong as f64,
        0.0,
    ));
    Ok(())
}

/// The timestep kernel is not a Backend op (the model embeds on the host); it is
/// checked here directly against f64 math.
fn check_timestep<E: Exec>(out: &mut Vec<Check>, exec: &E) -> Result<()> {
    let xs = [0.0f32, 1.0, 250.5, 999.0];
    let freqs: Vec<f32> = (0..128)
        .map(|k| (-(10000f64.ln()) * k as f64 / 128.0).exp() as f32)
        .collect();
    let mx = mem_with(exec, &f32_bytes(&xs))?;
    let mf = mem_with(exec, &f32_bytes(&freqs))?;
    let mo = exec.alloc(4 * 256 * 4).map_err(dev)?;
    let p = TimestepParams {
        xs: exec.addr(&mx),
        freqs: exec.addr(&mf),
        out: exec.addr(&mo),
        n: 4,
        half: 128,
    };
    exec.launch("timestep_embed_f32", Grid::linear(4 * 128, 128), &p)
        .map_err(dev)?;
    let got = read_f32(exec, &mo, 4 * 256)?;
    let mut worst = 0f64;
    for (b, &x) in xs.iter().enumerate() {
        for (j, &f) in freqs.iter().enumerate() {
            let a = (x * f) as f64;
            let (c, s) = (got[b * 256 + j], got[b * 256 + 128 + j]);
            worst = worst
                .max((c as f64 - a.cos()).abs())
                .max((s as f64 - a.sin()).abs());
        }
    }
    // |arg| up to ~1000 rad: f32 sin/cos of the same f32 argument agree to ~1e-6.
    out.push(Check::within(
        "timestep_embed (F32)".into(),
        "max abs diff from f64",
        worst,
        2e-5,
    ));
    Ok(())
}
