//! A histogram of f32 values whose bins do not depend on the data.
//!
//! # Bins
//!
//! A finite value's bin is the top 16 bits of its IEEE-754 pattern: the sign, the
//! 8 exponent bits and the top [`MANTISSA_BITS`] = 7 mantissa bits (the value
//! truncated to bfloat16). Within one octave `[2^e, 2^(e+1))` that cuts 128 equal
//! bins, so a bin's width relative to its lower edge is at most 2^-7 ≈ 0.78 %.
//! Seven bits is the least that meets a 1 % bound (six give 1.56 %), and cutting at
//! bit 16 makes binning a single shift with no range check, because every index
//! fits the 65 536-slot table (as HdrHistogram and DDSketch cut log-linear buckets
//! from a value's bits, for integers and for a relative-accuracy sketch).
//! Subnormals (|x| < 1.2e-38) fall into linear bins of their own; no int8 scale can
//! resolve them, so their coarse relative width does not matter.
//!
//! Exact zeros (+0 and −0) have their own count, as do NaN, +∞ and −∞, so the
//! 65 536 bins hold only finite non-zero values.
//!
//! # Merging
//!
//! Counts are `u64` and merge by addition; min/max are kept as order-preserving
//! integer keys and merge by integer min/max. Every merge is therefore exact,
//! commutative and associative: any sharding of the same values gives the same
//! histogram, bit for bit.
//!
//! # Storage
//!
//! Dense: one `u64` per bin (512 KiB). The `observe` benchmark measured the dense
//! table against a sparse map (see BENCHMARKS.md); dense wins by more than an order
//! of magnitude on the hot path, and only the non-empty bins are serialized.

mod observe;

pub use observe::{ObserveTier, observe_reference};

use crate::error::{Error, Result};

/// Mantissa bits kept in a bin index (see the module docs for the choice).
pub const MANTISSA_BITS: u32 = 7;
/// Bits dropped from an f32 pattern to form its bin index.
const SHIFT: u32 = 23 - MANTISSA_BITS;
/// Number of bins: every 16-bit pattern.
pub const BIN_COUNT: usize = 1 << (32 - SHIFT);

/// Sign bit of an f32 pattern.
const SIGN: u32 = 0x8000_0000;
/// Pattern of +∞; a magnitude above it is a NaN.
const INF_BITS: u32 = 0x7F80_0000;
/// Pattern of −∞.
const NEG_INF_BITS: u32 = INF_BITS | SIGN;
/// First bin index whose exponent is all ones (Inf and NaN only).
const FIRST_SPECIAL_BIN: usize = (INF_BITS >> SHIFT) as usize;
/// Number of bins per sign that hold only Inf/NaN patterns.
const SPECIAL_BINS: usize = (1 << (31 - SHIFT)) - FIRST_SPECIAL_BIN;
/// Index of the bin holding −0 (and the tiniest negative subnormals).
const NEG_ZERO_BIN: usize = (SIGN >> SHIFT) as usize;
/// Exact zeros are binned round-robin into this many special bins (see
/// `bin_of`)...
const ZERO_SPREAD: usize = 8;
/// ...starting at this one (the bin of +∞, otherwise holding only Inf/NaN).
const ZERO_SPREAD_BIN: usize = FIRST_SPECIAL_BIN;

/// Two sparse histograms merge into a sparse one while their union holds
/// at most this many non-empty bins (half the dense table's bytes); beyond
/// it the dense table is smaller and faster to add into. Statistics merged
/// from decoded results (a coordinator's; a synthetic worker's) stay about
/// 1 MB for SmolLM2 instead of 62 MB.
const SPARSE_MERGE_LIMIT: usize = BIN_COUNT / 4;

