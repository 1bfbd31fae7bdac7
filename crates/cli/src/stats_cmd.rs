//! `qforge stats observe | merge | show`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use qforge_core::codec::{decode, encode};
use qforge_core::{Calibrator, MergePolicy, Stats, StatsReport};
use qforge_formats::output::write_atomic;

use crate::output::{Written, print_json, print_report};
use crate::{OutputFlags, OutputPath, UsageError};

/// Arguments of `qforge stats observe`.
#[derive(Args)]
pub struct ObserveArgs {
    /// File of values: raw little-endian f32, or .npy (float32/float64),
    /// recognised by its magic bytes.
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Name of the tensor the values belong to.
    #[arg(long, default_value = "values")]
    name: String,
    /// Treat the values as rows of this many channels (the last axis) and also
    /// record each channel's abs-max, as smoothing needs.
    #[arg(long, value_name = "C")]
    channels: Option<usize>,
    #[command(flatten)]
    output: OutputPath,
    #[command(flatten)]
    flags: OutputFlags,
}

/// Arguments of `qforge stats merge`.
#[derive(Args)]
pub struct MergeArgs {
    /// Statistics files to merge (two or more).
    #[arg(required = true, num_args = 2.., value_name = "FILE")]
    inputs: Vec<PathBuf>,
    /// Merge even if provenance differs or batch ids overlap; the result is
    /// marked as forced and keeps every source's hashes.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    output: OutputPath,
    #[command(flatten)]
    flags: OutputFlags,
}

/// Arguments of `qforge stats show`.
#[derive(Args)]
pub struct ShowArgs {
    /// Statistics file to show.
    #[arg(value_name = "FILE")]
    input: PathBuf,
    /// Percentile of |x| kept by the `percentile` calibrator.
    #[arg(long, default_value_t = Calibrator::DEFAULT_PERCENTILE)]
    percentile: f64,
    /// Standard deviations kept by the `sigma` calibrator (mean ± k·σ, moments
    /// derived from the histogram).
    #[arg(long = "sigma-k", default_value_t = Calibrator::DEFAULT_SIGMA_K)]
    sigma_k: f64,
    #[command(flatten)]
    flags: OutputFlags,
}

/// Reads and decodes a `.qstats` file, naming the file in any error.
pub fn read_stats(path: &Path) -> Result<Stats> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    decode(&bytes).with_context(|| format!("{}", path.display()))
}

/// `qforge stats observe`.
pub fn observe(args: ObserveArgs) -> Result<()> {
    if args.channels == Some(0) {
        return Err(UsageError("--channels must be at least 1".into()).into());
    }
    if args.name.is_empty() {
        return Err(UsageError("--name must not be empty".into()).into());
    }
    let stats = qforge_calib::observe_value_file(&args.input, &args.name, args.channels)?;
    write_atomic(&args.output.output, &encode(&stats))?;
    report(&stats, &args.output.output, args.flags)
}

/// `qforge stats merge`.
pub fn merge(args: MergeArgs) -> Result<()> {
    let policy = if args.force {
        MergePolicy::Force
    } else {
        MergePolicy::Strict
    };
    let mut merged = Stats::default();
    for path in &args.inputs {
        let stats = read_stats(path)?;
        merged
            .merge(&stats, policy)
            .with_context(|| format!("merging {}", path.display()))?;
    }
    write_atomic(&args.output.output, &encode(&merged))?;
    report(&merged, &args.output.output, args.flags)
}

/// Prints what was written.
fn report(stats: &Stats, path: &Path, flags: OutputFlags) -> Result<()> {
    if flags.json {
        let report = StatsReport::new(stats, &Calibrator::defaults());
        return print_json(&Written::new(path, &report));
    }
    println!("wrote {}: {}", path.display(), stats.describe());
    Ok(())
}

/// `qforge stats show`.
pub fn show(args: ShowArgs) -> Result<()> {
    let calibrators = [
        Calibrator::MinMax,
        Calibrator::Percentile {
            percentile: args.percentile,
        },
        Calibrator::Entropy,
        Calibrator::Mse,
        Calibrator::Sigma { k: args.sigma_k },
    ];
    for c in &calibrators {
        c.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let stats = read_stats(&args.input)?;
    for warning in stats.warnings() {
        eprintln!("warning: {warning}");
    }
    print_report(&StatsReport::new(&stats, &calibrators), args.flags)
}
