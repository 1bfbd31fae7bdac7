//! How the Redis backend meets a Redis that fails, on a real `redis-server`.
//! (Faults with real worker and coordinator processes, SIGKILL and Redis
//! restarts mid-run, are in the CLI's cluster tests.)

#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use qforge_runner::cluster::run_worker;
use redis_server::RedisServer;

use pendulum::worker_of;

/// Clients connected to `server`.
fn clients(server: &RedisServer) -> usize {
    let client = redis::Client::open(server.url()).unwrap();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut client.get_connection().unwrap())
        .unwrap();
    list.lines().count()
}

#[test]
fn a_frozen_redis_ends_a_worker_within_its_outage_limit_not_twice_it() {
    let Some(server) = RedisServer::start("frozen", None) else {
        return;
    };
    let limit = Duration::from_secs(3);
    let mut worker = worker_of(&server, "frozen", "w");
    worker.outage_limit = limit;
    worker.wait = Duration::from_secs(600);
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = run_worker(&worker, &mut |_| {});
        sender.send(outcome.map(|_| ()).map_err(|e| e.to_string()))
    });
    // The worker waits for its run, connected: then Redis hangs.
    let deadline = Instant::now() + Duration::from_secs(60);
    while clients(&server) < 2 {
        assert!(Instant::now() < deadline, "the worker never connected");
        std::thread::sleep(Duration::from_millis(10));
    }
    server.freeze();
    let frozen = Instant::now();
    let outcome = receiver
        .recv_timeout(Duration::from_secs(60))
        .expect("the worker kept waiting on a frozen Redis");
    let waited = frozen.elapsed();
    let err = outcome.unwrap_err();
    assert!(err.contains("unreachable for more than 3 s"), "{err}");
    // It used to wait a read timeout (5 s) before counting, and another
    // after: 10.5 s for `--outage-limit 5`.
    assert!(
        waited < limit + Duration::from_millis(1500),
        "gave up {waited:?} after Redis froze, with an outage limit of {limit:?}"
    );
}
