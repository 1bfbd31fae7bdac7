//! The job spec a coordinator publishes and every worker follows.

use qforge_calib::{Job, Plan, Recipe};
use serde::{Deserialize, Serialize};

/// A file workers must reach, with the hash they must find there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRef {
    /// Absolute path (a shared filesystem) of the file or model directory.
    pub path: String,
    /// Its SHA-256 content digest, hex.
    pub sha256: String,
}

/// Everything a worker needs to join a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// Always `qforge-run`.
    pub format: String,
    /// Version of this spec (1).
    pub version: u32,
    /// The run's name.
    pub run: String,
    /// The model.
    pub model: FileRef,
    /// The calibration data.
    pub data: FileRef,
    /// Whether invalid data lines are skipped (otherwise they fail the run).
    pub skip_invalid: bool,
    /// The recipe.
    pub recipe: Recipe,
    /// Batches in the plan.
    pub planned: u64,
    /// [`qforge_calib::Plan::digest`] of the coordinator's plan, hex.
    pub plan_sha256: String,
    /// Heartbeat interval, milliseconds.
    pub heartbeat_ms: u64,
    /// A worker silent for this long is dead, milliseconds.
    pub heartbeat_timeout_ms: u64,
    /// Admit workers whose determinism fingerprint differs.
    pub allow_mixed_hardware: bool,
    /// Cap on total executions as a multiple of the planned batches (1.2:
    /// at most 20 % speculative re-executions).
    pub speculation: f64,
}

impl RunSpec {
    /// The format name.
    pub const FORMAT: &'static str = "qforge-run";
    /// The version this build writes and reads.
    pub const VERSION: u32 = 1;

    /// The spec of `job` over `plan`, with the default settings: heartbeat
    /// every 500 ms, dead after 2 s, no mixed hardware, speculation up to
    /// 1.2× the planned work.
    pub fn new(run: &str, model_path: &str, data_path: &str, job: &Job, plan: &Plan) -> Self {
        Self {
            format: Self::FORMAT.into(),
            version: Self::VERSION,
            run: run.into(),
            model: FileRef {
                path: model_path.into(),
                sha256: job.model.to_hex(),
            },
            data: FileRef {
                path: data_path.into(),
                sha256: job.data.to_hex(),
            },
            skip_invalid: false,
            recipe: job.recipe.clone(),
            planned: job.planned,
            plan_sha256: plan.digest().to_hex(),
            heartbeat_ms: 500,
            heartbeat_timeout_ms: 2000,
            allow_mixed_hardware: false,
            speculation: 1.2,
        }
    }

    /// Whether two specs describe the same calibration (heartbeat and
    /// admission settings may differ between a crashed coordinator and the
    /// one resuming it).
    pub fn same_job(&self, other: &RunSpec) -> bool {
        self.model.sha256 == other.model.sha256
            && self.data.sha256 == other.data.sha256
            && self.recipe == other.recipe
            && self.plan_sha256 == other.plan_sha256
    }

    /// Whether a worker that loaded `self` holds exactly what `other` needs:
    /// the same files at the same paths with the same hashes, and the same
    /// recipe (so the same plan).
    pub fn same_inputs(&self, other: &RunSpec) -> bool {
        self.model == other.model
            && self.data == other.data
            && self.skip_invalid == other.skip_invalid
            && self.recipe == other.recipe
            && self.plan_sha256 == other.plan_sha256
    }

    /// Most speculative executions the run allows.
    pub fn speculation_cap(&self) -> u64 {
        ((self.speculation - 1.0).max(0.0) * self.planned as f64).ceil() as u64
    }
}
