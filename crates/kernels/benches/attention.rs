//! One decode step's attention for one GQA group on SmolLM2-135M's shape
//! (3 query heads per key/value head, head size 64) and Llama-3-8B's (4
//! heads of 128), over 128 to 8 192 cached positions laid out as the KV
//! cache holds them: every tier of `attention::attend`. Throughput is
//! in cached positions attended per second.
//!
//! `prefill`: the AVX2 tier's attention of 8 consecutive query positions of
//! one group ending at position N, as one tile (what a prefill runs) and as
//! 8 calls of one position each (as decode steps attend); throughput in query
//! positions per second.

mod support;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::CpuTier;
use qforge_kernels::attention::{AttentionTier, KeyValues, Queries, attend_with};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// (name, query heads per group, head size, key/value heads in a cache row).
const SHAPES: [(&str, usize, usize, usize); 2] =
    [("smollm2_3x64", 3, 64, 3), ("llama3_8b_4x128", 4, 128, 8)];
const POSITIONS: [usize; 4] = [128, 512, 2048, 8192];

fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn attention(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(0);
    let mut group = c.benchmark_group("attention");
    for (name, heads, hd, kv_heads) in SHAPES {
        let queries = values(&mut rng, heads * hd);
        let row = kv_heads * hd;
        let longest = POSITIONS[POSITIONS.len() - 1];
        let keys = values(&mut rng, longest * row);
        let cached = values(&mut rng, longest * row);
        let mut out = vec![0f32; heads * hd];
        for visible in POSITIONS {
            group.throughput(Throughput::Elements(visible as u64));
            for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
                let id = BenchmarkId::new(format!("{name}/{tier:?}"), visible);
                group.bench_function(id, |b| {
                    b.iter(|| {
                        attend_with(
                            tier,
                            Queries {
                                rows: &queries,
                                head_stride: hd,
                                position_stride: 0,
                                visible: &[visible],
                            },
                            KeyValues {
                                keys: &keys,
                                values: &cached,
                                offset: 0,
                                stride: row,
                            },
                            hd,
                            1.0 / (hd as f32).sqrt(),
                            &mut out,
                        )
                        .expect("shapes fit")
                    })
                });
            }
        }
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    const TILE: usize = 8;
    let tier = AttentionTier::detect();
    let mut rng = StdRng::seed_from_u64(1);
    let mut group = c.benchmark_group("prefill");
    group.throughput(Throughput::Elements(TILE as u64));
    for (name, heads, hd, kv_heads) in SHAPES {
        let row = kv_heads * hd;
        let longest = POSITIONS[POSITIONS.len() - 1];
        let keys = values(&mut rng, longest * row);
        let cached = values(&mut rng, longest * row);
        // Queries `[heads, TILE, hd]`, as the tensor forward holds them.
        let queries = values(&mut rng, heads * TILE * hd);
        let mut out = vec![0f32; TILE * heads * hd];
        let kv = KeyValues {
            keys: &keys,
            values: &cached,
            offset: 0,
            stride: row,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        for last in POSITIONS {
            let visible: Vec<usize> = (last + 1 - TILE..=last).collect();
            let tile = Queries {
                rows: &queries,
                head_stride: TILE * hd,
                position_stride: hd,
                visible: &visible,
            };
            let id = BenchmarkId::new(format!("{name}/tile"), last);
            group.bench_function(id, |b| {
                b.iter(|| attend_with(tier, tile, kv, hd, scale, &mut out).expect("shapes fit"))
            });
            let id = BenchmarkId::new(format!("{name}/positions"), last);
            group.bench_function(id, |b| {
                b.iter(|| {
                    for (p, out) in out.chunks_exact_mut(heads * hd).enumerate() {
                        let one = Queries {
                            rows: &queries[p * hd..],
                            head_stride: TILE * hd,
                            position_stride: 0,
                            visible: &visible[p..=p],
                        };
                        attend_with(tier, one, kv, hd, scale, out).expect("shapes fit");
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = support::config();
    targets = attention, prefill
}
criterion_main!(benches);
