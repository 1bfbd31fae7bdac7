//! Observing passes: running the decoder only to hand its linear inputs to an
//! [`Observer`] (calibration, GPTQ), stopping once the observer has all it
//! wants and resuming from a kept hidden state, so that a pass over the last
//! layers does not run the first ones again.

use super::forward::Embedded;
use super::stack::{HiddenState, Span};
use super::{Llama, attention};
use crate::error::Result;
use crate::observe::Observer;

impl Llama {
    /// Runs the decoder over `batch` only to hand every distinct linear input
    /// to `observer`, as [`Llama::forward`] does, without logits. It stops
    /// once the observer is [finished](Observer::finished): at once inside
    /// a layer, or at the end of the layer when the last input it wanted was
    /// `down_proj`'s. A pass that wants the inputs of the first layers only
    /// does not pay for the rest, nor a pass that wants a layer's q/k/v
    /// input for that layer's attention and MLP.
    pub fn observe(&self, batch: &[Vec<u32>], observer: &mut dyn Observer) -> Result<()> {
        self.observe_resuming(batch, observer, None, false)
            .map(drop)
    }

    /// [`Llama::observe`], starting from `resume` (a hidden state an earlier
    /// observing pass of this model over this batch kept) instead of the
    /// embedding, so the layers before it are not run again: a pass that
    /// observes layers 20–23 after one that observed 16–19 runs only those.
    /// The layers run compute exactly what they compute from the embedding
    /// (the same operations on the same values). Returns the hidden states
    /// entering the last two layers it started (the layer after the last
    /// one counts when it stopped at that layer's end, and the final norm
    /// when it ran to the end), for the next pass to resume from.
    ///
    /// `rounds_observed`: the caller rounds the layers this pass observes
    /// before a later pass runs past them (GPTQ propagating its rounding).
    /// A state past them would then be stale, so a pass whose last input is
    /// `down_proj`'s stops there as at any other input, and `down_proj`
    /// does not run.
    pub fn observe_resuming(
        &self,
        batch: &[Vec<u32>],
        observer: &mut dyn Observer,
        resume: Option<&HiddenState>,
        rounds_observed: bool,
    ) -> Result<Vec<HiddenState>> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let (x, first) = match resume {
            Some(state) => (self.resumed(&x, state)?, state.layer),
            None => (x, 0),
        };
        let mut kept = Vec::new();
        self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            Some(observer),
            Span {
                first,
                stop_when_finished: true,
                rounds_observed,
                kept: Some(&mut kept),
                keep_every: false,
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        Ok(kept)
    }
}
