//! The coordinator's side of the Redis backend.
//!
//! This file holds the backend itself: opening a run (the coordinator's
//! lease, the spec), finishing or skipping one, and [`Backend::run`], the
//! loop that issues tasks and hands each result to the generic coordinator.
//! The files below hold its two other jobs:
//!
//! - `tasks.rs`: the task streams: enqueuing (sized, paced and routed),
//!   the periodic check (the lease, live workers, late joiners' routes,
//!   taking back dead workers' routed tasks) and the reconciliation that
//!   re-enqueues what Redis lost;
//! - `results.rs`: turning a results entry into an [`Outcome`], or
//!   dropping it with the reason counted.
//!
//! The decisions (sizes, pacing, routes, what is lost or abandoned) are
//! `cluster/policy.rs`'s; these files read Redis and carry them out.

mod results;
mod tasks;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use qforge_calib::{Plan, RoundedLayers};
use qforge_core::codec::Shapes;
use redis::streams::{StreamId, StreamReadReply};

use super::auth::{ClusterKey, RunKey};
use super::keys::{ACTIVE, RunKeys, entry_id, now_ms};
use super::link::{Link, RedisAddress};
use super::policy::{self, Routing};
use super::receive::{receive_all, refuse_future_id};
use super::rounding;
use super::spec::RunSpec;
use crate::backend::{Backend, Next, Outcome};
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
/// most 64, `MAX_BATCHES_PER_TASK` in `policy`), and no more than lets every
/// worker have two tasks of what is left of the plan.
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
        take_coordinator_role(&mut link, &keys, &token, lease, &spec.run)?;
        resume_or_clear(&mut link, &keys, &mut spec, options, (&token, lease))?;
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
                policy::settle(&covered, &again, &mut open, &mut backlog);
                // One by one: a batch that fails does not take others down.
                self.enqueue(&mut link, plan, &again, 1)?;
            }
            policy::smooth(
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

/// Takes the coordinator role of a run (`SET NX` with a `lease`), waiting
/// out a crashed predecessor's lease; a live coordinator keeps it.
fn take_coordinator_role(
    link: &mut Link,
    keys: &RunKeys,
    token: &str,
    lease: u64,
    run: &str,
) -> Result<()> {
    let waited = Instant::now();
    loop {
        let took: Option<String> = link.call(|c| {
            redis::cmd("SET")
                .arg(keys.coordinator())
                .arg(token)
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
                run
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Resuming: checks that the run in Redis is this calibration under this
/// cluster key and adopts its nonce (its sealed results stay readable).
/// Otherwise: clears whatever an earlier run of the name left, and renews
/// the coordinator's lease on `token`.
fn resume_or_clear(
    link: &mut Link,
    keys: &RunKeys,
    spec: &mut RunSpec,
    options: &ClusterOptions,
    (token, lease): (&str, u64),
) -> Result<()> {
    let existing: Option<String> = link.call(|c| redis::cmd("GET").arg(keys.spec()).query(c))?;
    if options.resume {
        if let Some(json) = existing {
            let previous: RunSpec = serde_json::from_str(&json).map_err(|e| {
                Error::Cluster(format!("run {} holds an unreadable spec: {e}", spec.run))
            })?;
            if !previous.same_job(spec) {
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
        stale.extend(routed_streams(link, keys)?);
        // A worker following this pass into the next must wait for this
        // run's next pass, not leave on what an earlier run of the same
        // name left there.
        if let Some(next) = &spec.next_pass {
            let next = RunKeys::new(next)?;
            stale.extend(next.run_wide());
            stale.extend(routed_streams(link, &next)?);
        }
        link.call(|c| redis::cmd("DEL").arg(&stale[..]).query::<i64>(c))?;
        link.call(|c| {
            redis::cmd("SET")
                .arg(keys.coordinator())
                .arg(token)
                .arg("PX")
                .arg(lease)
                .query::<()>(c)
        })?;
    }
    Ok(())
}
