//! The worker's side of the Redis backend: `qforge worker`.
//!
//! This file holds what a worker is and how it finds runs: its options and
//! report, the [`Compute`] it observes with, [`run_worker`] (following a
//! pipeline from pass to pass), waiting for a run and reading its spec, and
//! the types one run's `JoinedRun` shares with the files below:
//!
//! - `joined.rs`: one run, from joining it (checks, admission, heartbeat)
//!   to leaving it, and the loop that takes and executes tasks;
//! - `take.rs`: reading tasks from the streams, stealing, reclaiming dead
//!   workers' tasks and picking stragglers to re-execute (the decisions are
//!   in `cluster/policy.rs`);
//! - `execute.rs`: observing a task's batches and publishing its results.

mod execute;
mod joined;
mod take;

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qforge_calib::{Batch, HiddenStates, Job, Session, Weights};
use qforge_core::{MergePolicy, Stats};
use qforge_model::Model;
use redis::streams::{StreamId, StreamReadReply};

use super::auth::{ClusterKey, KEY_VARIABLE, RunKey};
use super::keys::{ACTIVE, RunKeys, check_name, routed_label};
use super::link::{Link, RedisAddress};
use super::rounding;
use super::spec::RunSpec;
use crate::backend::{Failure, observe_guarded};
use crate::error::{Error, Result};

/// What a worker holds for one pass: the model after the pass's transforms
/// and the job its statistics name.
struct Prepared {
    /// The model to observe.
    target: Model,
    /// The job, whose hashes match the spec's.
    job: Job,
}

/// How a worker behaves.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Where Redis is.
    pub redis: RedisAddress,
    /// Join this run; `None`: whichever run is active.
    pub run: Option<String>,
    /// This worker's name (unique in the run).
    pub name: String,
    /// Keep serving runs after one finishes.
    pub forever: bool,
    /// How long to wait for a run to appear.
    pub wait: Duration,
    /// Give up when Redis stays unreachable this long.
    pub outage_limit: Duration,
    /// The key shared with the coordinator: a worker joins only runs whose
    /// run key it derives, and seals its results with it.
    pub key: ClusterKey,
}

/// What a worker did.
#[derive(Debug, Clone, Default)]
pub struct WorkerReport {
    /// Runs served.
    pub runs: usize,
    /// Batches observed (including speculative and reclaimed ones).
    pub batches: usize,
    /// Tasks re-executed speculatively.
    pub speculative: usize,
    /// Tasks taken over from dead workers.
    pub reclaimed: usize,
    /// Batches whose observation failed.
    pub failed: usize,
}

/// What a worker computes with. [`run_worker`] loads the files a spec names and
/// runs the model's forward ([`ModelForward`]). Tests stand in a model that
/// computes other activations, as another CPU would; the cluster benchmark
/// (`examples/synthetic_worker.rs`) a forward that answers after a fixed
/// delay, so many worker processes load the coordinator and Redis without
/// loading the cores.
pub trait Compute {
    /// Loads the model and the data `spec` names, planned with its recipe,
    /// the same way the coordinator did.
    fn open(&mut self, spec: &RunSpec) -> Result<Session> {
        Session::open(
            Path::new(&spec.model.path),
            Path::new(&spec.data.path),
            &spec.recipe,
            spec.skip_invalid,
            Weights::Load,
        )
        .map_err(|e| Error::Cluster(format!("cannot load run {}: {e}", spec.run)))
    }

    /// Observes one planned batch of the pass's model.
    fn observe(
        &self,
        target: &Model,
        batch: &Batch,
        job: &Job,
        hidden_states: &HiddenStates,
    ) -> std::result::Result<Stats, Failure> {
        observe_guarded(target, batch, job, hidden_states)
    }

    /// Observes one planned batch into `task`, the merged statistics of the
    /// task's batches observed so far (`None` before its first). On an
    /// error `task` is as it was.
    fn observe_into(
        &self,
        target: &Model,
        batch: &Batch,
        job: &Job,
        hidden_states: &HiddenStates,
        task: &mut Option<Stats>,
    ) -> std::result::Result<(), Failure> {
        let stats = self.observe(target, batch, job, hidden_states)?;
        match task {
            None => {
                *task = Some(stats);
                Ok(())
            }
            Some(merged) => merged.merge(&stats, MergePolicy::Strict).map_err(|e| {
                Failure::Worker(format!(
                    "its statistics do not merge with the task's others: {e}"
                ))
            }),
        }
    }
}

/// The model's own forward over the files a spec names: `qforge worker`.
pub struct ModelForward;

impl Compute for ModelForward {}

/// Serves runs until the one joined finishes (or, with `forever`, until an
/// error). The worker loads the model and plans the data a spec names, the
/// same way the coordinator did ([`Session::open`]), and applies the
/// spec's transforms before observing. A pass whose spec names a next pass
/// is followed into it, so workers started for a multi-pass pipeline serve
/// all of its passes; what they loaded is kept for every pass (and, with
/// `forever`, for the next run) over the same files and plan. `log`
/// receives one line per notable event.
pub fn run_worker(options: &WorkerOptions, log: &mut dyn FnMut(&str)) -> Result<WorkerReport> {
    run_worker_with(options, &mut ModelForward, log)
}

