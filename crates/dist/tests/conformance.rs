//! Conformance of a backend + coordinator, run against both backends
//! (embedded threads, and Redis with worker threads on a real `redis-server`):
//! the merged statistics are byte-identical to a clean single-worker run
//! whatever the worker count, the order of results, duplicates, failures, a
//! coordinator crash and resume, or a corrupt checkpoint. Uses the trained
//! Pendulum policy and its rollouts (small, real). Faults with real processes
//! (SIGKILL, SIGSTOP, Redis restarts) are in the CLI's cluster tests.

#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pendulum::{
    address, clean_bytes, fast_spec, fixture, open_run, open_spec, session, session_of, setup,
    setup_of, test_key, worker_of,
};
use qforge_calib::{Job, Plan, Recipe, RoundedLayers, Session, load_jsonl};
use qforge_core::codec::encode;
use qforge_dist::cluster::{
    ClusterOptions, Compute, Pace, RedisBackend, RunSpec, WorkerOptions, serve, serve_with,
};
use qforge_dist::{
    Backend, CheckpointStore, Embedded, Error, Failure, Next, Outcome, RunOptions, RunSummary, run,
};
use qforge_model::{MlpPolicy, Model};
use redis_server::{RedisCluster, RedisServer};

/// A scratch directory, removed when dropped.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-dist-{name}-"))
        .tempdir()
        .unwrap()
}

/// The backends every test runs on: embedded always, Redis when a server
/// could be started (always under CI).
fn backends(test: &str) -> Vec<Option<RedisServer>> {
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
fn run_on(
    redis: Option<&RedisServer>,
    name: &str,
    workers: usize,
    options: &RunOptions,
    faults: &Faults,
) -> qforge_dist::Result<RunSummary> {
    run_session_on(session(), redis, name, workers, BY_BATCH, options, faults)
}

/// One batch per task.
const BY_BATCH: Option<NonZeroUsize> = NonZeroUsize::new(1);

/// [`run_on`] for another session than the default, `per_task` batches
/// per task on Redis (`None`: sized by the coordinator).
fn run_session_on(
    session: Session,
    redis: Option<&RedisServer>,
    name: &str,
    workers: usize,
    per_task: Option<NonZeroUsize>,
    options: &RunOptions,
    faults: &Faults,
) -> qforge_dist::Result<RunSummary> {
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
            scope.spawn(move || serve(&worker, &mut |_| {}).unwrap());
        }
        let summary = run(&job, &plan, &faults.wrap(&backend), options, &mut |_| {});
        backend.finish(summary.is_ok()).unwrap();
        summary
    })
}

#[test]
fn any_worker_count_gives_identical_bytes() {
    let (target, job, plan) = setup();
    assert_eq!(plan.batches.len(), 19);
    let clean = clean_bytes(&target, &job, &plan);
    for redis in backends("counts") {
        for workers in [1, 2, 4, 7] {
            let name = format!("counts-{workers}");
            let summary = run_on(
                redis.as_ref(),
                &name,
                workers,
                &RunOptions::default(),
                &Faults::none(),
            )
            .unwrap();
            assert_eq!(
                encode(&summary.stats),
                clean,
                "{workers} workers, redis: {}",
                redis.is_some()
            );
            assert_eq!(
                summary.workers.values().map(|w| w.merged).sum::<usize>(),
                19
            );
            let prefix = if redis.is_some() {
                "counts-"
            } else {
                "embedded-"
            };
            assert!(
                summary.workers.keys().all(|w| w.starts_with(prefix)),
                "{:?}",
                summary.workers.keys()
            );
        }
    }
}

