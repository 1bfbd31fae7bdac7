//! f32 → int8 activation quantizers.
//!
//! Values are quantized symmetrically, `q = clamp(round_half_even(x / s), −127,
//! 127)`, and stored as `q + 128` in a `u8` (zero point [`ZERO_POINT`]), the
//! operand layout of u8 × i8 GEMM kernels. A row holding NaN or ±Inf gets a NaN
//! scale, so that, as in f32, its outputs become NaN instead of silently
//! finite.

use qforge_core::CpuTier;

use crate::error::{Error, Result};

/// The u8 that stands for 0.
pub const ZERO_POINT: u8 = 128;

/// Largest quantized magnitude of an activation.
const QMAX: f32 = 127.0;

/// Adding then subtracting 1.5 × 2²³ rounds an f32 of magnitude < 2²² to the
/// nearest integer, ties to even, in two additions that vectorize on every
/// x86-64 (unlike `round_ties_even`, a libm call without SSE4.1).
pub(crate) const ROUNDER: f32 = 12_582_912.0;

/// A CPU tier of the quantizers.
pub type QuantizeTier = crate::fma_tier::FmaTier;

fn check(x: &[f32], cols: usize, q: &[u8], scales: &[f32]) -> Result<usize> {
    if cols == 0
        || !x.len().is_multiple_of(cols)
        || q.len() != x.len()
        || scales.len() != x.len() / cols
    {
        return Err(Error::Shape(format!(
            "quantizing {} values in rows of {cols} into {} bytes and {} scales",
            x.len(),
            q.len(),
            scales.len()
        )));
    }
    Ok(x.len() / cols)
}

/// Quantizes each row of `x` (rows of `cols` values) with its own scale
/// `max|x| / 127` (1 for an all-zero row), on the fastest tier.
pub fn quantize_per_token(x: &[f32], cols: usize, q: &mut [u8], scales: &mut [f32]) -> Result<()> {
    quantize_per_token_with(QuantizeTier::detect(), x, cols, q, scales)
}

/// [`quantize_per_token`] on a chosen tier; errors if the CPU lacks it.
pub fn quantize_per_token_with(
    tier: QuantizeTier,
    x: &[f32],
    cols: usize,
    q: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    check(x, cols, q, scales)?;
    if !tier.is_supported() {
        return Err(Error::UnsupportedTier(format!("{tier:?}")));
    }
    for ((row, out), scale) in x
        .chunks_exact(cols)
        .zip(q.chunks_exact_mut(cols))
        .zip(scales.iter_mut())
    {
        *scale = match tier {
            QuantizeTier::Portable => row_portable(row, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the tier's features were checked above.
            QuantizeTier::Avx2 => unsafe { row_avx2(row, out) },
            #[cfg(not(target_arch = "x86_64"))]
            QuantizeTier::Avx2 => unreachable!("checked above"),
        };
    }
    Ok(())
}

/// Quantizes `x` with one static scale (from calibration); values beyond
/// ±127 × `scale` saturate.
pub fn quantize_static(x: &[f32], scale: f32, q: &mut [u8]) -> Result<()> {
    if q.len() != x.len() {
        return Err(Error::Shape(format!(
            "quantizing {} values into {} bytes",
            x.len(),
            q.len()
        )));
    }
    encode(x, 1.0 / scale, q);
    Ok(())
}

/// The scalar twin of [`quantize_per_token`]: one value at a time, with the
/// library's rounding. The tiers must agree with it exactly.
pub fn quantize_per_token_reference(
    x: &[f32],
    cols: usize,
    q: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    check(x, cols, q, scales)?;
    for ((row, out), scale) in x
        .chunks_exact(cols)
        .zip(q.chunks_exact_mut(cols))
        .zip(scales.iter_mut())
    {
        let mut max = 0f32;
        let mut finite = true;
        for &v in row {
            finite &= v.is_finite();
            max = max.max(v.abs());
        }
        let s = row_scale(max, finite);
        let inverse = 1.0 / s;
        for (o, &v) in out.iter_mut().zip(row) {
            let r = (v * inverse).clamp(-QMAX, QMAX).round_ties_even();
            *o = (r as i32 + i32::from(ZERO_POINT)) as u8;
        }
        *scale = s;
    }
    Ok(())
}

fn row_scale(max: f32, finite: bool) -> f32 {
    if !finite {
        f32::NAN
    } else if max == 0.0 {
        1.0
    } else {
        max / QMAX
    }
}

#[inline(always)]
fn row_kernel(row: &[f32], out: &mut [u8]) -> f32 {
    // Eight independent lanes so the reductions vectorize; a value is NaN or
    // ±Inf exactly when its exponent bits are all ones.
    const EXPONENT: u32 = 0x7f80_0000;
    let mut max = [0f32; 8];
    let mut special = [0u32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..8 {
            max[i] = max[i].max(chunk[i].abs());
            special[i] |= u32::from(chunk[i].to_bits() & EXPONENT == EXPONENT);
        }
    }
    let mut m = max.iter().fold(0f32, |a, &b| a.max(b));
    let mut finite = special.iter().all(|&s| s == 0);
    for &v in tail {
        m = m.max(v.abs());
        finite &= v.is_finite();
    }
    let scale = row_scale(m, finite);
    encode(row, 1.0 / scale, out);
    scale
}

#[inline(always)]
fn encode(x: &[f32], inverse: f32, out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        // Clamp first: the rounding trick needs |v| < 2²². After adding
        // ROUNDER, the low byte of the bits is the rounded value in two's
        // complement, and flipping its top bit adds the zero point; integer
        // ops only, so the loop vectorizes (a saturating f32 → int cast does
        // not). NaN (a row with a NaN scale, or a NaN in static mode) clamps
        // to NaN and is encoded as the zero point.
        let r = (v * inverse).clamp(-QMAX, QMAX) + ROUNDER;
        let bits = if r.is_nan() { ROUNDER } else { r }.to_bits();
        *o = (bits as u8) ^ 0x80;
    }
}

fn row_portable(row: &[f32], out: &mut [u8]) -> f32 {
    row_kernel(row, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_avx2(row: &[f32], out: &mut [u8]) -> f32 {
    row_kernel(row, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_half_to_even_and_saturates() {
        let x = [0.5, 1.5, 2.5, -0.5, -1.5, 127.0, -127.0, 0.0];
        let mut q = [0u8; 8];
        quantize_static(&x, 1.0, &mut q).unwrap();
        let back: Vec<i32> = q.iter().map(|&v| i32::from(v) - 128).collect();
        assert_eq!(back, [0, 2, 2, 0, -2, 127, -127, 0]);
        quantize_static(&[1000.0, -1000.0], 1.0, &mut q[..2]).unwrap();
        assert_eq!(&q[..2], &[255, 1]);
        // NaN, with and without a payload, is the zero point in static mode.
        let payload = f32::from_bits(0x7fc0_0077);
        quantize_static(&[f32::NAN, payload, -payload], 0.5, &mut q[..3]).unwrap();
        assert_eq!(&q[..3], &[ZERO_POINT; 3]);
    }

    #[test]
    fn zero_rows_get_scale_one_and_special_rows_nan() {
        let x = [0.0, 0.0, 1.0, f32::NAN, 2.0, f32::INFINITY];
        let mut q = [0u8; 6];
        let mut scales = [0f32; 3];
        quantize_per_token(&x, 2, &mut q, &mut scales).unwrap();
        assert_eq!(scales[0], 1.0);
        assert!(scales[1].is_nan() && scales[2].is_nan());
        assert!(quantize_per_token(&x, 4, &mut q, &mut scales).is_err());
    }
}
