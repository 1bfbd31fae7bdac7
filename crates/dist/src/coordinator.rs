//! The coordinator: hands a plan to a backend, merges each batch id exactly
//! once, retries and quarantines failures, checkpoints, and enforces coverage.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use qforge_calib::{Job, Plan};
use qforge_core::{BatchId, MergePolicy, Provenance, Stats};

use crate::backend::{Backend, Next, Outcome};
use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};

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

/// Per-worker accounting.
#[derive(Debug, Clone, Default, PartialEq)]
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
#[derive(Debug, Clone, PartialEq)]
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
    /// Retries of failed batches.
    pub retries: usize,
    /// Results of speculative re-executions received (merged or dropped).
    pub speculative: usize,
    /// Batches that failed `MAX_ATTEMPTS` times, with their last error.
    pub quarantined: BTreeMap<BatchId, String>,
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
    let started = Instant::now();
    let planned = plan.batches.len();
    let ids: BTreeMap<BatchId, usize> = plan
        .batches
        .iter()
        .enumerate()
        .map(|(i, b)| (b.id, i))
        .collect();
    let mut merged_stats = Stats::default();
    let mut warnings = Vec::new();
    let mut resumed_from = None;
    if options.resume {
        let store = options
            .checkpoints
            .as_ref()
            .ok_or_else(|| Error::Checkpoint {
                path: "-".into(),
                reason: "resuming needs a checkpoint directory".into(),
            })?;
        let (latest, skipped) = store.latest()?;
        warnings.extend(skipped);
        match latest {
            Some((path, stats)) => {
                check_checkpoint(&stats.provenance, job, &ids, &path)?;
                merged_stats = stats;
                resumed_from = Some(path);
            }
            None => warnings.push(format!(
                "no readable checkpoint in {}; starting from scratch",
                store.dir().display()
            )),
        }
    }
    let resumed = merged_stats.provenance.batches.len();
    let mut done: BTreeSet<BatchId> = merged_stats.provenance.batches.clone();
    let pending: Vec<usize> = (0..planned)
        .filter(|&i| !done.contains(&plan.batches[i].id))
        .collect();

    let mut attempts: BTreeMap<usize, u32> = BTreeMap::new();
    let mut quarantined = BTreeMap::new();
    let mut workers: BTreeMap<String, WorkerReport> = BTreeMap::new();
    let mut timeline = Vec::new();
    let (mut duplicates, mut retries, mut speculative) = (0, 0, 0);
    let (mut since_checkpoint, mut checkpoints_written) = (0, 0);
    let mut unresolved = pending.len();
    progress(Progress {
        merged: done.len(),
        planned,
        retries,
        workers: backend.workers(),
    });
    if !pending.is_empty() {
        backend.run(plan, &pending, &mut |outcome| {
            let next = match outcome {
                Outcome::Done {
                    batch,
                    stats,
                    worker,
                    elapsed,
                    speculative: was_speculative,
                } => {
                    speculative += usize::from(was_speculative);
                    let report = workers.entry(worker.clone()).or_default();
                    report.busy_seconds += elapsed.as_secs_f64();
                    let claimed: Vec<BatchId> = stats.provenance.batches.iter().copied().collect();
                    let id = plan.batches.get(batch).map(|b| b.id);
                    if claimed.len() != 1 || Some(claimed[0]) != id {
                        return Err(Error::ForeignResult {
                            worker,
                            batch: claimed
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(","),
                        });
                    }
                    let merged = done.insert(claimed[0]);
                    timeline.push(Delivery {
                        worker: worker.clone(),
                        batch,
                        at_seconds: started.elapsed().as_secs_f64(),
                        busy_seconds: elapsed.as_secs_f64(),
                        merged,
                    });
                    if !merged {
                        // A retry or speculative copy that lost the race.
                        report.duplicates += 1;
                        duplicates += 1;
                        Next::Continue
                    } else {
                        merged_stats.merge(&stats, MergePolicy::Strict)?;
                        report.merged += 1;
                        unresolved -= 1;
                        since_checkpoint += 1;
                        if let Some(store) = &options.checkpoints
                            && since_checkpoint >= options.checkpoint_every
                        {
                            store.write(done.len() as u64, &merged_stats)?;
                            checkpoints_written += 1;
                            since_checkpoint = 0;
                            backend.committed()?;
                        } else if options.checkpoints.is_none() {
                            backend.committed()?;
                        }
                        if unresolved == 0 {
                            Next::Stop
                        } else {
                            Next::Continue
                        }
                    }
                }
                Outcome::Failed {
                    batch,
                    worker,
                    error,
                } => {
                    workers.entry(worker).or_default().failures += 1;
                    let id = plan.batches[batch].id;
                    if done.contains(&id) || quarantined.contains_key(&id) {
                        Next::Continue
                    } else {
                        let tries = attempts.entry(batch).or_insert(0);
                        *tries += 1;
                        if *tries < MAX_ATTEMPTS {
                            retries += 1;
                            Next::Retry(batch)
                        } else {
                            quarantined.insert(id, error);
                            unresolved -= 1;
                            if unresolved == 0 {
                                Next::Stop
                            } else {
                                Next::Continue
                            }
                        }
                    }
                }
            };
            progress(Progress {
                merged: done.len(),
                planned,
                retries,
                workers: backend.workers(),
            });
            Ok(next)
        })?;
    }
    if let Some(store) = &options.checkpoints
        && since_checkpoint > 0
    {
        store.write(done.len() as u64, &merged_stats)?;
        checkpoints_written += 1;
        backend.committed()?;
    }
    warnings.extend(backend.warnings());
    let merged = done.len();
    let coverage = if planned == 0 {
        1.0
    } else {
        merged as f64 / planned as f64
    };
    if coverage < options.min_coverage {
        let missing: Vec<String> = plan
            .batches
            .iter()
            .filter(|b| !done.contains(&b.id))
            .take(8)
            .map(|b| match quarantined.get(&b.id) {
                Some(e) => format!("{} (quarantined: {e})", b.id),
                None => b.id.to_string(),
            })
            .collect();
        return Err(Error::Coverage {
            merged,
            planned,
            required: options.min_coverage,
            missing: missing.join(", "),
        });
    }
    Ok(RunSummary {
        stats: merged_stats,
        planned,
        merged,
        coverage,
        resumed,
        resumed_from,
        duplicates,
        retries,
        speculative,
        quarantined,
        checkpoints_written,
        warnings,
        workers,
        seconds: started.elapsed().as_secs_f64(),
        timeline,
    })
}

/// A checkpoint may only resume the run it was written by.
fn check_checkpoint(
    provenance: &Provenance,
    job: &Job,
    ids: &BTreeMap<BatchId, usize>,
    path: &std::path::Path,
) -> Result<()> {
    let expected = Provenance::single(
        Some(job.model),
        job.data,
        job.recipe.digest(),
        job.recipe.pass.name(),
        BatchId {
            index: 0,
            content: job.data,
        },
        job.planned,
    );
    let same_source = provenance.models == expected.models
        && provenance.data == expected.data
        && provenance.recipes == expected.recipes
        && provenance.passes == expected.passes
        && provenance.planned == expected.planned
        && !provenance.forced;
    if !same_source {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: "it belongs to a different model, data or recipe; use another --checkpoint-dir or run name".into(),
        });
    }
    if let Some(foreign) = provenance.batches.iter().find(|b| !ids.contains_key(b)) {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            reason: format!("it holds batch {foreign}, which is not in this run's plan"),
        });
    }
    Ok(())
}
