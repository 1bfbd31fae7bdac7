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
//! `128 · Σ w`, exact in i32; the AVX2 and Arm tiers recover `q` itself (see
//! [`PackedWeights::offsets`]).
//!
//! Tiers: AVX-512 VNNI (`vpdpbusd`), AVX2 (`vpmaddubsw` + `vpmaddwd` on
//! `|q|` and the weights carrying `q`'s sign, so that no pair of products
//! saturates i16), on aarch64 base NEON (`smull` + pairwise adds), the
//! dot-product extension (`sdot`, the VNNI operand shape on signed bytes) and
//! the int8 matrix-multiply extension (`smmla`, whose 2 × 8 by 8 × 2 operand
//! wants eight inputs per channel: that tier packs groups in pairs, see
//! [`GemmTier::groups_per_step`]), and a portable scalar twin. Every tier
//! takes full 8-bit weights ([`WEIGHT_QMAX`]) and computes the exact integer
//! sums, so tests compare them for equality and an artifact runs the same on
//! every tier.
//!
//! Why our own kernel instead of `rten-gemm` (the first choice when the
//! engine was designed): on this machine's VNNI CPU rten's prepacked GEMM ran
//! SmolLM2's layers at 0.25–0.6× ONNX Runtime's `MatMulInteger` and its GEMV
//! read weights at 67 % of one thread's bandwidth (BENCHMARKS.md keeps the before and after).

use std::ops::Range;

use qforge_core::CpuTier;
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
    /// Base NEON, `smull` and pairwise adds (every aarch64 CPU).
    Neon,
    /// NEON with the dot-product extension, `sdot` (aarch64, Armv8.2+).
    NeonDotprod,
    /// NEON with the int8 matrix-multiply extension, `smmla` (aarch64, Armv8.6+).
    NeonI8mm,
}

impl CpuTier for GemmTier {
    const ALL: &'static [Self] = &[
        Self::Portable,
        Self::Avx2,
        Self::Avx512Vnni,
        Self::Neon,
        Self::NeonDotprod,
        Self::NeonI8mm,
    ];

    fn is_supported(self) -> bool {
        let cpu = qforge_core::CpuFeatures::get();
        match self {
            Self::Portable => true,
            Self::Avx2 => cpu.avx2,
            Self::Avx512Vnni => cpu.avx512f && cpu.avx512bw && cpu.avx512vnni,
            Self::Neon => cpu.neon,
            Self::NeonDotprod => cpu.neon && cpu.dotprod,
            Self::NeonI8mm => cpu.neon && cpu.i8mm,
        }
    }
}

impl GemmTier {
    /// Rows of the tier's register tile.
    fn rows_per_tile(self) -> usize {
        match self {
            Self::Avx512Vnni => 6,
            Self::Avx2 => 2,
            Self::Portable | Self::Neon | Self::NeonDotprod | Self::NeonI8mm => 4,
        }
    }

    /// Input groups the tier's kernel consumes at once: `smmla` takes eight
    /// inputs per channel, so the i8mm tier packs each pair of groups as one
    /// 64-channel × 8-input block (channel-major, 512 bytes) and its input
    /// ranges start and end on even groups.
    pub fn groups_per_step(self) -> usize {
        match self {
            Self::NeonI8mm => 2,
            _ => 1,
        }
    }

    /// Whether the kernel multiplies the signed activations `q` (recovered
    /// from the stored `q + 128`) rather than the stored bytes.
    fn multiplies_signed_activations(self) -> bool {
        match self {
            Self::Portable | Self::Avx512Vnni => false,
            Self::Avx2 | Self::Neon | Self::NeonDotprod | Self::NeonI8mm => true,
        }
    }