#[test]
fn tasks_of_several_batches_give_identical_bytes_through_duplicates_and_a_regrouping_resume() {
    let Some(server) = RedisServer::start("grouped", None) else {
        return;
    };
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    let duplicate = Faults {
        duplicate: true,
        ..Faults::none()
    };
    for per_task in [2, 4, 19] {
        let summary = run_session_on(
            session(),
            Some(&server),
            &format!("grouped-{per_task}"),
            3,
            NonZeroUsize::new(per_task),
            &RunOptions::default(),
            &duplicate,
        )
        .unwrap();
        assert_eq!(encode(&summary.stats), clean, "{per_task} batches per task");
        assert_eq!(summary.merged, 19);
        // Every copy dropped, but the last task's: its copy ends the run.
        assert!(
            (19 - per_task..19).contains(&summary.duplicates),
            "{per_task} batches per task: {} duplicates",
            summary.duplicates
        );
    }

    // A coordinator crashes while tasks of 4 are out; resumed, it hands out
    // tasks of 3, so results published before the crash may cover batches
    // it has merged together with batches it has not.
    let dir = temp_dir("grouped-resume");
    let options = RunOptions {
        checkpoints: Some(CheckpointStore::new(dir.path())),
        checkpoint_every: 1,
        ..RunOptions::default()
    };
    let crash = Faults {
        crash_after: Some(2),
        ..Faults::none()
    };
    let first = run_session_on(
        session(),
        Some(&server),
        "regrouped",
        2,
        NonZeroUsize::new(4),
        &options,
        &crash,
    );
    assert!(first.is_err());
    let resume = RunOptions {
        resume: true,
        ..options
    };
    let summary = run_session_on(
        session(),
        Some(&server),
        "regrouped",
        2,
        NonZeroUsize::new(3),
        &resume,
        &Faults::none(),
    )
    .unwrap();
    assert_eq!(encode(&summary.stats), clean);
    assert!(summary.resumed >= 4, "resumed {}", summary.resumed);
    assert_eq!(summary.merged, 19);
}

/// A Redis Cluster of three masters, reached through a node that serves
/// neither the run's slot nor `qforge:active`'s: the coordinator and the
/// workers follow the redirections to both (the workers find the run through
/// `qforge:active`), and the bytes are the clean run's.
#[test]
fn a_run_through_a_three_master_redis_cluster_gives_identical_bytes() {
    let Some(cluster) = RedisCluster::start("cluster", 3) else {
        return;
    };
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    let active = cluster.owner_of("qforge:active");
    let (name, owner) = (0..)
        .map(|i| format!("clustered-{i}"))
        .map(|name| {
            let owner = cluster.owner_of(&format!("qforge:{{{name}}}:spec"));
            (name, owner)
        })
        .find(|(_, owner)| *owner != active)
        .unwrap();
    let seed = &cluster.nodes[3 - owner - active];
    let backend = open_run(seed, &name, &job, NonZeroUsize::new(2));
    let summary = std::thread::scope(|scope| {
        for w in 0..3 {
            let worker = WorkerOptions {
                run: None,
                ..worker_of(seed, &name, &format!("{name}-w{w}"))
            };
            scope.spawn(move || serve(&worker, &mut |_| {}).unwrap());
        }
        let summary = run(&job, &plan, &backend, &RunOptions::default(), &mut |_| {}).unwrap();
        backend.finish(true).unwrap();
        summary
    });
    assert_eq!(encode(&summary.stats), clean);
    assert_eq!(summary.merged, 19);
    // The run's keys are on the node serving its slot.
    let mut connection = redis::Client::open(cluster.nodes[owner].url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let state: String = redis::cmd("GET")
        .arg(format!("qforge:{{{name}}}:state"))
        .query(&mut connection)
        .unwrap();
    assert_eq!(state, "done");
}

/// A Redis Cluster with a replica per master loses the master holding the
/// run mid-run (SIGKILL): its replica takes over the slot, the coordinator
/// and the workers, reaching the cluster through another master, follow it
/// there, writes the dead master had not replicated are made up for, and the
/// bytes are the clean run's.
#[test]
fn a_run_survives_the_failover_of_the_redis_cluster_master_holding_it() {
    let Some(mut cluster) = RedisCluster::start_with_replicas("failover", 3, true) else {
        return;
    };
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    let name = "failover";
    let owner = cluster.owner_of(&format!("qforge:{{{name}}}:spec"));
    // Reached through another master, which stays up.
    let seed = &cluster.nodes[(owner + 1) % 3];
    let backend = open_run(seed, name, &job, NonZeroUsize::new(1));
    let workers: Vec<WorkerOptions> = (0..3)
        .map(|w| worker_of(seed, name, &format!("{name}-w{w}")))
        .collect();
    let victim = &mut cluster.nodes[owner];
    let summary = std::thread::scope(|scope| {
        for worker in &workers {
            scope.spawn(move || {
                serve_with(worker, &mut Slow(Duration::from_millis(150)), &mut |_| {}).unwrap()
            });
        }
        // Once three batches are merged, the master holding the run dies.
        let mut victim = Some(victim);
        let summary = run(&job, &plan, &backend, &RunOptions::default(), &mut |p| {
            if p.merged >= 3
                && let Some(master) = victim.take()
            {
                master.stop("KILL");
            }
        });
        // Finished either way, so that the workers leave.
        backend.finish(summary.is_ok()).unwrap();
        assert!(victim.is_none(), "the master was killed mid-run");
        summary
    })
    .unwrap();
    assert_eq!(encode(&summary.stats), clean);
    assert_eq!(summary.merged, 19);
    assert!(cluster.is_master(3 + owner), "the replica took over");
}

/// Faults injected into what the coordinator sees.
#[derive(Default)]
struct Faults {
    /// Deliver every result twice (a speculative re-execution).
    duplicate: bool,
    /// Fail this batch index this many times before letting it through.
    fail: Option<(usize, usize)>,
    /// Stop the run with an error after this many outcomes (a coordinator crash).
    crash_after: Option<usize>,
    /// Take this long over every outcome (a coordinator that falls behind
    /// the results stream).
    slow_merge: Option<Duration>,
}

impl Faults {
    fn none() -> Self {
        Self::default()
    }

    fn wrap<'a>(&'a self, inner: &'a dyn Backend) -> Faulty<'a> {
        Faulty {
            inner,
            faults: self,
            seen: AtomicUsize::new(0),
            failures: AtomicUsize::new(0),
        }
    }
}

/// A backend with [`Faults`] injected.
struct Faulty<'a> {
    inner: &'a dyn Backend,
    faults: &'a Faults,
    seen: AtomicUsize,
    failures: AtomicUsize,
}

