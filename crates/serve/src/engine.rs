//! Continuous (iteration-level) batching for language models.
//!
//! One thread owns the model. Each iteration it admits waiting requests
//! while the KV budget allows (a request reserves `prompt + max_tokens`
//! positions up front, so an admitted sequence can never run out of cache
//! half-way), runs each newcomer's prompt, then advances every running
//! sequence by one token in a single batched step
//! ([`Llama::step`](qforge_model::Llama::step)): the linear layers read
//! their weights once for all sequences. A sequence leaves the batch the
//! iteration it finishes (end of sequence, a stop string, `max_tokens`, or
//! its client hanging up), and a waiting one takes its place at the next
//! iteration, not when the whole batch is done.
//!
//! Prompts are not chunked: a long prompt delays the other sequences' next
//! token by its prefill time.
//!
//! A request hears when it is admitted (`Request::admitted`): the server's
//! timeout bounds the wait in the queue, not the generation, which
//! `max_tokens` bounds. A panic in the model fails the requests it touched
//! (one prefill, or the batch of one step), is logged and counted
//! (`qforge_model_panics_total`), and the engine goes on; the model is only
//! read, and a failed step's caches are dropped with its sequences. Should
//! the engine's thread end all the same, [`Engine::alive`] says so and
//! `/ready` turns 503.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use qforge_model::lm::sample;
use qforge_model::{KvCache, LanguageModel, Logits, Observer};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use crate::batcher::{Alive, panic_message};
use crate::drift::DriftMonitor;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Stop strings that make the test build's engine panic: inside a
/// prefill (caught) and outside (ending the engine's thread).
#[cfg(test)]
pub(crate) const FAULT_PANIC: &str = "qforge-test-fault-panic";
#[cfg(test)]
pub(crate) const FAULT_EXIT: &str = "qforge-test-fault-exit";

/// Why a completion ended, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// What a completion sends back, in order: text pieces, then one `Done` (or
/// one `Failed`).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next piece of text.
    Text(String),
    /// The completion ended.
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
    },
    /// The model failed on this request.
    Failed(String),
}

/// One completion request, tokenized and checked.
pub struct Request {
    /// The prompt's token ids (not empty).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// `None`: greedy.
    pub temperature: Option<f64>,
    /// Seed of this request's sampler.
    pub seed: u64,
    /// Strings that end the completion (not included in it).
    pub stop: Vec<String>,
    /// Where the events go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// Hears the generated token ids when the request finishes (a shadow
    /// comparison needs them; the client gets text).
    pub finished: Option<oneshot::Sender<Vec<u32>>>,
    /// Hears that the request left the queue and its prompt is about to
    /// run.
    pub admitted: Option<oneshot::Sender<()>>,
}

/// A copy of a request for another engine (the shadow reference), with the
/// receiving ends of its own event channel (to keep it open) and its finish
/// notice.
pub struct Replay {
    /// The copy.
    pub request: Request,
    /// Its events; dropping this cancels the copy.
    pub events: UnboundedReceiver<Event>,
    /// Its generated tokens, when it finishes.
    pub finished: oneshot::Receiver<Vec<u32>>,
}

impl Request {
    /// The same prompt and sampling for another engine.
    pub fn replay(&self) -> Replay {
        let (events, receiver) = unbounded_channel();
        let (finished, tokens) = oneshot::channel();
        Replay {
            request: Request {
                prompt: self.prompt.clone(),
                max_tokens: self.max_tokens,
                temperature: self.temperature,
                seed: self.seed,
                stop: self.stop.clone(),
                events,
                finished: Some(finished),
                admitted: None,
            },
            events: receiver,
            finished: tokens,
        }
    }
}

/// The engine's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most sequences advanced per step.
    pub max_sequences: usize,
    /// Most KV-cache positions reserved at once, over all sequences.
    pub kv_budget_tokens: usize,
    /// Threads the engine's matrix products run on.
    pub threads: usize,
}

