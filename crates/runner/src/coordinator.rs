//! The coordinator: hands a plan to a backend, merges each batch id exactly
//! once, retries and quarantines failures, checkpoints, and enforces coverage.
//! The reduce step itself is the `Merger` (in `merger.rs`); [`run`] only
//! drives it.

use qforge_calib::{Job, Plan};

use crate::backend::Backend;
use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};
use crate::merger::Merger;
use crate::record::{Progress, RunSummary};

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
