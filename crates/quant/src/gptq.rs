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

use qforge_core::{CpuTier, VectorTier};
use qforge_kernels::WEIGHT_QMAX;
use qforge_model::Int8Weight;
use rayon::prelude::*;

use crate::error::{Error, Result};
use solve::inverse_factor;

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
    /// The vector unit the solver's f64 loops run on. Every tier runs the
    /// same operations in the same order (Rust never fuses a multiply and an
    /// add on its own), so all give the same bits; the wider ones do more
    /// lanes at once.
    tier: VectorTier,
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
        fn $name(tier: VectorTier, $($arg: $ty),*) -> $ret {
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
                // SAFETY: a `VectorTier` in use is one the CPU supports
                // (`VectorTier::detect`, or the tests' supported tiers).
                VectorTier::Avx2 => unsafe { avx2($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                VectorTier::Avx512 => unsafe { avx512($($arg),*) },
                _ => $body::<$($base)*>($($arg),*),
            }
        }
    };
}

// Declared after `tiered!`: the solve's tiers are stamped by it.
mod solve;

impl Gptq {
    /// Prepares GPTQ for layers whose input has the Hessian `hessian`
    /// (`inputs × inputs`, row-major, symmetric).
    pub fn new(hessian: Vec<f64>, inputs: usize, options: &GptqOptions) -> Result<Self> {
        Self::new_on(VectorTier::detect(), hessian, inputs, options)
    }

    fn new_on(
        tier: VectorTier,
        hessian: Vec<f64>,
        inputs: usize,
        options: &GptqOptions,
    ) -> Result<Self> {
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

#[cfg(test)]
mod tests {
    use super::solve::SOLVE_BLOCK;
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
    pub(super) fn correlated_inputs(rows: usize, n: usize, seed: u64) -> (Vec<f64>, Vec<f64>) {
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
        let baseline = on(VectorTier::Portable);
        for &tier in VectorTier::ALL.iter().filter(|t| t.is_supported()) {
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
