//! SmolLM2-135M tensor forward: full precision (a 128-token prefill with
//! and without observation, whose hook must cost ≤ 15 %, and one decode
//! step) and the INT8 engine with dynamic per-token activations (prefill,
//! decode step). The INT8 decoder's step is `qforge-decode`'s bench.
//!
//! Run: `cargo bench -p qforge-model --bench forward` (needs
//! scripts/fetch-models.sh).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use qforge_model::{Activations, Llama, Logits, Statistics, StatsObserver};

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
}

criterion_group!(benches, bench);
criterion_main!(benches);
