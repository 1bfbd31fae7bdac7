//! `qforge calibrate` (a calibration pass, coordinated on worker threads or
//! on a Redis cluster) and `qforge worker` (a cluster worker).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

use qforge_calib::{
    Dataset, EpisodeContent, Job, Pass, Plan, Recipe, Stratify, Target, load_jsonl, plan,
};
use qforge_core::codec::encode;
use qforge_core::{Digest, DigestBuilder};
use qforge_dist::cluster::{
    ClusterOptions, Prepared, RedisBackend, RunSpec, WorkerOptions, hostname, serve,
};
use qforge_dist::{Backend, CheckpointStore, Embedded, RunOptions, RunSummary, run};
use serde_json::json;

use qforge_model::TextSide;

use crate::model_cmd::{AnyModel, load_model};
use crate::output::write_atomic;
use crate::{OutputFlags, OutputPath, UsageError};

/// `--stratify`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StratifyArg {
    /// Seeded shuffle.
    None,
    /// Evenly across reward quantiles (every record needs a reward).
    Reward,
}

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
    /// Model: GGUF file, Hugging Face directory or policy directory.
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
    #[arg(long, value_enum, default_value_t = StratifyArg::None)]
    stratify: StratifyArg,
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
    /// Continue run NAME from its newest readable checkpoint (needs
    /// --checkpoint-dir).
    #[arg(long, value_name = "NAME")]
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
    pub settings: ClusterSettings,
}

/// Settings of a cluster run (ignored by the embedded backend).
#[derive(Args)]
pub(crate) struct ClusterSettings {
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
}

/// SHA-256 over the files that make up a model.
pub fn model_digest(path: &Path) -> Result<Digest> {
    let mut files: Vec<PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .with_context(|| format!("cannot list {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                name.ends_with(".safetensors") || name.ends_with(".json")
            })
            .collect()
    } else {
        vec![path.to_owned()]
    };
    files.sort();
    let mut digest = DigestBuilder::default();
    // Streamed: a model can be far larger than memory allows reading at once.
    let mut buffer = vec![0u8; 1 << 20];
    for file in files {
        let mut reader = std::fs::File::open(&file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        digest.update(file.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        loop {
            let n = std::io::Read::read(&mut reader, &mut buffer)
                .with_context(|| format!("cannot read {}", file.display()))?;
            if n == 0 {
                break;
            }
            digest.update(&buffer[..n]);
        }
    }
    Ok(digest.finish())
}

/// A calibration loaded from its inputs: the same on the coordinator and on
/// every worker. `model` is `None` where only the plan was needed (a cluster
/// coordinator reads the tokenizer, never the weights).
pub(crate) struct Loaded {
    pub model: Option<AnyModel>,
    pub job: Job,
    pub plan: Plan,
    pub data: Dataset,
}

impl Loaded {
    /// What the workers observe (weights are shared, not copied).
    fn target(&self) -> Option<Target> {
        self.model.as_ref().map(|model| match model {
            AnyModel::Language(lm) => Target::Language(lm.model.clone()),
            AnyModel::Policy(policy) => Target::Policy(policy.clone()),
        })
    }
}

/// Whether [`load`] reads the model's weights.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Weights {
    /// Load them: this process observes batches.
    Load,
    /// Skip them: this process only plans.
    Skip,
}

/// Loads the data (and the model, or only its tokenizer) and plans the
/// batches of `recipe`.
fn load(
    model_path: &Path,
    data_path: &Path,
    recipe: &Recipe,
    skip_invalid: bool,
    weights: Weights,
) -> Result<Loaded> {
    let data = load_jsonl(data_path, skip_invalid)?;
    for (line, reason) in &data.skipped {
        eprintln!("warning: {}:{line}: skipped: {reason}", data_path.display());
    }
    let is_policy = model_path.is_dir() && model_path.join("policy.json").exists();
    let (model, plan) = match (weights, is_policy) {
        (Weights::Load, _) => {
            let model = load_model(model_path)?;
            let plan = match &model {
                AnyModel::Language(lm) => plan_episodes(&data, recipe, &lm.text)?,
                AnyModel::Policy(_) => plan(&data, recipe, None)?,
            };
            (Some(model), plan)
        }
        (Weights::Skip, true) => (None, plan(&data, recipe, None)?),
        (Weights::Skip, false) => {
            if !model_path.exists() {
                bail!("model {} does not exist", model_path.display());
            }
            let text = TextSide::load(model_path)?;
            (None, plan_episodes(&data, recipe, &text)?)
        }
    };
    let job = Job {
        model: model_digest(model_path)?,
        data: data.digest,
        recipe: recipe.clone(),
        planned: plan.batches.len() as u64,
    };
    Ok(Loaded {
        model,
        job,
        plan,
        data,
    })
}

