//! An iteration for an all-INT8 model: one pass of the batched INT8
//! [`Decoder`](qforge_decode::Decoder) runs the next prompt chunks of the
//! sequences in prefill and one token of every running sequence together,
//! so the weights are read once for both.
//!
//! Apart from the tensor path because this is the engine's fast path with
//! its own bookkeeping: one pass's logits hold prompt rows and decode rows
//! side by side, and a prompt that completes in it draws its first token
//! (and forks its siblings) from its own row.

use qforge_model::KvCache;
use rayon::prelude::*;

use super::{Scheduler, caught};
use crate::drift::DriftMonitor;
use crate::engine::Event;

impl Scheduler<'_> {
    /// One pass of the batched INT8 decoder for everything in flight: the
    /// next prompt chunks of the sequences in prefill (at most
    /// `prefill_chunk` tokens over all of them, the front first, as
    /// [`Self::prefill`] gives them) and one token of every running
    /// sequence, so the weights are read once for both. A sequence whose
    /// prompt is then all in draws its first token (its siblings fork) and
    /// decodes from the next pass on.
    pub(super) fn advance(&mut self) {
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
}
