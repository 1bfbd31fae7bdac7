//! One sequence on its way through the engine: its KV cache, its sampler,
//! what it has generated and sent, and how it draws its next token, takes
//! a forced one, and forks its siblings once its prompt is in.
//!
//! Apart from the scheduler because it is the per-sequence state the
//! scheduler batches: nothing here knows about other sequences, the queue
//! or the KV budget, and a draw depends on its own row and sampler only
//! (which is why the scheduler may run the draws in parallel).

use std::time::Instant;

use qforge_decode::sampling::{TokenLogProb, with_distribution};
use qforge_model::KvCache;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::Request;

/// A sequence being prefilled or generated.
pub(super) struct Sequence {
    pub(super) request: Request,
    pub(super) cache: KvCache,
    rng: StdRng,
    /// Prompt tokens in the cache.
    pub(super) prefilled: usize,
    pub(super) generated: Vec<u32>,
    /// Bytes of the decoded text already sent.
    pub(super) sent: usize,
    /// Tokens of `generated` already sent.
    pub(super) sent_tokens: usize,
    /// Log-probabilities of the tokens taken and not yet sent.
    pub(super) pending: Vec<TokenLogProb>,
    /// The draw at every position so far.
    pub(super) chosen: Vec<u32>,
    /// The log-probability of every token taken so far (when asked for).
    pub(super) scored: Vec<f64>,
    /// The token to feed at the next step.
    pub(super) next: u32,
    pub(super) started: Instant,
}

impl Sequence {
    /// A sequence for `request` on `cache`, nothing drawn yet, its sampler
    /// seeded with the request's seed; its request arrived at `started`.
    pub(super) fn new(request: Request, cache: KvCache, started: Instant) -> Self {
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
    /// them: the draw and the score share one softmax over the vocabulary.
    pub(super) fn draw(&mut self, logits: &[f32]) -> qforge_model::Result<u32> {
        let request = &self.request;
        let rng = &mut self.rng;
        let position = self.chosen.len();
        let (drawn, token, entry) =
            with_distribution(logits, request.temperature, |distribution| {
                let drawn = distribution.sample(rng)?;
                let token = match &request.forced {
                    // `accept` ends the sequence at the last forced token.
                    Some(forced) => *forced.get(position).ok_or_else(|| {
                        qforge_model::Error::from(qforge_formats::Error::Shape(
                            "no forced token is left to take".into(),
                        ))
                    })?,
                    None => drawn,
                };
                let entry = request
                    .log_probs
                    .map(|top| distribution.log_prob(token, top));
                Ok::<_, qforge_model::Error>((drawn, token, entry))
            })?;
        self.chosen.push(drawn);
        if let Some(entry) = entry {
            self.scored.push(entry.log_prob);
            self.pending.push(entry);
        }
        Ok(token)
    }

    /// The sequences of the request's siblings, each with a fork of this
    /// one's cache (its prompt prefilled, marked as theirs in common, which
    /// the decoder then reads once for all of them) and a sampler of its
    /// own seed; a sibling that no one waits for any more is left out.
    pub(super) fn fork(&mut self) -> Vec<Sequence> {
        let siblings = std::mem::take(&mut self.request.siblings);
        let request = &self.request;
        siblings
            .into_iter()
            .filter(|sibling| !sibling.events.is_closed())
            .map(|sibling| {
                let request = Request {
                    prompt: request.prompt.clone(),
                    max_tokens: request.max_tokens,
                    ignore_eos: request.ignore_eos,
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
                let mut sequence = Sequence::new(request, self.cache.fork(), self.started);
                sequence.prefilled = self.prefilled;
                sequence
            })
            .collect()
    }

    /// Whether every forced token is taken.
    pub(super) fn forced_out(&self) -> bool {
        self.request
            .forced
            .as_ref()
            .is_some_and(|forced| self.chosen.len() >= forced.len())
    }
}