/// The sending end of the engine's queue.
#[derive(Clone)]
pub struct Engine {
    queue: mpsc::Sender<Request>,
    metrics: Arc<Metrics>,
    /// False once the scheduler has ended.
    alive: Arc<AtomicBool>,
}

impl Engine {
    /// Starts the engine thread, which owns `lm` and its drift `monitor`.
    pub fn start(
        lm: LanguageModel,
        monitor: Option<DriftMonitor>,
        limits: EngineLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Self> {
        // The engine's own pool, so its thread count does not depend on
        // the process-wide one (the HTTP side shares the cores). Dropping
        // the handle leaves the spawned scheduler running until the queue
        // closes.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(limits.threads.max(1))
            .thread_name(|i| format!("qforge-engine-{i}"))
            // Without a handler rayon aborts the process on a panic that
            // leaves a job: the scheduler's job ending is reported (and
            // `/ready` says so) instead.
            .panic_handler(|panic| {
                tracing::error!(
                    "qforge serve: the engine stopped: it panicked: {}",
                    panic_message(&*panic)
                );
            })
            .build()
            .map_err(|e| Error::Start(format!("the engine's thread pool: {e}")))?;
        let (queue, requests) = mpsc::channel::<Request>();
        let thread_metrics = Arc::clone(&metrics);
        let alive = Arc::new(AtomicBool::new(true));
        let scheduler_alive = Alive(Arc::clone(&alive));
        // The scheduler runs on one of the pool's threads, so the products
        // it starts stay in that pool.
        pool.spawn(move || {
            let _alive = scheduler_alive;
            Scheduler {
                lm: &lm,
                monitor,
                limits,
                metrics: &thread_metrics,
                waiting: VecDeque::new(),
                running: Vec::new(),
            }
            .run(&requests)
        });
        Ok(Self {
            queue,
            metrics,
            alive,
        })
    }

    /// Whether the scheduler still runs.
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Queues `request`; false when the engine thread is gone.
    pub fn submit(&self, request: Request) -> bool {
        self.metrics.queue_depth.inc();
        let sent = self.queue.send(request).is_ok();
        if !sent {
            self.metrics.queue_depth.dec();
        }
        sent
    }
}

/// A sequence being generated.
struct Sequence {
    request: Request,
    cache: KvCache,
    rng: StdRng,
    generated: Vec<u32>,
    /// Bytes of the decoded text already sent.
    sent: usize,
    /// The token to feed at the next step.
    next: u32,
    started: Instant,
}

struct Scheduler<'a> {
    lm: &'a LanguageModel,
    monitor: Option<DriftMonitor>,
    limits: EngineLimits,
    metrics: &'a Metrics,
    waiting: VecDeque<Request>,
    running: Vec<Sequence>,
}

/// Runs `model` (a prefill or a decode step), turning a panic into the
/// error of the requests `what` served, logged and counted.
fn caught<T>(
    metrics: &Metrics,
    what: &str,
    model: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(model)).unwrap_or_else(|panic| {
        metrics.model_panics.inc();
        let message = format!("the model panicked on {what}: {}", panic_message(&*panic));
        tracing::error!("qforge serve: {message}; the engine goes on");
        Err(message)
    })
}

fn cost(r: &Request) -> usize {
    r.prompt.len() + r.max_tokens
}

