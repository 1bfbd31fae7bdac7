//! `e^x` for `x ≤ 0` in fixed f32 arithmetic, and the softmaxes built on
//! it: attention's (in [`crate::attention`]) and the sampler's weights over
//! a vocabulary.
//!
//! `exp` is a degree-7 polynomial after the usual `x = n·ln 2 + r`
//! reduction (as Cephes' `expf`), within 2 ulp of the exact value, and
//! exactly 0 below `ln(f32::MIN_POSITIVE)` (a term that small moves no f32
//! sum whose largest term is 1). Its AVX2 form computes the same bits as
//! the scalar one, so every pass here gives the same bits on every tier:
//! a machine with AVX2 and one without (or an aarch64 one) draw the same
//! tokens for the same seed.
//!
//! The libm `exp` the sampler's weights replace cost the serving engine a
//! tenth of its time: a draw at temperature 1 took one f64 `exp` per
//! vocabulary entry (49 152 for SmolLM2), a call the compiler cannot
//! vectorize. SwiGLU keeps libm's `expf` (candle's `silu`): the tensor
//! forward and the decoder must agree to the bit, and INT8 perplexity
//! moved 0.3–0.7 % on an 811-token text when its arithmetic moved by an
//! ulp (one rounding flip of a dynamic quantizer cascades), which would
//! have moved every figure measured before for 1 % of a step.

use crate::error::{Error, Result};