impl Backend for Faulty<'_> {
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    fn committed(&self) -> qforge_dist::Result<()> {
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
        on: &mut dyn FnMut(Outcome) -> qforge_dist::Result<Next>,
    ) -> qforge_dist::Result<()> {
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

#[test]
fn duplicates_are_dropped_and_failures_retried() {
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    for redis in backends("faults") {
        let duplicate = Faults {
            duplicate: true,
            ..Faults::none()
        };
        let summary = run_on(redis.as_ref(), "dup", 3, &RunOptions::default(), &duplicate).unwrap();
        assert_eq!(encode(&summary.stats), clean);
        assert!(
            summary.duplicates >= 18,
            "duplicates {}",
            summary.duplicates
        );
        assert!(
            summary.speculative >= 18,
            "speculative {}",
            summary.speculative
        );

        let flaky = Faults {
            fail: Some((5, 2)),
            ..Faults::none()
        };
        let summary = run_on(redis.as_ref(), "flaky", 3, &RunOptions::default(), &flaky).unwrap();
        assert_eq!(encode(&summary.stats), clean);
        assert_eq!(summary.retries, 2);
        assert!(summary.quarantined.is_empty());
    }
}

#[test]
fn a_batch_failing_three_times_is_quarantined_and_reported() {
    let (_, _, plan) = setup();
    for redis in backends("quarantine") {
        let broken = Faults {
            fail: Some((7, usize::MAX)),
            ..Faults::none()
        };
        let err = run_on(redis.as_ref(), "strict", 2, &RunOptions::default(), &broken).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("18/19") && message.contains("quarantined"),
            "{message}"
        );

        let lenient = RunOptions {
            min_coverage: 0.9,
            ..RunOptions::default()
        };
        let summary = run_on(redis.as_ref(), "lenient", 2, &lenient, &broken).unwrap();
        assert_eq!(summary.merged, 18);
        assert_eq!(summary.quarantined.len(), 1);
        assert!(
            !summary
                .stats
                .provenance
                .batches
                .contains(&plan.batches[7].id)
        );
    }
}

#[test]
fn a_crashed_coordinator_resumes_to_identical_bytes_even_past_a_corrupt_checkpoint() {
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    for redis in backends("resume") {
        let dir = temp_dir(&format!("resume-{}", redis.is_some()));
        let options = RunOptions {
            checkpoints: Some(CheckpointStore::new(dir.path())),
            checkpoint_every: 3,
            ..RunOptions::default()
        };
        let crash = Faults {
            crash_after: Some(11),
            ..Faults::none()
        };
        assert!(run_on(redis.as_ref(), "resume", 2, &options, &crash).is_err());
        let mut files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert_eq!(files.len(), 3, "keeps the last three: {files:?}");

        // Corrupt the newest checkpoint: resume falls back to the previous one.
        let newest = files.last().unwrap();
        let mut bytes = std::fs::read(newest).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xFF;
        std::fs::write(newest, bytes).unwrap();

        let resume = RunOptions {
            resume: true,
            ..options.clone()
        };
        let summary = run_on(redis.as_ref(), "resume", 2, &resume, &Faults::none()).unwrap();
        assert_eq!(encode(&summary.stats), clean);
        assert_eq!(
            summary.resumed, 6,
            "resumed from the checkpoint after 6 batches"
        );
        assert!(
            summary.warnings.iter().any(|w| w.contains("falling back")),
            "{:?}",
            summary.warnings
        );
    }
}

