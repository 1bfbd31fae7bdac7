//! Conformance of a backend + coordinator: the merged statistics are
//! byte-identical to a clean single-worker run whatever the worker count, the
//! order of results, duplicates, failures, a coordinator crash and resume, or
//! a corrupt checkpoint. Uses the trained Pendulum policy and its rollouts
//! (small, real). The Redis backend will run the same suite.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use qforge_calib::{Job, Plan, Recipe, Target, load_jsonl, plan};
use qforge_core::Digest;
use qforge_core::codec::encode;
use qforge_dist::{Backend, CheckpointStore, Embedded, Error, Next, Outcome, RunOptions, run};
use qforge_model::MlpPolicy;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/pendulum")
}

fn setup() -> (Target, Job, Plan) {
    let policy = MlpPolicy::from_dir(&fixture()).unwrap();
    let data = load_jsonl(&fixture().join("rollouts.jsonl"), false).unwrap();
    let recipe = Recipe {
        samples: 600,
        batch_size: 32,
        ..Recipe::default()
    };
    let plan = plan(&data, &recipe, None).unwrap();
    let job = Job {
        model: Digest::of(b"pendulum fixture"),
        data: data.digest,
        recipe,
        planned: plan.batches.len() as u64,
    };
    (Target::Policy(policy), job, plan)
}

fn clean_bytes(target: &Target, job: &Job, plan: &Plan) -> Vec<u8> {
    let backend = Embedded::new(target.clone(), job.clone(), 1);
    let summary = run(job, plan, &backend, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(summary.coverage, 1.0);
    encode(&summary.stats)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qforge-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn any_worker_count_gives_identical_bytes() {
    let (target, job, plan) = setup();
    assert_eq!(plan.batches.len(), 19);
    let clean = clean_bytes(&target, &job, &plan);
    for workers in [2, 4, 7] {
        let backend = Embedded::new(target.clone(), job.clone(), workers);
        let summary = run(&job, &plan, &backend, &RunOptions::default(), &mut |_| {}).unwrap();
        assert_eq!(encode(&summary.stats), clean, "{workers} workers");
        assert_eq!(
            summary.workers.values().map(|w| w.merged).sum::<usize>(),
            19
        );
    }
}

/// Wraps a backend to inject faults into what the coordinator sees.
struct Faulty<'a> {
    inner: &'a dyn Backend,
    /// Deliver every result twice (speculative re-execution).
    duplicate: bool,
    /// Fail this batch index this many times before letting it through.
    fail: Option<(usize, usize)>,
    /// Stop the run with an error after this many outcomes (a coordinator crash).
    crash_after: Option<usize>,
    seen: AtomicUsize,
    failures: AtomicUsize,
}

impl<'a> Faulty<'a> {
    fn new(inner: &'a dyn Backend) -> Self {
        Self {
            inner,
            duplicate: false,
            fail: None,
            crash_after: None,
            seen: AtomicUsize::new(0),
            failures: AtomicUsize::new(0),
        }
    }
}

impl Backend for Faulty<'_> {
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    fn run(
        &self,
        plan: &Plan,
        pending: &[usize],
        on: &mut dyn FnMut(Outcome) -> qforge_dist::Result<Next>,
    ) -> qforge_dist::Result<()> {
        self.inner.run(plan, pending, &mut |outcome| {
            if let Some(limit) = self.crash_after
                && self.seen.fetch_add(1, Ordering::SeqCst) >= limit
            {
                return Err(Error::WorkerPanic("simulated coordinator crash".into()));
            }
            let outcome = match (outcome, self.fail) {
                (Outcome::Done { batch, worker, .. }, Some((b, times)))
                    if batch == b && self.failures.fetch_add(1, Ordering::SeqCst) < times =>
                {
                    Outcome::Failed {
                        batch,
                        worker,
                        error: "injected failure".into(),
                    }
                }
                (o, _) => o,
            };
            if self.duplicate
                && let Outcome::Done {
                    batch,
                    stats,
                    worker,
                    elapsed,
                } = &outcome
            {
                let copy = Outcome::Done {
                    batch: *batch,
                    stats: stats.clone(),
                    worker: format!("{worker}-speculative"),
                    elapsed: *elapsed,
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
    let inner = Embedded::new(target.clone(), job.clone(), 3);

    let mut dup = Faulty::new(&inner);
    dup.duplicate = true;
    let summary = run(&job, &plan, &dup, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(encode(&summary.stats), clean);
    assert!(
        summary.duplicates >= 18,
        "duplicates {}",
        summary.duplicates
    );

    let mut flaky = Faulty::new(&inner);
    flaky.fail = Some((5, 2));
    let summary = run(&job, &plan, &flaky, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(encode(&summary.stats), clean);
    assert_eq!(summary.retries, 2);
    assert!(summary.quarantined.is_empty());
}

#[test]
fn a_batch_failing_three_times_is_quarantined_and_reported() {
    let (target, job, plan) = setup();
    let inner = Embedded::new(target.clone(), job.clone(), 2);
    let mut broken = Faulty::new(&inner);
    broken.fail = Some((7, usize::MAX));
    let err = run(&job, &plan, &broken, &RunOptions::default(), &mut |_| {}).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("18/19") && message.contains("quarantined"),
        "{message}"
    );

    let mut broken = Faulty::new(&inner);
    broken.fail = Some((7, usize::MAX));
    let lenient = RunOptions {
        min_coverage: 0.9,
        ..RunOptions::default()
    };
    let summary = run(&job, &plan, &broken, &lenient, &mut |_| {}).unwrap();
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

#[test]
fn a_crashed_coordinator_resumes_to_identical_bytes_even_past_a_corrupt_checkpoint() {
    let (target, job, plan) = setup();
    let clean = clean_bytes(&target, &job, &plan);
    let dir = temp_dir("resume");
    let inner = Embedded::new(target.clone(), job.clone(), 2);
    let options = RunOptions {
        checkpoints: Some(CheckpointStore::new(&dir)),
        checkpoint_every: 3,
        ..RunOptions::default()
    };
    let mut crashing = Faulty::new(&inner);
    crashing.crash_after = Some(11);
    assert!(run(&job, &plan, &crashing, &options, &mut |_| {}).is_err());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
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
    let summary = run(&job, &plan, &inner, &resume, &mut |_| {}).unwrap();
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

    // A checkpoint of another recipe is refused.
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
    let err = run(&other, &other_plan, &inner, &resume, &mut |_| {}).unwrap_err();
    assert!(
        err.to_string().contains("different model, data or recipe"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
