//! `qforge calibrate` (a calibration pass, coordinated on worker threads or
//! on a Redis cluster) and `qforge worker` (a cluster worker).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, ValueEnum};
use qforge_calib::{Pass, Recipe, Stratify};
use qforge_runner::cluster::{ClusterKey, RedisAddress, WorkerOptions, hostname, run_worker};
use qforge_runner::{Calibration, ClusterSettings, EmbeddedExecutor, Executor, RedisExecutor};

use crate::output::print_written;
use crate::terminal::Terminal;
use crate::{OutputFlags, OutputPath, UsageError};

/// `--pass`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PassArg {
    /// Histograms of every linear input.
    Activation,
    /// Histograms and per-channel abs-max (for smoothing).
    Smoothing,
}

/// Arguments of `qforge calibrate`.
#[derive(Args)]
pub struct CalibrateArgs {
    /// Model: GGUF file, Hugging Face directory, policy directory or ONNX
    /// policy (NAME.onnx, its head in NAME.policy.json).
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Calibration data: JSONL episodes (LLM) or trajectories (policy).
    #[arg(long, value_name = "FILE.jsonl")]
    data: PathBuf,
    /// Samples to draw: sequences for LLMs, observations for policies
    /// (500–2000 is the usual range).
    #[arg(long, default_value_t = 512)]
    samples: usize,
    /// Most tokens per sequence (LLMs).
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Samples per batch (the unit of work and of retries).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How samples are drawn.
    #[arg(long, value_enum, default_value_t = Stratify::None)]
    stratify: Stratify,
    /// What the pass records.
    #[arg(long, value_enum, default_value_t = PassArg::Activation)]
    pass: PassArg,
    #[command(flatten)]
    backend: BackendArgs,
    /// Write checkpoints under DIR/RUN/.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after this many merged batches.
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Name of the run (its checkpoint folder); default: derived from the
    /// model, data and recipe hashes.
    #[arg(long)]
    run: Option<String>,
    /// Continue run NAME from its newest readable checkpoint.
    #[arg(long, value_name = "NAME", requires = "checkpoint_dir")]
    resume: Option<String>,
    /// Accept statistics covering at least this fraction of the batches.
    #[arg(long, default_value_t = 1.0)]
    min_coverage: f64,
    /// Count and skip invalid data lines instead of failing.
    #[arg(long)]
    skip_invalid: bool,
    #[command(flatten)]
    output: OutputPath,
    #[command(flatten)]
    flags: OutputFlags,
}

/// Where a calibration pass runs: worker threads here, or a Redis cluster.
#[derive(Args)]
pub(crate) struct BackendArgs {
    /// Worker threads (default: available cores).
    #[arg(long, conflicts_with = "cluster")]
    pub workers: Option<usize>,
    /// Coordinate the run through Redis (redis://[:PASSWORD@]HOST:PORT):
    /// batches are observed by `qforge worker` processes on any machines.
    #[arg(long, value_name = "URL")]
    pub cluster: Option<String>,
    #[command(flatten)]
    pub password: RedisPasswordArgs,
    #[command(flatten)]
    pub key: ClusterKeyArgs,
    #[command(flatten)]
    pub settings: ClusterArgs,
}

/// Where the Redis password comes from when it is not in the URL.
#[derive(Args)]
pub(crate) struct RedisPasswordArgs {
    /// Read the Redis password from this file (its first line), so it shows
    /// neither in the URL nor in `ps`; the environment variable
    /// QFORGE_REDIS_PASSWORD does the same.
    #[arg(long, value_name = "FILE", requires = "cluster")]
    redis_password_file: Option<PathBuf>,
}

impl RedisPasswordArgs {
    /// The Redis at `url`, with the password from the file or the
    /// environment, if either gives one.
    fn address(&self, url: &str) -> Result<RedisAddress> {
        Ok(RedisAddress::with_password_from(
            url,
            self.redis_password_file.as_deref(),
        )?)
    }
}

/// Where the key that coordinator and workers share comes from.
#[derive(Args)]
pub(crate) struct ClusterKeyArgs {
    /// Read the cluster key, which seals every worker's results so that
    /// nothing else writing to Redis can have statistics merged, from this
    /// file (its first line, at least 32 characters). QFORGE_CLUSTER_KEY
    /// gives the key itself. Default: ~/.config/qforge/cluster.key, created
    /// on first use; copy it to every worker machine.
    #[arg(long, value_name = "FILE", requires = "cluster")]
    cluster_key_file: Option<PathBuf>,
}

impl ClusterKeyArgs {
    /// The key, saying so when this call created the default key file.
    fn key(&self) -> Result<ClusterKey> {
        let (key, created) = ClusterKey::load(self.cluster_key_file.as_deref())?;
        if let Some(path) = created {
            eprintln!(
                "qforge: created the cluster key {} (readable by you only); workers on other \
                 machines need a copy of it at the same place, or --cluster-key-file",
                path.display()
            );
        }
        Ok(key)
    }
}

