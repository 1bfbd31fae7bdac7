//! Drawing the next token from a position's logits ([`sample`]) and the
//! log-probabilities of tokens under that same distribution
//! ([`token_log_prob`], [`continuation_log_probs`]): the sampler and the
//! figures a trainer scores against share one softmax, summed in this
//! thread's buffers.

use std::cell::RefCell;

use qforge_kernels::exp::{SOFTMAX_BLOCK, softmax_weights};
use rand::{Rng, rngs::StdRng};

use crate::error::{Error, Result};
use crate::llama::{Llama, Logits};

/// Picks the next token from one position's logits: the argmax when
/// `temperature` is `None` or 0, else a draw from softmax(logits / t).
///
/// The draw is one uniform f64 from `rng` times the softmax's total, found
/// among [`SOFTMAX_BLOCK`] block sums, then among that block's weights
/// ([`softmax_weights`]: the same bits on every CPU tier), so a seed draws
/// the same tokens on every machine. A row without a finite, positive
/// total (NaN or infinite logits) gives its argmax.
pub fn sample(logits: &[f32], temperature: Option<f64>, rng: &mut StdRng) -> Result<u32> {
    let t = match temperature {
        None | Some(0.0) => return Ok(argmax(logits)),
        Some(t) if t > 0.0 && t.is_finite() => t,
        Some(t) => {
            return Err(Error::Shape(format!(
                "temperature must be ≥ 0 and finite, got {t}"
            )));
        }
    };
    let uniform = rng.random::<f64>();
    Ok(with_softmax(logits, t, |weights, block_sums| {
        let total: f64 = block_sums.iter().sum();
        if !(total > 0.0 && total.is_finite()) {
            return argmax(logits);
        }
        let mut target = uniform * total;
        for (block, &sum) in block_sums.iter().enumerate() {
            if target > sum {
                target -= sum;
                continue;
            }
            let first = block * SOFTMAX_BLOCK;
            let weights = &weights[first..(first + SOFTMAX_BLOCK).min(weights.len())];
            let mut last_drawable = None;
            for (i, &w) in weights.iter().enumerate() {
                if w > 0.0 {
                    last_drawable = Some(i);
                }
                target -= f64::from(w);
                if target <= 0.0 && w > 0.0 {
                    return (first + i) as u32;
                }
            }
            // The block's sum is its weights' in another order; what
            // rounding leaves over belongs to its last token.
            if let Some(i) = last_drawable {
                return (first + i) as u32;
            }
        }
        argmax(logits)
    }))
}

thread_local! {
    /// One vocabulary's softmax weights and block sums, per thread (the
    /// engine draws for many sequences in parallel).
    static SOFTMAX: RefCell<(Vec<f32>, Vec<f64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` on the weights and block sums of softmax(logits / t) (see
/// [`softmax_weights`]), in this thread's buffers: a draw allocates nothing.
fn with_softmax<T>(logits: &[f32], t: f64, f: impl FnOnce(&[f32], &[f64]) -> T) -> T {
    SOFTMAX.with(|buffers| {
        let (weights, block_sums) = &mut *buffers.borrow_mut();
        weights.resize(logits.len(), 0.0);
        block_sums.resize(logits.len().div_ceil(SOFTMAX_BLOCK), 0.0);
        // `t` > 0 and finite: a scale that overflows f32 is an infinite
        // one, whose softmax is the argmax's (as a NaN-total row falls to).
        let scale = ((1.0 / t) as f32).min(f32::MAX);
        if softmax_weights(logits, scale, weights, block_sums).is_err() {
            // Only a scale that rounds to 0 is refused: t above 1e38.
            block_sums.fill(f64::NAN);
        }
        f(weights, block_sums)
    })
}

/// A token's log-probability under the distribution it was drawn from,
/// with the likeliest tokens' beside it (OpenAI's `logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogProb {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub log_prob: f64,
    /// The likeliest tokens and their log-probabilities, likeliest first
    /// (ties: the lower id first).
    pub top: Vec<(u32, f64)>,
}

/// The log-probability of `token`, and of the `top` likeliest tokens, under
/// the distribution [`sample`] draws from at `temperature`:
/// log softmax(logits / t), with t = 1 when greedy (greedy draws from no
/// distribution; the model's own is the one a trainer scores against).
/// The softmax's total is [`sample`]'s (f32 weights summed in f64), the
/// rest f64, so the figures do not depend on the vocabulary's size.
pub fn token_log_prob(
    logits: &[f32],
    temperature: Option<f64>,
    token: u32,
    top: usize,
) -> TokenLogProb {
    let t = match temperature {
        Some(t) if t > 0.0 => t,
        _ => 1.0,
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let shifted = |l: f32| (f64::from(l) - f64::from(max)) / t;
    let log_total = with_softmax(logits, t, |_, block_sums| {
        block_sums.iter().sum::<f64>().ln()
    });
    let log_prob = |i: usize| shifted(logits[i]) - log_total;
    // The `top` best so far, best first; the vocabulary is read once.
    let mut best: Vec<usize> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= logits[best[top - 1]] {
                continue;
            }
            let at = best.partition_point(|&b| logits[b] >= l);
            best.insert(at, i);
            best.truncate(top);
        }
    }
    TokenLogProb {
        token,
        log_prob: log_prob(token as usize),
        top: best.into_iter().map(|i| (i as u32, log_prob(i))).collect(),
    }
}

/// The log-probability of each token of `continuation` after `prompt`
/// (teacher forcing: one forward over both), under the distribution
/// [`token_log_prob`] describes. What a trainer computes for the tokens a
/// rollout engine sampled, and what the engine's own figures are checked
/// against.
pub fn continuation_log_probs(
    model: &Llama,
    prompt: &[u32],
    continuation: &[u32],
    temperature: Option<f64>,
) -> Result<Vec<f64>> {
    if prompt.is_empty() {
        return Err(Error::Shape("the prompt has no tokens".into()));
    }
    let Some((_, fed)) = continuation.split_last() else {
        return Ok(Vec::new());
    };
    let tokens = [prompt, fed].concat();
    let logits = model.forward(&[tokens], None, None, Logits::All)?;
    // Position j predicts token j + 1: the rows from the prompt's last on.
    let rows = logits
        .get(0)?
        .narrow(0, prompt.len() - 1, continuation.len())?
        .to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(continuation)
        .map(|(row, &token)| token_log_prob(row, temperature, token, 0).log_prob)
        .collect())
}

