//! A run on a Redis Cluster (several masters, on real `redis-server`s): the
//! coordinator and the workers follow redirections and a failover of the
//! master holding the run, and the bytes are a clean single-worker run's.

#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::num::NonZeroUsize;
use std::time::Duration;

use pendulum::{Slow, clean_bytes, open_run, setup, worker_of};
use qforge_core::codec::encode;
use qforge_runner::cluster::{WorkerOptions, run_worker, run_worker_with};
use qforge_runner::{RunOptions, run};
use redis_server::RedisCluster;

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
            scope.spawn(move || run_worker(&worker, &mut |_| {}).unwrap());
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
                run_worker_with(worker, &mut Slow(Duration::from_millis(150)), &mut |_| {}).unwrap()
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
