//! Dynamic batching: requests queue up; one thread takes the first, waits
//! at most `max_wait` for more, up to `max_batch` observations, runs them
//! as one forward (one GEMM per layer instead of one per request), and
//! answers each request with its own rows. It stops waiting as soon as no
//! accepted request is still on its way to the queue: a lone client pays
//! no batching delay, a loaded server still batches. (Measured with wrk, 16
//! connections, one observation per request: always waiting the window
//! held p50 at 2.3 ms; see BENCHMARKS.md for the figures after.)
//!
//! A panic in a forward fails that batch's requests (500), is logged and
//! counted (`qforge_model_panics_total`), and the thread goes on: the
//! forward only reads the policy. Should the thread end all the same,
//! [`Batcher::alive`] says so and `/ready` turns 503.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use qforge_formats::policy::Action;
use qforge_model::MlpPolicy;
use rand::rngs::StdRng;
use tokio::sync::oneshot;

use crate::drift::DriftMonitor;
use crate::metrics::Metrics;
use crate::swap::Swap;

/// One request's observations and where its actions go.
pub struct ActRequest {
    /// Row-major observations.
    pub observations: Vec<f32>,
    /// Number of rows.
    pub rows: usize,
    /// Which action each row gets, and which one its log-probability is of.
    pub choice: Choice,
    /// The actions, or why the forward failed.
    pub reply: oneshot::Sender<Result<Answer, String>>,
}

/// How a request's actions are chosen from the head's outputs.
pub enum Choice {
    /// The head's greedy action ([`qforge_formats::policy::Head::greedy`]).
    Greedy,
    /// A draw from the head's distribution (the head must have one).
    Sample(Box<StdRng>),
    /// The greedy actions, with the log-probabilities of these actions (one
    /// per row): what the FP shadow is asked about INT8's answer.
    Score(Vec<Action>),
}

/// A request's actions, their log-probabilities under the policy that chose
/// them, and the version of that policy.
pub struct Answer {
    /// One action per row.
    pub actions: Vec<Action>,
    /// Per row, the log-probability of its action ([`Choice::Score`]: of
    /// the action given); `None` where the head defines no distribution.
    pub log_probs: Vec<Option<f64>>,
    /// The model version (1 at start, one more per reload).
    pub version: u64,
}

/// What the batching thread receives.
enum Message {
    Act(ActRequest),
    /// A new policy, taken between two batches: the requests queued before it
    /// are answered by the old one.
    Swap(Box<Swap<MlpPolicy>>),
}

/// The queue's sending end.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Message>,
    metrics: Arc<Metrics>,
    /// Requests accepted but not yet taken into a batch.
    arriving: Arc<AtomicUsize>,
    /// False once the batching thread has ended.
    alive: Arc<AtomicBool>,
}

