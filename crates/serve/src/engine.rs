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

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use qforge_model::lm::sample;
use qforge_model::{KvCache, LanguageModel, Logits, Observer};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use crate::drift::DriftMonitor;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

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
            .build()
            .map_err(|e| Error::Start(format!("the engine's thread pool: {e}")))?;
        let (queue, requests) = mpsc::channel::<Request>();
        let thread_metrics = Arc::clone(&metrics);
        // The scheduler runs on one of the pool's threads, so the products
        // it starts stay in that pool.
        pool.spawn(move || {
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
        Ok(Self { queue, metrics })
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
            let request = self.waiting.pop_front().expect("front exists");
            self.metrics.queue_depth.dec();
            self.prefill(request);
        }
        self.publish();
    }

    fn prefill(&mut self, request: Request) {
        let lm = self.lm;
        let mut cache = lm.model.new_cache();
        let started = Instant::now();
        let observer = self.observer();
        let logits = lm
            .model
            .forward(
                std::slice::from_ref(&request.prompt),
                Some(&mut cache),
                observer,
                Logits::Last,
            )
            .and_then(|l| Ok(l.flatten_all()?.to_vec1::<f32>()?));
        let mut rng = StdRng::seed_from_u64(request.seed);
        let first = logits.and_then(|l| sample(&l, request.temperature, &mut rng));
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
            Err(e) => {
                let _ = request.events.send(Event::Failed(e.to_string()));
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
        let logits = {
            let observer = self.observer();
            let mut caches: Vec<&mut KvCache> = running.iter_mut().map(|s| &mut s.cache).collect();
            lm.model
                .step(&mut caches, &tokens, observer)
                .and_then(|l| Ok(l.to_vec2::<f32>()?))
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
            Err(e) => {
                for sequence in running {
                    let _ = sequence.request.events.send(Event::Failed(e.to_string()));
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
