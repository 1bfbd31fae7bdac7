//! The solve behind GPTQ: the upper-triangular factor of the dampened inverse
//! Hessian, by a blocked Cholesky factorization and a triangular inverse in
//! register tiles, the same bits on every tier and thread count.

use qforge_core::CpuTier;
use rayon::prelude::*;

use crate::error::{Error, Result};
use qforge_core::VectorTier;

/// The upper-triangular `U` with `Uᵀ U = H⁻¹` for the Hessian with its
/// columns in `order`, dampened and with unseen inputs made inert (unit
/// diagonal, no coupling), row-major `n × n`.
///
/// With `R` upper triangular and `H = R Rᵀ` (the Cholesky factor of `H` with
/// its rows and columns reversed, reversed back), `H⁻¹ = R⁻ᵀ R⁻¹`, so
/// `U = R⁻¹`: one factorization and one triangular inverse, both sums of
/// products of two rows computed in register tiles.
pub(super) fn inverse_factor(
    tier: VectorTier,
    hessian: Vec<f64>,
    n: usize,
    order: &[usize],
    dampening: f64,
) -> Result<Vec<f64>> {
    let diagonal_mean = (0..n).map(|i| hessian[i * n + i]).sum::<f64>() / n as f64;
    if diagonal_mean <= 0.0 {
        // Nothing was observed: every input is inert and GPTQ rounds to nearest.
        let mut identity = vec![0.0; n * n];
        (0..n).for_each(|i| identity[i * n + i] = 1.0);
        return Ok(identity);
    }
    let damp = dampening * diagonal_mean;
    // `reversed[i][j] = H'[n−1−i][n−1−j]`, H' the permuted, dampened matrix.
    let dead: Vec<bool> = (0..n)
        .map(|i| {
            let o = order[n - 1 - i];
            hessian[o * n + o] <= 0.0
        })
        .collect();
    let stride = solve_stride(n);
    let mut reversed = vec![0.0; n * stride];
    reversed
        .par_chunks_mut(stride)
        .enumerate()
        .for_each(|(i, row)| {
            let oi = order[n - 1 - i];
            for (j, v) in row[..=i].iter_mut().enumerate() {
                let oj = order[n - 1 - j];
                *v = if dead[i] || dead[j] {
                    0.0
                } else {
                    hessian[oi * n + oj]
                };
                if i == j {
                    *v = if dead[i] { 1.0 } else { *v + damp };
                }
            }
        });
    // The factorization works on its own copy: the Hessian's memory (1.64 GB
    // at 14 336 wide) is not held through it.
    drop(hessian);
    cholesky_lower(tier, &mut reversed, n, stride)?;
    // R = reverse(L), so U = R⁻¹ = reverse(L⁻¹):
    // U[i][j] = L⁻¹[n−1−i][n−1−j] = Y[n−1−j][n−1−i] with Y = (L⁻¹)ᵀ.
    let y = inverse_transposed(tier, &reversed, n, stride);
    drop(reversed);
    let mut u = vec![0.0; n * n];
    // By blocks of rows and columns: a row of `U` is a column of `Y`.
    u.par_chunks_mut(SOLVE_BLOCK * n)
        .enumerate()
        .for_each(|(b, rows)| {
            let i0 = b * SOLVE_BLOCK;
            let i1 = i0 + rows.len() / n;
            for j0 in (i0..n).step_by(SOLVE_BLOCK) {
                for j in j0..(j0 + SOLVE_BLOCK).min(n) {
                    let column = &y[(n - 1 - j) * stride..];
                    for i in i0..i1.min(j + 1) {
                        rows[(i - i0) * n + j] = column[n - 1 - i];
                    }
                }
            }
        });
    Ok(u)
}

/// The row stride of the factorization's and the inverse's matrices: `n`
/// rounded up to whole cache lines, an odd number of them. With rows a
/// multiple of 4 KB apart (any width a multiple of 512, as 4 096 and
/// 14 336 are), a column's entries all fall in one set of each cache, and a
/// block of 32 rows did not stay in L1 or L2: 14 336 inputs took 1.6× the
/// time that 4 096 scaled by n³ predicts.
fn solve_stride(n: usize) -> usize {
    let lines = n.div_ceil(LANES);
    (lines | 1) * LANES
}

