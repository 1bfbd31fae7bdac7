//! The tier set of the kernels whose only fast path is AVX2 with FMA: the
//! activation quantizers and attention. They need the same features, so one
//! type says which of them this CPU runs, and each kernel names it after
//! itself ([`crate::QuantizeTier`], [`crate::AttentionTier`]).

use qforge_core::CpuTier;

/// A CPU tier of a kernel whose fast path is AVX2 with FMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FmaTier {
    /// Compiled for the target's baseline instruction set.
    Portable,
    /// Compiled with AVX2 and FMA (x86-64 only).
    Avx2,
}

impl CpuTier for FmaTier {
    const ALL: &'static [Self] = &[Self::Portable, Self::Avx2];

    fn is_supported(self) -> bool {
        let cpu = qforge_core::CpuFeatures::get();
        match self {
            Self::Portable => true,
            Self::Avx2 => cpu.avx2 && cpu.fma,
        }
    }
}
