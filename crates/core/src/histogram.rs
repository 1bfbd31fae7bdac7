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

use crate::cpu::CpuTier;
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

/// Per-call tallies of the vectorised pass, folded into the histogram at the end.
#[derive(Default)]
struct Tally {
    pos_zero: u64,
    neg_zero: u64,
    pos_inf: u64,
    neg_inf: u64,
    nan: u64,
    /// Order key of the smallest finite value; `u32::MAX` when there is none.
    min_key: u32,
    /// Order key of the largest finite value; `0` when there is none.
    max_key: u32,
}

impl Tally {
    fn new() -> Self {
        Self {
            min_key: u32::MAX,
            ..Self::default()
        }
    }

    /// Classifies one value exactly; the slow path for blocks holding NaN/Inf.
    #[inline(always)]
    fn classify(&mut self, bits: u32) {
        match bits {
            0 => self.pos_zero += 1,
            SIGN => self.neg_zero += 1,
            INF_BITS => self.pos_inf += 1,
            NEG_INF_BITS => self.neg_inf += 1,
            _ if bits & !SIGN > INF_BITS => self.nan += 1,
            _ => {}
        }
        if bits & !SIGN < INF_BITS {
            let key = order_key(bits);
            self.min_key = self.min_key.min(key);
            self.max_key = self.max_key.max(key);
        }
    }
}

/// Values per block: the tally pass and the binning pass both walk one block, so
/// the second reads it from L1 (16 KiB), and the `u32` lane counters cannot
/// overflow within a block.
const BLOCK: usize = 4096;
/// Lanes of the tally pass: 8 × 32 bits fills one AVX2 register.
const LANES: usize = 8;

/// Per-lane state of the tally pass over one block: the extreme order keys
/// and the counts of the patterns binning cannot tell apart.
struct LaneTally {
    min_k: [u32; LANES],
    max_k: [u32; LANES],
    zero: [u32; LANES],
    neg_zero: [u32; LANES],
    special: [u32; LANES],
}

impl LaneTally {
    fn new() -> Self {
        Self {
            min_k: [u32::MAX; LANES],
            max_k: [0; LANES],
            zero: [0; LANES],
            neg_zero: [0; LANES],
            special: [0; LANES],
        }
    }
}

/// Pass 1 of the kernel over a block's whole groups of [`LANES`] values:
/// tallies each lane and writes each value's bin ([`bin_of`]).
trait TallyPass {
    /// # Safety
    /// The CPU must have the instructions the pass uses.
    unsafe fn run(groups: &[[f32; LANES]], bins: &mut [u16], lanes: &mut LaneTally);
}

/// Lane-wise Rust that the compiler vectorizes for the tier it is compiled
/// into (AVX2 on x86-64).
struct ScalarLanes;

impl TallyPass for ScalarLanes {
    #[inline(always)]
    unsafe fn run(groups: &[[f32; LANES]], bins: &mut [u16], t: &mut LaneTally) {
        for (group, group_bins) in groups.iter().zip(bins.chunks_exact_mut(LANES)) {
            for l in 0..LANES {
                let bits = group[l].to_bits();
                let magnitude = bits & !SIGN;
                let key = order_key(bits);
                t.min_k[l] = t.min_k[l].min(key);
                t.max_k[l] = t.max_k[l].max(key);
                t.zero[l] += u32::from(magnitude == 0);
                t.neg_zero[l] += u32::from(bits == SIGN);
                t.special[l] += u32::from(magnitude >= INF_BITS);
                group_bins[l] = bin_of(bits, l);
            }
        }
    }
}

/// The observation kernel. `inline(always)` so that each CPU tier below compiles
/// its own copy with that tier's instructions.
#[inline(always)]
unsafe fn observe_kernel<P: TallyPass>(
    counts: &mut [u64; BIN_COUNT],
    values: &[f32],
    tally: &mut Tally,
) {
    for block in values.chunks(BLOCK) {
        // Pass 1, vectorised: min/max keys over all values and counts of the
        // patterns that binning cannot tell apart (±0, and whether any NaN/Inf
        // is present). Keeping the common case to these few lane operations
        // roughly doubled this pass's throughput over classifying every value.
        let mut lanes = LaneTally::new();
        let mut bins = [0u16; BLOCK];
        let (groups, rest) = block.as_chunks::<LANES>();
        // SAFETY: forwarded from the caller.
        unsafe { P::run(groups, &mut bins, &mut lanes) };
        let LaneTally {
            min_k,
            max_k,
            zero,
            neg_zero,
            special,
        } = lanes;
        let tail_start = block.len() - rest.len();
        for (l, value) in rest.iter().enumerate() {
            bins[tail_start + l] = bin_of(value.to_bits(), l);
        }
        let sum = |lanes: [u32; LANES]| lanes.iter().map(|&c| u64::from(c)).sum::<u64>();
        if sum(special) == 0 && rest.is_empty() {
            let zero = sum(zero);
            let neg_zero = sum(neg_zero);
            tally.pos_zero += zero - neg_zero;
            tally.neg_zero += neg_zero;
            tally.min_key = min_k.iter().fold(tally.min_key, |a, &b| a.min(b));
            tally.max_key = max_k.iter().fold(tally.max_key, |a, &b| a.max(b));
        } else {
            // NaN/Inf present (their keys would corrupt min/max) or a ragged
            // tail: classify the block one value at a time.
            for value in block {
                tally.classify(value.to_bits());
            }
        }

        // Pass 2, scalar: one increment per value, from the indices pass 1
        // computed in SIMD. A u16 index cannot leave the 65 536-slot table, so
        // there is no bounds check.
        for &bin in &bins[..block.len()] {
            counts[usize::from(bin)] += 1;
        }
    }
}

