//! The `Backend` trait and the embedded backend (worker threads in-process).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use qforge_calib::{Batch, HiddenStates, Job, Plan, observe_batch};
use qforge_core::{Digest, Stats};
use qforge_model::Model;

use crate::error::{Error, Result};

/// What a worker reports for one batch.
#[derive(Debug)]
pub enum Outcome {
    /// The statistics of one or more batches, merged by the worker that
    /// observed them (a cluster worker handed several batches as one task
    /// publishes them as one result: merging is exact, so the coordinator's
    /// result is the same, at a fraction of its work per batch).
    Done {
        /// Indices of the batches in the plan, ascending, at least one.
        batches: Vec<usize>,
        /// Their statistics.
        stats: Box<Stats>,
        /// The worker that computed them.
        worker: String,
        /// Time spent observing them.
        elapsed: Duration,
        /// Whether it was a speculative re-execution of a task another
        /// worker still held.
        speculative: bool,
        /// The SHA-256 of the statistics' bytes as the worker sent them,
        /// where another copy of the same batches must have the same bytes
        /// (a cluster result under the run's reference fingerprint): a
        /// duplicate is compared by it.
        digest: Option<Digest>,
    },
    /// The batches failed on a worker (a worker publishes each failed
    /// batch of a task on its own; a result that does not decode fails all
    /// it covers).
    Failed {
        /// Indices of the batches in the plan, at least one.
        batches: Vec<usize>,
        /// The worker.
        worker: String,
        /// What went wrong.
        error: Failure,
    },
}

/// Why a batch failed: the kind decides what the coordinator's report says
/// and where to look, the message says what happened.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", content = "message", rename_all = "kebab-case")]
pub enum Failure {
    /// The batch cannot be observed as it is (a record the model rejects,
    /// non-finite activations): every worker would fail it the same way.
    Data(String),
    /// The worker failed (its forward panicked, its result did not decode,
    /// it holds another plan): another worker may well succeed.
    Worker(String),
}

impl Failure {
    /// The name a Redis result entry carries it under (`kind` field).
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Data(_) => "data",
            Failure::Worker(_) => "worker",
        }
    }

    /// The failure a result entry describes: `kind` as [`Failure::kind`]
    /// names it (a worker before this field existed sent none: a worker
    /// fault, the kind that does not blame the data).
    pub fn from_parts(kind: Option<&str>, message: String) -> Self {
        match kind {
            Some("data") => Failure::Data(message),
            _ => Failure::Worker(message),
        }
    }

    /// What happened, without the kind.
    pub fn message(&self) -> &str {
        match self {
            Failure::Data(m) | Failure::Worker(m) => m,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Data(m) => write!(f, "bad data: {m}"),
            Failure::Worker(m) => write!(f, "worker fault: {m}"),
        }
    }
}

/// What the coordinator tells a backend after each outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Keep going.
    Continue,
    /// Observe these batches again (they failed fewer times than the limit,
    /// or came in a result that could not be merged whole).
    Retry(Vec<usize>),
    /// Stop: the coordinator has what it needs or gave up.
    Stop,
}

/// Runs the map step of a pass: turns the planned batches it is given into
/// [`Outcome`]s. Outcomes may arrive in any order and may repeat (a retried
/// or speculatively re-run batch); the coordinator merges each batch id
/// exactly once, refusing a result that covers a batch merged already
/// together with one that is not.
pub trait Backend {
    /// Observes the batches `pending` (indices into `plan.batches`, not
    /// empty), calling `on_outcome` for each result as it arrives, until it
    /// answers [`Next::Stop`] or an error.
    fn run(
        &self,
        plan: &Plan,
        pending: &[usize],
        on_outcome: &mut dyn FnMut(Outcome) -> Result<Next>,
    ) -> Result<()>;

    /// How many workers it runs (for a cluster: how many are alive now).
    fn workers(&self) -> usize;

    /// Everything passed to `on_outcome` so far is durable (checkpointed, or
    /// there is no checkpoint to resume from): a backend may forget it.
    fn committed(&self) -> Result<()> {
        Ok(())
    }

    /// What the backend noticed on the way (lost tasks, refused results…).
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// Results the backend refused before the merge (entries it could not
    /// attribute to a planned batch, or not accept), each named in the
    /// warnings.
    fn refused_results(&self) -> usize {
        0
    }
}

/// N worker threads in this process, sharing the model (weights are shared,
/// not copied). The default backend: no services needed.
pub struct Embedded {
    target: Model,
    job: Job,
    workers: usize,
    hidden_states: Arc<HiddenStates>,
}

