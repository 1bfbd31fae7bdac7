//! The normalized Walsh–Hadamard rotation `Q = (H_m ⊗ H_{2^k}) / √n`, applied
//! to rows of activations (online, before a linear layer) and of weights
//! (offline, once): `x Wᵀ = (x Q)(W Q)ᵀ` because `Q` is orthogonal. A rotation
//! spreads an outlier channel's energy over all `n` channels, so a per-token
//! int8 scale no longer has to span one huge value (QuaRot, Ashkboos et al.
//! 2024; SpinQuant, Liu et al. 2024).
//!
//! Sizes are `n = m · 2^k` with `m` ∈ {1, 12, 20, 28, 36}: powers of two use
//! the Sylvester construction alone (a fast transform in `n log n`
//! additions); the others add one Paley Hadamard matrix of order 12, 20, 28
//! or 36, applied across the `m` blocks of `2^k` (SmolLM2's width 576 =
//! 36 · 16 and MLP width 1536 = 12 · 128, Llama-3-8B's 14336 = 28 · 512).
//!
//! Tiers: one body compiled for AVX-512, for AVX2 and for the baseline. The
//! transform only adds, subtracts and finally scales, in the same order on
//! every tier, so all tiers give the same bits (tested).

use std::cell::RefCell;

use qforge_core::{CpuTier, VectorTier};

use crate::error::{Error, Result};

