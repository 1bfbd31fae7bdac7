//! Two models compared on the same text ([`Comparison`]): KL divergence,
//! top-1 agreement and the perplexity increase with its interval, against a
//! reference's log-probabilities computed once ([`ReferenceLogProbs`]).

use candle_core::{D, Tensor};
use serde::Serialize;

use crate::perplexity::{Nll, chunk_count, chunk_log_probs, scored_log_probs};
use qforge_model::Result;
use qforge_model::llama::{HiddenState, Llama, Logits};

/// Two models compared on the same text, as llama.cpp's `--kl-divergence`
/// reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// Perplexity of the model under test.
    pub perplexity: f64,
    /// Perplexity of the reference.
    pub reference_perplexity: f64,
    /// Mean KL(reference ‖ model) of the next-token distributions.
    pub kl_divergence: f64,
    /// Fraction of positions where both predict the same top token.
    pub top1_agreement: f64,
    /// Number of scored positions.
    pub tokens: usize,
    /// A 95 % interval of `perplexity / reference_perplexity − 1`, from the
    /// spread of that ratio over the text's chunks (see
    /// [`increase_interval`]); `None` for a text of one chunk.
    pub increase_interval: Option<[f64; 2]>,
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "perplexity {:.4} (reference {:.4}), mean KL {:.6}, top-1 agreement {:.2} % over {} tokens",
            self.perplexity,
            self.reference_perplexity,
            self.kl_divergence,
            100.0 * self.top1_agreement,
            self.tokens
        )?;
        if let Some([low, high]) = self.increase_interval {
            write!(
                f,
                "; increase {:+.2} % (95 % interval {:+.2} … {:+.2} %)",
                100.0 * (self.perplexity / self.reference_perplexity - 1.0),
                100.0 * low,
                100.0 * high
            )?;
        }
        Ok(())
    }
}

/// A reference model's log-probabilities on a text, computed once so that
/// many models can be compared with it ([`compare_to`]). They are kept in a
/// temporary file (see the `spill` module), one chunk read back at a time:
/// for a 128 256-token vocabulary they are 1 GB per 4 096 tokens.
pub struct ReferenceLogProbs {
    chunks: Vec<SpilledLogProbs>,
    ctx: usize,
    tokens: usize,
    /// The reference's own perplexity on the text.
    perplexity: f64,
    /// Per chunk, when kept: the hidden states entering every layer.
    states: Vec<Vec<HiddenState>>,
}

/// One chunk's log-probabilities, `[rows, vocab]` f32, in a spilled file.
struct SpilledLogProbs {
    values: std::sync::Arc<memmap2::Mmap>,
    shape: (usize, usize),
    /// The negative log-likelihood of the chunk's targets, summed.
    nll: f64,
}

impl SpilledLogProbs {
    /// Spills a chunk's `log_probs`, adding what they give their `targets`
    /// to `nll`.
    fn new(log_probs: &Tensor, targets: &[u32], nll: &mut Nll) -> Result<Self> {
        let shape = log_probs.dims2()?;
        let before = nll.sum;
        let values = nll.add(log_probs, targets)?;
        let values =
            qforge_formats::spill::spill(|out| qforge_formats::spill::write_f32(&values, out))?;
        Ok(Self {
            values,
            shape,
            nll: nll.sum - before,
        })
    }

    /// The log-probabilities, as they were.
    fn read(&self) -> Result<Tensor> {
        let values = qforge_formats::spill::read_f32(&self.values);
        Ok(Tensor::from_vec(
            values,
            self.shape,
            &candle_core::Device::Cpu,
        )?)
    }
}