/// [`run_worker`], computing with `compute`.
pub fn run_worker_with(
    options: &WorkerOptions,
    compute: &mut dyn Compute,
    log: &mut dyn FnMut(&str),
) -> Result<WorkerReport> {
    check_name("worker", &options.name)?;
    let mut link = Link::open(&options.redis, options.outage_limit)?;
    let mut report = WorkerReport::default();
    let mut finished: Option<String> = None;
    // The next pass of the pipeline just served, which this worker follows.
    let mut next_pass: Option<String> = None;
    // What the previous run loaded, and the fingerprint of its pass's model.
    let mut loaded: Option<(RunSpec, Session, String)> = None;
    loop {
        let following = next_pass.take();
        let wanted = following.clone().or(options.run.clone());
        let Some(spec) = wait_for_run(
            &mut link,
            options,
            wanted.as_deref(),
            following.is_some(),
            finished.as_deref(),
            log,
        )?
        else {
            if following.is_some() && options.forever {
                // The pipeline ended before the pass it named; serve what
                // comes next.
                continue;
            }
            return Ok(report);
        };
        let run = spec.run.clone();
        let run_key = options.key.run_key(&run, &spec.nonce);
        if run_key.check_value() != spec.key_check {
            return Err(Error::Refused(format!(
                "run {run} was published under another cluster key than this worker's (from {}): \
                 the coordinator would refuse every result it sends. Give every worker the \
                 coordinator's key: a copy of its key file (--cluster-key-file FILE) or the same \
                 {KEY_VARIABLE}",
                options.key.source()
            )));
        }
        let (calibration, fingerprint) = match loaded.take() {
            Some((previous, calibration, fingerprint)) if previous.same_inputs(&spec) => {
                let same_model = previous.transforms == spec.transforms;
                (calibration, same_model.then_some(fingerprint))
            }
            _ => (compute.open(&spec)?, None),
        };
        let pipeline = RunKeys::new(&spec.pipeline)?;
        let fetched = rounding::fetch(
            &mut link,
            &pipeline,
            spec.recipe.pass.rounded(),
            &calibration.rounded,
        )?;
        if fetched > 0 {
            log(&format!(
                "fetched {fetched} of GPTQ's roundings for run {run}"
            ));
        }
        let mut joined = JoinedRun::join(options, spec, run_key, calibration, fingerprint, log)?;
        let ending = joined.take_part(&mut link, &*compute, &mut report, log)?;
        finished = Some(run);
        let follow = joined.spec.next_pass.clone();
        loaded = Some((joined.spec, joined.calibration, joined.fingerprint));
        match ending {
            Ending::Abandoned => continue,
            Ending::Finished { succeeded } => {
                report.runs += 1;
                if let Some(next) = follow.filter(|_| succeeded) {
                    log(&format!(
                        "following the pipeline into its next pass, run {next}"
                    ));
                    next_pass = Some(next);
                    continue;
                }
            }
        }
        if !options.forever {
            return Ok(report);
        }
    }
}

/// Waits for a running run: the named one, or the active one (not `skip`,
/// the run just served). `None` when a named run is already over, and, when
/// `following` (the run the previous pass named), even for a worker that
/// serves forever. A followed pass that is already done is followed into
/// the pass it names: a worker slower to arrive than its peers were to
/// finish stays with the pipeline.
fn wait_for_run(
    link: &mut Link,
    options: &WorkerOptions,
    named: Option<&str>,
    following: bool,
    skip: Option<&str>,
    log: &mut dyn FnMut(&str),
) -> Result<Option<RunSpec>> {
    let started = Instant::now();
    let mut announced = false;
    let mut named = named.map(str::to_owned);
    loop {
        let run = match &named {
            Some(run) => Some(run.clone()),
            None => link
                .call(|c| redis::cmd("GET").arg(ACTIVE).query::<Option<String>>(c))?
                .filter(|r| Some(r.as_str()) != skip),
        };
        if let Some(run) = run {
            let keys = RunKeys::new(&run)?;
            let (spec, state): (Option<String>, Option<String>) = link.call(|c| {
                redis::pipe()
                    .cmd("GET")
                    .arg(keys.spec())
                    .cmd("GET")
                    .arg(keys.state())
                    .query(c)
            })?;
            match (spec, state.as_deref()) {
                (Some(json), Some("running")) => return readable(&run, &json).map(Some),
                (Some(json), Some("done")) if following => {
                    let Some(next) = readable(&run, &json)?.next_pass else {
                        log(&format!("run {run} is done; nothing to do"));
                        return Ok(None);
                    };
                    log(&format!(
                        "run {run} is done before this worker joined; following the pipeline into run {next}"
                    ));
                    named = Some(next);
                    continue;
                }
                (Some(_), Some(state)) if named.is_some() && (following || !options.forever) => {
                    log(&format!("run {run} is {state}; nothing to do"));
                    return Ok(None);
                }
                _ => {}
            }
        }
        if started.elapsed() >= options.wait {
            return Err(Error::Cluster(format!(
                "no {} appeared within {:.0} s; start `qforge calibrate --cluster …` or raise --wait",
                named.map_or("active run".to_owned(), |r| format!("running run {r}")),
                options.wait.as_secs_f64()
            )));
        }
        if !announced {
            log("waiting for a run");
            announced = true;
        }
        match &named {
            Some(run) => await_first_task(link, &RunKeys::new(run)?, &options.name)?,
            None => std::thread::sleep(WAIT_POLL),
        }
    }
}

