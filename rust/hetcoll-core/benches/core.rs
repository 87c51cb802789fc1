//! Criterion benchmarks of the core: the split solver at cluster scale and the fused weighted sum.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hetcoll_core::kernels::{weighted_sum, Source};
use hetcoll_core::solvers::{split, SplitOptions};

fn bench_split(c: &mut Criterion) {
    let p = 10_000;
    let speeds: Vec<f64> = (0..p).map(|i| 1.0 + (i * 7919 % 1000) as f64 / 100.0).collect();
    let latency: Vec<f64> = (0..p).map(|i| (i * 104_729 % 1000) as f64 / 1e5).collect();
    c.bench_function("split/10k_ranks_total_1e7", |b| {
        b.iter(|| {
            split(
                black_box(10_000_000),
                black_box(&speeds),
                &SplitOptions {
                    latency: Some(&latency),
                    ..Default::default()
                },
            )
            .unwrap()
        })
    });
}

fn bench_weighted_sum(c: &mut Criterion) {
    let n = 1 << 22;
    let srcs: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32; n]).collect();
    let mut out = vec![0.0f32; n];
    let w = [0.1, 0.2, 0.3, 0.4];
    let mut g = c.benchmark_group("weighted_sum");
    g.throughput(Throughput::Bytes((5 * n * 4) as u64));
    for threads in [1, 2] {
        g.bench_function(format!("4x2^22_f32_{threads}threads"), |b| {
            let s: Vec<Source<f32>> = srcs.iter().map(|v| Source::Slice(v)).collect();
            b.iter(|| weighted_sum(&s, &w, &mut out, threads).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_split, bench_weighted_sum
}
criterion_main!(benches);