impl ReferenceLogProbs {
    /// Runs `reference` over `tokens` in chunks of `ctx`.
    pub fn new(reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Self> {
        let mut nll = Nll::default();
        let chunks = (0..chunk_count(tokens.len(), ctx)?)
            .map(|c| {
                let (log_probs, targets) = chunk_log_probs(reference, tokens, ctx, c)?;
                SpilledLogProbs::new(&log_probs, &targets, &mut nll)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            chunks,
            ctx,
            tokens: tokens.len(),
            perplexity: nll.perplexity(),
            states: Vec::new(),
        })
    }

    /// [`ReferenceLogProbs::new`], keeping the hidden states entering every
    /// layer of every chunk, so that a model that differs from `reference`
    /// only from some layer on is compared from there ([`compare_from`]).
    /// They take `(layers + 1) × tokens × hidden` floats.
    pub fn keeping_states(reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Self> {
        let (mut chunks, mut states, mut nll) = (Vec::new(), Vec::new(), Nll::default());
        for c in 0..chunk_count(tokens.len(), ctx)? {
            let chunk = &tokens[c * ctx..(c + 1) * ctx];
            let (logits, kept) = reference.forward_keeping(&[chunk.to_vec()], Logits::All)?;
            let (log_probs, targets) = scored_log_probs(&logits, chunk)?;
            chunks.push(SpilledLogProbs::new(&log_probs, &targets, &mut nll)?);
            states.push(kept);
        }
        Ok(Self {
            chunks,
            ctx,
            tokens: tokens.len(),
            perplexity: nll.perplexity(),
            states,
        })
    }

    /// The reference's own perplexity on the text it was run on, summed as
    /// it was run: bit for bit what [`perplexity`](crate::perplexity()) and
    /// [`compare_to`] report for it.
    pub fn perplexity(&self) -> f64 {
        self.perplexity
    }

    /// Refuses `tokens` other than the text the reference was run on (by
    /// count: the caller holds the text).
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.len() != self.tokens {
            return Err(qforge_formats::Error::Shape(format!(
                "the reference was run on {} tokens, the model on {}",
                self.tokens,
                tokens.len()
            ))
            .into());
        }
        Ok(())
    }
}

/// Compares `model` against `reference` on `tokens`.
pub fn compare(model: &Llama, reference: &Llama, tokens: &[u32], ctx: usize) -> Result<Comparison> {
    compare_to(
        model,
        &ReferenceLogProbs::new(reference, tokens, ctx)?,
        tokens,
    )
}

/// Compares `model` against a reference's log-probabilities on the same
/// `tokens`.
pub fn compare_to(
    model: &Llama,
    reference: &ReferenceLogProbs,
    tokens: &[u32],
) -> Result<Comparison> {
    compare_chunks(reference, tokens, |c| {
        chunk_log_probs(model, tokens, reference.ctx, c)
    })
}

/// [`compare_to`] for a `model` whose layers before `layer` are the
/// reference's (`layer` = the layer count: only the final norm and head
/// differ): each chunk runs from the reference's hidden state entering
/// `layer`, kept by [`ReferenceLogProbs::keeping_states`]. The figures are
/// those of [`compare_to`], bit for bit, for a fraction of the work.
pub fn compare_from(
    model: &Llama,
    reference: &ReferenceLogProbs,
    tokens: &[u32],
    layer: usize,
) -> Result<Comparison> {
    let ctx = reference.ctx;
    compare_chunks(reference, tokens, |c| {
        let state = reference
            .states
            .get(c)
            .and_then(|kept| kept.get(layer))
            .ok_or_else(|| {
                qforge_formats::Error::Shape(format!(
                    "the reference kept no hidden state entering layer {layer} of chunk {c}"
                ))
            })?;
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        let logits = model.forward_resuming(&[chunk.to_vec()], state, Logits::All)?;
        scored_log_probs(&logits, chunk)
    })
}

/// Compares the log-probabilities `chunk` gives for each chunk of `tokens`
/// with `reference`'s.
fn compare_chunks(
    reference: &ReferenceLogProbs,
    tokens: &[u32],
    chunk: impl Fn(usize) -> Result<(Tensor, Vec<u32>)>,
) -> Result<Comparison> {
    reference.check_tokens(tokens)?;
    let (mut nll, mut kl, mut agree) = (Nll::default(), 0.0, 0usize);
    let mut log_ratios = Vec::with_capacity(reference.chunks.len());
    for (c, spilled) in reference.chunks.iter().enumerate() {
        let (ours, targets) = chunk(c)?;
        let (lp, rp) = (&ours, &spilled.read()?);
        // KL(P_ref ‖ P_model) = Σ p_ref (log p_ref − log p_model), per row.
        let row_kl = (rp.exp()? * (rp - lp)?)?.sum(D::Minus1)?.to_vec1::<f32>()?;
        let our_top = lp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let ref_top = rp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let before = nll.sum;
        nll.add(lp, &targets)?;
        log_ratios.push((nll.sum - before - spilled.nll) / targets.len() as f64);
        for i in 0..targets.len() {
            kl += f64::from(row_kl[i]);
            agree += usize::from(our_top[i] == ref_top[i]);
        }
    }
    let n = nll.count as f64;
    Ok(Comparison {
        perplexity: nll.perplexity(),
        reference_perplexity: reference.perplexity,
        kl_divergence: kl / n,
        top1_agreement: agree as f64 / n,
        tokens: nll.count,
        increase_interval: increase_interval(&log_ratios),
    })
}

/// A 95 % interval of a perplexity ratio − 1 from the per-chunk log-ratios
/// `x_c = (NLL_model − NLL_reference) / tokens` of chunks scoring as many
/// tokens each, whose mean is the log of the whole text's ratio: Student's
/// t interval of that mean, `x̄ ± t(0.975, C − 1) · s / √C`, mapped through
/// `exp(·) − 1`. It treats the chunks as independent samples of text, which
/// consecutive chunks of one document are only roughly: a width, not a
/// guarantee. `None` below two chunks.
pub fn increase_interval(log_ratios: &[f64]) -> Option<[f64; 2]> {
    let chunks = log_ratios.len();
    if chunks < 2 {
        return None;
    }
    let mean = log_ratios.iter().sum::<f64>() / chunks as f64;
    let variance = log_ratios.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (chunks - 1) as f64;
    let half = student_t_975(chunks - 1) * (variance / chunks as f64).sqrt();
    Some([(mean - half).exp_m1(), (mean + half).exp_m1()])
}

/// Student's t distribution's 97.5 % quantile at `df` ≥ 1 degrees of
/// freedom: the table's values to 30 (as any statistics text prints
/// them), then the Cornish–Fisher expansion to its second term,
/// `z + (z³ + z) / (4·df) + (5z⁵ + 16z³ + 3z) / (96·df²)` with
/// z = 1.959 964, within 0.001 of the exact value from 31 on.
fn student_t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    const Z: f64 = 1.959_964;
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        _ => {
            let df = df as f64;
            Z + (Z.powi(3) + Z) / (4.0 * df)
                + (5.0 * Z.powi(5) + 16.0 * Z.powi(3) + 3.0 * Z) / (96.0 * df * df)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_increase_interval_is_students_t_interval_of_the_chunks_log_ratios() {
        assert_eq!(increase_interval(&[0.01]), None);
        // Two chunks: mean 0.02, s = √2 · 0.01, t(1) = 12.706.
        let [low, high] = increase_interval(&[0.01, 0.03]).unwrap();
        let half: f64 = 12.706 * 0.01;
        assert!((low - (0.02 - half).exp_m1()).abs() < 1e-12, "{low}");
        assert!((high - (0.02 + half).exp_m1()).abs() < 1e-12, "{high}");
        // The same spread over more chunks narrows it around exp(mean) − 1.
        let many: Vec<f64> = (0..64)
            .map(|i| 0.02 + 0.01 * f64::from(i % 2 * 2 - 1))
            .collect();
        let [low, high] = increase_interval(&many).unwrap();
        assert!(low < 0.02f64.exp_m1() && 0.02f64.exp_m1() < high);
        assert!(high - low < 0.006, "{low} … {high}");
        // The table meets the approximation where it ends.
        assert!((student_t_975(31) - 2.0395).abs() < 0.001);
        assert!((student_t_975(120) - 1.9799).abs() < 0.001);
        assert!(student_t_975(30) > student_t_975(31));
    }
}
