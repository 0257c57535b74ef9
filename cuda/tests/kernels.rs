//! Every GPU-backend op against the CPU backend (the numerical reference), on two
//! executors:
//! - the CPU emulator, always: the real kernel sources run on CPU threads, so this
//!   checks indexing, tiling, online softmax, fragment layouts and descriptors on
//!   machines without a GPU (CI);
//! - a real GPU (`cuda:0`), when one is present; otherwise the test says why it skips.
//!
//! Tolerances, relative to the largest reference magnitude of each output:
//! f32 mode 1e-5 (summation order only); bf16 mode 1.6e-2 (inputs are pre-rounded to
//! bf16 for both sides, so what remains is bf16 rounding of outputs and intermediates:
//! 2^-8 = 3.9e-3 per rounding, a few roundings deep).

use std::ops::Range;

use denoised_cuda::exec::Grid;
use denoised_cuda::params::TimestepParams;
use denoised_cuda::{CudaExec, Dt, EmuExec, Exec, GpuBackend};
use denoised_runtime::backend::{AttnSeq, Backend, KvSource, Modulation, QSpan, Rows, Src};
use denoised_runtime::{CpuBackend, Tensor};

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
        Tensor::new(shape.to_vec(), data).unwrap()
    }
}

fn tol(dt: Dt) -> f32 {
    match dt {
        Dt::F32 => 1e-5,
        Dt::Bf16 => 1.6e-2,
    }
}

fn close(what: &str, dt: Dt, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let scale = want
        .data()
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-6);
    let mut worst = (0f32, 0usize);
    for (i, (g, w)) in got.data().iter().zip(want.data()).enumerate() {
        let d = (g - w).abs();
        assert!(
            d.is_finite(),
            "{what}: non-finite output at {i} (got {g}, want {w})"
        );
        if d > worst.0 {
            worst = (d, i);
        }
    }
    let rel = worst.0 / scale;
    println!("  {what:<28} {dt:?}: max rel diff {rel:.2e}");
    assert!(
        rel <= tol(dt),
        "{what} ({dt:?}): max diff {} at {} (got {}, want {}), relative {rel:.2e} > {:.1e}",
        worst.0,
        worst.1,
        got.data()[worst.1],
        want.data()[worst.1],
        tol(dt)
    );
}

fn modl<'a, T>(table: &'a T, chunk: usize, seg: &'a [u32]) -> Modulation<'a, T> {
    Modulation { table, chunk, seg }
}

