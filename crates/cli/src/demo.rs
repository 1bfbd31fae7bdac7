//! `qforge demo`: the calibration-statistics promise, end to end, on synthetic
//! activations (`qforge_core::demo`): one worker and a sharded run must write
//! byte-identical statistics.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use qforge_core::demo::{CHANNELS, DemoOptions, TENSORS};
use qforge_core::{Calibrator, Digest};
use serde_json::json;

use crate::output::write_atomic;
use crate::stats_cmd::stats_json;
use crate::{OutputFlags, UsageError};

/// Arguments of `qforge demo`.
#[derive(Args)]
pub struct DemoArgs {
    /// Values per tensor over the whole data set.
    #[arg(long, default_value_t = 2_000_000)]
    values: usize,
    /// Number of calibration batches the values are cut into.
    #[arg(long, default_value_t = 64)]
    batches: usize,
    /// Worker threads of the sharded run (default: available cores, at least 2).
    #[arg(long)]
    workers: Option<usize>,
    /// Seed of the synthetic activations.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory to write `demo.qstats` into.
    #[arg(short = 'o', long = "output", default_value = "qforge-out")]
    output: PathBuf,
    #[command(flatten)]
    flags: OutputFlags,
}

/// `qforge demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    if args.batches == 0 || args.values < args.batches * CHANNELS {
        return Err(UsageError(format!(
            "--values must be at least --batches × {CHANNELS} (one row per batch)"
        ))
        .into());
    }
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().max(2)));
    if workers == 0 {
        return Err(UsageError("--workers must be at least 1".into()).into());
    }
    let demo = qforge_core::demo::run(DemoOptions {
        values: args.values,
        batches: args.batches,
        workers,
        seed: args.seed,
    })?;
    let (single, single_bytes) = (&demo.stats, &demo.encoded);
    let path = args.output.join("demo.qstats");
    write_atomic(&path, single_bytes)?;
    let file_digest = Digest::of(single_bytes);

    if args.flags.json {
        let mut out = stats_json(single, &Calibrator::defaults());
        out["demo"] = json!({
            "output": path.display().to_string(),
            "batches": args.batches,
            "values_per_tensor": demo.values_per_tensor,
            "workers": workers,
            "identical": true,
            "sha256": file_digest.to_hex(),
            "single_worker_seconds": demo.single_worker.as_secs_f64(),
            "sharded_seconds": demo.sharded.as_secs_f64(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "observed {} tensors × {} values in {} batches",
        TENSORS.len(),
        demo.values_per_tensor,
        args.batches
    );
    println!(
        "  1 worker:  {:.2} s\n  {workers} workers: {:.2} s (round-robin shards, merged in reverse order)",
        demo.single_worker.as_secs_f64(),
        demo.sharded.as_secs_f64()
    );
    println!(
        "byte-identical statistics: yes (sha256 {})",
        &file_digest.to_hex()[..16]
    );
    println!();
    println!(
        "{:<12} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "tensor", "minmax", "p99.99", "entropy", "mse", "sigma(3)"
    );
    for (name, tensor) in &single.tensors {
        let h = tensor.histogram();
        let cells: Vec<String> = Calibrator::defaults()
            .iter()
            .map(|c| c.threshold(h).map_or("-".into(), |t| format!("{t:.4}")))
            .collect();
        println!(
            "{name:<12} {:>11} {:>11} {:>11} {:>11} {:>11}",
            cells[0], cells[1], cells[2], cells[3], cells[4]
        );
    }
    println!();
    println!("wrote {}", path.display());
    println!("inspect it: qforge stats show {}", path.display());
    Ok(())
}