impl Embedded {
    /// A backend of `workers` threads (at least 1).
    pub fn new(target: Model, job: Job, workers: usize) -> Self {
        Self {
            target,
            job,
            workers: workers.max(1),
            hidden_states: Arc::default(),
        }
    }

    /// The backend resuming from, and keeping, `hidden_states` (those of
    /// the session whose passes it runs).
    pub fn with_hidden_states(self, hidden_states: Arc<HiddenStates>) -> Self {
        Self {
            hidden_states,
            ..self
        }
    }
}

impl Backend for Embedded {
    fn workers(&self) -> usize {
        self.workers
    }

    fn run(
        &self,
        plan: &Plan,
        pending: &[usize],
        on_outcome: &mut dyn FnMut(Outcome) -> Result<Next>,
    ) -> Result<()> {
        let cursor = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let (retry_tx, retry_rx) = mpsc::channel::<usize>();
        let retry_rx = std::sync::Mutex::new(retry_rx);
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = mpsc::channel::<Outcome>();
            let handles: Vec<_> = (0..self.workers)
                .map(|w| {
                    let tx = tx.clone();
                    let (cursor, stop, retry_rx) = (&cursor, &stop, &retry_rx);
                    let name = format!("embedded-{w}");
                    scope.spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            // Retries first, then fresh work; with neither, wait
                            // for a retry until the coordinator says stop.
                            let retried = retry_rx.lock().ok().and_then(|r| r.try_recv().ok());
                            let batch = match retried {
                                Some(b) => b,
                                None => match pending.get(cursor.fetch_add(1, Ordering::Relaxed)) {
                                    Some(&b) => b,
                                    None => {
                                        std::thread::sleep(Duration::from_millis(5));
                                        continue;
                                    }
                                },
                            };
                            let started = Instant::now();
                            let observed = observe_guarded(
                                &self.target,
                                &plan.batches[batch],
                                &self.job,
                                &self.hidden_states,
                            );
                            let outcome = match observed {
                                Ok(stats) => Outcome::Done {
                                    batches: vec![batch],
                                    stats: Box::new(stats),
                                    worker: name.clone(),
                                    elapsed: started.elapsed(),
                                    speculative: false,
                                    // One thread per batch: no duplicates.
                                    digest: None,
                                },
                                Err(error) => Outcome::Failed {
                                    batches: vec![batch],
                                    worker: name.clone(),
                                    error,
                                },
                            };
                            if tx.send(outcome).is_err() {
                                break;
                            }
                        }
                    })
                })
                .collect();
            drop(tx);
            let mut result = Ok(());
            for outcome in &rx {
                match on_outcome(outcome) {
                    Ok(Next::Continue) => {}
                    Ok(Next::Retry(batches)) => {
                        for batch in batches {
                            let _ = retry_tx.send(batch);
                        }
                    }
                    Ok(Next::Stop) => break,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
            drop(rx);
            for (w, handle) in handles.into_iter().enumerate() {
                if handle.join().is_err() && result.is_ok() {
                    result = Err(Error::WorkerPanic(format!("embedded-{w}")));
                }
            }
            result
        })
    }
}

/// Observes one batch; a panic inside the forward becomes a worker fault, so
/// the coordinator hears of it instead of waiting forever, and an error of
/// the batch's own a data failure.
pub(crate) fn observe_guarded(
    target: &Model,
    batch: &Batch,
    job: &Job,
    hidden_states: &HiddenStates,
) -> std::result::Result<Stats, Failure> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        observe_batch(target, batch, job, hidden_states)
    }))
    .map_err(|_| Failure::Worker("the forward pass panicked".into()))?
    .map_err(|e| Failure::Data(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::Failure;

    #[test]
    fn a_failure_crosses_redis_with_its_kind() {
        for failure in [
            Failure::Data("activations of layers.3.mlp are NaN".into()),
            Failure::Worker("the forward pass panicked".into()),
        ] {
            let back = Failure::from_parts(Some(failure.kind()), failure.message().to_owned());
            assert_eq!(back, failure);
        }
        // A result entry from a worker that predates the kind field.
        let legacy = Failure::from_parts(None, "boom".into());
        assert_eq!(legacy, Failure::Worker("boom".into()));
        assert_eq!(legacy.to_string(), "worker fault: boom");
        assert_eq!(
            Failure::Data("x".into()).to_string(),
            "bad data: x",
            "the report must tell a data problem from a worker's"
        );
    }
}
