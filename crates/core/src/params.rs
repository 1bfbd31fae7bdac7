//! INT8 quantization parameters and quantize/dequantize.
//!
//! `q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax)` and
//! `x' = (q − zero_point) · scale`, for symmetric int8 (zero point 0, range
//! ±127, so that negation is exact and the int8 GEMM never sees −128) and
//! asymmetric int8 (range −128..=127 with a zero point). Per-tensor parameters
//! come from calibration; per-channel from the rows of a weight matrix;
//! per-token from each row of an activation at run time.
//!
//! Degenerate ranges get a defined result and a [`RangeWarning`], never a NaN or
//! infinite scale: an all-zero (or empty, or all-NaN) range gets scale 1, which
//! maps every finite value of such a tensor (zero) to 0 exactly; a range too small
//! for a normal f32 scale gets the smallest normal scale.

use std::fmt;

/// Why a range was adjusted before it could give a usable scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeWarning {
    /// The range had zero width (all values equal zero, or no finite value):
    /// scale set to 1.
    ZeroRange,
    /// The range was NaN or infinite (no finite statistics): scale set to 1.
    NonFinite,
    /// The range was so small that range/levels is not a normal f32: scale
    /// raised to `f32::MIN_POSITIVE`.
    Tiny,
}

impl fmt::Display for RangeWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RangeWarning::ZeroRange => "zero range: scale set to 1, every value quantizes to 0",
            RangeWarning::NonFinite => {
                "no finite range (all values NaN/Inf or none): scale set to 1"
            }
            RangeWarning::Tiny => "range below f32 resolution: scale raised to f32::MIN_POSITIVE",
        })
    }
}

/// Quantization parameters of one tensor, channel or token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantParams {
    /// Step between adjacent int8 levels; always finite and positive.
    pub scale: f32,
    /// The int8 value that represents 0.0.
    pub zero_point: i8,
    /// Smallest int8 level used.
    pub qmin: i8,
    /// Largest int8 level used.
    pub qmax: i8,
}

/// Parameters together with the warning raised while fitting them, if any.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// The parameters (always usable).
    pub params: QuantParams,
    /// Set when the range was degenerate and a defined fallback was used.
    pub warning: Option<RangeWarning>,
}

/// Turns a range width into a finite, positive, normal scale.
fn checked_scale(width: f64, levels: f64) -> (f32, Option<RangeWarning>) {
    if !width.is_finite() {
        return (1.0, Some(RangeWarning::NonFinite));
    }
    if width <= 0.0 {
        return (1.0, Some(RangeWarning::ZeroRange));
    }
    let scale = (width / levels) as f32;
    if scale < f32::MIN_POSITIVE {
        return (f32::MIN_POSITIVE, Some(RangeWarning::Tiny));
    }
    (scale, None)
}

impl QuantParams {
    /// Symmetric int8 for magnitudes up to `abs_max`: scale = abs_max / 127,
    /// zero point 0, levels −127..=127.
    pub fn symmetric(abs_max: f32) -> Fit {
        let (scale, warning) = checked_scale(f64::from(abs_max.abs()), 127.0);
        Fit {
            params: QuantParams {
                scale,
                zero_point: 0,
                qmin: -127,
                qmax: 127,
            },
            warning,
        }
    }

    /// Asymmetric int8 for `[min, max]`: the range is first widened to contain
    /// 0 (so zero is exact, as padding and ReLU need), then scale =
    /// (max − min) / 255 and the zero point maps 0.0 exactly.
    pub fn asymmetric(min: f32, max: f32) -> Fit {
        if !(min.is_finite() && max.is_finite()) {
            let (scale, warning) = checked_scale(f64::NAN, 255.0);
            return Fit {
                params: QuantParams {
                    scale,
                    zero_point: 0,
                    qmin: -128,
                    qmax: 127,
                },
                warning,
            };
        }
        let (lo, hi) = (f64::from(min.min(0.0)), f64::from(max.max(0.0)));
        let (scale, warning) = checked_scale(hi - lo, 255.0);
        // lo/scale is in [-255, 0]; the zero point puts lo at −128.
        let zero_point = (-128.0 - (lo / f64::from(scale)).round_ties_even()).clamp(-128.0, 127.0);
        Fit {
            params: QuantParams {
                scale,
                zero_point: zero_point as i8,
                qmin: -128,
                qmax: 127,
            },
            warning,
        }
    }

