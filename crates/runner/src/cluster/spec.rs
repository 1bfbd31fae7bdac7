//! The job spec a coordinator publishes and every worker follows.

use std::path::Path;

use qforge_calib::{Job, Pass, Recipe, Session, Transform};
use serde::{Deserialize, Serialize};

use super::auth;
use crate::error::{Error, Result};

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
    /// The pipeline's run (its first pass's; a single pass's is its own),
    /// under whose hash tag lie the keys every pass of the pipeline reads:
    /// GPTQ's roundings, for `gptq.sequential`.
    pub pipeline: String,
    /// The model.
    pub model: FileRef,
    /// The calibration data.
    pub data: FileRef,
    /// Whether invalid data lines are skipped (otherwise they fail the run).
    pub skip_invalid: bool,
    /// The recipe.
    pub recipe: Recipe,
    /// What earlier passes of the pipeline changed in the model, applied in
    /// order by every worker before observing.
    pub transforms: Vec<Transform>,
    /// The run of the pipeline's next pass, which workers of this one
    /// follow into (`None`: the last pass).
    pub next_pass: Option<String>,
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
    /// The random nonce from which coordinator and workers derive the run
    /// key that seals results (see [`super::auth`]), hex.
    pub nonce: String,
    /// Proof that a worker derived the coordinator's run key: the
    /// coordinator's [`super::auth::RunKey::check_value`].
    pub key_check: String,
}

impl RunSpec {
    /// The format name.
    pub const FORMAT: &'static str = "qforge-run";
    /// The version this build writes and reads (2: transforms and the next
    /// pass; 3: tasks of several batches, whose entries name `batches` and
    /// `ids`; 4: the pipeline's run, where GPTQ's roundings are; 5: results
    /// sealed under a run key, the nonce and key check).
    pub const VERSION: u32 = 5;

    /// The spec of `job` over the plan of `session`, with the default
    /// settings: heartbeat every 500 ms, dead after 2 s, no mixed hardware,
    /// speculation up to 1.2× the planned work, a fresh nonce and no key
    /// check yet (the coordinator's backend writes it). Paths are made
    /// absolute, as workers on other machines must find them.
    pub fn new(run: &str, session: &Session, job: &Job) -> Result<Self> {
        Ok(Self {
            format: Self::FORMAT.into(),
            version: Self::VERSION,
            run: run.into(),
            pipeline: run.into(),
            model: FileRef {
                path: absolute(&session.model_path)?,
                sha256: session.model_digest.to_hex(),
            },
            data: FileRef {
                path: absolute(&session.data_path)?,
                sha256: session.data.digest.to_hex(),
            },
            skip_invalid: session.skip_invalid,
            recipe: job.recipe.clone(),
            transforms: job.transforms.clone(),
            next_pass: None,
            planned: job.planned,
            plan_sha256: session.plan.digest().to_hex(),
            heartbeat_ms: 500,
            heartbeat_timeout_ms: 2000,
            allow_mixed_hardware: false,
            speculation: 1.2,
            nonce: auth::new_nonce(),
            key_check: String::new(),
        })
    }

    /// Whether two specs describe the same calibration (heartbeat and
    /// admission settings may differ between a crashed coordinator and the
    /// one resuming it).
    pub fn same_job(&self, other: &RunSpec) -> bool {
        self.model.sha256 == other.model.sha256
            && self.data.sha256 == other.data.sha256
            && self.recipe == other.recipe
            && self.transforms == other.transforms
            && self.plan_sha256 == other.plan_sha256
    }

    /// Whether a worker that loaded `self` holds exactly what `other` needs:
    /// the same files at the same paths with the same hashes, and a recipe
    /// that differs at most in what the pass records (so the same plan).
    /// Transforms are applied to what was loaded, so they may differ.
    pub fn same_inputs(&self, other: &RunSpec) -> bool {
        let sampling = |r: &Recipe| Recipe {
            pass: Pass::Activation,
            ..r.clone()
        };
        self.model == other.model
            && self.data == other.data
            && self.skip_invalid == other.skip_invalid
            && sampling(&self.recipe) == sampling(&other.recipe)
            && self.plan_sha256 == other.plan_sha256
    }

    /// Most batches the run allows to be re-executed speculatively.
    pub fn speculation_cap(&self) -> u64 {
        ((self.speculation - 1.0).max(0.0) * self.planned as f64).ceil() as u64
    }
}

/// The absolute form of `path`, as workers on other machines must find it.
fn absolute(path: &Path) -> Result<String> {
    let resolved = std::fs::canonicalize(path)
        .map_err(|e| Error::Cluster(format!("cannot resolve {}: {e}", path.display())))?;
    resolved
        .to_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::Cluster(format!("{} is not valid UTF-8", resolved.display())))
}
