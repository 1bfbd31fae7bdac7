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
//! Prompts are prefilled in chunks (as vLLM's and llama-server's are): each
//! iteration gives at most `prefill_chunk` prompt tokens to the sequences in
//! prefill, round robin, before the decode step. So a long prompt delays
//! the running sequences by at most one chunk per token, a short prompt
//! that arrives behind a long one starts within an iteration or two, and a
//! prefill whose client has hung up is dropped at its next chunk.
//!
//! A request hears when it is admitted (`Request::admitted`): the server's
//! timeout bounds the wait in the queue, not the generation, which
//! `max_tokens` bounds. A panic in the model fails the requests it touched
//! (one prefill, or the batch of one step), is logged and counted
//! (`qforge_model_panics_total`), and the engine goes on; the model is only
//! read, and a failed step's caches are dropped with its sequences. Should
//! the engine's thread end all the same, [`Engine::alive`] says so and
//! `/ready` turns 503.
//!
//! A reload ([`Engine::swap`]) stops admitting, lets the admitted sequences
//! finish on the weights they started with, swaps, and admits again: a
//! completion is computed by one model version from its first token to its
//! last (the version its admission notice names), and the requests still
//! queued run on the new weights.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use qforge_model::lm::{TokenLogProb, sample, token_log_prob};
use qforge_model::{Decoder, KvCache, LanguageModel, Logits};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rayon::prelude::*;
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
    /// The next piece of text, with the tokens generated since the previous
    /// piece and their log-probabilities (when the request asks for them).
    /// A piece may be empty when text is held back, and is for a model
    /// without a tokenizer (which sends one piece per token).
    Text {
        /// The text.
        text: String,
        /// The token ids, in order (a stop string's included; the end of
        /// sequence not).
        tokens: Vec<u32>,
        /// One entry per token, in order.
        log_probs: Vec<TokenLogProb>,
    },
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
    /// `Some(k)`: report each generated token's log-probability (the end
    /// of sequence's included) with the `k` likeliest alternatives.
    pub log_probs: Option<usize>,
    /// Where the events go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// `Some`: take these tokens instead of the drawn ones (the end of
    /// sequence included, if it is one), and end after the last: the
    /// shadow reference scores what INT8 generated.
    pub forced: Option<Vec<u32>>,
    /// Hears what was generated when the request finishes (a shadow
    /// comparison needs it; the client gets text).
    pub finished: Option<oneshot::Sender<Finished>>,
    /// Hears that the request left the queue and its prompt is about to
    /// run, on the model version sent.
    pub admitted: Option<oneshot::Sender<u64>>,
    /// More samples of the same prompt (OpenAI's `n`): the prompt is
    /// prefilled once, then each sibling continues from a copy of its KV
    /// cache with a sampler of its own, as a request of its own with its
    /// seed would.
    pub siblings: Vec<Sibling>,
}

/// Another sample of a request's prompt (see [`Request::siblings`]).
pub struct Sibling {
    /// Seed of this sample's sampler.
    pub seed: u64,
    /// Where its events go; a closed channel cancels this sample.
    pub events: UnboundedSender<Event>,
    /// Hears what it generated when it finishes.
    pub finished: Option<oneshot::Sender<Finished>>,
}

/// What a finished request generated.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The tokens taken, the end of sequence included when it ended the
    /// completion.
    pub tokens: Vec<u32>,
    /// The engine's own draw at each of those positions (the tokens
    /// themselves unless they were forced).
    pub chosen: Vec<u32>,
    /// The log-probability of each token, when the request asked for them.
    pub log_probs: Vec<f64>,
    /// The model version that computed them.
    pub version: u64,
}

/// A copy of a request for another engine (the shadow reference), with the
/// receiving ends of its own event channel (to keep it open) and its finish
/// notice.
pub struct Replay {
    /// The copy.
    pub request: Request,
    /// Its events; dropping this cancels the copy.
    pub events: UnboundedReceiver<Event>,
    /// What it generated, when it finishes.
    pub finished: oneshot::Receiver<Finished>,
}

/// A request's prompt and sampling, for another engine to rerun it.
#[derive(Debug, Clone)]
pub struct Script {
    prompt: Vec<u32>,
    max_tokens: usize,
    temperature: Option<f64>,
    seed: u64,
    stop: Vec<String>,
}

impl Request {
    /// Sequences the request runs: itself and its siblings.
    pub fn samples(&self) -> usize {
        1 + self.siblings.len()
    }

    /// Whether no one waits for any of its samples any more.
    fn abandoned(&self) -> bool {
        self.events.is_closed() && self.siblings.iter().all(|s| s.events.is_closed())
    }

    /// Tells every sample that the request failed.
    fn fail(self, message: &str) {
        let _ = self.events.send(Event::Failed(message.to_owned()));
        for sibling in self.siblings {
            let _ = sibling.events.send(Event::Failed(message.to_owned()));
        }
    }