/// Marks a model thread dead when it ends, by return or by unwinding.
pub(crate) struct Alive(pub(crate) Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Observations that make the test build's batcher panic: inside a
/// forward (caught) and outside (ending the thread).
#[cfg(test)]
pub(crate) const FAULT_PANIC: f32 = 1.0e30;
#[cfg(test)]
pub(crate) const FAULT_EXIT: f32 = 2.0e30;

/// A request on its way to the queue; dropping it without submitting (an
/// invalid request) takes it back.
pub struct Arrival {
    arriving: Arc<AtomicUsize>,
    submitted: bool,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        if !self.submitted {
            self.arriving.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Batcher {
    /// Starts the batching thread, which owns `policy` and its drift
    /// `monitor`.
    pub fn start(
        policy: MlpPolicy,
        monitor: Option<DriftMonitor>,
        max_batch: usize,
        max_wait: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (queue, requests) = mpsc::channel::<Message>();
        let thread_metrics = Arc::clone(&metrics);
        let arriving = Arc::new(AtomicUsize::new(0));
        let thread_arriving = Arc::clone(&arriving);
        let alive = Arc::new(AtomicBool::new(true));
        let thread_alive = Alive(Arc::clone(&alive));
        std::thread::Builder::new()
            .name("qforge-batcher".into())
            .spawn(move || {
                let _alive = thread_alive;
                let mut thread = BatchingThread {
                    policy,
                    monitor,
                    version: 1,
                    max_batch: max_batch.max(1),
                    max_wait,
                    metrics: thread_metrics,
                    arriving: thread_arriving,
                };
                thread.run(&requests)
            })
            .expect("spawn the batching thread");
        Self {
            queue,
            metrics,
            arriving,
            alive,
        }
    }

    /// Whether the batching thread still runs.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Announces a request that will (probably) be submitted, so a batch
    /// being collected waits for it.
    pub fn announce(&self) -> Arrival {
        self.arriving.fetch_add(1, Ordering::SeqCst);
        Arrival {
            arriving: Arc::clone(&self.arriving),
            submitted: false,
        }
    }

    /// Queues the request of `arrival`; false when the batching thread is gone.
    pub fn submit(&self, mut arrival: Arrival, request: ActRequest) -> bool {
        self.metrics.queue_depth.inc();
        let sent = self.queue.send(Message::Act(request)).is_ok();
        if sent {
            // The batching thread takes it back when it takes the request.
            arrival.submitted = true;
        } else {
            self.metrics.queue_depth.dec();
        }
        sent
    }

    /// Queues a swap to `policy` (watched by `monitor`) as model `version`;
    /// the receiver hears once every request queued before it has its answer
    /// and the new policy answers what follows. `None`: the batching
    /// thread is gone.
    pub fn swap(
        &self,
        policy: MlpPolicy,
        monitor: Option<DriftMonitor>,
        version: u64,
    ) -> Option<oneshot::Receiver<()>> {
        let (swap, swapped) = Swap::new(policy, monitor, version);
        self.queue.send(Message::Swap(swap)).ok()?;
        Some(swapped)
    }
}

/// The batching thread's state: the policy it runs and its version.
struct BatchingThread {
    policy: MlpPolicy,
    monitor: Option<DriftMonitor>,
    version: u64,
    max_batch: usize,
    max_wait: Duration,
    metrics: Arc<Metrics>,
    arriving: Arc<AtomicUsize>,
}

impl BatchingThread {
    /// Collects and answers batches until every sender (the server) is
    /// gone. A swap ends the batch being collected: that batch is answered
    /// by the old policy, the next by the new one.
    fn run(&mut self, messages: &mpsc::Receiver<Message>) {
        let mut next = None;
        loop {
            let first = match next.take() {
                Some(message) => message,
                None => match messages.recv() {
                    Ok(message) => message,
                    Err(_) => return,
                },
            };
            let first = match first {
                Message::Act(request) => request,
                Message::Swap(swap) => {
                    self.swap(*swap);
                    continue;
                }
            };
            self.arriving.fetch_sub(1, Ordering::SeqCst);
            let mut batch = vec![first];
            let mut rows = batch[0].rows;
            let deadline = Instant::now() + self.max_wait;
            while rows < self.max_batch {
                let message = match messages.try_recv() {
                    Ok(message) => message,
                    // Nothing queued and nobody on the way: run now.
                    Err(_) if self.arriving.load(Ordering::SeqCst) == 0 => break,
                    Err(_) => match messages
                        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    {
                        Ok(message) => message,
                        Err(_) => break,
                    },
                };
                match message {
                    Message::Act(request) => {
                        self.arriving.fetch_sub(1, Ordering::SeqCst);
                        rows += request.rows;
                        batch.push(request);
                    }
                    swap @ Message::Swap(_) => {
                        next = Some(swap);
                        break;
                    }
                }
            }
            self.answer(batch, rows);
        }
    }

    /// Takes the new policy, then says so.
    fn swap(&mut self, swap: Swap<MlpPolicy>) {
        self.policy = swap.model;
        self.monitor = swap.monitor;
        self.version = swap.version;
        let _ = swap.done.send(());
    }

    /// One forward over the batch's `rows`, each request answered with its own.
    fn answer(&mut self, batch: Vec<ActRequest>, rows: usize) {
        let metrics = &self.metrics;
        metrics.queue_depth.dec_by(batch.len() as i64);
        metrics.batch_rows.observe(rows as f64);
        let dim = self.policy.config().observation_dim;
        let mut observations = Vec::with_capacity(rows * dim);
        for request in &batch {
            observations.extend_from_slice(&request.observations);
        }
        #[cfg(test)]
        if observations.first() == Some(&FAULT_EXIT) {
            panic!("injected fault outside the forward");
        }
        let policy = &self.policy;
        let observer = DriftMonitor::observer_for_next(self.monitor.as_mut());
        let outputs = catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            if observations.first() == Some(&FAULT_PANIC) {
                panic!("injected fault");
            }
            policy
                .forward(&observations, observer)
                .map_err(|e| e.to_string())
        }))
        .unwrap_or_else(|panic| {
            metrics.model_panics.inc();
            let message = format!(
                "the model panicked on this batch: {}",
                panic_message(&*panic)
            );
            tracing::error!("qforge serve: {message}; the batcher goes on");
            Err(message)
        });
        match outputs {
            Ok(outputs) => {
                let width = policy.config().head.outputs();
                let mut rows = outputs.chunks_exact(width);
                for request in batch {
                    let mine: Vec<&[f32]> = rows.by_ref().take(request.rows).collect();
                    // Only this request's rows decide its answer: another
                    // client's overflow is not its failure.
                    let answer = match policy.config().head.check_finite(&mine.concat()) {
                        Ok(()) => {
                            let (actions, log_probs) = choose(policy, &mine, request.choice);
                            Ok(Answer {
                                actions,
                                log_probs,
                                version: self.version,
                            })
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    // The client may have gone (timeout); nothing to do then.
                    let _ = request.reply.send(answer);
                }
            }
            Err(message) => {
                for request in batch {
                    let _ = request.reply.send(Err(message.clone()));
                }
            }
        }
    }
}

/// Each output row's action as `choice` says, and its log-probability.
/// A request admitted to sample whose policy was swapped, before its batch, for
/// one without a distribution gets that policy's greedy actions (and no
/// log-probabilities).
fn choose(policy: &MlpPolicy, rows: &[&[f32]], choice: Choice) -> (Vec<Action>, Vec<Option<f64>>) {
    let head = &policy.config().head;
    let greedy = || rows.iter().map(|row| head.greedy(row)).collect();
    let (actions, given): (Vec<Action>, _) = match choice {
        Choice::Greedy => (greedy(), None),
        Choice::Score(given) => (greedy(), Some(given)),
        Choice::Sample(mut rng) => {
            let sampled = rows
                .iter()
                .map(|row| {
                    head.sample(row, &mut *rng)
                        .unwrap_or_else(|| head.greedy(row))
                })
                .collect();
            (sampled, None)
        }
    };
    let scored = given.as_ref().unwrap_or(&actions);
    let log_probs = rows
        .iter()
        .zip(scored)
        .map(|(row, action)| head.log_prob(row, action))
        .collect();
    (actions, log_probs)
}

#[cfg(test)]
mod tests {
    use super::{FAULT_EXIT, FAULT_PANIC};
    use crate::testing::TestServer;

    const OK: &str = r#"{"observations": [[0.0, 0.1, 0.0, -0.1]]}"#;

    fn faulty(value: f32) -> String {
        format!(r#"{{"observations": [[{value:e}, 0.0, 0.0, 0.0]]}}"#)
    }

    /// Finite observations that overflow the forward (the attack's
    /// 3.4e38) get an error naming the row, not a 200 with a null
    /// log-probability and action 0; the next request is answered.
    #[test]
    fn an_overflowing_forward_is_refused_not_answered_with_nan() {
        let server = TestServer::policy();
        let huge = r#"{"observations": [[0.0, 0.1, 0.0, -0.1], [3.4e38, 3.4e38, 3.4e38, 3.4e38]]}"#;
        let (status, body) = server.request("POST", "/v1/act", huge);
        assert_eq!(status, 500, "{body}");
        assert!(
            body.contains("output for observation row 1 is") && body.contains("not finite"),
            "{body}"
        );
        let (status, body) = server.request("POST", "/v1/act", OK);
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains("null"), "{body}");
    }

    #[test]
    fn a_panicking_forward_fails_its_batch_and_the_batcher_goes_on() {
        let server = TestServer::policy();
        let (status, body) = server.request("POST", "/v1/act", &faulty(FAULT_PANIC));
        assert_eq!(status, 500, "{body}");
        assert!(
            body.contains("the model panicked on this batch: injected fault"),
            "{body}"
        );
        let (status, body) = server.request("POST", "/v1/act", OK);
        assert_eq!(status, 200, "{body}");
        assert_eq!(server.request("GET", "/ready", "").0, 200);
        let (_, metrics) = server.request("GET", "/metrics", "");
        assert!(metrics.contains("qforge_model_panics_total 1"), "{metrics}");
    }

    #[test]
    fn once_the_batching_thread_has_died_ready_answers_503() {
        let server = TestServer::policy();
        assert_eq!(server.request("GET", "/ready", "").0, 200);
        let (status, body) = server.request("POST", "/v1/act", &faulty(FAULT_EXIT));
        assert_eq!(status, 503, "{body}");
        server.wait_for_status("/ready", 503);
        let (status, body) = server.request("POST", "/v1/act", OK);
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("the model worker stopped"), "{body}");
        // The server itself stays up.
        assert_eq!(server.request("GET", "/health", "").0, 200);
    }
}
