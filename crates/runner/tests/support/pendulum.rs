//! What the backend tests share: the trained Pendulum policy and its
//! rollouts (small, real), a clean single-worker run's bytes, and Redis runs
//! with fast heartbeats opened under a test cluster key.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use qforge_calib::{Job, Plan, Recipe, RoundedLayers, Session, Weights};
use qforge_core::codec::encode;
use qforge_model::Model;
use qforge_runner::cluster::{
    ClusterKey, ClusterOptions, Compute, RedisAddress, RedisBackend, RunSpec, WorkerOptions,
};
use qforge_runner::{Embedded, Failure, RunOptions, run};

use super::redis_server::RedisServer;

/// The cluster key of every test run (the key itself: tests share no file).
pub fn test_key() -> ClusterKey {
    ClusterKey::from_text("qforge-test-cluster-key-0123456789abcdef", "the tests").unwrap()
}

/// The test server's address.
pub fn address(server: &RedisServer) -> RedisAddress {
    RedisAddress::new(&server.url(), None).unwrap()
}

/// The trained Pendulum policy's directory.
pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/pendulum")
}

/// The Pendulum policy and its rollouts, planned into 19 batches of 32.
pub fn session() -> Session {
    session_of(32)
}

/// The Pendulum policy and 600 of its observations in batches of
/// `batch_size`.
pub fn session_of(batch_size: usize) -> Session {
    let recipe = Recipe {
        samples: 600,
        batch_size,
        ..Recipe::default()
    };
    Session::open(
        &fixture(),
        &fixture().join("rollouts.jsonl"),
        &recipe,
        false,
        Weights::Load,
    )
    .unwrap()
}

/// The model, job and plan of [`session`].
pub fn setup() -> (Model, Job, Plan) {
    setup_of(session())
}

/// The model, job and plan of `session`.
pub fn setup_of(session: Session) -> (Model, Job, Plan) {
    let job = session.job(&session.recipe, &[]);
    (session.model.clone().unwrap(), job, session.plan)
}

/// The statistics of one worker thread over the whole plan: what every
/// run must reproduce byte for byte.
pub fn clean_bytes(target: &Model, job: &Job, plan: &Plan) -> Vec<u8> {
    let backend = Embedded::new(target.clone(), job.clone(), 1);
    let summary = run(job, plan, &backend, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(summary.coverage, 1.0);
    encode(&summary.stats)
}

/// Opens run `name` on `server` as its coordinator, with fast heartbeats,
/// no speculation and `per_task` batches per task (`None`: sized by the
/// coordinator).
pub fn open_run(
    server: &RedisServer,
    name: &str,
    job: &Job,
    per_task: Option<NonZeroUsize>,
) -> RedisBackend {
    open_spec(server, fast_spec(name, job), per_task)
}

/// The spec of run `name` over `job`, with fast heartbeats and no
/// speculation.
pub fn fast_spec(name: &str, job: &Job) -> RunSpec {
    let mut spec = RunSpec::new(name, &session(), job).unwrap();
    spec.speculation = 1.0;
    spec.heartbeat_ms = 100;
    spec.heartbeat_timeout_ms = 600;
    spec
}

/// Opens `spec` on `server` as its coordinator, with `per_task` batches per
/// task (`None`: sized by the coordinator).
pub fn open_spec(
    server: &RedisServer,
    spec: RunSpec,
    per_task: Option<NonZeroUsize>,
) -> RedisBackend {
    RedisBackend::open(
        spec,
        &ClusterOptions {
            redis: address(server),
            resume: false,
            outage_limit: Duration::from_secs(10),
            batches_per_task: per_task,
            key: test_key(),
        },
        &RoundedLayers::default(),
    )
    .unwrap()
}

/// A worker of run `run` named `name`.
pub fn worker_of(server: &RedisServer, run: &str, name: &str) -> WorkerOptions {
    WorkerOptions {
        redis: address(server),
        run: Some(run.to_owned()),
        name: name.to_owned(),
        forever: false,
        wait: Duration::from_secs(10),
        outage_limit: Duration::from_secs(10),
        key: test_key(),
    }
}

/// The model's own forward, slowed down so that a task of several batches
/// outlasts the heartbeat timeout.
pub struct Slow(pub Duration);

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

/// Waits until `command` (a count: `HLEN`, `EXISTS`, …) of `key` reaches
/// `least`, for a minute at most.
pub fn await_count(connection: &mut redis::Connection, command: &str, key: &str, least: i64) {
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
