//! Calibrators: choose a clipping range for int8 from merged statistics.
//!
//! Every calibrator reads only a [`Histogram`], so its answer is a pure function
//! of the merged statistics, and all of them assume values are uniform within a
//! bin (bins are at most 0.78 % wide, so that is the resolution of every answer
//! that falls inside the data). Arithmetic runs in `f64` in a fixed order, so a
//! threshold is reproducible bit for bit.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::histogram::{Histogram, MagnitudeBin};

/// Number of positive int8 levels: symmetric int8 spans ±127.
const POSITIVE_LEVELS: f64 = 127.0;

/// A method that chooses a clipping range from a histogram.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Calibrator {
    /// The largest finite magnitude. O(1).
    ///
    /// The classic post-training choice (Jacob et al. 2018, "Quantization and
    /// Training of Neural Networks for Efficient Integer-Arithmetic-Only
    /// Inference"); exact, but a single outlier stretches the scale.
    MinMax,
    /// The `percentile`-th percentile of |x| (zeros included), interpolated
    /// linearly within its bin. O(B) in the number of bins B.
    ///
    /// As in ONNX Runtime's and NVIDIA pytorch-quantization's percentile
    /// calibrators (McKinstry et al. 2018 use 99.99 % for activations).
    Percentile {
        /// Percent of values to keep inside the range, in (0, 100].
        percentile: f64,
    },
    /// TensorRT's KL-divergence method (Migacz, "8-bit Inference with TensorRT",
    /// GTC 2017): |x| is re-binned into 2048 linear bins over [0, abs-max];
    /// for every candidate edge i from 128 to 2048 the reference distribution P
    /// is bins [0, i) with the clipped tail added to the last bin, and the
    /// candidate Q is the same bins merged into 128 levels and expanded back
    /// over the bins where P is non-zero; the edge with the least KL(P‖Q) wins.
    /// Zero entries are smoothed with ε = 1e-4 as in MXNet's implementation.
    /// O(B + 2048²).
    Entropy,
    /// The threshold T minimising the expected squared error of symmetric int8
    /// quantization: clipping error Σ(|x| − T)² above T plus rounding error
    /// (T/127)²/12 per value below T (x² for values that round to zero).
    /// Candidates are every bin edge and 1024 evenly spaced points up to the
    /// abs-max, each scored in O(log B) from prefix sums: O((B + 1024) log B).
    ///
    /// As in ACIQ (Banner et al. 2019, "Post-training 4-bit quantization of
    /// convolutional networks for rapid-deployment") and the `mse` method of
    /// NVIDIA pytorch-quantization.
    Mse,
    /// mean ± k·σ, with the moments taken from the histogram (bin midpoints plus
    /// the within-bin variance width²/12), clamped to the observed range. O(B).
    ///
    /// Sigma clipping as surveyed by Wu et al. 2020 ("Integer Quantization for
    /// Deep Learning Inference: Principles and Empirical Evaluation").
    Sigma {
        /// Number of standard deviations.
        k: f64,
    },
}

impl Calibrator {
    /// Default percentile.
    pub const DEFAULT_PERCENTILE: f64 = 99.99;
    /// Default number of standard deviations for [`Calibrator::Sigma`]: the
    /// three-sigma rule.
    pub const DEFAULT_SIGMA_K: f64 = 3.0;

    /// Each method with its default parameters, in display order.
    pub fn defaults() -> [Calibrator; 5] {
        [
            Calibrator::MinMax,
            Calibrator::Percentile {
                percentile: Self::DEFAULT_PERCENTILE,
            },
            Calibrator::Entropy,
            Calibrator::Mse,
            Calibrator::Sigma {
                k: Self::DEFAULT_SIGMA_K,
            },
        ]
    }

