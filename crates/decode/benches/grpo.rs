//! GRPO's rollout step on SmolLM2-135M's INT8 decoder: prompts × 8
//! samples, 64 tokens into their completions, the samples forked from
//! their prompt's prefill (as a request with `n = 8` runs, attention
//! reading each prompt's positions once for its samples) or prefilled each
//! on their own (independent requests), on the rollout benchmark's chat
//! prompts (~48 tokens) and on a long shared prompt (512 tokens: few-shot
//! examples, a task's instructions).
//!
//! Run: `cargo bench -p qforge-decode --bench grpo` (needs
//! scripts/fetch-models.sh; ~7 GiB of memory for the long prompts' caches).

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use qforge_decode::Decoder;
use qforge_model::{KvCache, Llama};

fn bench(c: &mut Criterion) {
    let int8 = support::int8(&support::smollm2());
    let mut decoder = Decoder::new(rayon::current_num_threads()).expect("decode threads");
    for shape in [(32, 48), (16, 512)] {
        grpo_step(c, &mut decoder, &int8, shape);
    }
}

/// GRPO's shape: `prompts` prompts of `prompt` tokens, 8 samples each, 64
/// tokens into their completions (the middle of a 128-token rollout), one
/// step of them all. The samples either forked from their prompt's prefill
/// (as `n = 8` runs: attention reads each prompt's positions once for its
/// 8 samples) or prefilled each on their own (independent requests); the
/// caches hold the same bits either way.
fn grpo_step(
    c: &mut Criterion,
    decoder: &mut Decoder,
    int8: &Llama,
    (prompts, prompt): (usize, usize),
) {
    const SAMPLES: usize = 8;
    const DRAWN: u32 = 64;
    let sequences = prompts * SAMPLES;
    let text: Vec<u32> = (0..(prompts * prompt) as u32)
        .map(|i| (i * 389 + 7) % 49152)
        .collect();
    let mut prefill = |count: usize, prompt_of: &dyn Fn(usize) -> usize| -> Vec<_> {
        let mut caches: Vec<_> = (0..count).map(|_| int8.new_cache()).collect();
        let tokens: Vec<u32> = (0..count)
            .flat_map(|s| text[prompt_of(s) * prompt..][..prompt].to_vec())
            .collect();
        let mut refs: Vec<&mut _> = caches.iter_mut().collect();
        decoder
            .step_chunks(int8, &mut refs, &tokens, &vec![prompt; count], None)
            .expect("prefill");
        caches
    };
    let independent = prefill(sequences, &|s| s / SAMPLES);
    let forked: Vec<_> = prefill(prompts, &|p| p)
        .into_iter()
        .flat_map(|mut origin| {
            let mut samples: Vec<_> = (1..SAMPLES).map(|_| origin.fork()).collect();
            samples.push(origin);
            samples
        })
        .collect();
    let token = |s: usize, step: u32| 100 + (s as u32 * 7919 + step * 104_729) % 40_000;
    let mut drawn = |mut caches: Vec<KvCache>| {
        for step in 0..DRAWN {
            let tokens: Vec<u32> = (0..sequences).map(|s| token(s, step)).collect();
            let mut refs: Vec<&mut _> = caches.iter_mut().collect();
            decoder.step(int8, &mut refs, &tokens, None).expect("draw");
        }
        caches
    };
    let (independent, forked) = (drawn(independent), drawn(forked));
    let mut group = c.benchmark_group(format!(
        "smollm2_int8_grpo_step_{prompts}x{SAMPLES}_prompt_{prompt}"
    ));
    group.sample_size(10);
    // Several steps per sample: one step's time swings with the machine.
    group.measurement_time(std::time::Duration::from_secs(20));
    group.throughput(Throughput::Elements(sequences as u64));
    let tokens: Vec<u32> = (0..sequences).map(|s| token(s, DRAWN)).collect();
    for (name, start) in [("independent", &independent), ("forked", &forked)] {
        group.bench_function(name, |b| {
            b.iter_custom(|steps| {
                let mut caches: Vec<_> = start
                    .iter()
                    .map(|cache| {
                        let mut cache = cache.clone();
                        cache.reserve(cache.len() + steps as usize);
                        cache
                    })
                    .collect();
                let mut refs: Vec<&mut _> = caches.iter_mut().collect();
                let started = std::time::Instant::now();
                for _ in 0..steps {
                    black_box(decoder.step(int8, &mut refs, &tokens, None).unwrap());
                }
                started.elapsed()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