/// Rows of the Cholesky factorization and of the triangular inverse worked
/// on together, so each finished row is read from memory once per block
/// rather than once per row: a 1 536-wide factor is 18 MB, beyond the
/// caches, and reading it once per row made both memory-bound. 32 rows of
/// a 2 048-wide factor are 512 KB, which the L2 cache holds.
pub(super) const SOLVE_BLOCK: usize = 32;

/// In-place Cholesky factorization `A = L Lᵀ` of the lower triangle of `a`
/// (`n × n`, rows `stride` apart; the upper triangle is ignored), a
/// block of [`SOLVE_BLOCK`] columns at a time: first the block on the
/// diagonal, then every block of rows below it side by side on the rayon
/// pool. A row block's entries in these columns need only its own earlier
/// columns and the diagonal block's rows, so the blocks below are
/// independent; a Llama-3-8B `down_proj` input (14 336 wide) is one solve
/// on its own, and a serial factorization left every core but one idle.
fn cholesky_lower(tier: VectorTier, a: &mut [f64], n: usize, stride: usize) -> Result<()> {
    for k0 in (0..n).step_by(SOLVE_BLOCK) {
        let k1 = (k0 + SOLVE_BLOCK).min(n);
        let (diagonal, below) = a[k0 * stride..].split_at_mut((k1 - k0) * stride);
        factor_diagonal(tier, diagonal, stride, k0)?;
        let diagonal = &*diagonal;
        below
            .par_chunks_mut(SOLVE_BLOCK * stride)
            .for_each(|rows| factor_below(tier, rows, diagonal, stride, k0));
    }
    Ok(())
}

tiered! {
    /// The factorization's block on the diagonal: `block` holds its rows
    /// (from `k0`, their columns before `k0` finished), each tier with its
    /// register tile.
    fn factor_diagonal => factor_diagonal_body::<[2, 2] [2, 2] [4, 2]>(block: &mut [f64], stride: usize, k0: usize) -> Result<()>
}

tiered! {
    /// The factorization's entries of `rows` (a row block below the
    /// diagonal one, its columns before `k0` finished) in the diagonal
    /// block's columns, each tier with its register tile.
    fn factor_below => factor_below_body::<[2, 2] [2, 2] [4, 2]>(rows: &mut [f64], diagonal: &[f64], stride: usize, k0: usize) -> ()
}

/// Every entry `L[j][k]` is computed by one recipe, whichever block holds
/// it and whatever the tile: the products over the columns before its
/// block's first column `k0`, summed by [`block_dots`] in register tiles of
/// `JT × KT` entries, subtracted from `A[j][k]`; then the products over the
/// columns `k0..k`, one at a time, in order. So every tier and every
/// thread count gives the same bits.
#[inline(always)]
fn factor_diagonal_body<const JT: usize, const KT: usize>(
    block: &mut [f64],
    stride: usize,
    k0: usize,
) -> Result<()> {
    let rows = block.len() / stride;
    let mut sums = vec![0.0; SOLVE_BLOCK * SOLVE_BLOCK];
    block_dots::<JT, KT>((block, rows), (block, rows), stride, 0..k0, &mut sums);
    for k in k0..k0 + rows {
        let row_k = (k - k0) * stride;
        for j in k..k0 + rows {
            let row_j = (j - k0) * stride;
            let mut t = block[row_j + k] - sums[(j - k0) * SOLVE_BLOCK + k - k0];
            for m in k0..k {
                t -= block[row_j + m] * block[row_k + m];
            }
            block[row_j + k] = if j == k {
                if !(t > 0.0 && t.is_finite()) {
                    return Err(Error::Gptq(format!(
                        "the dampened Hessian is not positive definite at column {j}; raise gptq.dampening"
                    )));
                }
                t.sqrt()
            } else {
                t / block[row_k + k]
            };
        }
    }
    Ok(())
}

/// The same recipe as [`factor_diagonal_body`], for a row block below the
/// diagonal one (`diagonal` holds its finished rows).
#[inline(always)]
fn factor_below_body<const JT: usize, const KT: usize>(
    rows: &mut [f64],
    diagonal: &[f64],
    stride: usize,
    k0: usize,
) {
    let (count, width) = (rows.len() / stride, diagonal.len() / stride);
    let mut sums = vec![0.0; SOLVE_BLOCK * SOLVE_BLOCK];
    block_dots::<JT, KT>((rows, count), (diagonal, width), stride, 0..k0, &mut sums);
    for k in k0..k0 + width {
        let l_k = &diagonal[(k - k0) * stride..(k - k0 + 1) * stride];
        for j in 0..count {
            let row_j = j * stride;
            let mut t = rows[row_j + k] - sums[j * SOLVE_BLOCK + k - k0];
            for m in k0..k {
                t -= rows[row_j + m] * l_k[m];
            }
            rows[row_j + k] = t / l_k[k];
        }
    }
}

