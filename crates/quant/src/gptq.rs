//! GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
//! Generative Pre-trained Transformers"): a layer's int8 weights rounded one
//! input column at a time, each column's rounding error spread over the
//! columns not yet rounded through the inverse Hessian of the layer's input,
//! `H = Σ x xᵀ`. It minimizes `‖X Wᵀ − X Qᵀ‖²` on the calibration inputs far
//! better than rounding each weight to nearest when the inputs' channels are
//! correlated, and equals rounding to nearest when they are not.
//!
//! The grid is the engine's: symmetric per output row, scale
//! `max |w| / 127`, so GPTQ changes which integers are chosen, never what
//! they mean. Everything runs in f64 in one fixed order (rows are
//! independent and may run on any thread), so equal Hessians give equal
//! bits.

use qforge_core::CpuTier;
use qforge_kernels::WEIGHT_QMAX;
use qforge_model::Int8Weight;
use rayon::prelude::*;

use crate::error::{Error, Result};

/// How GPTQ runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqOptions {
    /// Columns per block of lazily applied updates (the paper's 128).
    pub block_size: usize,
    /// Added to the Hessian's diagonal, as a fraction of its mean (the
    /// paper's 1 %): keeps the inverse well conditioned.
    pub dampening: f64,
    /// Round columns in order of decreasing Hessian diagonal, the inputs
    /// with the most energy first (the reference implementation's act-order).
    pub act_order: bool,
}

impl Default for GptqOptions {
    fn default() -> Self {
        Self {
            block_size: 128,
            dampening: 0.01,
            act_order: false,
        }
    }
}

/// Rows rounded together, so the inverse Hessian's factor is read once per
/// group from memory rather than once per row.
const ROW_GROUP: usize = 32;

/// The part of GPTQ that depends only on a layer input's Hessian (the
/// column order and the inverse Hessian's factor), computed once for every
/// layer that reads the input (q, k and v share one).
#[derive(Debug, Clone)]
pub struct Gptq {
    inputs: usize,
    order: Vec<usize>,
    /// The factor's upper triangle, cut by blocks of columns as rounding
    /// reads it.
    blocks: Vec<FactorBlock>,
    block_size: usize,
    tier: Tier,
}

/// The factor's rows `start..end` (a block of columns rounded together):
/// `inner` their square on the block's own columns (`ks × ks`, row-major),
/// `panels` the rest of them, right of the block, in tiles of
/// [`TILE_COLUMNS`] columns (`[tile][row][TILE_COLUMNS]`, zero past the
/// width), so a tile of the lazy update reads its part as one stream.
/// Together they hold the upper triangle, half the full matrix's memory.
#[derive(Debug, Clone)]
struct FactorBlock {
    start: usize,
    end: usize,
    inner: Vec<f64>,
    panels: Vec<f64>,
}

impl FactorBlock {
    /// Cuts the blocks of `block` columns from the row-major `n × n` factor.
    fn cut(factor: &[f64], n: usize, block: usize) -> Vec<Self> {
        (0..n)
            .step_by(block)
            .map(|start| {
                let end = (start + block).min(n);
                let ks = end - start;
                let mut inner = Vec::with_capacity(ks * ks);
                for k in start..end {
                    inner.extend_from_slice(&factor[k * n + start..k * n + end]);
                }
                let tiles = (n - end).div_ceil(TILE_COLUMNS);
                let mut panels = vec![0.0; tiles * ks * TILE_COLUMNS];
                for k in start..end {
                    let row = &factor[k * n + end..(k + 1) * n];
                    for (t, columns) in row.chunks(TILE_COLUMNS).enumerate() {
                        let at = (t * ks + k - start) * TILE_COLUMNS;
                        panels[at..at + columns.len()].copy_from_slice(columns);
                    }
                }
                Self {
                    start,
                    end,
                    inner,
                    panels,
                }
            })
            .collect()
    }
}

/// The vector unit the solver's f64 loops are compiled for. Every tier runs
/// the same operations in the same order (Rust never fuses a multiply and
/// an add on its own), so all give the same bits; the wider ones do more
/// lanes at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Baseline,
    Avx2,
    Avx512,
}

impl CpuTier for Tier {
    const ALL: &'static [Self] = &[Tier::Baseline, Tier::Avx2, Tier::Avx512];

