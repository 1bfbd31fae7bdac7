//! SmolLM2-135M forward: full precision (a 128-token prefill with and
//! without observation, whose hook must cost ≤ 15 %, and one decode step),
//! the INT8 engine with dynamic per-token activations (prefill, decode step),
//! and the INT8 decoder's step (what `generate` and `serve` run) plain, with
//! the residual rotated offline, and with QuaRot's online down_proj rotation
//! on top.
//!
//! Run: `cargo bench -p qforge-model --bench forward` (needs
//! scripts/fetch-models.sh).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use qforge_model::{Activations, Decoder, Llama, Logits, RotatedInput, Statistics, StatsObserver};

fn model() -> Llama {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} missing: run scripts/fetch-models.sh",
        path.display()
    );
    Llama::from_gguf(&path).expect("load SmolLM2")
}

/// `prefill_128`, `decode_step_at_128` and `decode_step_at_2048` (a step
/// after a 2 048-token context, where reading the cache dominates) of
/// `model` in `group`.
fn prefill_and_decode(group: &mut BenchmarkGroup<'_, WallTime>, model: &Llama, prompt: &[u32]) {
    group.sample_size(10);
    group.throughput(Throughput::Elements(prompt.len() as u64));
    group.bench_function("prefill_128", |b| {
        b.iter(|| {
            model
                .forward(black_box(&[prompt.to_vec()]), None, None, Logits::Last)
                .unwrap()
        })
    });
    let long: Vec<u32> = (0..2048u32).map(|i| (i * 997 + 13) % 49152).collect();
    group.throughput(Throughput::Elements(1));
    for context in [prompt, &long[..]] {
        let mut cache = model.new_cache();
        model
            .forward(&[context.to_vec()], Some(&mut cache), None, Logits::Last)
            .unwrap();
        group.bench_function(format!("decode_step_at_{}", context.len()), |b| {
            // Steps continue one cache, as a server's do; each sample starts
            // from a copy of the prefilled one (made, and dropped, outside
            // the timing), so the context grows by a sample's steps only.
            b.iter_custom(|steps| {
                let mut cache = cache.clone();
                cache.reserve(context.len() + steps as usize);
                let started = std::time::Instant::now();
                for _ in 0..steps {
                    black_box(
                        model
                            .forward(black_box(&[vec![42]]), Some(&mut cache), None, Logits::Last)
                            .unwrap(),
                    );
                }
                started.elapsed()
            })
        });
    }
}

fn bench(c: &mut Criterion) {
    let model = model();
    let prompt: Vec<u32> = (0..128u32).map(|i| (i * 997 + 13) % 49152).collect();
    let mut group = c.benchmark_group("smollm2_fp32");
    prefill_and_decode(&mut group, &model, &prompt);
    group.throughput(Throughput::Elements(prompt.len() as u64));
    group.bench_function("prefill_128_observed", |b| {
        b.iter(|| {
            let mut observer = StatsObserver::new(Statistics::Histograms { per_channel: true });
            model
                .forward(
                    black_box(std::slice::from_ref(&prompt)),
                    None,
                    Some(&mut observer),
                    Logits::Last,
                )
                .unwrap()
        })
    });
    group.finish();

    let int8 = model
        .with_linears(|_, layer| layer.to_int8(Activations::Dynamic))
        .expect("INT8 conversion");
    let mut group = c.benchmark_group("smollm2_int8_dynamic");
    prefill_and_decode(&mut group, &int8, &prompt);
    group.finish();

    // The same decoder with the residual rotated offline (no run-time cost)
    // and down_proj's input rotated online: what the rotation costs a step.
    let residual = model.residual_rotated(0).expect("the residual rotation");
    let to_int8 = |m: &Llama| {
        m.with_linears(|_, layer| layer.to_int8(Activations::Dynamic))
            .expect("INT8 conversion")
    };
    let quarot = to_int8(
        &residual
            .rotated(&[RotatedInput::MlpProduct])
            .expect("QuaRot"),
    );
    let residual = to_int8(&residual);
    let mut decoder = Decoder::new(rayon::current_num_threads()).expect("decode threads");
    let mut group = c.benchmark_group("smollm2_int8_decoder");
    group.sample_size(20);
    group.throughput(Throughput::Elements(1));
    for (name, model) in [
        ("plain", &int8),
        ("residual", &residual),
        ("quarot", &quarot),
    ] {
        let mut cache = model.new_cache();
        model
            .forward(
                std::slice::from_ref(&prompt),
                Some(&mut cache),
                None,
                Logits::Last,
            )
            .unwrap();
        group.bench_function(format!("step_at_128_{name}"), |b| {
            b.iter_custom(|steps| {
                let mut cache = cache.clone();
                cache.reserve(prompt.len() + steps as usize);
                let started = std::time::Instant::now();
                for _ in 0..steps {
                    black_box(
                        decoder
                            .step(model, &mut [&mut cache], &[black_box(42)], None)
                            .unwrap(),
                    );
                }
                started.elapsed()
            })
        });
    }
    group.finish();

    // One step of many sequences, each 128 positions in: what continuous
    // batching runs. Throughput counts the tokens (one per sequence).
    let mut group = c.benchmark_group("smollm2_int8_batched_step");
    group.sample_size(10);
    let mut cache = int8.new_cache();
    int8.forward(
        std::slice::from_ref(&prompt),
        Some(&mut cache),
        None,
        Logits::Last,
    )
    .unwrap();
    for sequences in [1usize, 16, 64, 256] {
        group.throughput(Throughput::Elements(sequences as u64));
        let tokens: Vec<u32> = (0..sequences as u32).map(|i| 42 + i).collect();
        let caches = |steps: u64| -> Vec<_> {
            (0..sequences)
                .map(|_| {
                    let mut c = cache.clone();
                    c.reserve(prompt.len() + steps as usize);
                    c
                })
                .collect()
        };
        group.bench_function(format!("decoder_{sequences}"), |b| {
            b.iter_custom(|steps| {
                let mut caches = caches(steps);
                let mut caches: Vec<&mut _> = caches.iter_mut().collect();
                let started = std::time::Instant::now();
                for _ in 0..steps {
                    black_box(decoder.step(&int8, &mut caches, &tokens, None).unwrap());
                }
                started.elapsed()
            })
        });
        // The engine's step before the batched decoder: the tensor forward
        // with INT8 linear layers, attention per sequence.
        group.bench_function(format!("tensor_{sequences}"), |b| {
            b.iter_custom(|steps| {
                let mut caches = caches(steps);
                let mut caches: Vec<&mut _> = caches.iter_mut().collect();
                let started = std::time::Instant::now();
                for _ in 0..steps {
                    black_box(int8.step(&mut caches, &tokens, None).unwrap());
                }
                started.elapsed()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
