//! Observing one batch: the map step of a pass.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use qforge_core::{BatchId, Digest, DigestBuilder, Provenance, Stats};
use qforge_model::{HiddenState, Int8Weight, Linear, Llama, Model, Observer, StatsObserver};

use crate::error::{Error, Result};
use crate::plan::{Batch, Pass, Recipe, Sample};
use crate::transform::Transform;

/// What identifies a calibration pass: the hashes of model, data and recipe,
/// and the transforms earlier passes implied. Every batch's statistics carry
/// it in their provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Hash of the model observed: the model files' digest, chained through
    /// `transforms` ([`crate::transformed_digest`]).
    pub model: Digest,
    /// Hash of the data file.
    pub data: Digest,
    /// The recipe.
    pub recipe: Recipe,
    /// Batches in the plan (the denominator of coverage).
    pub planned: u64,
    /// What earlier passes changed in the model, applied in order before
    /// observing.
    pub transforms: Vec<Transform>,
}

impl Job {
    /// The provenance of one batch's statistics under this job.
    pub fn provenance(&self, batch: BatchId) -> Provenance {
        Provenance::single(
            Some(self.model),
            self.data,
            self.recipe.digest(),
            self.recipe.pass.name(),
            batch,
            self.planned,
        )
    }
}

/// Runs `batch` through the full-precision model `target` (already
/// transformed as `job.transforms` say) and returns its statistics:
/// every linear input's histogram (and per-channel abs-max for the smoothing
/// pass), with the batch's id in the provenance.
///
/// A language model's Hessian pass resumes each batch from a hidden state
/// that `hidden` kept from an earlier pass over the same model and batch,
/// where it has one, and keeps the states this pass reached. A state is
/// resumed only where every layer before it ran as in this pass: with GPTQ
/// propagating its rounding, a state an earlier pass computed through
/// layers since rounded is not.
pub fn observe_batch(
    target: &Model,
    batch: &Batch,
    job: &Job,
    hidden: &HiddenStates,
) -> Result<Stats> {
    let mut observer = StatsObserver::new(job.recipe.pass.statistics());
    match (target, first_observed_layer(&job.recipe.pass)) {
        (Model::Language(lm), Some(first)) => {
            let sequences = token_sequences(&batch.samples)?;
            let key = (job.model, batch.id);
            let below = RoundedBelow::of(&job.recipe.pass);
            let resume = hidden.deepest(&key, first, &below);
            // A pass running GPTQ's roundings is one of a pipeline that
            // rounds each layer it observes before the next pass.
            let rounds_observed = !job.recipe.pass.rounded().is_empty();
            let kept = lm.model.observe_resuming(
                &sequences,
                &mut observer,
                resume.as_ref(),
                rounds_observed,
            )?;
            hidden.keep(key, kept, &below);
        }
        _ => forward_samples(target, &batch.samples, &mut observer)?,
    }
    Ok(Stats {
        provenance: job.provenance(batch.id),
        tensors: observer.tensors,
    })
}

/// The token sequences of a language model's batch.
fn token_sequences(samples: &[Sample]) -> Result<Vec<Vec<u32>>> {
    samples
        .iter()
        .map(|s| match s {
            Sample::Tokens(ids) => Ok(ids.clone()),
            Sample::Observation(_) => Err(Error::Data(
                "policy observations cannot calibrate a language model".into(),
            )),
        })
        .collect()
}

/// The first decoder layer a pass observes, for a pass that may resume from
/// a kept hidden state: a Hessian pass, whose points are listed (`lm_head`
/// comes after every decoder layer). Other passes observe every layer.
fn first_observed_layer(pass: &Pass) -> Option<usize> {
    let Pass::Hessian(hessian) = pass else {
        return None;
    };
    hessian
        .points
        .keys()
        .map(|point| Llama::layer_of(point).unwrap_or(usize::MAX))
        .min()
}

/// Most bytes of hidden states a process keeps between passes: 2 GiB holds
/// the two states per batch of 128 sequences of 512 tokens of a 4096-wide
/// model (Llama-3-8B).
pub const HIDDEN_STATE_BUDGET: usize = 2 << 30;

/// Which of a pass's layers run rounded ([`crate::HessianPass::rounded`]),
/// summed up per depth: the digest of the roundings of the layers before
/// decoder layer `l` is what a hidden state entering `l` depends on beside
/// the model.
struct RoundedBelow<'a> {
    rounded: &'a BTreeMap<String, Digest>,
}

impl<'a> RoundedBelow<'a> {
    fn of(pass: &'a Pass) -> Self {
        Self {
            rounded: pass.rounded(),
        }
    }

    /// The digest of the roundings of every layer before decoder layer
    /// `layer` (`lm_head` follows them all).
    fn at(&self, layer: usize) -> Digest {
        let mut digest = DigestBuilder::default();
        digest.update(b"qforge.rounded-below.v1");
        for (name, rounding) in self.rounded {
            if Llama::layer_of(name).is_some_and(|l| l < layer) {
                digest.update(name.as_bytes());
                digest.update(&rounding.0);
            }
        }
        digest.finish()
    }
}