#[test]
fn a_checkpoint_of_another_recipe_is_refused() {
    let (target, job, plan) = setup();
    let dir = temp_dir("foreign");
    let options = RunOptions {
        checkpoints: Some(CheckpointStore::new(dir.path())),
        resume: true,
        ..RunOptions::default()
    };
    let embedded = Embedded::new(target.clone(), job.clone(), 2);
    run(
        &job,
        &plan,
        &embedded,
        &RunOptions {
            resume: false,
            ..options.clone()
        },
        &mut |_| {},
    )
    .unwrap();
    let other = Job {
        recipe: Recipe {
            seed: 9,
            ..job.recipe.clone()
        },
        ..job.clone()
    };
    let other_plan = qforge_calib::plan(
        &load_jsonl(&fixture().join("rollouts.jsonl"), false).unwrap(),
        &other.recipe,
        None,
    )
    .unwrap();
    let err = run(&other, &other_plan, &embedded, &options, &mut |_| {}).unwrap_err();
    assert!(
        err.to_string().contains("different model, data or recipe"),
        "{err}"
    );
}

/// A worker whose forward computes different activations (here: a policy
/// whose weights differ in the last bits, standing in for another CPU) is
/// refused, unless the run allows mixed hardware; then the statistics say so.
///
/// Refused, it joins after a reference worker that does the run's work.
/// Admitted, it must be the one that does the work, or nothing shows that
/// its results were merged: two workers racing for the batches let the
/// reference take them all on a busy machine. So there the test sets the
/// reference fingerprint as the first worker would (`SET NX` of its hex) and
/// the odd worker runs alone.
/// A worker that loads the fixture's files, then computes with `.0` in place
/// of the fixture's weights.
struct Loading(Model);

impl Compute for Loading {
    fn open(&mut self, _: &RunSpec) -> qforge_dist::Result<Session> {
        let mut session = session();
        session.model = Some(self.0.clone());
        Ok(session)
    }
}

#[test]
fn a_worker_with_another_fingerprint_is_refused_unless_mixed_hardware_is_allowed() {
    let Some(server) = RedisServer::start("mixed", None) else {
        return;
    };
    let (target, job, plan) = setup();
    let perturbed = {
        let dir = fixture();
        let config = std::fs::read(dir.join("policy.json")).unwrap();
        let mut weights = std::fs::read(dir.join("model.safetensors")).unwrap();
        // Flip the lowest mantissa bit of the last weight (little-endian f32).
        let last = weights.len() - 4;
        weights[last] ^= 1;
        Model::Policy(Box::new(MlpPolicy::from_bytes(&config, &weights).unwrap()))
    };
    assert_ne!(
        perturbed.fingerprint().unwrap(),
        target.fingerprint().unwrap()
    );
    for allow in [false, true] {
        let run_name = format!("mixed-{allow}");
        let mut spec = RunSpec::new(&run_name, &session(), &job).unwrap();
        spec.allow_mixed_hardware = allow;
        spec.heartbeat_ms = 100;
        spec.heartbeat_timeout_ms = 600;
        let backend = open_spec(&server, spec, None);
        let worker = |name: &str| WorkerOptions {
            redis: address(&server),
            run: Some(run_name.clone()),
            name: name.into(),
            forever: false,
            wait: Duration::from_secs(10),
            outage_limit: Duration::from_secs(10),
            key: test_key(),
        };
        // Both load the fixture's files; the odd one then computes with
        // the perturbed weights.
        let serve_as = |name: &str, model: &Model| {
            serve_with(&worker(name), &mut Loading(model.clone()), &mut |_| {})
        };
        let client = redis::Client::open(server.url()).unwrap();
        let mut connection = client.get_connection().unwrap();
        let reference_key = format!("qforge:{{{run_name}}}:reference");
        let workers_key = format!("qforge:{{{run_name}}}:workers");
        let summary = std::thread::scope(|scope| {
            let reference = if allow {
                redis::cmd("SET")
                    .arg(&reference_key)
                    .arg(target.fingerprint().unwrap().to_hex())
                    .arg("NX")
                    .query::<Option<String>>(&mut connection)
                    .unwrap();
                None
            } else {
                let reference = scope.spawn(|| serve_as("reference", &target));
                // The odd worker joins once the first has set the reference.
                await_count(&mut connection, "EXISTS", &reference_key, 1);
                Some(reference)
            };
            let odd = scope.spawn(|| serve_as("odd", &perturbed));
            // Tasks are enqueued by `run`, once every worker has registered.
            let registered = if allow { 1 } else { 2 };
            await_count(&mut connection, "HLEN", &workers_key, registered);
            let summary = run(&job, &plan, &backend, &RunOptions::default(), &mut |_| {});
            backend.finish(summary.is_ok()).unwrap();
            if let Some(reference) = reference {
                reference.join().unwrap().unwrap();
            }
            let odd = odd.join().unwrap();
            if allow {
                odd.unwrap();
            } else {
                let err = odd.unwrap_err();
                assert!(matches!(err, Error::Refused(_)), "{err}");
                assert!(err.to_string().contains("--allow-mixed-hardware"), "{err}");
            }
            summary.unwrap()
        });
        let odd_merged = summary.workers.get("odd").map_or(0, |w| w.merged);
        if allow {
            assert_eq!(odd_merged, summary.planned, "{:?}", summary.workers);
            assert!(summary.stats.provenance.mixed_hardware);
        } else {
            assert_eq!(odd_merged, 0);
            assert!(!summary.stats.provenance.mixed_hardware);
            assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
        }
    }
}

