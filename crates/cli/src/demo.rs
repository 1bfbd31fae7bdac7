//! `qforge demo`: the calibration-statistics promise, end to end, on synthetic
//! activations.
//!
//! A seeded generator plays the model: batch `b` of tensor `t` is always the
//! same values. One worker observes every batch in order; then several worker
//! threads take the batches round-robin, each merging its share in reverse, and
//! their partial statistics are merged in reverse. The two `.qstats` encodings
//! must be byte-identical.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use qforge_core::codec::encode;
use qforge_core::{BatchId, Calibrator, Digest, MergePolicy, Provenance, Stats, TensorStats};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal, StudentT};
use serde_json::json;

use crate::output::write_atomic;
use crate::stats_cmd::stats_json;
use crate::{OutputFlags, UsageError};

/// Channels of every synthetic activation (rows × CHANNELS per batch).
const CHANNELS: usize = 64;
/// The synthetic tensors: each mimics an activation shape seen in practice.
const TENSORS: [&str; 5] = ["gaussian", "laplace", "student_t3", "outliers", "relu"];

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

/// Values of tensor `tensor` in batch `batch`: a pure function of its inputs.
fn batch_values(seed: u64, tensor: usize, batch: usize, rows: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((tensor as u64) << 48) ^ batch as u64);
    let n = rows * CHANNELS;
    let normal = Normal::new(0.0f32, 1.0).expect("valid");
    match TENSORS[tensor] {
        "gaussian" => (0..n).map(|_| normal.sample(&mut rng)).collect(),
        "laplace" => (0..n)
            .map(|_| {
                let u: f32 = rng.random_range(-0.5f32..0.5);
                -u.signum() * (1.0 - 2.0 * u.abs()).max(f32::MIN_POSITIVE).ln()
            })
            .collect(),
        "student_t3" => {
            let t = StudentT::new(3.0f32).expect("valid");
            (0..n).map(|_| t.sample(&mut rng)).collect()
        }
        // Two channels carry rare, huge values, like the SwiGLU outputs feeding
        // an LLM's down_proj.
        "outliers" => (0..n)
            .map(|i| {
                let v: f32 = normal.sample(&mut rng);
                let outlier_channel = matches!(i % CHANNELS, 7 | 41);
                if outlier_channel && rng.random_ratio(1, 200) {
                    v * 1000.0
                } else {
                    v
                }
            })
            .collect(),
        _ => (0..n).map(|_| normal.sample(&mut rng).max(0.0)).collect(),
    }
}

/// Statistics of one batch, as a calibration worker would produce them.
fn observe_batch(
    seed: u64,
    batch: usize,
    batches: usize,
    rows: usize,
    data: Digest,
    recipe: Digest,
) -> Stats {
    let mut content = qforge_core::DigestBuilder::default();
    let mut tensors = std::collections::BTreeMap::new();
    for (t, name) in TENSORS.iter().enumerate() {
        let values = batch_values(seed, t, batch, rows);
        for v in &values {
            content.update(&v.to_le_bytes());
        }
        let mut stats = TensorStats::with_channels(CHANNELS);
        stats
            .observe(&values)
            .expect("values are whole rows of CHANNELS");
        tensors.insert((*name).to_owned(), stats);
    }
    let id = BatchId {
        index: batch as u64,
        content: content.finish(),
    };
    Stats {
        provenance: Provenance::single(None, data, recipe, "activation", id, batches as u64),
        tensors,
    }
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
    let rows = args.values / args.batches / CHANNELS;
    let data = Digest::of(
        format!(
            "qforge.demo.v1 seed={} batches={} rows={rows}",
            args.seed, args.batches
        )
        .as_bytes(),
    );
    let recipe = Digest::of(b"qforge.demo.v1 pass=activation channels=64");
    let observe = |b| observe_batch(args.seed, b, args.batches, rows, data, recipe);

    let started = Instant::now();
    let mut single = Stats::default();
    for b in 0..args.batches {
        single.merge(&observe(b), MergePolicy::Strict)?;
    }
    let single_time = started.elapsed();

    let started = Instant::now();
    let partials: Vec<Stats> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || -> Result<Stats> {
                    let mut mine = Stats::default();
                    let share: Vec<usize> = (w..args.batches).step_by(workers).collect();
                    for &b in share.iter().rev() {
                        mine.merge(&observe(b), MergePolicy::Strict)?;
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("demo worker panicked"))
            .collect::<Result<_>>()
    })?;
    let mut sharded = Stats::default();
    for partial in partials.iter().rev() {
        sharded.merge(partial, MergePolicy::Strict)?;
    }
    let sharded_time = started.elapsed();

    let (single_bytes, sharded_bytes) = (encode(&single), encode(&sharded));
    if single_bytes != sharded_bytes {
        bail!("sharded statistics differ from the single-worker statistics: merge is not exact");
    }
    let path = args.output.join("demo.qstats");
    write_atomic(&path, &single_bytes)?;
    let file_digest = Digest::of(&single_bytes);

    if args.flags.json {
        let mut out = stats_json(&single, &Calibrator::defaults());
        out["demo"] = json!({
            "output": path.display().to_string(),
            "batches": args.batches,
            "values_per_tensor": rows * CHANNELS * args.batches,
            "workers": workers,
            "identical": true,
            "sha256": file_digest.to_hex(),
            "single_worker_seconds": single_time.as_secs_f64(),
            "sharded_seconds": sharded_time.as_secs_f64(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "observed {} tensors × {} values in {} batches",
        TENSORS.len(),
        rows * CHANNELS * args.batches,
        args.batches
    );
    println!(
        "  1 worker:  {:.2} s\n  {workers} workers: {:.2} s (round-robin shards, merged in reverse order)",
        single_time.as_secs_f64(),
        sharded_time.as_secs_f64()
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
