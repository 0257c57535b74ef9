use denoised_runtime::cpu::matmul::{linear, matmul, MatRef};
use rayon::prelude::*;
use std::time::Instant;
fn split_linear(x: &[f32], k: usize, w: &[f32], out: &mut [f32], o: usize, parts: usize) {
    let n = x.len() / k;
    let rows = n.div_ceil(parts);
    out.par_chunks_mut(rows * o).zip(x.par_chunks(rows * k)).for_each(|(oc, xc)| {
        let m = xc.len() / k;
        matmul(m, o, k, oc, o, MatRef::row_major(xc, k), MatRef::transposed(w, k), false, false);
    });
}
fn main() {
    for &(n, k, o) in &[(1152usize, 768usize, 2304usize), (1152, 768, 5376), (1152, 3840, 768), (1024, 768, 3072), (1024, 3072, 768), (128, 768, 2304)] {
        let x = vec![0.5f32; n * k];
        let w = vec![0.25f32; o * k];
        let b = vec![0.0f32; o];
        let mut out = vec![0.0f32; n * o];
        linear(&x, k, &w, Some(&b), &mut out);
        let it = 10;
        let t = Instant::now();
        for _ in 0..it { linear(&x, k, &w, Some(&b), &mut out); }
        let s = t.elapsed().as_secs_f64() / it as f64;
        let t = Instant::now();
        for _ in 0..it { split_linear(&x, k, &w, &mut out, o, 2); }
        let s2 = t.elapsed().as_secs_f64() / it as f64;
        let t = Instant::now();
        for _ in 0..it { split_linear(&x, k, &w, &mut out, o, 8); }
        let s3 = t.elapsed().as_secs_f64() / it as f64;
        let g = |s: f64| 2.0 * (n * k * o) as f64 / s / 1e9;
        println!("{n}x{k}x{o}: gemm-rayon {:.1}  split2 {:.1}  split8 {:.1} GFLOP/s", g(s), g(s2), g(s3));
    }
}