#[test]
fn a_coordinator_behind_the_results_stream_recomputes_nothing() {
    let Some(server) = RedisServer::start("backlog", None) else {
        return;
    };
    // 75 batches, whose results the workers publish far faster than the
    // coordinator takes them (70 ms each: 16 results, one read, outlast the
    // 1 s between two checks for lost tasks), so most results wait unread,
    // their tasks acknowledged, through several checks.
    let faults = Faults {
        slow_merge: Some(Duration::from_millis(70)),
        ..Faults::none()
    };
    // Tasks sized by the coordinator: slow as it is, it hands out several
    // batches per task.
    let summary = run_session_on(
        session_of(8),
        Some(&server),
        "backlog",
        3,
        None,
        &RunOptions::default(),
        &faults,
    )
    .unwrap();
    assert_eq!(summary.planned, 75);
    assert!(
        summary.warnings.iter().all(|w| !w.contains("re-enqueued")),
        "{:?}",
        summary.warnings
    );
    assert_eq!(summary.duplicates, 0);
    // The batches of one result share their worker and arrival time.
    let mut per_result = std::collections::BTreeMap::new();
    for delivery in &summary.timeline {
        *per_result
            .entry((delivery.worker.clone(), delivery.at_seconds.to_bits()))
            .or_insert(0) += 1;
    }
    assert!(
        per_result.values().any(|&batches| batches > 1),
        "a coordinator this slow hands out several batches per task"
    );
    let (target, job, plan) = setup_of(session_of(8));
    assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
}

/// The model's own forward, slowed down so that a task of several batches
/// outlasts the heartbeat timeout.
struct Slow(Duration);

impl Compute for Slow {
    fn observe(
        &self,
        target: &Model,
        batch: &qforge_calib::Batch,
        job: &Job,
        hidden_states: &qforge_calib::HiddenStates,
    ) -> Result<qforge_core::Stats, Failure> {
        std::thread::sleep(self.0);
        qforge_calib::observe_batch(target, batch, job, hidden_states)
            .map_err(|e| Failure::Data(e.to_string()))
    }
}

/// A run paced from an earlier pass sizes its tasks from its first; one
/// without a pace hands out one batch a task until it has measured both
/// times, by which point a short run has handed out all of its batches.
#[test]
fn a_paced_run_sizes_its_first_tasks_from_the_pace() {
    let Some(server) = RedisServer::start("paced", None) else {
        return;
    };
    let (_, job, plan) = setup();
    let pending: Vec<usize> = (0..plan.batches.len()).collect();
    // A result takes the coordinator 1 000 batches' time: tasks as large as
    // two each for the one worker allow (19 / 2).
    let pace = Pace {
        merge_seconds: 1.0,
        batch_seconds: 0.001,
        workers: 1,
    };
    for (name, pace, expected) in [
        ("unpaced", None, vec![1; 19]),
        ("paced", Some(pace), vec![1, 9, 9]),
    ] {
        let mut backend = open_run(&server, name, &job, None);
        if let Some(pace) = pace {
            backend = backend.paced(pace);
        }
        let mut sizes = std::thread::scope(|scope| {
            scope.spawn(|| serve(&worker_of(&server, name, "w"), &mut |_| {}).unwrap());
            let mut sizes = Vec::new();
            let mut left = plan.batches.len();
            backend
                .run(&plan, &pending, &mut |outcome| {
                    let Outcome::Done { batches, .. } = outcome else {
                        panic!("{name}: a task failed: {outcome:?}");
                    };
                    sizes.push(batches.len());
                    left -= batches.len();
                    Ok(if left == 0 {
                        Next::Stop
                    } else {
                        Next::Continue
                    })
                })
                .unwrap();
            backend.finish(true).unwrap();
            sizes
        });
        sizes.sort_unstable();
        assert_eq!(sizes, expected, "{name}: batches per result");
        let measured = backend.pace().expect("both times measured");
        assert!(measured.merge_seconds > 0.0 && measured.batch_seconds > 0.0);
    }
}