/// Settings of a cluster run (ignored by the embedded backend).
#[derive(Args)]
pub(crate) struct ClusterArgs {
    /// Admit workers whose determinism fingerprint differs from the first
    /// worker's; the statistics are then exact only up to forward-pass rounding
    /// (and say so).
    #[arg(long, requires = "cluster")]
    allow_mixed_hardware: bool,
    /// Workers heartbeat this often (milliseconds).
    #[arg(long, default_value_t = 500, value_name = "MS")]
    heartbeat_ms: u64,
    /// A worker silent this long is dead and its batch is redone elsewhere
    /// (milliseconds).
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    heartbeat_timeout_ms: u64,
    /// Cap on executions, as a multiple of the planned batches: idle workers
    /// re-run the oldest in-flight batches speculatively up to this bound.
    #[arg(long, default_value_t = 1.2)]
    speculation: f64,
    /// Fail when Redis stays unreachable this long (seconds).
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    outage_limit: f64,
    /// Batches per task, which a worker merges and publishes as one result
    /// (fewer, larger results for the coordinator to merge; a dead worker
    /// loses a whole task). Default: sized from the coordinator's time per
    /// result and the workers' time per batch, one while those are unknown.
    #[arg(long, value_name = "N", requires = "cluster")]
    batches_per_task: Option<NonZeroUsize>,
}

impl BackendArgs {
    /// The executor these flags name: threads here, or the Redis run `run`
    /// (`None`: named after the inputs' hashes), resumed if `resume`.
    pub fn executor(&self, run: Option<String>, resume: bool) -> Result<Box<dyn Executor>> {
        if self.workers == Some(0) {
            return Err(UsageError("--workers must be at least 1".into()).into());
        }
        let s = &self.settings;
        if !(s.outage_limit.is_finite() && s.outage_limit > 0.0) {
            return Err(UsageError("--outage-limit must be positive".into()).into());
        }
        let settings = ClusterSettings {
            heartbeat: Duration::from_millis(s.heartbeat_ms),
            heartbeat_timeout: Duration::from_millis(s.heartbeat_timeout_ms),
            allow_mixed_hardware: s.allow_mixed_hardware,
            speculation: s.speculation,
            outage_limit: Duration::from_secs_f64(s.outage_limit),
            batches_per_task: s.batches_per_task,
        };
        settings.validate()?;
        Ok(match &self.cluster {
            Some(url) => Box::new(RedisExecutor::new(
                self.password.address(url)?,
                self.key.key()?,
                run,
                resume,
                settings,
            )),
            None => Box::new(
                self.workers
                    .map_or_else(EmbeddedExecutor::per_core, |threads| EmbeddedExecutor {
                        threads,
                    }),
            ),
        })
    }
}

/// `qforge calibrate`.
pub fn calibrate(args: CalibrateArgs) -> Result<()> {
    let run = args.resume.clone().or(args.run);
    let calibration = Calibration {
        model: args.model,
        data: args.data,
        recipe: Recipe {
            samples: args.samples,
            seq_len: args.seq_len,
            batch_size: args.batch_size,
            seed: args.seed,
            stratify: args.stratify,
            pass: match args.pass {
                PassArg::Activation => Pass::Activation,
                PassArg::Smoothing => Pass::Smoothing,
            },
        },
        skip_invalid: args.skip_invalid,
        run: run.clone(),
        checkpoint_dir: args.checkpoint_dir,
        checkpoint_every: args.checkpoint_every,
        resume: args.resume.is_some(),
        min_coverage: args.min_coverage,
    };
    // Refuse a bad request before connecting to a cluster.
    calibration.validate()?;
    let executor = args.backend.executor(run, calibration.resume)?;
    let mut terminal = Terminal::new(args.flags.json);
    let calibrated = calibration.run(executor.as_ref(), &args.output.output, &mut terminal)?;
    drop(terminal);
    print_written(&args.output.output, &calibrated.report(), args.flags)
}

/// Arguments of `qforge worker`.
#[derive(Args)]
pub struct WorkerArgs {
    /// The Redis the coordinator uses (redis://[:PASSWORD@]HOST:PORT).
    #[arg(long, value_name = "URL")]
    cluster: String,
    #[command(flatten)]
    password: RedisPasswordArgs,
    #[command(flatten)]
    key: ClusterKeyArgs,
    /// Join this run (default: whichever run is active).
    #[arg(long)]
    run: Option<String>,
    /// Keep serving runs after one finishes.
    #[arg(long)]
    forever: bool,
    /// This worker's name, unique in the run (default: HOST-PID).
    #[arg(long)]
    name: Option<String>,
    /// Seconds to wait for a run to start.
    #[arg(long, default_value_t = 600.0, value_name = "SECS")]
    wait: f64,
    /// Fail when Redis stays unreachable this long (seconds).
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    outage_limit: f64,
}

/// `qforge worker`.
pub fn worker(args: WorkerArgs) -> Result<()> {
    if !(args.wait.is_finite()
        && args.wait >= 0.0
        && args.outage_limit.is_finite()
        && args.outage_limit > 0.0)
    {
        return Err(UsageError("--wait must be ≥ 0 and --outage-limit positive".into()).into());
    }
    let host = hostname();
    let options = WorkerOptions {
        redis: args.password.address(&args.cluster)?,
        run: args.run,
        name: args
            .name
            .unwrap_or_else(|| format!("{host}-{}", std::process::id())),
        forever: args.forever,
        wait: Duration::from_secs_f64(args.wait),
        outage_limit: Duration::from_secs_f64(args.outage_limit),
        key: args.key.key()?,
    };
    let name = options.name.clone();
    let report = run_worker(&options, &mut |line| {
        eprintln!("qforge worker {name}: {line}");
    })?;
    eprintln!(
        "qforge worker {name}: served {} run(s), {} batch(es), {} failed",
        report.runs, report.batches, report.failed
    );
    Ok(())
}
