//! Scaled dot-product attention of one GQA group of query heads over one
//! key/value head, at one query position (a decode step) or a tile of
//! consecutive positions (a prefill).
//!
//! For each query of the group: the scores `q·k · scale` in key order, their
//! softmax, and the values weighted by it. The arithmetic is fixed down to
//! the order of every addition, and nothing depends on the other queries of
//! the group, so a prefill, a chunked prefill, a decode step and teacher
//! forcing over the same tokens give a query the same bits (the decoder's
//! batch invariance rests on it).
//!
//! The order is that of eight f32 lanes, so the AVX2 tier and its scalar twin
//! compute the same bits (tested): a dot product accumulates dimension `d` in
//! lane `d mod 8` with fused multiply-adds and sums the lanes as
//! `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`; the softmax's denominator sums key
//! `t` in lane `t mod 8` with the same tree; each output value accumulates
//! the keys in order with fused multiply-adds and is divided by the
//! denominator once at the end. `exp` is [`crate::exp`]'s, the same bits
//! on both tiers. A wider tier (AVX-512)
//! would have to keep eight lanes to keep the bits, so there is none: a
//! machine with AVX-512 and one without compute the same activations.
//!
//! The two passes over one query's scores (max, then exponentials) read a
//! row of `visible` floats (32 KiB at 8 192 keys) that stays in the cache;
//! no matrix of scores over a whole prompt's queries exists, only a tile's
//! rows. Keys are read from memory once per tile in blocks of eight, values
//! once per tile in blocks that stay in L1: a tile of 4 positions of
//! SmolLM2's 3-head groups reads the cache a quarter as often as a position
//! at a time, which is what a long prefill spends its time on.

use std::cell::RefCell;

use qforge_core::CpuTier;

use crate::error::{Error, Result};
use crate::exp::exp;

thread_local! {
    /// One group's padded rows of scores and their softmax denominators,
    /// grown per thread to the longest rows seen (or [`reserve`]d).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Lanes of the fixed summation order.
const LANES: usize = 8;

/// A CPU tier of the attention kernel.
pub type AttentionTier = crate::fma_tier::FmaTier;

/// The query heads of one GQA group at one or more consecutive query
/// positions: head `g` of position `p` at `p · position_stride + g ·
/// head_stride` in `rows`, and position `p` attends the first `visible[p]`
/// positions of the keys (at least 1). A decode step is one position; a
/// prefill attends a tile of positions at once, so each block of keys and
/// values read from memory serves every query of the tile.
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    /// The queries, each `head_dim` values.
    pub rows: &'a [f32],
    /// Distance between the first values of consecutive heads.
    pub head_stride: usize,
    /// Distance between the first values of consecutive positions.
    pub position_stride: usize,
    /// Positions attended by each query position.
    pub visible: &'a [usize],
}

impl Queries<'_> {
    fn positions(&self) -> usize {
        self.visible.len()
    }

    /// The most positions any query attends.
    fn longest(&self) -> usize {
        self.visible.iter().copied().max().unwrap_or(0)
    }
}

/// One key/value head: the key of position `t` at `offset + t · stride` in
/// `keys`, its value at the same index in `values`.
#[derive(Debug, Clone, Copy)]
pub struct KeyValues<'a> {
    /// Keys, `head_dim` values each.
    pub keys: &'a [f32],
    /// Values, laid out as the keys.
    pub values: &'a [f32],
    /// Index of position 0's key.
    pub offset: usize,
    /// Distance between consecutive positions' keys.
    pub stride: usize,
}

/// Attention of every query in `queries` over `kv`, on the fastest tier:
/// `out` holds the outputs position by position, each position's heads in
/// turn, `head_dim` values per head (so the group has `out.len() /
/// (head_dim · positions)` heads); `scale` multiplies each score. A query's
/// result does not depend on the other queries attended beside it.
pub fn attend(
    queries: Queries<'_>,
    kv: KeyValues<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attend_with(AttentionTier::detect(), queries, kv, head_dim, scale, out)
}

