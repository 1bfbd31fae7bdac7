//! The u8 × i8 → i32 GEMM of the INT8 engine, on weights prepacked once.
//!
//! Layout: the weight matrix `W [n, k]` is cut into panels of [`PANEL`] output
//! channels; within a panel, each group of four consecutive inputs holds the
//! panel's 64 channels × 4 bytes, channel-major (256 bytes, four cache lines).
//! That is the operand shape of AVX-512 VNNI's `vpdpbusd`, which multiplies
//! four u8 × i8 pairs per 32-bit lane and adds them into the lane: one
//! broadcast of four activation bytes against one 64-byte line advances 16
//! channels by four inputs. `n` is padded to whole panels and `k` to whole
//! groups with zero weights, so every kernel runs full tiles and padded
//! inputs contribute nothing whatever their bytes.
//!
//! Activations are symmetric int8 stored as `q + 128` in a u8 (the operand
//! VNNI takes). The portable and VNNI tiers multiply the stored bytes and
//! the epilogue removes the offset with each channel's precomputed
//! `128 · Σ w`, exact in i32; the AVX2 tier recovers `q` itself (see
//! [`PackedWeights::offsets`]).
//!
//! Tiers: AVX-512 VNNI (`vpdpbusd`), AVX2 (`vpmaddubsw` + `vpmaddwd` on
//! `|q|` and the weights carrying `q`'s sign, so that no pair of products
//! saturates i16) and a portable scalar twin. Every tier takes full 8-bit
//! weights ([`WEIGHT_QMAX`]) and computes the exact integer sums, so tests
//! compare them for equality and an artifact runs the same on every tier.
//!
//! Why our own kernel instead of `rten-gemm` (the first choice when the
//! engine was designed): on this machine's VNNI CPU rten's prepacked GEMM ran
//! SmolLM2's layers at 0.25–0.6× ONNX Runtime's `MatMulInteger` and its GEMV
//! read weights at 67 % of one thread's bandwidth (BENCHMARKS.md keeps the before and after).

use std::ops::Range;

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Output channels per packed panel.
pub const PANEL: usize = 64;

/// Inputs per group (the bytes one `vpdpbusd` lane sums).
const GROUP: usize = 4;

/// Bytes of one group of a panel.
const GROUP_BYTES: usize = PANEL * GROUP;

/// Largest weight magnitude: int8 weights are symmetric in ±127 on every tier.
pub const WEIGHT_QMAX: i8 = 127;

/// Largest `k` whose sums cannot overflow i32: `k · 255 · 127 < 2³¹`.
pub const MAX_INPUTS: usize = (i32::MAX as usize) / (255 * 127);

/// A GEMM goes parallel only when one thread would need at least this long:
/// handing half of it to rayon's pool from a thread outside the pool cost
/// ≈ 15 µs here (`cargo bench -p qforge-kernels --bench gemm` with
/// `RAYON_NUM_THREADS=1` vs 2: SmolLM2's q_proj at M = 16 ran at 481 G MAC/s
/// on one thread and 259 on two; gate_proj at M = 16, ≈ 40 µs, broke even).
const PARALLEL_MIN_MICROS: f64 = 30.0;

/// One thread's rates behind that estimate, measured by the same benchmark:
/// ≈ 470 G MAC/s once the weights are in cache, and weight bytes streamed at
/// ≈ 100 GB/s from L2/L3 (a GEMV on cached weights).
const MACS_PER_MICRO: f64 = 470e3;
const WEIGHT_BYTES_PER_MICRO: f64 = 100e3;

/// Up to this many rows, threads split the inputs (`k`) of a matrix with few
/// panels rather than its channels: every thread then reads an equal share of
/// every panel, where a split by panels leaves one thread a panel more
/// (SmolLM2's 576 channels are 9 panels), at a cost of one partial-sum buffer
/// per extra thread.
const SPLIT_INPUTS_MAX_ROWS: usize = 16;