/// Runs every op on `gpu` and on the CPU backend with the same inputs.
fn check_ops<E: Exec>(gpu: &GpuBackend<E>) {
    let cpu = CpuBackend::new();
    let dt = gpu.dtype();
    let mut rng = Rng(7);
    let up = |t: &Tensor| gpu.upload(t).unwrap();
    let down = |t: &<GpuBackend<E> as Backend>::Tensor| gpu.download(t).unwrap();

    // linear over a column block, with bias
    let x = rng.tensor(&[37, 40], 1.0);
    let w = rng.tensor(&[24, 16], 0.3);
    let b = rng.tensor(&[24], 0.5);
    let want = cpu
        .linear_cols(&x, 8..24, &cpu.upload_weight(&w).unwrap(), Some(&b))
        .unwrap();
    let got = gpu
        .linear_cols(
            &up(&x),
            8..24,
            &gpu.upload_weight(&w).unwrap(),
            Some(&up(&b)),
        )
        .unwrap();
    close("linear_cols+bias", dt, &down(&got), &want);

    // linear + GELU (the fused epilogue on a GPU; it must be the tanh approximation)
    let x = rng.tensor(&[29, 16], 1.0);
    let want = cpu
        .linear_gelu(&x, &cpu.upload_weight(&w).unwrap(), Some(&b))
        .unwrap();
    let got = gpu
        .linear_gelu(&up(&x), &gpu.upload_weight(&w).unwrap(), Some(&up(&b)))
        .unwrap();
    close("linear+bias+gelu_tanh", dt, &down(&got), &want);

    // LayerNorm + modulation per segment
    let x = rng.tensor(&[9, 96], 2.0);
    let table = rng.tensor(&[3, 3 * 96], 0.5);
    let seg: Vec<u32> = (0..9).map(|r| (r % 3) as u32).collect();
    let want = cpu
        .layer_norm_modulate(&x, 1e-6, modl(&table, 0, &seg), modl(&table, 2, &seg))
        .unwrap();
    let gt = up(&table);
    let got = gpu
        .layer_norm_modulate(&up(&x), 1e-6, modl(&gt, 0, &seg), modl(&gt, 2, &seg))
        .unwrap();
    close("layer_norm_modulate", dt, &down(&got), &want);

    // gated residual
    let mut xc = rng.tensor(&[9, 96], 1.0);
    let y = rng.tensor(&[9, 96], 1.0);
    let mut xg = up(&xc);
    cpu.gated_residual(&mut xc, &y, modl(&table, 1, &seg))
        .unwrap();
    gpu.gated_residual(&mut xg, &up(&y), modl(&gt, 1, &seg))
        .unwrap();
    close("gated_residual", dt, &down(&xg), &xc);

    // RMSNorm (+ RoPE) over a column block of heads
    let wt = rng.tensor(&[32], 1.0);
    let cos = rng.tensor(&[6, 32], 1.0);
    let sin = rng.tensor(&[6, 32], 1.0);
    for rope in [false, true] {
        let mut xc = rng.tensor(&[6, 160], 3.0);
        let mut xg = up(&xc);
        let (gc, gs) = (up(&cos), up(&sin));
        cpu.rms_norm_rope(&mut xc, 32..128, &wt, 1e-6, rope.then_some((&cos, &sin)))
            .unwrap();
        gpu.rms_norm_rope(&mut xg, 32..128, &up(&wt), 1e-6, rope.then_some((&gc, &gs)))
            .unwrap();
        close(
            if rope { "rms_norm+rope" } else { "rms_norm" },
            dt,
            &down(&xg),
            &xc,
        );
    }

    // elementwise
    let mut xc = rng.tensor(&[7, 50], 4.0);
    let mut xg = up(&xc);
    cpu.gelu_tanh(&mut xc, 10..45).unwrap();
    gpu.gelu_tanh(&mut xg, 10..45).unwrap();
    close("gelu_tanh(cols)", dt, &down(&xg), &xc);
    let want = cpu.silu(&xc).unwrap();
    close("silu", dt, &down(&gpu.silu(&up(&xc)).unwrap()), &want);
    let y = rng.tensor(&[7, 50], 1.0);
    let mut xg = up(&xc);
    cpu.add(&mut xc, &y).unwrap();
    gpu.add(&mut xg, &up(&y)).unwrap();
    close("add", dt, &down(&xg), &xc);

    // gathers
    let a = rng.tensor(&[5, 12], 1.0);
    let b2 = rng.tensor(&[4, 12], 1.0);
    let index = [(1, 3), (0, 0), (0, 4), (1, 0), (1, 3)];
    let want = cpu.gather_rows(&[&a, &b2], &index).unwrap();
    let got = gpu.gather_rows(&[&up(&a), &up(&b2)], &index).unwrap();
    close("gather_rows", dt, &down(&got), &want);
    let want = cpu.gather_cols(&a, 1..4, 3..11).unwrap();
    close(
        "gather_cols",
        dt,
        &down(&gpu.gather_cols(&up(&a), 1..4, 3..11).unwrap()),
        &want,
    );

    // attention: head dims 64 and 128 take the tensor-core kernel in bf16; 16 the
    // SIMT one. Queries span two buffers; keys come from both (by range) and from an
    // external "cache" by index, in two sequences of different lengths.
    for (heads, hd) in [(2, 64), (1, 128), (3, 16)] {
        check_attention(gpu, &cpu, &mut rng, heads, hd);
    }
    check_attention_many_caches(gpu, &cpu, &mut rng);
}

