//! SmolLM2-135M on the INT8 decoder (what `generate` and `serve` run): one
//! step after 128 tokens plain, with the residual rotated offline, and with
//! QuaRot's online down_proj rotation on top; and one step of 1 to 256
//! sequences each 128 positions in, against the tensor forward's batched
//! step with INT8 linear layers (`Llama::step`, attention per sequence as
//! candle ops), the engine's step before the decoder.
//!
//! Run: `cargo bench -p qforge-decode --bench decode` (needs
//! scripts/fetch-models.sh).

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use qforge_decode::Decoder;
use qforge_model::RotatedInput;

fn bench(c: &mut Criterion) {
    let model = support::smollm2();
    let prompt: Vec<u32> = (0..128u32).map(|i| (i * 997 + 13) % 49152).collect();
    let int8 = support::int8(&model);
    // The same decoder with the residual rotated offline (no run-time cost)
    // and down_proj's input rotated online: what the rotation costs a step.
    let residual = model.residual_rotated(0).expect("the residual rotation");
    let quarot = support::int8(
        &residual
            .rotated(&[RotatedInput::MlpProduct])
            .expect("QuaRot"),
    );
    let residual = support::int8(&residual);
    let mut decoder = Decoder::new(rayon::current_num_threads()).expect("decode threads");
    let mut group = c.benchmark_group("smollm2_int8_decoder");
    group.sample_size(20);
    group.throughput(Throughput::Elements(1));
    for (name, model) in [
        ("plain", &int8),
        ("residual", &residual),
        ("quarot", &quarot),
    ] {
        let cache = support::prefilled_cache(model, &prompt);
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
    let cache = support::prefilled_cache(&int8, &prompt);
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