    /// Short name of the method, without parameters.
    pub fn name(&self) -> &'static str {
        match self {
            Calibrator::MinMax => "minmax",
            Calibrator::Percentile { .. } => "percentile",
            Calibrator::Entropy => "entropy",
            Calibrator::Mse => "mse",
            Calibrator::Sigma { .. } => "sigma",
        }
    }

    /// The scale of a static (per-tensor, symmetric) int8 activation
    /// quantizer: [`Calibrator::threshold`] mapped onto ±127. The one way
    /// statistics become a static scale, for the guard and for
    /// `--precision int8-static` alike. `None` when the histogram has no
    /// finite value.
    pub fn static_scale(&self, histogram: &Histogram) -> Option<f32> {
        self.threshold(histogram)
            .map(|t| crate::QuantParams::symmetric(t).params.scale)
    }

    /// The symmetric clipping magnitude T on |x| (the int8 scale is T / 127).
    /// `None` when the histogram has no finite value; `Some(0.0)` when every
    /// finite value is zero.
    pub fn threshold(&self, histogram: &Histogram) -> Option<f32> {
        let abs_max = histogram.abs_max()?;
        if abs_max == 0.0 {
            return Some(0.0);
        }
        let threshold = match *self {
            Calibrator::MinMax => f64::from(abs_max),
            Calibrator::Percentile { percentile } => {
                let bins = magnitude_line(histogram);
                quantile(&bins, percentile / 100.0)
            }
            Calibrator::Entropy => entropy_threshold(histogram, f64::from(abs_max)),
            Calibrator::Mse => mse_threshold(histogram, f64::from(abs_max)),
            Calibrator::Sigma { k } => {
                let (mean, sd) = moments(histogram)?;
                (mean - k * sd).abs().max((mean + k * sd).abs())
            }
        };
        Some((threshold as f32).min(abs_max))
    }

    /// An asymmetric range `[lo, hi]` (for zero-point quantization), for the
    /// methods that define one: `minmax`, `percentile` (cutting half of the
    /// excluded mass from each tail) and `sigma`. `None` otherwise, or when the
    /// histogram has no finite value.
    pub fn range(&self, histogram: &Histogram) -> Option<(f32, f32)> {
        let (min, max) = (histogram.min()?, histogram.max()?);
        let (lo, hi) = match *self {
            Calibrator::MinMax => return Some((min, max)),
            Calibrator::Percentile { percentile } => {
                let line = signed_line(histogram);
                let cut = (1.0 - percentile / 100.0) / 2.0;
                (quantile(&line, cut), quantile(&line, 1.0 - cut))
            }
            Calibrator::Sigma { k } => {
                let (mean, sd) = moments(histogram)?;
                (mean - k * sd, mean + k * sd)
            }
            Calibrator::Entropy | Calibrator::Mse => return None,
        };
        Some(((lo as f32).max(min), (hi as f32).min(max)))
    }

    /// Checks the method's parameters.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Calibrator::Percentile { percentile } if !(percentile > 0.0 && percentile <= 100.0) => {
                Err(Error::Parse(format!(
                    "percentile must be in (0, 100], got {percentile}"
                )))
            }
            Calibrator::Sigma { k } if !(k > 0.0 && k.is_finite()) => Err(Error::Parse(format!(
                "sigma's k must be positive and finite, got {k}"
            ))),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Calibrator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Calibrator::Percentile { percentile } => write!(f, "percentile({percentile})"),
            Calibrator::Sigma { k } => write!(f, "sigma({k})"),
            other => f.write_str(other.name()),
        }
    }
}

impl FromStr for Calibrator {
    type Err = Error;

    /// Parses `minmax`, `entropy`, `mse`, `percentile`, `percentile(P)`,
    /// `sigma` or `sigma(K)`.
    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        let (name, argument) = match text.split_once('(') {
            Some((name, rest)) => {
                let argument = rest.strip_suffix(')').ok_or_else(|| {
                    Error::Parse(format!("calibrator {text:?}: missing closing parenthesis"))
                })?;
                let value: f64 = argument.trim().parse().map_err(|_| {
                    Error::Parse(format!("calibrator {text:?}: {argument:?} is not a number"))
                })?;
                (name.trim(), Some(value))
            }
            None => (text, None),
        };
        let calibrator = match (name, argument) {
            ("minmax", None) => Calibrator::MinMax,
            ("entropy", None) => Calibrator::Entropy,
            ("mse", None) => Calibrator::Mse,
            ("percentile", p) => Calibrator::Percentile {
                percentile: p.unwrap_or(Self::DEFAULT_PERCENTILE),
            },
            ("sigma", k) => Calibrator::Sigma {
                k: k.unwrap_or(Self::DEFAULT_SIGMA_K),
            },
            _ => {
                return Err(Error::Parse(format!(
                    "unknown calibrator {text:?}; expected minmax, percentile[(P)], entropy, mse or sigma[(K)]"
                )));
            }
        };
        calibrator.validate()?;
        Ok(calibrator)
    }
}

