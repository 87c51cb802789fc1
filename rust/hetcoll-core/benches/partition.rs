//! Criterion benchmarks of the partitioners: exact pipeline stages at 10,000 layers x 1,000
//! devices (with and without boundary transfers), and the multilevel hypergraph partitioner on a
//! 2D grid of 10,000 vertices into 4 heterogeneous blocks; the experts of a mixture-of-experts
//! layer (64 and 256 skewed loads) on 8 ranks of unequal speed, any experts on any rank.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use hetcoll_core::solvers::{
    assign_items, partition_chain, partition_hypergraph, refine_assignment, Hypergraph,
    PartitionOptions,
};

fn bench_chain(c: &mut Criterion) {
    let (n, p) = (10_000usize, 1_000usize);
    let costs: Vec<f64> = (0..n).map(|i| 1.0 + (i * 7919 % 1000) as f64).collect();
    let speeds: Vec<f64> = (0..p).map(|d| 1.0 + (d * 104_729 % 100) as f64).collect();
    let bytes: Vec<f64> = (0..n - 1).map(|i| (i * 31 % 4096) as f64 * 1e3).collect();
    let mut g = c.benchmark_group("partition_chain");
    g.bench_function("10k_layers_1k_devices", |b| {
        b.iter(|| partition_chain(black_box(&costs), black_box(&speeds), None, None).unwrap())
    });
    g.bench_function("10k_layers_1k_devices_with_transfers", |b| {
        b.iter(|| {
            partition_chain(
                black_box(&costs),
                black_box(&speeds),
                Some(&bytes),
                Some(1e9),
            )
            .unwrap()
        })
    });
    g.finish();
}

fn bench_hypergraph(c: &mut Criterion) {
    let side = 100usize;
    let mut offsets = vec![0usize];
    let mut pins = Vec::new();
    for r in 0..side {
        for col in 0..side {
            let v = (r * side + col) as u32;
            if col + 1 < side {
                pins.extend([v, v + 1]);
                offsets.push(pins.len());
            }
            if r + 1 < side {
                pins.extend([v, v + side as u32]);
                offsets.push(pins.len());
            }
        }
    }
    let hg = Hypergraph::new(side * side, offsets, pins, None, None).unwrap();
    let options = PartitionOptions::new(vec![0.4, 0.3, 0.2, 0.1]);
    let mut g = c.benchmark_group("partition_hypergraph");
    g.sample_size(10);
    g.bench_function("grid_100x100_k4_hetero", |b| {
        b.iter(|| partition_hypergraph(black_box(&hg), &options).unwrap())
    });
    g.finish();
}

/// Ranks of unequal speed, for the experts benchmarks.
const RANK_SPEEDS: [f64; 8] = [1.0, 0.8, 0.6, 0.5, 0.5, 0.3, 0.2, 0.1];

/// `n` experts' loads, skewed as routed tokens are: a few hot experts, a long cool tail.
fn skewed_loads(n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| 1000.0 / (1.0 + (i * 7919 % n) as f64).powf(0.8))
        .collect()
}

fn bench_assign(c: &mut Criterion) {
    let speeds = RANK_SPEEDS;
    let mut g = c.benchmark_group("assign_items");
    g.sample_size(20);
    for n in [64usize, 256] {
        let loads = skewed_loads(n);
        g.bench_function(format!("{n}_experts_8_ranks"), |b| {
            b.iter(|| assign_items(black_box(&loads), black_box(&speeds), None, 200_000).unwrap())
        });
    }
    g.finish();
}

fn bench_refine(c: &mut Criterion) {
    let speeds = RANK_SPEEDS;
    let mut g = c.benchmark_group("refine_assignment");
    g.sample_size(20);
    for n in [64usize, 256] {
        let loads = skewed_loads(n);
        // A placement that ignores the loads: runs of equal counts.
        let start: Vec<usize> = (0..n).map(|i| i * speeds.len() / n).collect();
        g.bench_function(format!("{n}_experts_8_ranks"), |b| {
            b.iter(|| {
                refine_assignment(black_box(&loads), black_box(&speeds), &start, None).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_chain,
    bench_hypergraph,
    bench_assign,
    bench_refine
);
criterion_main!(benches);