/// With at least this many panels per thread, a split by panels is even
/// enough and wins: each thread streams one contiguous range (SmolLM2's
/// lm_head at M = 1: 114–119 G MAC/s split by panels, 99–102 by inputs).
pub const SPLIT_CHANNELS_MIN_PANELS_PER_THREAD: usize = 16;

/// A CPU tier of the GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTier {
    /// Plain Rust loops, every target: the scalar twin.
    Portable,
    /// AVX2 `vpmaddubsw` on signed activations (x86-64).
    Avx2,
    /// AVX-512 VNNI `vpdpbusd` (x86-64).
    Avx512Vnni,
}

impl GemmTier {
    /// Every tier, slowest first.
    pub const ALL: [GemmTier; 3] = [Self::Portable, Self::Avx2, Self::Avx512Vnni];

    /// The fastest tier this CPU supports.
    pub fn detect() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|t| t.is_supported())
            .unwrap_or(Self::Portable)
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        let cpu = qforge_core::CpuFeatures::get();
        match self {
            Self::Portable => true,
            Self::Avx2 => cpu.avx2,
            Self::Avx512Vnni => cpu.avx512f && cpu.avx512bw && cpu.avx512vnni,
        }
    }

    /// Rows of the tier's register tile.
    fn rows_per_tile(self) -> usize {
        match self {
            Self::Avx512Vnni => 6,
            Self::Avx2 => 2,
            Self::Portable => 4,
        }
    }

    /// A short name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// One group of a panel, aligned to a cache line pair so that no load of a
/// 64-byte vector splits a line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Group([i8; GROUP_BYTES]);

/// `W [n, k]` packed for one tier (see the module docs for the layout).
pub struct PackedWeights {
    tier: GemmTier,
    groups: Vec<Group>,
    /// Per channel, what the epilogue subtracts from the raw sums (see
    /// [`PackedWeights::offsets`]).
    offsets: Vec<i32>,
    n: usize,
    k: usize,
}

impl std::fmt::Debug for PackedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeights")
            .field("tier", &self.tier)
            .field("n", &self.n)
            .field("k", &self.k)
            .finish_non_exhaustive()
    }
}

impl PackedWeights {
    /// Packs `values` (`[n, k]` row-major) for `tier`. Errors if the tier is
    /// missing, a value exceeds ±[`WEIGHT_QMAX`] (−128 has no symmetric
    /// twin), or `k` exceeds [`MAX_INPUTS`].
    pub fn new(tier: GemmTier, values: &[i8], n: usize, k: usize) -> Result<Self> {
        if !tier.is_supported() {
            return Err(Error::UnsupportedTier(tier.name().into()));
        }
        if n == 0 || k == 0 || values.len() != n * k {
            return Err(Error::Shape(format!(
                "{} weights for a [{n}, {k}] matrix",
                values.len()
            )));
        }
        if k > MAX_INPUTS {
            return Err(Error::Shape(format!(
                "{k} inputs per channel: sums of more than {MAX_INPUTS} could overflow i32"
            )));
        }
        if let Some(v) = values.iter().find(|v| **v < -WEIGHT_QMAX) {
            return Err(Error::Shape(format!(
                "weight {v} exceeds ±{WEIGHT_QMAX}: int8 weights are symmetric"
            )));
        }
        let panels = n.div_ceil(PANEL);
        let groups_per_panel = k.div_ceil(GROUP);
        let mut groups = vec![Group([0; GROUP_BYTES]); panels * groups_per_panel];
        for (c, row) in values.chunks_exact(k).enumerate() {
            let (panel, lane) = (c / PANEL, c % PANEL);
            let panel_groups = &mut groups[panel * groups_per_panel..][..groups_per_panel];
            for (group, four) in panel_groups.iter_mut().zip(row.chunks(GROUP)) {
                group.0[lane * GROUP..lane * GROUP + four.len()].copy_from_slice(four);
            }
        }
        let offsets = values
            .chunks_exact(k)
            .map(|row| match tier {
                GemmTier::Avx2 => 0,
                GemmTier::Portable | GemmTier::Avx512Vnni => {
                    128 * row.iter().map(|&v| i32::from(v)).sum::<i32>()
                }
            })
            .collect();
        Ok(Self {
            tier,
            groups,
            offsets,
            n,
            k,
        })
    }

