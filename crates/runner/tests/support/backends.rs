//! The backends every conformance test runs on (embedded always, Redis when
//! a server could be started), a run of the Pendulum job on either, and
//! faults injected into what the coordinator sees.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use qforge_calib::{Plan, RoundedLayers, Session};
use qforge_runner::cluster::{ClusterOptions, RedisBackend, RunSpec, WorkerOptions, run_worker};
use qforge_runner::{
    Backend, Embedded, Error, Failure, Next, Outcome, RunOptions, RunSummary, run,
};

use super::pendulum::{address, session, setup_of, test_key};
use super::redis_server::RedisServer;

/// A scratch directory, removed when dropped.
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-runner-{name}-"))
        .tempdir()
        .unwrap()
}

/// The backends every test runs on: embedded always, Redis when a server
/// could be started (always under CI).
pub fn backends(test: &str) -> Vec<Option<RedisServer>> {
    let mut kinds = vec![None];
    if let Some(server) = RedisServer::start(test, None) {
        kinds.push(Some(server));
    }
    kinds
}

/// Runs the job on the embedded backend (`redis` is `None`) or on Redis with
/// `workers` worker threads joining run `name`, one batch per task (so the
/// counts of retries and duplicates are per batch); `faults` wraps the
/// backend.
pub fn run_on(
    redis: Option<&RedisServer>,
    name: &str,
    workers: usize,
    options: &RunOptions,
    faults: &Faults,
) -> qforge_runner::Result<RunSummary> {
    run_session_on(session(), redis, name, workers, BY_BATCH, options, faults)
}

/// One batch per task.
pub const BY_BATCH: Option<NonZeroUsize> = NonZeroUsize::new(1);

/// [`run_on`] for another session than the default, `per_task` batches
/// per task on Redis (`None`: sized by the coordinator).
pub fn run_session_on(
    session: Session,
    redis: Option<&RedisServer>,
    name: &str,
    workers: usize,
    per_task: Option<NonZeroUsize>,
    options: &RunOptions,
    faults: &Faults,
) -> qforge_runner::Result<RunSummary> {
    let spec = RunSpec::new(name, &session, &session.job(&session.recipe, &[]));
    let (target, job, plan) = setup_of(session);
    let Some(server) = redis else {
        let backend = Embedded::new(target, job.clone(), workers);
        return run(&job, &plan, &faults.wrap(&backend), options, &mut |_| {});
    };
    let mut spec = spec?;
    // Speculation would add duplicates whose count depends on timing; the
    // counting assertions below want none (speculation is tested with real
    // processes in the CLI tests).
    spec.speculation = 1.0;
    spec.heartbeat_ms = 100;
    spec.heartbeat_timeout_ms = 600;
    let backend = RedisBackend::open(
        spec,
        &ClusterOptions {
            redis: address(server),
            resume: options.resume,
            outage_limit: Duration::from_secs(10),
            key: test_key(),
            batches_per_task: per_task,
        },
        &RoundedLayers::default(),
    )?;
    std::thread::scope(|scope| {
        for w in 0..workers {
            let worker = WorkerOptions {
                redis: address(server),
                run: Some(name.to_owned()),
                name: format!("{name}-w{w}"),
                forever: false,
                wait: Duration::from_secs(10),
                outage_limit: Duration::from_secs(10),
                key: test_key(),
            };
            scope.spawn(move || run_worker(&worker, &mut |_| {}).unwrap());
        }
        let summary = run(&job, &plan, &faults.wrap(&backend), options, &mut |_| {});
        backend.finish(summary.is_ok()).unwrap();
        summary
    })
}

/// Faults injected into what the coordinator sees.
#[derive(Default)]
pub struct Faults {
    /// Deliver every result twice (a speculative re-execution).
    pub duplicate: bool,
    /// Fail this batch index this many times before letting it through.
    pub fail: Option<(usize, usize)>,
    /// Stop the run with an error after this many outcomes (a coordinator crash).
    pub crash_after: Option<usize>,
    /// Take this long over every outcome (a coordinator that falls behind
    /// the results stream).
    pub slow_merge: Option<Duration>,
}

impl Faults {
    pub fn none() -> Self {
        Self::default()
    }

    pub fn wrap<'a>(&'a self, inner: &'a dyn Backend) -> Faulty<'a> {
        Faulty {
            inner,
            faults: self,
            seen: AtomicUsize::new(0),
            failures: AtomicUsize::new(0),
        }
    }
}

/// A backend with [`Faults`] injected.
pub struct Faulty<'a> {
    inner: &'a dyn Backend,
    faults: &'a Faults,
    seen: AtomicUsize,
    failures: AtomicUsize,
}

impl Backend for Faulty<'_> {
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    fn committed(&self) -> qforge_runner::Result<()> {
        self.inner.committed()
    }

    fn warnings(&self) -> Vec<String> {
        self.inner.warnings()
    }

    fn refused_results(&self) -> usize {
        self.inner.refused_results()
    }

    fn run(
        &self,
        plan: &Plan,
        pending: &[usize],
        on: &mut dyn FnMut(Outcome) -> qforge_runner::Result<Next>,
    ) -> qforge_runner::Result<()> {
        self.inner.run(plan, pending, &mut |outcome| {
            if let Some(pause) = self.faults.slow_merge {
                std::thread::sleep(pause);
            }
            if let Some(limit) = self.faults.crash_after
                && self.seen.fetch_add(1, Ordering::SeqCst) >= limit
            {
                return Err(Error::WorkerPanic("simulated coordinator crash".into()));
            }
            // A task holding the failing batch fails whole.
            let outcome = match (outcome, self.faults.fail) {
                (
                    Outcome::Done {
                        batches, worker, ..
                    },
                    Some((b, times)),
                ) if batches.contains(&b)
                    && self.failures.fetch_add(1, Ordering::SeqCst) < times =>
                {
                    Outcome::Failed {
                        batches,
                        worker,
                        error: Failure::Worker("injected failure".into()),
                    }
                }
                (o, _) => o,
            };
            if self.faults.duplicate
                && let Outcome::Done {
                    batches,
                    stats,
                    worker,
                    elapsed,
                    digest,
                    ..
                } = &outcome
            {
                let copy = Outcome::Done {
                    batches: batches.clone(),
                    stats: stats.clone(),
                    worker: format!("{worker}-speculative"),
                    elapsed: *elapsed,
                    speculative: true,
                    digest: *digest,
                };
                if on(copy)? == Next::Stop {
                    return Ok(Next::Stop);
                }
            }
            on(outcome)
        })
    }
}
