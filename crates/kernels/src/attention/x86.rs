//! The AVX2 tier: the portable tier's arithmetic in registers, keys read in
//! blocks of eight and values in blocks that stay in L1 for a tile of queries.

use std::arch::x86_64::*;
use std::ops::Range;

use super::*;
use crate::exp::x86::exp;

/// Keys whose values are accumulated for every query of the tile before
/// the next block is read: 64 values of 128 dimensions are 32 KiB.
const VALUE_BLOCK: usize = 64;

/// [`portable::attend`] in AVX2 registers: the same arithmetic in the
/// same order. `hd` is a multiple of 8. The shared prefix is attended by
/// every query of the tile at once, then each position goes on over its
/// own cache: the scores and the weighted sums pick up where the prefix
/// left them, so the order of every addition is that of one cache.
///
/// # Safety
/// The CPU has AVX2 and FMA, and [`check`] accepted the shapes.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend(
    queries: Queries<'_>,
    kv: Split<'_>,
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
    let shared = kv.len.min(queries.longest());
    // The spans of keys read: the prefix by the whole tile, then each
    // position whose keys go on past it over its own cache, as a tile of
    // its own (with the index of its first row and the position its
    // cache's first key holds). One call site each for the score and value
    // passes, which the compiler inlines.
    let spans = std::iter::once((tile, kv.prefix, 0..shared, 0, 0)).chain(
        (0..queries.positions())
            .filter(|&p| queries.visible[p] > shared)
            .map(|p| {
                let own = tile.at_position(p);
                (
                    own,
                    kv.own_of(p),
                    shared..own.queries.longest(),
                    p * tile.group,
                    shared,
                )
            }),
    );
    let Scratch { scores, totals } = scratch;
    for (tile, kv, range, row, first) in spans.clone() {
        // SAFETY: `check` proved that the query of head g < group at
        // position p lies at p · position_stride + g · head_stride within
        // `queries.rows`, the key and value of every position t < shared
        // within the prefix's slices and of every shared ≤ t < visible[p]
        // within position p's own; the scores hold a padded row per query
        // from `row` on.
        unsafe {
            score(
                tile,
                (kv, first),
                range,
                scores[row * tile.padded..].as_mut_ptr(),
                scale,
            )
        };
    }
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
    for (tile, kv, range, row, first) in spans {
        let (weights, out) = (scores[row * tile.padded..].as_ptr(), &mut out[row * hd..]);
        // SAFETY: as for the scores; `out` holds a row of `hd` per query
        // from `row` on.
        unsafe { weigh_values(tile, (kv, first), range, weights, out.as_mut_ptr()) };
    }
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

impl<'a> Tile<'a> {
    /// The queries of position `p` alone (rows `p · group ..`).
    fn at_position(&self, p: usize) -> Tile<'a> {
        let q = self.queries;
        Tile {
            queries: Queries {
                rows: &q.rows[p * q.position_stride..],
                visible: &q.visible[p..=p],
                ..q
            },
            ..*self
        }
    }

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

/// Each row's scores `q·k · scale` for the keys in `range` it sees, into
/// its row of `scores` (`tile.padded` apart), `kv` holding the keys from
/// position `first` on. Eight keys at a time for every
/// query of the tile, so a block of keys is read from memory once and
/// then from L1; two queries at a time share each key vector loaded.
///
/// # Safety
/// [`check`] accepted the tile and `kv`, and `scores` holds a padded row
/// per query.
#[target_feature(enable = "avx2,fma")]
unsafe fn score(
    tile: Tile<'_>,
    (kv, first): (KeyValues<'_>, usize),
    range: Range<usize>,
    scores: *mut f32,
    scale: f32,
) {
    let Tile { hd, padded, .. } = tile;
    let stride = kv.stride;
    let scales = _mm256_set1_ps(scale);
    // SAFETY: the caller's bounds: row r's scores for keys t < visible(r).
    unsafe {
        let keys = kv.keys.as_ptr().add(kv.offset);
        let seen = |row: usize| tile.visible(row).min(range.end);
        for t in range.clone().step_by(LANES) {
            let block = keys.add((t - first) * stride);
            let whole = |row: usize| t + LANES <= seen(row);
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
                    for j in 0..seen(row).saturating_sub(t) {
                        *at.add(j) = dot(tile.query(row), block.add(j * stride), hd) * scale;
                    }
                }
                row += 1;
            }
        }
    }
}

/// Adds each row's `weights[t] · value[t]` for the keys in `range` it
/// sees, in order, to its row of `out` (`kv` holding the values from
/// position `first` on). The tile's queries take a block of values in turn
/// while it is in L1; two queries at a time share each value vector
/// loaded, as far as both see, then each goes on alone to its own end.
///
/// # Safety
/// [`check`] accepted the tile and `kv`, `weights` holds a padded row per
/// query and `out` a row of `hd` per query.
#[target_feature(enable = "avx2,fma")]
unsafe fn weigh_values(
    tile: Tile<'_>,
    (kv, first): (KeyValues<'_>, usize),
    range: Range<usize>,
    weights: *const f32,
    out: *mut f32,
) {
    let Tile { hd, padded, .. } = tile;
    let stride = kv.stride;
    // SAFETY: the caller's bounds: row r's values for keys t < visible(r).
    unsafe {
        // Indices from position `first`: value t - first, weight t (the
        // weights pointer moved on by `first`).
        let values = kv.values.as_ptr().add(kv.offset);
        let row_of = |row: usize| (out.add(row * hd), weights.add(row * padded + first));
        for block in range.clone().step_by(VALUE_BLOCK) {
            let end = |row: usize| (block + VALUE_BLOCK).min(tile.visible(row)).min(range.end);
            let mut row = 0;
            while row < tile.rows() {
                if row + 1 < tile.rows() {
                    let common = end(row).min(end(row + 1));
                    if common > block {
                        let span = (block - first, common - first, stride);
                        accumulate_two(row_of(row), row_of(row + 1), values, span, hd);
                    }
                    for row in [row, row + 1] {
                        let (out, weights) = row_of(row);
                        let span = (common.max(block) - first, end(row) - first, stride);
                        accumulate_one(out, weights, values, span, hd);
                    }
                    row += 2;
                } else {
                    let (out, weights) = row_of(row);
                    let span = (block - first, end(row) - first, stride);
                    accumulate_one(out, weights, values, span, hd);
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
