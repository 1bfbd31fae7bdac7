//! Perplexity with llama.cpp's method ([`perplexity()`]), and the chunking
//! and summing of negative log-likelihoods that every figure qforge reports
//! shares with the comparison of two models (`crate::compare`).

use candle_core::Tensor;
use serde::Serialize;

use qforge_model::Result;
use qforge_model::llama::{Llama, Logits, log_softmax};

/// Perplexity with llama.cpp's method: consecutive, non-overlapping chunks of
/// `ctx` tokens; in each, only the second half is scored (every scored token
/// has at least ctx/2 tokens of context), so figures are comparable with
/// `llama-perplexity`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// exp(mean negative log-likelihood).
    pub perplexity: f64,
    /// Number of scored tokens.
    pub tokens: usize,
    /// Number of chunks.
    pub chunks: usize,
    /// Tokens per chunk.
    pub ctx: usize,
}

impl std::fmt::Display for Perplexity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "perplexity {:.4} over {} scored tokens ({} chunks of {})",
            self.perplexity, self.tokens, self.chunks, self.ctx
        )
    }
}

/// How many chunks of `ctx` a text of `tokens` has; a text shorter than
/// one chunk (or a `ctx` too small to score) is refused.
pub(super) fn chunk_count(tokens: usize, ctx: usize) -> Result<usize> {
    if ctx < 4 {
        return Err(
            qforge_formats::Error::Shape(format!("--ctx {ctx} is too small (at least 4)")).into(),
        );
    }
    let chunks = tokens / ctx;
    if chunks == 0 {
        return Err(qforge_formats::Error::Shape(format!(
            "the text has {tokens} tokens, fewer than one chunk of --ctx {ctx}; use a longer text or a smaller --ctx"
        )).into());
    }
    Ok(chunks)
}

/// Log-probabilities of the scored positions of chunk `c`, `[scored,
/// vocab]`, with the tokens they score. One chunk at a time: a chunk's
/// figures are ~50 MB for SmolLM2 at ctx 512, so holding every chunk's
/// (as this once did) took 6 GB for a 64 000-token text.
pub(super) fn chunk_log_probs(
    model: &Llama,
    tokens: &[u32],
    ctx: usize,
    c: usize,
) -> Result<(Tensor, Vec<u32>)> {
    let chunk = &tokens[c * ctx..(c + 1) * ctx];
    let logits = model.forward(&[chunk.to_vec()], None, None, Logits::All)?;
    scored_log_probs(&logits, chunk)
}

/// Of a chunk's `logits` (`[1, ctx, vocab]`), the log-probabilities of the
/// scored positions, with the tokens they score: position j predicts token
/// j + 1, and j in [ctx / 2, ctx − 1) is scored (llama.cpp's method).
pub(super) fn scored_log_probs(logits: &Tensor, chunk: &[u32]) -> Result<(Tensor, Vec<u32>)> {
    let (ctx, first) = (chunk.len(), chunk.len() / 2);
    let scored = logits.get(0)?.narrow(0, first, ctx - 1 - first)?;
    Ok((log_softmax(&scored)?, scored_targets(chunk).to_vec()))
}

/// The tokens a chunk's scored positions predict (see [`scored_log_probs`]).
fn scored_targets(chunk: &[u32]) -> &[u32] {
    &chunk[chunk.len() / 2 + 1..]
}

/// The negative log-likelihood of the scored targets, summed in the order
/// they come. Every perplexity qforge reports is summed here, so the same
/// log-probabilities give the same perplexity to the last bit.
#[derive(Default)]
pub(super) struct Nll {
    pub(super) sum: f64,
    pub(super) count: usize,
}

impl Nll {
    /// Adds the log-probabilities `log_probs` (`[targets, vocab]`) give
    /// their `targets`; returns the values, flat.
    pub(super) fn add(&mut self, log_probs: &Tensor, targets: &[u32]) -> Result<Vec<f32>> {
        let vocab = log_probs.dims2()?.1;
        let values = log_probs.flatten_all()?.to_vec1::<f32>()?;
        for (row, &t) in values.chunks_exact(vocab).zip(targets) {
            self.sum -= f64::from(row[t as usize]);
            self.count += 1;
        }
        Ok(values)
    }

    pub(super) fn perplexity(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }
}

/// Perplexity of `model` on `tokens` (see [`Perplexity`]).
pub fn perplexity(model: &Llama, tokens: &[u32], ctx: usize) -> Result<Perplexity> {
    let chunks = chunk_count(tokens.len(), ctx)?;
    let mut nll = Nll::default();
    for c in 0..chunks {
        let (log_probs, targets) = chunk_log_probs(model, tokens, ctx, c)?;
        nll.add(&log_probs, &targets)?;
    }
    Ok(Perplexity {
        perplexity: nll.perplexity(),
        tokens: nll.count,
        chunks,
        ctx,
    })
}
