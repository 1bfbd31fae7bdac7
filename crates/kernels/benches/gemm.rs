//! INT8 GEMM (dynamic per-token quantization + u8×i8→i32 GEMM + epilogue, as
//! the INT8 linear layer runs it) against candle's f32 matmul, on SmolLM2's
//! layer shapes. Throughput is in multiply-accumulates (m·n·k) per second.

use candle_core::{Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_kernels::{Activations, Int8Linear, Scratch, gemm_kernel_name};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// (name, out, in, batch rows): SmolLM2-135M's q/o projection, gate/up,
/// down and lm_head, and a 2048² layer at M = 512 (a Llama-scale prefill tile).
const SHAPES: [(&str, usize, usize, &[usize]); 5] = [
    ("q_proj_576x576", 576, 576, &[1, 16, 128]),
    ("gate_proj_1536x576", 1536, 576, &[1, 16, 128]),
    ("down_proj_576x1536", 576, 1536, &[1, 16, 128]),
    ("lm_head_49152x576", 49152, 576, &[1]),
    ("square_2048x2048", 2048, 2048, &[512]),
];

fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn gemm(c: &mut Criterion) {
    eprintln!("int8 GEMM kernel: {}", gemm_kernel_name());
    let mut rng = StdRng::seed_from_u64(0);
    let mut group = c.benchmark_group("gemm");
    for (name, n, k, rows) in SHAPES {
        let w = values(&mut rng, n * k);
        let layer = Int8Linear::new(&w, (n, k), None, Activations::Dynamic).unwrap();
        let w_t = Tensor::from_vec(w, (n, k), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        for &m in rows {
            let x = values(&mut rng, m * k);
            let x_tensor = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let mut scratch = Scratch::default();
            let mut y = vec![0f32; m * n];
            group.throughput(Throughput::Elements((m * n * k) as u64));
            group.bench_function(BenchmarkId::new(format!("int8_{name}"), m), |b| {
                b.iter(|| layer.forward_into(&x, m, &mut scratch, &mut y).unwrap())
            });
            group.bench_function(BenchmarkId::new(format!("candle_f32_{name}"), m), |b| {
                b.iter(|| x_tensor.matmul(&w_t).unwrap())
            });
        }
    }
    group.finish();
}

/// One thread streaming a 256 MiB buffer (far beyond the caches): the read
/// bandwidth a single-threaded decode step is bounded by.
fn read_bandwidth(c: &mut Criterion) {
    let words = vec![1u64; 32 << 20];
    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Bytes((words.len() * 8) as u64));
    group.bench_function("read_one_thread_256MiB", |b| {
        b.iter(|| words.iter().fold(0u64, |acc, &w| acc.wrapping_add(w)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2))
        .sample_size(20);
    targets = gemm, read_bandwidth
}
criterion_main!(benches);
