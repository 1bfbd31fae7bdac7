//! An iteration for a model with FP layers, which the batched INT8 decoder
//! cannot run: each prompt is prefilled a chunk at a time through the
//! tensor forward on the prefill pool (compute-bound, so it gets every
//! core), then every running sequence advances one token in a single
//! batched [`Llama::step`](qforge_model::Llama::step).
//!
//! Apart from the INT8 path because the two differ in everything but what
//! they feed: here prefill and decode are separate forwards with separate
//! failure scopes (a panic fails one prompt, or one step's batch).

use qforge_model::{KvCache, Logits};
use rayon::prelude::*;

use super::{Scheduler, caught};
use crate::drift::DriftMonitor;
use crate::engine::Event;
use crate::engine::sequence::Sequence;

impl Scheduler<'_> {
    /// Gives at most `prefill_chunk` prompt tokens to the sequences in
    /// prefill, the front first; one left unfinished goes to the back, so
    /// a short prompt behind a long one gets the next chunk. A sequence
    /// whose prompt is in is sampled its first token and joins the decode
    /// batch.
    pub(super) fn prefill(&mut self) {
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

    /// Advances every running sequence by one token through the tensor
    /// forward (a model with FP layers; an all-INT8 one runs
    /// [`Self::advance`]).
    pub(super) fn step(&mut self) {
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

    /// Runs the next `take` prompt tokens of `sequence` into its cache;
    /// after the last, returns the logits of the prompt's last position.
    fn prefill_chunk(
        &mut self,
        sequence: &mut Sequence,
        take: usize,
    ) -> std::result::Result<Option<Vec<f32>>, String> {
        #[cfg(test)]
        if asks_for(sequence, crate::engine::FAULT_EXIT) {
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
            if asks_for(sequence, crate::engine::FAULT_PANIC) {
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
}

/// Whether the test build's request `sequence` asks for `fault` (one of the
/// stop strings that make the engine panic).
#[cfg(test)]
fn asks_for(sequence: &Sequence, fault: &str) -> bool {
    sequence.request.stop.iter().any(|s| s == fault)
}
