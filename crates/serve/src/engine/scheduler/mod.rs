//! The engine's thread: the [`Scheduler`] that owns the model, admits
//! waiting requests within the sequence and KV budgets, runs one iteration
//! after another, takes each drawn token into its sequence (stop strings,
//! held-back text, the finish) and publishes the gauges, and swaps the
//! model in once the admitted sequences are done.
//!
//! An iteration runs one of two ways, each in a file of its own: an
//! all-INT8 model prefills and decodes in one pass of the batched decoder
//! ([`int8_decoder`]); a model with FP layers prefills through the tensor
//! forward and then steps the running sequences ([`tensor_forward`]). What
//! both share stays here: admission, dropping abandoned prefills,
//! catching a panicking model, and taking the drawn tokens.

mod int8_decoder;
mod tensor_forward;

use std::collections::{HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::Instant;

use qforge_decode::Decoder;
use qforge_model::LanguageModel;

use super::sequence::Sequence;
use super::{EngineLimits, Event, FinishReason, Finished, Message, Request, kv_positions};
use crate::batcher::panic_message;
use crate::drift::DriftMonitor;
use crate::metrics::Metrics;
use crate::swap::Swap;

/// What the engine's thread owns: the model and its version, the queue of
/// requests not yet admitted and the sequences admitted, in prefill or in
/// the decode batch.
pub(super) struct Scheduler<'a> {
    lm: LanguageModel,
    /// The version of `lm`.
    version: u64,
    /// A reload waiting for the admitted sequences to finish.
    swap: Option<Box<Swap<LanguageModel>>>,
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

/// KV positions a request reserves ([`kv_positions`]).
fn cost(r: &Request) -> usize {
    kv_positions(r.prompt.len(), r.max_tokens, r.samples())
}

impl<'a> Scheduler<'a> {
    /// A scheduler for `lm` as model version 1, with nothing queued or
    /// admitted yet.
    pub(super) fn new(
        lm: LanguageModel,
        monitor: Option<DriftMonitor>,
        limits: EngineLimits,
        prefill_pool: rayon::ThreadPool,
        decoder: Decoder,
        metrics: &'a Metrics,
    ) -> Self {
        Scheduler {
            lm,
            version: 1,
            swap: None,
            monitor,
            limits,
            prefill_pool,
            metrics,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            running: Vec::new(),
            decoder,
        }
    }

    pub(super) fn run(mut self, messages: &mpsc::Receiver<Message>) {
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
                model: lm,
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
            // is what the KV budget says from admission on (each sibling
            // forked from this cache holds the same room after the prompt,
            // which they all share).
            let mut cache = self.lm.model.new_cache();
            cache.reserve(positions(&request));
            self.prefilling
                .push_back(Sequence::new(request, cache, Instant::now()));
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

    /// Takes `token` into `sequence` and sends the text it completes;
    /// returns whether the sequence is finished (its `Done` sent).
    fn accept(&self, sequence: &mut Sequence, token: u32) -> bool {
        // Under `ignore_eos` an end of sequence is a token like any other.
        let eos = !sequence.request.ignore_eos && self.lm.text.tokenizer.eos.contains(&token);
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

    /// KV positions reserved by the admitted sequences: a request in
    /// prefill reserves its [`cost`]; a running sequence its own positions,
    /// and a shared prefix counts once for the samples that share it.
    fn reserved(&self) -> usize {
        let prefilling: usize = self.prefilling.iter().map(|s| cost(&s.request)).sum();
        let mut prefixes = HashSet::new();
        let running: usize = self
            .running
            .iter()
            .map(|s| {
                let prefix = s.cache.shared_prefix().filter(|p| prefixes.insert(p.id));
                s.cache.own_capacity() + prefix.map_or(0, |p| p.len)
            })
            .sum();
        prefilling + running
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
    use std::collections::VecDeque;

    use qforge_decode::Decoder;
    use qforge_model::LanguageModel;
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
    use tokio::sync::oneshot;

    use super::Scheduler;
    use crate::engine::{EngineLimits, Event, Message, Request, Sibling, engine_pool};
    use crate::metrics::Metrics;
    use crate::swap::Swap;
    use crate::testing::{smollm2, smollm2_int8};

    /// A greedy request for `prompt` and the receiving end of its events.
    fn request(prompt: Vec<u32>, max_tokens: usize) -> (Request, UnboundedReceiver<Event>) {
        let (events, receiver) = unbounded_channel();
        let request = Request {
            prompt,
            max_tokens,
            ignore_eos: false,
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
        let lm = smollm2_int8();
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

        let (swap, mut swapped) = Swap::new(lm, None, 2);
        scheduler.take(Message::Swap(swap));
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