/// Table slot of a value for pass 2 of the kernel: its bin, except that exact
/// zeros go round-robin (by `lane`) to eight of the otherwise unused NaN/Inf
/// slots. An increment of the slot the previous value hit waits for that
/// store, and runs of zeros (half of a ReLU output) are the common such run.
/// Spreading them, with the indices computed in SIMD, took ReLU-like input from
/// 0.95 to 1.87 G values/s on AVX2 (Gaussian input: 2.25 → 1.85, the price of
/// the index buffer). `fold_tally` moves them to the zero count.
#[inline(always)]
fn bin_of(bits: u32, lane: usize) -> u16 {
    if bits & !SIGN == 0 {
        (ZERO_SPREAD_BIN + lane % ZERO_SPREAD) as u16
    } else {
        (bits >> SHIFT) as u16
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn observe_avx2(counts: &mut [u64; BIN_COUNT], values: &[f32], tally: &mut Tally) {
    // SAFETY: the scalar pass needs nothing beyond what this function enables.
    unsafe { observe_kernel::<ScalarLanes>(counts, values, tally) }
}

fn observe_portable(counts: &mut [u64; BIN_COUNT], values: &[f32], tally: &mut Tally) {
    // SAFETY: the scalar pass needs nothing beyond the baseline.
    unsafe { observe_kernel::<ScalarLanes>(counts, values, tally) }
}

#[cfg(target_arch = "aarch64")]
fn observe_neon(counts: &mut [u64; BIN_COUNT], values: &[f32], tally: &mut Tally) {
    // SAFETY: NEON is in every aarch64 CPU.
    unsafe { observe_kernel::<neon::NeonLanes>(counts, values, tally) }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    //! The tally pass in NEON intrinsics: the compiler leaves the lane-wise
    //! Rust scalar on aarch64. Each half of a group of [`LANES`] is one
    //! register, the lane state stays in registers for the whole block, and
    //! the results are the scalar pass's, lane for lane.

    use std::arch::aarch64::*;

    use super::{INF_BITS, LANES, LaneTally, SHIFT, SIGN, TallyPass, ZERO_SPREAD_BIN};

    pub(super) struct NeonLanes;

    impl TallyPass for NeonLanes {
        #[inline(always)]
        unsafe fn run(groups: &[[f32; LANES]], bins: &mut [u16], t: &mut LaneTally) {
            // SAFETY: NEON is baseline; every load and store stays within the
            // lane arrays, `groups` and the first `8 · groups.len()` bins.
            unsafe {
                let load = |a: &[u32; LANES]| [vld1q_u32(a.as_ptr()), vld1q_u32(a.as_ptr().add(4))];
                let (mut min_k, mut max_k) = (load(&t.min_k), load(&t.max_k));
                let (mut zero, mut neg_zero) = (load(&t.zero), load(&t.neg_zero));
                let mut special = load(&t.special);
                let spread = [0u32, 1, 2, 3, 4, 5, 6, 7].map(|l| ZERO_SPREAD_BIN as u32 + l);
                let spread = [
                    vld1q_u32(spread.as_ptr()),
                    vld1q_u32(spread.as_ptr().add(4)),
                ];
                let (sign, inf) = (vdupq_n_u32(SIGN), vdupq_n_u32(INF_BITS));
                for (group, out) in groups.iter().zip(bins.chunks_exact_mut(LANES)) {
                    for h in 0..2 {
                        let bits = vld1q_u32(group.as_ptr().cast::<u32>().add(4 * h));
                        let magnitude = vbicq_u32(bits, sign);
                        let negative = vtstq_u32(bits, sign);
                        let key = vbslq_u32(negative, vmvnq_u32(bits), vorrq_u32(bits, sign));
                        min_k[h] = vminq_u32(min_k[h], key);
                        max_k[h] = vmaxq_u32(max_k[h], key);
                        // A true comparison is all ones, −1: subtracting counts it.
                        let is_zero = vceqzq_u32(magnitude);
                        zero[h] = vsubq_u32(zero[h], is_zero);
                        neg_zero[h] = vsubq_u32(neg_zero[h], vceqq_u32(bits, sign));
                        special[h] = vsubq_u32(special[h], vcgeq_u32(magnitude, inf));
                        let bin =
                            vbslq_u32(is_zero, spread[h], vshrq_n_u32::<{ SHIFT as i32 }>(bits));
                        vst1_u16(out.as_mut_ptr().add(4 * h), vmovn_u32(bin));
                    }
                }
                let store = |a: &mut [u32; LANES], v: [uint32x4_t; 2]| {
                    vst1q_u32(a.as_mut_ptr(), v[0]);
                    vst1q_u32(a.as_mut_ptr().add(4), v[1]);
                };
                store(&mut t.min_k, min_k);
                store(&mut t.max_k, max_k);
                store(&mut t.zero, zero);
                store(&mut t.neg_zero, neg_zero);
                store(&mut t.special, special);
            }
        }
    }
}

/// A CPU tier of the observation kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObserveTier {
    /// The kernel compiled for the target's baseline instruction set.
    Portable,
    /// The kernel compiled with AVX2 (x86-64 only).
    Avx2,
    /// The tally pass in NEON intrinsics (aarch64 only).
    Neon,
}

impl CpuTier for ObserveTier {
    const ALL: &'static [Self] = &[Self::Portable, Self::Avx2, Self::Neon];

    fn is_supported(self) -> bool {
        let cpu = crate::CpuFeatures::get();
        match self {
            Self::Portable => true,
            Self::Avx2 => cpu.avx2,
            Self::Neon => cpu.neon,
        }
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

    /// Records every value of `values` using the fastest kernel this CPU has.
    /// Does not allocate.
    pub fn observe(&mut self, values: &[f32]) {
        self.observe_with(ObserveTier::detect(), values)
            .expect("detected tier is supported");
    }

    /// Records `values` with a chosen kernel tier; errors if the CPU lacks it.
    /// Tests use this to compare tiers.
    pub fn observe_with(&mut self, tier: ObserveTier, values: &[f32]) -> Result<()> {
        if !tier.is_supported() {
            return Err(Error::UnsupportedTier(format!("{tier:?}")));
        }
        let mut tally = Tally::new();
        let counts = self.bins.dense();
        match tier {
            ObserveTier::Portable => observe_portable(counts, values, &mut tally),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `is_supported` confirmed AVX2 above.
            ObserveTier::Avx2 => unsafe { observe_avx2(counts, values, &mut tally) },
            #[cfg(not(target_arch = "x86_64"))]
            ObserveTier::Avx2 => unreachable!("rejected by is_supported"),
            #[cfg(target_arch = "aarch64")]
            ObserveTier::Neon => observe_neon(counts, values, &mut tally),
            #[cfg(not(target_arch = "aarch64"))]
            ObserveTier::Neon => unreachable!("rejected by is_supported"),
        }
        self.fold_tally(&tally);
        self.total += values.len() as u64;
        Ok(())
    }

    /// Moves zeros and non-finite values out of the bins the binning pass put
    /// them in, into their own counts.
    fn fold_tally(&mut self, tally: &Tally) {
        let zeros = tally.pos_zero + tally.neg_zero;
        let special = tally.nan + tally.pos_inf + tally.neg_inf;
        if zeros + special > 0 {
            // Only zeros (spread there by the kernel) and Inf/NaN patterns (whose
            // exponent is all ones) occupy these bins.
            let mut moved = 0;
            let counts = self.bins.dense();
            for start in [FIRST_SPECIAL_BIN, FIRST_SPECIAL_BIN | NEG_ZERO_BIN] {
                for bin in &mut counts[start..start + SPECIAL_BINS] {
                    moved += *bin;
                    *bin = 0;
                }
            }
            debug_assert_eq!(moved, zeros + special);
        }
        self.zero += zeros;
        self.pos_inf += tally.pos_inf;
        self.neg_inf += tally.neg_inf;
        self.nan += tally.nan;
        self.min_key = self.min_key.min(tally.min_key);
        self.max_key = self.max_key.max(tally.max_key);
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

/// The scalar twin of the observation kernels: classifies one value at a time
/// with ordinary float operations. Tests compare every tier against it.
pub fn observe_reference(histogram: &mut Histogram, values: &[f32]) {
    histogram.total += values.len() as u64;
    for &v in values {
        if v.is_nan() {
            histogram.nan += 1;
        } else if v == f32::INFINITY {
            histogram.pos_inf += 1;
        } else if v == f32::NEG_INFINITY {
            histogram.neg_inf += 1;
        } else {
            if v == 0.0 {
                histogram.zero += 1;
            } else {
                histogram.bins.dense()[usize::from(bin_index(v))] += 1;
            }
            let key = order_key(v.to_bits());
            histogram.min_key = histogram.min_key.min(key);
            histogram.max_key = histogram.max_key.max(key);
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