/// Lanes of the factorization's sums of products: one AVX-512 register,
/// two of AVX2.
const LANES: usize = 8;

/// Columns [`block_dots`] takes at a time: a tile's rows of a panel (8 KB)
/// stay in L1 and the panel of a block of rows (64 KB) in L2 while every
/// tile reads it, where whole rows (up to 14 336 columns, 3.5 MB for a
/// block of rows) came from L3 once per tile. Measured best of 64 to 1 024
/// on 2 048 and 4 096 inputs (`cargo bench -p qforge-quant --bench gptq`).
const PANEL: usize = 256;

/// `sums[j][k] = Σ_{m ∈ columns} x[j][m] · y[k][m]` for the first `x_rows`
/// rows of `x` and `y_rows` of `y` (row stride `stride`, at most
/// [`SOLVE_BLOCK`] each; `sums` row stride `SOLVE_BLOCK`), the range's
/// length a multiple of [`LANES`]. Each sum keeps [`LANES`]
/// running sums over interleaved columns, in column order, added pairwise
/// at the end; `JT × KT` of them are computed side by side in registers,
/// each row's values loaded once for the tile, a [`PANEL`] of columns at a
/// time (the running sums wait in memory between panels, so their order is
/// that of one sweep).
#[inline(always)]
fn block_dots<const JT: usize, const KT: usize>(
    (x, x_rows): (&[f64], usize),
    (y, y_rows): (&[f64], usize),
    stride: usize,
    columns: std::ops::Range<usize>,
    sums: &mut [f64],
) {
    debug_assert!(columns.len().is_multiple_of(LANES));
    let finish = |mut lanes: [f64; LANES]| {
        let mut width = LANES;
        while width > 1 {
            width /= 2;
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
        }
        lanes[0]
    };
    let chunk = |rows: &[f64], row: usize, at: usize| -> [f64; LANES] {
        rows[row * stride + at..row * stride + at + LANES]
            .try_into()
            .expect("a chunk of lanes")
    };
    // Whole tiles, panel by panel.
    let (tiled_x, tiled_y) = (x_rows / JT * JT, y_rows / KT * KT);
    let mut running = vec![[[[0f64; LANES]; KT]; JT]; (tiled_x / JT) * (tiled_y / KT)];
    for first in columns.clone().step_by(PANEL) {
        let panel = first..(first + PANEL).min(columns.end);
        let mut tiles = running.iter_mut();
        for j in (0..tiled_x).step_by(JT) {
            for k in (0..tiled_y).step_by(KT) {
                let tile = tiles.next().expect("a tile's running sums");
                // A local copy, which LLVM keeps in registers; the rows cut
                // to the panel's length, so no load is bounds-checked.
                let mut acc = *tile;
                let steps = panel.len() / LANES;
                let lanes_of = |row: usize| row * stride + panel.start..row * stride + panel.end;
                let xs: [&[[f64; LANES]]; JT] =
                    std::array::from_fn(|a| &x[lanes_of(j + a)].as_chunks().0[..steps]);
                let ys: [&[[f64; LANES]]; KT] =
                    std::array::from_fn(|b| &y[lanes_of(k + b)].as_chunks().0[..steps]);
                for c in 0..steps {
                    for (acc, xa) in acc.iter_mut().zip(&xs) {
                        let xa = &xa[c];
                        for (lanes, yb) in acc.iter_mut().zip(&ys) {
                            let yb = &yb[c];
                            for l in 0..LANES {
                                lanes[l] += xa[l] * yb[l];
                            }
                        }
                    }
                }
                *tile = acc;
            }
        }
    }
    let mut tiles = running.into_iter();
    for j in (0..tiled_x).step_by(JT) {
        for k in (0..tiled_y).step_by(KT) {
            let acc = tiles.next().expect("a tile's running sums");
            for (a, acc) in acc.into_iter().enumerate() {
                for (b, lanes) in acc.into_iter().enumerate() {
                    sums[(j + a) * SOLVE_BLOCK + k + b] = finish(lanes);
                }
            }
        }
    }
    // The rows and columns left over, one sum at a time.
    for a in 0..x_rows {
        let b_first = if a < tiled_x { tiled_y } else { 0 };
        for b in b_first..y_rows {
            let mut lanes = [0f64; LANES];
            for at in columns.clone().step_by(LANES) {
                let (xa, yb) = (chunk(x, a, at), chunk(y, b, at));
                for l in 0..LANES {
                    lanes[l] += xa[l] * yb[l];
                }
            }
            sums[a * SOLVE_BLOCK + b] = finish(lanes);
        }
    }
}

