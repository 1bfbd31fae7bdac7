//! Attacks on a Redis run by something that can write to Redis, each written
//! into a real `redis-server` beside a real coordinator and real worker
//! threads: results forged without the cluster key are refused by name and
//! the genuine ones merge to the clean bytes; a sealed result shaped unlike
//! the pass is refused before it is decoded; a second copy of a batch that
//! differs from the merged one stops the run naming both workers; an entry
//! id no worker can follow fails the run at once; a worker holding another
//! key is refused before it observes anything.

#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use qforge_calib::{HiddenStates, Job, Plan, observe_batch};
use qforge_core::codec::encode;
use qforge_core::{Gram, Stats, TensorStats};
use qforge_model::Model;
use qforge_runner::cluster::{ClusterKey, MAC_FIELD, RedisBackend, RunKey, RunSpec, run_worker};
use qforge_runner::{Error, RunOptions, RunSummary, run};
use redis_server::RedisServer;

use pendulum::{clean_bytes, open_run, setup, test_key, worker_of};

/// A client of `server` that writes what it likes, as a forger would.
struct Forger {
    connection: redis::Connection,
    run: String,
}

impl Forger {
    fn new(server: &RedisServer, run: &str) -> Self {
        let client = redis::Client::open(server.url()).unwrap();
        Self {
            connection: client.get_connection().unwrap(),
            run: run.to_owned(),
        }
    }

    /// The run's key as a worker holding `key` derives it from the spec.
    fn run_key(&mut self, key: &ClusterKey) -> RunKey {
        let json: String = redis::cmd("GET")
            .arg(format!("qforge:{{{}}}:spec", self.run))
            .query(&mut self.connection)
            .unwrap();
        let spec: RunSpec = serde_json::from_str(&json).unwrap();
        key.run_key(&self.run, &spec.nonce)
    }

    /// Sets the reference fingerprint, as the first worker would: nothing
    /// forged below is dropped for its fingerprint.
    fn set_reference(&mut self, target: &Model) -> String {
        let fingerprint = target.fingerprint().unwrap().to_hex();
        redis::cmd("SET")
            .arg(format!("qforge:{{{}}}:reference", self.run))
            .arg(&fingerprint)
            .query::<()>(&mut self.connection)
            .unwrap();
        fingerprint
    }

    /// Appends a result entry at `id` with `fields`, sealed under `key` if
    /// given.
    fn append(&mut self, id: &str, fields: &[(&str, &[u8])], key: Option<&RunKey>) {
        let mut command = redis::cmd("XADD");
        command
            .arg(format!("qforge:{{{}}}:results", self.run))
            .arg(id);
        for (name, value) in fields {
            command.arg(*name).arg(*value);
        }
        if let Some(key) = key {
            command.arg(MAC_FIELD).arg(key.seal(fields));
        }
        command.query::<String>(&mut self.connection).unwrap();
    }
}

/// Batch `batch`'s statistics as a worker observes them.
fn observed(target: &Model, job: &Job, plan: &Plan, batch: usize) -> Stats {
    observe_batch(target, &plan.batches[batch], job, &HiddenStates::default()).unwrap()
}

/// The fields of a result of batch `batch` carrying `stats`.
fn result_fields(
    plan: &Plan,
    batch: usize,
    worker: &str,
    fingerprint: &str,
    stats: &Stats,
) -> Vec<(String, Vec<u8>)> {
    [
        ("batches", batch.to_string().into_bytes()),
        ("ids", plan.batches[batch].id.to_string().into_bytes()),
        ("worker", worker.as_bytes().to_vec()),
        ("fingerprint", fingerprint.as_bytes().to_vec()),
        ("elapsed_us", b"1000".to_vec()),
        ("speculative", b"0".to_vec()),
        ("stats", encode(stats)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect()
}

fn borrowed(fields: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    fields
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_slice()))
        .collect()
}

/// Runs `backend`'s run to its end with two worker threads holding the test
/// key, ending the run whatever happens so that the workers leave.
fn run_with_workers(
    server: &RedisServer,
    name: &str,
    job: &Job,
    plan: &Plan,
    backend: &RedisBackend,
) -> qforge_runner::Result<RunSummary> {
    std::thread::scope(|scope| {
        for w in 0..2 {
            let worker = worker_of(server, name, &format!("{name}-w{w}"));
            scope.spawn(move || run_worker(&worker, &mut |_| {}));
        }
        let summary = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run(job, plan, backend, &RunOptions::default(), &mut |_| {})
        }));
        backend.finish(matches!(summary, Ok(Ok(_)))).unwrap();
        summary.unwrap()
    })
}

/// Runs `backend`'s run with no worker, on a thread of its own, and says how
/// it ended: the attacks below end it at once, and a coordinator that keeps
/// waiting (as before they were fixed) fails the test instead of hanging it.
fn run_without_workers(job: Job, plan: Plan, backend: RedisBackend) -> Result<(), String> {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = run(&job, &plan, &backend, &RunOptions::default(), &mut |_| {});
        backend.finish(false).unwrap();
        sender
            .send(outcome.map(|_| ()).map_err(|e| e.to_string()))
            .unwrap();
    });
    receiver
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the coordinator kept waiting for results after the attack")
}