    /// A short name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Neon => "neon",
            Self::NeonDotprod => "neon-dotprod",
            Self::NeonI8mm => "neon-i8mm",
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
        let step = tier.groups_per_step();
        let groups_per_panel = k.div_ceil(GROUP * step) * step;
        let mut groups = vec![Group([0; GROUP_BYTES]); panels * groups_per_panel];
        // A step's `span` inputs of one channel are consecutive bytes, its
        // channels one after another (for one group per step, the layout of
        // the module docs); a group holds a whole number of channels' spans.
        let span = GROUP * step;
        for (c, row) in values.chunks_exact(k).enumerate() {
            let (panel, lane) = (c / PANEL, c % PANEL);
            let panel_groups = &mut groups[panel * groups_per_panel..][..groups_per_panel];
            let at = lane * span;
            for (block, inputs) in panel_groups.chunks_exact_mut(step).zip(row.chunks(span)) {
                block[at / GROUP_BYTES].0[at % GROUP_BYTES..][..inputs.len()]
                    .copy_from_slice(inputs);
            }
        }
        let offsets = values
            .chunks_exact(k)
            .map(|row| {
                if tier.multiplies_signed_activations() {
                    0
                } else {
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
        let span = GROUP * self.tier.groups_per_step();
        self.k.div_ceil(span) * span
    }

    /// Input groups of a panel, the unit of [`Self::raw_sums`]' input ranges.
    pub fn groups_per_panel(&self) -> usize {
        self.row_stride() / GROUP
    }

    /// The `part`-th of `parts` near-equal shares of the input groups, each
    /// starting and ending where the tier's kernel may split them (some empty
    /// when there are fewer steps than parts).
    pub fn group_share(&self, parts: usize, part: usize) -> Range<usize> {
        let step = self.tier.groups_per_step();
        let steps = share(self.groups_per_panel() / step, parts, part);
        steps.start * step..steps.end * step
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
            let parts = threads.min(groups / self.tier.groups_per_step());
            sums.resize(parts * part_len, 0);
            sums.par_chunks_mut(part_len)
                .enumerate()
                .for_each(|(part, c)| {
                    self.raw_sums(a, rows, 0..panels, self.group_share(parts, part), c);
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
    /// activations as stored, or, on AVX2 and Arm, `Σₖ (a[r, k] − 128) · w[c, k]`.
    /// `groups` must start and end on a multiple of the tier's
    /// [`GemmTier::groups_per_step`] ([`Self::group_share`] does).
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
                && groups.start.is_multiple_of(self.tier.groups_per_step())
                && groups.end.is_multiple_of(self.tier.groups_per_step())
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
    /// zero on AVX2 and Arm, whose kernels multiply `q` itself.
    pub fn offsets(&self) -> &[i32] {
        &self.offsets
    }

    /// How many of the `n × k` int8 values differ between `self` and
    /// `other`, or `None` when the two are not packed alike (another shape
    /// or tier). Packing places every value in one byte of its own and
    /// fills the rest with zeros, so differing bytes are differing values.
    pub fn differing_values(&self, other: &PackedWeights) -> Option<u64> {
        if (self.tier, self.n, self.k) != (other.tier, other.n, other.k) {
            return None;
        }
        let differing = self
            .groups
            .iter()
            .zip(&other.groups)
            .map(|(a, b)| a.0.iter().zip(&b.0).filter(|(x, y)| x != y).count() as u64)
            .sum();
        Some(differing)
    }
}

/// The `part`-th of `parts` near-equal shares of `0..len`.
pub fn share(len: usize, parts: usize, part: usize) -> Range<usize> {
    len * part / parts..len * (part + 1) / parts
}

/// One register tile: `c[r][j] = Σ_g Σ_t a[r·lda + 4g + t] · b[g][4j + t]`
/// (on the i8mm tier, over blocks of two groups with eight bytes per channel).
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
        #[cfg(target_arch = "aarch64")]
        // SAFETY: forwarded from the caller.
        GemmTier::Neon => unsafe { arm::tile_neon(a, lda, rows, b, c) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: forwarded from the caller.
        GemmTier::NeonDotprod => unsafe { arm::tile_dotprod(a, lda, rows, b, c) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: forwarded from the caller.
        GemmTier::NeonI8mm => unsafe { arm::tile_i8mm(a, lda, rows, b, c) },
        #[cfg(not(target_arch = "aarch64"))]
        GemmTier::Neon | GemmTier::NeonDotprod | GemmTier::NeonI8mm => {
            unreachable!("packing checked the tier")
        }
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

#[cfg(target_arch = "aarch64")]
mod arm {
    //! NEON's intrinsics are `unsafe` to call even though every aarch64 CPU
    //! has NEON (Rust requires the feature on the calling function, and
    //! `#[inline(always)]` helpers cannot carry one): each helper's body is
    //! one `unsafe` block on that ground.

    use std::arch::aarch64::*;
    use std::arch::asm;

    use super::{GROUP, GROUP_BYTES, Group, PANEL};

    /// Four activation bytes of row `r`, group `g`, as the signed `q` (the
    /// stored `q + 128` with its top bit flipped), repeated in every 32-bit
    /// lane.
    ///
    /// # Safety
    /// `offset + 4` must lie within `a`'s row.
    #[inline(always)]
    unsafe fn signed4(a: *const u8, offset: usize) -> int8x16_t {
        // SAFETY: the caller keeps the bytes in bounds; NEON is baseline.
        unsafe {
            let stored = a.add(offset).cast::<i32>().read_unaligned();
            veorq_s8(
                vreinterpretq_s8_s32(vdupq_n_s32(stored)),
                vdupq_n_s8(i8::MIN),
            )
        }
    }

    /// One step of a lane-wise dot product: each 32-bit lane of `acc` (one
    /// channel) gains the dot product of its four weight bytes in `w` with
    /// the four signed activations in `x`.
    trait Dot4 {
        /// # Safety
        /// The CPU must have the instructions the step uses.
        unsafe fn dot4(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
    }

    /// Base NEON: `smull` widens the 16 products to i16, a pairwise add sums
    /// each channel's pairs (at most 2 · 128 · 127 = 32 512, so i16 holds
    /// them) and `sadalp` adds each channel's two pair sums into its lane.
    struct Widening;

    impl Dot4 for Widening {
        #[inline(always)]
        unsafe fn dot4(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
            // SAFETY: NEON is baseline.
            unsafe {
                let low = vmull_s8(vget_low_s8(w), vget_low_s8(x));
                let high = vmull_high_s8(w, x);
                vpadalq_s16(acc, vpaddq_s16(low, high))
            }
        }
    }

    /// An accumulating int8 instruction whose intrinsic is not stable in Rust,
    /// as inline assembly on registers only: `acc` gains the instruction's
    /// products of `a` and `b`. Only ever inlined into a function compiled
    /// with the instruction's feature.
    macro_rules! accumulating_asm {
        ($(#[$doc:meta])* $name:ident, $instruction:literal) => {
            $(#[$doc])*
            ///
            /// # Safety
            /// The CPU must have the instruction's extension.
            #[inline(always)]
            unsafe fn $name(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
                // SAFETY: register-only arithmetic; the caller checked the feature.
                unsafe {
                    asm!(
                        concat!($instruction, " {acc:v}.4s, {a:v}.16b, {b:v}.16b"),
                        acc = inout(vreg) acc,
                        a = in(vreg) a,
                        b = in(vreg) b,
                        options(pure, nomem, nostack, preserves_flags),
                    );
                }
                acc
            }
        };
    }

    accumulating_asm!(
        /// `sdot`: each 32-bit lane gains the dot product of its four bytes
        /// of `a` and of `b`.
        sdot,
        "sdot"
    );
    accumulating_asm!(
        /// `smmla`: `acc += A · Bᵀ` for the 2 × 8 matrices `a` (two rows of
        /// activations) and `b` (two channels of weights), giving
        /// `[r0·c0, r0·c1, r1·c0, r1·c1]`.
        smmla,
        "smmla"
    );

    /// The dot-product extension's `sdot`.
    struct SignedDot;

    impl Dot4 for SignedDot {
        #[inline(always)]
        unsafe fn dot4(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
            // SAFETY: the caller checked the feature.
            unsafe { sdot(acc, w, x) }
        }
    }

    /// Register tile of `R` rows × `16 L` channels (`L` 64-byte lines of each
    /// group from `first_line`): 4·L·R accumulators of four channels.
    ///
    /// # Safety
    /// See [`super::tile`], for the lines `first_line..first_line + L`.
    #[inline(always)]
    unsafe fn tile_rows<const R: usize, const L: usize, D: Dot4>(
        a: *const u8,
        lda: usize,
        b: &[Group],
        first_line: usize,
        c: *mut i32,
    ) {
        // SAFETY: L lines of 64 bytes from `first_line` lie within each
        // group, rows below R within the caller's `a` and `c`; the caller
        // checked the tier's features.
        unsafe {
            let mut acc = [[[vdupq_n_s32(0); 4]; L]; R];
            for (g, group) in b.iter().enumerate() {
                let w = group.0[first_line * 64..].as_ptr();
                let w: [[int8x16_t; 4]; L] = std::array::from_fn(|l| {
                    std::array::from_fn(|v| vld1q_s8(w.add(64 * l + 16 * v)))
                });
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = signed4(a, r * lda + g * GROUP);
                    for (acc, w) in acc.iter_mut().zip(&w) {
                        for (acc, &w) in acc.iter_mut().zip(w) {
                            *acc = D::dot4(*acc, w, x);
                        }
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (l, acc) in acc.iter().enumerate() {
                    for (v, &sums) in acc.iter().enumerate() {
                        vst1q_s32(c.add(r * PANEL + 16 * (first_line + l) + 4 * v), sums);
                    }
                }
            }
        }
    }

    /// The whole panel for `rows` rows in tiles of at most 16 accumulators
    /// (4 lines for one row, 2 for two, 1 for three or four), so that a
    /// call's weights and accumulators fit NEON's 32 registers.
    ///
    /// # Safety
    /// See [`super::tile`].
    #[inline(always)]
    unsafe fn tile_panel<D: Dot4>(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
        let (a, c) = (a.as_ptr(), c.as_mut_ptr());
        // SAFETY: forwarded from the caller.
        unsafe {
            match rows {
                1 => tile_rows::<1, 4, D>(a, lda, b, 0, c),
                2 => {
                    tile_rows::<2, 2, D>(a, lda, b, 0, c);
                    tile_rows::<2, 2, D>(a, lda, b, 2, c);
                }
                // Loops, not closures: a closure would not inherit the
                // caller's target features, which `sdot` needs.
                3 => {
                    for line in 0..4 {
                        tile_rows::<3, 1, D>(a, lda, b, line, c);
                    }
                }
                4 => {
                    for line in 0..4 {
                        tile_rows::<4, 1, D>(a, lda, b, line, c);
                    }
                }
                _ => unreachable!("the NEON tiles have at most 4 rows"),
            }
        }
    }

    /// # Safety
    /// See [`super::tile`].
    pub(super) unsafe fn tile_neon(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
        // SAFETY: forwarded from the caller; NEON is baseline.
        unsafe { tile_panel::<Widening>(a, lda, rows, b, c) }
    }

    /// # Safety
    /// See [`super::tile`]; the CPU must have the dot-product extension.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn tile_dotprod(
        a: &[u8],
        lda: usize,
        rows: usize,
        b: &[Group],
        c: &mut [i32],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { tile_panel::<SignedDot>(a, lda, rows, b, c) }
    }

    /// Eight signed activation bytes of `row` from input `offset`, or zeros
    /// for the missing second row of an odd tile (`row == rows`).
    ///
    /// # Safety
    /// Below `rows`, `offset + 8` must lie within the row.
    #[inline(always)]
    unsafe fn signed8(
        a: *const u8,
        lda: usize,
        row: usize,
        rows: usize,
        offset: usize,
    ) -> int8x8_t {
        // SAFETY: the caller keeps the bytes in bounds; NEON is baseline.
        unsafe {
            if row < rows {
                let stored = vld1_u8(a.add(row * lda + offset));
                veor_s8(vreinterpret_s8_u8(stored), vdup_n_s8(i8::MIN))
            } else {
                vdup_n_s8(0)
            }
        }
    }

    /// Register tile of `R` rows × 16 channels from channel `first`: `smmla`
    /// on pairs of rows against pairs of channels, eight inputs at a time
    /// (from each pair of groups, which the i8mm tier packs as one
    /// 64-channel × 8-input block, so that channels `2p, 2p + 1` are 16
    /// consecutive bytes).
    ///
    /// # Safety
    /// See [`tile_i8mm`].
    #[inline(always)]
    unsafe fn tile_i8mm_rows<const R: usize>(
        a: *const u8,
        lda: usize,
        b: &[Group],
        first: usize,
        c: *mut i32,
    ) {
        let pairs = R.div_ceil(2);
        // SAFETY: a block is two consecutive groups (512 bytes, 8 per
        // channel), rows below R lie within the caller's `a` and `c`; the
        // caller checked the feature.
        unsafe {
            let mut acc = [[vdupq_n_s32(0); 8]; 2];
            for (step, block) in b.chunks_exact(2).enumerate() {
                let w = block.as_ptr().cast::<i8>().add(8 * first);
                let w: [int8x16_t; 8] = std::array::from_fn(|j| vld1q_s8(w.add(16 * j)));
                let offset = step * 2 * GROUP;
                for (p, acc) in acc.iter_mut().enumerate().take(pairs) {
                    let x = vcombine_s8(
                        signed8(a, lda, 2 * p, R, offset),
                        signed8(a, lda, 2 * p + 1, R, offset),
                    );
                    for (acc, &w) in acc.iter_mut().zip(&w) {
                        *acc = smmla(*acc, x, w);
                    }
                }
            }
            for (p, acc) in acc.iter().enumerate().take(pairs) {
                for (j, four) in acc.chunks_exact(2).enumerate() {
                    let left = vreinterpretq_s64_s32(four[0]);
                    let right = vreinterpretq_s64_s32(four[1]);
                    let rows = [vzip1q_s64(left, right), vzip2q_s64(left, right)];
                    for (r, sums) in rows.into_iter().enumerate().take(R - 2 * p) {
                        let at = (2 * p + r) * PANEL + first + 4 * j;
                        vst1q_s32(c.add(at), vreinterpretq_s32_s64(sums));
                    }
                }
            }
        }
    }

    /// # Safety
    /// See [`super::tile`]; the CPU must have the int8 matrix-multiply
    /// extension and `b` hold whole pairs of groups packed for it.
    #[target_feature(enable = "i8mm")]
    pub(super) unsafe fn tile_i8mm(a: &[u8], lda: usize, rows: usize, b: &[Group], c: &mut [i32]) {
        debug_assert!(b.len().is_multiple_of(2) && 2 * GROUP_BYTES == 8 * PANEL);
        let (a, c) = (a.as_ptr(), c.as_mut_ptr());
        for first in (0..PANEL).step_by(16) {
            // SAFETY: forwarded from the caller.
            unsafe {
                match rows {
                    1 => tile_i8mm_rows::<1>(a, lda, b, first, c),
                    2 => tile_i8mm_rows::<2>(a, lda, b, first, c),
                    3 => tile_i8mm_rows::<3>(a, lda, b, first, c),
                    4 => tile_i8mm_rows::<4>(a, lda, b, first, c),
                    _ => unreachable!("the i8mm tile has at most 4 rows"),
                }
            }
        }
    }
}
