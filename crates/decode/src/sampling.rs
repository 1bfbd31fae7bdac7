//! Drawing the next token from a position's logits and the
//! log-probabilities of tokens under that same distribution. A
//! [`Distribution`] ([`with_distribution`]) computes the tempered softmax
//! at most once, in this thread's buffers, and both draws from it and
//! scores any token against it: a rollout that asks for log-probs pays for
//! one pass of `exp` over the vocabulary per token, not two.
//! [`sample`], [`token_log_prob`] and [`continuation_log_probs`] are its
//! one-job uses.

use std::cell::RefCell;

use qforge_kernels::exp::{SOFTMAX_BLOCK, softmax_weights};
use rand::{Rng, rngs::StdRng};

use qforge_model::{Llama, Logits, Result};

/// Picks the next token from one position's logits (see
/// [`Distribution::sample`]).
pub fn sample(logits: &[f32], temperature: Option<f64>, rng: &mut StdRng) -> Result<u32> {
    with_distribution(logits, temperature, |distribution| distribution.sample(rng))
}

thread_local! {
    /// One vocabulary's softmax weights and block sums, per thread (the
    /// engine draws for many sequences in parallel).
    static SOFTMAX: RefCell<(Vec<f32>, Vec<f64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` on the distribution of one position's `logits` at
/// `temperature`, whose softmax lives in this thread's buffers: a draw
/// allocates nothing. `f` must not call back into this module's free
/// functions (the buffers are borrowed for its duration).
pub fn with_distribution<T>(
    logits: &[f32],
    temperature: Option<f64>,
    f: impl FnOnce(&mut Distribution<'_>) -> T,
) -> T {
    SOFTMAX.with(|buffers| {
        let (weights, block_sums) = &mut *buffers.borrow_mut();
        f(&mut Distribution {
            logits,
            temperature,
            weights,
            block_sums,
            softmax: None,
        })
    })
}

/// One position's logits at a temperature, with the softmax that drawing
/// and scoring share, computed on first need. Greedy draws need none (the
/// argmax), and greedy scores use temperature 1, so a greedy draw without
/// log-probs never runs the softmax.
pub struct Distribution<'a> {
    logits: &'a [f32],
    temperature: Option<f64>,
    weights: &'a mut Vec<f32>,
    block_sums: &'a mut Vec<f64>,
    /// What `weights` and `block_sums` hold, once computed.
    softmax: Option<Softmax>,
}

/// A softmax computed into a [`Distribution`]'s buffers.
#[derive(Clone, Copy)]
struct Softmax {
    /// The temperature it was computed at.
    t: f64,
    /// The weights' total: the block sums summed in order (NaN when the
    /// kernel refused the scale).
    total: f64,
    /// The largest logit, when the kernel's `max x` is it exactly (its
    /// scale is 1: every request at temperature 1 and every greedy score),
    /// which spares [`Distribution::log_prob`] a pass over the vocabulary.
    max: Option<f32>,
}

impl Distribution<'_> {
    /// Picks the next token: the argmax when the temperature is `None` or
    /// 0, else a draw from softmax(logits / t).
    ///
    /// The draw is one uniform f64 from `rng` times the softmax's total,
    /// found among [`SOFTMAX_BLOCK`] block sums, then among that block's
    /// weights ([`softmax_weights`]: the same bits on every CPU tier), so a
    /// seed draws the same tokens on every machine. A row without a finite,
    /// positive total (NaN or infinite logits) gives its argmax.
    pub fn sample(&mut self, rng: &mut StdRng) -> Result<u32> {
        let Some(t) = draw_temperature(self.temperature)? else {
            return Ok(argmax(self.logits));
        };
        let uniform = rng.random::<f64>();
        let total = self.softmax(t).total;
        let drawn = draw(self.weights, self.block_sums, total, uniform);
        Ok(drawn.unwrap_or_else(|| argmax(self.logits)))
    }

    /// The log-probability of `token` (any token, not only a drawn one),
    /// and of the `top` likeliest tokens, under the distribution
    /// [`Distribution::sample`] draws from: log softmax(logits / t), with
    /// t = 1 when greedy (greedy draws from no distribution; the model's
    /// own is the one a trainer scores against). The softmax's total is
    /// the draw's (f32 weights summed in f64), the rest f64, so the
    /// figures do not depend on the vocabulary's size.
    pub fn log_prob(&mut self, token: u32, top: usize) -> TokenLogProb {
        let t = match self.temperature {
            Some(t) if t > 0.0 => t,
            _ => 1.0,
        };
        let softmax = self.softmax(t);
        let logits = self.logits;
        let max = softmax
            .max
            .unwrap_or_else(|| logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        // A temperature so small that 1/t overflows f32 (below about
        // 3e-39) leaves the f32 softmax no finite total, and the draw takes
        // the argmax. Its log-probs come from the same softmax in f64, where
        // (l - max) / t still fits; a figure past f64's range is floored at
        // its most negative number, so that an answer's JSON holds a number
        // (serde writes a non-finite float as null). NaN logits stay NaN.
        let degenerate = !(softmax.total > 0.0 && softmax.total.is_finite());
        let log_total = if degenerate {
            logits
                .iter()
                .map(|&l| ((f64::from(l) - f64::from(max)) / t).exp())
                .sum::<f64>()
                .ln()
        } else {
            softmax.total.ln()
        };
        let log_prob = |i: usize| {
            let log_prob = (f64::from(logits[i]) - f64::from(max)) / t - log_total;
            if degenerate && log_prob == f64::NEG_INFINITY {
                f64::MIN
            } else {
                log_prob
            }
        };
        TokenLogProb::of(logits, token, top, log_prob)
    }

    /// The softmax of logits / `t` (see [`softmax_weights`]) in the
    /// buffers, computed unless they already hold it.
    fn softmax(&mut self, t: f64) -> Softmax {
        if let Some(softmax) = self.softmax.filter(|softmax| softmax.t == t) {
            return softmax;
        }
        self.weights.resize(self.logits.len(), 0.0);
        self.block_sums
            .resize(self.logits.len().div_ceil(SOFTMAX_BLOCK), 0.0);
        // `t` > 0: a scale that overflows f32 is an infinite one, whose
        // softmax is the argmax's (as a NaN-total row falls to).
        let scale = ((1.0 / t) as f32).min(f32::MAX);
        let max = match softmax_weights(self.logits, scale, self.weights, self.block_sums) {
            // `max x` is the largest logit times the scale, rounded.
            Ok(max) => (scale == 1.0).then_some(max),
            // Only a scale that rounds to 0 is refused: t above 1e38.
            Err(_) => {
                self.block_sums.fill(f64::NAN);
                None
            }
        };
        let softmax = Softmax {
            t,
            total: self.block_sums.iter().sum(),
            max,
        };
        self.softmax = Some(softmax);
        softmax
    }
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

impl TokenLogProb {
    /// `token`'s figure and the `top` likeliest tokens' (by `logits`),
    /// each by `log_prob` of its index.
    fn of(logits: &[f32], token: u32, top: usize, log_prob: impl Fn(usize) -> f64) -> Self {
        TokenLogProb {
            token,
            log_prob: log_prob(token as usize),
            top: top_tokens(logits, top)
                .into_iter()
                .map(|i| (i as u32, log_prob(i)))
                .collect(),
        }
    }
}

/// The log-probability of `token`, and of the `top` likeliest tokens, at
/// `temperature` (see [`Distribution::log_prob`]).
pub fn token_log_prob(
    logits: &[f32],
    temperature: Option<f64>,
    token: u32,
    top: usize,
) -> TokenLogProb {
    with_distribution(logits, temperature, |distribution| {
        distribution.log_prob(token, top)
    })
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
        return Err(qforge_formats::Error::Shape("the prompt has no tokens".into()).into());
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

/// The indices of the `top` largest logits, best first (the earlier of two
/// equal ones first); the vocabulary is read once.
fn top_tokens(logits: &[f32], top: usize) -> Vec<usize> {
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
    best
}

/// The temperature a draw divides the logits by: `None` for a greedy
/// one (no temperature, or 0), an error for a negative or non-finite one.
fn draw_temperature(temperature: Option<f64>) -> Result<Option<f64>> {
    match temperature {
        None | Some(0.0) => Ok(None),
        Some(t) if t > 0.0 && t.is_finite() => Ok(Some(t)),
        Some(t) => Err(qforge_formats::Error::Shape(format!(
            "temperature must be ≥ 0 and finite, got {t}"
        ))
        .into()),
    }
}

/// The token on which `uniform · total` falls (`total`: the block sums
/// summed in order): the block it falls in by the block sums, then the
/// token by that block's weights. `None` when the total is not finite and
/// positive (NaN or infinite logits) or no weight can be drawn; the
/// caller takes the argmax.
fn draw(weights: &[f32], block_sums: &[f64], total: f64, uniform: f64) -> Option<u32> {
    if !(total > 0.0 && total.is_finite()) {
        return None;
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
                return Some((first + i) as u32);
            }
        }
        // The block's sum is its weights' in another order; what
        // rounding leaves over belongs to its last token.
        if let Some(i) = last_drawable {
            return Some((first + i) as u32);
        }
    }
    None
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

    /// The draw and the score as they were before one softmax served both
    /// (two passes of `exp`, the largest logit found twice): what the
    /// users' seeds and the recorded figures were made with. The choice of
    /// the top tokens, the temperature's check and the walk through the
    /// blocks, which that change left as they were, are the module's own.
    mod before {
        use std::cell::RefCell;

        use qforge_kernels::exp::{SOFTMAX_BLOCK, softmax_weights};
        use rand::{Rng, rngs::StdRng};

        use super::super::{TokenLogProb, argmax, draw, draw_temperature};

        use qforge_model::Result;

        pub(super) fn sample(
            logits: &[f32],
            temperature: Option<f64>,
            rng: &mut StdRng,
        ) -> Result<u32> {
            let Some(t) = draw_temperature(temperature)? else {
                return Ok(argmax(logits));
            };
            let uniform = rng.random::<f64>();
            Ok(with_softmax(logits, t, |weights, block_sums| {
                let total: f64 = block_sums.iter().sum();
                draw(weights, block_sums, total, uniform).unwrap_or_else(|| argmax(logits))
            }))
        }

        thread_local! {
            /// One vocabulary's softmax weights and block sums, per thread (the
            /// engine draws for many sequences in parallel).
            static SOFTMAX: RefCell<(Vec<f32>, Vec<f64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
        }

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

        pub(super) fn token_log_prob(
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
            TokenLogProb::of(logits, token, top, |i| shifted(logits[i]) - log_total)
        }
    }

    /// [`a_seed_draws_the_tokens_it_always_drew`]'s fold of the draws.
    const PINNED_DRAWS: u64 = 0xaa4d_718c_27aa_db0b;

    /// Whether two figures are the same to the last bit (any NaN is NaN).
    fn same(a: f64, b: f64) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Logits like a model's: mostly spread over a few nats, a few far
    /// above, ties, and entries no draw can reach.
    fn row(vocab: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..vocab)
            .map(|i| match rng.random_range(0..100) {
                0 => 12.0 + rng.random_range(0.0f32..4.0),
                1 => f32::NEG_INFINITY,
                2 => -200.0,
                3 => 1.5,
                _ => rng.random_range(-6.0f32..6.0) + (i % 7) as f32 * 0.01,
            })
            .collect()
    }

    #[test]
    fn one_softmax_draws_and_scores_to_the_bit_what_sample_and_token_log_prob_did() {
        let temperatures = [
            None,
            Some(0.0),
            Some(0.05),
            Some(0.3),
            Some(0.7),
            Some(1.0),
            Some(1.3),
            Some(4.0),
            Some(1e-30),
        ];
        let mut rows: Vec<(Vec<f32>, u64)> = Vec::new();
        for seed in 0..24 {
            rows.push((row(49_152, seed), seed));
        }
        for seed in 0..200 {
            rows.push((row(1 + (seed as usize * 37) % 700, seed), seed));
        }
        // Rows the draw falls back to the argmax for.
        rows.push((vec![1.0, f32::NAN, 3.0], 1));
        rows.push((vec![1.0, f32::INFINITY, 3.0], 2));
        rows.push((vec![f32::NEG_INFINITY; 5], 3));
        let (mut draws, mut not_argmax) = (0, 0);
        for (logits, seed) in &rows {
            for temperature in temperatures {
                let mut old_rng = StdRng::seed_from_u64(*seed);
                let mut new_rng = StdRng::seed_from_u64(*seed);
                for step in 0..3u64 {
                    let forced = ((seed * 7_919 + step * 104_729) % logits.len() as u64) as u32;
                    let old = before::sample(logits, temperature, &mut old_rng).unwrap();
                    let (new, drawn, other) = with_distribution(logits, temperature, |d| {
                        let new = d.sample(&mut new_rng).unwrap();
                        (new, d.log_prob(new, 3), d.log_prob(forced, 0))
                    });
                    assert_eq!(new, old, "seed {seed}, {temperature:?}, step {step}");
                    for (entry, token, top) in [(drawn, old, 3), (other, forced, 0)] {
                        let expected = before::token_log_prob(logits, temperature, token, top);
                        assert_eq!(entry.token, token);
                        assert!(
                            same(entry.log_prob, expected.log_prob),
                            "seed {seed}, {temperature:?}, token {token}: {} vs {}",
                            entry.log_prob,
                            expected.log_prob
                        );
                        assert_eq!(entry.top.len(), expected.top.len());
                        for (&(i, a), &(j, b)) in entry.top.iter().zip(&expected.top) {
                            assert!(i == j && same(a, b), "top {i} {a} vs {j} {b}");
                        }
                    }
                    draws += 1;
                    not_argmax += usize::from(new != argmax(logits));
                }
                // Both consumed the same uniforms.
                assert_eq!(old_rng.random::<u64>(), new_rng.random::<u64>());
            }
        }
        // The draws spread (about a third left the argmax; greedy and
        // cold rows are a third of them), so the block search was compared.
        assert!(not_argmax > draws / 4, "{not_argmax} of {draws}");
    }

    /// What a seed draws is part of qforge's contract (a trainer
    /// reproduces its behaviour log-probs from it, and the recorded
    /// figures were made with it): the draws of fixed rows and seeds,
    /// folded into one number, are those of the sampler this test was
    /// written against. A change that moves it changes users' rollouts:
    /// say so in the CHANGELOG, then update the number.
    #[test]
    fn a_seed_draws_the_tokens_it_always_drew() {
        let mut folded = 0xcbf2_9ce4_8422_2325u64;
        for seed in 0..40 {
            let logits = row(1 + (seed as usize * 211) % 49_152, seed);
            let mut rng = StdRng::seed_from_u64(seed);
            for temperature in [Some(0.3), Some(0.7), Some(1.0), Some(1.3)] {
                for _ in 0..4 {
                    let token = sample(&logits, temperature, &mut rng).unwrap();
                    folded = (folded ^ u64::from(token)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        assert_eq!(folded, PINNED_DRAWS, "{folded:#x}");
    }

    #[test]
    fn a_greedy_draw_without_scores_runs_no_softmax_and_a_score_reuses_the_draws() {
        let logits = row(1_000, 5);
        with_distribution(&logits, Some(0.0), |d| {
            d.sample(&mut StdRng::seed_from_u64(1)).unwrap();
            assert!(d.softmax.is_none());
            // A greedy score is at temperature 1, whose largest logit the
            // kernel gives exactly.
            d.log_prob(0, 0);
            assert!(d.softmax.is_some_and(|s| s.t == 1.0 && s.max.is_some()));
        });
        with_distribution(&logits, Some(0.7), |d| {
            d.sample(&mut StdRng::seed_from_u64(1)).unwrap();
            let computed = d.softmax.unwrap();
            // A score that ran the softmax again would not see this total.
            d.softmax = Some(Softmax {
                total: 1.0,
                ..computed
            });
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let expected = (f64::from(logits[0]) - f64::from(max)) / 0.7;
            assert!(same(d.log_prob(0, 0).log_prob, expected));
            assert!(computed.max.is_none(), "scale 1/0.7 is not 1");
        });
    }

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
    fn a_temperature_that_overflows_f32_draws_the_argmax_and_scores_finite_numbers() {
        // The OpenAI fuzz test sent temperature 6e-272: 1/t overflows f32,
        // and the log-probs came out NaN (null in the answer's JSON).
        let logits = [2.0f32, -1.0, 2.5, 0.5];
        for t in [6.079_738_781_013_78e-272, 1e-320] {
            let mut rng = StdRng::seed_from_u64(0);
            let (token, entry) = with_distribution(&logits, Some(t), |d| -> Result<_> {
                let token = d.sample(&mut rng)?;
                Ok((token, d.log_prob(token, 4)))
            })
            .unwrap();
            assert_eq!(token, 2, "{t}");
            assert_eq!(entry.log_prob, 0.0, "{t}");
            assert_eq!(entry.top[0], (2, 0.0), "{t}");
            for &(i, lp) in &entry.top[1..] {
                assert!(lp.is_finite() && lp < -1e200, "{t}: token {i} {lp}");
            }
        }
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
