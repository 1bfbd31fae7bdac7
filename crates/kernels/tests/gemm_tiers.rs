//! Every GEMM tier against the definition: the signed sums (raw sums less
//! the tier's offsets) equal exactly on random shapes (odd `n` and `k`,
//! M = 1 and partial register tiles, split input ranges) with full 8-bit
//! weights, on the worst-case operands of each tier, and a layer split over
//! two threads (by inputs and by channels) equals the same layer on one.

use qforge_core::CpuTier;
use qforge_kernels::gemm::{GemmTier, MAX_INPUTS, PANEL, PackedWeights, WEIGHT_QMAX};
use qforge_kernels::{Activations, Int8Linear, Scratch};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn supported(tier: GemmTier) -> bool {
    let ok = tier.is_supported();
    if !ok {
        eprintln!("SKIPPED: this CPU lacks the {} GEMM tier", tier.name());
    }
    ok
}

/// Raw sums of `rows` rows over every input group (as one range, or as
/// `split_in` shares), every panel, on `tier`, added up, less the tier's
/// offsets: the signed sums.
fn sums(
    tier: GemmTier,
    w: &[i8],
    (n, k): (usize, usize),
    a: &[u8],
    rows: usize,
    split_in: Option<usize>,
) -> Vec<i32> {
    let packed = PackedWeights::new(tier, w, n, k).unwrap();
    let groups = packed.groups_per_panel();
    let bounds = match split_in {
        None => vec![0, groups],
        Some(parts) => (0..parts)
            .map(|part| packed.group_share(parts, part).start)
            .chain([groups])
            .collect(),
    };
    let mut total = vec![0; packed.panels() * rows * PANEL];
    for groups in bounds.windows(2).map(|b| b[0]..b[1]) {
        let mut c = vec![0; total.len()];
        packed.raw_sums(a, rows, 0..packed.panels(), groups, &mut c);
        total.iter_mut().zip(&c).for_each(|(t, c)| *t += c);
    }
    for (i, t) in total.iter_mut().enumerate() {
        let channel = (i / (rows * PANEL)) * PANEL + i % PANEL;
        if channel < n {
            *t -= packed.offsets()[channel];
        }
    }
    total
}

/// Bytes per activation row the tier's kernel reads: `k` padded to its step
/// of inputs.
fn row_stride(tier: GemmTier, k: usize) -> usize {
    let span = 4 * tier.groups_per_step();
    k.div_ceil(span) * span
}

/// `Σ (a − 128) · w` from the definition in i64, laid out as the kernels lay
/// them out (`[panel][row][PANEL]`, padded channels 0).
fn definition(w: &[i8], (n, k): (usize, usize), a: &[u8], rows: usize, stride: usize) -> Vec<i32> {
    let panels = n.div_ceil(PANEL);
    let mut c = vec![0; panels * rows * PANEL];
    for r in 0..rows {
        for ch in 0..n {
            let s: i64 = (0..k)
                .map(|i| (i64::from(a[r * stride + i]) - 128) * i64::from(w[ch * k + i]))
                .sum();
            c[((ch / PANEL) * rows + r) * PANEL + ch % PANEL] = i32::try_from(s).unwrap();
        }
    }
    c
}

#[test]
fn every_tier_equals_the_definition_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(7);
    let shapes: [(usize, usize, usize); 10] = [
        (1, 1, 1),
        (1, 64, 4),
        (1, 65, 3),
        (2, 127, 5),
        (3, 200, 33),
        (5, 64, 576),
        (6, 130, 257),
        (7, 17, 1001),
        (13, 192, 64),
        (1, 576, 1536),
    ];
    for &tier in GemmTier::ALL {
        if !supported(tier) {
            continue;
        }
        let qmax = WEIGHT_QMAX;
        for &(rows, n, k) in &shapes {
            let w: Vec<i8> = (0..n * k).map(|_| rng.random_range(-qmax..=qmax)).collect();
            let stride = row_stride(tier, k);
            // Padding bytes are random: padded weights are zero, so they
            // must not matter.
            let a: Vec<u8> = (0..rows * stride).map(|_| rng.random()).collect();
            let want = definition(&w, (n, k), &a, rows, stride);
            let got = sums(tier, &w, (n, k), &a, rows, None);
            assert_eq!(got, want, "{} rows {rows} n {n} k {k}", tier.name());
            // Shares of the inputs add up to the whole (some empty when
            // there are fewer groups than shares).
            for parts in [2, 3] {
                let split = sums(tier, &w, (n, k), &a, rows, Some(parts));
                assert_eq!(split, want, "{} split in {parts}", tier.name());
            }
        }
    }
}

