//! A cluster coordinator's work per result: decoding a worker's `.qstats`
//! bytes and merging them into the run's statistics. The result has
//! SmolLM2-135M's shape: 121 observed tensors (30 layers × the inputs of
//! q/k/v, o_proj, gate/up and down_proj, then lm_head), each a histogram of
//! one batch of 399 rows, about 1 MB encoded.
//!
//! Run: `cargo bench -p qforge-core --bench codec`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use qforge_core::codec::{decode, encode};
use qforge_core::{BatchId, Digest, MergePolicy, Provenance, Stats, TensorStats};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

const ROWS: usize = 399;

/// One batch's statistics, seeded, with a few outlier channels per tensor as
/// real activations have.
fn smollm2_result(batch: u64) -> Stats {
    let mut rng = StdRng::seed_from_u64(batch);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let mut points: Vec<(String, usize)> = (0..30)
        .flat_map(|layer| {
            [
                ("self_attn.q_proj", 576),
                ("self_attn.o_proj", 576),
                ("mlp.gate_proj", 576),
                ("mlp.down_proj", 1536),
            ]
            .map(|(point, width)| (format!("model.layers.{layer}.{point}"), width))
        })
        .collect();
    points.push(("lm_head".into(), 576));
    let tensors = points
        .into_iter()
        .map(|(name, width)| {
            let outliers: Vec<usize> = (0..4).map(|_| rng.random_range(0..width)).collect();
            let values: Vec<f32> = (0..ROWS * width)
                .map(|i| {
                    let scale = if outliers.contains(&(i % width)) {
                        300.0
                    } else {
                        1.0
                    };
                    normal.sample(&mut rng) * scale
                })
                .collect();
            let mut stats = TensorStats::new();
            stats.observe(&values).expect("finite values");
            (name, stats)
        })
        .collect();
    Stats {
        provenance: Provenance::single(
            Some(Digest([1; 32])),
            Digest([2; 32]),
            Digest([3; 32]),
            "activation",
            BatchId {
                index: batch,
                content: Digest([4; 32]),
            },
            1_000_000,
        ),
        tensors,
    }
}

fn bench_coordinator(c: &mut Criterion) {
    let bytes = encode(&smollm2_result(1));
    eprintln!("one result: {} bytes", bytes.len());
    let mut group = c.benchmark_group("coordinator_per_result");
    group.sample_size(20);
    group.bench_function("decode", |b| {
        b.iter(|| decode(black_box(&bytes)).expect("valid bytes"))
    });
    // The run's statistics so far: other batches, merged (dense, as after
    // the first merge).
    let mut merged = smollm2_result(2);
    merged
        .merge(
            &decode(&encode(&smollm2_result(3))).expect("valid bytes"),
            MergePolicy::Strict,
        )
        .expect("disjoint batches");
    // As decoded (sparse): what a coordinator's statistics are after its
    // first result, and a worker's after its task's first batch.
    let mut merged_sparse = decode(&encode(&merged)).expect("valid bytes");
    for (name, into) in [
        ("decode_and_merge", &mut merged),
        ("decode_and_merge_into_decoded", &mut merged_sparse),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let result = decode(black_box(&bytes)).expect("valid bytes");
                // Merged per tensor: the same batch again would be refused as
                // a duplicate by the provenance check, which this leaves out.
                for (name, tensor) in &result.tensors {
                    into.tensors
                        .get_mut(name)
                        .expect("same tensors")
                        .merge(tensor)
                        .expect("in range");
                }
            })
        });
    }
    group.finish();

    // A worker's work per batch of a task: merging a batch's statistics into
    // the task's, holding the same bins (the synthetic worker's case).
    let decoded = decode(&bytes).expect("valid bytes");
    let mut task = decoded.clone();
    let mut group = c.benchmark_group("worker_per_batch");
    group.sample_size(20);
    group.bench_function("merge_same_bins", |b| {
        b.iter(|| {
            for (name, tensor) in &decoded.tensors {
                task.tensors
                    .get_mut(name)
                    .expect("same tensors")
                    .merge(black_box(tensor))
                    .expect("in range");
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench_coordinator);
criterion_main!(benches);
