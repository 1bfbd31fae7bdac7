//! Observing one batch: the map step of a pass.

use std::collections::HashMap;
use std::sync::Mutex;

use qforge_core::{BatchId, Digest, Provenance, Stats};
use qforge_model::{HiddenState, Llama, Model, Observer, StatsObserver};

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
/// where it has one, and keeps the states this pass reached.
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
            let resume = hidden.deepest(&key, first);
            let kept = lm
                .model
                .observe_resuming(&sequences, &mut observer, resume.as_ref())?;
            hidden.keep(key, kept);
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
    held: Mutex<HashMap<(Digest, BatchId), Vec<HiddenState>>>,
}

impl HiddenStates {
    /// The deepest state kept for `key` that enters layer `layer` or one
    /// before it.
    fn deepest(&self, key: &(Digest, BatchId), layer: usize) -> Option<HiddenState> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(key)?
            .iter()
            .filter(|state| state.layer <= layer)
            .max_by_key(|state| state.layer)
            .cloned()
    }

    /// Keeps `states` for `key` in place of what was kept, if the budget
    /// allows. States of other models are dropped: a process runs one pass
    /// at a time, so a pass of another model (a method the search tried
    /// before, a run served before) will not resume from them.
    fn keep(&self, key: (Digest, BatchId), states: Vec<HiddenState>) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|(model, batch), _| *model == key.0 && *batch != key.1);
        let bytes =
            |states: &Vec<HiddenState>| states.iter().map(HiddenState::bytes).sum::<usize>();
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
