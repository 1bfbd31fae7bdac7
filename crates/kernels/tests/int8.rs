//! The INT8 kernels against their scalar references: quantizer tiers agree
//! exactly with the scalar twin; the GEMM's i32 sums equal exact integer sums
//! (so no pair of products saturates) on odd shapes and M = 1, including the
//! worst-case operands; the INT8 layer agrees with a dequantize-then-f32
//! simulation within the derived rounding bound.

use qforge_core::CpuTier;
use qforge_kernels::quantize::{quantize_per_token_reference, quantize_per_token_with};
use qforge_kernels::{
    Activations, GemmTier, Int8Linear, QuantizeTier, Scratch, WEIGHT_QMAX, ZERO_POINT,
    quantize_rows_symmetric,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

const U: f64 = f32::EPSILON as f64 / 2.0; // unit roundoff of f32

fn gaussian(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = StandardNormal.sample(rng);
            v * scale
        })
        .collect()
}

#[test]
fn quantizer_tiers_equal_the_scalar_twin() {
    let mut rng = StdRng::seed_from_u64(1);
    for &tier in QuantizeTier::ALL {
        if !tier.is_supported() {
            eprintln!("SKIPPED: this CPU lacks the {tier:?} quantizer tier");
            continue;
        }
        for cols in [1usize, 3, 7, 8, 9, 16, 31, 64, 577] {
            let rows = rng.random_range(1..6);
            let mut x = gaussian(&mut rng, rows * cols, 3.0);
            // An all-zero row, a row with NaN, a row with an infinity.
            if rows > 1 {
                x[..cols].fill(0.0);
            }
            if rows > 2 {
                x[cols + cols / 2] = f32::NAN;
            }
            if rows > 3 {
                x[2 * cols] = f32::NEG_INFINITY;
            }
            let (mut q, mut s) = (vec![0u8; x.len()], vec![0f32; rows]);
            let (mut q_ref, mut s_ref) = (q.clone(), s.clone());
            quantize_per_token_with(tier, &x, cols, &mut q, &mut s).unwrap();
            quantize_per_token_reference(&x, cols, &mut q_ref, &mut s_ref).unwrap();
            assert_eq!(q, q_ref, "{tier:?} cols {cols}");
            assert_eq!(
                s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                s_ref.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{tier:?} cols {cols}"
            );
        }
    }
}

/// The layer's output computed from exact integer sums of the same quantized
/// operands, with the epilogue's f32 formula.
fn exact(x: &[f32], weight: &[f32], bias: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
    let (mut qa, mut sa) = (vec![0u8; m * k], vec![0f32; m]);
    quantize_per_token_reference(x, k, &mut qa, &mut sa).unwrap();
    let (qw, sw) = quantize_rows_symmetric(weight, k, WEIGHT_QMAX);
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let sum: i64 = (0..k)
                .map(|p| {
                    (i64::from(qa[i * k + p]) - i64::from(ZERO_POINT)) * i64::from(qw[j * k + p])
                })
                .sum();
            let sum = i32::try_from(sum).unwrap();
            y[i * n + j] = sum as f32 * (sa[i] * sw[j]) + bias[j];
        }
    }
    y
}

#[test]
fn gemm_sums_are_exact_on_odd_shapes_and_worst_case_operands() {
    eprintln!(
        "GEMM kernel: {}, weight qmax {}",
        GemmTier::detect().name(),
        WEIGHT_QMAX
    );
    let mut rng = StdRng::seed_from_u64(2);
    let mut scratch = Scratch::default();
    for &(m, n, k) in &[
        (1, 1, 1),
        (1, 64, 576),
        (2, 3, 5),
        (3, 17, 31),
        (7, 100, 129),
        (16, 64, 64),
        (33, 9, 1537),
        (128, 48, 96),
    ] {
        let x = gaussian(&mut rng, m * k, 2.0);
        let w = gaussian(&mut rng, n * k, 0.05);
        let b = gaussian(&mut rng, n, 0.1);
        let layer = Int8Linear::new(&w, (n, k), Some(&b), Activations::Dynamic).unwrap();
        let y = layer.forward(&x, m, &mut scratch).unwrap();
        assert_eq!(y, exact(&x, &w, &b, (m, n, k)), "m {m} n {n} k {k}");
    }
    // Worst case for a pairwise-summing kernel: every activation at +127
    // (u8 255) against weights at ±qmax, same sign in each pair.
    let (m, n, k) = (2, 8, 256);
    let x = vec![1.0f32; m * k];
    let w: Vec<f32> = (0..n * k)
        .map(|i| if (i / k) % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let b = vec![0f32; n];
    let layer = Int8Linear::new(&w, (n, k), Some(&b), Activations::Dynamic).unwrap();
    let y = layer.forward(&x, m, &mut scratch).unwrap();
    assert_eq!(y, exact(&x, &w, &b, (m, n, k)));
    assert!((y[0] - k as f32).abs() < 1e-3 * k as f32, "{}", y[0]);
}

/// Bound (derived): the INT8 path computes the exact integer sum S, then
/// rounds S to f32 (k·127·qmax can exceed 2²⁴), the scale product, the
/// product and the bias addition: at most 4 roundings, ≤ 4u(|y| + |b|)
/// with u = 2⁻²⁴. A dequantize-then-f32 simulation rounds each of the k
/// products and k additions: ≤ (k + 1)u Σ|ã w̃| + u|b| (Higham, recursive
/// summation). Both sit around the same exact value, so they differ by at
/// most (k + 6)u (Σ|ã w̃| + |b|).
#[test]
fn int8_forward_matches_the_dequantized_simulation_within_the_rounding_bound() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut scratch = Scratch::default();
    let mut worst = 0f64;
    for &(m, n, k) in &[(1, 32, 576), (5, 31, 1536), (16, 64, 49), (64, 96, 576)] {
        let x = gaussian(&mut rng, m * k, 1.0);
        let w = gaussian(&mut rng, n * k, 0.04);
        let b = gaussian(&mut rng, n, 0.1);
        let layer = Int8Linear::new(&w, (n, k), Some(&b), Activations::Dynamic).unwrap();
        let y = layer.forward(&x, m, &mut scratch).unwrap();
        let (mut qa, mut sa) = (vec![0u8; m * k], vec![0f32; m]);
        quantize_per_token_reference(&x, k, &mut qa, &mut sa).unwrap();
        let (qw, sw) = quantize_rows_symmetric(&w, k, WEIGHT_QMAX);
        for i in 0..m {
            for j in 0..n {
                let (mut sim, mut magnitude) = (0f32, 0f64);
                for p in 0..k {
                    let a = (f32::from(qa[i * k + p]) - 128.0) * sa[i];
                    let v = f32::from(qw[j * k + p]) * sw[j];
                    sim += a * v;
                    magnitude += f64::from((a * v).abs());
                }
                sim += b[j];
                let bound = (k as f64 + 6.0) * U * (magnitude + f64::from(b[j].abs()));
                let gap = f64::from((y[i * n + j] - sim).abs());
                assert!(
                    gap <= bound,
                    "m {m} n {n} k {k}: gap {gap:e} > bound {bound:e}"
                );
                worst = worst.max(gap / bound);
            }
        }
    }
    eprintln!("largest gap / bound: {worst:.3}");
}

