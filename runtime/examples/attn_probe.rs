use denoised_runtime::cpu::attention::{attention, Kv, Seq};
use denoised_runtime::Rows;
use std::time::Instant;
fn main() {
    let (n, heads, hd) = (1152usize, 12usize, 64usize);
    let w = heads * hd;
    let q: Vec<f32> = (0..n * w).map(|i| ((i * 7919 % 1000) as f32 / 1000.0) - 0.5).collect();
    let k = q.clone();
    let v = q.clone();
    let mut out = vec![0.0f32; n * w];
    let seqs = vec![Seq { q: 0..n, kv: vec![Kv { k: &k, v: &v, rows: Rows::Range(0..n) }] }];
    attention(&q, &mut out, w, heads, &seqs);
    let it = 10;
    let t = Instant::now();
    for _ in 0..it { attention(&q, &mut out, w, heads, &seqs); }
    let s = t.elapsed().as_secs_f64() / it as f64;
    println!("attention {n} tokens: {:.2} ms, {:.1} GFLOP/s", s * 1e3, 4.0 * (n * n * w) as f64 / s / 1e9);
}
