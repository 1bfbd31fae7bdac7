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
//!
//! This file holds the handle the server and Python hold ([`Engine`]: start,
//! submit, swap) and the engine's limits; what a request is and what it
//! hears back is in `request.rs`, one sequence's state and sampling in
//! `sequence.rs`, and the thread that batches them in `scheduler/`.

mod request;
mod scheduler;
mod sequence;

pub use request::{Event, FinishReason, Finished, Replay, Request, Script, Sibling};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use qforge_decode::Decoder;
use qforge_model::LanguageModel;
use tokio::sync::oneshot;

use crate::batcher::{Alive, panic_message};
use crate::drift::DriftMonitor;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::swap::Swap;
use scheduler::Scheduler;

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

impl EngineLimits {
    /// Refuses limits no engine can run with.
    pub fn check(&self) -> Result<()> {
        if self.max_sequences == 0
            || self.kv_budget_tokens < 2
            || self.prefill_chunk == 0
            || self.threads == 0
            || self.prefill_threads == 0
        {
            return Err(Error::Options(
                "the engine needs at least 1 sequence, a KV budget of at least 2 tokens, a prefill chunk of at least 1 token and at least 1 thread for decode and for prefill".into(),
            ));
        }
        Ok(())
    }
}

/// KV positions a request reserves against [`EngineLimits::kv_budget_tokens`]:
/// its prompt once (its `samples` fork from the prompt's cache and share
/// its positions) and each sample's completion.
pub(crate) fn kv_positions(prompt: usize, max_tokens: usize, samples: usize) -> usize {
    prompt.saturating_add(max_tokens.saturating_mul(samples))
}

/// What the engine's queue carries.
enum Message {
    Request(Request),
    /// A reload: the model to serve once the admitted sequences are done.
    Swap(Box<Swap<LanguageModel>>),
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
        limits.check()?;
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
            Scheduler::new(lm, monitor, limits, prefill_pool, decoder, &thread_metrics)
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
        let (swap, swapped) = Swap::new(lm, monitor, version);
        self.queue.send(Message::Swap(swap)).ok()?;
        Some(swapped)
    }
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

/// Stop strings that make the test build's engine panic: inside a
/// prefill (caught) and outside (ending the engine's thread).
#[cfg(test)]
const FAULT_PANIC: &str = "qforge-test-fault-panic";
#[cfg(test)]
const FAULT_EXIT: &str = "qforge-test-fault-exit";

/// The engine's failure handling end to end, through a server: a panic
/// the scheduler catches (`scheduler::caught`) and one that ends its thread
/// (`engine_pool`'s handler, [`Engine::alive`]).
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