/// The plan of LLM episodes: chat-formatted (when the model has a template)
/// and tokenized.
fn plan_episodes(data: &Dataset, recipe: &Recipe, text: &TextSide) -> Result<Plan> {
    Ok(plan(
        data,
        recipe,
        Some(&|content| episode_tokens(text, content)),
    )?)
}

/// The token ids of an LLM episode, as calibration sees it.
pub(crate) fn episode_tokens(
    text: &TextSide,
    content: &EpisodeContent,
) -> qforge_calib::Result<Vec<u32>> {
    let rendered = match content {
        EpisodeContent::TokenIds(ids) => return Ok(ids.clone()),
        EpisodeContent::Text(t) => t.clone(),
        EpisodeContent::PromptCompletion { prompt, completion } => {
            text.chat_text(prompt, completion)?
        }
    };
    Ok(text.tokenizer.encode(&rendered)?)
}

/// The absolute form of `path`, as workers on other machines must find it.
fn absolute(path: &Path) -> Result<String> {
    let path = std::fs::canonicalize(path)
        .with_context(|| format!("cannot resolve {}", path.display()))?;
    path.to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not valid UTF-8", path.display()))
}

/// Where and how a calibration pass runs.
pub(crate) struct Calibration<'a> {
    pub model: &'a Path,
    pub data: &'a Path,
    pub recipe: &'a Recipe,
    pub skip_invalid: bool,
    /// Worker threads of the embedded backend (default: available cores).
    pub workers: Option<usize>,
    /// Redis URL of a cluster run.
    pub cluster: Option<&'a str>,
    pub settings: &'a ClusterSettings,
    pub checkpoint_dir: Option<&'a Path>,
    pub checkpoint_every: usize,
    pub run: Option<String>,
    pub resume: Option<String>,
    pub min_coverage: f64,
    /// No progress output (JSON mode).
    pub quiet: bool,
}

/// A finished calibration pass.
pub(crate) struct Calibrated {
    /// Inputs, plan and (unless a cluster coordinated it) the model.
    pub loaded: Loaded,
    pub summary: RunSummary,
    pub run_name: String,
    /// `embedded` or `redis`.
    pub backend: &'static str,
    /// Threads (embedded) or workers that delivered results (cluster).
    pub workers: usize,
}

impl ClusterSettings {
    fn validate(&self) -> Result<()> {
        if self.heartbeat_ms == 0 || self.heartbeat_timeout_ms <= self.heartbeat_ms {
            return Err(UsageError(
                "--heartbeat-timeout-ms must exceed --heartbeat-ms, which must be at least 1"
                    .into(),
            )
            .into());
        }
        if !(1.0..=2.0).contains(&self.speculation)
            || !self.outage_limit.is_finite()
            || self.outage_limit <= 0.0
        {
            return Err(UsageError(
                "--speculation must be in [1, 2] and --outage-limit positive".into(),
            )
            .into());
        }
        Ok(())
    }
}

