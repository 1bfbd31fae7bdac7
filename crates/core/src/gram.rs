//! Exact Gram matrices `Σ x xᵀ` over the rows a layer input saw: the
//! Hessians GPTQ rounds weights with.
//!
//! A float sum depends on its order, so Hessians summed as floats move with
//! the sharding (llm-compressor's data-parallel GPTQ sums float Hessians; its
//! Llama-3-8B perplexity reads 37.51, 37.64 and 36.40 on 1, 2 and 4 GPUs).
//! Here every observation is cut into chunks of [`CHUNK_ROWS`] rows; a
//! chunk's sums are computed in f32, each entry over the chunk's rows in
//! order (one fused multiply-add per row, rounded once), then scaled by a
//! run-wide power of two and rounded to `i128`. Partials
//! merge by integer addition: any sharding, any merge order, the same
//! integers. An entry that would leave the range is refused, never wrapped.
//!
//! The chunk sums are f32 because GPTQ needs the Hessian to a few digits,
//! not to f64's sixteen: over 1 024 rows an entry's relative rounding error is
//! about 2e-6 (at worst 1 024 · 2⁻²⁴ ≈ 6e-5), under the 1 % dampening GPTQ
//! adds to the diagonal by orders of magnitude, and the reference GPTQ sums
//! its whole Hessian in f32. Twice the lanes per vector and half the bytes
//! per panel, with the sums added in place, made the Hessian arithmetic
//! 2.1–2.5 times as fast as f64 chunk sums were; fused multiply-adds, one
//! instruction where a product and an addition took two, made it faster
//! again (BENCHMARKS.md, "GPTQ's time").

use rayon::prelude::*;

use crate::cpu::{CpuTier, VectorTier};
use crate::error::{Error, Result};

/// Rows per chunk of an observation whose f32 sums are rounded to fixed point
/// together. Fixed, so that the integers depend only on the rows observed;
/// small enough that a chunk of a 14 336-wide input packs into 59 MB. A
/// chunk's sums are scaled, rounded and added to the `i128` triangle (16
/// bytes per entry, read and written) once per chunk: at 256 rows that cost
/// as much as the multiply-adds, at 1 024 a quarter as much.
pub const CHUNK_ROWS: usize = 1024;

/// Magnitude the merged sums of a run are kept under (`2^LIMIT_BITS`): seven
/// bits below `i128::MAX`, so rounding and the bound's slack cannot overflow.
const LIMIT_BITS: i32 = 120;

/// The largest activation magnitude [`Gram::run_exponent`] provides for:
/// 2²⁴. Trained LLMs stay far below it (the "massive activations" of
/// Llama-2 and -3 reach about 10⁴; Sun et al., 2024). The sums have seven
/// bits of headroom, so an input overflows only when its values pass about
/// eleven times the bound on every row; its Gram matrix is then dropped, not
/// wrapped ([`crate::TensorStats`]).
pub const ACTIVATION_BOUND: f32 = 16_777_216.0;

/// Columns of a packed panel: one AVX-512 register of f32.
const PANEL: usize = 16;

/// `Σ x xᵀ` of a `width`-wide input, as integers `round(partial · 2^exponent)`
/// summed over chunks; the upper triangle, row by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gram {
    width: usize,
    exponent: i32,
    rows: u64,
    upper: Vec<i128>,
}

impl Gram {
    /// An empty Gram matrix of a `width`-wide input whose sums are scaled by
    /// `2^exponent` ([`Gram::exponent_for`] chooses it for a run).
    pub fn new(width: usize, exponent: i32) -> Result<Self> {
        if width == 0 {
            return Err(Error::Shape("a Gram matrix needs a width ≥ 1".into()));
        }
        if !(-EXPONENT_RANGE..=EXPONENT_RANGE).contains(&exponent) {
            return Err(Error::Shape(format!(
                "Gram exponent {exponent} is outside ±{EXPONENT_RANGE}"
            )));
        }
        Ok(Self {
            width,
            exponent,
            rows: 0,
            upper: vec![0; width * (width + 1) / 2],
        })
    }