/// Adds `theirs` into `mine`, both sorted by bin: in place, without
/// allocating, while `theirs` only has bins `mine` has (what merging batches
/// of the same tensor mostly meets); from the first bin `mine` lacks, into
/// a new list.
fn add_sparse(mine: &mut Vec<(u16, u64)>, theirs: &[(u16, u64)]) {
    let mut at = 0;
    for (next, &(index, count)) in theirs.iter().enumerate() {
        while at < mine.len() && mine[at].0 < index {
            at += 1;
        }
        match mine.get_mut(at) {
            Some((i, c)) if *i == index => {
                *c += count;
                at += 1;
            }
            _ => {
                let mut merged = Vec::with_capacity(mine.len() + theirs.len() - next);
                merged.extend_from_slice(&mine[..at]);
                merge_sparse(&mine[at..], &theirs[next..], &mut merged);
                *mine = merged;
                return;
            }
        }
    }
}

/// Appends the bins of both sorted lists to `merged`, counts of the same
/// bin added.
fn merge_sparse(mine: &[(u16, u64)], theirs: &[(u16, u64)], merged: &mut Vec<(u16, u64)>) {
    let (mut a, mut b) = (mine.iter().peekable(), theirs.iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(&&(i, x)), Some(&&(j, y))) if i == j => {
                a.next();
                b.next();
                (i, x + y)
            }
            (Some(&&(i, _)), Some(&&(j, _))) if j < i => *b.next().expect("peeked"),
            (Some(_), _) => *a.next().expect("peeked"),
            (None, Some(_)) => *b.next().expect("peeked"),
            (None, None) => return,
        };
        merged.push(next);
    }
}

/// Order-preserving map from an f32 pattern to a `u32`: `a < b` (IEEE, with
/// −0 < +0) iff `key(a) < key(b)`. Using it for min/max makes them independent of
/// the order values arrive in, even for signed zeros.
#[inline(always)]
fn order_key(bits: u32) -> u32 {
    if bits & SIGN != 0 { !bits } else { bits | SIGN }
}

/// Inverse of [`order_key`].
#[inline(always)]
fn from_order_key(key: u32) -> f32 {
    f32::from_bits(if key & SIGN != 0 { key & !SIGN } else { !key })
}

/// Magnitude range `[lower, upper)` covered by bin `index` (sign ignored).
///
/// The last finite bin's upper edge is +∞; callers that know the data's
/// abs-max clamp it (see [`Histogram::magnitude_bins`]).
pub fn bin_magnitude_range(index: u16) -> (f32, f32) {
    let magnitude = u32::from(index) & 0x7FFF;
    (
        f32::from_bits(magnitude << SHIFT),
        f32::from_bits((magnitude + 1) << SHIFT),
    )
}

/// Bin index of a value (meaningful for finite non-zero values).
#[inline(always)]
pub fn bin_index(value: f32) -> u16 {
    (value.to_bits() >> SHIFT) as u16
}

/// One non-empty bin of |x|, as seen by the calibrators.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MagnitudeBin {
    /// Inclusive lower edge.
    pub lower: f64,
    /// Exclusive upper edge, clamped to the observed abs-max.
    pub upper: f64,
    /// Number of values whose magnitude falls in the bin.
    pub count: u64,
}

/// The counts of finite non-zero values per bin (the zero and special bins
/// stay empty).
#[derive(Clone)]
enum Bins {
    /// Every bin: what observing writes to, without looking anything up.
    Dense(Box<[u64; BIN_COUNT]>),
    /// The non-empty bins in index order, as decoded: a few thousand for a
    /// real tensor. A coordinator merges a decoded result in time that
    /// follows its size; densifying every decoded tensor (512 KiB each, 121
    /// for SmolLM2) was most of its time per result.
    Sparse(Vec<(u16, u64)>),
}

impl Bins {
    fn zeroed() -> Self {
        Self::Dense(
            vec![0u64; BIN_COUNT]
                .into_boxed_slice()
                .try_into()
                .expect("BIN_COUNT elements"),
        )
    }

    /// The dense counts, converting sparse ones first.
    fn dense(&mut self) -> &mut [u64; BIN_COUNT] {
        if let Self::Sparse(bins) = self {
            let mut dense = Self::zeroed();
            if let Self::Dense(counts) = &mut dense {
                for &(index, count) in bins.iter() {
                    counts[usize::from(index)] = count;
                }
            }
            *self = dense;
        }
        match self {
            Self::Dense(counts) => counts,
            Self::Sparse(_) => unreachable!("converted above"),
        }
    }