    fn is_supported(self) -> bool {
        let cpu = qforge_core::CpuFeatures::get();
        match self {
            Tier::Baseline => true,
            Tier::Avx2 => cpu.avx2,
            Tier::Avx512 => cpu.avx512f,
        }
    }
}

/// `fn $name(tier, args…)`: `$body` (an `#[inline(always)]` function, so
/// each copy vectorizes for its instruction set) run on the tier's copy.
/// `$body::<generics>` per tier (baseline, AVX2, AVX-512) lets each tier
/// choose its register tile.
macro_rules! tiered {
    ($(#[$doc:meta])* fn $name:ident => $body:ident ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        tiered! {
            $(#[$doc])*
            fn $name => $body::<[] [] []>($($arg: $ty),*) -> $ret
        }
    };
    ($(#[$doc:meta])* fn $name:ident => $body:ident::<[$($base:tt)*] [$($avx2:tt)*] [$($avx512:tt)*]>
        ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        fn $name(tier: Tier, $($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2($($arg: $ty),*) -> $ret {
                $body::<$($avx2)*>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512($($arg: $ty),*) -> $ret {
                $body::<$($avx512)*>($($arg),*)
            }
            debug_assert!(tier.is_supported());
            match tier {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: a `Tier` in use is one the CPU supports
                // (`Tier::detect`, or the tests' supported tiers).
                Tier::Avx2 => unsafe { avx2($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Tier::Avx512 => unsafe { avx512($($arg),*) },
                _ => $body::<$($base)*>($($arg),*),
            }
        }
    };
}

impl Gptq {
    /// Prepares GPTQ for layers whose input has the Hessian `hessian`
    /// (`inputs × inputs`, row-major, symmetric).
    pub fn new(hessian: Vec<f64>, inputs: usize, options: &GptqOptions) -> Result<Self> {
        Self::new_on(Tier::detect(), hessian, inputs, options)
    }

    fn new_on(tier: Tier, hessian: Vec<f64>, inputs: usize, options: &GptqOptions) -> Result<Self> {
        if inputs == 0 || hessian.len() != inputs * inputs {
            return Err(Error::Gptq(format!(
                "a {}-entry Hessian for {inputs} inputs",
                hessian.len()
            )));
        }
        if hessian.iter().any(|h| !h.is_finite()) {
            return Err(Error::Gptq(
                "the Hessian holds NaN or infinite values".into(),
            ));
        }
        // Inputs never seen (zero diagonal) carry no information: their
        // weights are rounded to nearest and take no part in the solve.
        let order = column_order(&hessian, inputs, options.act_order);
        let factor = inverse_factor(tier, hessian, inputs, &order, options.dampening)?;
        let block_size = options.block_size.max(1);
        Ok(Self {
            inputs,
            order,
            blocks: FactorBlock::cut(&factor, inputs, block_size),
            block_size,
            tier,
        })
    }

    /// Rounds `weight` (`[out, in]`, row-major) to int8.
    pub fn round(&self, weight: &[f32], out: usize) -> Result<Int8Weight> {
        let n = self.inputs;
        if weight.len() != out * n {
            return Err(Error::Gptq(format!(
                "{} weights for a [{out}, {n}] layer",
                weight.len()
            )));
        }
        if weight.iter().any(|w| !w.is_finite()) {
            return Err(Error::Gptq(
                "the weights hold NaN or infinite values".into(),
            ));
        }
        let scales = row_scales(weight, n);
        let mut values = vec![0i8; out * n];
        values
            .par_chunks_mut(ROW_GROUP * n)
            .zip(weight.par_chunks(ROW_GROUP * n))
            .zip(scales.par_chunks(ROW_GROUP))
            .for_each(|((q, w), s)| round_rows(self.tier, self, w, s, q));
        Ok(Int8Weight {
            values: values.into(),
            scales,
        })
    }
}

tiered! {
    /// GPTQ over a group of rows: `w` holds whole rows, `scales` one per
    /// row; writes the int8 values (in the original column order) into `q`.
    fn round_rows => round_rows_body(g: &Gptq, w: &[f32], scales: &[f32], q: &mut [i8]) -> ()
}

#[inline(always)]
fn round_rows_body(g: &Gptq, w: &[f32], scales: &[f32], q: &mut [i8]) {
    let (n, block, order) = (g.inputs, g.block_size, &g.order);
    let rows = scales.len();
    let qmax = f64::from(WEIGHT_QMAX);
    // Working copy in rounding order.
    let mut work: Vec<f64> = (0..rows)
        .flat_map(|r| order.iter().map(move |&c| f64::from(w[r * n + c])))
        .collect();
    let mut errors = vec![0.0; rows * block];
    for factor in &g.blocks {
        let (start, end) = (factor.start, factor.end);
        let ks = end - start;
        for i in start..end {
            let a = i - start;
            let d = factor.inner[a * ks + a];
            let u = &factor.inner[a * ks + a + 1..(a + 1) * ks];
            for r in 0..rows {
                let scale = f64::from(scales[r]);
                let row = &mut work[r * n..(r + 1) * n];
                let value = row[i];
                let rounded = (value / scale).round_ties_even().clamp(-qmax, qmax);
                q[r * n + order[i]] = rounded as i8;
                let error = (value - rounded * scale) / d;
                errors[a * rows + r] = error;
                for (x, &u) in row[i + 1..end].iter_mut().zip(u) {
                    *x -= error * u;
                }
            }
        }
        // The block's errors reach the columns after it at once, a tile of
        // rows × columns at a time held in registers while the block's
        // columns pass in order: each value sees the same operations as one
        // sweep per column would give it, with one load and one store.
        for (t, panel) in factor.panels.chunks_exact(ks * TILE_COLUMNS).enumerate() {
            let first_column = end + t * TILE_COLUMNS;
            let columns = (n - first_column).min(TILE_COLUMNS);
            for first_row in (0..rows).step_by(TILE_ROWS) {
                let tile = Tile {
                    first_row,
                    first_column,
                    panel,
                    errors: &errors[..ks * rows],
                    rows,
                };
                if columns == TILE_COLUMNS && first_row + TILE_ROWS <= rows {
                    tile.update::<TILE_ROWS, TILE_COLUMNS>(&mut work, n);
                } else {
                    tile.update_edge(&mut work, n, columns);
                }
            }
        }
    }
}

/// Rows and columns of the lazy update's register tile: 4 vectors of 8 f64
/// lanes on AVX-512, 8 of 4 on AVX2. (LLVM keeps an 8-row tile in memory,
/// not registers: 6× slower.)
const TILE_ROWS: usize = 4;
const TILE_COLUMNS: usize = 8;

/// A tile of the lazy update: rows from `first_row` of the group, columns
/// from `first_column`; `panel` holds the factor's rows for the block's
/// columns over the tile's columns (`TILE_COLUMNS` each, zero past the
/// width), `errors` the block's rounding errors (`rows` per column of the
/// block).
struct Tile<'a> {
    first_row: usize,
    first_column: usize,
    panel: &'a [f64],
    errors: &'a [f64],
    rows: usize,
}

impl Tile<'_> {
    /// `work[r][c] -= error[k][r] · factor[k][c]` for the block's columns
    /// `k` in order, on a full `R × C` tile kept in registers.
    #[inline(always)]
    fn update<const R: usize, const C: usize>(&self, work: &mut [f64], n: usize) {
        let at = |r: usize| (self.first_row + r) * n + self.first_column;
        let mut acc = [[0f64; C]; R];
        for (r, values) in acc.iter_mut().enumerate() {
            values.copy_from_slice(&work[at(r)..at(r) + C]);
        }
        let rows = self.first_row..self.first_row + R;
        for (u, errors) in self
            .panel
            .chunks_exact(C)
            .zip(self.errors.chunks_exact(self.rows))
        {
            let u: &[f64; C] = u.try_into().expect("a tile's width");
            let errors: &[f64; R] = errors[rows.clone()].try_into().expect("a tile's height");
            for (values, &error) in acc.iter_mut().zip(errors) {
                for (x, &u) in values.iter_mut().zip(u) {
                    *x -= error * u;
                }
            }
        }
        for (r, values) in acc.iter().enumerate() {
            work[at(r)..at(r) + C].copy_from_slice(values);
        }
    }

    /// The same on a tile cut short by the last rows or columns.
    fn update_edge(&self, work: &mut [f64], n: usize, columns: usize) {
        for r in self.first_row..self.rows.min(self.first_row + TILE_ROWS) {
            let row = &mut work[r * n + self.first_column..r * n + self.first_column + columns];
            let errors = self.errors.iter().skip(r).step_by(self.rows);
            for (u, &error) in self.panel.chunks_exact(TILE_COLUMNS).zip(errors) {
                for (x, &u) in row.iter_mut().zip(u) {
                    *x -= error * u;
                }
            }
        }
    }
}

/// The engine's per-row scales (`max |w| / 127`, 1 for a zero row), computed
/// in f32 as `qforge_kernels::quantize_rows_symmetric` computes them.
fn row_scales(weight: &[f32], inputs: usize) -> Vec<f32> {
    let qmax = f32::from(WEIGHT_QMAX);
    weight
        .chunks_exact(inputs)
        .map(|row| {
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            if max > 0.0 { max / qmax } else { 1.0 }
        })
        .collect()
}

/// The order columns are rounded in: by index, or (act-order) by decreasing
/// diagonal, ties by index.
fn column_order(hessian: &[f64], n: usize, act_order: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if act_order {
        order.sort_by(|&a, &b| {
            hessian[b * n + b]
                .total_cmp(&hessian[a * n + a])
                .then(a.cmp(&b))
        });
    }
    order
}

/// The upper-triangular `U` with `Uᵀ U = H⁻¹` for the Hessian with its
/// columns in `order`, dampened and with unseen inputs made inert (unit
/// diagonal, no coupling), row-major `n × n`.
///
/// With `R` upper triangular and `H = R Rᵀ` (the Cholesky factor of `H` with
/// its rows and columns reversed, reversed back), `H⁻¹ = R⁻ᵀ R⁻¹`, so
/// `U = R⁻¹`: one factorization and one triangular inverse, both sums of
/// products of two rows computed in register tiles.
fn inverse_factor(
    tier: Tier,
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
const SOLVE_BLOCK: usize = 32;

/// In-place Cholesky factorization `A = L Lᵀ` of the lower triangle of `a`
/// (`n × n`, rows `stride` apart; the upper triangle is ignored), a
/// block of [`SOLVE_BLOCK`] columns at a time: first the block on the
/// diagonal, then every block of rows below it side by side on the rayon
/// pool. A row block's entries in these columns need only its own earlier
/// columns and the diagonal block's rows, so the blocks below are
/// independent; a Llama-3-8B `down_proj` input (14 336 wide) is one solve
/// on its own, and a serial factorization left every core but one idle.
fn cholesky_lower(tier: Tier, a: &mut [f64], n: usize, stride: usize) -> Result<()> {
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
fn inverse_transposed(tier: Tier, l: &[f64], n: usize, stride: usize) -> Vec<f64> {
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
    use qforge_kernels::quantize_rows_symmetric;

    fn lcg(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        }
    }

    /// `rows × n` inputs whose channels are correlated (mixtures of a few
    /// shared sources), and their Hessian.
    fn correlated_inputs(rows: usize, n: usize, seed: u64) -> (Vec<f64>, Vec<f64>) {
        let mut next = lcg(seed);
        let sources = 4;
        let mixing: Vec<f64> = (0..sources * n).map(|_| next()).collect();
        let x: Vec<f64> = (0..rows)
            .flat_map(|_| {
                let s: Vec<f64> = (0..sources).map(|_| next() * 4.0).collect();
                let noise: Vec<f64> = (0..n).map(|_| next() * 0.05).collect();
                (0..n)
                    .map(|c| (0..sources).map(|k| s[k] * mixing[k * n + c]).sum::<f64>() + noise[c])
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut h = vec![0.0; n * n];
        for row in x.chunks_exact(n) {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += row[i] * row[j];
                }
            }
        }
        (x, h)
    }

    /// `‖X Wᵀ − X Qᵀ‖²` of int8 values and scales against `weight`.
    fn output_error(x: &[f64], weight: &[f32], q: &[i8], scales: &[f32], n: usize) -> f64 {
        let out = scales.len();
        x.chunks_exact(n)
            .map(|row| {
                (0..out)
                    .map(|o| {
                        let e: f64 = (0..n)
                            .map(|c| {
                                let deq = f64::from(q[o * n + c]) * f64::from(scales[o]);
                                row[c] * (f64::from(weight[o * n + c]) - deq)
                            })
                            .sum();
                        e * e
                    })
                    .sum::<f64>()
            })
            .sum()
    }

    #[test]
    fn gptq_beats_rounding_to_nearest_on_correlated_inputs() {
        let (out, n) = (19, 48);
        let (x, h) = correlated_inputs(400, n, 3);
        let mut next = lcg(9);
        let weight: Vec<f32> = (0..out * n).map(|_| next() as f32 * 0.2).collect();
        let (rtn, rtn_scales) = quantize_rows_symmetric(&weight, n, WEIGHT_QMAX);
        let rtn_error = output_error(&x, &weight, &rtn, &rtn_scales, n);
        for options in [
            GptqOptions::default(),
            GptqOptions {
                block_size: 7,
                act_order: true,
                ..GptqOptions::default()
            },
        ] {
            let g = Gptq::new(h.clone(), n, &options)
                .unwrap()
                .round(&weight, out)
                .unwrap();
            // Same grid as rounding to nearest.
            assert_eq!(g.scales, rtn_scales);
            assert!(g.values.iter().all(|v| v.unsigned_abs() <= 127));
            let gptq_error = output_error(&x, &weight, &g.values, &g.scales, n);
            assert!(
                gptq_error < 0.5 * rtn_error,
                "{options:?}: GPTQ {gptq_error} vs nearest {rtn_error}"
            );
            // Deterministic.
            let again = Gptq::new(h.clone(), n, &options).unwrap();
            assert_eq!(again.round(&weight, out).unwrap(), g);
        }
    }

    impl Gptq {
        /// The factor's upper triangle as a row-major `n × n` matrix, put
        /// back together from its blocks.
        fn factor(&self) -> Vec<f64> {
            let n = self.inputs;
            let mut full = vec![0.0; n * n];
            for b in &self.blocks {
                let ks = b.end - b.start;
                for k in b.start..b.end {
                    let row = &mut full[k * n..(k + 1) * n];
                    let inner = &b.inner[(k - b.start) * ks..(k - b.start + 1) * ks];
                    row[b.start..b.end].copy_from_slice(inner);
                    for (t, tile) in row[b.end..].chunks_mut(TILE_COLUMNS).enumerate() {
                        let at = (t * ks + k - b.start) * TILE_COLUMNS;
                        tile.copy_from_slice(&b.panels[at..at + tile.len()]);
                    }
                }
            }
            full
        }
    }

    /// GPTQ as the paper states it: each column rounded in turn and its
    /// error spread over every later column at once.
    fn column_by_column(g: &Gptq, weight: &[f32], out: usize) -> Vec<i8> {
        let n = g.inputs;
        let factor = g.factor();
        let scales = row_scales(weight, n);
        let qmax = f64::from(WEIGHT_QMAX);
        let mut q = vec![0i8; out * n];
        for r in 0..out {
            let mut row: Vec<f64> = g
                .order
                .iter()
                .map(|&c| f64::from(weight[r * n + c]))
                .collect();
            let scale = f64::from(scales[r]);
            for i in 0..n {
                let rounded = (row[i] / scale).round_ties_even().clamp(-qmax, qmax);
                q[r * n + g.order[i]] = rounded as i8;
                let error = (row[i] - rounded * scale) / factor[i * n + i];
                for j in i + 1..n {
                    row[j] -= error * factor[i * n + j];
                }
            }
        }
        q
    }

    #[test]
    fn lazy_blocks_and_tiles_give_the_bits_of_column_by_column_rounding() {
        // Whole and cut tiles of rows and columns, blocks that do and do
        // not divide the width, more rows than one group.
        for (out, n, block) in [(11, 37, 16), (37, 70, 16), (70, 100, 128), (5, 3, 1)] {
            let (_, h) = correlated_inputs(200, n, n as u64);
            let mut next = lcg(out as u64);
            let weight: Vec<f32> = (0..out * n).map(|_| next() as f32).collect();
            for act_order in [false, true] {
                let options = GptqOptions {
                    block_size: block,
                    act_order,
                    ..GptqOptions::default()
                };
                let g = Gptq::new(h.clone(), n, &options).unwrap();
                let rounded = g.round(&weight, out).unwrap();
                assert_eq!(
                    rounded.values,
                    column_by_column(&g, &weight, out).into(),
                    "{out}×{n}, block {block}, act order {act_order}"
                );
            }
        }
    }

    #[test]
    fn uncorrelated_inputs_round_to_nearest() {
        let (out, n) = (5, 33);
        let mut next = lcg(1);
        let weight: Vec<f32> = (0..out * n).map(|_| next() as f32).collect();
        // A diagonal Hessian couples no columns: nothing to compensate.
        let mut h = vec![0.0; n * n];
        (0..n).for_each(|i| h[i * n + i] = 1.0 + i as f64);
        // An input never seen (zero row and column) changes nothing either.
        h[4 * n + 4] = 0.0;
        let options = GptqOptions::default();
        let g = Gptq::new(h.clone(), n, &options)
            .unwrap()
            .round(&weight, out)
            .unwrap();
        let (rtn, scales) = quantize_rows_symmetric(&weight, n, WEIGHT_QMAX);
        assert_eq!((g.values, g.scales), (rtn.into(), scales));
        let nothing_seen = vec![0.0; n * n];
        let g = Gptq::new(nothing_seen, n, &options)
            .unwrap()
            .round(&weight, out)
            .unwrap();
        assert_eq!(
            g.values,
            quantize_rows_symmetric(&weight, n, WEIGHT_QMAX).0.into()
        );
    }

    #[test]
    fn the_inverse_factor_inverts_the_dampened_hessian() {
        // Two whole blocks of rows and a partial one.
        let n = 2 * SOLVE_BLOCK + 5;
        let (_, h) = correlated_inputs(50, n, 5);
        let order: Vec<usize> = (0..n).collect();
        let u = inverse_factor(Tier::detect(), h.clone(), n, &order, 0.01).unwrap();
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

    #[test]
    fn every_tier_gives_the_same_bits() {
        let (out, n) = (11, 3 * SOLVE_BLOCK + 3);
        let (_, h) = correlated_inputs(300, n, 7);
        let mut next = lcg(4);
        let weight: Vec<f32> = (0..out * n).map(|_| next() as f32).collect();
        let options = GptqOptions {
            block_size: 16,
            ..GptqOptions::default()
        };
        let on = |tier| {
            let g = Gptq::new_on(tier, h.clone(), n, &options).unwrap();
            (g.factor(), g.round(&weight, out).unwrap())
        };
        let baseline = on(Tier::Baseline);
        for &tier in Tier::ALL.iter().filter(|t| t.is_supported()) {
            let (factor, rounded) = on(tier);
            let same_factor = factor
                .iter()
                .zip(&baseline.0)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same_factor, "{tier:?}: the inverse factor differs");
            assert_eq!(rounded, baseline.1, "{tier:?}");
        }
    }

    #[test]
    fn the_solve_does_not_depend_on_the_thread_count() {
        // Enough blocks of rows that the factorization's and the inverse's
        // blocks are shared out among the threads, and a short last one.
        let (out, n) = (9, 5 * SOLVE_BLOCK + 3);
        let (_, h) = correlated_inputs(400, n, 12);
        let mut next = lcg(5);
        let weight: Vec<f32> = (0..out * n).map(|_| next() as f32).collect();
        let on = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let g = Gptq::new(h.clone(), n, &GptqOptions::default()).unwrap();
                (g.factor(), g.round(&weight, out).unwrap())
            })
        };
        let (factor, rounded) = on(1);
        for threads in [2, 3] {
            let (other, other_rounded) = on(threads);
            let same = other
                .iter()
                .zip(&factor)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{threads} threads: the inverse factor differs");
            assert_eq!(other_rounded, rounded, "{threads} threads");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let options = GptqOptions::default();
        assert!(Gptq::new(vec![1.0; 3], 2, &options).is_err());
        let nan = vec![f64::NAN, 0.0, 0.0, 1.0];
        assert!(Gptq::new(nan, 2, &options).is_err());
        let identity = Gptq::new(vec![1.0, 0.0, 0.0, 1.0], 2, &options).unwrap();
        assert!(identity.round(&[1.0; 3], 2).is_err());
        assert!(identity.round(&[1.0, f32::NAN, 0.0, 0.0], 2).is_err());
        // Not positive definite even when dampened.
        let indefinite = vec![1.0, 10.0, 10.0, 1.0];
        let e = Gptq::new(indefinite, 2, &options).unwrap_err();
        assert!(e.to_string().contains("dampening"), "{e}");
    }
}
