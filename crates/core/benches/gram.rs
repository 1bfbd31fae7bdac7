//! Throughput of GPTQ's Hessian pass hot path: exact Gram matrices of layer
//! inputs, per CPU tier, on SmolLM2's input widths (576 for q/k/v, o_proj,
//! gate/up and lm_head; 1536 for down_proj) and Llama-3-8B's hidden width
//! (4 096; vector tiers only, ten samples) and 1 024 rows (one chunk: one
//! observation of a batch of two 512-token sequences).
//! Throughput counts multiply-adds: rows × width × (width + 1) / 2.
//!
//! Run: `cargo bench -p qforge-core --bench gram`

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::{CpuTier, Gram, MergePolicy, Provenance, Stats, TensorStats, VectorTier};
use rand::{SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

fn bench_gram(c: &mut Criterion) {
    let mut group = c.benchmark_group("gram");
    let rows = 1024;
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    for width in [576, 1536, 4096] {
        if width == 4096 {
            group.sample_size(10);
        }
        let values: Vec<f32> = (0..rows * width).map(|_| normal.sample(&mut rng)).collect();
        let exponent = Gram::exponent_for(8.0, 1 << 40).expect("finite");
        group.throughput(Throughput::Elements(
            (rows * width * (width + 1) / 2) as u64,
        ));
        for &tier in VectorTier::ALL {
            if !tier.is_supported() {
                eprintln!("SKIPPED: {tier:?} is not supported on this CPU");
                continue;
            }
            if width == 4096 && tier == VectorTier::Portable {
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

/// A coordinator's merge of one batch's Hessian partial: the statistics of
/// a `down_proj` input of SmolLM2 (1536 wide) with its Gram matrix, merged
/// into the run's.
fn bench_merge(c: &mut Criterion) {
    let width = 1536;
    let mut rng = StdRng::seed_from_u64(8);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let values: Vec<f32> = (0..256 * width).map(|_| normal.sample(&mut rng)).collect();
    let exponent = Gram::exponent_for(8.0, 1 << 40).expect("finite");
    let mut tensor = TensorStats::with_gram(Gram::new(width, exponent).expect("width ≥ 1"));
    tensor.observe(&values).expect("in range");
    let partial = Stats {
        provenance: Provenance::default(),
        tensors: BTreeMap::from([("model.layers.0.mlp.down_proj".to_owned(), tensor)]),
    };
    let mut run = partial.clone();
    let mut group = c.benchmark_group("gram_merge");
    group.sample_size(20);
    group.bench_function("stats_1536", |b| {
        // Force: the same partial again would be refused as a duplicate.
        b.iter(|| {
            run.merge(black_box(&partial), MergePolicy::Force)
                .expect("in range")
        })
    });
    group.finish();
}

criterion_group!(benches, bench_gram, bench_merge);
criterion_main!(benches);
