//! `qforge info`: this build and what this CPU runs.

use anyhow::Result;
use clap::Args;
use qforge_core::{CpuFeatures, ObserveTier};
use qforge_kernels::{AttentionTier, GemmTier, HadamardTier, QuantizeTier};
use serde_json::json;

use crate::OutputFlags;

/// Arguments of `qforge info`.
#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge info`: the version, the CPU features the one probe found, and the
/// kernel tier each hot kernel runs at (workers whose tiers differ compute
/// different activations, which their determinism fingerprints reveal).
pub fn info(args: InfoArgs) -> Result<()> {
    let features = CpuFeatures::get().names();
    let tiers = [
        ("observe", format!("{:?}", ObserveTier::detect())),
        ("quantize", format!("{:?}", QuantizeTier::detect())),
        ("gemm", format!("{:?}", GemmTier::detect())),
        ("attention", format!("{:?}", AttentionTier::detect())),
        ("hadamard", format!("{:?}", HadamardTier::detect())),
    ];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.flags.json {
        let tiers: serde_json::Map<String, serde_json::Value> = tiers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_lowercase().into()))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "version": env!("CARGO_PKG_VERSION"),
                "arch": std::env::consts::ARCH,
                "cpu_features": features,
                "tiers": tiers,
                "threads": threads,
            }))?
        );
        return Ok(());
    }
    println!(
        "qforge {} ({})",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH
    );
    println!("cpu features: {}", features.join(" "));
    for (kernel, tier) in &tiers {
        println!("{kernel:<10} tier: {}", tier.to_lowercase());
    }
    println!("threads:  {threads}");
    Ok(())
}
