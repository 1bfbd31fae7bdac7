//! The coordinator: hands a plan to a backend, merges each batch id exactly
//! once, retries and quarantines failures, checkpoints, and enforces coverage.
//! The reduce step itself is the `Merger` (in `merger.rs`); [`run`] only
//! drives it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use qforge_calib::{Job, Plan};
use qforge_core::{BatchId, Stats};

use crate::backend::{Backend, Failure};
use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};
use crate::merger::Merger;

/// Attempts a batch gets before it is quarantined.
pub const MAX_ATTEMPTS: u32 = 3;

/// How a run is coordinated.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Where to checkpoint, if anywhere.
    pub checkpoints: Option<CheckpointStore>,
    /// Checkpoint after this many newly merged batches.
    pub checkpoint_every: usize,
    /// Continue from the newest readable checkpoint in `checkpoints`.
    pub resume: bool,
    /// Fraction of planned batches that must be merged (1.0: all).
    pub min_coverage: f64,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            checkpoints: None,
            checkpoint_every: 50,
            resume: false,
            min_coverage: 1.0,
        }
    }
}

/// Progress after each outcome.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Batches merged, including those restored from a checkpoint.
    pub merged: usize,
    /// Batches planned.
    pub planned: usize,
    /// Retries so far.
    pub retries: usize,
    /// Workers of the backend.
    pub workers: usize,
}

/// Per-worker accounting (`report.json` and `qforge calibrate --json` print it
/// as it is, keyed by worker name).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct WorkerReport {
    /// Batches whose results were merged.
    pub merged: usize,
    /// Results dropped as duplicates.
    pub duplicates: usize,
    /// Failures.
    pub failures: usize,
    /// Seconds spent observing.
    pub busy_seconds: f64,
}

/// One result a worker delivered, in arrival order.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Delivery {
    /// The worker.
    pub worker: String,
    /// The batch's index in the plan.
    pub batch: usize,
    /// Seconds from the start of the run to its arrival.
    pub at_seconds: f64,
    /// Seconds the worker spent observing it.
    pub busy_seconds: f64,
    /// Merged (false: a duplicate, dropped).
    pub merged: bool,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// The merged statistics.
    pub stats: Stats,
    /// Batches planned.
    pub planned: usize,
    /// Batches merged (equal to `planned` at full coverage).
    pub merged: usize,
    /// merged / planned.
    pub coverage: f64,
    /// Batches restored from a checkpoint.
    pub resumed: usize,
    /// The checkpoint resumed from.
    pub resumed_from: Option<PathBuf>,
    /// Results dropped because their batch was already merged.
    pub duplicates: usize,
    /// Results refused as forged, corrupt or foreign (by the merge, or by
    /// the backend before it): each is in the warnings (the first few) and
    /// counts as a failed attempt of its batch, which is observed again.
    pub quarantined_results: usize,
    /// Retries of failed batches.
    pub retries: usize,
    /// Results of speculative re-executions received (merged or dropped).
    pub speculative: usize,
    /// Batches that failed `MAX_ATTEMPTS` times, with their last error.
    pub quarantined: BTreeMap<BatchId, Failure>,
    /// Checkpoints written.
    pub checkpoints_written: usize,
    /// Warnings (e.g. an unreadable checkpoint skipped).
    pub warnings: Vec<String>,
    /// Accounting per worker.
    pub workers: BTreeMap<String, WorkerReport>,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Every result delivered in this session, in arrival order (the
    /// workers' timeline).
    pub timeline: Vec<Delivery>,
}

/// Runs `plan` for `job` on `backend`.
pub fn run(
    job: &Job,
    plan: &Plan,
    backend: &dyn Backend,
    options: &RunOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunSummary> {
    // Without a store there is nothing to resume from, so every merge is as
    // durable as it will get and the backend may forget it at once.
    let every = match options.checkpoints {
        Some(_) => options.checkpoint_every,
        None => 1,
    };
    let mut merger = Merger::new(plan, every);
    if options.resume {
        resume(&mut merger, job, options)?;
    }
    let pending = merger.pending();
    progress(merger.progress(backend.workers()));
    if !pending.is_empty() {
        backend.run(plan, &pending, &mut |outcome| {
            let next = merger.accept(outcome)?;
            if merger.checkpoint_due() {
                merger.checkpoint(options.checkpoints.as_ref())?;
                backend.committed()?;
            }
            progress(merger.progress(backend.workers()));
            Ok(next)
        })?;
    }
    if let Some(store) = &options.checkpoints
        && merger.has_unsaved()
    {
        merger.checkpoint(Some(store))?;
        backend.committed()?;
    }
    merger.warn(backend.warnings());
    let mut summary = merger.finish(options.min_coverage)?;
    summary.quarantined_results += backend.refused_results();
    Ok(summary)
}

/// Restores the newest readable checkpoint into `merger`. Resuming without a
/// checkpoint directory is an error; a directory with no readable checkpoint
/// only warns, and the run starts from scratch.
fn resume(merger: &mut Merger<'_>, job: &Job, options: &RunOptions) -> Result<()> {
    let store = options
        .checkpoints
        .as_ref()
        .ok_or_else(|| Error::Checkpoint {
            path: "-".into(),
            reason: "resuming needs a checkpoint directory".into(),
        })?;
    let (latest, skipped) = store.latest()?;
    merger.warn(skipped);
    match latest {
        Some((path, stats)) => merger.restore(job, path, stats),
        None => {
            merger.warn([format!(
                "no readable checkpoint in {}; starting from scratch",
                store.dir().display()
            )]);
            Ok(())
        }
    }
}