#[test]
fn results_forged_without_the_key_are_refused_by_name_and_the_genuine_ones_merge() {
    let Some(server) = RedisServer::start("unsealed", None) else {
        return;
    };
    let (target, job, plan) = setup();
    let backend = open_run(&server, "unsealed", &job, None);
    let mut forger = Forger::new(&server, "unsealed");
    let fingerprint = forger.set_reference(&target);
    // The attack: batch 3 with one histogram count raised by 40, before any
    // worker runs, so that the genuine result would be the duplicate.
    let mut raised = observed(&target, &job, &plan, 3);
    let tensor = raised.tensors.values_mut().next().unwrap();
    tensor.observe(&[0.5; 40]).unwrap();
    let forged = result_fields(&plan, 3, "forger", &fingerprint, &raised);
    forger.append("1-1", &borrowed(&forged), None);
    // The same, sealed under a key derived from another cluster key.
    let other = ClusterKey::from_text(&"x".repeat(40), "another").unwrap();
    let other_key = forger.run_key(&other);
    forger.append("1-2", &borrowed(&forged), Some(&other_key));

    let summary = run_with_workers(&server, "unsealed", &job, &plan, &backend).unwrap();
    assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
    assert_eq!(summary.quarantined_results, 2, "{:?}", summary.warnings);
    let warnings = summary.warnings.join("\n");
    assert!(
        warnings.contains("dropped 2 result(s) that fails its MAC"),
        "{warnings}"
    );
    assert!(
        warnings.contains("entry 1-1 (claiming worker \"forger\", batches \"3\")")
            && warnings.contains("entry 1-2"),
        "{warnings}"
    );
}

#[test]
fn a_sealed_result_shaped_unlike_the_pass_is_refused_before_decoding_and_redone() {
    let Some(server) = RedisServer::start("misshapen", None) else {
        return;
    };
    let (target, job, plan) = setup();
    let backend = open_run(&server, "misshapen", &job, None);
    let mut forger = Forger::new(&server, "misshapen");
    let fingerprint = forger.set_reference(&target);
    let key = forger.run_key(&test_key());
    // A genuine first result gives the pass's shapes; then, sealed (a
    // worker holding the key, faulty or hostile), batch 1 with a Gram
    // matrix 4 096 wide on a layer that records none: 8 MB of one-byte
    // zero entries that would take 134 MB as sums.
    let genuine = result_fields(
        &plan,
        0,
        "forger",
        &fingerprint,
        &observed(&target, &job, &plan, 0),
    );
    forger.append("1-1", &borrowed(&genuine), Some(&key));
    let mut wide = observed(&target, &job, &plan, 1);
    let name = wide.tensors.keys().next().unwrap().clone();
    wide.tensors
        .insert(name, TensorStats::with_gram(Gram::new(4096, 0).unwrap()));
    let misshapen = result_fields(&plan, 1, "forger", &fingerprint, &wide);
    forger.append("1-2", &borrowed(&misshapen), Some(&key));

    let summary = run_with_workers(&server, "misshapen", &job, &plan, &backend).unwrap();
    assert_eq!(encode(&summary.stats), clean_bytes(&target, &job, &plan));
    assert!(summary.retries >= 1, "{summary:?}");
    assert!(
        summary
            .timeline
            .iter()
            .any(|d| d.batch == 1 && d.merged && d.worker != "forger"),
        "batch 1 was not redone by a worker"
    );
}

#[test]
fn a_second_copy_that_differs_from_the_merged_one_stops_the_run_naming_both_workers() {
    let Some(server) = RedisServer::start("differing", None) else {
        return;
    };
    let (target, job, plan) = setup();
    let backend = open_run(&server, "differing", &job, None);
    let mut forger = Forger::new(&server, "differing");
    let fingerprint = forger.set_reference(&target);
    let key = forger.run_key(&test_key());
    let genuine = observed(&target, &job, &plan, 2);
    let mut faulty = genuine.clone();
    let tensor = faulty.tensors.values_mut().next().unwrap();
    tensor.observe(&[0.5; 40]).unwrap();
    let first = result_fields(&plan, 2, "w-honest", &fingerprint, &genuine);
    forger.append("1-1", &borrowed(&first), Some(&key));
    let second = result_fields(&plan, 2, "w-faulty", &fingerprint, &faulty);
    forger.append("1-2", &borrowed(&second), Some(&key));

    // No worker: the coordinator reads both entries and stops at the second.
    let err = run_without_workers(job, plan, backend).unwrap_err();
    assert!(
        err.contains("worker w-honest sent") && err.contains("worker w-faulty sent"),
        "{err}"
    );
    assert!(
        err.contains("computed twice with different statistics"),
        "{err}"
    );
}

#[test]
fn an_entry_id_no_worker_can_follow_fails_the_run_at_once() {
    let Some(server) = RedisServer::start("exhausted", None) else {
        return;
    };
    let (_, job, plan) = setup();
    let backend = open_run(&server, "exhausted", &job, None);
    let mut forger = Forger::new(&server, "exhausted");
    forger.append(
        "18446744073709551615-18446744073709551615",
        &[("batches", b"0")],
        None,
    );
    // Before the fix the coordinator waited for results forever.
    let err = run_without_workers(job, plan, backend).unwrap_err();
    assert!(err.contains("no worker can append a result"), "{err}");
    assert!(err.contains("check who can write to"), "{err}");
}

#[test]
fn a_worker_holding_another_cluster_key_is_refused_before_it_observes() {
    let Some(server) = RedisServer::start("other-key", None) else {
        return;
    };
    let (_, job, _) = setup();
    let backend = open_run(&server, "other-key", &job, None);
    let mut worker = worker_of(&server, "other-key", "stranger");
    worker.key = ClusterKey::from_text(&"y".repeat(40), "QFORGE_CLUSTER_KEY").unwrap();
    let err = run_worker(&worker, &mut |_| {}).unwrap_err();
    backend.finish(false).unwrap();
    assert!(matches!(err, Error::Refused(_)), "{err}");
    let err = err.to_string();
    assert!(
        err.contains("another cluster key than this worker's (from QFORGE_CLUSTER_KEY)"),
        "{err}"
    );
}