    fn get(&self, index: u16) -> u64 {
        match self {
            Self::Dense(counts) => counts[usize::from(index)],
            Self::Sparse(bins) => bins
                .binary_search_by_key(&index, |&(i, _)| i)
                .map_or(0, |at| bins[at].1),
        }
    }

    fn non_empty(&self) -> Box<dyn Iterator<Item = (u16, u64)> + '_> {
        match self {
            Self::Dense(counts) => Box::new(
                counts
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| **c != 0)
                    .map(|(i, &c)| (i as u16, c)),
            ),
            Self::Sparse(bins) => Box::new(bins.iter().copied()),
        }
    }
}

/// Exact, mergeable histogram of f32 values with min/max and special-value counts.
#[derive(Clone)]
pub struct Histogram {
    bins: Bins,
    zero: u64,
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
    /// Every value recorded (the sum of all the counts above), kept so that
    /// the overflow check of a merge does not add up 65 536 bins of both
    /// sides: that check was most of a coordinator's merge time.
    total: u64,
    /// Order key of the smallest finite value; `u32::MAX` when there is none.
    min_key: u32,
    /// Order key of the largest finite value; `0` when there is none.
    max_key: u32,
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.count())
            .field("zero", &self.zero)
            .field("nan", &self.nan)
            .field("pos_inf", &self.pos_inf)
            .field("neg_inf", &self.neg_inf)
            .field("min", &self.min())
            .field("max", &self.max())
            .field("non_empty_bins", &self.non_empty_bins().count())
            .finish()
    }
}

impl PartialEq for Histogram {
    /// Equal counts and extremes, however each side holds its bins.
    fn eq(&self, other: &Self) -> bool {
        (self.zero, self.nan, self.pos_inf, self.neg_inf, self.total)
            == (
                other.zero,
                other.nan,
                other.pos_inf,
                other.neg_inf,
                other.total,
            )
            && (self.min_key, self.max_key) == (other.min_key, other.max_key)
            && self.bins.non_empty().eq(other.bins.non_empty())
    }
}