/// How often a worker looks for the run it waits for.
const WAIT_POLL: Duration = Duration::from_millis(50);

/// Waits for the first task of the run `keys` name, on the shared stream
/// or the one routed to `worker`, or [`WAIT_POLL`] at most. Its coordinator
/// sets the run running before it enqueues, so a worker following a
/// pipeline joins the next pass as its tasks appear, not at its next look
/// (25 ms a pass on average with SmolLM2's 121).
fn await_first_task(link: &mut Link, keys: &RunKeys, worker: &str) -> Result<()> {
    link.call(|c| {
        match redis::cmd("XREAD")
            .arg("BLOCK")
            .arg(WAIT_POLL.as_millis() as u64)
            .arg("STREAMS")
            .arg(keys.tasks())
            .arg(keys.routed_tasks(worker))
            .arg("$")
            .arg("$")
            .query::<Option<StreamReadReply>>(c)
        {
            Err(e) if e.code() == Some("UNBLOCKED") => Ok(None),
            other => other,
        }
    })?;
    Ok(())
}

/// The spec `json` of run `run`, if this build reads it.
fn readable(run: &str, json: &str) -> Result<RunSpec> {
    let spec: RunSpec = serde_json::from_str(json).map_err(|e| {
        Error::Cluster(format!(
            "run {run} has a spec this build cannot read ({e}); use the coordinator's qforge version"
        ))
    })?;
    if spec.format != RunSpec::FORMAT || spec.version != RunSpec::VERSION {
        return Err(Error::Cluster(format!(
            "run {run} uses spec {} v{}; this build reads {} v{}",
            spec.format,
            spec.version,
            RunSpec::FORMAT,
            RunSpec::VERSION
        )));
    }
    Ok(spec)
}

/// How a worker left a run.
enum Ending {
    /// The run is over: `done` (succeeded) or `failed`.
    Finished {
        /// Whether the coordinator marked it `done`.
        succeeded: bool,
    },
    /// Its coordinator is gone and another run is active: a worker that
    /// follows the active run moves on (one bound to `--run` waits for a
    /// resumed coordinator instead).
    Abandoned,
}

/// One worker in one run.
struct JoinedRun {
    keys: RunKeys,
    spec: RunSpec,
    /// Seals this worker's results (see [`super::auth`]).
    run_key: RunKey,
    calibration: Session,
    prepared: Prepared,
    name: String,
    fingerprint: String,
    redis: RedisAddress,
    outage_limit: Duration,
    follows_active: bool,
    /// Batches this worker observed in this run, and the time they took.
    observed: Cell<(u32, Duration)>,
    /// The workers with a routed task stream in this run, as last read
    /// (empty: every task is on the shared stream).
    routes: RefCell<Vec<String>>,
    /// When this worker joined the run: for a heartbeat timeout after, a
    /// routed stream's owner without a heartbeat may still be joining.
    joined: Instant,
}

/// Shared with the heartbeat thread: the task being observed ("-" when idle).
type Current = Arc<Mutex<String>>;

/// A task read from one of the run's task streams.
#[derive(Clone)]
struct Task {
    /// The worker whose routed stream it was read from (`None`: the shared
    /// one).
    owner: Option<String>,
    entry: StreamId,
}

impl Task {
    /// The stream it was read from, where it is acknowledged.
    fn stream(&self, keys: &RunKeys) -> String {
        queue(keys, self.owner.as_deref())
    }

    /// How the heartbeat and speculation claims name it (see
    /// [`routed_label`]).
    fn label(&self) -> String {
        match &self.owner {
            Some(owner) => routed_label(owner, &self.entry.id),
            None => self.entry.id.clone(),
        }
    }
}

/// What reading the task queue gave.
enum Queue {
    /// A task.
    Task(Task),
    /// Nothing within the wait.
    Empty,
    /// No queue: the run is over (its coordinator deletes the queue, which
    /// wakes the workers blocked reading it), or its coordinator is
    /// recreating it.
    Gone,
}

/// The task stream of run `keys` routed to `owner` (`None`: the shared one).
fn queue(keys: &RunKeys, owner: Option<&str>) -> String {
    owner.map_or_else(|| keys.tasks(), |owner| keys.routed_tasks(owner))
}

/// The first 16 characters of a fingerprint, escaped: the run's reference
/// comes from Redis and may be anything (a byte slice of a non-ASCII value
/// panicked the worker).
fn abbreviated(fingerprint: &str) -> String {
    fingerprint
        .chars()
        .take(16)
        .flat_map(char::escape_debug)
        .collect()
}

/// This machine's host name (for worker names and the worker record).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}