    /// The tier these weights are packed for.
    pub fn tier(&self) -> GemmTier {
        self.tier
    }

    /// `(n, k)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Whole panels (`n` rounded up to [`PANEL`], divided by it).
    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes per activation row the kernels read: `k` rounded up to a group.
    pub fn row_stride(&self) -> usize {
        self.groups_per_panel() * GROUP
    }

    fn groups_per_panel(&self) -> usize {
        self.k.div_ceil(GROUP)
    }

    /// Raw sums of `rows` rows of `a` (row stride [`Self::row_stride`]) into
    /// `sums`, laid out `[part][panel][row][PANEL]`, on the current rayon
    /// pool's threads when the work is worth splitting. Returns the number of
    /// parts, whose sums add up to the result.
    pub fn sums(&self, a: &[u8], rows: usize, sums: &mut Vec<i32>) -> usize {
        let panels = self.panels();
        let groups = self.groups_per_panel();
        let part_len = panels * rows * PANEL;
        let threads = rayon::current_num_threads();
        let weights = (self.n * self.k) as f64;
        let one_thread_micros =
            rows as f64 * weights / MACS_PER_MICRO + weights / WEIGHT_BYTES_PER_MICRO;
        if threads == 1 || one_thread_micros < PARALLEL_MIN_MICROS {
            sums.resize(part_len, 0);
            self.raw_sums(a, rows, 0..panels, 0..groups, sums);
            return 1;
        }
        if rows <= SPLIT_INPUTS_MAX_ROWS && panels < SPLIT_CHANNELS_MIN_PANELS_PER_THREAD * threads
        {
            let parts = threads.min(groups);
            sums.resize(parts * part_len, 0);
            sums.par_chunks_mut(part_len)
                .enumerate()
                .for_each(|(part, c)| {
                    self.raw_sums(a, rows, 0..panels, share(groups, parts, part), c);
                });
            parts
        } else {
            let per_part = panels.div_ceil(threads);
            sums.resize(part_len, 0);
            sums.par_chunks_mut(per_part * rows * PANEL)
                .enumerate()
                .for_each(|(part, c)| {
                    let first = part * per_part;
                    self.raw_sums(
                        a,
                        rows,
                        first..first + c.len() / (rows * PANEL),
                        0..groups,
                        c,
                    );
                });
            1
        }
    }

    /// Raw sums of `rows` rows of `a` (row stride [`Self::row_stride`]) over
    /// the panels `panels` and input groups `groups`, into `c` laid out
    /// `[panel][row][PANEL]` for those panels: `Σₖ a[r, k] · w[c, k]` with the
    /// activations as stored, or, on AVX2, `Σₖ (a[r, k] − 128) · w[c, k]`.
    /// On every tier, the raw sums of all input groups less
    /// [`Self::offsets`] are the signed sums `Σₖ q[r, k] · w[c, k]`.
    pub fn raw_sums(
        &self,
        a: &[u8],
        rows: usize,
        panels: Range<usize>,
        groups: Range<usize>,
        c: &mut [i32],
    ) {
        let lda = self.row_stride();
        let gpp = self.groups_per_panel();
        assert!(
            a.len() >= rows * lda
                && panels.end <= self.panels()
                && groups.end <= gpp
                && c.len() == panels.len() * rows * PANEL,
            "raw_sums: operands do not fit the packed weights"
        );
        let mr = self.tier.rows_per_tile();
        for (panel, c_panel) in panels.zip(c.chunks_exact_mut(rows * PANEL)) {
            let b = &self.groups[panel * gpp + groups.start..panel * gpp + groups.end];
            let mut row = 0;
            while row < rows {
                let tile_rows = mr.min(rows - row);
                let a_tile = &a[row * lda + groups.start * GROUP..];
                let c_tile = &mut c_panel[row * PANEL..(row + tile_rows) * PANEL];
                // SAFETY: `a_tile` holds `tile_rows` rows of `lda` bytes from
                // the first group (checked above), `b` the panel's groups and
                // `c_tile` the tile; the tier was checked when packing.
                unsafe { tile(self.tier, a_tile, lda, tile_rows, b, c_tile) };
                row += tile_rows;
            }
        }
    }