/// A piece of a piecewise-uniform distribution: `count` values spread evenly
/// over `[lower, upper]` (a point mass when the two are equal).
#[derive(Debug, Clone, Copy)]
struct Piece {
    lower: f64,
    upper: f64,
    count: f64,
}

/// |x| as ascending pieces: the zeros, then each magnitude bin.
fn magnitude_line(histogram: &Histogram) -> Vec<Piece> {
    let mut line = vec![Piece {
        lower: 0.0,
        upper: 0.0,
        count: histogram.zero() as f64,
    }];
    line.extend(histogram.magnitude_bins().into_iter().map(piece));
    line
}

fn piece(bin: MagnitudeBin) -> Piece {
    Piece {
        lower: bin.lower,
        upper: bin.upper,
        count: bin.count as f64,
    }
}

/// Signed values as ascending pieces, clamped to the observed [min, max].
fn signed_line(histogram: &Histogram) -> Vec<Piece> {
    let (Some(min), Some(max)) = (histogram.min(), histogram.max()) else {
        return Vec::new();
    };
    let (min, max) = (f64::from(min), f64::from(max));
    let mut negative = Vec::new();
    let mut positive = Vec::new();
    for (index, count) in histogram.non_empty_bins() {
        let (lo, hi) = crate::histogram::bin_magnitude_range(index);
        let (lo, hi) = (f64::from(lo), f64::from(hi));
        if index & 0x8000 != 0 {
            negative.push(Piece {
                lower: (-hi).max(min),
                upper: -lo,
                count: count as f64,
            });
        } else {
            positive.push(Piece {
                lower: lo,
                upper: hi.min(max),
                count: count as f64,
            });
        }
    }
    // Negative bins come in ascending magnitude: reverse them to ascend in value.
    negative.reverse();
    negative.push(Piece {
        lower: 0.0,
        upper: 0.0,
        count: histogram.zero() as f64,
    });
    negative.extend(positive);
    negative
}

/// The value below which a fraction `q` of the mass lies, interpolating within
/// a piece.
fn quantile(line: &[Piece], q: f64) -> f64 {
    let total: f64 = line.iter().map(|p| p.count).sum();
    let target = (q.clamp(0.0, 1.0) * total).max(f64::MIN_POSITIVE);
    let mut below = 0.0;
    for piece in line.iter().filter(|p| p.count > 0.0) {
        if below + piece.count >= target {
            let fraction = (target - below) / piece.count;
            return piece.lower + fraction * (piece.upper - piece.lower);
        }
        below += piece.count;
    }
    line.iter()
        .rev()
        .find(|p| p.count > 0.0)
        .map_or(0.0, |p| p.upper)
}

/// Mean and standard deviation of the finite values.
fn moments(histogram: &Histogram) -> Option<(f64, f64)> {
    let line = signed_line(histogram);
    let total: f64 = line.iter().map(|p| p.count).sum();
    if total == 0.0 {
        return None;
    }
    let mean = line
        .iter()
        .map(|p| p.count * (p.lower + p.upper) / 2.0)
        .sum::<f64>()
        / total;
    let second = line
        .iter()
        .map(|p| {
            let mid = (p.lower + p.upper) / 2.0;
            let width = p.upper - p.lower;
            p.count * ((mid - mean).powi(2) + width * width / 12.0)
        })
        .sum::<f64>()
        / total;
    Some((mean, second.sqrt()))
}

