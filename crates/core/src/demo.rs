//! The statistics promise on synthetic activations (`qforge demo`).
//!
//! A seeded generator plays the model: batch `b` of tensor `t` is always the
//! same values. One worker observes every batch in order; then several worker
//! threads take the batches round-robin, each merging its share in reverse,
//! and their partial statistics are merged in reverse. The two runs' `.qstats`
//! encodings must be byte-identical: that is what makes a calibration exact
//! under any sharding, retry order or worker count.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal, StudentT};

use serde::Serialize;

use crate::codec::encode;
use crate::report::StatsReport;
use crate::{
    BatchId, Calibrator, Digest, DigestBuilder, Error, MergePolicy, Provenance, Result, Stats,
    TensorStats,
};

/// Channels of every synthetic activation (rows × CHANNELS per batch).
pub const CHANNELS: usize = 64;
/// The synthetic tensors: each mimics an activation shape seen in practice.
pub const TENSORS: [&str; 5] = ["gaussian", "laplace", "student_t3", "outliers", "relu"];

/// What to generate and how many workers share it.
#[derive(Clone, Copy, Debug)]
pub struct DemoOptions {
    /// Values per tensor over the whole data set.
    pub values: usize,
    /// Batches the values are cut into.
    pub batches: usize,
    /// Worker threads of the sharded run.
    pub workers: usize,
    /// Seed of the synthetic activations.
    pub seed: u64,
}

/// The outcome of a demo whose two runs agreed.
pub struct DemoRun {
    /// The merged statistics (the same from both runs).
    pub stats: Stats,
    /// Their `.qstats` encoding (byte-identical from both runs).
    pub encoded: Vec<u8>,
    /// Values per tensor actually observed (whole rows per batch).
    pub values_per_tensor: usize,
    /// Wall time of the single-worker run.
    pub single_worker: Duration,
    /// Wall time of the sharded run.
    pub sharded: Duration,
    /// The options it ran with.
    pub options: DemoOptions,
}

/// What a demo shows: its statistics under the default calibrators, and how
/// the two runs went.
#[derive(Serialize)]
pub struct DemoReport<'a> {
    #[serde(flatten)]
    stats: StatsReport<'a>,
    demo: DemoSummary,
}

#[derive(Serialize)]
struct DemoSummary {
    batches: usize,
    values_per_tensor: usize,
    workers: usize,
    /// Always true: a run whose two encodings differ is an error.
    identical: bool,
    sha256: String,
    single_worker_seconds: f64,
    sharded_seconds: f64,
}

impl DemoRun {
    /// The report of this run.
    pub fn report(&self) -> DemoReport<'_> {
        DemoReport {
            stats: StatsReport::new(&self.stats, &Calibrator::defaults()),
            demo: DemoSummary {
                batches: self.options.batches,
                values_per_tensor: self.values_per_tensor,
                workers: self.options.workers,
                identical: true,
                sha256: Digest::of(&self.encoded).to_hex(),
                single_worker_seconds: self.single_worker.as_secs_f64(),
                sharded_seconds: self.sharded.as_secs_f64(),
            },
        }
    }
}

impl fmt::Display for DemoRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "observed {} tensors × {} values in {} batches",
            TENSORS.len(),
            self.values_per_tensor,
            o.batches
        )?;
        writeln!(f, "  1 worker:  {:.2} s", self.single_worker.as_secs_f64())?;
        writeln!(
            f,
            "  {} workers: {:.2} s (round-robin shards, merged in reverse order)",
            o.workers,
            self.sharded.as_secs_f64()
        )?;
        let digest = Digest::of(&self.encoded).to_hex();
        writeln!(
            f,
            "byte-identical statistics: yes (sha256 {})",
            &digest[..16]
        )?;
        write!(
            f,
            "\n{:<12} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "tensor", "minmax", "p99.99", "entropy", "mse", "sigma(3)"
        )?;
        for (name, tensor) in &self.stats.tensors {
            write!(f, "\n{name:<12}")?;
            for c in Calibrator::defaults() {
                let threshold = c.threshold(tensor.histogram());
                write!(
                    f,
                    " {:>11}",
                    threshold.map_or("-".into(), |t| format!("{t:.4}"))
                )?;
            }
        }
        Ok(())
    }
}

impl DemoOptions {
    /// Rows per batch; refuses options that leave a batch without a row.
    fn rows(&self) -> Result<usize> {
        if self.batches == 0 || self.values < self.batches * CHANNELS {
            return Err(Error::Shape(format!(
                "{} values cannot fill {} batches of whole {CHANNELS}-channel rows: give at least batches × {CHANNELS} values",
                self.values, self.batches
            )));
        }
        if self.workers == 0 {
            return Err(Error::Parse(
                "the sharded run needs at least 1 worker".into(),
            ));
        }
        Ok(self.values / self.batches / CHANNELS)
    }
}