    /// What the epilogue subtracts from each channel's raw sums (length `n`):
    /// `128 · Σ w` where the kernel multiplied the stored `q + 128` bytes,
    /// zero on AVX2, whose kernel multiplies `q` itself.
    pub fn offsets(&self) -> &[i32] {
        &self.offsets
    }
}

/// The `part`-th of `parts` near-equal shares of `0..len`.
pub fn share(len: usize, parts: usize, part: usize) -> Range<usize> {
    len * part / parts..len * (part + 1) / parts
}

/// One register tile: `c[r][j] = Σ_g Σ_t a[r·lda + 4g + t] · b[g][4j + t]`.
///
/// # Safety
/// `a` must hold `rows` rows of `lda` bytes covering `4 · b.len()` bytes each,
/// `c` `rows · PANEL` values, and the tier must be supported.
unsafe fn tile(tier: GemmTier, a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
    debug_assert!(c.len() == rows * PANEL && a.len() >= (rows - 1) * lda + b.len() * GROUP);
    match tier {
        GemmTier::Portable => tile_portable(a, lda, rows, b, c),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from the caller.
        GemmTier::Avx2 => unsafe { x86::tile_avx2(a, lda, rows, b, c) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from the caller.
        GemmTier::Avx512Vnni => unsafe { x86::tile_vnni(a, lda, rows, b, c) },
        #[cfg(not(target_arch = "x86_64"))]
        GemmTier::Avx2 | GemmTier::Avx512Vnni => unreachable!("packing checked the tier"),
    }
}

/// The scalar twin: the definition every tier must equal.
fn tile_portable(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
    for (r, out) in c.chunks_exact_mut(PANEL).enumerate().take(rows) {
        let mut acc = [0i32; PANEL];
        for (g, group) in b.iter().enumerate() {
            let a4 = &a[r * lda + g * GROUP..r * lda + (g + 1) * GROUP];
            for (lane, w4) in acc.iter_mut().zip(group.0.chunks_exact(GROUP)) {
                *lane += a4
                    .iter()
                    .zip(w4)
                    .map(|(&x, &w)| i32::from(x) * i32::from(w))
                    .sum::<i32>();
            }
        }
        out.copy_from_slice(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, Group, PANEL};

    /// Four activation bytes of row `r`, group `g`, broadcast to every lane.
    #[inline(always)]
    unsafe fn broadcast4(a: *const u8, offset: usize) -> i32 {
        // SAFETY: the caller keeps `offset + 4` within the row.
        unsafe { a.add(offset).cast::<i32>().read_unaligned() }
    }

    /// Register tile of `R` rows × 64 channels: 4·R accumulators.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile_vnni_rows<const R: usize>(a: *const u8, lda: usize, b: &[Group], c: *mut i32) {
        let mut acc = [[_mm512_setzero_si512(); 4]; R];
        for (g, group) in b.iter().enumerate() {
            let w = group.0.as_ptr().cast::<__m512i>();
            // SAFETY: a group is 256 bytes, 64-byte aligned.
            let w = unsafe {
                [
                    _mm512_load_si512(w),
                    _mm512_load_si512(w.add(1)),
                    _mm512_load_si512(w.add(2)),
                    _mm512_load_si512(w.add(3)),
                ]
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `r`, group `g` lies within the caller's rows.
                let x = _mm512_set1_epi32(unsafe { broadcast4(a, r * lda + g * GROUP) });
                for (acc, &w) in acc.iter_mut().zip(&w) {
                    *acc = _mm512_dpbusd_epi32(*acc, x, w);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, &v) in acc.iter().enumerate() {
                // SAFETY: `c` holds R rows of 64 values.
                unsafe { _mm512_storeu_si512(c.add(r * PANEL + 16 * j).cast(), v) };
            }
        }
    }

    /// # Safety
    /// See [`super::tile`]; the CPU must have AVX-512 F, BW and VNNI.
    pub(super) unsafe fn tile_vnni(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
        let (a, c) = (a.as_ptr(), c.as_mut_ptr());
        // SAFETY: forwarded from the caller.
        unsafe {
            match rows {
                1 => tile_vnni_rows::<1>(a, lda, b, c),
                2 => tile_vnni_rows::<2>(a, lda, b, c),
                3 => tile_vnni_rows::<3>(a, lda, b, c),
                4 => tile_vnni_rows::<4>(a, lda, b, c),
                5 => tile_vnni_rows::<5>(a, lda, b, c),
                6 => tile_vnni_rows::<6>(a, lda, b, c),
                _ => unreachable!("the VNNI tile has at most 6 rows"),
            }
        }
    }

    /// Register tile of `R` rows × `16 L` channels (`L` lines of each group), on
    /// the signed activations `q = a ^ 0x80`: `vpmaddubsw` multiplies `|q|`
    /// (unsigned) by the weights given `q`'s sign (`vpsignb`, which also
    /// zeroes them where `q` is 0), so each i16 pair sum is at most
    /// 2 · 128 · 127 = 32 512 and never saturates (the trick of ggml's AVX2
    /// dot products; multiplying the stored `q + 128` would need 7-bit
    /// weights). `vpmaddwd` by 1 widens the pairs to i32.
    #[target_feature(enable = "avx2")]
    unsafe fn tile_avx2_rows<const R: usize, const L: usize>(
        a: *const u8,
        lda: usize,
        b: &[Group],
        first_line: usize,
        c: *mut i32,
    ) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(i8::MIN);
        let mut acc = [[[_mm256_setzero_si256(); 2]; L]; R];
        for (g, group) in b.iter().enumerate() {
            let w = group.0[first_line * 64..].as_ptr().cast::<__m256i>();
            // SAFETY: L 64-byte lines of the group from `first_line`.
            let w: [[__m256i; 2]; L] = std::array::from_fn(|l| unsafe {
                [
                    _mm256_load_si256(w.add(2 * l)),
                    _mm256_load_si256(w.add(2 * l + 1)),
                ]
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `r`, group `g` lies within the caller's rows.
                let stored = _mm256_set1_epi32(unsafe { broadcast4(a, r * lda + g * GROUP) });
                let q = _mm256_xor_si256(stored, flip);
                let magnitude = _mm256_sign_epi8(q, q);
                for (acc, w) in acc.iter_mut().zip(&w) {
                    for (acc, &w) in acc.iter_mut().zip(w) {
                        let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w, q));
                        *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (l, acc) in acc.iter().enumerate() {
                for (j, &v) in acc.iter().enumerate() {
                    let at = r * PANEL + 16 * (first_line + l) + 8 * j;
                    // SAFETY: `c` holds R rows of 64 values.
                    unsafe { _mm256_storeu_si256(c.add(at).cast(), v) };
                }
            }
        }
    }

    /// # Safety
    /// See [`super::tile`]; the CPU must have AVX2.
    pub(super) unsafe fn tile_avx2(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
        let (a, c) = (a.as_ptr(), c.as_mut_ptr());
        // The activations' preparation (broadcast, sign, magnitude) is shared
        // by every line a call covers: a lone row covers the whole panel
        // (8 accumulators), two rows half of it at a time (8 as well); 16
        // would spill. SmolLM2 int8-dynamic decoding (M = 1, 3 rounds on
        // this 2-core AVX2 machine): 35–44 tok/s with one line per call,
        // 50–62 with the whole panel (BENCHMARKS.md).
        // SAFETY: forwarded from the caller.
        unsafe {
            match rows {
                1 => tile_avx2_rows::<1, 4>(a, lda, b, 0, c),
                2 => {
                    tile_avx2_rows::<2, 2>(a, lda, b, 0, c);
                    tile_avx2_rows::<2, 2>(a, lda, b, 2, c);
                }
                _ => unreachable!("the AVX2 tile has at most 2 rows"),
            }
        }
    }
}
