//! One calibration pass written to a statistics file: what `qforge
//! calibrate` and the Python package's `qforge.calibrate` run, on any
//! [`Executor`].

use std::path::{Path, PathBuf};

use qforge_calib::{Job, Recipe, Session};
use qforge_core::codec::encode;
use qforge_formats::output::write_atomic;

use crate::checkpoint::CheckpointStore;
use crate::coordinator::RunOptions;
use crate::error::{Error, Result};
use crate::executor::{Executor, Listener, PassPosition};
use crate::record::{PassReport, RunSummary};

/// A calibration pass as asked for.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The model (any format [`qforge_model::open`] takes).
    pub model: PathBuf,
    /// The calibration data (JSONL).
    pub data: PathBuf,
    /// What is sampled and recorded.
    pub recipe: Recipe,
    /// Count and skip invalid data lines instead of failing.
    pub skip_invalid: bool,
    /// The run's name: its checkpoint folder and, on a cluster, the run its
    /// workers join. `None`: derived from the inputs' hashes
    /// ([`Session::run_name`]), so a rerun finds its checkpoints.
    pub run: Option<String>,
    /// Checkpoints go under `DIR/RUN/`.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after this many merged batches.
    pub checkpoint_every: usize,
    /// Continue run `run` from its newest readable checkpoint.
    pub resume: bool,
    /// Accept statistics covering at least this fraction of the batches.
    pub min_coverage: f64,
}

impl Calibration {
    /// `recipe` over `data` with `model`: every batch, no checkpoints.
    pub fn new(model: PathBuf, data: PathBuf, recipe: Recipe) -> Self {
        let defaults = RunOptions::default();
        Self {
            model,
            data,
            recipe,
            skip_invalid: false,
            run: None,
            checkpoint_dir: None,
            checkpoint_every: defaults.checkpoint_every,
            resume: false,
            min_coverage: defaults.min_coverage,
        }
    }

    /// Checks the request before anything is loaded; the error names the
    /// setting.
    pub fn validate(&self) -> Result<()> {
        let request = |why: &str| Err(Error::Request(why.into()));
        if let Err(e) = self.recipe.validate() {
            return request(&e.to_string());
        }
        if !(0.0..=1.0).contains(&self.min_coverage) {
            return request("min_coverage must be in [0, 1]");
        }
        if self.checkpoint_every == 0 {
            return request("checkpoint_every must be at least 1");
        }
        if self.resume && (self.checkpoint_dir.is_none() || self.run.is_none()) {
            return request("resuming needs the run's name and its checkpoint directory");
        }
        Ok(())
    }

    /// Runs the pass on `executor` and writes the merged statistics to
    /// `output` (`.qstats`, atomically). `listener` hears the session's
    /// warnings, the pass's events and the run's warnings.
    pub fn run(
        &self,
        executor: &dyn Executor,
        output: &Path,
        listener: &mut dyn Listener,
    ) -> Result<Calibrated> {
        self.validate()?;
        let session = Session::open(
            &self.model,
            &self.data,
            &self.recipe,
            self.skip_invalid,
            executor.weights(),
        )?;
        for warning in session.warnings() {
            listener.message(&format!("warning: {warning}"));
        }
        let job = session.job(&self.recipe, &[]);
        let run = self.run.clone().unwrap_or_else(|| session.run_name());
        let options = RunOptions {
            checkpoints: (self.checkpoint_dir.as_ref())
                .map(|dir| CheckpointStore::new(dir.join(&run))),
            checkpoint_every: self.checkpoint_every,
            resume: self.resume,
            min_coverage: self.min_coverage,
        };
        let position = PassPosition::ONLY;
        let summary = executor.run_pass(&session, &job, position, &options, &mut |event| {
            listener.pass_event(position, &event)
        })?;
        for warning in &summary.warnings {
            listener.message(&format!("warning: {warning}"));
        }
        write_atomic(output, &encode(&summary.stats))?;
        Ok(Calibrated {
            workers: executor.workers(&summary),
            backend: executor.name(),
            session,
            job,
            summary,
            run,
        })
    }
}

/// A finished calibration pass, its statistics written.
pub struct Calibrated {
    /// The data, plan and model hashes the pass ran over.
    pub session: Session,
    /// The pass's job.
    pub job: Job,
    /// What the run did, with the merged statistics.
    pub summary: RunSummary,
    /// The run's name.
    pub run: String,
    /// The executor's name (`embedded`, `redis`).
    pub backend: &'static str,
    /// Workers the pass ran on.
    pub workers: usize,
}

impl Calibrated {
    /// The report `qforge calibrate` prints.
    pub fn report(&self) -> PassReport<'_> {
        (self.summary).report(
            &self.session,
            &self.job,
            &self.run,
            self.backend,
            self.workers,
        )
    }
}