/// [`attend`] on a chosen tier; errors if the CPU lacks it or the slices do
/// not hold what the shapes say.
pub fn attend_with(
    tier: AttentionTier,
    queries: Queries<'_>,
    kv: KeyValues<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    check(queries, kv, head_dim, out)?;
    if !tier.is_supported() {
        return Err(Error::UnsupportedTier(format!("{tier:?}")));
    }
    let rows = out.len() / head_dim;
    let longest = queries.longest();
    let padded = longest.next_multiple_of(LANES);
    reserve(rows, longest);
    SCRATCH.with_borrow_mut(|scratch| {
        let (scores, rest) = scratch.split_at_mut(rows * padded);
        let scratch = Scratch {
            scores,
            totals: &mut rest[..rows],
        };
        match tier {
            #[cfg(target_arch = "x86_64")]
            AttentionTier::Avx2 if head_dim.is_multiple_of(LANES) => {
                // SAFETY: the CPU has AVX2 and FMA (checked above), and
                // `check` accepted the shapes.
                unsafe { x86::attend(queries, kv, head_dim, scratch, scale, out) }
            }
            // Head sizes that are not whole vectors take the scalar order,
            // which is the vector order too.
            _ => portable::attend(queries, kv, head_dim, scratch, scale, out),
        }
    });
    Ok(())
}

/// Grows the calling thread's scratch so that attending `rows` queries
/// (query heads times positions) over up to `visible` positions does not
/// allocate: a decoder of fixed capacity reserves it once per thread, and
/// its steps then allocate nothing.
pub fn reserve(rows: usize, visible: usize) {
    let needed = rows * (visible.next_multiple_of(LANES) + 1);
    SCRATCH.with_borrow_mut(|scratch| {
        if scratch.len() < needed {
            scratch.resize(needed, 0.0);
        }
    });
}

/// The queries' padded rows of scores (row `p · group + g` for head `g` of
/// position `p`, each as long as the longest row rounded up to whole lanes)
/// and their softmax denominators.
struct Scratch<'a> {
    scores: &'a mut [f32],
    totals: &'a mut [f32],
}

impl Scratch<'_> {
    fn padded(&self) -> usize {
        self.scores.len() / self.totals.len()
    }
}

fn check(queries: Queries<'_>, kv: KeyValues<'_>, head_dim: usize, out: &[f32]) -> Result<()> {
    let positions = queries.positions();
    let group = out
        .len()
        .checked_div(head_dim * positions)
        .unwrap_or_default();
    let longest = queries.longest();
    let fits_kv = |len: usize| len >= kv.offset + (longest - 1) * kv.stride + head_dim;
    let last_query = |group: usize| {
        (positions - 1) * queries.position_stride + (group - 1) * queries.head_stride + head_dim
    };
    if group == 0
        || !out.len().is_multiple_of(head_dim * positions)
        || queries.visible.contains(&0)
        || queries.rows.len() < last_query(group)
        || !fits_kv(kv.keys.len())
        || !fits_kv(kv.values.len())
    {
        return Err(Error::Shape(format!(
            "attention of {} output values in heads of {head_dim} at {positions} positions \
             (queries: {} values, head stride {}, position stride {}) over up to {longest} \
             positions at offset {} stride {} ({} keys, {} values)",
            out.len(),
            queries.rows.len(),
            queries.head_stride,
            queries.position_stride,
            kv.offset,
            kv.stride,
            kv.keys.len(),
            kv.values.len()
        )));
    }
    Ok(())
}

