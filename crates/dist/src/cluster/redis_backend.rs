//! The coordinator's side of the Redis backend.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use qforge_calib::{Plan, RoundedLayers};
use qforge_core::Stats;
use qforge_core::codec::decode;
use redis::Value;
use redis::streams::{
    StreamId, StreamInfoGroupsReply, StreamPendingCountReply, StreamRangeReply, StreamReadReply,
};

use super::keys::{ACTIVE, GROUP, RunKeys, entry_id, joined, named_batches};
use super::link::{Link, RedisAddress};
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
}

/// How often the coordinator checks that no task was lost.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

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
    spec: RunSpec,
    batches_per_task: Option<NonZeroUsize>,
    token: String,
    alive: Cell<usize>,
    book: RefCell<Bookkeeping>,
}

impl RedisBackend {
    /// Connects, publishes the roundings the pass runs with (from
    /// `roundings`, the coordinator's; see the module's "Roundings"), takes
    /// the coordinator role of `spec.run` (waiting out a crashed
    /// predecessor's lease) and publishes the spec. Unless resuming,
    /// whatever an earlier run of that name left is cleared.
    pub fn open(
        spec: RunSpec,
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
            }
        } else {
            let mut stale = keys.run_wide().to_vec();
            // A worker following this pass into the next must wait for this
            // run's next pass, not leave on what an earlier run of the same
            // name left there.
            if let Some(next) = &spec.next_pass {
                stale.extend(RunKeys::new(next)?.run_wide());
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
            batches_per_task: options.batches_per_task,
            token,
            alive: Cell::new(0),
            book: RefCell::new(Bookkeeping::default()),
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
    pub fn skip(spec: RunSpec, options: &ClusterOptions) -> Result<()> {
        let keys = RunKeys::new(&spec.run)?;
        let mut link = Link::open(&options.redis, options.outage_limit)?;
        let json = serde_json::to_string(&spec).expect("a spec serializes");
        let stale = keys.run_wide();
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

    /// Enqueues `batches` as tasks of up to `per_task` batches each.
    fn enqueue(
        &self,
        link: &mut Link,
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
                        .arg(self.keys.tasks())
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

    /// A fresh, empty task stream and group.
    fn reset_tasks(&self, link: &mut Link) -> Result<()> {
        let tasks = self.keys.tasks();
        link.call(|c| redis::cmd("DEL").arg(&tasks).query::<i64>(c))?;
        self.create_group(link)
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

    fn create_group(&self, link: &mut Link) -> Result<()> {
        let tasks = self.keys.tasks();
        link.call(|c| {
            match redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&tasks)
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
        let tasks = self.keys.tasks();
        let groups: Option<StreamInfoGroupsReply> =
            link.call(
                |c| match redis::cmd("XINFO").arg("GROUPS").arg(&tasks).query(c) {
                    Ok(reply) => Ok(Some(reply)),
                    Err(e) if e.to_string().contains("no such key") => Ok(None),
                    Err(e) => Err(e),
                },
            )?;
        let last_delivered = groups
            .and_then(|g| g.groups.into_iter().find(|g| g.name == GROUP))
            .map(|g| g.last_delivered_id);
        let Some(last_delivered) = last_delivered else {
            // Redis lost the stream or the group: recreate, re-enqueue all.
            self.create_group(link)?;
            let all: Vec<usize> = open.iter().copied().collect();
            self.enqueue(link, plan, &all, self.per_task(open.len()))?;
            self.book.borrow_mut().reenqueued += all.len();
            return Ok(());
        };
        if !drained {
            return Ok(());
        }
        let entries: StreamRangeReply =
            link.call(|c| redis::cmd("XRANGE").arg(&tasks).arg("-").arg("+").query(c))?;
        let pending: StreamPendingCountReply = link.call(|c| {
            redis::cmd("XPENDING")
                .arg(&tasks)
                .arg(GROUP)
                .arg("-")
                .arg("+")
                .arg(entries.ids.len().max(1))
                .query(c)
        })?;
        let pending: BTreeSet<&str> = pending.ids.iter().map(|p| p.id.as_str()).collect();
        let delivered_up_to = entry_id(&last_delivered);
        let covered: BTreeSet<usize> = entries
            .ids
            .iter()
            .filter(|e| entry_id(&e.id) > delivered_up_to || pending.contains(e.id.as_str()))
            .filter_map(named_batches)
            .flatten()
            .collect();
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

    /// Workers whose heartbeat key is alive.
    fn count_alive(&self, link: &mut Link) -> Result<usize> {
        let names: Vec<String> =
            link.call(|c| redis::cmd("HKEYS").arg(self.keys.workers()).query(c))?;
        if names.is_empty() {
            return Ok(0);
        }
        let beats: Vec<String> = names.iter().map(|n| self.keys.heartbeat(n)).collect();
        link.call(|c| redis::cmd("EXISTS").arg(&beats[..]).query(c))
    }

    /// Turns a results entry, whose statistics (if it carries any) are
    /// `decoded`, into an outcome; `None` (with the reason counted) for one
    /// that must not reach the merge.
    fn outcome(
        &self,
        link: &mut Link,
        plan: &Plan,
        entry: &StreamId,
        decoded: Option<qforge_core::Result<Stats>>,
    ) -> Result<Option<Outcome>> {
        let text = |field: &str| entry.get::<String>(field).unwrap_or_default();
        let worker = text("worker");
        let drop_as = |why: &str| {
            *self
                .book
                .borrow_mut()
                .dropped
                .entry(why.to_owned())
                .or_default() += 1;
            Ok(None)
        };
        let Some(batches) =
            named_batches(entry).filter(|batches| batches.iter().all(|&b| b < plan.batches.len()))
        else {
            return drop_as("names no batch of this plan");
        };
        if text("ids") != joined(batches.iter().map(|&b| plan.batches[b].id)) {
            return drop_as("has batch ids that differ from the plan's");
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
            return drop_as("came from a worker whose determinism fingerprint differs");
        }
        let Some(decoded) = decoded else {
            return drop_as("carries neither statistics nor an error");
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
        self.book.borrow_mut().reporting.insert(worker.clone());
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
        }))
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
        let lease = self.spec.heartbeat_timeout_ms;
        loop {
            if housekeeping.elapsed() >= RECONCILE_EVERY {
                housekeeping = Instant::now();
                let token = &self.token;
                let held: Option<String> = link.call(|c| {
                    redis::cmd("SET")
                        .arg(self.keys.coordinator())
                        .arg(token)
                        .arg("PX")
                        .arg(lease)
                        .arg("GET")
                        .query(c)
                })?;
                if held.as_deref().is_some_and(|h| h != token) {
                    return Err(Error::Cluster(format!(
                        "another coordinator took over run {}; this one stops",
                        self.keys.run()
                    )));
                }
                let counted = self.count_alive(&mut link)?;
                let mut book = self.book.borrow_mut();
                // A pass's workers join after it opens: until one has,
                // the count of the pass it was paced from stands.
                if counted > 0 || !book.workers_from_pace {
                    book.workers_from_pace = false;
                    self.alive.set(counted);
                }
                drop(book);
                self.reconcile(&mut link, plan, &open, drained)?;
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
            let decoded = decode_all(&entries);
            for (entry, decoded) in entries.iter().zip(decoded) {
                cursor = entry.id.clone();
                self.book.borrow_mut().cursor = Some(cursor.clone());
                let Some(outcome) = self.outcome(&mut link, plan, entry, decoded)? else {
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

/// The statistics each results entry carries, decoded on every core the
/// machine has, in the entries' order: decoding is most of what the
/// coordinator spends on a result (5 of 7 ms for a SmolLM2 batch's 1 MB),
/// while merging them stays in order on one thread.
fn decode_all(entries: &[StreamId]) -> Vec<Option<qforge_core::Result<Stats>>> {
    let decode_one = |entry: &StreamId| match entry.map.get("stats") {
        Some(Value::BulkString(bytes)) => Some(decode(bytes)),
        _ => None,
    };
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    if threads < 2 || entries.len() < 2 {
        return entries.iter().map(decode_one).collect();
    }
    let per_thread = entries.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = entries
            .chunks(per_thread)
            .map(|part| scope.spawn(move || part.iter().map(decode_one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| {
                part.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