    /// The exponent a run of `rows` rows sums its Gram matrices at: the one
    /// [`Gram::exponent_for`] gives for values up to [`ACTIVATION_BOUND`].
    /// It depends on the plan alone, so the Hessians can be summed in the
    /// same pass that first sees the activations. Its resolution is far finer
    /// than the f32 chunk sums' (2⁻⁵⁸ at 16 384 rows).
    pub fn run_exponent(rows: u64) -> i32 {
        Self::exponent_for(ACTIVATION_BOUND, rows).expect("the bound is finite")
    }

    /// The exponent that keeps the merged sums of `rows` rows whose values are
    /// at most `max_abs` in magnitude under `2^120`: every entry is at most
    /// `rows · max_abs²`. A run chooses it once and every batch uses it, so
    /// partials merge as integers.
    pub fn exponent_for(max_abs: f32, rows: u64) -> Result<i32> {
        if !max_abs.is_finite() {
            return Err(Error::NonFinite(format!(
                "the input's largest magnitude is {max_abs}; its Gram matrix is undefined"
            )));
        }
        let bound = f64::from(max_abs.abs()).powi(2) * rows.max(1) as f64;
        if bound == 0.0 {
            // Every value is zero: any exponent represents the sums exactly.
            return Ok(0);
        }
        // ceil(log2(bound)) from the bits, exact for powers of two.
        let (mantissa, exp) = frexp(bound);
        let log2 = if mantissa == 0.5 { exp - 1 } else { exp };
        Ok((LIMIT_BITS - log2).clamp(-EXPONENT_RANGE, EXPONENT_RANGE))
    }

    /// Adds `values`, rows of `width` values, with the fastest tier.
    pub fn observe(&mut self, values: &[f32]) -> Result<()> {
        self.observe_with(VectorTier::detect(), values)
    }