impl Eq for Histogram {}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self {
            bins: Bins::zeroed(),
            zero: 0,
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
            total: 0,
            min_key: u32::MAX,
            max_key: 0,
        }
    }

    /// Fails if merging `other` into `self` would overflow a `u64` count (more
    /// than 2^64 − 1 values in all, which only crafted files can claim).
    pub fn check_merge(&self, other: &Histogram) -> Result<()> {
        match self.total.checked_add(other.total) {
            Some(_) => Ok(()),
            None => Err(Error::Corrupt(
                "merged histogram would hold more than 2^64 - 1 values".into(),
            )),
        }
    }

    /// Adds `other` into `self`: integer addition of counts, min/max of
    /// extremes. Fails, leaving `self` unchanged, if a count would overflow.
    pub fn merge(&mut self, other: &Histogram) -> Result<()> {
        self.check_merge(other)?;
        match (&mut self.bins, &other.bins) {
            (Bins::Sparse(mine), Bins::Sparse(theirs)) => {
                add_sparse(mine, theirs);
                if mine.len() > SPARSE_MERGE_LIMIT {
                    self.bins.dense();
                }
            }
            (_, theirs) => {
                let counts = self.bins.dense();
                match theirs {
                    Bins::Dense(theirs) => {
                        for (a, b) in counts.iter_mut().zip(theirs.iter()) {
                            *a += *b;
                        }
                    }
                    Bins::Sparse(theirs) => {
                        for &(index, count) in theirs {
                            counts[usize::from(index)] += count;
                        }
                    }
                }
            }
        }
        self.zero += other.zero;
        self.nan += other.nan;
        self.pos_inf += other.pos_inf;
        self.neg_inf += other.neg_inf;
        self.total += other.total;
        self.min_key = self.min_key.min(other.min_key);
        self.max_key = self.max_key.max(other.max_key);
        Ok(())
    }

    /// Number of finite values (zeros included).
    pub fn count(&self) -> u64 {
        self.total - self.nan - self.pos_inf - self.neg_inf
    }

    /// Number of exact zeros (+0 and −0).
    pub fn zero(&self) -> u64 {
        self.zero
    }

    /// Number of NaNs.
    pub fn nan(&self) -> u64 {
        self.nan
    }

    /// Number of +∞.
    pub fn pos_inf(&self) -> u64 {
        self.pos_inf
    }

    /// Number of −∞.
    pub fn neg_inf(&self) -> u64 {
        self.neg_inf
    }

    /// Smallest finite value, if any.
    pub fn min(&self) -> Option<f32> {
        (self.min_key != u32::MAX).then(|| from_order_key(self.min_key))
    }

    /// Largest finite value, if any.
    pub fn max(&self) -> Option<f32> {
        (self.max_key != 0).then(|| from_order_key(self.max_key))
    }

    /// Largest finite magnitude, if any finite value was seen.
    pub fn abs_max(&self) -> Option<f32> {
        Some(self.min()?.abs().max(self.max()?.abs()))
    }

    /// Non-empty bins of finite non-zero values as `(index, count)`, in index order.
    pub fn non_empty_bins(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.bins.non_empty()
    }

    /// Count of one bin.
    pub fn bin(&self, index: u16) -> u64 {
        self.bins.get(index)
    }

    /// The distribution of |x| over finite non-zero values, ascending, with the
    /// sign folded and the top bin clamped to the abs-max. Zeros are in
    /// [`Histogram::zero`].
    pub fn magnitude_bins(&self) -> Vec<MagnitudeBin> {
        let Some(abs_max) = self.abs_max() else {
            return Vec::new();
        };
        let abs_max = f64::from(abs_max);
        let mut magnitudes = std::collections::BTreeMap::<u16, u64>::new();
        for (index, count) in self.non_empty_bins() {
            *magnitudes
                .entry(index & !(NEG_ZERO_BIN as u16))
                .or_default() += count;
        }
        magnitudes
            .into_iter()
            .map(|(index, count)| {
                let (lower, upper) = bin_magnitude_range(index);
                MagnitudeBin {
                    lower: f64::from(lower),
                    upper: f64::from(upper).min(abs_max),
                    count,
                }
            })
            .collect()
    }

    /// Rebuilds a histogram from its parts, validating that they are consistent.
    /// Used by the `.qstats` decoder.
    pub(crate) fn from_parts(parts: HistogramParts) -> Result<Self> {
        let mut previous: Option<u16> = None;
        // Decoded counts are untrusted. Real data never holds 2^64 values, and
        // with the total in range `count()` and every sum over bins cannot
        // overflow (the `qstats_decode` fuzz target found this).
        let overflow =
            || Error::Corrupt("histogram counts add up to more than 2^64 - 1 values".into());
        let mut total = [parts.zero, parts.nan, parts.pos_inf, parts.neg_inf]
            .into_iter()
            .try_fold(0u64, u64::checked_add)
            .ok_or_else(overflow)?;
        for &(index, count) in &parts.bins {
            let i = usize::from(index);
            let special = (FIRST_SPECIAL_BIN..NEG_ZERO_BIN).contains(&(i & 0x7FFF));
            if special || count == 0 || previous.is_some_and(|p| p >= index) {
                return Err(Error::Corrupt(format!(
                    "histogram bin {index:#06x} (count {count}) is invalid or out of order"
                )));
            }
            total = total.checked_add(count).ok_or_else(overflow)?;
            previous = Some(index);
        }
        let mut histogram = Self {
            bins: Bins::Sparse(parts.bins),
            zero: parts.zero,
            nan: parts.nan,
            pos_inf: parts.pos_inf,
            neg_inf: parts.neg_inf,
            total,
            min_key: u32::MAX,
            max_key: 0,
        };
        let finite = histogram.count();
        match (parts.min, parts.max) {
            (None, None) if finite == 0 => {}
            (Some(min), Some(max)) if finite > 0 && min.is_finite() && max.is_finite() => {
                histogram.min_key = order_key(min.to_bits());
                histogram.max_key = order_key(max.to_bits());
                if histogram.min_key > histogram.max_key {
                    return Err(Error::Corrupt(format!("min {min} exceeds max {max}")));
                }
            }
            _ => {
                return Err(Error::Corrupt(format!(
                    "min/max ({:?}, {:?}) inconsistent with {finite} finite values",
                    parts.min, parts.max
                )));
            }
        }
        Ok(histogram)
    }
}