    /// The prompt and sampling.
    pub fn script(&self) -> Script {
        Script {
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            seed: self.seed,
            stop: self.stop.clone(),
        }
    }
}

impl Script {
    /// The request for another engine, scoring `forced` (log-probabilities
    /// on) instead of generating.
    pub fn scoring(self, forced: Vec<u32>) -> Replay {
        let (events, receiver) = unbounded_channel();
        let (finished, generated) = oneshot::channel();
        Replay {
            request: Request {
                prompt: self.prompt,
                max_tokens: self.max_tokens,
                temperature: self.temperature,
                seed: self.seed,
                stop: self.stop,
                log_probs: Some(0),
                forced: Some(forced),
                events,
                finished: Some(finished),
                admitted: None,
                siblings: Vec::new(),
            },
            events: receiver,
            finished: generated,
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
    /// Threads the engine's decode steps run on.
    pub threads: usize,
    /// Threads a prompt's prefill runs on. Prefill is compute-bound and
    /// gains from every core (a 4 056-token prompt of the INT8 SmolLM2:
    /// 293 tokens/s on one thread, 451–498 on two, `generate`'s 487), where
    /// a decode step on a second thread gained nothing while the HTTP side
    /// needed the core.
    pub prefill_threads: usize,
    /// Most prompt tokens prefilled per iteration, over all sequences.
    pub prefill_chunk: usize,
}

/// What the engine's queue carries.
enum Message {
    Request(Request),
    Swap(Box<Swap>),
}

/// A reload: the model to serve once the admitted sequences are done.
struct Swap {
    lm: LanguageModel,
    monitor: Option<DriftMonitor>,
    version: u64,
    /// Hears that the new model serves.
    done: oneshot::Sender<()>,
}

/// The sending end of the engine's queue.
#[derive(Clone)]
pub struct Engine {
    queue: mpsc::Sender<Message>,
    metrics: Arc<Metrics>,
    /// False once the scheduler has ended.
    alive: Arc<AtomicBool>,
}

impl Engine {
    /// Starts the engine thread, which owns `lm` (model version 1) and its
    /// drift `monitor`.
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
        let pool = engine_pool("qforge-engine", limits.threads)?;
        let prefill_pool = engine_pool("qforge-prefill", limits.prefill_threads)?;
        let decoder = Decoder::new(limits.threads)
            .map_err(|e| Error::Start(format!("the engine's decode threads: {e}")))?;
        let (queue, messages) = mpsc::channel::<Message>();
        let thread_metrics = Arc::clone(&metrics);
        let alive = Arc::new(AtomicBool::new(true));
        let scheduler_alive = Alive(Arc::clone(&alive));
        // The scheduler runs on one of the pool's threads, so the products
        // it starts stay in that pool.
        pool.spawn(move || {
            let _alive = scheduler_alive;
            Scheduler {
                lm,
                version: 1,
                swap: None,
                monitor,
                limits,
                prefill_pool,
                metrics: &thread_metrics,
                waiting: VecDeque::new(),
                prefilling: VecDeque::new(),
                running: Vec::new(),
                decoder,
            }
            .run(&messages)
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
        let sent = self.queue.send(Message::Request(request)).is_ok();
        if !sent {
            self.metrics.queue_depth.dec();
        }
        sent
    }

    /// Queues a swap to `lm` (watched by `monitor`) as model `version` (see
    /// the module docs); the receiver hears when the new model serves.
    /// `None` when the engine thread is gone.
    pub fn swap(
        &self,
        lm: LanguageModel,
        monitor: Option<DriftMonitor>,
        version: u64,
    ) -> Option<oneshot::Receiver<()>> {
        let (done, swapped) = oneshot::channel();
        let swap = Swap {
            lm,
            monitor,
            version,
            done,
        };
        self.queue.send(Message::Swap(Box::new(swap))).ok()?;
        Some(swapped)
    }
}

/// A sequence being prefilled or generated.
struct Sequence {
    request: Request,
    cache: KvCache,
    rng: StdRng,
    /// Prompt tokens in the cache.
    prefilled: usize,
    generated: Vec<u32>,
    /// Bytes of the decoded text already sent.
    sent: usize,
    /// Tokens of `generated` already sent.
    sent_tokens: usize,
    /// Log-probabilities of the tokens taken and not yet sent.
    pending: Vec<TokenLogProb>,
    /// The draw at every position so far.
    chosen: Vec<u32>,
    /// The log-probability of every token taken so far (when asked for).
    scored: Vec<f64>,
    /// The token to feed at the next step.
    next: u32,
    started: Instant,
}

impl Sequence {
    /// A sequence for `request` on `cache`, nothing drawn yet, its sampler
    /// seeded with the request's seed; its request arrived at `started`.
    fn new(request: Request, cache: KvCache, started: Instant) -> Self {
        Sequence {
            cache,
            rng: StdRng::seed_from_u64(request.seed),
            request,
            prefilled: 0,
            generated: Vec::new(),
            sent: 0,
            sent_tokens: 0,
            pending: Vec::new(),
            chosen: Vec::new(),
            scored: Vec::new(),
            next: 0,
            started,
        }
    }

    /// Draws the next token from one position's logits (or takes the
    /// forced one), noting its log-probability when the request asks for
    /// them.
    fn draw(&mut self, logits: &[f32]) -> qforge_model::Result<u32> {
        let temperature = self.request.temperature;
        let drawn = sample(logits, temperature, &mut self.rng)?;
        let token = match &self.request.forced {
            // `accept` ends the sequence at the last forced token.
            Some(forced) => *forced.get(self.chosen.len()).ok_or_else(|| {
                qforge_model::Error::Shape("no forced token is left to take".into())
            })?,
            None => drawn,
        };
        self.chosen.push(drawn);
        if let Some(top) = self.request.log_probs {
            let entry = token_log_prob(logits, temperature, token, top);
            self.scored.push(entry.log_prob);
            self.pending.push(entry);
        }
        Ok(token)
    }

    /// The sequences of the request's siblings, each with a copy of this
    /// one's cache (its prompt prefilled) and a sampler of its own seed;
    /// a sibling that no one waits for any more is left out.
    fn fork(&mut self) -> Vec<Sequence> {
        let siblings = std::mem::take(&mut self.request.siblings);
        let request = &self.request;
        siblings
            .into_iter()
            .filter(|sibling| !sibling.events.is_closed())
            .map(|sibling| {
                let request = Request {
                    prompt: request.prompt.clone(),
                    max_tokens: request.max_tokens,
                    temperature: request.temperature,
                    seed: sibling.seed,
                    stop: request.stop.clone(),
                    log_probs: request.log_probs,
                    events: sibling.events,
                    forced: request.forced.clone(),
                    finished: sibling.finished,
                    admitted: None,
                    siblings: Vec::new(),
                };
                let mut sequence = Sequence::new(request, self.cache.clone(), self.started);
                sequence.prefilled = self.prefilled;
                sequence
            })
            .collect()
    }

    /// Whether every forced token is taken.
    fn forced_out(&self) -> bool {
        self.request
            .forced
            .as_ref()
            .is_some_and(|forced| self.chosen.len() >= forced.len())
    }
}

struct Scheduler<'a> {
    lm: LanguageModel,
    /// The version of `lm`.
    version: u64,
    /// A reload waiting for the admitted sequences to finish.
    swap: Option<Box<Swap>>,
    monitor: Option<DriftMonitor>,
    limits: EngineLimits,
    /// Where prefills run (`limits.prefill_threads`).
    prefill_pool: rayon::ThreadPool,
    metrics: &'a Metrics,
    waiting: VecDeque<Request>,
    /// Admitted sequences whose prompt is not all in their cache yet, in
    /// the order they get their next chunk.
    prefilling: VecDeque<Sequence>,
    /// Sequences in the decode batch.
    running: Vec<Sequence>,
    /// Steps the running sequences of an all-INT8 model.
    decoder: Decoder,
}

/// A pool of `threads` named `name-i` for the engine's matrix products: its
/// own, so its thread count does not depend on the process-wide one (the
/// HTTP side shares the cores).
fn engine_pool(name: &'static str, threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("{name}-{i}"))
        // Without a handler rayon aborts the process on a panic that leaves
        // a job: the scheduler's job ending is reported (and `/ready` says
        // so) instead.
        .panic_handler(|panic| {
            tracing::error!(
                "qforge serve: the engine stopped: it panicked: {}",
                panic_message(&*panic)
            );
        })
        .build()
        .map_err(|e| Error::Start(format!("the engine's {name} thread pool: {e}")))
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

/// KV positions one sample of a request takes: its prompt and completion.
fn positions(r: &Request) -> usize {
    r.prompt.len() + r.max_tokens
}

/// KV positions a request reserves: each of its samples' (a sibling's cache
/// is a copy).
fn cost(r: &Request) -> usize {
    positions(r) * r.samples()
}

impl Scheduler<'_> {
    fn run(mut self, messages: &mpsc::Receiver<Message>) {
        loop {
            self.swap_when_drained();
            // Idle: sleep until a message comes (or the server is gone).
            if self.idle() {
                match messages.recv() {
                    Ok(m) => self.take(m),
                    Err(_) => return,
                }
            }
            while let Ok(m) = messages.try_recv() {
                self.take(m);
            }
            self.iteration();
        }
    }

    fn take(&mut self, message: Message) {
        match message {
            Message::Request(r) => self.waiting.push_back(r),
            // The server reloads one model at a time; a newer swap would
            // replace an older one still waiting (whose caller then hears
            // that it did not happen).
            Message::Swap(swap) => self.swap = Some(swap),
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.prefilling.is_empty() && self.running.is_empty()
    }

    /// Swaps the model in once no admitted sequence is left on the old one.
    fn swap_when_drained(&mut self) {
        if !(self.prefilling.is_empty() && self.running.is_empty()) {
            return;
        }
        if let Some(swap) = self.swap.take() {
            let Swap {
                lm,
                monitor,
                version,
                done,
            } = *swap;
            self.lm = lm;
            self.monitor = monitor;
            self.version = version;
            let _ = done.send(());
        }
    }

    /// Admits what the budget allows, prefills one chunk, decodes one token.
    fn iteration(&mut self) {
        // Requests whose client stopped waiting (the queue timeout, a
        // hang-up) leave now, wherever they are in the queue: behind a
        // request that waits for KV budget they would pile up.
        let before = self.waiting.len();
        self.waiting.retain(|r| !r.abandoned());
        self.metrics
            .queue_depth
            .dec_by((before - self.waiting.len()) as i64);
        self.admit();
        if Decoder::supports(&self.lm.model) {
            self.advance();
        } else {
            self.prefill();
            self.step();
        }
    }

    /// Starts waiting requests, oldest first, while the budget allows and
    /// no reload waits. A request larger than the whole budget fails at
    /// once instead of waiting forever.
    fn admit(&mut self) {
        while self.swap.is_none() {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let limits = &self.limits;
            let never = (cost(front) > limits.kv_budget_tokens
                || front.samples() > limits.max_sequences)
                .then(|| {
                    format!(
                        "{} sample(s) of {} prompt and {} completion tokens can never run: the engine holds {} sequences and {} KV positions at most",
                        front.samples(),
                        front.prompt.len(),
                        front.max_tokens,
                        limits.max_sequences,
                        limits.kv_budget_tokens
                    )
                });
            if front.abandoned() || never.is_some() {
                self.metrics.queue_depth.dec();
                if let (Some(request), Some(message)) = (self.waiting.pop_front(), never) {
                    request.fail(&message);
                }
                continue;
            }
            if self.sequences() + front.samples() > self.limits.max_sequences
                || self.reserved() + cost(front) > self.limits.kv_budget_tokens
            {
                // First come, first served: later requests wait too.
                break;
            }
            let Some(mut request) = self.waiting.pop_front() else {
                break;
            };
            self.metrics.queue_depth.dec();
            if let Some(admitted) = request.admitted.take() {
                let _ = admitted.send(self.version);
            }
            // The cache takes its whole reservation now: a long sequence
            // never reallocates (and copies) what it has cached, and memory
            // is what the KV budget says from admission on (each sibling's
            // copy of this cache holds the same room).
            let mut cache = self.lm.model.new_cache();
            cache.reserve(positions(&request));
            self.prefilling
                .push_back(Sequence::new(request, cache, Instant::now()));
        }
        self.publish();
    }

    /// Gives at most `prefill_chunk` prompt tokens to the sequences in
    /// prefill, the front first; one left unfinished goes to the back, so
    /// a short prompt behind a long one gets the next chunk. A sequence
    /// whose prompt is in is sampled its first token and joins the decode
    /// batch.
    fn prefill(&mut self) {
        self.drop_abandoned_prefills();
        let mut budget = self.limits.prefill_chunk.max(1);
        while budget > 0
            && let Some(mut sequence) = self.prefilling.pop_front()
        {
            let take = (sequence.request.prompt.len() - sequence.prefilled).min(budget);
            budget -= take;
            match self.prefill_chunk(&mut sequence, take) {
                Ok(None) => self.prefilling.push_back(sequence),
                Ok(Some(logits)) => {
                    self.metrics
                        .time_to_first_token
                        .observe(sequence.started.elapsed().as_secs_f64());
                    let siblings = sequence.fork();
                    for sample in std::iter::once(sequence).chain(siblings) {
                        self.start_decoding(sample, &logits);
                    }
                }
                // The sequence goes, and its cache (which a panic may have
                // left half-written) with it.
                Err(message) => sequence.request.fail(&message),
            }
        }
        self.publish();
    }

    /// Drops the sequences in prefill whose clients have all gone, counted
    /// as cancelled.
    fn drop_abandoned_prefills(&mut self) {
        let before = self.prefilling.len();
        self.prefilling.retain(|s| !s.request.abandoned());
        self.metrics
            .cancelled_prefills
            .inc_by((before - self.prefilling.len()) as u64);
    }

    /// Draws the first token of `sequence`, whose prompt is in, from the
    /// prompt's last `logits`; it joins the decode batch unless that token
    /// ends it.
    fn start_decoding(&mut self, mut sequence: Sequence, logits: &[f32]) {
        if sequence.request.events.is_closed() {
            return;
        }
        let drawn = sequence.draw(logits);
        self.take_draws(vec![sequence], vec![drawn]);
    }

    /// Takes each sequence's drawn token (sending its text, or its
    /// failure); those not finished join the decode batch.
    fn take_draws(&mut self, sequences: Vec<Sequence>, drawn: Vec<qforge_model::Result<u32>>) {
        for (mut sequence, token) in sequences.into_iter().zip(drawn) {
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

    /// One pass of the batched INT8 decoder for everything in flight: the
    /// next prompt chunks of the sequences in prefill (at most
    /// `prefill_chunk` tokens over all of them, the front first, as
    /// [`Self::prefill`] gives them) and one token of every running
    /// sequence, so the weights are read once for both. A sequence whose
    /// prompt is then all in draws its first token (its siblings fork) and
    /// decodes from the next pass on.
    fn advance(&mut self) {
        self.drop_abandoned_prefills();
        // Clients that hung up free their place now.
        self.running.retain(|s| !s.request.events.is_closed());
        let mut filling = Vec::new();
        let mut budget = self.limits.prefill_chunk.max(1);
        while budget > 0
            && let Some(sequence) = self.prefilling.pop_front()
        {
            let take = (sequence.request.prompt.len() - sequence.prefilled).min(budget);
            budget -= take;
            filling.push((sequence, take));
        }
        if filling.is_empty() && self.running.is_empty() {
            self.publish();
            return;
        }
        let mut tokens = Vec::new();
        let mut lengths = Vec::with_capacity(filling.len() + self.running.len());
        for (sequence, take) in &filling {
            let start = sequence.prefilled;
            tokens.extend_from_slice(&sequence.request.prompt[start..start + take]);
            lengths.push(*take);
        }
        tokens.extend(self.running.iter().map(|s| s.next));
        lengths.extend(std::iter::repeat_n(1, self.running.len()));
        if !self.running.is_empty() {
            self.metrics.batch_rows.observe(self.running.len() as f64);
        }
        let mut running = std::mem::take(&mut self.running);
        let (lm, metrics, decoder) = (&self.lm, self.metrics, &mut self.decoder);
        let observer = DriftMonitor::observer_for_next(self.monitor.as_mut());
        let mut caches: Vec<&mut KvCache> = filling
            .iter_mut()
            .map(|(s, _)| &mut s.cache)
            .chain(running.iter_mut().map(|s| &mut s.cache))
            .collect();
        let (rows, chunks) = (&tokens, &lengths);
        let passed = caught(metrics, "this engine step", move || {
            decoder
                .step_chunks(&lm.model, &mut caches, rows, chunks, observer)
                .map_err(|e| e.to_string())
        });
        let logits = match passed {
            Ok(logits) => logits,
            // The sequences go, and their caches (which a panic may have
            // left half-written) with them.
            Err(message) => {
                for (sequence, _) in filling {
                    sequence.request.fail(&message);
                }
                for sequence in running {
                    let _ = sequence.request.events.send(Event::Failed(message.clone()));
                }
                self.publish();
                return;
            }
        };
        let vocab = logits.len() / lengths.len();
        let (prompt_rows, decode_rows) = logits.split_at(filling.len() * vocab);
        // Every draw reads its own row with its own sampler: in parallel.
        let drawn: Vec<_> = running
            .par_iter_mut()
            .zip(decode_rows.par_chunks_exact(vocab))
            .map(|(sequence, row)| sequence.draw(row))
            .collect();
        let mut starting = Vec::new();
        let mut first_draws = Vec::new();
        for ((mut sequence, take), row) in filling.into_iter().zip(prompt_rows.chunks_exact(vocab))
        {
            sequence.prefilled += take;
            metrics.prompt_tokens.inc_by(take as u64);
            if sequence.prefilled < sequence.request.prompt.len() {
                self.prefilling.push_back(sequence);
                continue;
            }
            metrics
                .time_to_first_token
                .observe(sequence.started.elapsed().as_secs_f64());
            let siblings = sequence.fork();
            for mut sample in std::iter::once(sequence).chain(siblings) {
                if !sample.request.events.is_closed() {
                    first_draws.push(sample.draw(row));
                    starting.push(sample);
                }
            }
        }
        self.take_draws(running, drawn);
        self.take_draws(starting, first_draws);
        self.publish();
    }

    /// Runs the next `take` prompt tokens of `sequence` into its cache;
    /// after the last, returns the logits of the prompt's last position.
    fn prefill_chunk(
        &mut self,
        sequence: &mut Sequence,
        take: usize,
    ) -> std::result::Result<Option<Vec<f32>>, String> {
        #[cfg(test)]
        if sequence.request.stop.iter().any(|s| s == FAULT_EXIT) {
            panic!("injected fault outside the model");
        }
        let lm = &self.lm;
        let metrics = self.metrics;
        let monitor = self.monitor.as_mut();
        let chunk = sequence.prefilled..sequence.prefilled + take;
        let last = chunk.end == sequence.request.prompt.len();
        let tokens = sequence.request.prompt[chunk.clone()].to_vec();
        let first = caught(metrics, "this prompt", || {
            #[cfg(test)]
            if sequence.request.stop.iter().any(|s| s == FAULT_PANIC) {
                panic!("injected fault");
            }
            let cache = &mut sequence.cache;
            // On the prefill pool's threads; this one waits (a panic there
            // comes back here).
            let logits = self
                .prefill_pool
                .install(|| {
                    let observer = DriftMonitor::observer_for_next(monitor);
                    lm.model
                        .forward(&[tokens], Some(cache), observer, Logits::Last)
                })
                .map_err(|e| e.to_string())?;
            if !last {
                return Ok(None);
            }
            logits
                .flatten_all()
                .and_then(|l| l.to_vec1::<f32>())
                .map_err(|e| e.to_string())
                .map(Some)
        })?;
        sequence.prefilled = chunk.end;
        metrics.prompt_tokens.inc_by(take as u64);
        Ok(first)
    }

    /// Advances every running sequence by one token through the tensor
    /// forward (a model with FP layers; an all-INT8 one runs
    /// [`Self::advance`]).
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
        let lm = &self.lm;
        let metrics = self.metrics;
        let logits = {
            let observer = DriftMonitor::observer_for_next(self.monitor.as_mut());
            let mut caches: Vec<&mut KvCache> = running.iter_mut().map(|s| &mut s.cache).collect();
            caught(metrics, "this decode step", || {
                lm.model
                    .step(&mut caches, &tokens, observer)
                    .and_then(|l| Ok(l.flatten_all()?.to_vec1::<f32>()?))
                    .map_err(|e| e.to_string())
            })
        };
        let drawn = logits.map(|logits| {
            // Each sequence draws from its own row with its own sampler, so
            // the draws run in parallel on the engine's pool and stay the
            // same whatever the split.
            let vocab = logits.len() / running.len();
            running
                .par_iter_mut()
                .zip(logits.par_chunks_exact(vocab))
                .map(|(sequence, row)| sequence.draw(row))
                .collect::<Vec<_>>()
        });
        match drawn {
            Ok(drawn) => self.take_draws(running, drawn),
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
        let length = sequence.generated.len() >= request.max_tokens || sequence.forced_out();
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
        // The last tokens and their log-probabilities go out with the finish
        // even when they add no text (the end of sequence, a stop string);
        // a model without a tokenizer sends every token as it comes.
        let unsent = sequence.generated.len() > sequence.sent_tokens;
        let flush = !self.lm.text.tokenizer.reads_text() || finish.is_some();
        if end > sequence.sent || (flush && (unsent || !sequence.pending.is_empty())) {
            let end = end.max(sequence.sent);
            let _ = request.events.send(Event::Text {
                text: text[sequence.sent..end].to_owned(),
                tokens: sequence.generated[sequence.sent_tokens..].to_vec(),
                log_probs: std::mem::take(&mut sequence.pending),
            });
            sequence.sent = end;
            sequence.sent_tokens = sequence.generated.len();
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
                let mut tokens = sequence.generated.clone();
                tokens.extend(eos.then_some(token));
                let _ = finished.send(Finished {
                    tokens,
                    chosen: std::mem::take(&mut sequence.chosen),
                    log_probs: std::mem::take(&mut sequence.scored),
                    version: self.version,
                });
            }
            return true;
        }
        false
    }

    /// Sequences admitted: running, and in prefill with their siblings.
    fn sequences(&self) -> usize {
        let prefilling: usize = self.prefilling.iter().map(|s| s.request.samples()).sum();
        prefilling + self.running.len()
    }

    /// KV positions reserved by the admitted sequences.
    fn reserved(&self) -> usize {
        self.prefilling
            .iter()
            .chain(&self.running)
            .map(|s| cost(&s.request))
            .sum()
    }

    fn publish(&self) {
        self.metrics
            .running_sequences
            .set(self.running.len() as i64);
        self.metrics
            .prefilling_sequences
            .set(self.prefilling.len() as i64);
        self.metrics.kv_reserved_tokens.set(self.reserved() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::ServeOptions;
    use crate::testing::{TestServer, smollm2};

    /// A greedy request for `prompt` and the receiving end of its events.
    fn request(prompt: Vec<u32>, max_tokens: usize) -> (Request, UnboundedReceiver<Event>) {
        let (events, receiver) = unbounded_channel();
        let request = Request {
            prompt,
            max_tokens,
            temperature: None,
            seed: 0,
            stop: Vec::new(),
            log_probs: None,
            forced: None,
            events,
            finished: None,
            admitted: None,
            siblings: Vec::new(),
        };
        (request, receiver)
    }

    /// Token ids that are no text in particular, `len` of them.
    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32)
            .map(|i| 200 + (i * 7 + salt) % 5000)
            .collect()
    }

    fn scheduler(lm: LanguageModel, metrics: &Metrics, chunk: usize) -> Scheduler<'_> {
        Scheduler {
            lm,
            version: 1,
            swap: None,
            monitor: None,
            limits: EngineLimits {
                max_sequences: 4,
                kv_budget_tokens: 4096,
                threads: 1,
                prefill_threads: 2,
                prefill_chunk: chunk,
            },
            prefill_pool: engine_pool("test-prefill", 2).unwrap(),
            metrics,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            running: Vec::new(),
            decoder: Decoder::new(1).unwrap(),
        }
    }

    /// Every event sent so far; `true` once the last is `Done` or `Failed`.
    fn drain(events: &mut UnboundedReceiver<Event>, into: &mut Vec<Event>) -> bool {
        while let Ok(event) = events.try_recv() {
            into.push(event);
        }
        matches!(into.last(), Some(Event::Done { .. } | Event::Failed(_)))
    }

    /// The completion of `prompt` by a scheduler prefilling `chunk` tokens
    /// an iteration.
    fn complete(lm: &LanguageModel, prompt: &[u32], chunk: usize) -> Vec<Event> {
        let metrics = Metrics::default();
        let mut scheduler = scheduler(lm.clone(), &metrics, chunk);
        let (request, mut receiver) = request(prompt.to_vec(), 8);
        scheduler.waiting.push_back(request);
        let mut events = Vec::new();
        while !drain(&mut receiver, &mut events) {
            scheduler.iteration();
        }
        assert_eq!(metrics.prompt_tokens.get(), prompt.len() as u64);
        events
    }

    /// The events of a request for `prompt` sampled at temperature 1 with
    /// one sample per seed (the first the request's, the rest its
    /// siblings'), and the prompt tokens the engine prefilled.
    fn sampled(lm: &LanguageModel, prompt: &[u32], seeds: &[u64]) -> (Vec<Vec<Event>>, u64) {
        let metrics = Metrics::default();
        let mut scheduler = scheduler(lm.clone(), &metrics, 1024);
        let (mut request, receiver) = request(prompt.to_vec(), 6);
        request.temperature = Some(1.0);
        request.seed = seeds[0];
        request.log_probs = Some(0);
        let mut receivers = vec![receiver];
        for &seed in &seeds[1..] {
            let (events, receiver) = unbounded_channel();
            request.siblings.push(Sibling {
                seed,
                events,
                finished: None,
            });
            receivers.push(receiver);
        }
        scheduler.waiting.push_back(request);
        let mut events = vec![Vec::new(); seeds.len()];
        loop {
            let done: Vec<bool> = receivers
                .iter_mut()
                .zip(&mut events)
                .map(|(receiver, seen)| drain(receiver, seen))
                .collect();
            if done.iter().all(|&d| d) {
                return (events, metrics.prompt_tokens.get());
            }
            scheduler.iteration();
        }
    }

    /// Siblings share their request's prefill (its prompt runs once) and
    /// each draws what a request of its own with its seed draws, tokens and
    /// log-probabilities to the bit (INT8: batch-invariant rows); a request
    /// with more samples than the engine holds fails instead of waiting.
    #[test]
    fn siblings_share_the_prefill_and_draw_as_requests_of_their_own() {
        let lm = smollm2();
        let lm = LanguageModel {
            model: lm
                .model
                .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
                .unwrap(),
            ..lm
        };
        let prompt = prompt(40, 3);
        let seeds = [5, 6, 7];
        let (together, prefilled) = sampled(&lm, &prompt, &seeds);
        assert_eq!(prefilled, prompt.len() as u64);
        for (seed, theirs) in seeds.iter().zip(&together) {
            let (alone, _) = sampled(&lm, &prompt, &[*seed]);
            assert_eq!(&alone[0], theirs, "seed {seed}");
            assert!(matches!(theirs.last(), Some(Event::Done { .. })));
        }
        assert!(together[0] != together[1] || together[1] != together[2]);

        // The test scheduler holds 4 sequences: 5 samples can never run.
        let (events, _) = sampled(&lm, &prompt, &[1, 2, 3, 4, 5]);
        for seen in events {
            match seen.as_slice() {
                [Event::Failed(message)] => assert!(message.contains("can never run"), "{message}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_prompt_prefilled_in_chunks_completes_as_one_prefilled_at_once() {
        let lm = smollm2();
        let prompt = prompt(120, 0);
        let whole = complete(&lm, &prompt, 1024);
        assert!(
            matches!(
                whole.last(),
                Some(Event::Done {
                    completion_tokens: 8,
                    ..
                })
            ),
            "{whole:?}"
        );
        // 120 = 3 × 32 + 24, and chunks of 7 end nowhere near a power of two.
        for chunk in [32, 7] {
            assert_eq!(complete(&lm, &prompt, chunk), whole, "chunks of {chunk}");
        }
    }

    #[test]
    fn a_short_prompt_behind_a_long_one_finishes_while_the_long_one_prefills() {
        let lm = smollm2();
        let metrics = Metrics::default();
        let chunk = 16;
        let mut scheduler = scheduler(lm, &metrics, chunk);
        let (long, mut long_events) = request(prompt(320, 1), 1);
        let (short, mut short_events) = request(prompt(9, 2), 3);
        scheduler.waiting.extend([long, short]);
        let (mut long_seen, mut short_seen) = (Vec::new(), Vec::new());
        let mut short_finished = false;
        let mut prefilled = 0;
        loop {
            scheduler.iteration();
            // No iteration prefills more than one chunk, over all prompts.
            let now = metrics.prompt_tokens.get();
            assert!(
                now - prefilled <= chunk as u64,
                "{} tokens in one iteration",
                now - prefilled
            );
            prefilled = now;
            let long_done = drain(&mut long_events, &mut long_seen);
            if !short_finished && drain(&mut short_events, &mut short_seen) {
                short_finished = true;
                assert!(
                    long_seen.is_empty() && scheduler.prefilling.len() == 1,
                    "the short request waited for the long prefill"
                );
            }
            if long_done {
                break;
            }
        }
        assert!(short_finished);
        assert!(
            matches!(
                short_seen.last(),
                Some(Event::Done {
                    prompt_tokens: 9,
                    ..
                })
            ),
            "{short_seen:?}"
        );
        assert!(
            matches!(
                long_seen.last(),
                Some(Event::Done {
                    prompt_tokens: 320,
                    ..
                })
            ),
            "{long_seen:?}"
        );
    }

    #[test]
    fn a_prompt_over_max_prompt_tokens_is_refused_before_admission() {
        let server = TestServer::language_model_with(ServeOptions {
            max_prompt_tokens: 16,
            ..crate::testing::options()
        });
        let long = serde_json::json!({"prompt": "one two three ".repeat(10), "max_tokens": 1});
        let (status, body) = server.request("POST", "/v1/completions", &long.to_string());
        assert_eq!(status, 400, "{body}");
        assert!(
            body.contains("prompts of at most 16 tokens (--max-prompt-tokens 16"),
            "{body}"
        );
        let (_, metrics) = server.request("GET", "/metrics", "");
        assert!(
            metrics.contains("qforge_prompt_tokens_total 0"),
            "{metrics}"
        );
        let short = serde_json::json!({"prompt": "one two", "max_tokens": 1});
        let (status, body) = server.request("POST", "/v1/completions", &short.to_string());
        assert_eq!(status, 200, "{body}");
    }

    #[test]
    fn a_prefill_whose_client_has_gone_is_dropped_at_the_next_chunk() {
        let lm = smollm2();
        let metrics = Metrics::default();
        let mut scheduler = scheduler(lm, &metrics, 32);
        let (long, events) = request(prompt(320, 3), 4);
        scheduler.waiting.push_back(long);
        scheduler.iteration();
        assert_eq!(metrics.prefilling_sequences.get(), 1);
        assert_eq!(metrics.prompt_tokens.get(), 32);
        drop(events);
        scheduler.iteration();
        assert!(scheduler.idle());
        assert_eq!(metrics.cancelled_prefills.get(), 1);
        assert_eq!(
            metrics.prompt_tokens.get(),
            32,
            "no chunk ran after the hang-up"
        );
        assert_eq!(metrics.prefilling_sequences.get(), 0);
        assert_eq!(metrics.kv_reserved_tokens.get(), 0);
    }

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

    #[test]
    fn a_swap_waits_for_the_admitted_sequences_and_the_queued_run_on_the_new_version() {
        let lm = smollm2();
        let metrics = Metrics::default();
        let mut scheduler = scheduler(lm.clone(), &metrics, 64);
        let (mut first, mut first_events) = request(prompt(8, 1), 6);
        let (finished, mut first_finished) = oneshot::channel();
        first.finished = Some(finished);
        scheduler.take(Message::Request(first));
        scheduler.iteration();
        assert_eq!(scheduler.running.len(), 1);

        let (done, mut swapped) = oneshot::channel();
        scheduler.take(Message::Swap(Box::new(Swap {
            lm,
            monitor: None,
            version: 2,
            done,
        })));
        let (mut second, mut second_events) = request(prompt(8, 2), 2);
        let (admitted, mut admission) = oneshot::channel();
        second.admitted = Some(admitted);
        scheduler.take(Message::Request(second));

        // The admitted sequence finishes on version 1; nothing is admitted
        // and nothing swapped meanwhile.
        let mut seen = Vec::new();
        for _ in 0..32 {
            scheduler.swap_when_drained();
            if drain(&mut first_events, &mut seen) {
                break;
            }
            assert!(
                swapped.try_recv().is_err(),
                "swapped under a running sequence"
            );
            assert!(admission.try_recv().is_err(), "admitted during a reload");
            scheduler.iteration();
        }
        assert!(matches!(seen.last(), Some(Event::Done { .. })), "{seen:?}");
        assert_eq!(first_finished.try_recv().unwrap().version, 1);

        scheduler.swap_when_drained();
        assert!(swapped.try_recv().is_ok());
        assert_eq!(scheduler.version, 2);
        scheduler.iteration();
        assert_eq!(admission.try_recv(), Ok(2));
        let mut seen = Vec::new();
        for _ in 0..32 {
            if drain(&mut second_events, &mut seen) {
                break;
            }
            scheduler.iteration();
        }
        assert!(matches!(seen.last(), Some(Event::Done { .. })), "{seen:?}");
    }
}