    /// Adds `values` with a chosen kernel tier; errors if the CPU lacks it.
    /// Tests use this to compare tiers. A refused observation leaves the
    /// matrix unchanged. Nothing the size of the matrix is allocated: sums
    /// are added in place, a panel of rows at a time, the panels side by
    /// side on the rayon pool.
    pub fn observe_with(&mut self, tier: VectorTier, values: &[f32]) -> Result<()> {
        if !tier.is_supported() {
            return Err(Error::UnsupportedTier(format!("{tier:?}")));
        }
        let width = self.width;
        if !values.len().is_multiple_of(width) {
            return Err(Error::Shape(format!(
                "{} values do not form rows of {width}",
                values.len()
            )));
        }
        if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
            return Err(Error::NonFinite(format!(
                "a {width}-wide input holds {bad}; its Gram matrix is undefined (a NaN or infinite activation upstream)"
            )));
        }
        // Sums are added in place; an entry that cannot be added undoes
        // what this observation added before it (the integers are exact, so
        // subtracting them restores every entry), recomputing the chunks.
        let scale = 2f64.powi(self.exponent);
        let padded = width.next_multiple_of(PANEL);
        let mut packed = Vec::new();
        let chunks = || values.chunks(CHUNK_ROWS * width);
        for (done, chunk) in chunks().enumerate() {
            pack(chunk, width, padded, &mut packed);
            let upper = &mut self.upper;
            let applied = apply_chunk(tier, &packed, width, upper, scale, Direction::Add, None);
            let Some(entry) = first_refused(width, &applied) else {
                continue;
            };
            for (c, chunk) in chunks().take(done + 1).enumerate() {
                pack(chunk, width, padded, &mut packed);
                let limits = (c == done).then_some(applied.as_slice());
                let taken =
                    apply_chunk(tier, &packed, width, upper, scale, Direction::Take, limits);
                let all_taken = match limits {
                    Some(added) => taken == added,
                    None => first_refused(width, &taken).is_none(),
                };
                assert!(all_taken, "taking back what was added cannot overflow");
            }
            let (i, j) = upper_entry(width, entry);
            return Err(self.overflow(i, j));
        }
        self.rows += (values.len() / width) as u64;
        Ok(())
    }

    fn overflow(&self, i: usize, j: usize) -> Error {
        Error::Overflow(format!(
            "Gram entry ({i}, {j}) of a {}-wide input leaves the fixed-point range of exponent {}: the input holds larger values than the run's exponent was chosen for",
            self.width, self.exponent
        ))
    }

    /// Merges `other` into `self`; refused (and `self` unchanged) when the
    /// widths or exponents differ or a sum would overflow.
    pub fn merge(&mut self, other: &Gram) -> Result<()> {
        self.check_merge(other)?;
        self.add_checked(other);
        Ok(())
    }

    /// Adds `other` into `self`, which [`Gram::check_merge`] has accepted:
    /// a caller that checked a whole set of statistics first adds without
    /// scanning the matrices again (a Llama-3-8B `down_proj` matrix is
    /// 103 M entries).
    pub(crate) fn add_checked(&mut self, other: &Gram) {
        for (a, b) in self.upper.iter_mut().zip(&other.upper) {
            *a += b;
        }
        self.rows += other.rows;
    }

    /// Fails if `other` cannot be merged into `self`.
    pub fn check_merge(&self, other: &Gram) -> Result<()> {
        if (self.width, self.exponent) != (other.width, other.exponent) {
            return Err(Error::Shape(format!(
                "cannot merge a Gram matrix of width {} and exponent {} with one of width {} and exponent {}",
                self.width, self.exponent, other.width, other.exponent
            )));
        }
        let overflows = self
            .upper
            .iter()
            .zip(&other.upper)
            .any(|(a, b)| a.checked_add(*b).is_none());
        if overflows || self.rows.checked_add(other.rows).is_none() {
            return Err(Error::Overflow(
                "merging these Gram matrices would overflow".into(),
            ));
        }
        Ok(())
    }

    /// Width of the input.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The fixed-point exponent.
    pub fn exponent(&self) -> i32 {
        self.exponent
    }

    /// Rows observed.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The upper triangle's integers, row by row (`(0,0), (0,1) … (1,1) …`).
    pub fn upper(&self) -> &[i128] {
        &self.upper
    }

    /// The matrix as f64, `width × width`, row-major and symmetric: each
    /// integer divided by `2^exponent` (rounded to the nearest f64). The
    /// integers are freed on return, not kept beside their f64 copy.
    pub fn into_matrix(self) -> Vec<f64> {
        let n = self.width;
        let unscale = 2f64.powi(-self.exponent);
        let mut out = vec![0.0; n * n];
        for i in 0..n {
            for j in i..n {
                let v = self.upper[upper_index(n, i, j)] as f64 * unscale;
                out[i * n + j] = v;
                out[j * n + i] = v;
            }
        }
        out
    }

    /// Rebuilds a matrix from its parts (the codec's decoder).
    pub(crate) fn from_parts(
        width: usize,
        exponent: i32,
        rows: u64,
        upper: Vec<i128>,
    ) -> Result<Self> {
        let mut gram = Self::new(width, exponent)?;
        if upper.len() != gram.upper.len() {
            return Err(Error::Shape(format!(
                "{} entries for the upper triangle of a {width}-wide Gram matrix",
                upper.len()
            )));
        }
        gram.rows = rows;
        gram.upper = upper;
        Ok(gram)
    }
}

/// Exponents stay where `2^e` and `2^-e` are normal f64 values.
const EXPONENT_RANGE: i32 = 1000;

/// Index of `(i, j)`, `j ≥ i`, in a row-major upper triangle of width `n`.
fn upper_index(n: usize, i: usize, j: usize) -> usize {
    i * (2 * n - i + 1) / 2 + (j - i)
}

/// `(i, j)` of the entry at `index` of a row-major upper triangle of width
/// `n`.
fn upper_entry(n: usize, index: usize) -> (usize, usize) {
    let i = (0..n)
        .take_while(|&i| upper_index(n, i, i) <= index)
        .last()
        .expect("index inside the triangle");
    (i, i + index - upper_index(n, i, i))
}

