//! Throughput of the calibration hot path: observing f32 activations.
//!
//! Besides `Histogram::observe` on each CPU tier, two reference loops run side
//! by side on the same data: the bare scalar binning loop (one table increment
//! per value, no min/max, no special values: the ceiling to approach) and the
//! same binning into a sparse `HashMap`, the alternative to a dense table.
//!
//! Run: `cargo bench -p qforge-core --bench observe`

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::{CpuTier, Histogram, ObserveTier};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

/// Activation-sized input: 256 Ki values (1 MiB, an L2-resident block, like a
/// `[tokens, hidden]` activation that was just computed).
const LEN: usize = 256 * 1024;

fn inputs() -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = StdRng::seed_from_u64(42);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let gaussian: Vec<f32> = (0..LEN).map(|_| normal.sample(&mut rng)).collect();
    // A post-ReLU/SwiGLU-like activation: half exact zeros, so consecutive
    // values often hit the same bin (the worst case for a table increment).
    let relu: Vec<f32> = (0..LEN)
        .map(|_| {
            let v: f32 = normal.sample(&mut rng);
            if rng.random::<bool>() { v.abs() } else { 0.0 }
        })
        .collect();
    vec![("gaussian", gaussian), ("relu", relu)]
}

fn bench_observe(c: &mut Criterion) {
    let mut group = c.benchmark_group("observe");
    group.throughput(Throughput::Elements(LEN as u64));
    for (name, values) in inputs() {
        for &tier in ObserveTier::ALL {
            if !tier.is_supported() {
                eprintln!("skipped: tier {tier:?} is not supported on this CPU");
                continue;
            }
            let mut histogram = Histogram::new();
            group.bench_with_input(
                BenchmarkId::new(format!("histogram_{tier:?}").to_lowercase(), name),
                &values,
                |b, v| b.iter(|| histogram.observe_with(tier, black_box(v))),
            );
        }

        let mut table = vec![0u64; 1 << 16];
        group.bench_with_input(
            BenchmarkId::new("bare_scalar_binning", name),
            &values,
            |b, v| {
                b.iter(|| {
                    for x in black_box(v) {
                        table[(x.to_bits() >> 16) as usize] += 1;
                    }
                })
            },
        );

        let mut sparse: HashMap<u16, u64> = HashMap::new();
        group.bench_with_input(
            BenchmarkId::new("sparse_hashmap_binning", name),
            &values,
            |b, v| {
                b.iter(|| {
                    for x in black_box(v) {
                        *sparse.entry((x.to_bits() >> 16) as u16).or_default() += 1;
                    }
                })
            },
        );
    }
    group.finish();
}

fn bench_merge(c: &mut Criterion) {
    let mut group = c.benchmark_group("merge");
    let (_, values) = inputs().swap_remove(0);
    let mut a = Histogram::new();
    a.observe(&values);
    let b = a.clone();
    group.bench_function("dense_histogram", |bench| {
        bench.iter(|| a.merge(black_box(&b)).expect("counts fit in u64"))
    });
    group.finish();
}

criterion_group!(benches, bench_observe, bench_merge);
criterion_main!(benches);