#[test]
fn a_worker_folds_a_dead_workers_task_into_the_one_it_is_running() {
    let Some(server) = RedisServer::start("fold", None) else {
        return;
    };
    let (target, job, plan) = setup();
    // Two tasks: batches 0-9 and 10-18.
    let backend = open_run(&server, "fold", &job, NonZeroUsize::new(10));
    let (job_ref, plan_ref) = (&job, &plan);
    let client = redis::Client::open(server.url()).unwrap();
    let served = std::sync::atomic::AtomicBool::new(false);
    let summary = std::thread::scope(|scope| {
        let coordinator = scope.spawn(move || {
            let summary = run(
                job_ref,
                plan_ref,
                &backend,
                &RunOptions::default(),
                &mut |_| {},
            );
            backend.finish(summary.is_ok()).unwrap();
            summary
        });
        // A worker that takes the first task and dies at once: it never
        // heartbeats.
        let mut connection = client.get_connection().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        // Until the coordinator has created the task stream's group. A
        // failure is asserted once the live worker has ended the run, which
        // would otherwise wait for workers forever.
        let ghost = loop {
            let read = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("workers")
                .arg("ghost")
                .arg("COUNT")
                .arg(1)
                .arg("BLOCK")
                .arg(1_000)
                .arg("STREAMS")
                .arg("qforge:{fold}:tasks")
                .arg(">")
                .query::<Option<redis::streams::StreamReadReply>>(&mut connection);
            match read {
                Ok(Some(reply)) => break Ok(reply.keys[0].ids.len()),
                Ok(None) | Err(_) if std::time::Instant::now() < deadline => {}
                other => break Err(format!("{other:?}")),
            }
        };
        // The live worker takes the other task, 10 batches of 200 ms, and
        // finds the ghost's pending past the 600 ms timeout on the way: its
        // heartbeat then names both tasks.
        let folded = scope.spawn(|| {
            let mut connection = client.get_connection().unwrap();
            while !served.load(Ordering::SeqCst) {
                let beat: Option<String> = redis::cmd("GET")
                    .arg("qforge:{fold}:hb:fold-live")
                    .query(&mut connection)
                    .unwrap();
                if beat.is_some_and(|held| held.contains(',')) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            false
        });
        let report = serve_with(
            &worker_of(&server, "fold", "fold-live"),
            &mut Slow(Duration::from_millis(200)),
            &mut |_| {},
        );
        served.store(true, Ordering::SeqCst);
        assert_eq!(ghost, Ok(1), "the ghost holds a task");
        assert_eq!(report.unwrap().reclaimed, 1);
        assert!(
            folded.join().unwrap(),
            "the ghost's task joined the running one"
        );
        coordinator.join().unwrap().unwrap()
    });
    assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
    assert_eq!(summary.workers["fold-live"].merged, 19);
    assert_eq!(summary.duplicates, 0);
}

/// A routed run sends each batch's tasks to the stream of the worker that
/// holds its hidden states. Here the odd batches' holder serves, slowly;
/// the even batches' holder, a ghost, takes one task and dies without a
/// heartbeat. The live worker steals the ghost's unread tasks, the
/// coordinator takes back the one it held once it has been pending past the
/// timeout, and the run writes the single-worker bytes, every batch now
/// held by the live worker.
#[test]
fn a_routed_run_survives_a_holder_that_dies_holding_its_tasks() {
    let Some(server) = RedisServer::start("routed", None) else {
        return;
    };
    // The ghost reads one task of its stream as soon as it exists; at 50 ms
    // a batch, long before the live worker is through its own nine.
    let routed = run_routed(&server, "routed", "ghost", 50, |connection| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let read = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("workers")
                .arg("ghost")
                .arg("COUNT")
                .arg(1)
                .arg("STREAMS")
                .arg("qforge:{routed}:tasks:ghost")
                .arg(">")
                .query::<Option<redis::streams::StreamReadReply>>(connection);
            match read {
                Ok(Some(reply)) => break Ok(reply.keys[0].ids.len()),
                Ok(None) | Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                other => break Err(format!("{other:?}")),
            }
        }
    });
    assert_eq!(routed.meanwhile, Ok(1), "the ghost held a task");
    assert_eq!(
        routed.routed_to_live, 9,
        "the odd batches' tasks went to their holder"
    );
    assert_eq!(routed.summary.duplicates, 0);
    assert!(
        routed
            .warnings
            .iter()
            .any(|w| w == "took back 1 task(s) from workers that died holding them"),
        "{:?}",
        routed.warnings
    );
    let held = &routed.holders;
    assert!(
        held.len() == 19 && held.values().all(|w| w == "live"),
        "{held:?}"
    );
}

