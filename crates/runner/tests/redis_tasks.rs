//! How the Redis backend hands out tasks, on a real `redis-server`: tasks of
//! several batches and their regrouping on resume, a coordinator behind the
//! results stream, pacing, a dead worker's task folded into a live one's,
//! routed tasks, and a worker following a pipeline into its next pass. Each
//! run ends with the bytes of a clean single-worker run.

#[path = "support/backends.rs"]
mod backends;
#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;

use backends::{BY_BATCH, Faults, run_session_on, temp_dir};
use pendulum::{
    Slow, await_count, clean_bytes, fast_spec, open_run, open_spec, session, session_of, setup,
    setup_of, worker_of,
};
use qforge_core::codec::encode;
use qforge_runner::cluster::{Pace, run_worker, run_worker_with};
use qforge_runner::{Backend, CheckpointStore, Next, Outcome, RunOptions, RunSummary, run};
use redis_server::RedisServer;

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
            scope.spawn(|| run_worker(&worker_of(&server, name, "w"), &mut |_| {}).unwrap());
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
        let report = run_worker_with(
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
        let served = run_worker_with(
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
        scope.spawn(|| run_worker(&worker_of(&server, "flw", "prompt"), &mut |_| {}).unwrap());
        // "late" serves the first pass, then stalls before following the
        // pipeline until the second pass is over.
        let late = scope.spawn(|| {
            run_worker(&worker_of(&server, "flw", "late"), &mut |line: &str| {
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
