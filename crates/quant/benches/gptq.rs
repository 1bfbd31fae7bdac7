//! GPTQ's solver: preparing a layer input's inverse Hessian factor
//! (`Gptq::new`: the dampened Cholesky factorization and a triangular
//! inverse) and rounding a layer's weights with it (`Gptq::round`), on the
//! input widths of SmolLM2 (576, and 1 536 for `down_proj`), of
//! Llama-3.2-1B (2 048) and of Llama-3-8B (4 096). The Hessians are Gram
//! matrices of correlated inputs, as a layer's are.
//!
//! Throughput counts multiply-adds: `n³ / 3` each for the factorization and
//! the inverse, `out · n² / 2` for the rounding's updates.
//!
//! Run: `cargo bench -p qforge-quant --bench gptq`

use std::hint::black_box;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::Gram;
use qforge_quant::gptq::{Gptq, GptqOptions};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

/// The Hessian of `rows` inputs mixing 32 shared sources with noise.
fn hessian(n: usize, rows: usize, rng: &mut StdRng) -> Vec<f64> {
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let sources = 32;
    let mixing: Vec<f32> = (0..sources * n).map(|_| normal.sample(rng)).collect();
    let mut x = vec![0f32; rows * n];
    for row in x.chunks_exact_mut(n) {
        let s: Vec<f32> = (0..sources).map(|_| normal.sample(rng)).collect();
        for (c, v) in row.iter_mut().enumerate() {
            *v = (0..sources).map(|k| s[k] * mixing[k * n + c]).sum::<f32>()
                + 0.1 * normal.sample(rng);
        }
    }
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut gram =
        Gram::new(n, Gram::exponent_for(max, rows as u64).expect("finite")).expect("width ≥ 1");
    gram.observe(&x).expect("in range");
    gram.into_matrix()
}

fn bench_gptq(c: &mut Criterion) {
    let mut group = c.benchmark_group("gptq");
    group.sample_size(10);
    let mut rng = StdRng::seed_from_u64(11);
    let options = GptqOptions::default();
    // (input width, output rows): SmolLM2's gate/up and down_proj, the 1B
    // shape's q_proj, Llama-3-8B's k_proj.
    for (n, out) in [(576, 1536), (1536, 576), (2048, 2048), (4096, 1024)] {
        let h = hessian(n, 2 * n, &mut rng);
        let cube = (n * n * n) as u64;
        group.throughput(Throughput::Elements(2 * cube / 3));
        group.bench_with_input(BenchmarkId::new("factor", n), &h, |b, h| {
            // The solver consumes its Hessian; the copy is made outside the timing.
            b.iter_batched(
                || h.clone(),
                |h| Gptq::new(black_box(h), n, &options).expect("positive definite"),
                BatchSize::LargeInput,
            );
        });
        let gptq = Gptq::new(h, n, &options).expect("positive definite");
        let weight: Vec<f32> = (0..out * n)
            .map(|_| rng.random_range(-0.05..0.05))
            .collect();
        group.throughput(Throughput::Elements((out * n * n / 2) as u64));
        group.bench_with_input(
            BenchmarkId::new("round", format!("{out}x{n}")),
            &weight,
            |b, w| b.iter(|| gptq.round(black_box(w), out).expect("finite weights")),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_gptq);
criterion_main!(benches);
