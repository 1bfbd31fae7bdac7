//! What this machine runs (`qforge info`): the CPU features the one probe
//! found and the tier each hot kernel runs at. Workers whose tiers differ
//! compute different activations, which their determinism fingerprints
//! reveal; this says why.

use std::collections::BTreeMap;
use std::fmt;

use qforge_core::{CpuFeatures, CpuTier, ObserveTier, VectorTier};
use serde::Serialize;

use crate::{AttentionTier, GemmTier, QuantizeTier};

/// This build, this CPU, and each hot kernel's tier.
#[derive(Debug, Serialize)]
pub struct MachineReport {
    /// The qforge version.
    pub version: &'static str,
    /// The CPU architecture (`x86_64`, `aarch64`).
    pub arch: &'static str,
    /// Features the CPU probe found.
    pub cpu_features: Vec<&'static str>,
    /// Kernel → tier, lower case. On aarch64 the tiers named `portable` are
    /// compiled for the baseline, which includes NEON: the compiler
    /// vectorizes them with it.
    pub tiers: BTreeMap<&'static str, String>,
    /// Threads available to this process.
    pub threads: usize,
}

impl MachineReport {
    /// Probes this machine.
    pub fn detect() -> Self {
        let tier = |t: &dyn fmt::Debug| format!("{t:?}").to_lowercase();
        let tiers = [
            ("observe", tier(&ObserveTier::detect())),
            ("gram", tier(&VectorTier::detect())),
            ("quantize", tier(&QuantizeTier::detect())),
            ("gemm", GemmTier::detect().name().to_owned()),
            ("attention", tier(&AttentionTier::detect())),
            ("hadamard", tier(&VectorTier::detect())),
        ];
        Self {
            version: env!("CARGO_PKG_VERSION"),
            arch: std::env::consts::ARCH,
            cpu_features: CpuFeatures::get().names(),
            tiers: tiers.into_iter().collect(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl fmt::Display for MachineReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "qforge {} ({})", self.version, self.arch)?;
        writeln!(f, "cpu features: {}", self.cpu_features.join(" "))?;
        for (kernel, tier) in &self.tiers {
            writeln!(f, "{kernel:<10} tier: {tier}")?;
        }
        write!(f, "threads:  {}", self.threads)
    }
}
