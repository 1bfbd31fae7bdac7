//! One row's online Hadamard rotation, as a decode step runs it before a
//! rotated layer: SmolLM2-135M's widths (576, its MLP's 1 536) and
//! Llama-3-8B's MLP (14 336), on every tier. Throughput is in values rotated
//! per second.

mod support;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::CpuTier;
use qforge_core::VectorTier;
use qforge_kernels::Hadamard;

fn hadamard(c: &mut Criterion) {
    let mut group = c.benchmark_group("hadamard_row");
    for n in [576, 1536, 14336] {
        let rotation = Hadamard::new(n).expect("a supported width");
        let mut row: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        group.throughput(Throughput::Elements(n as u64));
        for &tier in VectorTier::ALL.iter().filter(|t| t.is_supported()) {
            group.bench_function(BenchmarkId::new(format!("{tier:?}"), n), |b| {
                // Rotating the same row over and over keeps its magnitude:
                // the rotation is orthogonal.
                b.iter(|| {
                    rotation
                        .rotate_with(tier, std::hint::black_box(&mut row))
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = support::config();
    targets = hadamard
}
criterion_main!(benches);