/// `value` rounded half to even, as an integer under `2^127`; `None` past it.
#[inline(always)]
fn to_fixed(value: f64) -> Option<i128> {
    // 2^126: an entry at or beyond it means the exponent's bound was wrong.
    const LIMIT: f64 = 85_070_591_730_234_615_865_843_651_857_942_052_864.0;
    // 2^53: from here on every f64 is an integer.
    const INTEGRAL: f64 = 9_007_199_254_740_992.0;
    let rounded = value.round_ties_even();
    let magnitude = rounded.abs();
    if magnitude < INTEGRAL {
        return Some(rounded as i64 as i128);
    }
    // An f32 sum past f32's range is infinite, or NaN where infinities of
    // both signs met.
    if magnitude >= LIMIT || magnitude.is_nan() {
        return None;
    }
    // Mantissa times a power of two, shifted as an integer: exact, and far
    // cheaper than the generic f64 → i128 conversion, which is a library
    // call. Every entry of a run scaled towards 2^120 takes this path.
    let bits = magnitude.to_bits();
    let mantissa = i128::from((bits & ((1 << 52) - 1)) | (1 << 52));
    let shift = ((bits >> 52) as i32 - 1075) as u32;
    let fixed = mantissa << shift;
    Some(if rounded < 0.0 { -fixed } else { fixed })
}

/// `(m, e)` with `x = m · 2^e` and `0.5 ≤ m < 1`, for a finite positive `x`.
fn frexp(x: f64) -> (f64, i32) {
    let bits = x.to_bits();
    let biased = ((bits >> 52) & 0x7FF) as i32;
    if biased == 0 {
        // Subnormal: scale into the normal range first.
        let (m, e) = frexp(x * 2f64.powi(64));
        return (m, e - 64);
    }
    let mantissa = f64::from_bits((bits & !(0x7FF << 52)) | (1022 << 52));
    (mantissa, biased - 1022)
}

/// Packs `rows` of `width` values into panels of [`PANEL`] columns
/// (`[panel][row][PANEL]`), zero-padded to `padded` columns: each tile of
/// the kernel then streams contiguous panels. Zero columns add nothing.
fn pack(values: &[f32], width: usize, padded: usize, out: &mut Vec<f32>) {
    let rows = values.len() / width;
    out.clear();
    out.resize(rows * padded, 0.0);
    for (r, row) in values.chunks_exact(width).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            out[(c / PANEL) * rows * PANEL + r * PANEL + c % PANEL] = v;
        }
    }
}

/// Whether a chunk's integers are added to the sums, or taken back out
/// after a later entry was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Add,
    Take,
}

