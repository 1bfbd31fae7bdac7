//! `qforge demo`: the calibration-statistics promise, end to end, on synthetic
//! activations (`qforge_core::demo`): one worker and a sharded run must write
//! byte-identical statistics.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use qforge_core::demo::{CHANNELS, DemoOptions};
use qforge_formats::output::write_atomic;

use crate::output::{Written, print_json};
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
    let path = args.output.join("demo.qstats");
    write_atomic(&path, &demo.encoded)?;
    if args.flags.json {
        return print_json(&Written::new(&path, &demo.report()));
    }
    println!("{demo}\n\nwrote {}", path.display());
    println!("inspect it: qforge stats show {}", path.display());
    Ok(())
}