/// A routed stream that Redis loses (here deleted while the run goes on)
/// stops nothing: a worker looking for tasks to steal finds it missing and
/// goes on (a missing stream failed its whole lookup and ended the worker),
/// and the coordinator recreates it and re-enqueues the batches it held,
/// which reach the bytes of a clean run.
#[test]
fn a_routed_stream_lost_by_redis_is_recreated_and_its_batches_rerun() {
    let Some(server) = RedisServer::start("lostroute", None) else {
        return;
    };
    let routed = run_routed(&server, "lostroute", "lost", 20, |connection| {
        await_count(connection, "XLEN", "qforge:{lostroute}:tasks:lost", 10);
        redis::cmd("DEL")
            .arg("qforge:{lostroute}:tasks:lost")
            .query::<i64>(connection)
            .unwrap()
    });
    assert_eq!(routed.meanwhile, 1, "the stream was deleted");
    // The odd batches' 9, then the lost stream's 10: their holder is gone.
    assert_eq!(routed.routed_to_live, 19);
    assert!(
        routed
            .warnings
            .iter()
            .any(|w| w.starts_with("re-enqueued 10 task(s) that Redis lost")),
        "{:?}",
        routed.warnings
    );
}

/// What [`run_routed`] saw.
struct Routed<T> {
    summary: RunSummary,
    warnings: Vec<String>,
    holders: BTreeMap<usize, String>,
    /// The tasks that went to the stream of "live".
    routed_to_live: i64,
    /// What the test did while the run went on.
    meanwhile: T,
}

/// Runs the Pendulum job as run `run`, one batch a task, routed: the even
/// batches held by `even`, which no worker serves, the odd ones by "live",
/// a worker that takes `per_batch_ms` more a batch and starts once
/// `meanwhile` has done what it does to the run. Asserts what every such
/// run must give: the clean run's bytes, every batch merged from "live".
fn run_routed<T: Send>(
    server: &RedisServer,
    run_name: &str,
    even: &str,
    per_batch_ms: u64,
    meanwhile: impl FnOnce(&mut redis::Connection) -> T,
) -> Routed<T> {
    let (target, job, plan) = setup();
    let holders: BTreeMap<usize, String> = (0..plan.batches.len())
        .map(|b| (b, if b % 2 == 0 { even } else { "live" }.to_owned()))
        .collect();
    let backend = open_run(server, run_name, &job, BY_BATCH).routed(holders);
    let client = redis::Client::open(server.url()).unwrap();
    let live_stream = format!("qforge:{{{run_name}}}:tasks:live");
    let (job_ref, plan_ref, client_ref, live_ref) = (&job, &plan, &client, &live_stream);
    let (summary, routed_to_live, backend, meanwhile) = std::thread::scope(|scope| {
        let coordinator = scope.spawn(move || {
            let summary = run(
                job_ref,
                plan_ref,
                &backend,
                &RunOptions::default(),
                &mut |_| {},
            );
            let routed_to_live: i64 = redis::cmd("XLEN")
                .arg(live_ref)
                .query(&mut client_ref.get_connection().unwrap())
                .unwrap();
            backend.finish(summary.is_ok()).unwrap();
            (summary, routed_to_live, backend)
        });
        let mut connection = client.get_connection().unwrap();
        let meanwhile = meanwhile(&mut connection);
        let served = serve_with(
            &worker_of(server, run_name, "live"),
            &mut Slow(Duration::from_millis(per_batch_ms)),
            &mut |_| {},
        );
        if served.is_err() {
            take_over(&mut connection, run_name);
        }
        let (summary, routed_to_live, backend) = coordinator.join().unwrap();
        served.unwrap();
        (summary.unwrap(), routed_to_live, backend, meanwhile)
    });
    assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
    assert_eq!(summary.workers["live"].merged, 19);
    Routed {
        routed_to_live,
        warnings: backend.warnings(),
        holders: backend.holders(),
        summary,
        meanwhile,
    }
}

