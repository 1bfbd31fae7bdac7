//! The calibration recipe, hashed into provenance, and the plan: the samples it
//! selects from the data, cut into batches with stable ids.

use std::collections::BTreeMap;

use qforge_core::{BatchId, Digest, DigestBuilder, SplitMix64};
use qforge_model::Statistics;
use serde::{Deserialize, Serialize};

use crate::data::{Dataset, EpisodeContent, Record};
use crate::error::{Error, Result};

/// How samples are drawn from the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Stratify {
    /// A seeded shuffle.
    None,
    /// Evenly across reward quantiles, so high- and low-reward behaviour are
    /// both covered.
    Reward,
}

/// What a pass records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// Histograms of every linear input (for activation scales).
    Activation,
    /// Histograms plus per-channel abs-max of every linear input (for
    /// smoothing factors).
    Smoothing,
    /// The exact Gram matrices `Σ x xᵀ` of some linear inputs (GPTQ's
    /// Hessians).
    Hessian(HessianPass),
    /// The activation pass and GPTQ's first Hessian pass in one forward:
    /// every linear input's histogram, and the Gram matrices of some.
    #[serde(rename = "activation+hessian")]
    ActivationAndHessian(HessianPass),
}

/// The linear inputs a Hessian pass sums `Σ x xᵀ` of, each with the
/// run-wide fixed-point exponent its integers use
/// ([`qforge_core::Gram::run_exponent`]).
/// A pipeline cuts a model's inputs into such passes so that one pass's
/// matrices fit in memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HessianPass {
    /// Observation point → exponent.
    pub points: BTreeMap<String, i32>,
    /// Linear layers the pass runs with GPTQ's rounding of them (dequantized)
    /// instead of their full-precision weights, each with the digest of its
    /// rounding ([`qforge_model::Int8Weight::digest`]): GPTQ propagating its
    /// rounding into the inputs of the layers it rounds next. Empty: the
    /// pass observes the full-precision model.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rounded: BTreeMap<String, Digest>,
}

impl Pass {
    /// The name recorded in provenance.
    pub fn name(&self) -> &'static str {
        match self {
            Pass::Activation => "activation",
            Pass::Smoothing => "smoothing",
            Pass::Hessian(_) => "hessian",
            Pass::ActivationAndHessian(_) => "activation+hessian",
        }
    }

    /// The layers the pass runs with GPTQ's rounding of them, by the
    /// rounding's digest ([`HessianPass::rounded`]); empty for a pass that
    /// observes the full-precision model.
    pub fn rounded(&self) -> &BTreeMap<String, Digest> {
        static NONE: BTreeMap<String, Digest> = BTreeMap::new();
        match self {
            Pass::Hessian(hessian) => &hessian.rounded,
            _ => &NONE,
        }
    }

    /// What an observer records for this pass.
    pub fn statistics(&self) -> Statistics {
        match self {
            Pass::Activation => Statistics::Histograms { per_channel: false },
            Pass::Smoothing => Statistics::Histograms { per_channel: true },
            Pass::Hessian(h) => Statistics::Grams(h.points.clone()),
            Pass::ActivationAndHessian(h) => Statistics::HistogramsAndGrams(h.points.clone()),
        }
    }
}

/// Everything besides model and data that decides the statistics. Equal
/// recipes, and only equal recipes, have equal digests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Samples to draw: sequences for LLMs, observations for policies.
    pub samples: usize,
    /// Most tokens per sequence (LLMs).
    pub seq_len: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Seed of the sampling.
    pub seed: u64,
    /// How samples are drawn.
    pub stratify: Stratify,
    /// The pass.
    pub pass: Pass,
}

impl Default for Recipe {
    fn default() -> Self {
        Self {
            samples: 512,
            seq_len: 512,
            batch_size: 8,
            seed: 0,
            stratify: Stratify::None,
            pass: Pass::Activation,
        }
    }
}

impl Recipe {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if self.samples == 0 || self.seq_len < 2 || self.batch_size == 0 {
            return Err(Error::Recipe(format!(
                "samples ({}), batch size ({}) must be ≥ 1 and seq_len ({}) ≥ 2",
                self.samples, self.batch_size, self.seq_len
            )));
        }
        Ok(())
    }

    /// SHA-256 of the recipe's canonical JSON (fields in declaration order).
    pub fn digest(&self) -> Digest {
        let json = serde_json::to_string(self).expect("a recipe serializes");
        Digest::of(format!("qforge.recipe.v1 {json}").as_bytes())
    }
}

/// One calibration sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Sample {
    /// A token sequence.
    Tokens(Vec<u32>),
    /// One observation.
    Observation(Vec<f32>),
}

/// A batch of samples with its stable id.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Index in the plan plus the hash of the content.
    pub id: BatchId,
    /// The samples.
    pub samples: Vec<Sample>,
}