/// Runs both calibrations and checks they agree byte for byte; a difference
/// is an error (the merge would not be exact).
pub fn run(options: DemoOptions) -> Result<DemoRun> {
    let rows = options.rows()?;
    let data = Digest::of(
        format!(
            "qforge.demo.v1 seed={} batches={} rows={rows}",
            options.seed, options.batches
        )
        .as_bytes(),
    );
    let recipe = Digest::of(b"qforge.demo.v1 pass=activation channels=64");
    let observe = |b| observe_batch(options.seed, b, options.batches, rows, data, recipe);

    let started = Instant::now();
    let mut single = Stats::default();
    for b in 0..options.batches {
        single.merge(&observe(b)?, MergePolicy::Strict)?;
    }
    let single_worker = started.elapsed();

    let started = Instant::now();
    let partials: Vec<Stats> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..options.workers)
            .map(|w| {
                scope.spawn(move || -> Result<Stats> {
                    let mut mine = Stats::default();
                    let share: Vec<usize> = (w..options.batches).step_by(options.workers).collect();
                    for &b in share.iter().rev() {
                        mine.merge(&observe(b)?, MergePolicy::Strict)?;
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a demo worker panicked"))
            .collect::<Result<_>>()
    })?;
    let mut sharded_stats = Stats::default();
    for partial in partials.iter().rev() {
        sharded_stats.merge(partial, MergePolicy::Strict)?;
    }
    let sharded = started.elapsed();

    let encoded = encode(&single);
    if encoded != encode(&sharded_stats) {
        return Err(Error::Corrupt(
            "the sharded statistics differ from the single-worker statistics: the merge is not exact"
                .into(),
        ));
    }
    Ok(DemoRun {
        stats: single,
        encoded,
        values_per_tensor: rows * CHANNELS * options.batches,
        single_worker,
        sharded,
        options,
    })
}

/// Values of tensor `tensor` in batch `batch`: a pure function of its inputs.
fn batch_values(seed: u64, tensor: usize, batch: usize, rows: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((tensor as u64) << 48) ^ batch as u64);
    let n = rows * CHANNELS;
    let normal = Normal::new(0.0f32, 1.0).expect("a unit normal is valid");
    match TENSORS[tensor] {
        "gaussian" => (0..n).map(|_| normal.sample(&mut rng)).collect(),
        "laplace" => (0..n)
            .map(|_| {
                let u: f32 = rng.random_range(-0.5f32..0.5);
                -u.signum() * (1.0 - 2.0 * u.abs()).max(f32::MIN_POSITIVE).ln()
            })
            .collect(),
        "student_t3" => {
            let t = StudentT::new(3.0f32).expect("3 degrees of freedom are valid");
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
) -> Result<Stats> {
    let mut content = DigestBuilder::default();
    let mut tensors = BTreeMap::new();
    for (t, name) in TENSORS.iter().enumerate() {
        let values = batch_values(seed, t, batch, rows);
        for v in &values {
            content.update(&v.to_le_bytes());
        }
        let mut stats = TensorStats::with_channels(CHANNELS);
        stats.observe(&values)?;
        tensors.insert((*name).to_owned(), stats);
    }
    let id = BatchId {
        index: batch as u64,
        content: content.finish(),
    };
    Ok(Stats {
        provenance: Provenance::single(None, data, recipe, "activation", id, batches as u64),
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(workers: usize, seed: u64) -> DemoOptions {
        DemoOptions {
            values: 64 * CHANNELS * 8,
            batches: 8,
            workers,
            seed,
        }
    }

    #[test]
    fn every_worker_count_gives_the_same_bytes_and_the_seed_moves_them() {
        let one = run(options(1, 3)).unwrap();
        for workers in [2, 3, 8] {
            assert_eq!(run(options(workers, 3)).unwrap().encoded, one.encoded);
        }
        assert_ne!(run(options(2, 4)).unwrap().encoded, one.encoded);
        assert_eq!(one.values_per_tensor, 64 * CHANNELS * 8);
        assert_eq!(one.stats.tensors.len(), TENSORS.len());
        assert_eq!(one.stats.provenance.batches.len(), 8);
    }

    #[test]
    fn options_that_leave_a_batch_empty_or_no_worker_are_refused() {
        let mut too_few = options(1, 0);
        too_few.values = CHANNELS * 8 - 1;
        assert!(
            run(too_few)
                .err()
                .unwrap()
                .to_string()
                .contains("at least batches × 64 values")
        );
        assert!(run(options(0, 0)).is_err());
    }
}
