//! Conformance of a backend + coordinator, run against both backends
//! (embedded threads, and Redis with worker threads on a real `redis-server`):
//! the merged statistics are byte-identical to a clean single-worker run
//! whatever the worker count, the order of results, duplicates, failures, a
//! coordinator crash and resume, or a corrupt checkpoint, and a checkpoint of
//! another calibration is refused. Uses the trained Pendulum policy and its
//! rollouts (small, real). What only the Redis backend has is tested in the
//! `redis_*.rs` files beside this one; faults with real processes (SIGKILL,
//! SIGSTOP, Redis restarts) are in the CLI's cluster tests.

#[path = "support/backends.rs"]
mod backends;
#[path = "support/pendulum.rs"]
mod pendulum;
#[path = "support/redis_server.rs"]
mod redis_server;

use backends::{BY_BATCH, Faults, backends, run_on, run_session_on, temp_dir};
use pendulum::{clean_bytes, fixture, session, setup};
use qforge_calib::{Recipe, Session, Weights};
use qforge_core::codec::encode;
use qforge_runner::{CheckpointStore, RunOptions};

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
    for redis in backends("foreign") {
        let dir = temp_dir(&format!("foreign-{}", redis.is_some()));
        let options = RunOptions {
            checkpoints: Some(CheckpointStore::new(dir.path())),
            ..RunOptions::default()
        };
        run_on(redis.as_ref(), "foreign", 2, &options, &Faults::none()).unwrap();
        // The same files planned under another seed.
        let recipe = Recipe {
            seed: 9,
            ..session().recipe
        };
        let rollouts = fixture().join("rollouts.jsonl");
        let other = Session::open(&fixture(), &rollouts, &recipe, false, Weights::Load).unwrap();
        let resume = RunOptions {
            resume: true,
            ..options
        };
        // Under another run name: Redis refuses to resume a run of the same
        // name that holds another calibration before any checkpoint is read.
        let err = run_session_on(
            other,
            redis.as_ref(),
            "foreign-recipe",
            2,
            BY_BATCH,
            &resume,
            &Faults::none(),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("different model, data or recipe"),
            "{err}"
        );
    }
}