/// Below `ln(f32::MIN_POSITIVE)`, `exp` is 0 (no subnormal results).
const EXP_MIN: f32 = -87.336_55;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n · LN2_HI` is exact for |n| ≤ 2⁸ and the reduced
/// argument keeps its precision.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Taylor coefficients of `e^r`, highest first (`r` within ±ln 2 / 2, where
/// the degree-8 term is below 6e-9 relative).
const EXP_POLY: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];
/// Adding then subtracting 1.5 · 2²³ rounds to the nearest integer.
const ROUNDER: f32 = 12_582_912.0;
/// Lanes of the fixed summation orders.
const LANES: usize = 8;

/// Vocabulary entries per partial sum of [`softmax_weights`]: a draw finds
/// its block among `len / 256` sums, then its entry among 256 weights.
pub const SOFTMAX_BLOCK: usize = 256;

/// `e^x` for `x ≤ 0` (see the module's note); NaN stays NaN. Positive `x`
/// is outside its range.
pub(crate) fn exp(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    let n = (x * LOG2_E + ROUNDER) - ROUNDER;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = EXP_POLY[1..]
        .iter()
        .fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    // `n` is in [-126, 0] for x in [EXP_MIN, 0], so 2^n is a normal float
    // (a NaN `x` makes `p` NaN, whatever this gives).
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Whether this CPU runs the AVX2 forms.
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    let cpu = qforge_core::CpuFeatures::get();
    cpu.avx2 && cpu.fma
}

/// The softmax of `logits · scale`, unnormalized, for drawing from it:
/// writes `weights[i] = e^(x_i − max x)` with `x_i = logits[i] · scale`
/// (f32), and `block_sums[b]` = the f64 sum of the weights of block `b`
/// ([`SOFTMAX_BLOCK`] entries, the last one shorter), entry `i` of a block
/// summed in lane `i mod 8` and the lanes as
/// `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`. Returns `max x`. The sums are
/// f64 so that a draw's resolution does not depend on the vocabulary's
/// size; `scale` > 0 (the inverse temperature).
///
/// A NaN logit makes its block's sum NaN, and an infinite one `max x`
/// infinite; the caller decides what such a row means.
pub fn softmax_weights(
    logits: &[f32],
    scale: f32,
    weights: &mut [f32],
    block_sums: &mut [f64],
) -> Result<f32> {
    if weights.len() != logits.len() || block_sums.len() != logits.len().div_ceil(SOFTMAX_BLOCK) {
        return Err(Error::Shape(format!(
            "softmax over {} logits needs {} weights and {} block sums, got {} and {}",
            logits.len(),
            logits.len(),
            logits.len().div_ceil(SOFTMAX_BLOCK),
            weights.len(),
            block_sums.len()
        )));
    }
    if scale.is_nan() || scale <= 0.0 {
        return Err(Error::Shape(format!(
            "softmax scale must be positive, got {scale}"
        )));
    }
    // `scale` > 0 keeps the order, and rounding is monotonic: the largest
    // product is the largest logit's.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
    let blocks = logits
        .chunks(SOFTMAX_BLOCK)
        .zip(weights.chunks_mut(SOFTMAX_BLOCK));
    for ((logits, weights), sum) in blocks.zip(block_sums.iter_mut()) {
        *sum = weigh_block(logits, scale, max, weights);
    }
    Ok(max)
}

/// One block of [`softmax_weights`] on the fastest tier.
fn weigh_block(logits: &[f32], scale: f32, max: f32, weights: &mut [f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { x86::weigh_block(logits, scale, max, weights) };
    }
    portable::weigh_block(logits, scale, max, weights)
}

/// The lanes' sum in the fixed tree.
fn tree_sum(l: [f64; LANES]) -> f64 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

mod portable {
    use super::*;

    /// [`super::weigh_block`], one value at a time; `lanes` carries on
    /// from the values before `start` (the AVX2 form's tail).
    pub(super) fn weigh_from(
        logits: &[f32],
        scale: f32,
        max: f32,
        weights: &mut [f32],
        start: usize,
        mut lanes: [f64; LANES],
    ) -> f64 {
        for i in start..logits.len() {
            weights[i] = exp(logits[i] * scale - max);
            lanes[i % LANES] += f64::from(weights[i]);
        }
        tree_sum(lanes)
    }

    pub(super) fn weigh_block(logits: &[f32], scale: f32, max: f32, weights: &mut [f32]) -> f64 {
        weigh_from(logits, scale, max, weights, 0, [0.0; LANES])
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::*;

    /// [`super::exp`] of eight values.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp(x: __m256) -> __m256 {
        // Not below the minimum; true for NaN, as the scalar comparison.
        let keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_NLT_UQ);
        let rounder = _mm256_set1_ps(ROUNDER);
        let n = _mm256_sub_ps(
            _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)), rounder),
            rounder,
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let bits = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep)
    }

    /// [`portable::weigh_block`] eight values at a time: lanes 0–3 and
    /// 4–7 in two f64 registers, the tail by the scalar form.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `weights` is as long as `logits`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weigh_block(
        logits: &[f32],
        scale: f32,
        max: f32,
        weights: &mut [f32],
    ) -> f64 {
        let (scale_v, max_v) = (_mm256_set1_ps(scale), _mm256_set1_ps(max));
        let (mut low, mut high) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let full = logits.len() / LANES * LANES;
        for at in (0..full).step_by(LANES) {
            // SAFETY: `at + 8 ≤ full ≤ len` for both slices.
            let x = unsafe { _mm256_loadu_ps(logits.as_ptr().add(at)) };
            let e = exp(_mm256_sub_ps(_mm256_mul_ps(x, scale_v), max_v));
            unsafe { _mm256_storeu_ps(weights.as_mut_ptr().add(at), e) };
            low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        let mut lanes = [0f64; LANES];
        // SAFETY: `lanes` holds eight f64.
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), low);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), high);
        }
        portable::weigh_from(logits, scale, max, weights, full, lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(len: usize, seed: u32, spread: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32 - 0.5) * spread
            })
            .collect()
    }

    #[test]
    fn exp_is_within_two_ulp_and_vanishes_below_the_normal_range() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let exact = (x as f64).exp();
            let ulp = (exact as f32).to_bits().abs_diff(exp(x).to_bits());
            assert!(ulp <= 2, "exp({x}) = {} vs {exact} ({ulp} ulp)", exp(x));
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Both tiers' weights and block sums, for a vocabulary that ends in
    /// a short block with a short tail of eight.
    fn weigh_on_each_tier(logits: &[f32], scale: f32) -> Vec<(Vec<f32>, Vec<f64>)> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
        // Only x86-64 has a second tier to add.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut tiers = vec![portable::weigh_block as fn(&[f32], f32, f32, &mut [f32]) -> f64];
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            tiers.push(|l, s, m, w| unsafe { x86::weigh_block(l, s, m, w) });
        }
        tiers
            .into_iter()
            .map(|weigh| {
                let mut weights = vec![0f32; logits.len()];
                let sums = logits
                    .chunks(SOFTMAX_BLOCK)
                    .zip(weights.chunks_mut(SOFTMAX_BLOCK))
                    .map(|(l, w)| weigh(l, scale, max, w))
                    .collect();
                (weights, sums)
            })
            .collect()
    }

    #[test]
    fn softmax_weights_are_the_same_bits_on_every_tier_and_match_the_exact_softmax() {
        let logits = seeded(3 * SOFTMAX_BLOCK + 13, 7, 40.0);
        let scale = 1.0 / 0.7;
        let tiers = weigh_on_each_tier(&logits, scale);
        for other in &tiers[1..] {
            assert_eq!(other.0, tiers[0].0);
            assert_eq!(
                other.1.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
                tiers[0].1.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
            );
        }
        let mut weights = vec![0f32; logits.len()];
        let mut sums = vec![0f64; 4];
        let max = softmax_weights(&logits, scale, &mut weights, &mut sums).unwrap();
        assert_eq!((weights.clone(), sums.clone()), tiers[0].clone());
        let exact_max = logits
            .iter()
            .map(|&l| f64::from(l * scale))
            .fold(f64::MIN, f64::max);
        assert_eq!(f64::from(max), exact_max);
        let shifted: Vec<f64> = logits
            .iter()
            .map(|&l| f64::from(l * scale) - exact_max)
            .collect();
        let exact_total: f64 = shifted.iter().map(|x| x.exp()).sum();
        let total: f64 = sums.iter().sum();
        assert!(
            (total / exact_total - 1.0).abs() < 1e-6,
            "{total} vs {exact_total}"
        );
        for (w, x) in weights.iter().zip(&shifted) {
            // 2 ulp of `exp`, and the rounding of the f32 subtraction: half
            // an ulp of `x`, relative error |x| · 2⁻²⁴ in e^x.
            let tolerance = 3e-7 + x.abs() * 6e-8;
            let e = x.exp();
            assert!((f64::from(*w) - e).abs() <= tolerance * e, "{w} vs {e}");
        }
    }

    #[test]
    fn softmax_weights_refuse_mismatched_buffers_and_a_non_positive_scale() {
        let logits = [0.0f32; 300];
        let (mut weights, mut sums) = (vec![0f32; 300], vec![0f64; 2]);
        assert!(softmax_weights(&logits, 1.0, &mut weights, &mut sums).is_ok());
        let error = softmax_weights(&logits, 1.0, &mut weights, &mut [0.0; 1]).unwrap_err();
        assert!(error.to_string().contains("2 block sums"), "{error}");
        let error = softmax_weights(&logits, 0.0, &mut weights, &mut sums).unwrap_err();
        assert!(error.to_string().contains("must be positive"), "{error}");
    }
}
