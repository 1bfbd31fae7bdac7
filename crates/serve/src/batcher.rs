//! Dynamic batching: requests queue up; one thread takes the first, waits
//! at most `max_wait` for more, up to `max_batch` observations, runs them
//! as one forward (one GEMM per layer instead of one per request), and
//! answers each request with its own rows.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use qforge_model::{Action, MlpPolicy};
use tokio::sync::oneshot;

use crate::metrics::Metrics;

/// One request's observations and where its actions go.
pub struct Job {
    /// Row-major observations.
    pub observations: Vec<f32>,
    /// Number of rows.
    pub rows: usize,
    /// Actions, or why the forward failed.
    pub reply: oneshot::Sender<Result<Vec<Action>, String>>,
}

/// The queue's sending end.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
}

impl Batcher {
    /// Starts the batching thread, which owns `policy`.
    pub fn start(
        policy: MlpPolicy,
        max_batch: usize,
        max_wait: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (queue, jobs) = mpsc::channel::<Job>();
        let thread_metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("qforge-batcher".into())
            .spawn(move || run(&policy, &jobs, max_batch.max(1), max_wait, &thread_metrics))
            .expect("spawn the batching thread");
        Self { queue, metrics }
    }

    /// Queues a job; false when the batching thread is gone.
    pub fn submit(&self, job: Job) -> bool {
        self.metrics.queue_depth.inc();
        let sent = self.queue.send(job).is_ok();
        if !sent {
            self.metrics.queue_depth.dec();
        }
        sent
    }
}

fn run(
    policy: &MlpPolicy,
    jobs: &mpsc::Receiver<Job>,
    max_batch: usize,
    max_wait: Duration,
    metrics: &Metrics,
) {
    let dim = policy.config().observation_dim;
    // Ends when every sender (the server) is gone.
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        let mut rows = batch[0].rows;
        let deadline = Instant::now() + max_wait;
        while rows < max_batch {
            let left = deadline.saturating_duration_since(Instant::now());
            match jobs.recv_timeout(left) {
                Ok(job) => {
                    rows += job.rows;
                    batch.push(job);
                }
                Err(_) => break,
            }
        }
        metrics.queue_depth.dec_by(batch.len() as i64);
        metrics.batch_rows.observe(rows as f64);
        let mut observations = Vec::with_capacity(rows * dim);
        for job in &batch {
            observations.extend_from_slice(&job.observations);
        }
        match policy.act(&observations) {
            Ok(actions) => {
                let mut actions = actions.into_iter();
                for job in batch {
                    let mine: Vec<Action> = actions.by_ref().take(job.rows).collect();
                    // The client may have gone (timeout); nothing to do then.
                    let _ = job.reply.send(Ok(mine));
                }
            }
            Err(e) => {
                for job in batch {
                    let _ = job.reply.send(Err(e.to_string()));
                }
            }
        }
    }
}