/// Linear bins of the entropy method.
const ENTROPY_BINS: usize = 2048;
/// Quantized levels of the entropy method (the positive half of int8).
const ENTROPY_LEVELS: usize = 128;
/// Smoothing mass, in counts, given to empty entries before KL (MXNet's choice).
const ENTROPY_EPSILON: f64 = 1e-4;

fn entropy_threshold(histogram: &Histogram, abs_max: f64) -> f64 {
    let width = abs_max / ENTROPY_BINS as f64;
    let mut linear = vec![0.0f64; ENTROPY_BINS];
    linear[0] += histogram.zero() as f64;
    let last = ENTROPY_BINS - 1;
    for bin in histogram.magnitude_bins() {
        let count = bin.count as f64;
        let first = ((bin.lower / width) as usize).min(last);
        let end = ((bin.upper / width) as usize).min(last);
        let span = bin.upper - bin.lower;
        if first == end || span <= 0.0 {
            linear[first] += count;
            continue;
        }
        for (i, slot) in linear.iter_mut().enumerate().take(end + 1).skip(first) {
            let lo = (i as f64 * width).max(bin.lower);
            let hi = ((i + 1) as f64 * width).min(bin.upper);
            *slot += count * (hi - lo).max(0.0) / span;
        }
    }
    let mut tail = vec![0.0f64; ENTROPY_BINS + 1];
    for i in (0..ENTROPY_BINS).rev() {
        tail[i] = tail[i + 1] + linear[i];
    }

    let mut best = (f64::INFINITY, ENTROPY_BINS);
    let mut p = vec![0.0f64; ENTROPY_BINS];
    let mut q = vec![0.0f64; ENTROPY_BINS];
    for edge in ENTROPY_LEVELS..=ENTROPY_BINS {
        let p = &mut p[..edge];
        let q = &mut q[..edge];
        p.copy_from_slice(&linear[..edge]);
        p[edge - 1] += tail[edge];
        let merged = edge / ENTROPY_LEVELS;
        for level in 0..ENTROPY_LEVELS {
            let start = level * merged;
            let stop = if level == ENTROPY_LEVELS - 1 {
                edge
            } else {
                start + merged
            };
            let mass: f64 = linear[start..stop].iter().sum();
            let support = p[start..stop].iter().filter(|&&v| v != 0.0).count();
            for (qj, pj) in q[start..stop].iter_mut().zip(&p[start..stop]) {
                *qj = if *pj != 0.0 && support > 0 {
                    mass / support as f64
                } else {
                    0.0
                };
            }
        }
        let divergence = kl_divergence(p, q);
        if divergence < best.0 {
            best = (divergence, edge);
        }
    }
    best.1 as f64 * width
}

/// Gives each empty entry of the count vector `d` a mass of ε, taken evenly
/// from the non-empty ones (MXNet's `_smooth_distribution`, which ONNX Runtime
/// shares). ε is in count units, so against real counts it is negligible; a
/// non-empty entry never gives up more than half of itself (re-binned counts
/// can be fractional). `None` when `d` has no mass.
fn smooth(d: &mut [f64]) -> Option<()> {
    let nonzero = d.iter().filter(|&&v| v > 0.0).count();
    if nonzero == 0 {
        return None;
    }
    let zeros = d.len() - nonzero;
    let take = ENTROPY_EPSILON * zeros as f64 / nonzero as f64;
    for v in d.iter_mut() {
        *v = if *v > 0.0 {
            *v - take.min(*v / 2.0)
        } else {
            ENTROPY_EPSILON
        };
    }
    Some(())
}

fn kl_divergence(p: &mut [f64], q: &mut [f64]) -> f64 {
    if smooth(p).is_none() || smooth(q).is_none() {
        return f64::INFINITY;
    }
    let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
    p.iter()
        .zip(q.iter())
        .map(|(&pi, &qi)| {
            let (pi, qi) = (pi / sp, qi / sq);
            pi * (pi / qi).ln()
        })
        .sum()
}

/// Evenly spaced candidates the MSE search tries besides the bin edges, so a
/// sparse histogram still gets a fine search between its bins.
const MSE_GRID: usize = 1024;