/// `Y = (L⁻¹)ᵀ` of the lower-triangular `l` (`n × n`, row-major with
/// rows `stride` apart, as `Y` is), upper triangular. Each block of
/// [`SOLVE_BLOCK`] rows of `Y` reads only `l`, so the blocks run side by
/// side on the rayon pool.
fn inverse_transposed(tier: VectorTier, l: &[f64], n: usize, stride: usize) -> Vec<f64> {
    let mut y = vec![0.0; n * stride];
    y.par_chunks_mut(SOLVE_BLOCK * stride)
        .enumerate()
        .for_each(|(b, block)| inverse_rows(tier, l, (n, stride), b * SOLVE_BLOCK, block));
    y
}

tiered! {
    /// The rows of `Y` from `j0` (`block`, zeroed), each tier with its
    /// register tile.
    fn inverse_rows => inverse_rows_body::<[2, 2] [2, 2] [4, 2]>(l: &[f64], shape: (usize, usize), j0: usize, block: &mut [f64]) -> ()
}

/// Forward substitution for every column of `L⁻¹` at once, written as
/// rows of `Y`: `Y[j][i] = (δ_ij − Σ_{j ≤ m < i} L[i][m] · Y[j][m]) / L[i][i]`,
/// a sum of products of two rows, like the factorization's. For the block's
/// rows and the columns of a block `i0..`, the products over the columns
/// `j0..i0` come first ([`block_dots`]; `Y[j][m]` is zero for `m < j`, so
/// starting at the block's first row adds only zeros), then the block's own
/// columns one at a time, in order.
#[inline(always)]
fn inverse_rows_body<const JT: usize, const KT: usize>(
    l: &[f64],
    (n, stride): (usize, usize),
    j0: usize,
    block: &mut [f64],
) {
    let j1 = j0 + block.len() / stride;
    let mut sums = vec![0.0; SOLVE_BLOCK * SOLVE_BLOCK];
    for i0 in (j0..n).step_by(SOLVE_BLOCK) {
        let i1 = (i0 + SOLVE_BLOCK).min(n);
        block_dots::<JT, KT>(
            (block, j1 - j0),
            (&l[i0 * stride..], i1 - i0),
            stride,
            j0..i0,
            &mut sums,
        );
        for i in i0..i1 {
            let l_i = &l[i * stride..(i + 1) * stride];
            for j in j0..j1.min(i + 1) {
                let row_j = (j - j0) * stride;
                let identity = if i == j { 1.0 } else { 0.0 };
                let mut t = identity - sums[(j - j0) * SOLVE_BLOCK + i - i0];
                for m in i0.max(j)..i {
                    t -= l_i[m] * block[row_j + m];
                }
                block[row_j + i] = t / l_i[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gptq::tests::correlated_inputs;

    #[test]
    fn the_inverse_factor_inverts_the_dampened_hessian() {
        // Two whole blocks of rows and a partial one.
        let n = 2 * SOLVE_BLOCK + 5;
        let (_, h) = correlated_inputs(50, n, 5);
        let order: Vec<usize> = (0..n).collect();
        let u = inverse_factor(VectorTier::detect(), h.clone(), n, &order, 0.01).unwrap();
        let damp = 0.01 * (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
        // (Uᵀ U) (H + damp I) = I.
        for i in 0..n {
            for j in 0..n {
                let v: f64 = (0..n)
                    .map(|m| {
                        let utu: f64 = (0..n).map(|k| u[k * n + i] * u[k * n + m]).sum();
                        utu * (h[m * n + j] + if m == j { damp } else { 0.0 })
                    })
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-8, "({i}, {j}): {v}");
            }
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0, "upper triangular");
            }
        }
    }
}