/// A batch of 12 edits of 12 different templates: 13 distinct buffers, more than one
/// launch addresses, so the backend splits the sequences over launches.
fn check_attention_many_caches<E: Exec>(gpu: &GpuBackend<E>, cpu: &CpuBackend, rng: &mut Rng) {
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
    cpu.attention(&mut [&mut c], 0, w, heads, &seqs(&caches, &idx, rows, w))
        .unwrap();
    let mut g = gpu.upload(&t).unwrap();
    let gc: Vec<_> = caches.iter().map(|c| gpu.upload(c).unwrap()).collect();
    gpu.attention(&mut [&mut g], 0, w, heads, &seqs(&gc, &idx, rows, w))
        .unwrap();
    close(
        "attention, 12 caches in one call",
        gpu.dtype(),
        &gpu.download(&g).unwrap(),
        &c,
    );
}

fn check_attention<E: Exec>(
    gpu: &GpuBackend<E>,
    cpu: &CpuBackend,
    rng: &mut Rng,
    heads: usize,
    hd: usize,
) {
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
    )
    .unwrap();
    let (mut g0, mut g1, gc) = (
        gpu.upload(&t0).unwrap(),
        gpu.upload(&t1).unwrap(),
        gpu.upload(&cache).unwrap(),
    );
    gpu.attention(
        &mut [&mut g0, &mut g1],
        0,
        w,
        heads,
        &seqs(&gc, &idx_a, &idx_b, w),
    )
    .unwrap();
    let name = format!("attention {heads}x{hd}");
    close(&name, dt, &gpu.download(&g0).unwrap(), &c0);
    close(&name, dt, &gpu.download(&g1).unwrap(), &c1);
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}
fn mem_with<E: Exec>(exec: &E, bytes: &[u8]) -> E::Mem {
    let m = exec.alloc(bytes.len()).unwrap();
    exec.upload(&m, 0, bytes).unwrap();
    m
}
fn read_f32<E: Exec>(exec: &E, m: &E::Mem, n: usize) -> Vec<f32> {
    let mut out = vec![0u8; 4 * n];
    exec.download(m, 0, &mut out).unwrap();
    out.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Kernel features the Backend does not use yet, launched directly: LayerNorm +
/// modulation with fused row gather and scatter (f32), and the dtype conversions.
fn check_fused_ln_and_convert<E: Exec>(exec: &E) {
    use denoised_cuda::params::{EwParams, LnModParams};
    let cpu = CpuBackend::new();
    let mut rng = Rng(11);
    let (rows_in, rows, width) = (10usize, 6usize, 40usize);
    let x = rng.tensor(&[rows_in, width], 2.0);
    let table = rng.tensor(&[2, 2 * width], 0.5);
    let seg: Vec<u32> = vec![0, 1, 1, 0, 1, 0];
    let in_index: Vec<u32> = vec![9, 0, 4, 4, 7, 2];
    let out_index: Vec<u32> = vec![5, 3, 0, 7, 1, 2];
    // Reference: gather, LN-modulate on the CPU backend, scatter.
    let gathered = cpu
        .gather_rows(&[&x], &in_index.iter().map(|&r| (0, r)).collect::<Vec<_>>())
        .unwrap();
    let ln = cpu
        .layer_norm_modulate(
            &gathered,
            1e-6,
            modl(&table, 0, &seg),
            modl(&table, 1, &seg),
        )
        .unwrap();
    let mut want = vec![7.0f32; 8 * width]; // rows nobody writes keep their value
    for (r, &o) in out_index.iter().enumerate() {
        want[o as usize * width..(o as usize + 1) * width].copy_from_slice(ln.row(r));
    }
    let u32_bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let (mx, mt) = (
        mem_with(exec, &f32_bytes(x.data())),
        mem_with(exec, &f32_bytes(table.data())),
    );
    let mo = mem_with(exec, &f32_bytes(&vec![7.0f32; 8 * width]));
    let (ms, mi, mj) = (
        mem_with(exec, &u32_bytes(&seg)),
        mem_with(exec, &u32_bytes(&in_index)),
        mem_with(exec, &u32_bytes(&out_index)),
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
    };
    exec.launch("ln_modulate_f32", Grid::linear(rows * 32, 128), &p)
        .unwrap();
    let got = Tensor::new([8, width], read_f32(exec, &mo, 8 * width)).unwrap();
    close(
        "ln_modulate gather+scatter",
        Dt::F32,
        &got,
        &Tensor::new([8, width], want).unwrap(),
    );

    // f32 -> bf16 -> f32 against the half crate (round to nearest even).
    let v: Vec<f32> = (0..1000)
        .map(|i| (i as f32 - 500.0) * 0.37e-3 * (1.0 + i as f32))
        .collect();
    let (ma, mb, mc) = (
        mem_with(exec, &f32_bytes(&v)),
        exec.alloc(2 * v.len()).unwrap(),
        exec.alloc(4 * v.len()).unwrap(),
    );
    let n = v.len() as i32;
    let p1 = EwParams {
        x: exec.addr(&ma),
        y: exec.addr(&mb),
        n,
        ..Default::default()
    };
    exec.launch("convert_f32_bf16", Grid::linear(v.len(), 256), &p1)
        .unwrap();
    let p2 = EwParams {
        x: exec.addr(&mb),
        y: exec.addr(&mc),
        n,
        ..Default::default()
    };
    exec.launch("convert_bf16_f32", Grid::linear(v.len(), 256), &p2)
        .unwrap();
    let back = read_f32(exec, &mc, v.len());
    for (a, b) in v.iter().zip(&back) {
        assert_eq!(half::bf16::from_f32(*a).to_f32(), *b, "conversion of {a}");
    }
    println!("  convert f32<->bf16: exact round to nearest even");
}

/// The timestep kernel is not a Backend op (the model embeds on the host); it is
/// checked here directly against f64 math.
fn check_timestep<E: Exec>(exec: &E) {
    let xs = [0.0f32, 1.0, 250.5, 999.0];
    let freqs: Vec<f32> = (0..128)
        .map(|k| (-(10000f64.ln()) * k as f64 / 128.0).exp() as f32)
        .collect();
    let mx = mem_with(exec, &f32_bytes(&xs));
    let mf = mem_with(exec, &f32_bytes(&freqs));
    let mo = exec.alloc(4 * 256 * 4).unwrap();
    let p = TimestepParams {
        xs: exec.addr(&mx),
        freqs: exec.addr(&mf),
        out: exec.addr(&mo),
        n: 4,
        half: 128,
    };
    exec.launch("timestep_embed_f32", Grid::linear(4 * 128, 128), &p)
        .unwrap();
    let got = read_f32(exec, &mo, 4 * 256);
    for (b, &x) in xs.iter().enumerate() {
        for (j, &f) in freqs.iter().enumerate() {
            let a = (x * f) as f64;
            let (c, s) = (got[b * 256 + j], got[b * 256 + 128 + j]);
            // |arg| up to ~1000 rad: f32 sin/cos of the same f32 argument agree to ~1e-6.
            assert!(
                (c as f64 - a.cos()).abs() < 2e-5 && (s as f64 - a.sin()).abs() < 2e-5,
                "timestep {b},{j}"
            );
        }
    }
    println!("  timestep_embed               f32: within 2e-5 of f64");
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn param_structs_match_cpp() {
    use denoised_cuda::params::*;
    use std::mem::size_of;
    let rust = [
        size_of::<EwParams>(),
        size_of::<LnModParams>(),
        size_of::<RmsRopeParams>(),
        size_of::<GatherParams>(),
        size_of::<TimestepParams>(),
        size_of::<AttnParams>(),
    ];
    assert_eq!(rust, denoised_cuda::emu::param_sizes());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_kernels_match_cpu_f32() {
    check_ops(&GpuBackend::new(EmuExec::default(), Dt::F32));
    check_timestep(&EmuExec::default());
    check_fused_ln_and_convert(&EmuExec::default());
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn emulated_kernels_match_cpu_bf16() {
    check_ops(&GpuBackend::new(EmuExec::default(), Dt::Bf16));
}

#[test]
fn gpu_kernels_match_cpu() {
    let exec = match CudaExec::new(0) {
        Ok(e) => e,
        Err(e) => {
            println!("skipping the GPU run: {e}");
            return;
        }
    };
    println!("on {}", exec.describe());
    check_timestep(&exec);
    check_fused_ln_and_convert(&exec);
    for dt in [Dt::F32, Dt::Bf16] {
        check_ops(&GpuBackend::new(CudaExec::new(0).unwrap(), dt));
    }
}