/// Runs a calibration pass on the embedded backend or a Redis cluster,
/// with a progress bar.
pub(crate) fn run_calibration(c: &Calibration<'_>) -> Result<Calibrated> {
    if !(0.0..=1.0).contains(&c.min_coverage) {
        return Err(UsageError("--min-coverage must be in [0, 1]".into()).into());
    }
    if c.resume.is_some() && c.checkpoint_dir.is_none() {
        return Err(UsageError("--resume needs --checkpoint-dir".into()).into());
    }
    if c.checkpoint_every == 0 || c.workers == Some(0) {
        return Err(
            UsageError("--checkpoint-every and --workers must be at least 1".into()).into(),
        );
    }
    c.recipe.validate().map_err(|e| UsageError(e.to_string()))?;
    c.settings.validate()?;
    // A cluster coordinator only plans: the workers load the weights.
    let weights = if c.cluster.is_some() {
        Weights::Skip
    } else {
        Weights::Load
    };
    let loaded = load(c.model, c.data, c.recipe, c.skip_invalid, weights)?;
    let (job, plan) = (&loaded.job, &loaded.plan);
    if plan.samples < c.recipe.samples {
        eprintln!(
            "warning: the data holds {} samples, fewer than the {} asked for; calibrating on all of them",
            plan.samples, c.recipe.samples
        );
    }
    let threads = c
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let run_name = c.resume.clone().or(c.run.clone()).unwrap_or_else(|| {
        let mut d = DigestBuilder::default();
        d.update(&job.model.0);
        d.update(&job.data.0);
        d.update(&job.recipe.digest().0);
        d.finish().to_hex()[..12].to_owned()
    });
    let options = RunOptions {
        checkpoints: c
            .checkpoint_dir
            .map(|dir| CheckpointStore::new(dir.join(&run_name))),
        checkpoint_every: c.checkpoint_every,
        resume: c.resume.is_some(),
        min_coverage: c.min_coverage,
    };
    let cluster = match c.cluster {
        None => None,
        Some(url) => {
            let settings = c.settings;
            let mut spec = RunSpec::new(
                &run_name,
                &absolute(c.model)?,
                &absolute(c.data)?,
                job,
                plan,
            );
            spec.skip_invalid = c.skip_invalid;
            spec.heartbeat_ms = settings.heartbeat_ms;
            spec.heartbeat_timeout_ms = settings.heartbeat_timeout_ms;
            spec.allow_mixed_hardware = settings.allow_mixed_hardware;
            spec.speculation = settings.speculation;
            let backend = RedisBackend::open(
                spec,
                &ClusterOptions {
                    url: url.to_owned(),
                    resume: c.resume.is_some(),
                    outage_limit: Duration::from_secs_f64(settings.outage_limit),
                },
            )?;
            if !c.quiet {
                eprintln!(
                    "run {run_name} is open: start workers with `qforge worker --cluster URL --run {run_name}`"
                );
            }
            Some(backend)
        }
    };
    let embedded;
    let backend: &dyn Backend = match &cluster {
        Some(cluster) => cluster,
        None => {
            let target = loaded
                .target()
                .context("the embedded backend loads the model")?;
            embedded = Embedded::new(target, job.clone(), threads);
            &embedded
        }
    };
    let summary = run_with_progress(job, plan, backend, &options, c.quiet);
    if let Some(cluster) = &cluster {
        cluster.finish(summary.is_ok())?;
    }
    let summary = summary?;
    for warning in &summary.warnings {
        eprintln!("warning: {warning}");
    }
    let workers = if cluster.is_some() {
        summary.workers.len()
    } else {
        threads
    };
    Ok(Calibrated {
        loaded,
        summary,
        run_name,
        backend: if cluster.is_some() {
            "redis"
        } else {
            "embedded"
        },
        workers,
    })
}

/// Runs a pass on `backend` with a progress bar (hidden when `quiet`).
fn run_with_progress(
    job: &Job,
    plan: &Plan,
    backend: &dyn Backend,
    options: &RunOptions,
    quiet: bool,
) -> qforge_dist::Result<RunSummary> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(plan.batches.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} batches  {per_sec}  ETA {eta}  {msg}")
            .expect("valid template"),
    );
    let summary = run(job, plan, backend, options, &mut |p| {
        bar.set_position(p.merged as u64);
        bar.set_message(format!("{} workers, {} retries", p.workers, p.retries));
    });
    bar.finish_and_clear();
    summary
}

/// Observes `plan` again on `target`, a transform of the model `first`
/// calibrated (SmoothQuant's second pass), on embedded threads. The
/// statistics' provenance names the transformed model by `model`.
pub(crate) fn transformed_pass(
    first: &Loaded,
    target: Target,
    model: Digest,
    recipe: &Recipe,
    workers: Option<usize>,
    quiet: bool,
) -> Result<RunSummary> {
    let job = Job {
        model,
        data: first.job.data,
        recipe: recipe.clone(),
        planned: first.plan.batches.len() as u64,
    };
    let threads =
        workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let backend = Embedded::new(target, job.clone(), threads);
    let options = RunOptions {
        checkpoints: None,
        checkpoint_every: 50,
        resume: false,
        min_coverage: 0.0,
    };
    Ok(run_with_progress(
        &job,
        &first.plan,
        &backend,
        &options,
        quiet,
    )?)
}

