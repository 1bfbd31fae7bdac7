//! What a run did and how far it has got: the records the coordinator and the
//! merger both write, and that executors, the CLI and `report.json` read.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use qforge_calib::{Job, Session, Stratum};
use qforge_core::{BatchId, Stats};
use serde::Serialize;

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
pub struct WorkerAccount {
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
    pub workers: BTreeMap<String, WorkerAccount>,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Every result delivered in this session, in arrival order (the
    /// workers' timeline).
    pub timeline: Vec<Delivery>,
}

/// A calibration pass as `qforge calibrate` reports it: its run record, its
/// plan and the hashes the statistics carry. JSON through `Serialize`; the
/// line a person reads through `Display`.
#[derive(Serialize)]
pub struct PassReport<'a> {
    run: &'a str,
    backend: &'a str,
    planned_batches: usize,
    merged_batches: usize,
    coverage: f64,
    resumed_batches: usize,
    duplicates: usize,
    quarantined_results: usize,
    retries: usize,
    speculative_executions: usize,
    mixed_hardware: bool,
    quarantined: Vec<Quarantined<'a>>,
    checkpoints_written: usize,
    samples: usize,
    rows: usize,
    seconds: f64,
    rows_per_s: f64,
    /// Which rewards the samples came from (`Stratify::Reward`; empty
    /// otherwise), lowest first.
    reward_strata: &'a [Stratum],
    workers: BTreeMap<&'a str, WorkerRate<'a>>,
    model_sha256: String,
    data_sha256: String,
    recipe_sha256: String,
    /// Workers the pass ran on (threads, or cluster workers that reported).
    #[serde(skip)]
    worker_count: usize,
}

#[derive(Serialize)]
struct Quarantined<'a> {
    batch: String,
    error: &'a Failure,
}

#[derive(Serialize)]
struct WorkerRate<'a> {
    #[serde(flatten)]
    account: &'a WorkerAccount,
    batches_per_s: f64,
}

impl RunSummary {
    /// The report of this pass of `job` over `session`'s plan, run as `run`
    /// on `backend` with `worker_count` workers.
    pub fn report<'a>(
        &'a self,
        session: &'a Session,
        job: &Job,
        run: &'a str,
        backend: &'a str,
        worker_count: usize,
    ) -> PassReport<'a> {
        let plan = &session.plan;
        PassReport {
            run,
            backend,
            planned_batches: self.planned,
            merged_batches: self.merged,
            coverage: self.coverage,
            resumed_batches: self.resumed,
            duplicates: self.duplicates,
            quarantined_results: self.quarantined_results,
            retries: self.retries,
            speculative_executions: self.speculative,
            mixed_hardware: self.stats.provenance.mixed_hardware,
            quarantined: self
                .quarantined
                .iter()
                .map(|(id, error)| Quarantined {
                    batch: id.to_string(),
                    error,
                })
                .collect(),
            checkpoints_written: self.checkpoints_written,
            samples: plan.samples,
            rows: plan.rows,
            seconds: self.seconds,
            rows_per_s: plan.rows as f64 / self.seconds.max(1e-9),
            reward_strata: &plan.strata,
            workers: self
                .workers
                .iter()
                .map(|(name, account)| {
                    let rate = account.merged as f64 / account.busy_seconds.max(1e-9);
                    let rate = WorkerRate {
                        account,
                        batches_per_s: rate,
                    };
                    (name.as_str(), rate)
                })
                .collect(),
            model_sha256: job.model.to_hex(),
            data_sha256: job.data.to_hex(),
            recipe_sha256: job.recipe.digest().to_hex(),
            worker_count,
        }
    }
}

impl fmt::Display for PassReport<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} batches ({:.1} % coverage), {} samples, {} rows in {:.1} s with {} workers",
            self.merged_batches,
            self.planned_batches,
            100.0 * self.coverage,
            self.samples,
            self.rows,
            self.seconds,
            self.worker_count,
        )?;
        if self.resumed_batches > 0 {
            let resumed = self.resumed_batches;
            write!(f, ", {resumed} batches resumed from a checkpoint")?;
        }
        if !self.reward_strata.is_empty() {
            let strata: Vec<String> = self
                .reward_strata
                .iter()
                .map(|s| {
                    let (lo, hi) = (s.min_reward, s.max_reward);
                    format!("[{lo}, {hi}] {}/{}", s.drawn, s.available)
                })
                .collect();
            let strata = strata.join(", ");
            write!(f, "\nreward strata (rewards, drawn/available): {strata}")?;
        }
        Ok(())
    }
}
