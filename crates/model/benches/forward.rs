//! SmolLM2-135M full-precision forward: a 128-token prefill with and without
//! observation (calibration's hook must cost ≤ 15 %), and one decode step.
//!
//! Run: `cargo bench -p qforge-model --bench forward` (needs
//! scripts/fetch-models.sh).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use qforge_model::{Llama, Logits, StatsObserver};

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

fn bench(c: &mut Criterion) {
    let model = model();
    let prompt: Vec<u32> = (0..128u32).map(|i| (i * 997 + 13) % 49152).collect();
    let mut group = c.benchmark_group("smollm2_fp32");
    group.sample_size(10);
    group.throughput(Throughput::Elements(prompt.len() as u64));
    group.bench_function("prefill_128", |b| {
        b.iter(|| {
            model
                .forward(
                    black_box(std::slice::from_ref(&prompt)),
                    None,
                    None,
                    Logits::Last,
                )
                .unwrap()
        })
    });
    group.bench_function("prefill_128_observed", |b| {
        b.iter(|| {
            let mut observer = StatsObserver::new(true);
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
    group.throughput(Throughput::Elements(1));
    group.bench_function("decode_step_at_128", |b| {
        let mut cache = model.new_cache();
        model
            .forward(
                std::slice::from_ref(&prompt),
                Some(&mut cache),
                None,
                Logits::Last,
            )
            .unwrap();
        b.iter_batched(
            || cache.clone(),
            |mut cache| {
                model
                    .forward(black_box(&[vec![42]]), Some(&mut cache), None, Logits::Last)
                    .unwrap()
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