/// `qforge calibrate`.
pub fn calibrate(args: CalibrateArgs) -> Result<()> {
    let recipe = Recipe {
        samples: args.samples,
        seq_len: args.seq_len,
        batch_size: args.batch_size,
        seed: args.seed,
        stratify: match args.stratify {
            StratifyArg::None => Stratify::None,
            StratifyArg::Reward => Stratify::Reward,
        },
        pass: match args.pass {
            PassArg::Activation => Pass::Activation,
            PassArg::Smoothing => Pass::Smoothing,
        },
    };
    let Calibrated {
        loaded,
        summary,
        run_name,
        backend,
        workers,
    } = run_calibration(&Calibration {
        model: &args.model,
        data: &args.data,
        recipe: &recipe,
        skip_invalid: args.skip_invalid,
        workers: args.backend.workers,
        cluster: args.backend.cluster.as_deref(),
        settings: &args.backend.settings,
        checkpoint_dir: args.checkpoint_dir.as_deref(),
        checkpoint_every: args.checkpoint_every,
        run: args.run.clone(),
        resume: args.resume.clone(),
        min_coverage: args.min_coverage,
        quiet: args.flags.json,
    })?;
    let (job, plan) = (&loaded.job, &loaded.plan);
    write_atomic(&args.output.output, &encode(&summary.stats))?;
    if args.flags.json {
        let workers: serde_json::Map<String, serde_json::Value> = summary
            .workers
            .iter()
            .map(|(name, w)| {
                (
                    name.clone(),
                    json!({
                        "merged": w.merged,
                        "duplicates": w.duplicates,
                        "failures": w.failures,
                        "batches_per_s": w.merged as f64 / w.busy_seconds.max(1e-9),
                    }),
                )
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "output": args.output.output.display().to_string(),
                "run": run_name,
                "backend": backend,
                "planned_batches": summary.planned,
                "merged_batches": summary.merged,
                "coverage": summary.coverage,
                "resumed_batches": summary.resumed,
                "duplicates": summary.duplicates,
                "retries": summary.retries,
                "speculative_executions": summary.speculative,
                "mixed_hardware": summary.stats.provenance.mixed_hardware,
                "quarantined": summary.quarantined.iter().map(|(id, e)| json!({"batch": id.to_string(), "error": e})).collect::<Vec<_>>(),
                "checkpoints_written": summary.checkpoints_written,
                "samples": plan.samples,
                "rows": plan.rows,
                "seconds": summary.seconds,
                "rows_per_s": plan.rows as f64 / summary.seconds.max(1e-9),
                // Which rewards the samples came from (`--stratify reward`;
                // empty otherwise), lowest first.
                "reward_strata": plan.strata,
                "workers": workers,
                "model_sha256": job.model.to_hex(),
                "data_sha256": job.data.to_hex(),
                "recipe_sha256": job.recipe.digest().to_hex(),
            }))?
        );
    } else {
        println!(
            "wrote {}: {}/{} batches ({:.1} % coverage), {} samples, {} rows in {:.1} s with {} workers{}",
            args.output.output.display(),
            summary.merged,
            summary.planned,
            100.0 * summary.coverage,
            plan.samples,
            plan.rows,
            summary.seconds,
            workers,
            if summary.resumed > 0 {
                format!(", {} batches resumed from a checkpoint", summary.resumed)
            } else {
                String::new()
            }
        );
        if !plan.strata.is_empty() {
            let strata: Vec<String> = plan
                .strata
                .iter()
                .map(|s| {
                    format!(
                        "[{}, {}] {}/{}",
                        s.min_reward, s.max_reward, s.drawn, s.available
                    )
                })
                .collect();
            println!(
                "reward strata (rewards, drawn/available): {}",
                strata.join(", ")
            );
        }
    }
    Ok(())
}

/// Arguments of `qforge worker`.
#[derive(Args)]
pub struct WorkerArgs {
    /// The Redis the coordinator uses (redis://[:PASSWORD@]HOST:PORT).
    #[arg(long, value_name = "URL")]
    cluster: String,
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
        url: args.cluster,
        run: args.run,
        name: args
            .name
            .unwrap_or_else(|| format!("{host}-{}", std::process::id())),
        forever: args.forever,
        wait: Duration::from_secs_f64(args.wait),
        outage_limit: Duration::from_secs_f64(args.outage_limit),
    };
    let mut prepare = |spec: &RunSpec| -> std::result::Result<Prepared, String> {
        let loaded = load(
            Path::new(&spec.model.path),
            Path::new(&spec.data.path),
            &spec.recipe,
            spec.skip_invalid,
            Weights::Load,
        )
        .map_err(|e| format!("{e:#}"))?;
        Ok(Prepared {
            target: loaded.target().ok_or("the model did not load")?,
            job: loaded.job,
            plan: loaded.plan,
        })
    };
    let name = options.name.clone();
    let report = serve(&options, &mut prepare, &mut |line| {
        eprintln!("qforge worker {name}: {line}");
    })?;
    eprintln!(
        "qforge worker {name}: served {} run(s), {} batch(es), {} failed",
        report.runs, report.batches, report.failed
    );
    Ok(())
}
