//! The coordinator's side of the Redis backend.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use qforge_calib::{Plan, RoundedLayers};
use qforge_core::codec::Shapes;
use redis::streams::{
    StreamId, StreamInfoGroupsReply, StreamPendingCountReply, StreamRangeReply, StreamReadReply,
};

use super::auth::{ClusterKey, RunKey};
use super::keys::{
    ACTIVE, GROUP, RunKeys, entry_id, idle_pending, joined, named_batches, now_ms, routed_label,
};
use super::link::{Link, RedisAddress};
use super::receive::{Received, receive_all, refuse_future_id};
use super::rounding;
use super::spec::RunSpec;
use crate::backend::{Backend, Failure, Next, Outcome};
use crate::error::{Error, Result};

/// How a cluster run is coordinated.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Where Redis is.
    pub redis: RedisAddress,
    /// Continue the run's results and workers instead of starting clean.
    pub resume: bool,
    /// Give up when Redis stays unreachable this long.
    pub outage_limit: Duration,
    /// Batches handed out per task, which the worker merges and publishes
    /// as one result. `None`: sized as the run goes, from the coordinator's
    /// time per result and the workers' time per batch (one until both are
    /// measured; see [`RedisBackend`]).
    pub batches_per_task: Option<NonZeroUsize>,
    /// The key shared with the workers, from which the run key that seals
    /// their results is derived.
    pub key: ClusterKey,
}

/// How often the coordinator checks that no task was lost.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// Results refused for their MAC that the warnings name one by one.
const UNSEALED_NAMED: usize = 4;

/// Results read from the stream at a time.
const READ_COUNT: usize = 16;

/// Tasks in flight (enqueued, not yet resolved) per live worker: one being
/// observed and one queued, so no worker waits for the next task.
const IN_FLIGHT_PER_WORKER: usize = 2;

/// Batches in flight however few workers are alive (before the first count
/// of heartbeats, too).
const MIN_IN_FLIGHT: usize = 64;

/// The most batches one task holds when sized automatically: a worker that
/// dies loses at most this many batches' work.
const MAX_BATCHES_PER_TASK: usize = 64;

/// Weight of the newest measurement in the running means that size tasks.
const SMOOTHING: f64 = 0.2;

/// What a pass measured of its tasks: a later pass of the same kind sizes
/// its tasks from it at once (see [`RedisBackend::paced`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace {
    /// The coordinator's mean seconds per result.
    pub merge_seconds: f64,
    /// The workers' mean seconds per batch.
    pub batch_seconds: f64,
    /// Workers that delivered results in it.
    pub workers: usize,
}

/// What the backend keeps between calls.
#[derive(Default)]
struct Bookkeeping {
    /// The last results entry handed to the coordinator.
    cursor: Option<String>,
    /// The reference fingerprint, once a worker has set it.
    reference: Option<String>,
    /// Unresolved batches that had no queued or pending task at the last
    /// reconciliation; re-enqueued if still so at the next one.
    suspects: BTreeSet<usize>,
    /// Results dropped, with why.
    dropped: BTreeMap<String, usize>,
    /// Tasks re-enqueued after Redis lost them.
    reenqueued: usize,
    /// Running mean of the coordinator's seconds per result (decoding,
    /// checking, merging, checkpointing).
    merge_seconds: Option<f64>,
    /// Running mean of the workers' seconds per batch.
    batch_seconds: Option<f64>,
    /// Whether the live workers counted are still those of the [`Pace`]
    /// the run started from: no worker has joined it yet.
    workers_from_pace: bool,
    /// The workers whose results were read. A pass shorter than the
    /// heartbeat count's period counts its workers only at its start,
    /// before any has joined.
    reporting: BTreeSet<String>,
    /// The worker whose result last covered each batch: it holds the
    /// batch's hidden states (seeded from the pass before, see
    /// [`RedisBackend::routed`]).
    holders: BTreeMap<usize, String>,
    /// Tasks taken back from dead workers' routed streams.
    reassigned: usize,
    /// The first results refused for their MAC, described (entry id, the
    /// worker and batches they claim).
    unsealed: Vec<String>,
    /// The tensors the pass observes and their shapes, from its first
    /// sealed result: later results are decoded against them.
    shapes: Option<Shapes>,
}

impl Bookkeeping {
    /// Folds `value` into the running mean `mean`.
    fn smooth(mean: &mut Option<f64>, value: f64) {
        *mean = Some(mean.map_or(value, |m| m + SMOOTHING * (value - m)));
    }
}

