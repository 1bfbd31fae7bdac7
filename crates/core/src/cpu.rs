//! The one CPU-feature probe. Every kernel tier (histogram observation here,
//! the quantizers and the GEMM in `qforge-kernels`) asks it which
//! instructions it may use, and `qforge info` prints what it found, so what
//! a machine runs is stated in one place. [`CpuTier`] is the one rule that
//! turns what it found into each kernel's tier.

use std::sync::OnceLock;

/// The instruction-set extensions qforge's kernel tiers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    /// AVX2 (x86-64).
    pub avx2: bool,
    /// FMA3 (x86-64).
    pub fma: bool,
    /// AVX-512 Foundation (x86-64).
    pub avx512f: bool,
    /// AVX-512 byte and word instructions (x86-64).
    pub avx512bw: bool,
    /// AVX-512 VNNI, `vpdpbusd` (x86-64).
    pub avx512vnni: bool,
    /// Advanced SIMD (aarch64; every aarch64 CPU has it).
    pub neon: bool,
    /// The dot-product extension, `sdot` (aarch64, Armv8.2 and later).
    pub dotprod: bool,
    /// The int8 matrix-multiply extension, `smmla` (aarch64, Armv8.6 and later).
    pub i8mm: bool,
}

impl CpuFeatures {
    /// This CPU's features, probed once per process.
    pub fn get() -> CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        *FEATURES.get_or_init(probe)
    }

    /// The names of the features present, in a fixed order.
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512vnni, "avx512vnni"),
            (self.neon, "neon"),
            (self.dotprod, "dotprod"),
            (self.i8mm, "i8mm"),
        ]
        .into_iter()
        .filter_map(|(present, name)| present.then_some(name))
        .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn probe() -> CpuFeatures {
    CpuFeatures {
        avx2: std::is_x86_feature_detected!("avx2"),
        fma: std::is_x86_feature_detected!("fma"),
        avx512f: std::is_x86_feature_detected!("avx512f"),
        avx512bw: std::is_x86_feature_detected!("avx512bw"),
        avx512vnni: std::is_x86_feature_detected!("avx512vnni"),
        ..CpuFeatures::default()
    }
}

#[cfg(target_arch = "aarch64")]
fn probe() -> CpuFeatures {
    CpuFeatures {
        neon: std::arch::is_aarch64_feature_detected!("neon"),
        dotprod: std::arch::is_aarch64_feature_detected!("dotprod"),
        i8mm: std::arch::is_aarch64_feature_detected!("i8mm"),
        ..CpuFeatures::default()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn probe() -> CpuFeatures {
    CpuFeatures::default()
}

/// A CPU tier of a kernel: one copy of its code compiled for an instruction
/// set. Every tier of a kernel computes the same bits (each kernel's tests
/// check it), so the choice is speed alone, and [`CpuTier::detect`] makes it
/// the same way for every kernel.
pub trait CpuTier: Copy + 'static {
    /// Every tier, slowest first within each architecture; the first runs on
    /// every CPU.
    const ALL: &'static [Self];

    /// Whether this CPU can run the tier.
    fn is_supported(self) -> bool;

    /// The fastest tier this CPU supports: the last supported one in
    /// [`CpuTier::ALL`].
    fn detect() -> Self {
        Self::ALL
            .iter()
            .rev()
            .copied()
            .find(|t| t.is_supported())
            .unwrap_or(Self::ALL[0])
    }
}

/// The tier set of the kernels compiled three times: for the target's
/// baseline instruction set, for AVX2 and for AVX-512F (x86-64): the Gram
/// matrices' partial sums, the Hadamard transform and GPTQ's solver. One
/// type says which of them this CPU runs (as `FmaTier` does for the kernels
/// with only an AVX2 fast path). Its AVX2 tier asks for FMA besides, which
/// Gram's kernel uses; the other two use AVX2 alone, so an AVX2 CPU without
/// FMA (none made since 2013) runs them portable, with the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VectorTier {
    /// Compiled for the target's baseline instruction set.
    Portable,
    /// Compiled with AVX2 (Gram's with FMA too); x86-64 only.
    Avx2,
    /// Compiled with AVX-512F (x86-64 only).
    Avx512,
}

impl CpuTier for VectorTier {
    const ALL: &'static [Self] = &[Self::Portable, Self::Avx2, Self::Avx512];

    fn is_supported(self) -> bool {
        let cpu = CpuFeatures::get();
        match self {
            Self::Portable => true,
            Self::Avx2 => cpu.avx2 && cpu.fma,
            Self::Avx512 => cpu.avx512f,
        }
    }
}

impl VectorTier {
    /// `portable`, `avx2` or `avx512`, as `qforge info` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}
