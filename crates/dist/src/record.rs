//! What a run did and how far it has got: the records the coordinator and the
//! merger both write, and that executors, the CLI and `report.json` read.

use std::collections::BTreeMap;
use std::path::PathBuf;

use qforge_core::{BatchId, Stats};

use crate::backend::Failure;

/// Attempts a batch gets before it is quarantined.
pub const MAX_ATTEMPTS: u32 = 3;

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
