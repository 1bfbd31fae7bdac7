//! The worker's side of the Redis backend: `qforge worker`.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use qforge_calib::{Batch, HiddenStates, Job, Session as Calibration, Weights};
use qforge_core::codec::encode;
use qforge_core::{MergePolicy, Stats};
use qforge_model::Model;
use redis::streams::{
    StreamClaimReply, StreamId, StreamInfoGroupsReply, StreamPendingReply, StreamRangeReply,
    StreamReadReply,
};
use serde_json::json;

use super::auth::{ClusterKey, KEY_VARIABLE, MAC_FIELD, RunKey};
use super::keys::{
    ACTIVE, GROUP, RunKeys, check_name, entry_id, idle_pending, joined, named_batches, routed_label,
};
use super::link::{Link, RedisAddress};
use super::rounding;
use super::spec::RunSpec;
use crate::backend::{Failure, observe_guarded};
use crate::error::{Error, Result};

/// A task delivered this many times to workers that all died is reported as
/// failed instead of being handed out again (the coordinator then retries or
/// quarantines it like any failure).
const MAX_DELIVERIES: usize = 3;

/// Unread tasks a live owner must have before an idle worker steals one.
/// A thief runs a stolen batch from the deepest state it kept of it, which
/// may be many layers back: on SmolLM2 (`--sequential`, 2 workers) stolen
/// one-batch tasks took 30–232 ms where their owners took 28–70 ms over
/// their own. Taking one of `n` unread tasks ends the owner's backlog a
/// task sooner but the thief's only after that rerun; from 2 and from 4
/// unread it ended the passes traced 30–100 ms later. An owner with fewer
/// finishes its own; one that is gone is stolen from at once.
const STEAL_BACKLOG: usize = 8;

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