/// The batches a pass observes.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Batches in index order.
    pub batches: Vec<Batch>,
    /// Samples planned (fewer than the recipe asks when the data is short).
    pub samples: usize,
    /// Tokens or observation rows planned.
    pub rows: usize,
    /// The reward strata of a `Stratify::Reward` plan, lowest rewards first
    /// (empty otherwise): what a run reports to show which rewards it drew.
    pub strata: Vec<Stratum>,
}

/// One reward stratum of a plan: the rewards it spans and the samples it
/// gave, so a run can show that both low- and high-reward behaviour were
/// drawn rather than asserting it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stratum {
    /// Lowest reward in the stratum.
    pub min_reward: f64,
    /// Highest reward in the stratum.
    pub max_reward: f64,
    /// Samples the data holds in it.
    pub available: usize,
    /// Samples the plan drew from it.
    pub drawn: usize,
}

impl Plan {
    /// Every planned sample, in batch order.
    pub fn samples(&self) -> impl Iterator<Item = &Sample> {
        self.batches.iter().flat_map(|b| &b.samples)
    }

    /// SHA-256 over the batch ids in order: two machines that planned the
    /// same batches from the same data agree on it, so a worker can prove it
    /// holds the coordinator's plan before observing anything.
    pub fn digest(&self) -> Digest {
        let mut d = DigestBuilder::default();
        d.update(b"qforge.plan.v1");
        for batch in &self.batches {
            d.update(&batch.id.index.to_le_bytes());
            d.update(&batch.id.content.0);
        }
        d.finish()
    }
}

/// The platform-independent sort key of candidate `i` in the shuffle seeded
/// with `seed`: SplitMix64's first draw from `seed` mixed with the first draw
/// from `i`. Fixed forever, since batch ids follow the order.
fn sort_key(seed: u64, i: usize) -> u64 {
    let first_draw = |x| SplitMix64::new(x).next_u64();
    first_draw(seed ^ first_draw(i as u64))
}

/// Turns an LLM episode into token ids (the caller's tokenizer and chat
/// template).
pub type Tokenize<'a> = &'a dyn Fn(&EpisodeContent) -> Result<Vec<u32>>;

/// Builds the plan: draws `recipe.samples` samples (seeded, optionally
/// stratified by reward) and cuts them into batches. `tokenize` is required
/// for LLM episodes.
pub fn plan(dataset: &Dataset, recipe: &Recipe, tokenize: Option<Tokenize<'_>>) -> Result<Plan> {
    recipe.validate()?;
    // Candidates: (sample, reward).
    let mut candidates: Vec<(Sample, Option<f64>)> = Vec::new();
    for record in &dataset.records {
        match record {
            Record::Episode { content, reward } => {
                let tokenize = tokenize.ok_or_else(|| {
                    Error::Data("LLM episodes need a language model (got a policy)".into())
                })?;
                let mut ids = tokenize(content)?;
                ids.truncate(recipe.seq_len);
                if !ids.is_empty() {
                    candidates.push((Sample::Tokens(ids), *reward));
                }
            }
            Record::Trajectory {
                observations,
                reward,
            } => candidates.extend(
                observations
                    .iter()
                    .map(|o| (Sample::Observation(o.clone()), *reward)),
            ),
        }
    }
    if candidates.is_empty() {
        return Err(Error::Data("the data yields no samples".into()));
    }
    let (order, strata) = match recipe.stratify {
        Stratify::None => {
            let mut order: Vec<usize> = (0..candidates.len()).collect();
            order.sort_by_key(|&i| (sort_key(recipe.seed, i), i));
            order.truncate(recipe.samples);
            (order, Vec::new())
        }
        Stratify::Reward => stratified(&candidates, recipe)?,
    };
    let selected: Vec<Sample> = order.into_iter().map(|i| candidates[i].0.clone()).collect();
    let rows = selected
        .iter()
        .map(|s| match s {
            Sample::Tokens(t) => t.len(),
            Sample::Observation(_) => 1,
        })
        .sum();
    let batches = selected
        .chunks(recipe.batch_size)
        .enumerate()
        .map(|(index, samples)| Batch {
            id: BatchId {
                index: index as u64,
                content: content_digest(samples),
            },
            samples: samples.to_vec(),
        })
        .collect();
    Ok(Plan {
        batches,
        samples: selected.len(),
        rows,
        strata,
    })
}