#[test]
fn worst_case_operands_do_not_saturate_any_tier() {
    // Activations all at one byte against weights at ±127, same sign within
    // each channel: 255 (q = 127) gives the largest raw sums the stored-byte
    // tiers form, and reaches i32's limit on the longest allowed row; 0
    // (q = −128, which the quantizer never writes) gives AVX2's largest pair
    // sums, 2 · 128 · 127.
    for &tier in GemmTier::ALL {
        if !supported(tier) {
            continue;
        }
        for (rows, n, k) in [(2usize, 4usize, 512usize), (1, 2, MAX_INPUTS)] {
            let w: Vec<i8> = (0..n * k)
                .map(|i| {
                    if (i / k) % 2 == 0 {
                        WEIGHT_QMAX
                    } else {
                        -WEIGHT_QMAX
                    }
                })
                .collect();
            let stride = row_stride(tier, k);
            for byte in [255u8, 0, 1] {
                let a = vec![byte; rows * stride];
                let got = sums(tier, &w, (n, k), &a, rows, None);
                assert_eq!(
                    got,
                    definition(&w, (n, k), &a, rows, stride),
                    "{} byte {byte}",
                    tier.name()
                );
                let extreme = (i64::from(byte) - 128) * i64::from(WEIGHT_QMAX) * k as i64;
                assert_eq!(i64::from(got[0]), extreme, "{} k {k}", tier.name());
                assert_eq!(i64::from(got[1]), -extreme, "{} k {k}", tier.name());
            }
        }
    }
}

#[test]
fn asymmetric_weights_and_rows_beyond_i32_are_refused() {
    for &tier in GemmTier::ALL {
        if !supported(tier) {
            continue;
        }
        let err = PackedWeights::new(tier, &[0, i8::MIN], 1, 2).unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
        let k = MAX_INPUTS + 1;
        let err = PackedWeights::new(tier, &vec![0; k], 1, k).unwrap_err();
        assert!(err.to_string().contains("overflow"), "{err}");
        assert!(PackedWeights::new(tier, &[0; 5], 2, 3).is_err());
    }
}

#[test]
fn two_threads_give_the_one_thread_bits() {
    let mut rng = StdRng::seed_from_u64(8);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let two = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    // All large enough to be split at all (≥ 30 µs on one thread). Up to 16
    // rows and fewer than 16 panels per thread split the inputs (two partial
    // sums); many panels or more rows split the panels (one); 9 panels do not
    // halve evenly.
    for (rows, n, k, parts) in [
        (1usize, 1500usize, 2001usize, 2usize),
        (16, 1200, 1100, 2),
        (1, 4000, 1001, 1),
        (17, 1000, 900, 1),
        (40, 576, 1000, 1),
    ] {
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-4.0..4.0)).collect();
        let layer = Int8Linear::new(&w, (n, k), Some(&b), Activations::Dynamic).unwrap();
        let run = |pool: &rayon::ThreadPool| {
            pool.install(|| layer.forward(&x, rows, &mut Scratch::default()).unwrap())
        };
        let (y1, y2) = (run(&one), run(&two));
        let packed = layer.packed();
        let a = vec![128u8; rows * packed.row_stride()];
        let got = two.install(|| packed.sums(&a, rows, &mut Vec::new()));
        assert_eq!(got, parts, "partial sums for rows {rows} n {n} k {k}");
        assert_eq!(
            y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "rows {rows} n {n} k {k}"
        );
    }
}

/// The count of differing values between two packings of the same shape on
/// every tier is the count of positions where the row-major values differ
/// (padding never counts), and packings of another shape are not compared.
#[test]
fn differing_values_count_the_changed_weights_exactly() {
    let mut rng = StdRng::seed_from_u64(11);
    let (n, k) = (PANEL + 3, 37);
    let before: Vec<i8> = (0..n * k)
        .map(|_| rng.random_range(-WEIGHT_QMAX..=WEIGHT_QMAX))
        .collect();
    let mut after = before.clone();
    let mut changed = 0;
    for (i, v) in after.iter_mut().enumerate() {
        if i % 7 == 3 {
            *v = if *v == 0 { 1 } else { -*v };
            changed += 1;
        }
    }
    for &tier in GemmTier::ALL {
        if !supported(tier) {
            continue;
        }
        let a = PackedWeights::new(tier, &before, n, k).unwrap();
        let b = PackedWeights::new(tier, &after, n, k).unwrap();
        assert_eq!(a.differing_values(&a), Some(0), "{}", tier.name());
        assert_eq!(a.differing_values(&b), Some(changed), "{}", tier.name());
        let other = PackedWeights::new(tier, &before, k, n).unwrap();
        assert_eq!(a.differing_values(&other), None, "{}", tier.name());
    }
}