/// Adds one chunk (`packed` by [`pack`]) to `upper`, or takes it back out,
/// a panel of [`PANEL`] matrix rows at a time: the panel's sums on or above
/// the diagonal ([`panel_sums`]), then scaled, rounded and applied as
/// integers. Panels are disjoint runs of the triangle, so they run side by
/// side on the rayon pool; each entry's value does not depend on which
/// thread computed it. `limits` applies only the first `limits[p]` entries
/// of panel `p` (taking back an observation cut short). Returns the entries
/// each panel applied: a panel short of its length stopped at an entry that
/// could not be applied, and applied none after it.
fn apply_chunk(
    tier: VectorTier,
    packed: &[f32],
    width: usize,
    upper: &mut [i128],
    scale: f64,
    direction: Direction,
    limits: Option<&[usize]>,
) -> Vec<usize> {
    let mut panels = Vec::with_capacity(width.div_ceil(PANEL));
    let mut rest = upper;
    for pi in 0..width.div_ceil(PANEL) {
        let (panel, after) = rest.split_at_mut(panel_len(width, pi));
        panels.push(panel);
        rest = after;
    }
    panels
        .into_par_iter()
        .enumerate()
        .map_init(Vec::new, |strip, (pi, entries)| {
            let limit = limits.map_or(entries.len(), |l| l[pi]);
            let entries = &mut entries[..limit];
            if entries.is_empty() {
                return 0;
            }
            let panel = Panel {
                packed,
                width,
                index: pi,
                scale,
                direction,
            };
            // Every tier performs the same f32 fused multiply-adds in the
            // same order, so every tier gives the same bits; they differ in
            // vector width.
            match tier {
                VectorTier::Portable => panel_portable(&panel, entries, strip),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller checked `tier.is_supported()`.
                VectorTier::Avx2 => unsafe { panel_avx2(&panel, entries, strip) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                VectorTier::Avx512 => unsafe { panel_avx512(&panel, entries, strip) },
                #[cfg(not(target_arch = "x86_64"))]
                VectorTier::Avx2 | VectorTier::Avx512 => unreachable!("rejected by is_supported"),
            }
        })
        .collect()
}

/// Entries of the triangle in panel `pi`'s rows.
fn panel_len(width: usize, pi: usize) -> usize {
    let (first, last) = (pi * PANEL, ((pi + 1) * PANEL).min(width));
    upper_index(width, last, last) - upper_index(width, first, first)
}

/// The first entry of the triangle that [`apply_chunk`] could not apply,
/// from the entries each panel applied; `None` when it applied them all.
fn first_refused(width: usize, applied: &[usize]) -> Option<usize> {
    let mut base = 0;
    for (pi, &done) in applied.iter().enumerate() {
        let len = panel_len(width, pi);
        if done < len {
            return Some(base + done);
        }
        base += len;
    }
    None
}

/// One panel's part of a chunk for [`panel_kernel`].
struct Panel<'a> {
    packed: &'a [f32],
    width: usize,
    index: usize,
    scale: f64,
    direction: Direction,
}

/// The kernel behind [`apply_chunk`] for one panel: its sums, each turned
/// into an integer and applied to its entry in order, up to the first that
/// cannot be. Returns the entries applied. `inline(always)` so each tier
/// compiles its own copy (the rounding too: without SSE4.1 it is a library
/// call).
#[inline(always)]
fn panel_kernel<const ROWS: usize, const PANELS: usize>(
    panel: &Panel<'_>,
    entries: &mut [i128],
    strip: &mut Vec<f32>,
) -> usize {
    let rows = panel.packed.len() / panel.width.next_multiple_of(PANEL);
    let sums = panel_sums::<ROWS, PANELS>(panel.packed, rows, panel.width, panel.index, strip);
    for (at, (entry, &sum)) in entries.iter_mut().zip(sums.iter()).enumerate() {
        let fixed = to_fixed(f64::from(sum) * panel.scale);
        let applied = fixed.and_then(|fixed| match panel.direction {
            Direction::Add => entry.checked_add(fixed),
            Direction::Take => entry.checked_sub(fixed),
        });
        match applied {
            Some(value) => *entry = value,
            None => return at,
        }
    }
    entries.len()
}

/// The sums of matrix rows `pi · PANEL ..` (one panel, cut at the width)
/// on and above the diagonal, over the chunk's rows in order, written into
/// `strip` in the upper triangle's order: tiles of `ROWS` rows ×
/// `PANELS` panels. The tile's shape decides only which sums are computed
/// side by side, never an entry's operations, so each tier picks the shape
/// that fills its registers.
#[inline(always)]
fn panel_sums<'a, const ROWS: usize, const PANELS: usize>(
    packed: &[f32],
    rows: usize,
    width: usize,
    pi: usize,
    strip: &'a mut Vec<f32>,
) -> &'a [f32] {
    const { assert!(PANEL.is_multiple_of(ROWS)) };
    let panels = width.div_ceil(PANEL);
    let first = pi * PANEL;
    let last = (first + PANEL).min(width);
    let base = upper_index(width, first, first);
    strip.resize(upper_index(width, last, last) - base, 0.0);
    let panel = |p: usize| &packed[p * rows * PANEL..(p + 1) * rows * PANEL];
    // Panels `pj` outermost: each is read from memory once and serves every
    // tile of rows from L2 (rows outermost read the whole packed chunk,
    // 16 MB for a 4 096-wide one, once per tile).
    let mut pj = pi;
    while pj < panels {
        let whole = pj + PANELS <= panels;
        for offset in (0..last - first).step_by(ROWS) {
            let i0 = first + offset;
            if whole {
                let sums = tile::<ROWS, PANELS>(panel(pi), offset, &packed[pj * rows * PANEL..]);
                hand_over(&sums, i0, pj, width, base, strip);
            } else {
                let sums = tile::<ROWS, 1>(panel(pi), offset, panel(pj));
                hand_over(&sums, i0, pj, width, base, strip);
            }
        }
        pj += if whole { PANELS } else { 1 };
    }
    strip
}