/// Hidden states kept between the observing passes of one process, per
/// model (after its transforms) and batch: a pass that observes deep layers
/// only (GPTQ's Hessian passes after the first) resumes each batch from the
/// deepest state at or before its first observed layer instead of from the
/// embedding, so the passes together run the model about once instead of
/// once per pass up to its layers. Results do not change (resuming computes
/// what the whole forward computes), only time. A batch this process holds
/// no state for (another worker observed it before, it was reclaimed from a
/// dead one, or the budget was full) starts from the embedding.
#[derive(Default)]
pub struct HiddenStates {
    held: Mutex<HashMap<(Digest, BatchId), Vec<KeptState>>>,
}

/// A kept hidden state, with the digest of the roundings of the layers
/// before it ([`RoundedBelow`]).
struct KeptState {
    state: HiddenState,
    rounded_below: Digest,
}

impl HiddenStates {
    /// The deepest state kept for `key` that enters layer `layer` or one
    /// before it, through the layers as `below` rounds them.
    fn deepest(
        &self,
        key: &(Digest, BatchId),
        layer: usize,
        below: &RoundedBelow<'_>,
    ) -> Option<HiddenState> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(key)?
            .iter()
            .filter(|kept| {
                kept.state.layer <= layer && kept.rounded_below == below.at(kept.state.layer)
            })
            .max_by_key(|kept| kept.state.layer)
            .map(|kept| kept.state.clone())
    }

    /// Keeps `states` (reached through the layers as `below` rounds them)
    /// for `key` in place of what was kept, if the budget allows. States of
    /// other models are dropped: a process runs one pass at a time, so a
    /// pass of another model (a method the search tried before, a run
    /// served before) will not resume from them.
    fn keep(&self, key: (Digest, BatchId), states: Vec<HiddenState>, below: &RoundedBelow<'_>) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|(model, batch), _| *model == key.0 && *batch != key.1);
        let bytes = |states: &Vec<KeptState>| states.iter().map(|k| k.state.bytes()).sum::<usize>();
        let states: Vec<KeptState> = states
            .into_iter()
            .map(|state| KeptState {
                rounded_below: below.at(state.layer),
                state,
            })
            .collect();
        let used: usize = held.values().map(bytes).sum();
        if used + bytes(&states) <= HIDDEN_STATE_BUDGET {
            held.insert(key, states);
        }
    }

    /// Drops every kept state (the passes that could resume are over).
    pub fn clear(&self) {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Runs `samples` (token sequences for a language model, observations for a
/// policy) through `target` in one forward, past `observer`.
pub fn forward_samples(
    target: &Model,
    samples: &[Sample],
    observer: &mut dyn Observer,
) -> Result<()> {
    match target {
        Model::Language(lm) => lm.model.observe(&token_sequences(samples)?, observer)?,
        Model::Policy(policy) => {
            let dim = policy.config().observation_dim;
            let mut rows = Vec::with_capacity(samples.len() * dim);
            for s in samples {
                match s {
                    Sample::Observation(o) if o.len() == dim => rows.extend_from_slice(o),
                    Sample::Observation(o) => {
                        return Err(Error::Data(format!(
                            "an observation has {} values; the policy takes {dim}",
                            o.len()
                        )));
                    }
                    Sample::Tokens(_) => {
                        return Err(Error::Data("LLM episodes cannot calibrate a policy".into()));
                    }
                }
            }
            policy.forward(&rows, Some(observer))?;
        }
    }
    Ok(())
}

/// GPTQ's rounding of the layers it rounded so far, as the passes that
/// propagate it run them ([`crate::HessianPass::rounded`]): the int8
/// weights by layer name, each with its digest. The process that rounded
/// holds them from the start; a cluster's worker fetches each from Redis
/// (verified against the digest the pass names) before it joins the pass.
/// A pass's target swaps them into its model ([`crate::Session::pass_target`]).
#[derive(Default)]
pub struct RoundedLayers {
    held: Mutex<BTreeMap<String, (Digest, Int8Weight)>>,
}

impl RoundedLayers {
    /// Holds `int8`, the rounding of layer `name` whose digest is `rounding`.
    pub fn insert(&self, name: String, rounding: Digest, int8: Int8Weight) {
        self.lock().insert(name, (rounding, int8));
    }

    /// The rounding of layer `name` whose digest is `rounding`, if held.
    pub fn get(&self, name: &str, rounding: &Digest) -> Option<Int8Weight> {
        match self.lock().get(name) {
            Some((digest, int8)) if digest == rounding => Some(int8.clone()),
            _ => None,
        }
    }

    /// The layers of `rounded` whose rounding is not held here.
    pub fn missing(&self, rounded: &BTreeMap<String, Digest>) -> Vec<(String, Digest)> {
        let held = self.lock();
        rounded
            .iter()
            .filter(|(name, rounding)| held.get(*name).is_none_or(|(d, _)| d != *rounding))
            .map(|(name, rounding)| (name.clone(), *rounding))
            .collect()
    }

    /// The layers `rounded` names, each `model`'s layer computing with the
    /// rounding there said.
    pub(crate) fn layers(
        &self,
        model: &Model,
        rounded: &BTreeMap<String, Digest>,
    ) -> Result<BTreeMap<String, Linear>> {
        let linears = model.linears();
        rounded
            .iter()
            .map(|(name, rounding)| {
                let int8 = self.get(name, rounding).ok_or_else(|| {
                    Error::Data(format!(
                        "the pass runs {name} as GPTQ rounded it (sha256 {rounding}), a rounding this process does not hold"
                    ))
                })?;
                let (_, _, layer) = linears.iter().find(|(n, _, _)| n == name).ok_or_else(|| {
                    Error::Data(format!("the pass rounds {name}, which the model does not have"))
                })?;
                Ok((name.clone(), layer.with_rounded_weight(int8)?))
            })
            .collect()
    }

    /// Drops the roundings `rounded` does not name.
    pub fn retain(&self, rounded: &BTreeMap<String, Digest>) {
        self.lock()
            .retain(|name, (digest, _)| rounded.get(name) == Some(digest));
    }

    /// Drops every rounding (the passes that run them are over).
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Digest, Int8Weight)>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::plan::HessianPass;

    /// A Hessian pass over one input, running the layers `rounded` names
    /// rounded.
    fn job(point: &str, rounded: &BTreeMap<String, Digest>) -> Job {
        let pass = Pass::Hessian(HessianPass {
            points: BTreeMap::from([(point.to_owned(), -20)]),
            rounded: rounded.clone(),
        });
        Job {
            model: Digest::of(b"smollm2"),
            data: Digest::of(b"data"),
            recipe: Recipe {
                pass,
                ..Recipe::default()
            },
            planned: 1,
            transforms: Vec::new(),
        }
    }

    /// With GPTQ propagating its rounding, a pass resumes a hidden state
    /// only where every layer before it ran as the pass runs it: a pass
    /// observing layer 1 after layer 0 was rounded gets from the states an
    /// earlier pass kept (entering layers 0 and 1, both at full precision)
    /// the statistics it gets from the embedding, which differ from the
    /// full-precision model's.
    #[test]
    fn a_pass_resumes_only_states_reached_through_the_layers_as_it_runs_them() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/smollm2-135m-instruct-q4_1.gguf");
        let model = qforge_model::open(&path).expect("scripts/fetch-models.sh fetches SmolLM2");
        let tokens: Vec<u32> = (0..24).map(|i| 100 + 37 * i).collect();
        let batch = Batch {
            id: BatchId {
                index: 0,
                content: Digest::of(b"batch"),
            },
            samples: vec![
                Sample::Tokens(tokens[..16].to_vec()),
                Sample::Tokens(tokens),
            ],
        };
        let hidden = HiddenStates::default();
        let none = BTreeMap::new();
        let first = job("model.layers.0.mlp.down_proj", &none);
        observe_batch(&model, &batch, &first, &hidden).unwrap();

        let rounded_layers = RoundedLayers::default();
        let mut rounded = BTreeMap::new();
        for (name, _, layer) in model.linears() {
            if Llama::layer_of(&name) == Some(0) {
                let int8 = layer.int8_weight().unwrap().into_owned();
                let digest = int8.digest();
                rounded_layers.insert(name.clone(), digest, int8);
                rounded.insert(name, digest);
            }
        }
        let layer_1 = "model.layers.1.self_attn.q_proj";
        let propagated = job(layer_1, &rounded);
        let target = model
            .with_layers(&rounded_layers.layers(&model, &rounded).unwrap())
            .unwrap();
        let key = (propagated.model, batch.id);
        let below = RoundedBelow::of(&propagated.recipe.pass);
        let resumed_from = hidden.deepest(&key, 1, &below).map(|state| state.layer);

        let resumed = observe_batch(&target, &batch, &propagated, &hidden).unwrap();
        let fresh = observe_batch(&target, &batch, &propagated, &HiddenStates::default()).unwrap();
        // (Not assert_eq: the statistics print as megabytes.)
        assert!(resumed == fresh, "a resumed pass observed other inputs");
        let full_precision = observe_batch(
            &model,
            &batch,
            &job(layer_1, &none),
            &HiddenStates::default(),
        )
        .unwrap();
        assert!(
            resumed.tensors != full_precision.tensors,
            "the rounding of layer 0 changed nothing"
        );
        assert_eq!(
            resumed_from,
            Some(0),
            "the state entering layer 1 ran layer 0 unrounded"
        );

        // A process that holds none of the roundings cannot run the pass,
        // and says which it misses.
        let nothing = RoundedLayers::default();
        assert_eq!(nothing.missing(&rounded).len(), rounded.len());
        assert!(rounded_layers.missing(&rounded).is_empty());
        let err = nothing.layers(&model, &rounded).unwrap_err();
        assert!(err.to_string().contains("does not hold"), "{err}");
    }
}