/// `max` as x86's `maxps` computes it (the second operand when unordered),
/// so both tiers agree even on NaN.
fn max_ps(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The lanes' sum in the fixed tree.
fn tree_sum(l: [f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

mod portable {
    use super::*;

    pub(super) fn attend(
        queries: Queries<'_>,
        kv: KeyValues<'_>,
        hd: usize,
        scratch: Scratch<'_>,
        scale: f32,
        out: &mut [f32],
    ) {
        let padded = scratch.padded();
        let group = scratch.totals.len() / queries.positions();
        let rows = scratch.scores.chunks_exact_mut(padded);
        for (r, (row, out)) in rows.zip(out.chunks_exact_mut(hd)).enumerate() {
            let (p, g) = (r / group, r % group);
            let visible = queries.visible[p];
            let query =
                &queries.rows[p * queries.position_stride + g * queries.head_stride..][..hd];
            let row = &mut row[..visible.next_multiple_of(LANES)];
            for (t, score) in row[..visible].iter_mut().enumerate() {
                *score = dot(query, &kv.keys[kv.offset + t * kv.stride..][..hd]) * scale;
            }
            row[visible..].fill(f32::NEG_INFINITY);
            let total = exponentials(row);
            out.fill(0.0);
            for (t, &e) in row[..visible].iter().enumerate() {
                let value = &kv.values[kv.offset + t * kv.stride..][..hd];
                for (o, &v) in out.iter_mut().zip(value) {
                    *o = e.mul_add(v, *o);
                }
            }
            out.iter_mut().for_each(|o| *o /= total);
        }
    }

    /// `q·k`: dimension `d` in lane `d mod 8`, lanes summed by the tree.
    fn dot(q: &[f32], k: &[f32]) -> f32 {
        let mut lanes = [0f32; LANES];
        for (d, (&a, &b)) in q.iter().zip(k).enumerate() {
            lanes[d % LANES] = a.mul_add(b, lanes[d % LANES]);
        }
        tree_sum(lanes)
    }

    /// Replaces a padded row of scores by `e^(s - max)` and returns their sum.
    fn exponentials(row: &mut [f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        for block in row.chunks_exact(LANES) {
            for (m, &s) in lanes.iter_mut().zip(block) {
                *m = max_ps(*m, s);
            }
        }
        // The order of `x86::max_lanes`.
        let max = max_ps(
            max_ps(max_ps(lanes[0], lanes[4]), max_ps(lanes[2], lanes[6])),
            max_ps(max_ps(lanes[1], lanes[5]), max_ps(lanes[3], lanes[7])),
        );
        let mut sums = [0f32; LANES];
        for block in row.chunks_exact_mut(LANES) {
            for (sum, s) in sums.iter_mut().zip(block) {
                *s = exp(*s - max);
                *sum += *s;
            }
        }
        tree_sum(sums)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::*;
    use crate::exp::x86::exp;

    /// Keys whose values are accumulated for every query of the tile before
    /// the next block is read: 64 values of 128 dimensions are 32 KiB.
    const VALUE_BLOCK: usize = 64;

    /// [`portable::attend`] in AVX2 registers: the same arithmetic in the
    /// same order. `hd` is a multiple of 8.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and [`check`] accepted the shapes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend(
        queries: Queries<'_>,
        kv: KeyValues<'_>,
        hd: usize,
        scratch: Scratch<'_>,
        scale: f32,
        out: &mut [f32],
    ) {
        let tile = Tile {
            queries,
            group: scratch.totals.len() / queries.positions(),
            hd,
            padded: scratch.padded(),
        };
        let Scratch { scores, totals } = scratch;
        // SAFETY: `check` proved that the query of head g < group at
        // position p lies at p · position_stride + g · head_stride within
        // `queries.rows`, and the key and value of every position t <
        // visible[p] at offset + t · stride within theirs; the scores hold
        // a padded row per query and `out` a row of `hd` per query.
        unsafe { score(tile, kv, scores.as_mut_ptr(), scale) };
        for (row, (scores, total)) in scores
            .chunks_exact_mut(tile.padded)
            .zip(totals.iter_mut())
            .enumerate()
        {
            let scores = &mut scores[..tile.visible(row).next_multiple_of(LANES)];
            scores[tile.visible(row)..].fill(f32::NEG_INFINITY);
            *total = exponentials(scores);
        }
        out.fill(0.0);
        // SAFETY: as above.
        unsafe { weigh_values(tile, kv, scores.as_ptr(), out.as_mut_ptr()) };
        for (out, &total) in out.chunks_exact_mut(hd).zip(totals.iter()) {
            out.iter_mut().for_each(|o| *o /= total);
        }
    }

    /// The queries of one call, row `p · group + g` for head `g` of
    /// position `p`, and the length of a row of scores.
    #[derive(Clone, Copy)]
    struct Tile<'a> {
        queries: Queries<'a>,
        group: usize,
        hd: usize,
        padded: usize,
    }

    impl Tile<'_> {
        fn rows(&self) -> usize {
            self.queries.positions() * self.group
        }

        fn visible(&self, row: usize) -> usize {
            self.queries.visible[row / self.group]
        }

        /// The first of a row's query values (a pointer into the checked
        /// `rows`).
        fn query(&self, row: usize) -> *const f32 {
            let (p, g) = (row / self.group, row % self.group);
            let at = p * self.queries.position_stride + g * self.queries.head_stride;
            self.queries.rows[at..].as_ptr()
        }
    }

    /// Each row's scores `q·k · scale` for the keys it sees, into its row
    /// of `scores` (`tile.padded` apart). Eight keys at a time for every
    /// query of the tile, so a block of keys is read from memory once and
    /// then from L1; two queries at a time share each key vector loaded.
    ///
    /// # Safety
    /// [`check`] accepted the tile and `kv`, and `scores` holds a padded row
    /// per query.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score(tile: Tile<'_>, kv: KeyValues<'_>, scores: *mut f32, scale: f32) {
        let Tile { hd, padded, .. } = tile;
        let stride = kv.stride;
        let scales = _mm256_set1_ps(scale);
        // SAFETY: the caller's bounds: row r's scores for keys t < visible(r).
        unsafe {
            let keys = kv.keys.as_ptr().add(kv.offset);
            for t in (0..tile.queries.longest()).step_by(LANES) {
                let block = keys.add(t * stride);
                let whole = |row: usize| t + LANES <= tile.visible(row);
                let mut row = 0;
                while row < tile.rows() {
                    let at = scores.add(row * padded + t);
                    if row + 1 < tile.rows() && whole(row) && whole(row + 1) {
                        let both = (tile.query(row), tile.query(row + 1));
                        let (a_low, b_low) = dot_two(both, block, stride, hd);
                        let (a_high, b_high) = dot_two(both, block.add(4 * stride), stride, hd);
                        let a = _mm256_set_m128(a_high, a_low);
                        let b = _mm256_set_m128(b_high, b_low);
                        _mm256_storeu_ps(at, _mm256_mul_ps(a, scales));
                        _mm256_storeu_ps(at.add(padded), _mm256_mul_ps(b, scales));
                        row += 2;
                        continue;
                    }
                    if whole(row) {
                        let each = dot_each(tile.query(row), block, stride, hd);
                        _mm256_storeu_ps(at, _mm256_mul_ps(each, scales));
                    } else {
                        for j in 0..tile.visible(row).saturating_sub(t) {
                            *at.add(j) = dot(tile.query(row), block.add(j * stride), hd) * scale;
                        }
                    }
                    row += 1;
                }
            }
        }
    }

    /// Adds each row's `weights[t] · value[t]`, keys in order, to its row of
    /// `out` (zeroed). The tile's queries take a block of values in turn
    /// while it is in L1; two queries at a time share each value vector
    /// loaded, as far as both see, then each goes on alone to its own end.
    ///
    /// # Safety
    /// [`check`] accepted the tile and `kv`, `weights` holds a padded row per
    /// query and `out` a row of `hd` per query.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weigh_values(tile: Tile<'_>, kv: KeyValues<'_>, weights: *const f32, out: *mut f32) {
        let Tile { hd, padded, .. } = tile;
        let stride = kv.stride;
        // SAFETY: the caller's bounds: row r's values for keys t < visible(r).
        unsafe {
            let values = kv.values.as_ptr().add(kv.offset);
            let row_of = |row: usize| (out.add(row * hd), weights.add(row * padded));
            for block in (0..tile.queries.longest()).step_by(VALUE_BLOCK) {
                let end = |row: usize| (block + VALUE_BLOCK).min(tile.visible(row));
                let mut row = 0;
                while row < tile.rows() {
                    if row + 1 < tile.rows() {
                        let common = end(row).min(end(row + 1));
                        if common > block {
                            let span = (block, common, stride);
                            accumulate_two(row_of(row), row_of(row + 1), values, span, hd);
                        }
                        for row in [row, row + 1] {
                            let (out, weights) = row_of(row);
                            let span = (common.max(block), end(row), stride);
                            accumulate_one(out, weights, values, span, hd);
                        }
                        row += 2;
                    } else {
                        let (out, weights) = row_of(row);
                        accumulate_one(out, weights, values, (block, end(row), stride), hd);
                        row += 1;
                    }
                }
            }
        }
    }

    /// Adds `weights[t] · values[t · stride]` for `t` in `start..end`, in
    /// order, to one query's output row of `hd` values at `out`.
    ///
    /// # Safety
    /// `out` holds `hd` values, `weights` `end` values, and each value row
    /// `hd` values at `t · stride` for `t < end`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_one(
        out: *mut f32,
        weights: *const f32,
        values: *const f32,
        span: (usize, usize, usize),
        hd: usize,
    ) {
        if span.1 <= span.0 {
            return;
        }
        for c in (0..hd).step_by(LANES * LANES) {
            let (out, values) = (out.wrapping_add(c), values.wrapping_add(c));
            let (o, w) = ([out], [weights]);
            // SAFETY: the caller's bounds; the width fits `hd - c`.
            unsafe {
                // The width is a constant in each instance, so the
                // accumulators stay in registers without a branch per
                // vector.
                match (hd - c).min(LANES * LANES) / LANES {
                    8 => accumulate::<1, 8>(o, w, values, span),
                    7 => accumulate::<1, 7>(o, w, values, span),
                    6 => accumulate::<1, 6>(o, w, values, span),
                    5 => accumulate::<1, 5>(o, w, values, span),
                    4 => accumulate::<1, 4>(o, w, values, span),
                    3 => accumulate::<1, 3>(o, w, values, span),
                    2 => accumulate::<1, 2>(o, w, values, span),
                    _ => accumulate::<1, 1>(o, w, values, span),
                }
            }
        }
    }

    /// [`accumulate_one`] for two queries' rows over the same span, each
    /// value vector loaded once for both.
    ///
    /// # Safety
    /// As [`accumulate_one`], for both rows.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_two(
        a: (*mut f32, *const f32),
        b: (*mut f32, *const f32),
        values: *const f32,
        span: (usize, usize, usize),
        hd: usize,
    ) {
        for c in (0..hd).step_by(4 * LANES) {
            let o = [a.0.wrapping_add(c), b.0.wrapping_add(c)];
            let (w, values) = ([a.1, b.1], values.wrapping_add(c));
            // SAFETY: the caller's bounds; the width fits `hd - c`.
            unsafe {
                match (hd - c).min(4 * LANES) / LANES {
                    4 => accumulate::<2, 4>(o, w, values, span),
                    3 => accumulate::<2, 3>(o, w, values, span),
                    2 => accumulate::<2, 2>(o, w, values, span),
                    _ => accumulate::<2, 1>(o, w, values, span),
                }
            }
        }
    }

    /// Adds `weights[r][t] · values[t · stride]` for `t` in `start..end`, in
    /// order, to the `W` vectors at `out[r]`, for each of `R` rows.
    ///
    /// # Safety
    /// Each `out[r]` holds `8 W` values, each `weights[r]` `end` values, and
    /// each value row `8 W` values at `t · stride` for `t < end`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate<const R: usize, const W: usize>(
        out: [*mut f32; R],
        weights: [*const f32; R],
        values: *const f32,
        (start, end, stride): (usize, usize, usize),
    ) {
        // SAFETY: the caller's bounds.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); W]; R];
            for (acc, out) in acc.iter_mut().zip(out) {
                for (i, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_loadu_ps(out.add(i * LANES));
                }
            }
            for t in start..end {
                let value = values.add(t * stride);
                let e = weights.map(|w| _mm256_set1_ps(*w.add(t)));
                for i in 0..W {
                    let v = _mm256_loadu_ps(value.add(i * LANES));
                    for (acc, e) in acc.iter_mut().zip(e) {
                        acc[i] = _mm256_fmadd_ps(e, v, acc[i]);
                    }
                }
            }
            for (acc, out) in acc.iter().zip(out) {
                for (i, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(i * LANES), *acc);
                }
            }
        }
    }

    /// The dot products of two queries with four consecutive keys (`stride`
    /// apart), four lanes each, in the order of [`dot_each`].
    ///
    /// # Safety
    /// Both queries hold `hd` values and each key `hd` values.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_two(
        (a, b): (*const f32, *const f32),
        keys: *const f32,
        stride: usize,
        hd: usize,
    ) -> (__m128, __m128) {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        for c in (0..hd).step_by(LANES) {
            // SAFETY: c + 8 ≤ hd (the caller's bounds).
            unsafe {
                let q = [_mm256_loadu_ps(a.add(c)), _mm256_loadu_ps(b.add(c))];
                for j in 0..4 {
                    let k = _mm256_loadu_ps(keys.add(j * stride + c));
                    for (acc, q) in acc.iter_mut().zip(q) {
                        acc[j] = _mm256_fmadd_ps(q, k, acc[j]);
                    }
                }
            }
        }
        (sum_four(acc[0]), sum_four(acc[1]))
    }

    /// Each of four vectors' lanes summed by the tree: the low half of
    /// [`sum_each`].
    #[target_feature(enable = "avx2,fma")]
    fn sum_four(a: [__m256; 4]) -> __m128 {
        let u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1))
    }

    /// The dot products of one query with eight consecutive keys (`stride`
    /// apart), as one vector.
    ///
    /// # Safety
    /// `query` holds `hd` values and each key `hd` values.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_each(query: *const f32, keys: *const f32, stride: usize, hd: usize) -> __m256 {
        let mut acc = [_mm256_setzero_ps(); LANES];
        for c in (0..hd).step_by(LANES) {
            // SAFETY: c + 8 ≤ hd (the caller's bounds).
            unsafe {
                let qc = _mm256_loadu_ps(query.add(c));
                for (j, acc) in acc.iter_mut().enumerate() {
                    let k = _mm256_loadu_ps(keys.add(j * stride + c));
                    *acc = _mm256_fmadd_ps(qc, k, *acc);
                }
            }
        }
        sum_each(acc)
    }

    /// One query's dot product with one key.
    ///
    /// # Safety
    /// `query` and `key` hold `hd` values each.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(query: *const f32, key: *const f32, hd: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for c in (0..hd).step_by(LANES) {
            // SAFETY: c + 8 ≤ hd (the caller's bounds).
            unsafe {
                let k = _mm256_loadu_ps(key.add(c));
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(query.add(c)), k, acc);
            }
        }
        sum(acc)
    }

    /// Each of eight vectors' lanes summed by the tree, as one vector.
    #[target_feature(enable = "avx2,fma")]
    fn sum_each(a: [__m256; LANES]) -> __m256 {
        // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7],
        // so u = [a0(0..4), a1(0..4), a2(0..4), a3(0..4), a0(4..8), …, a3(4..8)]
        // and v the same for a4..a7: the low halves of u and v hold the sums
        // of the first four lanes, the high halves those of the last four.
        let u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let v = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        _mm256_add_ps(
            _mm256_permute2f128_ps(u, v, 0x20),
            _mm256_permute2f128_ps(u, v, 0x31),
        )
    }

    /// One vector's lanes summed by the tree.
    #[target_feature(enable = "avx2,fma")]
    fn sum(a: __m256) -> f32 {
        let h = _mm256_hadd_ps(a, a);
        let h = _mm256_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_add_ss(
            _mm256_castps256_ps128(h),
            _mm256_extractf128_ps(h, 1),
        ))
    }

    /// [`portable::exponentials`] in registers.
    #[target_feature(enable = "avx2,fma")]
    fn exponentials(row: &mut [f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for block in row.chunks_exact(LANES) {
            m = _mm256_max_ps(m, load(block));
        }
        let max = _mm256_set1_ps(max_lanes(m));
        let mut total = _mm256_setzero_ps();
        for block in row.chunks_exact_mut(LANES) {
            let e = exp(_mm256_sub_ps(load(block), max));
            // SAFETY: a block holds eight values.
            unsafe { _mm256_storeu_ps(block.as_mut_ptr(), e) };
            total = _mm256_add_ps(total, e);
        }
        sum(total)
    }

    /// Eight values from a block of eight.
    #[target_feature(enable = "avx2,fma")]
    fn load(block: &[f32]) -> __m256 {
        assert_eq!(block.len(), LANES);
        // SAFETY: the block holds eight values (asserted).
        unsafe { _mm256_loadu_ps(block.as_ptr()) }
    }

    /// max((m0, m4), (m2, m6)), max((m1, m5), (m3, m7)), then those two.
    #[target_feature(enable = "avx2,fma")]
    fn max_lanes(m: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(len: usize, seed: u32, spread: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + seed as f32 * 0.173) * 0.618).sin() * spread)
            .collect()
    }

    /// Attention in f64 with the exact softmax.
    fn reference(q: &[f32], keys: &[f32], values: &[f32], hd: usize, scale: f32) -> Vec<f64> {
        let visible = keys.len() / hd;
        let scores: Vec<f64> = keys
            .chunks_exact(hd)
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                (0..visible)
                    .map(|t| e[t] * values[t * hd + d] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    struct Case {
        hd: usize,
        group: usize,
        visible: usize,
    }

    fn run(
        tier: AttentionTier,
        case: &Case,
        spread: f32,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let Case { hd, group, visible } = *case;
        // Two kv heads interleaved per position, as a KV cache lays them out;
        // the group attends the second.
        let stride = 2 * hd;
        let q = seeded(group * hd, 1, spread);
        let keys = seeded(visible * stride, 2, spread);
        let values = seeded(visible * stride, 3, 1.0);
        let mut out = vec![0f32; group * hd];
        attend_with(
            tier,
            Queries {
                rows: &q,
                head_stride: hd,
                position_stride: 0,
                visible: &[visible],
            },
            KeyValues {
                keys: &keys,
                values: &values,
                offset: hd,
                stride,
            },
            hd,
            1.0 / (hd as f32).sqrt(),
            &mut out,
        )
        .unwrap();
        (q, keys, values, out)
    }

    const CASES: [Case; 5] = [
        Case {
            hd: 64,
            group: 3,
            visible: 1,
        },
        Case {
            hd: 64,
            group: 3,
            visible: 200,
        },
        Case {
            hd: 128,
            group: 4,
            visible: 77,
        },
        Case {
            hd: 20,
            group: 2,
            visible: 13,
        },
        Case {
            hd: 64,
            group: 1,
            visible: 8,
        },
    ];

    #[test]
    fn every_tier_gives_the_same_bits() {
        for case in &CASES {
            let (.., reference) = run(AttentionTier::Portable, case, 3.0);
            for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
                let (.., out) = run(tier, case, 3.0);
                let same = out
                    .iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{tier:?} differs from the portable tier at hd {}",
                    case.hd
                );
            }
        }
    }

    #[test]
    fn attention_matches_the_exact_softmax() {
        for case in &CASES {
            for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
                // A spread of 6 gives scores tens of nats apart.
                let (q, keys, values, out) = run(tier, case, 6.0);
                let hd = case.hd;
                let head = |rows: &[f32]| -> Vec<f32> {
                    rows.chunks_exact(2 * hd)
                        .flat_map(|r| r[hd..].to_vec())
                        .collect()
                };
                let (keys, values) = (head(&keys), head(&values));
                for (g, out) in out.chunks_exact(hd).enumerate() {
                    let expected = reference(
                        &q[g * hd..(g + 1) * hd],
                        &keys,
                        &values,
                        hd,
                        1.0 / (hd as f32).sqrt(),
                    );
                    for (&o, &e) in out.iter().zip(&expected) {
                        assert!(
                            (o as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{o} vs {e} ({tier:?})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_nan_key_makes_the_output_nan_on_every_tier() {
        let hd = 16;
        let q = vec![0.5f32; hd];
        let mut keys = seeded(10 * hd, 4, 1.0);
        keys[3 * hd + 5] = f32::NAN;
        let values = seeded(10 * hd, 5, 1.0);
        for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
            let mut out = vec![0f32; hd];
            attend_with(
                tier,
                Queries {
                    rows: &q,
                    head_stride: hd,
                    position_stride: 0,
                    visible: &[10],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset: 0,
                    stride: hd,
                },
                hd,
                0.25,
                &mut out,
            )
            .unwrap();
            assert!(out.iter().all(|o| o.is_nan()), "{tier:?}: {out:?}");
        }
    }

    #[test]
    fn slices_shorter_than_the_shapes_are_refused() {
        let (q, keys, values) = (vec![0f32; 64], vec![0f32; 64 * 4], vec![0f32; 64 * 4]);
        let mut out = vec![0f32; 64];
        let attempt = |visible: usize, offset: usize, out: &mut [f32]| {
            attend(
                Queries {
                    rows: &q,
                    head_stride: 64,
                    position_stride: 64,
                    visible: &[visible],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset,
                    stride: 64,
                },
                64,
                1.0,
                out,
            )
        };
        assert!(attempt(4, 0, &mut out).is_ok());
        assert!(attempt(5, 0, &mut out).is_err());
        assert!(attempt(4, 1, &mut out).is_err());
        assert!(attempt(0, 0, &mut out).is_err());
        assert!(attempt(1, 0, &mut vec![0f32; 128]).is_err());
        assert!(attempt(1, 0, &mut vec![0f32; 60]).is_err());
        // Two positions need two queries' values and two outputs.
        let two = |q: &[f32], out: &mut [f32]| {
            attend(
                Queries {
                    rows: q,
                    head_stride: 64,
                    position_stride: 64,
                    visible: &[1, 2],
                },
                KeyValues {
                    keys: &keys,
                    values: &values,
                    offset: 0,
                    stride: 64,
                },
                64,
                1.0,
                out,
            )
        };
        assert!(two(&[0f32; 128], &mut vec![0f32; 128]).is_ok());
        assert!(two(&q, &mut vec![0f32; 128]).is_err());
        assert!(two(&[0f32; 128], &mut vec![0f32; 64]).is_err());
        assert!(two(&[0f32; 128], &mut vec![0f32; 192]).is_err());
    }

    /// A tile of positions gives each query the bits it gets alone, on
    /// every tier: causal rows of every length around the lanes and the
    /// value blocks, and trailing rows that stop growing (a padded
    /// sequence's queries past its end).
    #[test]
    fn a_tile_of_positions_gives_each_query_its_bits_alone() {
        for (hd, group) in [(64, 3), (128, 4), (20, 2)] {
            let positions = 13;
            let visible: Vec<usize> = (0..positions).map(|p| (60 + p).min(70)).collect();
            let longest = visible[positions - 1];
            // Queries laid out [heads, positions, hd], as the tensor forward
            // holds them; two kv heads interleaved per cached position.
            let q = seeded(group * positions * hd, 6, 3.0);
            let keys = seeded(longest * 2 * hd, 7, 3.0);
            let values = seeded(longest * 2 * hd, 8, 1.0);
            let kv = KeyValues {
                keys: &keys,
                values: &values,
                offset: hd,
                stride: 2 * hd,
            };
            let scale = 1.0 / (hd as f32).sqrt();
            let mut alone = vec![0f32; positions * group * hd];
            for (p, out) in alone.chunks_exact_mut(group * hd).enumerate() {
                let queries = Queries {
                    rows: &q[p * hd..],
                    head_stride: positions * hd,
                    position_stride: 0,
                    visible: &visible[p..=p],
                };
                attend_with(AttentionTier::Portable, queries, kv, hd, scale, out).unwrap();
            }
            for &tier in AttentionTier::ALL.iter().filter(|t| t.is_supported()) {
                let mut tile = vec![0f32; positions * group * hd];
                let queries = Queries {
                    rows: &q,
                    head_stride: positions * hd,
                    position_stride: hd,
                    visible: &visible,
                };
                attend_with(tier, queries, kv, hd, scale, &mut tile).unwrap();
                let same = tile
                    .iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{tier:?}: a tile differs from its positions alone (hd {hd})"
                );
            }
        }
    }
}