/// One tile's sums: rows `offset..offset + ROWS` of the panel `a` against
/// the `PANELS` consecutive panels that `b` starts with, every entry summed
/// over the chunk's rows in order, in registers.
#[inline(always)]
fn tile<const ROWS: usize, const PANELS: usize>(
    a: &[f32],
    offset: usize,
    b: &[f32],
) -> [[[f32; PANEL]; PANELS]; ROWS] {
    let rows = a.len() / PANEL;
    let mut acc = [[[0f32; PANEL]; PANELS]; ROWS];
    for row in 0..rows {
        let x: &[f32; ROWS] = a[row * PANEL + offset..row * PANEL + offset + ROWS]
            .try_into()
            .expect("a tile row");
        for p in 0..PANELS {
            let at = (p * rows + row) * PANEL;
            let y: &[f32; PANEL] = b[at..at + PANEL].try_into().expect("a panel row");
            for (acc_row, &x) in acc.iter_mut().zip(x) {
                for (slot, &y) in acc_row[p].iter_mut().zip(y) {
                    *slot = x.mul_add(y, *slot);
                }
            }
        }
    }
    acc
}

/// Writes a tile's entries on or above the diagonal and inside the width
/// into `strip`, the part of the upper triangle from index `base`.
#[inline(always)]
fn hand_over<const ROWS: usize, const PANELS: usize>(
    sums: &[[[f32; PANEL]; PANELS]; ROWS],
    i0: usize,
    pj: usize,
    width: usize,
    base: usize,
    strip: &mut [f32],
) {
    for (i, row) in (i0..width).zip(sums) {
        let columns = row.as_flattened();
        let first = (pj * PANEL).max(i);
        let end = ((pj + PANELS) * PANEL).min(width);
        if first < end {
            let at = upper_index(width, i, first) - base;
            strip[at..at + end - first]
                .copy_from_slice(&columns[first - pj * PANEL..end - pj * PANEL]);
        }
    }
}

/// Tiles of 4 rows × one panel: 64 sums, 16 registers of four lanes. On a
/// target without an FMA instruction (baseline x86-64) each fused
/// multiply-add is a call to libm's `fmaf`: slow, and only run where the
/// CPU has no AVX2; aarch64 has the instruction.
fn panel_portable(panel: &Panel<'_>, entries: &mut [i128], strip: &mut Vec<f32>) -> usize {
    panel_kernel::<4, 1>(panel, entries, strip)
}

/// Tiles of 4 rows × one panel: 8 of AVX2's 16 registers hold the sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn panel_avx2(panel: &Panel<'_>, entries: &mut [i128], strip: &mut Vec<f32>) -> usize {
    panel_kernel::<4, 1>(panel, entries, strip)
}

