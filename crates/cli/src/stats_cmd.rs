//! `qforge stats observe | merge | show`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use qforge_core::codec::{decode, encode};
use qforge_core::{Calibrator, Digest, MergePolicy, QuantParams, Stats};
use serde_json::{Value, json};

use crate::output::write_atomic;
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
        let mut out = stats_json(stats, &Calibrator::defaults());
        out["output"] = json!(path.display().to_string());
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let values: u64 = stats.tensors.values().map(|t| t.histogram().count()).sum();
        println!(
            "wrote {}: {} tensor(s), {} finite value(s), {} batch(es){}",
            path.display(),
            stats.tensors.len(),
            values,
            stats.provenance.batches.len(),
            if stats.provenance.forced {
                " (forced merge)"
            } else {
                ""
            }
        );
    }
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
    for (name, tensor) in &stats.tensors {
        if let Some(t) = Calibrator::MinMax.threshold(tensor.histogram())
            && let Some(warning) = QuantParams::symmetric(t).warning
        {
            eprintln!("warning: tensor {name}: {warning}");
        } else if tensor.histogram().count() == 0 {
            eprintln!("warning: tensor {name}: no finite values; thresholds are null");
        }
    }
    if args.flags.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&stats_json(&stats, &calibrators))?
        );
        return Ok(());
    }
    print_human(&stats, &calibrators);
    Ok(())
}

/// An f32 as JSON with its shortest round-tripping digits (`3.3002303`, not
/// the `3.3002302646636963` of a widened f64); `null` for `None`.
pub fn number(value: Option<f32>) -> Value {
    value.map_or(Value::Null, f32_json)
}

/// An f32 as a JSON number with its shortest round-tripping digits.
pub fn f32_json(value: f32) -> Value {
    value
        .to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

/// The JSON document of `stats show --json`.
pub fn stats_json(stats: &Stats, calibrators: &[Calibrator]) -> Value {
    let tensors: serde_json::Map<String, Value> = stats
        .tensors
        .iter()
        .map(|(name, tensor)| {
            let h = tensor.histogram();
            let thresholds: serde_json::Map<String, Value> = calibrators
                .iter()
                .map(|c| (c.name().to_owned(), number(c.threshold(h))))
                .collect();
            let ranges: serde_json::Map<String, Value> = calibrators
                .iter()
                .filter_map(|c| {
                    c.range(h)
                        .map(|(lo, hi)| (c.name().to_owned(), json!([f32_json(lo), f32_json(hi)])))
                })
                .collect();
            let mut entry = json!({
                "count": h.count(),
                "zero": h.zero(),
                "min": number(h.min()),
                "max": number(h.max()),
                "nan": h.nan(),
                "pos_inf": h.pos_inf(),
                "neg_inf": h.neg_inf(),
                "thresholds": thresholds,
                "ranges": ranges,
                "calibrators": calibrators.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            });
            if let Some(channels) = tensor.channel_abs_max() {
                entry["channel_abs_max"] = channels.into_iter().map(f32_json).collect();
            }
            (name.clone(), entry)
        })
        .collect();
    json!({
        "provenance": stats.provenance,
        "coverage": stats.provenance.coverage(),
        "tensors": tensors,
    })
}

fn print_human(stats: &Stats, calibrators: &[Calibrator]) {
    let p = &stats.provenance;
    let hashes = |set: &std::collections::BTreeSet<Digest>| {
        if set.is_empty() {
            "-".to_owned()
        } else {
            set.iter()
                .map(|d| d.to_hex()[..16].to_owned())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    println!("model:   {}", hashes(&p.models));
    println!("data:    {}", hashes(&p.data));
    println!("recipe:  {}", hashes(&p.recipes));
    println!(
        "pass:    {}",
        p.passes.iter().cloned().collect::<Vec<_>>().join(", ")
    );
    println!(
        "batches: {} of {} planned ({:.1} % coverage){}",
        p.batches.len(),
        p.planned,
        100.0 * p.coverage(),
        if p.forced { " (forced merge)" } else { "" }
    );
    if p.mixed_hardware {
        println!(
            "note:    observed on workers with different determinism fingerprints; \
             exact only up to forward-pass rounding"
        );
    }
    println!();
    let fmt = |v: Option<f32>| v.map_or("-".to_owned(), |v| format!("{v:.6e}"));
    for (name, tensor) in &stats.tensors {
        let h = tensor.histogram();
        println!("{name}");
        println!(
            "  count {}  zero {}  min {}  max {}  nan {}  +inf {}  -inf {}",
            h.count(),
            h.zero(),
            fmt(h.min()),
            fmt(h.max()),
            h.nan(),
            h.pos_inf(),
            h.neg_inf()
        );
        for c in calibrators {
            println!("  {:<18} {}", c.to_string(), fmt(c.threshold(h)));
        }
        if let Some(channels) = tensor.channel_abs_max() {
            println!("  {} channels with abs-max", channels.len());
        }
    }
}
