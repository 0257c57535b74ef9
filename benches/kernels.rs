//! Criterion benchmarks of the CPU kernels at flux-small sizes (hidden 768, 12 heads
//! of 64, 1024 image + 128 text tokens). Run with `cargo bench --bench kernels`.
//! `denoised bench step` times whole transformer steps; these isolate the parts.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use denoised_runtime::backend::{AttnSeq, KvSource, QSpan, Rows, Src};
use denoised_runtime::{Backend, CpuBackend, Modulation, Tensor};

fn filled(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) >> 9) as f32 / 8388608.0 - 1.0)
        .collect();
    Tensor::new(shape.to_vec(), data).unwrap()
}

fn kernels(c: &mut Criterion) {
    let be = CpuBackend::new();
    let (n, d, heads) = (1152usize, 768usize, 12usize);
    let mut g = c.benchmark_group("cpu");
    g.sample_size(10);

    let x = filled(&[n, d], 1);
    let w = be.upload_weight(&filled(&[3 * d, d], 2)).unwrap();
    let b = filled(&[3 * d], 3);
    g.throughput(Throughput::Elements((2 * n * d * 3 * d) as u64));
    g.bench_function("linear 1152x768 -> 2304 (flop)", |bch| {
        bch.iter(|| be.linear(black_box(&x), &w, Some(&b)).unwrap())
    });

    let qkv = filled(&[n, 3 * d], 4);
    g.throughput(Throughput::Elements((4 * n * n * d) as u64));
    g.bench_function("attention 1152 tokens (flop)", |bch| {
        bch.iter_batched(
            || qkv.clone(),
            |mut buf| {
                let seq = AttnSeq {
                    q: vec![QSpan { buf: 0, rows: 0..n }],
                    kv: vec![KvSource {
                        src: Src::Own(0),
                        k_col: d,
                        v_col: 2 * d,
                        rows: Rows::Range(0..n),
                    }],
                };
                be.attention(&mut [&mut buf], 0, d, heads, &[seq]).unwrap();
                buf
            },
            BatchSize::LargeInput,
        )
    });

    let table = filled(&[1, 6 * d], 5);
    let seg = vec![0u32; n];
    g.throughput(Throughput::Elements((n * d) as u64));
    g.bench_function("layer_norm_modulate 1152x768 (element)", |bch| {
        bch.iter(|| {
            be.layer_norm_modulate(
                black_box(&x),
                1e-6,
                Modulation {
                    table: &table,
                    chunk: 0,
                    seg: &seg,
                },
                Modulation {
                    table: &table,
                    chunk: 1,
                    seg: &seg,
                },
            )
            .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
