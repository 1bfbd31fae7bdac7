//! What a caller hands the engine and hears back: the [`Request`] with its
//! [`Sibling`] samples, the [`Event`]s of a completion, what a finished one
//! [`Finished`] with, and the [`Script`] and [`Replay`] that rerun a request
//! on another engine (the shadow reference).
//!
//! These are the engine's whole interface to the server and to Python's
//! `LanguageModel`; they live apart from the scheduler so that a reader of
//! the contract does not wade through the batching that fulfils it.

use qforge_decode::sampling::TokenLogProb;
use serde::Serialize;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

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
        /// sequence that ends the completion not, one passed under
        /// [`Request::ignore_eos`] included).
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
    /// Whether the end of sequence is an ordinary token: the completion
    /// runs to `max_tokens` (or a stop string), every end of sequence in it
    /// counted, scored and sent like any other token (vLLM's
    /// `ignore_eos`). Load of a fixed length, for benchmarks.
    pub ignore_eos: bool,
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
    ignore_eos: bool,
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
    pub(super) fn abandoned(&self) -> bool {
        self.events.is_closed() && self.siblings.iter().all(|s| s.events.is_closed())
    }

    /// Tells every sample that the request failed.
    pub(super) fn fail(self, message: &str) {
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
            ignore_eos: self.ignore_eos,
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
                // The forced tokens pass any end of sequence INT8 passed.
                ignore_eos: self.ignore_eos,
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
