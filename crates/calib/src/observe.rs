//! Observing one batch: the map step of a pass.

use qforge_core::{Digest, Provenance, Stats};
use qforge_model::fingerprint::{llm_fingerprint, policy_fingerprint};
use qforge_model::{Llama, Logits, MlpPolicy, StatsObserver};

use crate::error::{Error, Result};
use crate::plan::{Batch, Pass, Recipe, Sample};

/// The model a pass runs.
#[derive(Debug, Clone)]
pub enum Target {
    /// A decoder.
    Language(Llama),
    /// A policy.
    Policy(MlpPolicy),
}

impl Target {
    /// The determinism fingerprint of this machine's forward pass: workers
    /// whose fingerprints agree compute bit-identical activations.
    pub fn fingerprint(&self) -> Result<Digest> {
        Ok(match self {
            Target::Language(model) => llm_fingerprint(model)?,
            Target::Policy(policy) => policy_fingerprint(policy)?,
        })
    }
}

/// What identifies a calibration: the hashes of model, data and recipe, and the
/// pass. Every batch's statistics carry it in their provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Hash of the model files.
    pub model: Digest,
    /// Hash of the data file.
    pub data: Digest,
    /// The recipe.
    pub recipe: Recipe,
    /// Batches in the plan (the denominator of coverage).
    pub planned: u64,
}

/// Runs `batch` through the full-precision model and returns its statistics:
/// every linear input's histogram (and per-channel abs-max for the smoothing
/// pass), with the batch's id in the provenance.
pub fn observe_batch(target: &Target, batch: &Batch, job: &Job) -> Result<Stats> {
    let mut observer = StatsObserver::new(job.recipe.pass == Pass::Smoothing);
    match target {
        Target::Language(model) => {
            let sequences = batch
                .samples
                .iter()
                .map(|s| match s {
                    Sample::Tokens(ids) => Ok(ids.clone()),
                    Sample::Observation(_) => Err(Error::Data(
                        "policy observations cannot calibrate a language model".into(),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            model.forward(&sequences, None, Some(&mut observer), Logits::Last)?;
        }
        Target::Policy(policy) => {
            let dim = policy.config().observation_dim;
            let mut rows = Vec::with_capacity(batch.samples.len() * dim);
            for s in &batch.samples {
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
            policy.forward(&rows, Some(&mut observer))?;
        }
    }
    Ok(Stats {
        provenance: Provenance::single(
            Some(job.model),
            job.data,
            job.recipe.digest(),
            job.recipe.pass.name(),
            batch.id,
            job.planned,
        ),
        tensors: observer.tensors,
    })
}