/// Draws evenly from reward quantiles: candidates are sorted by reward, cut
/// into strata of equal size, each shuffled by the seed, and taken round-robin.
/// Returns the order and each stratum's range and counts.
fn stratified(
    candidates: &[(Sample, Option<f64>)],
    recipe: &Recipe,
) -> Result<(Vec<usize>, Vec<Stratum>)> {
    let mut by_reward: Vec<(f64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, (_, r))| {
            r.map(|r| (r, i)).ok_or_else(|| {
                Error::Data("--stratify reward needs a reward on every record".into())
            })
        })
        .collect::<Result<_>>()?;
    by_reward.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let count = recipe.samples.clamp(1, 10).min(by_reward.len());
    let mut strata = Vec::with_capacity(count);
    let mut groups: Vec<Vec<usize>> = (0..count)
        .map(|s| {
            let lo = s * by_reward.len() / count;
            let hi = (s + 1) * by_reward.len() / count;
            strata.push(Stratum {
                min_reward: by_reward[lo].0,
                max_reward: by_reward[hi - 1].0,
                available: hi - lo,
                drawn: 0,
            });
            let mut group: Vec<usize> = by_reward[lo..hi].iter().map(|&(_, i)| i).collect();
            group.sort_by_key(|&i| (sort_key(recipe.seed, i), i));
            group.reverse(); // pop() takes from the front of the shuffle
            group
        })
        .collect();
    let mut order = Vec::with_capacity(recipe.samples);
    while order.len() < recipe.samples && groups.iter().any(|g| !g.is_empty()) {
        for (group, stratum) in groups.iter_mut().zip(&mut strata) {
            if order.len() == recipe.samples {
                break;
            }
            if let Some(i) = group.pop() {
                order.push(i);
                stratum.drawn += 1;
            }
        }
    }
    Ok((order, strata))
}

/// SHA-256 of a batch's canonical bytes.
fn content_digest(samples: &[Sample]) -> Digest {
    let mut d = DigestBuilder::default();
    for sample in samples {
        match sample {
            Sample::Tokens(ids) => {
                d.update(b"T");
                d.update(&(ids.len() as u64).to_le_bytes());
                for id in ids {
                    d.update(&id.to_le_bytes());
                }
            }
            Sample::Observation(values) => {
                d.update(b"O");
                d.update(&(values.len() as u64).to_le_bytes());
                for v in values {
                    d.update(&v.to_bits().to_le_bytes());
                }
            }
        }
    }
    d.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::parse_jsonl;

    fn trajectories(n: usize) -> Dataset {
        let text: String = (0..n)
            .map(|i| {
                format!("{{\"observations\": [[{i}, 0.5], [{i}, 1.5]], \"rewards\": [{i}]}}\n")
            })
            .collect();
        parse_jsonl(text.as_bytes(), "t", false).unwrap()
    }

    #[test]
    fn plans_are_deterministic_and_ids_follow_content() {
        let data = trajectories(50);
        let recipe = Recipe {
            samples: 40,
            batch_size: 8,
            ..Recipe::default()
        };
        let a = plan(&data, &recipe, None).unwrap();
        let b = plan(&data, &recipe, None).unwrap();
        assert_eq!(a, b);
        assert_eq!((a.batches.len(), a.samples), (5, 40));
        let other = plan(
            &data,
            &Recipe {
                seed: 1,
                ..recipe.clone()
            },
            None,
        )
        .unwrap();
        assert_ne!(a.batches[0].id, other.batches[0].id);
        assert_ne!(
            recipe.digest(),
            Recipe {
                seed: 1,
                ..recipe.clone()
            }
            .digest()
        );
        assert_eq!(recipe.digest(), recipe.clone().digest());
    }

    #[test]
    fn reward_stratification_covers_both_ends() {
        let data = trajectories(100);
        let recipe = Recipe {
            samples: 20,
            stratify: Stratify::Reward,
            ..Recipe::default()
        };
        let p = plan(&data, &recipe, None).unwrap();
        let firsts: Vec<f32> = p
            .batches
            .iter()
            .flat_map(|b| &b.samples)
            .map(|s| match s {
                Sample::Observation(o) => o[0],
                Sample::Tokens(_) => unreachable!(),
            })
            .collect();
        // Trajectory i has reward i: every decile of rewards is represented.
        for decile in 0..10 {
            let lo = (decile * 10) as f32;
            assert!(
                firsts.iter().any(|&r| r >= lo && r < lo + 10.0),
                "decile {decile}"
            );
        }
        // Ten strata of ten trajectories (two observations each), two drawn
        // from each, lowest rewards first.
        assert_eq!(p.strata.len(), 10);
        for (s, stratum) in p.strata.iter().enumerate() {
            let lo = (s * 10) as f64;
            assert_eq!(
                (
                    stratum.min_reward,
                    stratum.max_reward,
                    stratum.available,
                    stratum.drawn
                ),
                (lo, lo + 9.0, 20, 2),
                "stratum {s}"
            );
        }
        let unstratified = plan(
            &data,
            &Recipe {
                stratify: Stratify::None,
                ..recipe.clone()
            },
            None,
        )
        .unwrap();
        assert!(unstratified.strata.is_empty());
        let unrewarded = parse_jsonl(b"{\"observations\": [[1]]}\n", "u", false).unwrap();
        assert!(plan(&unrewarded, &recipe, None).is_err());
    }
}