/// The coordinator's side of a Redis run. It publishes the spec, enqueues the
/// pending batches, and turns the results stream into [`Outcome`]s.
///
/// A task holds one or more batches; its worker merges their statistics
/// and publishes one result. Merging is exact, so the grouping changes
/// nothing in the output, only the coordinator's work: decoding and merging
/// a SmolLM2 result takes it about 7 ms whatever the batches it covers, so
/// with one batch per task it merges at most ~150 batches a second, however
/// many workers it has. Sized automatically, a task holds enough batches
/// that the results of all live workers keep the coordinator busy at most
/// half the time (`2 × workers × time per result / time per batch`, at
/// most [`MAX_BATCHES_PER_TASK`]), and no more than lets every worker have
/// two tasks of what is left of the plan.
///
/// Until both times are measured, a task holds one batch. A pipeline's
/// passes are short (SmolLM2 `--sequential`: 16 batches a pass), so most of
/// a pass would go by unsized; [`Self::paced`] starts a pass from the times
/// an earlier pass of its kind measured.
pub struct RedisBackend {
    link: RefCell<Link>,
    keys: RunKeys,
    /// Seals this run's results (see [`super::auth`]).
    run_key: RunKey,
    spec: RunSpec,
    batches_per_task: Option<NonZeroUsize>,
    token: String,
    alive: Cell<usize>,
    book: RefCell<Bookkeeping>,
    routing: RefCell<Routing>,
}

/// Where a routed run's tasks go (see [`RedisBackend::routed`]).
#[derive(Default)]
struct Routing {
    /// The workers with a task stream of their own, sorted; empty: every
    /// task goes to the shared stream.
    routes: Vec<String>,
    /// The workers whose heartbeat was alive at the last count.
    alive: BTreeSet<String>,
    /// Until then a route counts as alive: a pass's workers join after it
    /// opens, so none has a heartbeat at its start.
    presumed_alive_until: Option<Instant>,
    /// Next route for a batch whose holder is gone (round robin).
    next: usize,
}

impl Routing {
    /// The worker whose stream a task of `batch` goes to, if routed: its
    /// holder while that one lives, else the next live route in turn.
    fn target(&mut self, batch: usize, holders: &BTreeMap<usize, String>) -> Option<String> {
        if self.routes.is_empty() {
            return None;
        }
        let presumed = self
            .presumed_alive_until
            .is_some_and(|t| Instant::now() < t);
        let usable = |worker: &String| presumed || self.alive.contains(worker);
        if let Some(holder) = holders.get(&batch)
            && self.routes.binary_search(holder).is_ok()
            && usable(holder)
        {
            return Some(holder.clone());
        }
        let live: Vec<&String> = self.routes.iter().filter(|r| usable(r)).collect();
        let pool = if live.is_empty() {
            self.routes.iter().collect()
        } else {
            live
        };
        self.next = self.next.wrapping_add(1);
        Some(pool[self.next % pool.len()].clone())
    }
}