#[test]
fn dynamic_int8_keeps_a_high_sqnr_against_fp32_and_static_scales_work() {
    let mut rng = StdRng::seed_from_u64(4);
    let (m, n, k) = (32, 64, 256);
    let x = gaussian(&mut rng, m * k, 1.0);
    let w = gaussian(&mut rng, n * k, 0.06);
    let fp: Vec<f32> = (0..m * n)
        .map(|idx| {
            let (i, j) = (idx / n, idx % n);
            (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum()
        })
        .collect();
    let sqnr = |y: &[f32]| {
        let signal: f64 = fp.iter().map(|v| f64::from(*v).powi(2)).sum();
        let noise: f64 = fp
            .iter()
            .zip(y)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        10.0 * (signal / noise).log10()
    };
    let mut scratch = Scratch::default();
    let dynamic = Int8Linear::new(&w, (n, k), None, Activations::Dynamic).unwrap();
    let y = dynamic.forward(&x, m, &mut scratch).unwrap();
    let absmax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let fixed = Int8Linear::new(&w, (n, k), None, Activations::Static(absmax / 127.0)).unwrap();
    let y_static = fixed.forward(&x, m, &mut scratch).unwrap();
    let (d, s) = (sqnr(&y), sqnr(&y_static));
    eprintln!("SQNR vs FP32: dynamic {d:.1} dB, static min-max {s:.1} dB");
    // Gaussian operands at 8 bits (7 on AVX2 weights): well above 25 dB.
    assert!(d > 25.0 && s > 25.0, "dynamic {d:.1} dB, static {s:.1} dB");
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    assert!(Int8Linear::new(&[1.0; 6], (2, 4), None, Activations::Dynamic).is_err());
    assert!(Int8Linear::new(&[1.0; 8], (2, 4), Some(&[0.0]), Activations::Dynamic).is_err());
    let layer = Int8Linear::new(&[1.0; 8], (2, 4), None, Activations::Dynamic).unwrap();
    let mut scratch = Scratch::default();
    assert!(layer.forward(&[1.0; 5], 1, &mut scratch).is_err());
    assert_eq!(
        layer.forward(&[], 0, &mut scratch).unwrap(),
        Vec::<f32>::new()
    );
}

#[test]
fn prequantized_weights_load_as_the_layer_that_made_them() {
    let mut rng = StdRng::seed_from_u64(11);
    let (n, k, m) = (37, 53, 5);
    let weight = gaussian(&mut rng, n * k, 0.05);
    let bias = gaussian(&mut rng, n, 0.1);
    let x = gaussian(&mut rng, m * k, 1.0);
    let mut scratch = Scratch::default();
    let made = Int8Linear::new(&weight, (n, k), Some(&bias), Activations::Dynamic).unwrap();
    let want = made.forward(&x, m, &mut scratch).unwrap();

    // What an artifact written on this CPU holds: the engine's own values.
    let (values, scales) = quantize_rows_symmetric(&weight, k, WEIGHT_QMAX);
    let loaded =
        Int8Linear::from_quantized(&values, scales, (n, k), Some(&bias), Activations::Dynamic)
            .unwrap();
    assert_eq!(loaded.forward(&x, m, &mut scratch).unwrap(), want);

    // Corrupt scales are refused, not multiplied through.
    let (values, mut scales) = quantize_rows_symmetric(&weight, k, WEIGHT_QMAX);
    scales[3] = f32::NAN;
    assert!(
        Int8Linear::from_quantized(&values, scales, (n, k), None, Activations::Dynamic).is_err()
    );
}