#[test]
fn a_worker_arriving_at_a_finished_pass_follows_the_pipeline_into_the_next() {
    let Some(server) = RedisServer::start("follow", None) else {
        return;
    };
    let (target, job, plan) = setup();
    // A pipeline of three passes: flw, flw.pass2, flw.pass3.
    let runs = ["flw", "flw.pass2", "flw.pass3"];
    let open_pass = |index: usize| {
        let mut spec = fast_spec(runs[index], &job);
        spec.pipeline = runs[0].into();
        spec.next_pass = runs.get(index + 1).map(|r| (*r).to_owned());
        open_spec(&server, spec, BY_BATCH)
    };
    let client = redis::Client::open(server.url()).unwrap();
    // Until pass `index` has `least` registered workers.
    let await_workers = |index: usize, least: i64| {
        let key = format!("qforge:{{{}}}:workers", runs[index]);
        await_count(&mut client.get_connection().unwrap(), "HLEN", &key, least);
    };
    let pass_2_done = std::sync::atomic::AtomicBool::new(false);
    let mut late_log = Vec::new();
    let backend = open_pass(0);
    let (summaries, late) = std::thread::scope(|scope| {
        scope.spawn(|| serve(&worker_of(&server, "flw", "prompt"), &mut |_| {}).unwrap());
        // "late" serves the first pass, then stalls before following the
        // pipeline until the second pass is over.
        let late = scope.spawn(|| {
            serve(&worker_of(&server, "flw", "late"), &mut |line: &str| {
                if line.ends_with("run flw.pass2") {
                    while !pass_2_done.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                late_log.push(line.to_owned());
            })
        });
        let mut summaries = Vec::new();
        let mut backend = Some(backend);
        for index in 0..runs.len() {
            let backend = backend.take().unwrap_or_else(|| open_pass(index));
            // Both workers in the first and last pass; the second has only
            // "prompt".
            if index != 1 {
                await_workers(index, 2);
            }
            let summary = run(&job, &plan, &backend, &RunOptions::default(), &mut |_| {});
            backend.finish(summary.is_ok()).unwrap();
            if index == 1 {
                pass_2_done.store(true, Ordering::SeqCst);
            }
            summaries.push(summary.unwrap());
        }
        (summaries, late.join().unwrap().unwrap())
    });
    assert_eq!(late.runs, 2, "{late_log:?}");
    assert!(
        late_log.iter().any(|line| line
            == "run flw.pass2 is done before this worker joined; following the pipeline into run flw.pass3"),
        "{late_log:?}"
    );
    assert!(!summaries[1].workers.contains_key("late"));
    let clean = clean_bytes(&target, &job, &plan);
    for summary in &summaries {
        assert_eq!(encode(&summary.stats), clean);
    }
}

/// Takes run `run`'s coordinator lease, which stops its coordinator at its
/// next check: a test whose only worker failed then fails instead of
/// waiting for workers forever.
fn take_over(connection: &mut redis::Connection, run: &str) {
    redis::cmd("SET")
        .arg(format!("qforge:{{{run}}}:coordinator"))
        .arg("the test")
        .query::<()>(connection)
        .unwrap();
}

/// Waits until `command` (a count: `HLEN`, `EXISTS`, …) of `key` reaches
/// `least`, for a minute at most.
fn await_count(connection: &mut redis::Connection, command: &str, key: &str, least: i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while redis::cmd(command)
        .arg(key)
        .query::<i64>(connection)
        .unwrap()
        < least
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{command} {key} never reached {least}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_forged_non_ascii_reference_fingerprint_refuses_the_worker_without_a_panic() {
    let Some(server) = RedisServer::start("forged-reference", None) else {
        return;
    };
    let (_, job, _) = setup();
    let _backend = open_run(&server, "forged-reference", &job, None);
    let client = redis::Client::open(server.url()).unwrap();
    redis::cmd("SET")
        .arg("qforge:{forged-reference}:reference")
        .arg("\u{e9}".repeat(20))
        .query::<()>(&mut client.get_connection().unwrap())
        .unwrap();
    let worker = worker_of(&server, "forged-reference", "honest");
    let err = serve(&worker, &mut |_| {}).unwrap_err();
    assert!(matches!(err, Error::Refused(_)), "{err}");
    assert!(err.to_string().contains("differs from the run's"), "{err}");
}
