//! Which workers a Redis run admits by their determinism fingerprint, on a
//! real `redis-server`: one that computes other activations is refused
//! unless the run allows mixed hardware, and a forged reference fingerprint
//! refuses a worker without a panic.

#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use pendulum::{
    address, await_count, clean_bytes, fixture, open_run, open_spec, session, setup, test_key,
    worker_of,
};
use qforge_calib::Session;
use qforge_core::codec::encode;
use qforge_model::{MlpPolicy, Model};
use qforge_runner::cluster::{Compute, RunSpec, WorkerOptions, run_worker, run_worker_with};
use qforge_runner::{Error, RunOptions, run};
use redis_server::RedisServer;

/// A worker that loads the fixture's files, then computes with `.0` in place
/// of the fixture's weights.
struct Loading(Model);

impl Compute for Loading {
    fn open(&mut self, _: &RunSpec) -> qforge_runner::Result<Session> {
        let mut session = session();
        session.model = Some(self.0.clone());
        Ok(session)
    }
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
            run_worker_with(&worker(name), &mut Loading(model.clone()), &mut |_| {})
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
    let err = run_worker(&worker, &mut |_| {}).unwrap_err();
    assert!(matches!(err, Error::Refused(_)), "{err}");
    assert!(err.to_string().contains("differs from the run's"), "{err}");
}