impl RedisBackend {
    /// Connects, publishes the roundings the pass runs with (from
    /// `roundings`, the coordinator's; see the module's "Roundings"), takes
    /// the coordinator role of `spec.run` (waiting out a crashed
    /// predecessor's lease) and publishes the spec. Unless resuming,
    /// whatever an earlier run of that name left is cleared.
    pub fn open(
        mut spec: RunSpec,
        options: &ClusterOptions,
        roundings: &RoundedLayers,
    ) -> Result<Self> {
        let keys = RunKeys::new(&spec.run)?;
        let mut link = Link::open(&options.redis, options.outage_limit)?;
        // In Redis before any worker can join the pass.
        rounding::publish(
            &mut link,
            &RunKeys::new(&spec.pipeline)?,
            spec.recipe.pass.rounded(),
            roundings,
        )?;
        let token = format!("{}-{}", std::process::id(), now_ms());
        let lease = spec.heartbeat_timeout_ms;
        let waited = Instant::now();
        loop {
            let took: Option<String> = link.call(|c| {
                redis::cmd("SET")
                    .arg(keys.coordinator())
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(lease)
                    .query(c)
            })?;
            if took.is_some() {
                break;
            }
            if waited.elapsed() > Duration::from_millis(2 * lease + 500) {
                return Err(Error::Cluster(format!(
                    "run {} already has a live coordinator; give this one another --run name",
                    spec.run
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let existing: Option<String> =
            link.call(|c| redis::cmd("GET").arg(keys.spec()).query(c))?;
        if options.resume {
            if let Some(json) = existing {
                let previous: RunSpec = serde_json::from_str(&json).map_err(|e| {
                    Error::Cluster(format!("run {} holds an unreadable spec: {e}", spec.run))
                })?;
                if !previous.same_job(&spec) {
                    return Err(Error::Cluster(format!(
                        "run {} in Redis is a different calibration (model, data or recipe); resume it with the same inputs or pick another --run",
                        spec.run
                    )));
                }
                // The results already in the stream are sealed under the
                // run key of the previous coordinator's nonce.
                if options
                    .key
                    .run_key(&spec.run, &previous.nonce)
                    .check_value()
                    != previous.key_check
                {
                    return Err(Error::Cluster(format!(
                        "run {} was started under another cluster key than {}; resume it with that key or pick another --run",
                        spec.run,
                        options.key.source()
                    )));
                }
                spec.nonce = previous.nonce;
            }
        } else {
            let mut stale = keys.run_wide().to_vec();
            stale.extend(routed_streams(&mut link, &keys)?);
            // A worker following this pass into the next must wait for this
            // run's next pass, not leave on what an earlier run of the same
            // name left there.
            if let Some(next) = &spec.next_pass {
                let next = RunKeys::new(next)?;
                stale.extend(next.run_wide());
                stale.extend(routed_streams(&mut link, &next)?);
            }
            link.call(|c| redis::cmd("DEL").arg(&stale[..]).query::<i64>(c))?;
            link.call(|c| {
                redis::cmd("SET")
                    .arg(keys.coordinator())
                    .arg(&token)
                    .arg("PX")
                    .arg(lease)
                    .query::<()>(c)
            })?;
        }
        let run_key = options.key.run_key(&spec.run, &spec.nonce);
        spec.key_check = run_key.check_value();
        let json = serde_json::to_string(&spec).expect("a spec serializes");
        link.call(|c| {
            redis::pipe()
                .atomic()
                .cmd("SET")
                .arg(keys.spec())
                .arg(&json)
                .ignore()
                .cmd("SET")
                .arg(keys.state())
                .arg("running")
                .ignore()
                .query::<()>(c)
        })?;
        // Apart: `qforge:active` is not in the run's Redis Cluster slot. Set
        // after the spec, so a worker that follows it finds the run.
        link.call(|c| redis::cmd("SET").arg(ACTIVE).arg(keys.run()).query::<()>(c))?;
        Ok(Self {
            link: RefCell::new(link),
            keys,
            spec,
            run_key,
            batches_per_task: options.batches_per_task,
            token,
            alive: Cell::new(0),
            book: RefCell::new(Bookkeeping::default()),
            routing: RefCell::new(Routing::default()),
        })
    }

    /// Sizes tasks from `pace` (an earlier pass's) until this run measures
    /// its own, counting its workers until the first of this run joins.
    pub fn paced(self, pace: Pace) -> Self {
        {
            let mut book = self.book.borrow_mut();
            book.merge_seconds = Some(pace.merge_seconds);
            book.batch_seconds = Some(pace.batch_seconds);
            book.workers_from_pace = true;
        }
        self.alive.set(pace.workers);
        self
    }

    /// Routes each batch's tasks to the worker that `holders` names, the
    /// one whose result covered it in the pass before and so holds its
    /// hidden states: each such worker gets a task stream of its own, which
    /// it reads before the shared one, and from which idle workers steal
    /// once their own is empty (see the module's "Routing").
    pub fn routed(self, holders: BTreeMap<usize, String>) -> Self {
        self.book.borrow_mut().holders = holders;
        self
    }

    /// The worker whose result last covered each batch: the holders to
    /// route the next pass by.
    pub fn holders(&self) -> BTreeMap<usize, String> {
        self.book.borrow().holders.clone()
    }

    /// What this run measured of its tasks so far, once it has measured
    /// both times.
    pub fn pace(&self) -> Option<Pace> {
        let book = self.book.borrow();
        Some(Pace {
            merge_seconds: book.merge_seconds?,
            batch_seconds: book.batch_seconds?,
            workers: book.reporting.len(),
        })
    }

    /// Publishes `spec` as a run that will not happen (state `skipped`, no
    /// task): workers that follow the pass before it into this one find it
    /// and leave. Its keys expire after a day, as a finished run's.
    pub fn skip(mut spec: RunSpec, options: &ClusterOptions) -> Result<()> {
        spec.key_check = options.key.run_key(&spec.run, &spec.nonce).check_value();
        let keys = RunKeys::new(&spec.run)?;
        let mut link = Link::open(&options.redis, options.outage_limit)?;
        let json = serde_json::to_string(&spec).expect("a spec serializes");
        let mut stale = keys.run_wide().to_vec();
        stale.extend(routed_streams(&mut link, &keys)?);
        link.call(|c| {
            redis::pipe()
                .atomic()
                .cmd("DEL")
                .arg(&stale[..])
                .ignore()
                .cmd("SET")
                .arg(keys.spec())
                .arg(&json)
                .arg("EX")
                .arg(24 * 3600)
                .ignore()
                .cmd("SET")
                .arg(keys.state())
                .arg("skipped")
                .arg("EX")
                .arg(24 * 3600)
                .ignore()
                .query::<()>(c)
        })
    }

    /// The run's keys.
    pub fn keys(&self) -> &RunKeys {
        &self.keys
    }

    /// Marks the run finished (`done` or `failed`) so workers leave, deletes
    /// its task queue (waking the workers blocked on it), releases the
    /// coordinator lease and lets the run's keys expire after a day.
    /// After the pipeline's last pass succeeds, deletes its roundings.
    pub fn finish(&self, succeeded: bool) -> Result<()> {
        let mut link = self.link.borrow_mut();
        let keys = &self.keys;
        let routed = routed_streams(&mut link, keys)?;
        link.call(|c| {
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("SET")
                .arg(keys.state())
                .arg(if succeeded { "done" } else { "failed" })
                .ignore()
                .cmd("DEL")
                .arg(keys.coordinator())
                .ignore()
                // Wakes the workers blocked reading the queue: they see the
                // state at once, not at their next check, and a pipeline's
                // next pass does not wait for them.
                .cmd("DEL")
                .arg(keys.tasks())
                .arg(&routed[..])
                .ignore();
            for key in keys.run_wide() {
                pipe.cmd("EXPIRE").arg(key).arg(24 * 3600).ignore();
            }
            pipe.query::<()>(c)
        })?;
        // Only clear the active pointer if it still names this run.
        let active: Option<String> = link.call(|c| redis::cmd("GET").arg(ACTIVE).query(c))?;
        if active.as_deref() == Some(keys.run()) {
            link.call(|c| redis::cmd("DEL").arg(ACTIVE).query::<i64>(c))?;
        }
        if succeeded && self.spec.next_pass.is_none() {
            let pipeline = RunKeys::new(&self.spec.pipeline)?;
            rounding::release(&mut link, &pipeline, self.spec.recipe.pass.rounded())?;
        }
        Ok(())
    }

    /// Enqueues `batches` as tasks of up to `per_task` batches each: on the
    /// shared stream, or, in a routed run, on the streams of the workers
    /// [`Routing::target`] picks.
    fn enqueue(
        &self,
        link: &mut Link,
        plan: &Plan,
        batches: &[usize],
        per_task: usize,
    ) -> Result<()> {
        let mut by_stream: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        {
            let book = self.book.borrow();
            let mut routing = self.routing.borrow_mut();
            for &batch in batches {
                let stream = match routing.target(batch, &book.holders) {
                    Some(worker) => self.keys.routed_tasks(&worker),
                    None => self.keys.tasks(),
                };
                by_stream.entry(stream).or_default().push(batch);
            }
        }
        for (stream, batches) in by_stream {
            self.add_tasks(link, &stream, plan, &batches, per_task)?;
        }
        Ok(())
    }

    /// Appends `batches` to `stream` as tasks of up to `per_task` batches.
    fn add_tasks(
        &self,
        link: &mut Link,
        stream: &str,
        plan: &Plan,
        batches: &[usize],
        per_task: usize,
    ) -> Result<()> {
        let tasks: Vec<&[usize]> = batches.chunks(per_task.max(1)).collect();
        for chunk in tasks.chunks(512) {
            link.call(|c| {
                let mut pipe = redis::pipe();
                for task in chunk {
                    pipe.cmd("XADD")
                        .arg(stream)
                        .arg("*")
                        .arg("batches")
                        .arg(joined(task.iter()))
                        .arg("ids")
                        .arg(joined(task.iter().map(|&b| plan.batches[b].id)))
                        .ignore();
                }
                pipe.query::<()>(c)
            })?;
        }
        Ok(())
    }

    /// Batches per task when `remaining` batches of the plan are unresolved:
    /// as the options fix it, else as the type's documentation says.
    fn per_task(&self, remaining: usize) -> usize {
        if let Some(fixed) = self.batches_per_task {
            return fixed.get();
        }
        let book = self.book.borrow();
        let (Some(merge), Some(batch)) = (book.merge_seconds, book.batch_seconds) else {
            return 1;
        };
        let alive = self.alive.get().max(1);
        let keeping_up = (2.0 * alive as f64 * merge / batch.max(1e-6)).ceil();
        let spread = (remaining / (IN_FLIGHT_PER_WORKER * alive)).max(1);
        // `as` saturates: an infinite or huge ratio is the cap.
        (keeping_up as usize)
            .clamp(1, MAX_BATCHES_PER_TASK)
            .min(spread)
    }

    /// Fresh, empty task streams and groups: the shared one, and in a
    /// routed run one for each worker holding batches' hidden states.
    /// Whatever streams an earlier coordinator of the run left are deleted.
    fn reset_tasks(&self, link: &mut Link) -> Result<()> {
        let mut stale = routed_streams(link, &self.keys)?;
        stale.push(self.keys.tasks());
        let routes: Vec<String> = {
            let holders = &self.book.borrow().holders;
            let named: BTreeSet<&String> = holders.values().collect();
            named.into_iter().cloned().collect()
        };
        link.call(|c| {
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("DEL")
                .arg(&stale[..])
                .arg(self.keys.routes())
                .ignore();
            for stream in std::iter::once(self.keys.tasks())
                .chain(routes.iter().map(|r| self.keys.routed_tasks(r)))
            {
                pipe.cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .ignore();
            }
            if !routes.is_empty() {
                pipe.cmd("SADD")
                    .arg(self.keys.routes())
                    .arg(&routes[..])
                    .ignore();
            }
            pipe.query::<()>(c)
        })?;
        let mut routing = self.routing.borrow_mut();
        routing.routes = routes;
        routing.presumed_alive_until =
            Some(Instant::now() + Duration::from_millis(self.spec.heartbeat_timeout_ms));
        Ok(())
    }

    /// Gives `worker`, alive in a routed run without a stream of its own
    /// (it joined late), one: later tasks can be routed to it, and the
    /// batches it runs to the pass after.
    fn add_route(&self, link: &mut Link, worker: &str) -> Result<()> {
        self.create_group(link, &self.keys.routed_tasks(worker))?;
        link.call(|c| {
            redis::cmd("SADD")
                .arg(self.keys.routes())
                .arg(worker)
                .query::<i64>(c)
        })?;
        let mut routing = self.routing.borrow_mut();
        if let Err(at) = routing.routes.binary_search_by(|r| r.as_str().cmp(worker)) {
            routing.routes.insert(at, worker.to_owned());
        }
        Ok(())
    }

    /// The run's task streams: the shared one first, then the routed ones.
    fn task_streams(&self) -> Vec<String> {
        std::iter::once(self.keys.tasks())
            .chain(
                self.routing
                    .borrow()
                    .routes
                    .iter()
                    .map(|r| self.keys.routed_tasks(r)),
            )
            .collect()
    }

    /// Moves whole tasks' worth of batches from `backlog` to `open`
    /// (enqueued, unresolved) until the run has its limit of tasks in
    /// flight. A result waits in Redis only for a task in flight, so when
    /// the coordinator merges slower than the workers observe, Redis holds a
    /// bounded number of results instead of the rest of the plan's (a
    /// SmolLM2 result is 1 MB).
    fn issue(
        &self,
        link: &mut Link,
        plan: &Plan,
        backlog: &mut BTreeSet<usize>,
        open: &mut BTreeSet<usize>,
    ) -> Result<()> {
        let per_task = self.per_task(backlog.len() + open.len());
        let limit = (IN_FLIGHT_PER_WORKER * self.alive.get() * per_task).max(MIN_IN_FLIGHT);
        let mut batches = Vec::new();
        while open.len() + per_task <= limit.max(per_task) && !backlog.is_empty() {
            for _ in 0..per_task {
                let Some(batch) = backlog.pop_first() else {
                    break;
                };
                open.insert(batch);
                batches.push(batch);
            }
        }
        self.enqueue(link, plan, &batches, per_task)
    }

    fn create_group(&self, link: &mut Link, stream: &str) -> Result<()> {
        link.call(|c| {
            match redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(stream)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query::<()>(c)
            {
                Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
                other => other,
            }
        })
    }

    /// The periodic check ([`RECONCILE_EVERY`]): renews the coordinator's
    /// lease (failing if another took the run over), counts the live
    /// workers, gives late joiners of a routed run their stream and takes
    /// back what dead ones held on theirs, and reconciles the task streams
    /// with the open batches (`open`).
    fn check(
        &self,
        link: &mut Link,
        plan: &Plan,
        open: &BTreeSet<usize>,
        drained: bool,
    ) -> Result<()> {
        let token = &self.token;
        let held: Option<String> = link.call(|c| {
            redis::cmd("SET")
                .arg(self.keys.coordinator())
                .arg(token)
                .arg("PX")
                .arg(self.spec.heartbeat_timeout_ms)
                .arg("GET")
                .query(c)
        })?;
        if held.as_deref().is_some_and(|h| h != token) {
            return Err(Error::Cluster(format!(
                "another coordinator took over run {}; this one stops",
                self.keys.run()
            )));
        }
        let alive = self.alive_workers(link)?;
        let mut book = self.book.borrow_mut();
        // A pass's workers join after it opens: until one has, the count of
        // the pass it was paced from stands.
        if !alive.is_empty() || !book.workers_from_pace {
            book.workers_from_pace = false;
            self.alive.set(alive.len());
        }
        drop(book);
        if !self.routing.borrow().routes.is_empty() {
            let unrouted: Vec<&String> = {
                let routing = self.routing.borrow();
                alive
                    .iter()
                    .filter(|w| routing.routes.binary_search(w).is_err())
                    .collect()
            };
            for worker in unrouted {
                self.add_route(link, worker)?;
            }
            self.routing.borrow_mut().alive = alive;
            self.reassign_dead(link, plan, open)?;
        }
        self.reconcile(link, plan, open, drained)
    }

    /// Re-enqueues unresolved batches that have neither a queued nor a
    /// pending task two checks in a row (Redis lost the task, or a result
    /// and its acknowledgement).
    ///
    /// A batch whose result is published but not read yet has no task
    /// either (its worker acknowledged it), so a check counts only once the
    /// coordinator has read the results stream to its end (`drained`):
    /// workers publish before they acknowledge, so every result of a batch
    /// that looked lost at the previous check has been read by then. Checking
    /// behind a backlog re-enqueued 38 845 tasks of a clean 20 000-batch run.
    fn reconcile(
        &self,
        link: &mut Link,
        plan: &Plan,
        open: &BTreeSet<usize>,
        drained: bool,
    ) -> Result<()> {
        let mut delivered = Vec::new();
        for stream in self.task_streams() {
            match last_delivered(link, &stream)? {
                Some(id) => delivered.push((stream, id)),
                None if stream == self.keys.tasks() => {
                    // Redis lost the shared stream or its group: recreate,
                    // re-enqueue all.
                    self.create_group(link, &stream)?;
                    let all: Vec<usize> = open.iter().copied().collect();
                    self.enqueue(link, plan, &all, self.per_task(open.len()))?;
                    self.book.borrow_mut().reenqueued += all.len();
                    return Ok(());
                }
                // A routed stream lost: recreated for its owner to read;
                // the batches it held are re-enqueued below, as any lost.
                None => self.create_group(link, &stream)?,
            }
        }
        if !drained {
            return Ok(());
        }
        let mut covered = BTreeSet::new();
        for (stream, last_delivered) in &delivered {
            let entries: StreamRangeReply =
                link.call(|c| redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(c))?;
            let pending: StreamPendingCountReply = link.call(|c| {
                redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(GROUP)
                    .arg("-")
                    .arg("+")
                    .arg(entries.ids.len().max(1))
                    .query(c)
            })?;
            let pending: BTreeSet<&str> = pending.ids.iter().map(|p| p.id.as_str()).collect();
            let delivered_up_to = entry_id(last_delivered);
            covered.extend(
                entries
                    .ids
                    .iter()
                    .filter(|e| {
                        entry_id(&e.id) > delivered_up_to || pending.contains(e.id.as_str())
                    })
                    .filter_map(named_batches)
                    .flatten(),
            );
        }
        let uncovered: BTreeSet<usize> = open.difference(&covered).copied().collect();
        let mut book = self.book.borrow_mut();
        let lost: Vec<usize> = uncovered.intersection(&book.suspects).copied().collect();
        book.suspects = uncovered.difference(&book.suspects).copied().collect();
        if !lost.is_empty() {
            book.reenqueued += lost.len();
            drop(book);
            self.enqueue(link, plan, &lost, 1)?;
        }
        Ok(())
    }

    /// Takes back the tasks held on routed streams by dead workers (their
    /// heartbeat expired, or does not name the task while it has been
    /// pending past the timeout: a worker restarted under the same name),
    /// and enqueues their unresolved batches on the shared stream. There the
    /// workers' own reclaim takes over if the next worker dies too, and
    /// counts the deliveries that fail a batch which kills every worker.
    ///
    /// The coordinator does this for every routed stream once a check;
    /// were the workers to, each would list every stream's pending tasks
    /// at every check: a cost growing with the square of the workers.
    fn reassign_dead(&self, link: &mut Link, plan: &Plan, open: &BTreeSet<usize>) -> Result<()> {
        let routes = self.routing.borrow().routes.clone();
        let timeout = self.spec.heartbeat_timeout_ms;
        let mut stale = Vec::new();
        for owner in &routes {
            let stream = self.keys.routed_tasks(owner);
            let idle = idle_pending(link, &stream, timeout, 64, None)?;
            stale.extend(idle.into_iter().map(|p| (stream.clone(), owner, p)));
        }
        if stale.is_empty() {
            return Ok(());
        }
        let beats: Vec<String> = stale
            .iter()
            .map(|(_, _, pending)| self.keys.heartbeat(&pending.consumer))
            .collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        for ((stream, owner, pending), beat) in stale.iter().zip(beats) {
            let label = routed_label(owner, &pending.id);
            if beat.is_some_and(|held| held.split(',').any(|task| task == label)) {
                continue;
            }
            let range: StreamRangeReply = link.call(|c| {
                redis::cmd("XRANGE")
                    .arg(stream)
                    .arg(&pending.id)
                    .arg(&pending.id)
                    .query(c)
            })?;
            link.call(|c| {
                redis::cmd("XACK")
                    .arg(stream)
                    .arg(GROUP)
                    .arg(&pending.id)
                    .query::<i64>(c)
            })?;
            let unresolved: Vec<usize> = range
                .ids
                .first()
                .and_then(named_batches)
                .unwrap_or_default()
                .into_iter()
                .filter(|batch| open.contains(batch))
                .collect();
            if !unresolved.is_empty() {
                self.add_tasks(
                    link,
                    &self.keys.tasks(),
                    plan,
                    &unresolved,
                    unresolved.len(),
                )?;
                self.book.borrow_mut().reassigned += 1;
            }
        }
        Ok(())
    }

    /// Workers whose heartbeat key is alive.
    fn alive_workers(&self, link: &mut Link) -> Result<BTreeSet<String>> {
        let names: Vec<String> =
            link.call(|c| redis::cmd("HKEYS").arg(self.keys.workers()).query(c))?;
        if names.is_empty() {
            return Ok(BTreeSet::new());
        }
        let beats: Vec<String> = names.iter().map(|n| self.keys.heartbeat(n)).collect();
        let beats: Vec<Option<String>> =
            link.call(|c| redis::cmd("MGET").arg(&beats[..]).query(c))?;
        Ok(names
            .into_iter()
            .zip(beats)
            .filter_map(|(name, beat)| beat.map(|_| name))
            .collect())
    }

    /// Turns a results entry, as it was `received`, into an outcome; `None`
    /// (with the reason counted) for one that must not reach the merge.
    fn outcome(
        &self,
        link: &mut Link,
        plan: &Plan,
        entry: &StreamId,
        received: Received,
    ) -> Result<Option<Outcome>> {
        let text = |field: &str| entry.get::<String>(field).unwrap_or_default();
        let worker = text("worker");
        if let Received::Unsealed = received {
            let mut book = self.book.borrow_mut();
            if book.unsealed.len() < UNSEALED_NAMED {
                book.unsealed.push(format!(
                    "entry {} (claiming worker {worker:?}, batches {:?})",
                    entry.id,
                    text("batches")
                ));
            }
            drop(book);
            return self.drop_as(
                "fails its MAC under this run's key: something that does not hold the cluster \
                 key wrote it to Redis; check who can write to it",
            );
        }
        let Some(batches) =
            named_batches(entry).filter(|batches| batches.iter().all(|&b| b < plan.batches.len()))
        else {
            return self.drop_as("names no batch of this plan");
        };
        if text("ids") != joined(batches.iter().map(|&b| plan.batches[b].id)) {
            return self.drop_as("has batch ids that differ from the plan's");
        }
        if let Some(message) = entry.get::<String>("error") {
            let kind = entry.get::<String>("failure");
            return Ok(Some(Outcome::Failed {
                batches,
                worker,
                error: Failure::from_parts(kind.as_deref(), message),
            }));
        }
        if self.book.borrow().reference.is_none() {
            let reference: Option<String> =
                link.call(|c| redis::cmd("GET").arg(self.keys.reference()).query(c))?;
            self.book.borrow_mut().reference = reference;
        }
        let mixed = self.book.borrow().reference.as_deref() != Some(text("fingerprint").as_str());
        if mixed && !self.spec.allow_mixed_hardware {
            return self.drop_as("came from a worker whose determinism fingerprint differs");
        }
        let Received::Stats { decoded, digest } = received else {
            return self.drop_as("carries neither statistics nor an error");
        };
        let mut stats = match decoded {
            Ok(stats) => stats,
            Err(e) => {
                return Ok(Some(Outcome::Failed {
                    batches,
                    worker,
                    error: Failure::Worker(format!("the result does not decode: {e}")),
                }));
            }
        };
        stats.provenance.mixed_hardware |= mixed;
        let mut book = self.book.borrow_mut();
        book.reporting.insert(worker.clone());
        for &batch in &batches {
            book.holders.insert(batch, worker.clone());
        }
        drop(book);
        let elapsed = Duration::from_micros(entry.get::<u64>("elapsed_us").unwrap_or(0));
        Bookkeeping::smooth(
            &mut self.book.borrow_mut().batch_seconds,
            elapsed.as_secs_f64() / batches.len() as f64,
        );
        Ok(Some(Outcome::Done {
            batches,
            stats: Box::new(stats),
            worker,
            elapsed,
            speculative: text("speculative") == "1",
            // Results computed under another fingerprint may differ in
            // their last bits: only same-fingerprint copies must agree.
            digest: (!mixed).then_some(digest),
        }))
    }

    /// Counts a result dropped for `why` (the warning reads "dropped N
    /// result(s) that `why`").
    fn drop_as(&self, why: &str) -> Result<Option<Outcome>> {
        *self
            .book
            .borrow_mut()
            .dropped
            .entry(why.to_owned())
            .or_default() += 1;
        Ok(None)
    }
}

impl Backend for RedisBackend {
    fn workers(&self) -> usize {
        self.alive.get()
    }

    fn run(
        &self,
        plan: &Plan,
        pending: &[usize],
        on_outcome: &mut dyn FnMut(Outcome) -> Result<Next>,
    ) -> Result<()> {
        let mut link = self.link.borrow_mut();
        self.reset_tasks(&mut link)?;
        let results = self.keys.results();
        // Pending batches not enqueued yet, and those enqueued and unresolved.
        let mut backlog: BTreeSet<usize> = pending.iter().copied().collect();
        let mut open = BTreeSet::new();
        // From the start of the stream: a resumed coordinator also merges what
        // workers finished while it was down (duplicates of the checkpoint
        // are dropped by the merge).
        let mut cursor = self
            .book
            .borrow()
            .cursor
            .clone()
            .unwrap_or_else(|| "0-0".into());
        let mut housekeeping = Instant::now() - RECONCILE_EVERY;
        // Whether the last read reached the end of the results stream.
        let mut drained = true;
        loop {
            if housekeeping.elapsed() >= RECONCILE_EVERY {
                housekeeping = Instant::now();
                self.check(&mut link, plan, &open, drained)?;
            }
            self.issue(&mut link, plan, &mut backlog, &mut open)?;
            let reply: Option<StreamReadReply> = link.call(|c| {
                redis::cmd("XREAD")
                    .arg("COUNT")
                    .arg(READ_COUNT)
                    .arg("BLOCK")
                    .arg(250)
                    .arg("STREAMS")
                    .arg(&results)
                    .arg(&cursor)
                    .query(c)
            })?;
            let entries: Vec<StreamId> = reply
                .into_iter()
                .flat_map(|r| r.keys)
                .flat_map(|k| k.ids)
                .collect();
            drained = entries.len() < READ_COUNT;
            if entries.is_empty() {
                continue;
            }
            let started = Instant::now();
            let mut shapes = self.book.borrow_mut().shapes.take();
            let received = receive_all(&entries, &self.run_key, &mut shapes);
            self.book.borrow_mut().shapes = shapes;
            for (entry, received) in entries.iter().zip(received) {
                refuse_future_id(&results, &entry.id)?;
                cursor = entry.id.clone();
                self.book.borrow_mut().cursor = Some(cursor.clone());
                let Some(outcome) = self.outcome(&mut link, plan, entry, received)? else {
                    continue;
                };
                let covered = match &outcome {
                    Outcome::Done { batches, .. } | Outcome::Failed { batches, .. } => {
                        batches.clone()
                    }
                };
                drop(link);
                let next = on_outcome(outcome);
                link = self.link.borrow_mut();
                let again = match next? {
                    Next::Continue => Vec::new(),
                    Next::Retry(again) => again,
                    Next::Stop => return Ok(()),
                };
                // Settled, all but `again`. A resumed coordinator may merge,
                // from before its crash, a batch it has not enqueued again.
                for batch in covered.iter().filter(|b| !again.contains(b)) {
                    open.remove(batch);
                    backlog.remove(batch);
                }
                for &batch in &again {
                    backlog.remove(&batch);
                    open.insert(batch);
                }
                // One by one: a batch that fails does not take others down.
                self.enqueue(&mut link, plan, &again, 1)?;
            }
            Bookkeeping::smooth(
                &mut self.book.borrow_mut().merge_seconds,
                started.elapsed().as_secs_f64() / entries.len() as f64,
            );
        }
    }

    fn committed(&self) -> Result<()> {
        let Some((ms, seq)) = self.book.borrow().cursor.as_deref().and_then(entry_id) else {
            return Ok(());
        };
        // XTRIM MINID drops entries below the id: everything up to the
        // cursor. A forged entry may carry the largest sequence number.
        let min_id = match seq.checked_add(1) {
            Some(next) => format!("{ms}-{next}"),
            None => format!("{}-0", ms.saturating_add(1)),
        };
        self.link.borrow_mut().call(|c| {
            redis::cmd("XTRIM")
                .arg(self.keys.results())
                .arg("MINID")
                .arg(&min_id)
                .query::<i64>(c)
        })?;
        Ok(())
    }

    fn warnings(&self) -> Vec<String> {
        let book = self.book.borrow();
        let mut warnings: Vec<String> = book
            .dropped
            .iter()
            .map(|(why, n)| format!("dropped {n} result(s) that {why}"))
            .collect();
        if !book.unsealed.is_empty() {
            warnings.push(format!(
                "refused unsealed result(s), first: {}",
                book.unsealed.join("; ")
            ));
        }
        if book.reassigned > 0 {
            warnings.push(format!(
                "took back {} task(s) from workers that died holding them",
                book.reassigned
            ));
        }
        if book.reenqueued > 0 {
            warnings.push(format!(
                "re-enqueued {} task(s) that Redis lost (a restart without the last writes); they were recomputed",
                book.reenqueued
            ));
        }
        warnings
    }

    fn refused_results(&self) -> usize {
        self.book.borrow().dropped.values().sum()
    }
}

/// The routed task streams of `keys`' run that Redis lists.
fn routed_streams(link: &mut Link, keys: &RunKeys) -> Result<Vec<String>> {
    let routes: Vec<String> = link.call(|c| redis::cmd("SMEMBERS").arg(keys.routes()).query(c))?;
    Ok(routes.iter().map(|r| keys.routed_tasks(r)).collect())
}

/// The last entry of `stream` delivered to its group; `None` when Redis
/// lost the stream or the group.
fn last_delivered(link: &mut Link, stream: &str) -> Result<Option<String>> {
    let groups: Option<StreamInfoGroupsReply> =
        link.call(
            |c| match redis::cmd("XINFO").arg("GROUPS").arg(stream).query(c) {
                Ok(reply) => Ok(Some(reply)),
                Err(e) if e.to_string().contains("no such key") => Ok(None),
                Err(e) => Err(e),
            },
        )?;
    Ok(groups
        .and_then(|g| g.groups.into_iter().find(|g| g.name == GROUP))
        .map(|g| g.last_delivered_id))
}