/// Index of the first maximum.
fn argmax(values: &[f32]) -> u32 {
    values
        .iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > values[best] { i } else { best }) as u32
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn log_probs_are_a_distribution_at_every_temperature_and_top_is_ranked() {
        let logits = [2.0f32, -1.0, 2.0, 0.5, 30.0, -40.0];
        for temperature in [None, Some(0.0), Some(0.3), Some(1.0), Some(2.0)] {
            let all: Vec<f64> = (0..logits.len() as u32)
                .map(|t| token_log_prob(&logits, temperature, t, 0).log_prob)
                .collect();
            let total: f64 = all.iter().map(|l| l.exp()).sum();
            assert!((total - 1.0).abs() < 1e-12, "{temperature:?}: Σp = {total}");
            let entry = token_log_prob(&logits, temperature, 1, 3);
            assert_eq!(entry.log_prob, all[1]);
            // Likeliest first; the tie between 0 and 2 goes to the lower id.
            let ids: Vec<u32> = entry.top.iter().map(|&(i, _)| i).collect();
            assert_eq!(ids, [4, 0, 2], "{temperature:?}");
            for (i, lp) in entry.top {
                assert_eq!(lp, all[i as usize]);
            }
        }
        // Greedy scores under the model's own distribution (t = 1); a
        // lower temperature sharpens it.
        let greedy = token_log_prob(&logits, None, 0, 0).log_prob;
        assert_eq!(greedy, token_log_prob(&logits, Some(1.0), 0, 0).log_prob);
        assert!(token_log_prob(&logits, Some(0.3), 0, 0).log_prob < greedy);
        assert!(token_log_prob(&logits, Some(0.3), 4, 0).log_prob > greedy);
        assert!(token_log_prob(&logits, None, 0, 99).top.len() == logits.len());
    }

    #[test]
    fn sampled_tokens_come_as_often_as_their_log_probs_say() {
        let logits = [0.0f32, 1.0, 2.0];
        let temperature = Some(0.7);
        let mut rng = StdRng::seed_from_u64(7);
        let draws = 60_000;
        let mut counts = [0usize; 3];
        for _ in 0..draws {
            counts[sample(&logits, temperature, &mut rng).unwrap() as usize] += 1;
        }
        for (token, &count) in counts.iter().enumerate() {
            let p = token_log_prob(&logits, temperature, token as u32, 0)
                .log_prob
                .exp();
            let seen = count as f64 / draws as f64;
            // Five standard errors of a binomial share.
            let tolerance = 5.0 * (p * (1.0 - p) / draws as f64).sqrt();
            assert!((seen - p).abs() < tolerance, "token {token}: {seen} vs {p}");
        }
    }
}