fn mse_threshold(histogram: &Histogram, abs_max: f64) -> f64 {
    let bins: Vec<Piece> = histogram.magnitude_bins().into_iter().map(piece).collect();
    // Prefix sums over bins of count, count·E[x] and count·E[x²], with x
    // uniform over the bin.
    let n = bins.len();
    let mut count = vec![0.0f64; n + 1];
    let mut first = vec![0.0f64; n + 1];
    let mut second = vec![0.0f64; n + 1];
    for (i, b) in bins.iter().enumerate() {
        let (a, c) = (b.lower, b.upper);
        count[i + 1] = count[i] + b.count;
        first[i + 1] = first[i] + b.count * (a + c) / 2.0;
        second[i + 1] = second[i] + b.count * (a * a + a * c + c * c) / 3.0;
    }
    let expected_error = |t: f64| -> f64 {
        let step = t / POSITIVE_LEVELS;
        let rounding = step * step / 12.0;
        // Bins entirely below step/2 round to zero: their error is x².
        let small = bins.partition_point(|b| b.upper <= step / 2.0);
        // Bins entirely below t are inside the range.
        let inside = bins.partition_point(|b| b.upper <= t);
        let mut error = second[small] + (count[inside] - count[small]) * rounding;
        let mut clipped_from = inside;
        if let Some(b) = bins.get(inside)
            && b.lower < t
        {
            // The bin straddles t: split it in proportion.
            let span = b.upper - b.lower;
            let above = (b.upper - t) / span;
            error += b.count * (1.0 - above) * rounding;
            error += b.count * (b.upper - t).powi(3) / (3.0 * span);
            clipped_from = inside + 1;
        }
        let c = count[n] - count[clipped_from];
        let s1 = first[n] - first[clipped_from];
        let s2 = second[n] - second[clipped_from];
        error + s2 - 2.0 * t * s1 + t * t * c
    };
    let grid = (1..=MSE_GRID).map(|i| abs_max * i as f64 / MSE_GRID as f64);
    let edges = bins.iter().map(|b| b.upper);
    let mut best = (f64::INFINITY, abs_max);
    for t in grid.chain(edges).filter(|&t| t > 0.0) {
        let error = expected_error(t);
        if error < best.0 || (error == best.0 && t < best.1) {
            best = (error, t);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram_of(values: &[f32]) -> Histogram {
        let mut h = Histogram::new();
        h.observe(values);
        h
    }

    /// Deterministic standard normal samples (Box–Muller over a 64-bit LCG), so
    /// these unit tests need no RNG crate.
    fn normal(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        let mut uniform = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
            })
            .collect()
    }

    #[test]
    fn minmax_is_the_largest_magnitude() {
        let h = histogram_of(&[-7.5, 2.0, 3.0, f32::NAN, f32::INFINITY]);
        assert_eq!(Calibrator::MinMax.threshold(&h), Some(7.5));
        assert_eq!(Calibrator::MinMax.range(&h), Some((-7.5, 3.0)));
    }

    #[test]
    fn percentile_of_uniform_values_is_within_a_bin() {
        let values: Vec<f32> = (1..=100_000).map(|i| i as f32 / 100_000.0).collect();
        let h = histogram_of(&values);
        for p in [50.0, 90.0, 99.0, 99.99] {
            let t = Calibrator::Percentile { percentile: p }
                .threshold(&h)
                .unwrap();
            let expected = p / 100.0;
            assert!(
                (f64::from(t) - expected).abs() <= expected * 2f64.powi(-7),
                "p{p}: {t} vs {expected}"
            );
        }
    }

    #[test]
    fn percentile_counts_zeros() {
        let mut values = vec![0.0f32; 900];
        values.extend(std::iter::repeat_n(5.0f32, 100));
        let h = histogram_of(&values);
        let p80 = Calibrator::Percentile { percentile: 80.0 };
        assert_eq!(p80.threshold(&h), Some(0.0));
    }

    #[test]
    fn gaussian_thresholds_match_the_sample() {
        let values = normal(400_000, 7);
        let h = histogram_of(&values);
        // The percentile is the empirical one, to within one bin (2^-7 relative).
        let mut magnitudes: Vec<f32> = values.iter().map(|v| v.abs()).collect();
        magnitudes.sort_by(f32::total_cmp);
        let rank = (magnitudes.len() as f64 * 0.9999).ceil() as usize - 1;
        let empirical = magnitudes[rank];
        let p = Calibrator::Percentile { percentile: 99.99 }
            .threshold(&h)
            .unwrap();
        assert!(
            (p - empirical).abs() <= empirical * 2f32.powi(-7),
            "percentile {p} vs empirical {empirical}"
        );
        let s = Calibrator::Sigma { k: 3.0 }.threshold(&h).unwrap();
        assert!((s - 3.0).abs() < 0.03, "sigma {s}");
        // The MSE-optimal int8 clip of a unit Gaussian is ≈ 4σ (Banner et al.);
        // it must sit inside the sample's maximum.
        let m = Calibrator::Mse.threshold(&h).unwrap();
        let max = h.abs_max().unwrap();
        assert!(m > 3.5 && m < 4.5 && m < max, "mse {m}, max {max}");
        let e = Calibrator::Entropy.threshold(&h).unwrap();
        assert!(e > 2.0 && e <= max, "entropy {e}, max {max}");
    }

    #[test]
    fn mse_clips_a_rare_outlier_but_keeps_a_costly_one() {
        // One value at 20σ among a million: clipping it costs ≈ 16² once, while
        // keeping it raises every value's rounding error; MSE clips.
        let mut values = normal(1_000_000, 3);
        values.push(20.0);
        let t = Calibrator::Mse.threshold(&histogram_of(&values)).unwrap();
        assert!(t < 6.0, "a rare outlier should be clipped, got {t}");
        // One value at 1000 among 100 000: clipping it costs ≈ 10⁶, more than
        // the rounding error of keeping it (≈ 10⁵); MSE keeps it.
        let mut values = normal(100_000, 3);
        values.push(1000.0);
        let t = Calibrator::Mse.threshold(&histogram_of(&values)).unwrap();
        assert!(t > 900.0, "a costly outlier should be kept, got {t}");
    }

    #[test]
    fn entropy_keeps_a_bimodal_outlier_cluster() {
        // 10 % of the mass far out: clipping it loses more information than
        // the resolution gained, so KL keeps (most of) the range.
        let mut values = normal(90_000, 5);
        values.extend(std::iter::repeat_n(50.0f32, 10_000));
        let h = histogram_of(&values);
        let t = Calibrator::Entropy.threshold(&h).unwrap();
        assert!(t >= 49.0, "entropy threshold {t}");
    }

    #[test]
    fn degenerate_inputs_are_defined() {
        let empty = Histogram::new();
        let zeros = histogram_of(&[0.0; 64]);
        let nans = histogram_of(&[f32::NAN; 3]);
        let one = histogram_of(&[2.5]);
        for c in Calibrator::defaults() {
            assert_eq!(c.threshold(&empty), None, "{c}");
            assert_eq!(c.threshold(&nans), None, "{c}");
            assert_eq!(c.threshold(&zeros), Some(0.0), "{c}");
            let t = c.threshold(&one).unwrap();
            assert!(t.is_finite() && t > 0.0 && t <= 2.5, "{c}: {t}");
        }
    }

    #[test]
    fn parses_and_prints() {
        for text in ["minmax", "entropy", "mse", "percentile(99.9)", "sigma(4)"] {
            let c: Calibrator = text.parse().unwrap();
            assert_eq!(c.to_string(), text);
        }
        assert_eq!(
            "percentile".parse::<Calibrator>().unwrap(),
            Calibrator::Percentile { percentile: 99.99 }
        );
        for bad in [
            "kl",
            "percentile(101)",
            "percentile(x)",
            "sigma(-1)",
            "sigma(2",
        ] {
            assert!(bad.parse::<Calibrator>().is_err(), "{bad}");
        }
    }
}