impl Scheduler<'_> {
    fn run(mut self, requests: &mpsc::Receiver<Request>) {
        loop {
            // Idle: sleep until a request comes (or the server is gone).
            if self.running.is_empty() && self.waiting.is_empty() {
                match requests.recv() {
                    Ok(r) => self.waiting.push_back(r),
                    Err(_) => return,
                }
            }
            while let Ok(r) = requests.try_recv() {
                self.waiting.push_back(r);
            }
            // Requests whose client stopped waiting (the queue timeout, a
            // hang-up) leave now, wherever they are in the queue: behind a
            // request that waits for KV budget they would pile up.
            let before = self.waiting.len();
            self.waiting.retain(|r| !r.events.is_closed());
            self.metrics
                .queue_depth
                .dec_by((before - self.waiting.len()) as i64);
            self.admit();
            self.step();
        }
    }

    fn observer(&mut self) -> Option<&mut dyn Observer> {
        DriftMonitor::observer_for_next(self.monitor.as_mut())
    }

    /// Starts waiting requests, oldest first, while the budget allows.
    fn admit(&mut self) {
        while self.running.len() < self.limits.max_sequences {
            let Some(front) = self.waiting.front() else {
                break;
            };
            if front.events.is_closed() {
                self.metrics.queue_depth.dec();
                self.waiting.pop_front();
                continue;
            }
            if self.reserved() + cost(front) > self.limits.kv_budget_tokens {
                // First come, first served: later requests wait too.
                break;
            }
            let Some(mut request) = self.waiting.pop_front() else {
                break;
            };
            self.metrics.queue_depth.dec();
            if let Some(admitted) = request.admitted.take() {
                let _ = admitted.send(());
            }
            self.prefill(request);
        }
        self.publish();
    }

    fn prefill(&mut self, request: Request) {
        let lm = self.lm;
        let mut cache = lm.model.new_cache();
        let started = Instant::now();
        #[cfg(test)]
        if request.stop.iter().any(|s| s == FAULT_EXIT) {
            panic!("injected fault outside the model");
        }
        let metrics = self.metrics;
        let observer = self.observer();
        let mut rng = StdRng::seed_from_u64(request.seed);
        let first = caught(metrics, "this prompt", || {
            #[cfg(test)]
            if request.stop.iter().any(|s| s == FAULT_PANIC) {
                panic!("injected fault");
            }
            lm.model
                .forward(
                    std::slice::from_ref(&request.prompt),
                    Some(&mut cache),
                    observer,
                    Logits::Last,
                )
                .and_then(|l| Ok(l.flatten_all()?.to_vec1::<f32>()?))
                .and_then(|l| sample(&l, request.temperature, &mut rng))
                .map_err(|e| e.to_string())
        });
        match first {
            Ok(token) => {
                self.metrics
                    .prompt_tokens
                    .inc_by(request.prompt.len() as u64);
                self.metrics
                    .time_to_first_token
                    .observe(started.elapsed().as_secs_f64());
                let mut sequence = Sequence {
                    request,
                    cache,
                    rng,
                    generated: Vec::new(),
                    sent: 0,
                    next: token,
                    started,
                };
                if !self.accept(&mut sequence, token) {
                    self.running.push(sequence);
                }
            }
            Err(message) => {
                let _ = request.events.send(Event::Failed(message));
            }
        }
    }

    /// Advances every running sequence by one token.
    fn step(&mut self) {
        if self.running.is_empty() {
            return;
        }
        // Clients that hung up free their place now.
        self.running.retain(|s| !s.request.events.is_closed());
        if self.running.is_empty() {
            self.publish();
            return;
        }
        let tokens: Vec<u32> = self.running.iter().map(|s| s.next).collect();
        self.metrics.batch_rows.observe(tokens.len() as f64);
        let mut running = std::mem::take(&mut self.running);
        let lm = self.lm;
        let metrics = self.metrics;
        let logits = {
            let observer = self.observer();
            let mut caches: Vec<&mut KvCache> = running.iter_mut().map(|s| &mut s.cache).collect();
            caught(metrics, "this decode step", || {
                lm.model
                    .step(&mut caches, &tokens, observer)
                    .and_then(|l| Ok(l.to_vec2::<f32>()?))
                    .map_err(|e| e.to_string())
            })
        };
        match logits {
            Ok(rows) => {
                for (mut sequence, row) in running.into_iter().zip(rows) {
                    let token = sample(&row, sequence.request.temperature, &mut sequence.rng);
                    let finished = match token {
                        Ok(token) => {
                            sequence.next = token;
                            self.accept(&mut sequence, token)
                        }
                        Err(e) => {
                            let _ = sequence.request.events.send(Event::Failed(e.to_string()));
                            true
                        }
                    };
                    if !finished {
                        self.running.push(sequence);
                    }
                }
            }
            // The sequences go, and their caches (which a panic may have
            // left half-written) with them.
            Err(message) => {
                for sequence in running {
                    let _ = sequence.request.events.send(Event::Failed(message.clone()));
                }
            }
        }
        self.publish();
    }

    /// Takes `token` into `sequence` and sends the text it completes;
    /// returns whether the sequence is finished (its `Done` sent).
    fn accept(&self, sequence: &mut Sequence, token: u32) -> bool {
        let eos = self.lm.text.tokenizer.eos.contains(&token);
        if !eos {
            sequence.generated.push(token);
            self.metrics.generated_tokens.inc();
        }
        let text = self
            .lm
            .text
            .tokenizer
            .decode(&sequence.generated)
            .unwrap_or_default();
        let request = &sequence.request;
        let stop_at = request
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min();
        let length = sequence.generated.len() >= request.max_tokens;
        let finish = match (eos || stop_at.is_some(), length) {
            (true, _) => Some(FinishReason::Stop),
            (false, true) => Some(FinishReason::Length),
            (false, false) => None,
        };
        // While running, hold back what may still become a stop string or
        // an incomplete UTF-8 character.
        let end = match (finish, stop_at) {
            (_, Some(at)) => at,
            (Some(_), None) => text.len(),
            (None, None) => {
                let hold = request
                    .stop
                    .iter()
                    .map(|s| s.len().saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                let mut end = text.len().saturating_sub(hold);
                if text.ends_with('\u{FFFD}') {
                    end = end.min(text.len() - '\u{FFFD}'.len_utf8());
                }
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                end
            }
        };
        if end > sequence.sent {
            let _ = request
                .events
                .send(Event::Text(text[sequence.sent..end].to_owned()));
            sequence.sent = end;
        }
        if let Some(finish_reason) = finish {
            self.metrics
                .completion_duration
                .observe(sequence.started.elapsed().as_secs_f64());
            let _ = request.events.send(Event::Done {
                finish_reason,
                prompt_tokens: request.prompt.len(),
                completion_tokens: sequence.generated.len(),
            });
            if let Some(finished) = sequence.request.finished.take() {
                let _ = finished.send(sequence.generated.clone());
            }
            return true;
        }
        false
    }

    /// KV positions reserved by the running sequences.
    fn reserved(&self) -> usize {
        self.running.iter().map(|s| cost(&s.request)).sum()
    }

    fn publish(&self) {
        self.metrics
            .running_sequences
            .set(self.running.len() as i64);
        self.metrics.kv_reserved_tokens.set(self.reserved() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::{FAULT_EXIT, FAULT_PANIC};
    use crate::testing::TestServer;

    fn completion(stop: &str) -> String {
        serde_json::json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stop": [stop]})
            .to_string()
    }

    #[test]
    fn a_panic_in_the_model_fails_its_request_and_the_engine_goes_on() {
        let server = TestServer::language_model();
        let (status, body) = server.request("POST", "/v1/completions", &completion(FAULT_PANIC));
        assert_eq!(status, 500, "{body}");
        assert!(
            body.contains("the model panicked on this prompt: injected fault"),
            "{body}"
        );
        let (status, body) = server.request("POST", "/v1/completions", &completion("\n\n"));
        assert_eq!(status, 200, "{body}");
        assert_eq!(server.request("GET", "/ready", "").0, 200);
        let (_, metrics) = server.request("GET", "/metrics", "");
        assert!(metrics.contains("qforge_model_panics_total 1"), "{metrics}");
    }

    #[test]
    fn once_the_engine_has_died_ready_answers_503_and_the_server_stays_up() {
        let server = TestServer::language_model();
        let (status, body) = server.request("POST", "/v1/completions", &completion(FAULT_EXIT));
        assert_eq!(status, 503, "{body}");
        server.wait_for_status("/ready", 503);
        let (status, body) = server.request("POST", "/v1/completions", &completion("\n\n"));
        assert_eq!(status, 503, "{body}");
        assert_eq!(server.request("GET", "/health", "").0, 200);
    }
}