    /// Quantizes one value (round half to even, saturating). NaN maps to the
    /// zero point.
    #[inline]
    pub fn quantize(&self, x: f32) -> i8 {
        let q = (x / self.scale).round_ties_even() + f32::from(self.zero_point);
        // `as` saturates ±∞ and maps NaN to 0; the clamp applies the level range.
        let q = if q.is_nan() {
            f32::from(self.zero_point)
        } else {
            q
        };
        q.clamp(f32::from(self.qmin), f32::from(self.qmax)) as i8
    }

    /// Dequantizes one value.
    #[inline]
    pub fn dequantize(&self, q: i8) -> f32 {
        (i32::from(q) - i32::from(self.zero_point)) as f32 * self.scale
    }

    /// Quantizes a slice into `out` (same length).
    pub fn quantize_slice(&self, values: &[f32], out: &mut [i8]) {
        assert_eq!(values.len(), out.len(), "quantize_slice: length mismatch");
        for (o, &x) in out.iter_mut().zip(values) {
            *o = self.quantize(x);
        }
    }

    /// Dequantizes a slice into `out` (same length).
    pub fn dequantize_slice(&self, values: &[i8], out: &mut [f32]) {
        assert_eq!(values.len(), out.len(), "dequantize_slice: length mismatch");
        for (o, &q) in out.iter_mut().zip(values) {
            *o = self.dequantize(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symmetric_uses_plus_minus_127() {
        let p = QuantParams::symmetric(12.7).params;
        assert_eq!(p.zero_point, 0);
        assert!((p.scale - 0.1).abs() < 1e-7);
        assert_eq!(p.quantize(12.7), 127);
        assert_eq!(p.quantize(-12.7), -127);
        assert_eq!(p.quantize(-1000.0), -127, "saturates at -127, not -128");
        assert_eq!(p.quantize(f32::INFINITY), 127);
        assert_eq!(p.quantize(f32::NAN), 0);
    }

    #[test]
    fn rounds_half_to_even() {
        let p = QuantParams::symmetric(127.0).params; // scale 1
        assert_eq!(p.quantize(0.5), 0);
        assert_eq!(p.quantize(1.5), 2);
        assert_eq!(p.quantize(2.5), 2);
        assert_eq!(p.quantize(-2.5), -2);
        assert_eq!(p.quantize(-3.5), -4);
    }

    #[test]
    fn asymmetric_represents_zero_exactly_and_spans_the_range() {
        for (min, max) in [(-1.0f32, 3.0f32), (0.5, 2.0), (-4.0, -1.0), (-1e-3, 1e5)] {
            let fit = QuantParams::asymmetric(min, max);
            assert_eq!(fit.warning, None);
            let p = fit.params;
            assert_eq!(p.dequantize(p.quantize(0.0)), 0.0, "[{min}, {max}]");
            let step = p.scale;
            for x in [min, max] {
                let err = (p.dequantize(p.quantize(x)) - x).abs();
                assert!(err <= step / 2.0 * 1.001, "[{min},{max}] x={x} err={err}");
            }
        }
    }

    #[test]
    fn degenerate_ranges_give_finite_scales_and_warnings() {
        let cases = [
            (QuantParams::symmetric(0.0), RangeWarning::ZeroRange),
            (QuantParams::symmetric(f32::NAN), RangeWarning::NonFinite),
            (QuantParams::symmetric(1e-40), RangeWarning::Tiny),
            (QuantParams::asymmetric(0.0, 0.0), RangeWarning::ZeroRange),
            (
                QuantParams::asymmetric(f32::NAN, 1.0),
                RangeWarning::NonFinite,
            ),
        ];
        for (fit, expected) in cases {
            assert_eq!(fit.warning, Some(expected));
            assert!(fit.params.scale.is_normal() && fit.params.scale > 0.0);
            assert_eq!(fit.params.quantize(0.0), fit.params.zero_point);
        }
        // The widest finite range does not overflow the scale.
        let fit = QuantParams::asymmetric(-f32::MAX, f32::MAX);
        assert!(fit.params.scale.is_finite() && fit.warning.is_none());
    }
}