/// Tiles of 4 rows × two panels: 8 of AVX-512's 32 registers hold the sums.
/// (LLVM keeps an 8-row tile in memory, not registers: 8× slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn panel_avx512(panel: &Panel<'_>, entries: &mut [i128], strip: &mut Vec<f32>) -> usize {
    panel_kernel::<4, 2>(panel, entries, strip)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: every entry's f32 sum over each chunk's rows in
    /// order, scaled, rounded and added as integers.
    fn reference(values: &[f32], width: usize, exponent: i32) -> Vec<i128> {
        let mut out = vec![0i128; width * (width + 1) / 2];
        for chunk in values.chunks(CHUNK_ROWS * width) {
            for i in 0..width {
                for j in i..width {
                    let mut sum = 0f32;
                    for row in chunk.chunks_exact(width) {
                        sum = row[i].mul_add(row[j], sum);
                    }
                    out[upper_index(width, i, j)] +=
                        to_fixed(f64::from(sum) * 2f64.powi(exponent)).unwrap();
                }
            }
        }
        out
    }

    fn values(rows: usize, width: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..rows * width)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
            })
            .collect()
    }

    #[test]
    fn every_tier_equals_the_definition() {
        let chunks = 2 * CHUNK_ROWS + 37;
        for (rows, width) in [(1, 1), (3, 5), (17, 8), (300, 13), (chunks, 37), (260, 70)] {
            let v = values(rows, width, (rows * width) as u64);
            let exponent = Gram::exponent_for(4.0, rows as u64).unwrap();
            let expected = reference(&v, width, exponent);
            for &tier in VectorTier::ALL {
                let mut gram = Gram::new(width, exponent).unwrap();
                match gram.observe_with(tier, &v) {
                    Ok(()) => {
                        assert_eq!(gram.upper(), expected, "{tier:?} {rows}×{width}");
                        assert_eq!(gram.rows(), rows as u64);
                    }
                    Err(Error::UnsupportedTier(_)) => {
                        eprintln!("SKIPPED: {tier:?} is not supported on this CPU");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }

    #[test]
    fn the_integers_do_not_depend_on_the_thread_count() {
        let (rows, width) = (CHUNK_ROWS + 300, 70);
        let v = values(rows, width, 3);
        let exponent = Gram::exponent_for(4.0, rows as u64).unwrap();
        let on = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut gram = Gram::new(width, exponent).unwrap();
            pool.install(|| gram.observe(&v)).unwrap();
            gram
        };
        let one = on(1);
        assert_eq!(one.upper(), reference(&v, width, exponent));
        for threads in [2, 3] {
            assert_eq!(on(threads), one, "{threads} threads");
        }
    }

    #[test]
    fn merging_any_sharding_gives_the_same_integers() {
        let width = 11;
        // Observations that cross chunk boundaries.
        let (total, cut) = (2 * CHUNK_ROWS + 188, 100 + CHUNK_ROWS);
        let v = values(total, width, 7);
        let exponent = Gram::exponent_for(4.0, total as u64).unwrap();
        // Each part is a (first row, end row) observation.
        let shard = |parts: &[(usize, usize)]| {
            let grams: Vec<Gram> = parts
                .iter()
                .map(|&(start, end)| {
                    let mut g = Gram::new(width, exponent).unwrap();
                    g.observe(&v[start * width..end * width]).unwrap();
                    g
                })
                .collect();
            let mut merged = Gram::new(width, exponent).unwrap();
            for g in grams.iter().rev() {
                merged.merge(g).unwrap();
            }
            merged
        };
        let a = shard(&[(0, 100), (100, total)]);
        let b = shard(&[(0, 100), (100, cut), (cut, total)]);
        let c = shard(&[(100, cut), (cut, total), (0, 100)]);
        // Different chunkings round differently, so compare shardings of the
        // same observations: every order and grouping of merges agrees.
        assert_eq!(b, c);
        let mut d = shard(&[(cut, total)]);
        d.merge(&shard(&[(0, 100), (100, cut)])).unwrap();
        assert_eq!(b, d);
        assert_eq!(a.rows(), total as u64);
        // The matrix is the Gram matrix up to the f32 sums' rounding: about
        // √1024 · 2⁻²⁴ ≈ 2e-6 of the products' sizes over a chunk.
        let m = a.clone().into_matrix();
        let (i, j) = (2, 9);
        let products = || {
            v.chunks_exact(width)
                .map(|r| f64::from(r[i]) * f64::from(r[j]))
        };
        let exact: f64 = products().sum();
        let magnitude: f64 = products().map(f64::abs).sum();
        let error = (m[i * width + j] - exact).abs();
        assert!(error <= 1e-5 * magnitude, "{error} against {magnitude}");
        assert_eq!(m[i * width + j], m[j * width + i]);
    }

    #[test]
    fn overflow_and_bad_input_are_refused_and_leave_the_matrix_unchanged() {
        let mut gram = Gram::new(2, Gram::exponent_for(1.0, 4).unwrap()).unwrap();
        gram.observe(&[1.0, -1.0, 0.5, 0.25]).unwrap();
        let before = gram.clone();
        // Values far beyond the bound the exponent was chosen for.
        let e = gram.observe(&[1e30, 1.0]).unwrap_err();
        assert!(matches!(e, Error::Overflow(_)), "{e}");
        assert!(
            matches!(gram.observe(&[f32::NAN, 1.0]), Err(Error::NonFinite(_))),
            "NaN refused"
        );
        assert!(matches!(gram.observe(&[1.0]), Err(Error::Shape(_))));
        assert_eq!(gram, before);
        // A value far out of range in the last of three chunks: the chunks
        // before it, the entries of its chunk before the first bad one and
        // the panels after it (run side by side) were added, and are taken
        // back. First in the first panel; then, with the row's first panel
        // of values zero, in the second of three, between two that were
        // added whole.
        let width = 40;
        let rows = 2 * CHUNK_ROWS + 88;
        let mut first_panel = values(rows, width, 5);
        first_panel[(rows - 1) * width + 35] = 1e18;
        let mut middle_panel = first_panel.clone();
        middle_panel[(rows - 1) * width..(rows - 1) * width + PANEL].fill(0.0);
        middle_panel[(rows - 1) * width + 20] = 1e18;
        for (v, entry) in [
            (first_panel, "entry (0, 35)"),
            (middle_panel, "entry (16, 20)"),
        ] {
            for &tier in VectorTier::ALL {
                if !tier.is_supported() {
                    continue;
                }
                let exponent = Gram::exponent_for(4.0, rows as u64).unwrap();
                let mut gram = Gram::new(width, exponent).unwrap();
                gram.observe(&v[..100 * width]).unwrap();
                let before = gram.clone();
                let e = gram.observe_with(tier, &v).unwrap_err();
                assert!(e.to_string().contains(entry), "{e}");
                assert_eq!(gram, before, "{tier:?}");
            }
        }
        // Merging past i128 is refused too.
        let mut big = Gram::from_parts(1, 0, 1, vec![i128::MAX - 1]).unwrap();
        let one = Gram::from_parts(1, 0, 1, vec![2]).unwrap();
        assert!(matches!(big.merge(&one), Err(Error::Overflow(_))));
        assert_eq!(big.upper(), [i128::MAX - 1]);
        let other_exponent = Gram::new(1, 3).unwrap();
        assert!(big.merge(&other_exponent).is_err());
    }

    #[test]
    fn exponents_bound_the_sums() {
        assert_eq!(Gram::exponent_for(0.0, 10).unwrap(), 0);
        // rows · max² = 2^10 · 2^2 = 2^12 → 120 - 12.
        assert_eq!(Gram::exponent_for(2.0, 1024).unwrap(), 108);
        assert_eq!(Gram::exponent_for(3.0, 1).unwrap(), 120 - 4);
        assert!(Gram::exponent_for(f32::INFINITY, 1).is_err());
        let tiny = Gram::exponent_for(f32::MIN_POSITIVE / 4.0, 1).unwrap();
        assert!(tiny > 120 && tiny <= EXPONENT_RANGE);
        let huge = Gram::exponent_for(f32::MAX, u64::MAX).unwrap();
        assert!(huge < 0);
        assert_eq!(frexp(1.0), (0.5, 1));
        assert_eq!(frexp(0.75), (0.75, 0));
    }
}
