//! INT8 GEMM on SmolLM2-135M's and Llama-3-8B's layer shapes: qforge's
//! kernel (raw u8 × i8 → i32 sums on prepacked weights, ONNX Runtime
//! `MatMulInteger`'s scope), the whole INT8 layer (dynamic per-token
//! quantization + GEMM + dequantizing epilogue), rten-gemm's prepacked kernel
//! (the engine's GEMM before qforge had its own; raw sums like ours) and
//! candle's f32 matmul. All on rayon's default pool. Throughput is in
//! multiply-accumulates (m·n·k) per second.

mod support;

use candle_core::{Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qforge_core::CpuTier;
use qforge_kernels::{Activations, GemmTier, Int8Linear, PackedWeights, Scratch};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rten_gemm::{GemmExecutor, GemmInputA, GemmInputB, GemmOptions, QuantParams};
use rten_tensor::NdTensorView;

const ALL_M: &[usize] = &[1, 16, 128, 512];

/// (name, out, in, batch rows). Llama-3-8B's lm_head (128256 × 4096) is left
/// out: its f32 copy alone is 2.1 GB.
const SHAPES: [(&str, usize, usize, &[usize]); 8] = [
    ("smollm2_q_proj_576x576", 576, 576, ALL_M),
    ("smollm2_gate_proj_1536x576", 1536, 576, ALL_M),
    ("smollm2_down_proj_576x1536", 576, 1536, ALL_M),
    ("smollm2_lm_head_49152x576", 49152, 576, &[1, 16]),
    ("llama3_8b_q_proj_4096x4096", 4096, 4096, ALL_M),
    ("llama3_8b_k_proj_1024x4096", 1024, 4096, ALL_M),
    ("llama3_8b_gate_proj_14336x4096", 14336, 4096, ALL_M),
    ("llama3_8b_down_proj_4096x14336", 4096, 14336, ALL_M),
];

fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn gemm(c: &mut Criterion) {
    let tier = GemmTier::detect();
    let rten = GemmExecutor::<u8, i8, i32>::new();
    eprintln!(
        "qforge GEMM tier: {}; rten-gemm kernel: {}; rayon threads: {}",
        tier.name(),
        rten.kernel_name(),
        rayon::current_num_threads()
    );
    let mut rng = StdRng::seed_from_u64(0);
    let mut group = c.benchmark_group("gemm");
    for (name, n, k, rows) in SHAPES {
        let w = values(&mut rng, n * k);
        let layer = Int8Linear::new(&w, (n, k), None, Activations::Dynamic).unwrap();
        // Any values in ±127 cost every tier the same.
        let w_i8: Vec<i8> = (0..n * k).map(|i| ((i % 255) as i32 - 127) as i8).collect();
        let packed = PackedWeights::new(tier, &w_i8, n, k).unwrap();
        let rten_packed = rten.prepack_b(NdTensorView::from_data([n, k], &w_i8[..]).transposed());
        let w_t = Tensor::from_vec(w, (n, k), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        for &m in rows {
            let x = values(&mut rng, m * k);
            let x_tensor = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let a: Vec<u8> = (0..m * packed.row_stride()).map(|_| rng.random()).collect();
            let a_rten: Vec<u8> = (0..m * k).map(|_| rng.random()).collect();
            let zero_points = vec![128u8; m];
            let mut sums = Vec::new();
            let mut rten_out = vec![0i32; m * n];
            let mut scratch = Scratch::default();
            let mut y = vec![0f32; m * n];
            group.throughput(Throughput::Elements((m * n * k) as u64));
            group.bench_function(BenchmarkId::new(format!("qforge_gemm_{name}"), m), |b| {
                b.iter(|| packed.sums(&a, m, &mut sums))
            });
            group.bench_function(BenchmarkId::new(format!("qforge_layer_{name}"), m), |b| {
                b.iter(|| layer.forward_into(&x, m, &mut scratch, &mut y).unwrap())
            });
            group.bench_function(BenchmarkId::new(format!("rten_gemm_{name}"), m), |b| {
                b.iter(|| {
                    rten.gemm(
                        &mut rten_out,
                        GemmInputA::Unpacked(NdTensorView::from_data([m, k], &a_rten[..])),
                        GemmInputB::Packed(&rten_packed),
                        GemmOptions {
                            a_quant: Some(QuantParams {
                                zero_point: &zero_points,
                            }),
                            ..GemmOptions::default()
                        },
                    )
                    .unwrap()
                })
            });
            group.bench_function(BenchmarkId::new(format!("candle_f32_{name}"), m), |b| {
                b.iter(|| x_tensor.matmul(&w_t).unwrap())
            });
        }
    }
    group.finish();
}

fn sum(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |acc, &w| acc.wrapping_add(w))
}

/// One thread, then two (each streaming its half), reading a 256 MiB buffer
/// far beyond the caches: the read bandwidth a decode step is bounded by.
fn read_bandwidth(c: &mut Criterion) {
    let words = vec![1u64; 32 << 20];
    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Bytes((words.len() * 8) as u64));
    group.bench_function("read_one_thread_256MiB", |b| b.iter(|| sum(&words)));
    let (low, high) = words.split_at(words.len() / 2);
    group.bench_function("read_two_threads_256MiB", |b| {
        b.iter(|| {
            std::thread::scope(|s| {
                let other = s.spawn(|| sum(high));
                sum(low).wrapping_add(other.join().expect("reader thread"))
            })
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = support::config();
    targets = gemm, read_bandwidth
}
criterion_main!(benches);
