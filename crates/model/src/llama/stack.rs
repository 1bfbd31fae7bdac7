//! The decoder stack every tensor pass runs (the forward, the kept and
//! resumed forwards, the observing passes): the layers with their observation
//! points, where an observing pass may stop, and the hidden states it keeps
//! to resume from. One loop serves them all, so an observing pass sees exactly
//! the values the forward computes.

use candle_core::Tensor;

use super::{Llama, RotatedInput};
use crate::error::Result;
use crate::observe::Observer;

impl Llama {
    /// The decoder layers and the final norm over embeddings `x: [b, seq,
    /// hidden]` at the positions `cos`/`sin` give; `attend(layer, q, k, v)`
    /// (heads-major, RoPE applied) returns `[b, seq, heads·head_dim]` and owns
    /// the KV cache. Every distinct linear input, the final norm's output
    /// included (`lm_head`'s), is handed to `observer`.
    pub(super) fn decoder_stack(
        &self,
        mut x: Tensor,
        (cos, sin): (&Tensor, &Tensor),
        lengths: &[usize],
        mut observer: Option<&mut dyn Observer>,
        mut span: Span<'_>,
        mut attend: impl FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps as f32;
        for (i, layer) in self.layers.iter().enumerate().skip(span.first) {
            span.keep(i, &x);
            let h = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let h = self.rotate_input(RotatedInput::Attention, h)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.self_attn.q_proj"),
                &h,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            let q = self.heads(&layer.q_proj.forward(&h)?, c.num_heads)?;
            let k = self.heads(&layer.k_proj.forward(&h)?, c.num_kv_heads)?;
            let v = self.heads(&layer.v_proj.forward(&h)?, c.num_kv_heads)?;
            let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
            let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
            let attended =
                self.rotate_input(RotatedInput::AttentionOutput, attend(i, &q, &k, &v)?)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.self_attn.o_proj"),
                &attended,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            x = (x + layer.o_proj.forward(&attended)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.post_attention_norm, eps)?;
            let h = self.rotate_input(RotatedInput::Mlp, h)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.mlp.gate_proj"),
                &h,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            let gated = self.rotate_input(
                RotatedInput::MlpProduct,
                (candle_nn::ops::silu(&layer.gate_proj.forward(&h)?)?
                    * layer.up_proj.forward(&h)?)?,
            )?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.mlp.down_proj"),
                &gated,
                lengths,
            )?;
            if span.rounds_observed && span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            x = (x + layer.down_proj.forward(&gated)?)?;
            if span.stop_when_finished && finished(&observer) {
                span.keep(i + 1, &x);
                // What follows is never observed: the hidden state is all an
                // observing pass gets.
                return Ok(x);
            }
        }
        if span.keep_every {
            span.keep(self.layers.len(), &x);
        }
        let x = self.rotate_input(
            RotatedInput::Head,
            candle_nn::ops::rms_norm(&x, &self.norm, eps)?,
        )?;
        // lm_head's input is observed at every real position, whichever
        // logits are asked for.
        observe(&mut observer, "lm_head", &x, lengths)?;
        Ok(x)
    }

    /// `[b, seq, heads·head_dim]` → `[b, heads, seq, head_dim]`.
    fn heads(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        Ok(x.reshape((b, seq, heads, self.config.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }
}

/// Which decoder layers [`Llama::decoder_stack`] runs, and what it keeps.
#[derive(Default)]
pub(super) struct Span<'a> {
    /// The first layer run (the stack's input enters it).
    pub(super) first: usize,
    /// Stop as soon as the observer is finished: at once when it finishes
    /// at an input before `down_proj`'s, whose layer need not run further;
    /// after the layer when it finishes at `down_proj`'s input, so that the
    /// state entering the next layer is kept for the pass that observes it
    /// (unless [`Span::rounds_observed`]).
    pub(super) stop_when_finished: bool,
    /// The layers observed are rounded before any pass runs past them (GPTQ
    /// propagating its rounding), so the state entering the next layer
    /// would be stale: finishing at `down_proj`'s input stops there too.
    pub(super) rounds_observed: bool,
    /// Receives the hidden states entering the last two layers run (or, when
    /// it stops after a whole layer, entering that layer and the one after
    /// it).
    pub(super) kept: Option<&'a mut Vec<HiddenState>>,
    /// Keep the states entering every layer run and the one after the
    /// last, not only the last two.
    pub(super) keep_every: bool,
}

/// Whether `observer` (if any) has seen all it wants.
fn finished(observer: &Option<&mut dyn Observer>) -> bool {
    observer.as_ref().is_some_and(|o| o.finished())
}

impl Span<'_> {
    /// Whether the stack stops inside a layer, now that `observer` saw the
    /// layer's inputs up to the current one: what follows in that layer is
    /// observed by no one, and a state past it is kept only at the layer's
    /// end (see [`Span::stop_when_finished`]).
    fn stops_inside_layer(&self, observer: &Option<&mut dyn Observer>) -> bool {
        self.stop_when_finished && finished(observer)
    }

    /// Keeps `x`, entering layer `layer` (as one of the last two, unless
    /// every state is kept).
    fn keep(&mut self, layer: usize, x: &Tensor) {
        if let Some(kept) = self.kept.as_deref_mut() {
            kept.push(HiddenState {
                layer,
                x: x.clone(),
            });
            if kept.len() > 2 && !self.keep_every {
                kept.remove(0);
            }
        }
    }
}

/// A batch's hidden state entering decoder layer `layer` (`[batch, seq,
/// hidden]`, padding included), from which an observing pass of the same
/// model over the same batch resumes ([`Llama::observe_resuming`]).
#[derive(Debug, Clone)]
pub struct HiddenState {
    /// The layer it enters.
    pub layer: usize,
    pub(super) x: Tensor,
}

impl HiddenState {
    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.x.elem_count() * self.x.dtype().size_in_bytes()
    }
}

/// Hands the real (non-padding) rows of `x: [batch, seq, width]` to the observer.
fn observe(
    observer: &mut Option<&mut dyn Observer>,
    point: &str,
    x: &Tensor,
    lengths: &[usize],
) -> Result<()> {
    let Some(observer) = observer.as_deref_mut() else {
        return Ok(());
    };
    let (_, seq, width) = x.dims3()?;
    let values = x.flatten_all()?.to_vec1::<f32>()?;
    if lengths.iter().all(|&l| l == seq) {
        return observer.observe(point, &values, width);
    }
    for (s, &len) in lengths.iter().enumerate() {
        let start = s * seq * width;
        observer.observe(point, &values[start..start + len * width], width)?;
    }
    Ok(())
}