thread_local! {
    // The blocks' mixed sums of one row, reused across calls.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Orders of the non-power-of-two factor this module can build.
pub const SMALL_ORDERS: [usize; 5] = [1, 12, 20, 28, 36];

/// The rotation of rows of `n` values.
#[derive(Debug, Clone, PartialEq)]
pub struct Hadamard {
    n: usize,
    /// Length of each Sylvester block, `2^k`.
    block: usize,
    /// The small factor `H_m`, row-major ±1 (empty when `m` = 1).
    small: Vec<f32>,
    /// `1 / √n`.
    norm: f32,
}

impl Hadamard {
    /// The rotation of size `n`; an error names the sizes that exist.
    pub fn new(n: usize) -> Result<Self> {
        let (m, block) = SMALL_ORDERS
            .iter()
            .rev()
            .find_map(|&m| {
                (n >= m && n.is_multiple_of(m) && (n / m).is_power_of_two()).then_some((m, n / m))
            })
            .ok_or_else(|| {
                Error::Shape(format!(
                    "no Hadamard rotation of size {n}: sizes are m · 2^k with m in {SMALL_ORDERS:?}"
                ))
            })?;
        Ok(Self {
            n,
            block,
            small: if m == 1 { Vec::new() } else { paley(m) },
            norm: 1.0 / (n as f32).sqrt(),
        })
    }

    /// Whether a rotation of size `n` exists.
    pub fn supports(n: usize) -> bool {
        Self::new(n).is_ok()
    }

    /// The size it rotates.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether it rotates nothing (never: sizes start at 1).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The unnormalized matrix `H` (row-major, every entry ±1) with
    /// [`Hadamard::rotate`]`(x) = x H / √n`: row `i` holds the signs of the
    /// rotated `eᵢ`. Formats that store a rotation as a matrix (Hugging Face
    /// compressed-tensors' transforms) carry it so; its ±1 entries are exact
    /// in any float width, bf16 included.
    pub fn signs(&self) -> Vec<f32> {
        let n = self.n;
        let mut rows = vec![0f32; n * n];
        for i in 0..n {
            rows[i * n + i] = 1.0;
        }
        self.rotate_with(VectorTier::Portable, &mut rows)
            .expect("n × n values are n rows, and the portable tier runs anywhere");
        // Entries are ±1/√n (a Hadamard matrix, normalized): never zero.
        rows.iter_mut().for_each(|v| *v = v.signum());
        rows
    }

    /// Rotates every row of `rows` (rows of [`Hadamard::len`] values) in
    /// place, on the fastest tier.
    pub fn rotate(&self, rows: &mut [f32]) -> Result<()> {
        self.rotate_with(VectorTier::detect(), rows)
    }

    /// [`Hadamard::rotate`] on a chosen tier; errors if the CPU lacks it.
    pub fn rotate_with(&self, tier: VectorTier, rows: &mut [f32]) -> Result<()> {
        if !rows.len().is_multiple_of(self.n) {
            return Err(Error::Shape(format!(
                "{} values are not rows of {}",
                rows.len(),
                self.n
            )));
        }
        if !tier.is_supported() {
            return Err(Error::UnsupportedTier(format!("{tier:?}")));
        }
        SCRATCH.with_borrow_mut(|scratch| self.rotate_rows(tier, rows, scratch));
        Ok(())
    }

    fn rotate_rows(&self, tier: VectorTier, rows: &mut [f32], scratch: &mut Vec<f32>) {
        // Grown once per thread to the widest rotation, so that a decode step
        // does not allocate.
        let width = self.small.len().min(1) * self.n;
        if scratch.len() < width {
            scratch.resize(width, 0.0);
        }
        let scratch = &mut scratch[..width];
        for row in rows.chunks_exact_mut(self.n) {
            match tier {
                VectorTier::Portable => self.row(row, scratch),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the tier's features were checked above.
                VectorTier::Avx2 => unsafe { self.row_avx2(row, scratch) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                VectorTier::Avx512 => unsafe { self.row_avx512(row, scratch) },
                #[cfg(not(target_arch = "x86_64"))]
                VectorTier::Avx2 | VectorTier::Avx512 => unreachable!("checked above"),
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn row_avx2(&self, row: &mut [f32], scratch: &mut [f32]) {
        self.row(row, scratch)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn row_avx512(&self, row: &mut [f32], scratch: &mut [f32]) {
        self.row(row, scratch)
    }

    /// One row: Sylvester butterflies within each block, the small factor
    /// across blocks, then the normalization. Inlined into each tier's
    /// wrapper so that the loops vectorize for its instruction set.
    #[inline(always)]
    fn row(&self, row: &mut [f32], scratch: &mut [f32]) {
        for block in row.chunks_exact_mut(self.block) {
            sylvester(block);
        }
        if !self.small.is_empty() {
            let (m, b) = (self.n / self.block, self.block);
            scratch.fill(0.0);
            for (i, out) in scratch.chunks_exact_mut(b).enumerate() {
                for (j, input) in row.chunks_exact(b).enumerate() {
                    if self.small[i * m + j] > 0.0 {
                        out.iter_mut().zip(input).for_each(|(o, &x)| *o += x);
                    } else {
                        out.iter_mut().zip(input).for_each(|(o, &x)| *o -= x);
                    }
                }
            }
            row.copy_from_slice(scratch);
        }
        let norm = self.norm;
        row.iter_mut().for_each(|v| *v *= norm);
    }
}

/// The in-place unnormalized fast Walsh–Hadamard transform (Sylvester order)
/// of a power-of-two-long slice.
#[inline(always)]
fn sylvester(x: &mut [f32]) {
    let mut h = 1;
    while h < x.len() {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                *u = s;
                *v = d;
            }
        }
        h *= 2;
    }
}

/// Whether `a` is a nonzero square modulo the prime `q`.
fn is_residue(a: usize, q: usize) -> bool {
    (1..q).any(|x| (x * x) % q == a % q)
}

/// Legendre symbol χ(a) modulo the prime `q`: 0, 1 or −1.
fn chi(a: usize, q: usize) -> i32 {
    match a % q {
        0 => 0,
        r if is_residue(r, q) => 1,
        _ => -1,
    }
}

/// A Hadamard matrix of order 12, 20 (Paley I, q = 11, 19: q ≡ 3 mod 4), 28
/// or 36 (Paley II, q = 13, 17: q ≡ 1 mod 4), row-major ±1.
fn paley(m: usize) -> Vec<f32> {
    // The Jacobsthal matrix bordered by ones: C[0][j] = 1, C[i][0] = ±1,
    // C[i][j] = χ(i − j) for i, j ≥ 1.
    let conference = |q: usize, antisymmetric: bool| -> Vec<i32> {
        let n = q + 1;
        let mut c = vec![0i32; n * n];
        for i in 0..n {
            for j in 0..n {
                c[i * n + j] = match (i, j) {
                    (0, 0) => 0,
                    (0, _) => 1,
                    (_, 0) if antisymmetric => -1,
                    (_, 0) => 1,
                    _ => chi(i + q - j, q),
                };
            }
        }
        c
    };
    let h: Vec<i32> = match m {
        12 | 20 => {
            // Paley I: H = I + C with C antisymmetric.
            let c = conference(m - 1, true);
            (0..m * m)
                .map(|k| c[k] + i32::from(k / m == k % m))
                .collect()
        }
        28 | 36 => {
            // Paley II: each entry of the symmetric C becomes a 2×2 block,
            // 0 → [[1, −1], [−1, −1]], ±1 → ±[[1, 1], [1, −1]].
            let q = m / 2 - 1;
            let c = conference(q, false);
            let n = q + 1;
            let mut h = vec![0i32; m * m];
            for i in 0..n {
                for j in 0..n {
                    let block = match c[i * n + j] {
                        0 => [1, -1, -1, -1],
                        s => [s, s, s, -s],
                    };
                    for (k, v) in block.into_iter().enumerate() {
                        h[(2 * i + k / 2) * m + 2 * j + k % 2] = v;
                    }
                }
            }
            h
        }
        _ => unreachable!("Hadamard::new only asks for orders in SMALL_ORDERS"),
    };
    h.into_iter().map(|v| v as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation as a dense matrix: row i is the rotation of eᵢ.
    fn dense(h: &Hadamard) -> Vec<f64> {
        let n = h.len();
        let mut m = vec![0f32; n * n];
        for i in 0..n {
            m[i * n + i] = 1.0;
        }
        h.rotate_with(VectorTier::Portable, &mut m).unwrap();
        m.into_iter().map(f64::from).collect()
    }

    #[test]
    fn every_size_is_orthogonal() {
        for n in [1, 2, 8, 12, 24, 20, 28, 36, 56, 64, 576, 1536] {
            let h = Hadamard::new(n).unwrap();
            let q = dense(&h);
            // Every pair of rows up to 576 wide; beyond, every row against 16
            // spread over the matrix (all pairs of 1 536 rows take a minute
            // under qemu-aarch64).
            let rows: Vec<usize> = if n <= 576 {
                (0..n).collect()
            } else {
                (0..n).step_by(n / 16).collect()
            };
            for &i in &rows {
                for j in 0..n {
                    let dot: f64 = (0..n).map(|k| q[i * n + k] * q[j * n + k]).sum();
                    let expected = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - expected).abs() < 1e-5, "n {n}: ({i}, {j}) = {dot}");
                }
            }
            // A Hadamard matrix: every entry ±1/√n.
            let norm = 1.0 / (n as f64).sqrt();
            assert!(q.iter().all(|v| (v.abs() - norm).abs() < 1e-6), "n {n}");
        }
    }

    #[test]
    fn the_sign_matrix_over_root_n_is_the_rotation() {
        for n in [1, 12, 64, 576] {
            let h = Hadamard::new(n).unwrap();
            let signs = h.signs();
            assert!(signs.iter().all(|v| v.abs() == 1.0), "n {n}");
            let q = dense(&h);
            let norm = 1.0 / (n as f64).sqrt();
            for (s, v) in signs.iter().zip(&q) {
                assert!((f64::from(*s) * norm - v).abs() < 1e-6, "n {n}");
            }
        }
        // Paley's factor is not symmetric, so the orientation matters:
        // row i is eᵢ rotated, not column i.
        let signs = Hadamard::new(12).unwrap().signs();
        assert!((0..12).any(|i| (0..12).any(|j| signs[i * 12 + j] != signs[j * 12 + i])));
    }

    #[test]
    fn sizes_without_a_construction_are_refused() {
        for n in [0, 3, 6, 44, 1000] {
            let err = Hadamard::new(n).unwrap_err().to_string();
            assert!(err.contains("no Hadamard rotation"), "{n}: {err}");
        }
        assert!(Hadamard::supports(14336) && Hadamard::supports(8192));
    }

    #[test]
    fn an_outlier_is_spread_over_every_channel() {
        let n = 1536;
        let mut x = vec![0.01f32; n];
        x[7] = 3000.0;
        Hadamard::new(n).unwrap().rotate(&mut x).unwrap();
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max < 3000.0 / (n as f32).sqrt() + 1.0, "{max}");
    }

    #[test]
    fn rotating_rows_and_weights_keeps_the_product() {
        let (n, rows) = (48, 3);
        let h = Hadamard::new(n).unwrap();
        let x: Vec<f32> = (0..rows * n)
            .map(|i| ((i * 37 % 11) as f32) - 5.0)
            .collect();
        let w: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32) * 0.25 - 0.7).collect();
        let (mut xr, mut wr) = (x.clone(), w.clone());
        h.rotate(&mut xr).unwrap();
        h.rotate(&mut wr).unwrap();
        for r in 0..rows {
            let before: f32 = x[r * n..][..n].iter().zip(&w).map(|(a, b)| a * b).sum();
            let after: f32 = xr[r * n..][..n].iter().zip(&wr).map(|(a, b)| a * b).sum();
            assert!(
                (before - after).abs() < 1e-3 * before.abs().max(1.0),
                "{before} {after}"
            );
        }
    }

    #[test]
    fn every_tier_gives_the_same_bits() {
        let h = Hadamard::new(1536).unwrap();
        let x: Vec<f32> = (0..2 * 1536)
            .map(|i| ((i as f32) * 0.37).sin() * 10.0)
            .collect();
        let mut reference = x.clone();
        h.rotate_with(VectorTier::Portable, &mut reference).unwrap();
        for &tier in VectorTier::ALL.iter().filter(|t| t.is_supported()) {
            let mut y = x.clone();
            h.rotate_with(tier, &mut y).unwrap();
            let same = y
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{tier:?} differs from the portable tier");
        }
    }
}