/// What a worker computes with. [`serve`] loads the files a spec names and
/// runs the model's forward ([`ModelForward`]). Tests stand in a model that
/// computes other activations, as another CPU would; the cluster benchmark
/// (`examples/synthetic_worker.rs`) a forward that answers after a fixed
/// delay, so many worker processes load the coordinator and Redis without
/// loading the cores.
pub trait Compute {
    /// Loads the model and the data `spec` names, planned with its recipe,
    /// the same way the coordinator did.
    fn open(&mut self, spec: &RunSpec) -> Result<Calibration> {
        Calibration::open(
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
/// same way the coordinator did ([`Calibration::open`]), and applies the
/// spec's transforms before observing. A pass whose spec names a next pass
/// is followed into it, so workers started for a multi-pass pipeline serve
/// all of its passes; what they loaded is kept for every pass (and, with
/// `forever`, for the next run) over the same files and plan. `log`
/// receives one line per notable event.
pub fn serve(options: &WorkerOptions, log: &mut dyn FnMut(&str)) -> Result<WorkerReport> {
    serve_with(options, &mut ModelForward, log)
}

/// [`serve`], computing with `compute`.
pub fn serve_with(
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
    let mut loaded: Option<(RunSpec, Calibration, String)> = None;
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
        let mut session = Session::join(options, spec, run_key, calibration, fingerprint, log)?;
        let ending = session.serve(&mut link, &*compute, &mut report, log)?;
        finished = Some(run);
        let follow = session.spec.next_pass.clone();
        loaded = Some((session.spec, session.calibration, session.fingerprint));
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
struct Session {
    keys: RunKeys,
    spec: RunSpec,
    /// Seals this worker's results (see [`super::auth`]).
    run_key: RunKey,
    calibration: Calibration,
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

/// One results entry a task gives: the batches it covers, as the `batches`
/// and `ids` fields name them, their statistics (`.qstats` bytes) or why
/// they failed, and the time spent observing them.
struct Answer {
    batches: String,
    ids: String,
    observed: std::result::Result<Vec<u8>, Failure>,
    elapsed: Duration,
}

/// A task a worker holds while observing: its entry, the batches it names
/// (planned), and the merged statistics of those observed so far.
struct Held {
    task: Task,
    batches: Vec<usize>,
    merged: Option<Stats>,
    done: Vec<usize>,
    took: Duration,
}

impl Held {
    fn new(task: Task, batches: Vec<usize>) -> Self {
        Self {
            task,
            batches,
            merged: None,
            done: Vec::new(),
            took: Duration::ZERO,
        }
    }
}

impl Session {
    /// Checks that `calibration` is what `spec` describes, applies the
    /// spec's transforms and computes the fingerprint (unless `fingerprint`
    /// already holds it for this pass's model).
    fn join(
        options: &WorkerOptions,
        spec: RunSpec,
        run_key: RunKey,
        calibration: Calibration,
        fingerprint: Option<String>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let run = spec.run.clone();
        let mismatch = |what: &str, found: String, expected: &str| {
            Error::Cluster(format!(
                "run {run}: this worker's {what} has sha256 {found} but the run expects {expected}; \
                 every worker must reach the same files (a shared filesystem)"
            ))
        };
        let model = calibration.model_digest.to_hex();
        if model != spec.model.sha256 {
            return Err(mismatch("model", model, &spec.model.sha256));
        }
        let data = calibration.data.digest.to_hex();
        if data != spec.data.sha256 {
            return Err(mismatch("data", data, &spec.data.sha256));
        }
        let job = calibration.job(&spec.recipe, &spec.transforms);
        if calibration.plan.digest().to_hex() != spec.plan_sha256 || job.planned != spec.planned {
            return Err(Error::Cluster(format!(
                "run {run}: this worker planned different batches than the coordinator; use the same qforge build"
            )));
        }
        let target = calibration
            .pass_target(&job)
            .map_err(|e| Error::Cluster(format!("run {run}: cannot build its model: {e}")))?;
        let fingerprint = match fingerprint {
            Some(known) => known,
            None => target.fingerprint()?.to_hex(),
        };
        log(&format!(
            "joining run {run} as {} (fingerprint {})",
            options.name,
            abbreviated(&fingerprint)
        ));
        Ok(Self {
            keys: RunKeys::new(&run)?,
            spec,
            run_key,
            calibration,
            prepared: Prepared { target, job },
            name: options.name.clone(),
            fingerprint,
            redis: options.redis.clone(),
            outage_limit: options.outage_limit,
            follows_active: options.run.is_none(),
            observed: Cell::new((0, Duration::ZERO)),
            routes: RefCell::default(),
            joined: Instant::now(),
        })
    }

    /// Registers, checks admission, then observes tasks until the run ends.
    fn serve(
        &mut self,
        link: &mut Link,
        compute: &dyn Compute,
        report: &mut WorkerReport,
        log: &mut dyn FnMut(&str),
    ) -> Result<Ending> {
        let keys = &self.keys;
        let fingerprint = &self.fingerprint;
        let reference: String = link.call(|c| {
            redis::pipe()
                .cmd("SET")
                .arg(keys.reference())
                .arg(fingerprint)
                .arg("NX")
                .ignore()
                .cmd("GET")
                .arg(keys.reference())
                .query::<(String,)>(c)
                .map(|(r,)| r)
        })?;
        let matches = &reference == fingerprint;
        let admitted = matches || self.spec.allow_mixed_hardware;
        let record = json!({
            "build": crate::BUILD,
            "kernel_tier": format!("{:?}", qforge_core::ObserveTier::detect()).to_lowercase(),
            "fingerprint": fingerprint,
            "host": hostname(),
            "pid": std::process::id(),
            "admitted": admitted,
        })
        .to_string();
        link.call(|c| {
            redis::cmd("HSET")
                .arg(keys.workers())
                .arg(&self.name)
                .arg(&record)
                .query::<i64>(c)
        })?;
        if !admitted {
            return Err(Error::Refused(format!(
                "this worker's determinism fingerprint {} differs from the run's {}: its forward pass \
                 computes different activations (another build or CPU), which would break byte-identical \
                 statistics; run workers on matching machines, or start the coordinator with \
                 --allow-mixed-hardware to accept results exact only up to forward-pass rounding",
                abbreviated(fingerprint),
                abbreviated(&reference)
            )));
        }
        if !matches {
            log("fingerprint differs from the run's reference; admitted (--allow-mixed-hardware)");
        }

        let current: Current = Arc::new(Mutex::new("-".into()));
        // Dropping `stop` wakes and ends the heartbeat thread at once.
        let (stop, stopped) = mpsc::channel::<()>();
        let heartbeat = self.start_heartbeat(current.clone(), stopped)?;
        // `report` counts every run this worker served; the log line is this run's.
        let before = (report.batches, report.speculative, report.reclaimed);
        let served = self.work(link, compute, &current, report);
        drop(stop);
        let _ = heartbeat.join();
        let _ = link.call(|c| {
            redis::cmd("DEL")
                .arg(self.keys.heartbeat(&self.name))
                .query::<i64>(c)
        });
        let ending = served?;
        match ending {
            Ending::Finished { .. } => log(&format!(
                "run {} finished; this worker observed {} batch(es) of it ({} speculative tasks, {} reclaimed)",
                self.spec.run,
                report.batches - before.0,
                report.speculative - before.1,
                report.reclaimed - before.2
            )),
            Ending::Abandoned => log(&format!(
                "run {} lost its coordinator and another run is active; moving on",
                self.spec.run
            )),
        }
        Ok(ending)
    }

    fn start_heartbeat(
        &self,
        current: Current,
        stopped: mpsc::Receiver<()>,
    ) -> Result<std::thread::JoinHandle<()>> {
        let mut link = Link::open(&self.redis, self.outage_limit)?;
        let key = self.keys.heartbeat(&self.name);
        let interval = Duration::from_millis(self.spec.heartbeat_ms);
        let ttl = self.spec.heartbeat_timeout_ms;
        let beat = move |link: &mut Link, value: &str| {
            link.call(|c| {
                redis::cmd("SET")
                    .arg(&key)
                    .arg(value)
                    .arg("PX")
                    .arg(ttl)
                    .query::<()>(c)
            })
        };
        beat(&mut link, "-")?;
        // The thread wakes only to beat: on a machine whose cores all run
        // the forward's matmul threads, frequent wake-ups (a 20 ms polling
        // loop) stalled the barrier-synchronised matmul and cost 20 % of a
        // SmolLM2 calibration's throughput on 2 cores.
        Ok(std::thread::spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                let value = current.lock().map(|v| v.clone()).unwrap_or_default();
                if beat(&mut link, &value).is_err() {
                    // Redis is gone past the outage limit: the main loop will
                    // report it; stop beating so the worker reads as dead.
                    return;
                }
            }
        }))
    }

    fn work(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        report: &mut WorkerReport,
    ) -> Result<Ending> {
        let every = self.reclaim_every();
        // The first check is at once: it learns whether the run routes
        // tasks to this worker.
        let mut last_state_check: Option<Instant> = None;
        let mut last_reclaim = Instant::now();
        let mut queue_gone = false;
        loop {
            if queue_gone
                || last_state_check.is_none_or(|t| t.elapsed() >= Duration::from_millis(250))
            {
                last_state_check = Some(Instant::now());
                let (state, coordinator, routes): (Option<String>, bool, Vec<String>) =
                    link.call(|c| {
                        redis::pipe()
                            .cmd("GET")
                            .arg(self.keys.state())
                            .cmd("EXISTS")
                            .arg(self.keys.coordinator())
                            .cmd("SMEMBERS")
                            .arg(self.keys.routes())
                            .query(c)
                    })?;
                let mut routes = routes;
                // Sorted: looked up by binary search (a set's members come
                // in no order).
                routes.sort_unstable();
                *self.routes.borrow_mut() = routes;
                if state.as_deref() != Some("running") {
                    return Ok(Ending::Finished {
                        succeeded: state.as_deref() == Some("done"),
                    });
                }
                if self.follows_active && !coordinator && self.active_moved_on(link)? {
                    return Ok(Ending::Abandoned);
                }
                if std::mem::take(&mut queue_gone) {
                    // The coordinator is recreating the queue.
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if last_reclaim.elapsed() >= every {
                last_reclaim = Instant::now();
                if let Some(task) = self.reclaim(link, report)? {
                    report.reclaimed += 1;
                    self.execute(link, compute, current, &task, false, report)?;
                    continue;
                }
            }
            match self.next_task(link)? {
                Queue::Task(task) => {
                    self.execute(link, compute, current, &task, false, report)?;
                }
                Queue::Gone => queue_gone = true,
                Queue::Empty => {
                    if let Some(task) = self.reclaim(link, report)? {
                        report.reclaimed += 1;
                        self.execute(link, compute, current, &task, false, report)?;
                    } else if let Some(task) = self.speculate(link)? {
                        report.speculative += 1;
                        self.execute(link, compute, current, &task, true, report)?;
                    }
                }
            }
        }
    }

    /// The next undelivered task, waiting briefly for one. In a routed run:
    /// this worker's own stream first (the batches whose hidden states it
    /// holds), then the shared one, then a task stolen from the routed
    /// stream with the most undelivered tasks, and only then waits on its
    /// own.
    fn next_task(&self, link: &mut Link) -> Result<Queue> {
        let routes = self.routes.borrow();
        if routes.is_empty() {
            return self.read(link, None, Some(200));
        }
        let own = routes
            .binary_search(&self.name)
            .is_ok()
            .then_some(self.name.as_str());
        if own.is_some() {
            let read = self.read(link, own, None)?;
            if !matches!(read, Queue::Empty) {
                return Ok(read);
            }
        }
        let read = self.read(link, None, None)?;
        if !matches!(read, Queue::Empty) {
            return Ok(read);
        }
        if let Some(task) = self.steal(link, &routes)? {
            return Ok(Queue::Task(task));
        }
        self.read(link, own, Some(200))
    }

    /// The next undelivered task of the routed stream of `owner` (`None`:
    /// the shared one), waiting up to `block` milliseconds for one (`None`:
    /// not at all).
    fn read(&self, link: &mut Link, owner: Option<&str>, block: Option<u64>) -> Result<Queue> {
        let stream = queue(&self.keys, owner);
        let reply: Option<Option<StreamReadReply>> = link.call(|c| {
            let mut read = redis::cmd("XREADGROUP");
            read.arg("GROUP")
                .arg(GROUP)
                .arg(&self.name)
                .arg("COUNT")
                .arg(1);
            if let Some(block) = block {
                read.arg("BLOCK").arg(block);
            }
            match read.arg("STREAMS").arg(&stream).arg(">").query(c) {
                Err(e) if matches!(e.code(), Some("NOGROUP" | "UNBLOCKED")) => Ok(None),
                other => other.map(Some),
            }
        })?;
        let Some(reply) = reply else {
            return Ok(Queue::Gone);
        };
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .next()
            .map_or(Queue::Empty, |entry| {
                Queue::Task(Task {
                    owner: owner.map(str::to_owned),
                    entry,
                })
            }))
    }

    /// A task of another worker's routed stream that its owner has not
    /// read yet, when this worker would idle. It runs the batches from the
    /// deepest states it holds of them, as a worker whose tasks were not
    /// routed does, which takes longer than the owner would (see
    /// [`STEAL_BACKLOG`]). So it takes, from the stream with the most unread
    /// tasks, one of an owner with at least [`STEAL_BACKLOG`] unread, or of
    /// an owner without a heartbeat (dead, or yet to join a heartbeat
    /// timeout after this worker did); else one of an owner that has not
    /// read its oldest unread task for [`STEAL_BACKLOG`] times the
    /// straggler floor ([`Session::straggler_floor`]) of its batches: a
    /// live owner that slow is stuck.
    fn steal(&self, link: &mut Link, routes: &[String]) -> Result<Option<Task>> {
        let others: Vec<&String> = routes.iter().filter(|r| **r != self.name).collect();
        if others.is_empty() {
            return Ok(None);
        }
        let replies: Vec<redis::Value> = link.call(|c| {
            let mut pipe = redis::pipe();
            for owner in &others {
                pipe.cmd("XINFO")
                    .arg("GROUPS")
                    .arg(self.keys.routed_tasks(owner));
            }
            for owner in &others {
                pipe.cmd("EXISTS").arg(self.keys.heartbeat(owner));
            }
            match pipe.query(c) {
                // A stream gone: the run ended (its coordinator deleted
                // the streams) or Redis lost it (the coordinator recreates
                // it). Nothing to steal now.
                Err(e) if e.to_string().contains("no such key") => Ok(Vec::new()),
                other => other,
            }
        })?;
        if replies.len() != 2 * others.len() {
            return Ok(None);
        }
        let (groups, beats) = replies.split_at(others.len());
        let groups = groups
            .iter()
            .map(|reply| redis::from_redis_value_ref::<StreamInfoGroupsReply>(reply).ok());
        let beats = beats
            .iter()
            .map(|reply| redis::from_redis_value_ref::<bool>(reply).unwrap_or(false));
        let joining = self.joined.elapsed() < Duration::from_millis(self.spec.heartbeat_timeout_ms);
        let mut backlogs = Vec::new();
        let mut waiting = Vec::new();
        for (owner, (reply, beating)) in others.iter().zip(groups.zip(beats)) {
            let Some(group) = reply.and_then(|r| r.groups.into_iter().find(|g| g.name == GROUP))
            else {
                continue;
            };
            let gone = !beating && !joining;
            match group.lag {
                Some(lag) if lag >= STEAL_BACKLOG || (lag > 0 && gone) => {
                    backlogs.push((lag, *owner));
                }
                Some(lag) if lag > 0 => waiting.push((*owner, group.last_delivered_id.clone())),
                _ => {}
            }
        }
        backlogs.sort_unstable_by(|a, b| b.cmp(a));
        let mut candidates: Vec<&String> = backlogs.into_iter().map(|(_, owner)| owner).collect();
        if candidates.is_empty() {
            candidates = self.overdue(link, &waiting)?;
        }
        for owner in candidates {
            if let Queue::Task(task) = self.read(link, Some(owner), None)? {
                return Ok(Some(task));
            }
        }
        Ok(None)
    }

    /// Of the owners in `waiting`, each with unread tasks after the entry
    /// it last read, those whose oldest unread task has waited for
    /// [`STEAL_BACKLOG`] times the straggler floor of its batches: in that
    /// time an owner working at this worker's pace would have run that many
    /// tasks, so it is stuck on the one it holds. The wait is taken on
    /// Redis's clock, which stamped the entry's id.
    fn overdue<'a>(
        &self,
        link: &mut Link,
        waiting: &[(&'a String, String)],
    ) -> Result<Vec<&'a String>> {
        if waiting.is_empty() {
            return Ok(Vec::new());
        }
        let patience = self.straggler_floor() * STEAL_BACKLOG as u32;
        let (time, unread): ((u64, u64), Vec<StreamRangeReply>) = link.call(|c| {
            let mut unread = redis::pipe();
            for (owner, last_read) in waiting {
                unread
                    .cmd("XRANGE")
                    .arg(self.keys.routed_tasks(owner))
                    .arg(format!("({last_read}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(1);
            }
            Ok((redis::cmd("TIME").query(c)?, unread.query(c)?))
        })?;
        let now_ms = time.0 * 1000 + time.1 / 1000;
        Ok(waiting
            .iter()
            .zip(unread)
            .filter(|(_, range)| {
                range.ids.first().is_some_and(|entry| {
                    let queued_ms = entry_id(&entry.id).map_or(now_ms, |(ms, _)| ms);
                    let size = named_batches(entry).map_or(1, |b| b.len().max(1)) as u32;
                    Duration::from_millis(now_ms.saturating_sub(queued_ms)) >= patience * size
                })
            })
            .map(|((owner, _), _)| *owner)
            .collect())
    }

    /// Twice the time this worker takes over a batch (the heartbeat timeout
    /// before it has taken any): a task held or queued longer than this
    /// per batch is a straggler's, worth running here as well.
    fn straggler_floor(&self) -> Duration {
        match self.observed.get() {
            (0, _) => Duration::from_millis(self.spec.heartbeat_timeout_ms),
            (batches, took) => 2 * took / batches,
        }
    }

    /// Takes over a task whose worker is dead: its heartbeat expired, or
    /// does not name the task while it has been pending past the timeout (a
    /// worker restarted under the same name).
    ///
    /// Only the tasks of suspect workers are listed: those whose heartbeat
    /// is gone, or names fewer tasks than they hold. Listing every task
    /// pending past the timeout instead found, once tasks of several batches
    /// outlasted the timeout, the tasks of live workers first: at 256
    /// workers a dead one's tasks waited 7 s.
    ///
    /// Only the shared stream: the coordinator takes back dead workers'
    /// tasks on routed streams (see `RedisBackend`'s `reassign_dead`).
    fn reclaim(&self, link: &mut Link, report: &mut WorkerReport) -> Result<Option<Task>> {
        let tasks = self.keys.tasks();
        let holders: StreamPendingReply =
            link.call(
                |c| match redis::cmd("XPENDING").arg(&tasks).arg(GROUP).query(c) {
                    Err(e) if e.code() == Some("NOGROUP") => Ok(StreamPendingReply::default()),
                    other => other,
                },
            )?;
        let StreamPendingReply::Data(holders) = holders else {
            return Ok(None);
        };
        let beats: Vec<String> = holders
            .consumers
            .iter()
            .map(|c| self.keys.heartbeat(&c.name))
            .collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        for (holder, beat) in holders.consumers.iter().zip(beats) {
            // The heartbeat names the tasks its worker holds ("-": none; a
            // speculative copy, which it does not hold, marked "~"; a task
            // of a routed stream qualified by its owner).
            let named: Vec<&str> = beat
                .as_deref()
                .map(|held| {
                    held.split(',')
                        .filter(|id| *id != "-" && !id.starts_with('~') && !id.contains('/'))
                        .collect()
                })
                .unwrap_or_default();
            if beat.is_some() && holder.pending <= named.len() {
                continue;
            }
            if let Some(entry) = self.claim_from(link, &holder.name, &named, report)? {
                return Ok(Some(entry));
            }
        }
        Ok(None)
    }

    /// Claims a task of `holder` pending past the timeout that its heartbeat
    /// does not name (`named`); one that dead workers were handed too often
    /// is published as failed instead.
    fn claim_from(
        &self,
        link: &mut Link,
        holder: &str,
        named: &[&str],
        report: &mut WorkerReport,
    ) -> Result<Option<Task>> {
        let timeout = self.spec.heartbeat_timeout_ms;
        let tasks = self.keys.tasks();
        for pending in idle_pending(link, &tasks, timeout, 32, Some(holder))? {
            if named.contains(&pending.id.as_str()) {
                continue; // alive and still on it
            }
            // XCLAIM with the idle floor: of several idle workers, one wins.
            let claimed: StreamClaimReply = link.call(|c| {
                match redis::cmd("XCLAIM")
                    .arg(&tasks)
                    .arg(GROUP)
                    .arg(&self.name)
                    .arg(timeout)
                    .arg(&pending.id)
                    .query(c)
                {
                    Err(e) if e.code() == Some("NOGROUP") => Ok(StreamClaimReply::default()),
                    other => other,
                }
            })?;
            let Some(entry) = claimed.ids.into_iter().next() else {
                continue;
            };
            let task = Task { owner: None, entry };
            if pending.times_delivered >= MAX_DELIVERIES {
                let failure = Failure::Worker(format!(
                    "{} workers died while observing it (out of memory? a crash in the forward?)",
                    pending.times_delivered
                ));
                let answers = match self.planned(&task.entry) {
                    Ok(batches) => batches
                        .into_iter()
                        .map(|b| self.failed(b, failure.clone()))
                        .collect(),
                    Err(unplanned) => vec![unplanned],
                };
                report.failed += answers.len();
                self.publish(link, std::slice::from_ref(&task), &answers, false)?;
                continue;
            }
            return Ok(Some(task));
        }
        Ok(None)
    }

    /// Picks the oldest task another (live) worker still holds, if it has
    /// been held for more than twice the time this worker would take over
    /// its batches (a straggler), the run's speculation budget allows one
    /// more execution and nobody else speculates on it. Without that floor,
    /// a queue emptied by a coordinator that merges slower than workers
    /// observe sent every idle worker after fresh tasks: the cap's 20 % of
    /// extra results, all duplicates, at the very coordinator that bounded
    /// the run.
    fn speculate(&self, link: &mut Link) -> Result<Option<Task>> {
        // Per batch; a task of several must have been held that many times
        // as long.
        let floor = self.straggler_floor();
        let routes = self.routes.borrow();
        let owners = std::iter::once(None).chain(routes.iter().map(|r| Some(r.as_str())));
        for owner in owners {
            if let Some(task) = self.speculate_on(link, owner, floor)? {
                return Ok(Some(task));
            }
        }
        Ok(None)
    }

    /// [`Session::speculate`] over the tasks of the routed stream of
    /// `owner` (`None`: the shared one), for a worker whose floor per batch
    /// is `floor`.
    fn speculate_on(
        &self,
        link: &mut Link,
        owner: Option<&str>,
        floor: Duration,
    ) -> Result<Option<Task>> {
        let tasks = queue(&self.keys, owner);
        for pending in idle_pending(link, &tasks, floor.as_millis() as u64, 8, None)? {
            if pending.consumer == self.name {
                continue;
            }
            let range: StreamRangeReply = link.call(|c| {
                redis::cmd("XRANGE")
                    .arg(&tasks)
                    .arg(&pending.id)
                    .arg(&pending.id)
                    .query(c)
            })?;
            let Some(entry) = range.ids.into_iter().next() else {
                continue;
            };
            let size = named_batches(&entry).map_or(1, |b| b.len().max(1)) as u32;
            if Duration::from_millis(pending.last_delivered_ms as u64) < floor * size {
                continue;
            }
            let task = Task {
                owner: owner.map(str::to_owned),
                entry,
            };
            let mine: Option<String> = link.call(|c| {
                redis::cmd("SET")
                    .arg(self.keys.speculation_claim(&task.label()))
                    .arg(&self.name)
                    .arg("NX")
                    .arg("PX")
                    .arg(3_600_000)
                    .query(c)
            })?;
            if mine.is_none() {
                continue;
            }
            // The budget counts batches, as the planned work does.
            let started: u64 = link.call(|c| {
                redis::cmd("INCRBY")
                    .arg(self.keys.speculative())
                    .arg(size)
                    .query(c)
            })?;
            if started > self.spec.speculation_cap() {
                return Ok(None);
            }
            return Ok(Some(task));
        }
        Ok(None)
    }

    /// Observes the batches of a task, merges those that succeed into one
    /// result, and publishes it with one entry per batch that failed.
    fn execute(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        task: &Task,
        speculative: bool,
        report: &mut WorkerReport,
    ) -> Result<()> {
        // A speculative copy is not this worker's pending task: the
        // heartbeat marks it, so that the count of tasks it names matches
        // those it holds (see `reclaim`).
        let named = if speculative {
            format!("~{}", task.label())
        } else {
            task.label()
        };
        self.announce(link, current, &named)?;
        let started = Instant::now();
        let (held, answers, observed) = match self.planned(&task.entry) {
            Ok(batches) => {
                let held = Held::new(task.clone(), batches);
                self.observe_tasks(link, compute, current, held, speculative, report)?
            }
            Err(unplanned) => (vec![task.clone()], vec![unplanned], 1),
        };
        let (batches, took) = self.observed.get();
        self.observed.set((
            batches.saturating_add(observed as u32),
            took + started.elapsed(),
        ));
        report.batches += observed;
        report.failed += answers.iter().filter(|a| a.observed.is_err()).count();
        self.publish(link, &held, &answers, speculative)?;
        self.announce(link, current, "-")
    }

    /// Whether `qforge:active` names another run than this one (asked apart
    /// from the run's keys: on a Redis Cluster it lives in another slot).
    fn active_moved_on(&self, link: &mut Link) -> Result<bool> {
        let active: Option<String> = link.call(|c| redis::cmd("GET").arg(ACTIVE).query(c))?;
        Ok(active.as_deref() != Some(self.keys.run()))
    }

    /// How often a worker looks for dead workers' tasks, between its own
    /// batches too, so that a death costs about one timeout, not the queue's
    /// length or a long task's.
    fn reclaim_every(&self) -> Duration {
        Duration::from_millis((self.spec.heartbeat_timeout_ms / 4).clamp(50, 1000))
    }

    /// The plan batches a task names, if they are this worker's (else the
    /// failure to publish for it, under the task's own fields).
    fn planned(&self, entry: &StreamId) -> std::result::Result<Vec<usize>, Answer> {
        let plan = &self.calibration.plan.batches;
        let ids = entry.get::<String>("ids").unwrap_or_default();
        match named_batches(entry) {
            Some(batches)
                if !batches.is_empty()
                    && batches.iter().all(|&b| b < plan.len())
                    && joined(batches.iter().map(|&b| plan[b].id)) == ids =>
            {
                Ok(batches)
            }
            _ => {
                let named = entry.get::<String>("batches").unwrap_or_default();
                Err(Answer {
                    observed: Err(Failure::Worker(format!(
                        "task names batches {named} ({ids}), which are not in this worker's plan"
                    ))),
                    batches: named,
                    ids,
                    elapsed: Duration::ZERO,
                })
            }
        }
    }

    /// The answer that batch `batch` failed.
    fn failed(&self, batch: usize, failure: Failure) -> Answer {
        Answer {
            batches: batch.to_string(),
            ids: self.calibration.plan.batches[batch].id.to_string(),
            observed: Err(failure),
            elapsed: Duration::ZERO,
        }
    }

    /// Observes the batches of `task` (planned), merging their statistics
    /// in order. Merging is exact, so the coordinator's merge of the result
    /// equals its merges of the batches one by one.
    ///
    /// A dead worker's task found on the way (looked for every
    /// [`Session::reclaim_every`], unless this is a speculative copy) is
    /// taken into the run: its batches are observed after this task's, the
    /// heartbeat names both, and each task gets its own result, so a result
    /// never covers more than its task (were the dead worker only slow, its
    /// result and this one are duplicates, not an overlap the coordinator
    /// must refuse). Returns the entries held, their answers (a merged
    /// result per task, then a failure per batch that failed) and the number
    /// of batches observed.
    fn observe_tasks(
        &self,
        link: &mut Link,
        compute: &dyn Compute,
        current: &Current,
        task: Held,
        speculative: bool,
        report: &mut WorkerReport,
    ) -> Result<(Vec<Task>, Vec<Answer>, usize)> {
        let plan = &self.calibration.plan.batches;
        let mut queued: BTreeSet<usize> = task.batches.iter().copied().collect();
        let mut queue: VecDeque<(usize, usize)> = task.batches.iter().map(|&b| (0, b)).collect();
        let mut tasks = vec![task];
        let mut failures = Vec::new();
        let mut observed = 0;
        let mut last_reclaim = Instant::now();
        while let Some((t, b)) = queue.pop_front() {
            observed += 1;
            let started = Instant::now();
            let task = &mut tasks[t];
            match compute.observe_into(
                &self.prepared.target,
                &plan[b],
                &self.prepared.job,
                &self.calibration.hidden_states,
                &mut task.merged,
            ) {
                Ok(()) => task.done.push(b),
                Err(failure) => failures.push(self.failed(b, failure)),
            }
            task.took += started.elapsed();
            if speculative || queue.is_empty() || last_reclaim.elapsed() < self.reclaim_every() {
                continue;
            }
            last_reclaim = Instant::now();
            let Some(reclaimed) = self.reclaim(link, report)? else {
                continue;
            };
            report.reclaimed += 1;
            let more = match self.planned(&reclaimed.entry) {
                Ok(more) => more,
                Err(unplanned) => {
                    failures.push(unplanned);
                    Vec::new()
                }
            };
            // A batch already queued here (a retry enqueued beside its first
            // task) is observed once, for its first task.
            let t = tasks.len();
            queue.extend(more.iter().filter(|&&b| queued.insert(b)).map(|&b| (t, b)));
            tasks.push(Held::new(reclaimed, more));
            self.announce(link, current, &joined(tasks.iter().map(|h| h.task.label())))?;
        }
        let mut answers = Vec::with_capacity(tasks.len() + failures.len());
        let mut held = Vec::with_capacity(tasks.len());
        for task in tasks {
            if let Some(stats) = task.merged {
                answers.push(Answer {
                    batches: joined(&task.done),
                    ids: joined(task.done.iter().map(|&b| plan[b].id)),
                    observed: Ok(encode(&stats)),
                    elapsed: task.took,
                });
            }
            held.push(task.task);
        }
        answers.extend(failures);
        Ok((held, answers, observed))
    }

    /// Names the task being observed ("-": none) in the heartbeat at once,
    /// not only at the next beat, so the key never claims a finished task
    /// for long, nor misses a started one.
    fn announce(&self, link: &mut Link, current: &Current, task: &str) -> Result<()> {
        if let Ok(mut c) = current.lock() {
            task.clone_into(&mut c);
        }
        link.call(|c| {
            redis::cmd("SET")
                .arg(self.keys.heartbeat(&self.name))
                .arg(task)
                .arg("PX")
                .arg(self.spec.heartbeat_timeout_ms)
                .query::<()>(c)
        })
    }

    /// Appends the results of the tasks `held`, then acknowledges them: in
    /// this order, a crash in between leaves pending tasks whose rerun is a
    /// duplicate the merge drops, never a lost result.
    fn publish(
        &self,
        link: &mut Link,
        held: &[Task],
        answers: &[Answer],
        speculative: bool,
    ) -> Result<()> {
        let results = self.keys.results();
        link.call(|c| {
            let mut pipe = redis::pipe();
            for answer in answers {
                let elapsed = (answer.elapsed.as_micros() as u64).to_string();
                let mut fields: Vec<(&str, &[u8])> = vec![
                    ("batches", answer.batches.as_bytes()),
                    ("ids", answer.ids.as_bytes()),
                    ("worker", self.name.as_bytes()),
                    ("fingerprint", self.fingerprint.as_bytes()),
                    ("elapsed_us", elapsed.as_bytes()),
                    ("speculative", if speculative { b"1" } else { b"0" }),
                ];
                match &answer.observed {
                    Ok(bytes) => fields.push(("stats", bytes)),
                    Err(failure) => {
                        fields.push(("error", failure.message().as_bytes()));
                        fields.push(("failure", failure.kind().as_bytes()));
                    }
                }
                let mac = self.run_key.seal(&fields);
                let add = pipe.cmd("XADD").arg(&results).arg("*");
                for (name, value) in &fields {
                    add.arg(*name).arg(*value);
                }
                add.arg(MAC_FIELD).arg(&mac).ignore();
            }
            pipe.query::<()>(c)
        })?;
        let mut by_stream: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for task in held {
            by_stream
                .entry(task.stream(&self.keys))
                .or_default()
                .push(&task.entry.id);
        }
        link.call(|c| {
            let mut pipe = redis::pipe();
            for (stream, ids) in &by_stream {
                pipe.cmd("XACK").arg(stream).arg(GROUP).arg(ids).ignore();
            }
            pipe.query::<()>(c)
        })?;
        Ok(())
    }
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
