//! Throughput of GPTQ's Hessian pass hot path: exact Gram matrices of layer
//! inputs, per CPU tier, on SmolLM2's input widths (576 for q/k/v, o_proj,
//! gate/up and lm_head; 1536 for down_proj) and 1 024 rows (four chunks: one
//! observation of a batch of two 512-token sequences).
//! Throughput counts multiply-adds: rows × width × (width + 1) / 2.
//!
//! Run: `cargo bench -p qforge-core --bench gram`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::{Gram, GramTier};
use rand::{SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

fn bench_gram(c: &mut Criterion) {
    let mut group = c.benchmark_group("gram");
    let rows = 1024;
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    for width in [576, 1536] {
        let values: Vec<f32> = (0..rows * width).map(|_| normal.sample(&mut rng)).collect();
        let exponent = Gram::exponent_for(8.0, 1 << 40).expect("finite");
        group.throughput(Throughput::Elements(
            (rows * width * (width + 1) / 2) as u64,
        ));
        for tier in [GramTier::Portable, GramTier::Avx2, GramTier::Avx512] {
            if !tier.is_supported() {
                eprintln!("SKIPPED: {tier:?} is not supported on this CPU");
                continue;
            }
            group.bench_with_input(BenchmarkId::new(tier.name(), width), &values, |b, v| {
                let mut gram = Gram::new(width, exponent).expect("width ≥ 1");
                b.iter(|| gram.observe_with(tier, black_box(v)).expect("in range"));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_gram);
criterion_main!(benches);