/// A histogram taken apart for serialization.
pub(crate) struct HistogramParts {
    pub bins: Vec<(u16, u64)>,
    pub zero: u64,
    pub nan: u64,
    pub pos_inf: u64,
    pub neg_inf: u64,
    pub min: Option<f32>,
    pub max: Option<f32>,
}

impl Histogram {
    /// Takes the histogram apart for serialization.
    pub(crate) fn to_parts(&self) -> HistogramParts {
        HistogramParts {
            bins: self.non_empty_bins().collect(),
            zero: self.zero,
            nan: self.nan,
            pos_inf: self.pos_inf,
            neg_inf: self.neg_inf,
            min: self.min(),
            max: self.max(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_are_at_most_one_percent_wide_for_normal_values() {
        let mut worst: f64 = 0.0;
        for magnitude in (1u16 << MANTISSA_BITS)..(FIRST_SPECIAL_BIN as u16 - 1) {
            let (lo, hi) = bin_magnitude_range(magnitude);
            worst = worst.max((f64::from(hi) - f64::from(lo)) / f64::from(lo));
        }
        assert!(worst <= 0.01, "relative bin width {worst}");
        assert!((worst - 2f64.powi(-7)).abs() < 1e-12);
    }

    #[test]
    fn every_value_falls_inside_its_bin() {
        for v in [1.0f32, 1.5, 3.3, 1e-30, 6.5e4, 3.0e38, -2.75, -1e-20] {
            let (lo, hi) = bin_magnitude_range(bin_index(v));
            assert!(lo <= v.abs() && v.abs() < hi, "{v} not in [{lo}, {hi})");
        }
    }

    #[test]
    fn special_values_and_zeros_are_counted_apart() {
        let weird_nan = f32::from_bits(0x7F80_0001); // NaN whose bin is +Inf's
        let values = [
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            weird_nan,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0,
            -2.0,
            f32::from_bits(1), // smallest subnormal: not a zero
        ];
        let mut h = Histogram::new();
        h.observe(&values);
        assert_eq!(h.zero(), 2);
        assert_eq!(h.nan(), 3);
        assert_eq!(h.pos_inf(), 1);
        assert_eq!(h.neg_inf(), 1);
        assert_eq!(h.count(), 5);
        assert_eq!(h.min(), Some(-2.0));
        assert_eq!(h.max(), Some(1.0));
        assert_eq!(h.bin(0), 1, "subnormal in the lowest bin");
        assert_eq!(h.non_empty_bins().count(), 3);
    }

    #[test]
    fn signed_zero_extremes_do_not_depend_on_order() {
        let mut a = Histogram::new();
        a.observe(&[0.0, -0.0]);
        let mut b = Histogram::new();
        b.observe(&[-0.0, 0.0]);
        assert_eq!(a, b);
        assert_eq!(a.min().map(f32::to_bits), Some((-0.0f32).to_bits()));
        assert_eq!(a.max().map(f32::to_bits), Some(0.0f32.to_bits()));
    }

    #[test]
    fn empty_and_all_nan_have_no_extremes() {
        let mut h = Histogram::new();
        assert_eq!((h.min(), h.max(), h.abs_max()), (None, None, None));
        h.observe(&[f32::NAN; 9]);
        assert_eq!((h.count(), h.nan(), h.min()), (0, 9, None));
        assert!(h.magnitude_bins().is_empty());
    }

    #[test]
    fn merging_past_u64_is_refused_and_changes_nothing() {
        let huge = |n: u64| {
            Histogram::from_parts(HistogramParts {
                bins: vec![(bin_index(1.0), n)],
                zero: 0,
                nan: 0,
                pos_inf: 0,
                neg_inf: 0,
                min: Some(1.0),
                max: Some(1.0),
            })
            .unwrap()
        };
        let mut a = huge(u64::MAX - 5);
        let before = a.clone();
        assert!(a.merge(&huge(6)).is_err());
        assert_eq!(a, before);
        a.merge(&huge(5)).unwrap();
        assert_eq!(a.count(), u64::MAX);
    }

    #[test]
    fn a_decoded_histogram_answers_merges_and_observes_like_the_one_encoded() {
        let values: Vec<f32> = (0..5000)
            .map(|i| ((i as f32) * 0.37).sin() * 10f32.powi(i % 7 - 3))
            .chain([0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY])
            .collect();
        let (first, second) = values.split_at(2000);
        let observed = |values: &[f32]| {
            let mut h = Histogram::new();
            h.observe(values);
            h
        };
        let dense = observed(first);
        let decoded = Histogram::from_parts(dense.to_parts()).unwrap();
        assert!(matches!(decoded.bins, Bins::Sparse(_)));
        assert_eq!(decoded, dense);
        assert_eq!(decoded.count(), dense.count());
        assert_eq!(decoded.magnitude_bins(), dense.magnitude_bins());
        for index in (0..=u16::MAX).step_by(97) {
            assert_eq!(decoded.bin(index), dense.bin(index), "bin {index:#06x}");
        }
        // Merged into, merged from, or both: the counts of one histogram of all.
        let whole = observed(&values);
        let other = observed(second);
        let other_decoded = Histogram::from_parts(other.to_parts()).unwrap();
        for (mut a, b) in [
            (dense.clone(), &other_decoded),
            (decoded.clone(), &other),
            (decoded.clone(), &other_decoded),
        ] {
            let both_sparse = matches!((&a.bins, &b.bins), (Bins::Sparse(_), Bins::Sparse(_)));
            a.merge(b).unwrap();
            assert_eq!(
                matches!(a.bins, Bins::Sparse(_)),
                both_sparse,
                "two decoded histograms merge without densifying"
            );
            assert_eq!(a, whole);
            assert_eq!(
                a.non_empty_bins().collect::<Vec<_>>(),
                whole.non_empty_bins().collect::<Vec<_>>()
            );
        }
        // Bins all in the other's: added in place.
        let mut twice = decoded.clone();
        twice.merge(&decoded).unwrap();
        let mut twice_dense = dense.clone();
        twice_dense.merge(&dense).unwrap();
        assert!(matches!(twice.bins, Bins::Sparse(_)));
        assert_eq!(twice, twice_dense);
        let mut resumed = decoded;
        resumed.observe(second);
        assert_eq!(resumed, whole);
    }

    #[test]
    fn sparse_histograms_whose_union_outgrows_the_limit_merge_dense() {
        // Every bin of ±2^-60 .. 2^60: 30 720 bins, split between two.
        let values: Vec<f32> = (-60..60)
            .flat_map(|e| (0..128).map(move |m| 2f32.powi(e) * (1.0 + m as f32 / 128.0)))
            .flat_map(|v| [v, -v])
            .collect();
        let (first, second) = values.split_at(values.len() / 2);
        let decoded = |values: &[f32]| {
            let mut h = Histogram::new();
            h.observe(values);
            Histogram::from_parts(h.to_parts()).unwrap()
        };
        let mut merged = decoded(first);
        merged.merge(&decoded(second)).unwrap();
        assert!(matches!(merged.bins, Bins::Dense(_)));
        let mut whole = Histogram::new();
        whole.observe(&values);
        assert_eq!(merged, whole);
        assert!(whole.non_empty_bins().count() > SPARSE_MERGE_LIMIT);
    }

    #[test]
    fn magnitude_bins_fold_signs_and_clamp_the_top() {
        let mut h = Histogram::new();
        h.observe(&[1.0, -1.0, 3.0, 0.0]);
        let bins = h.magnitude_bins();
        assert_eq!(bins.len(), 2);
        assert_eq!(bins[0].count, 2);
        assert_eq!(bins[0].lower, 1.0);
        assert_eq!(bins[1].upper, 3.0, "top bin clamped to abs-max");
    }
}
