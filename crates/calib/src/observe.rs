//! Observing one batch: the map step of a pass.

use qforge_core::{Digest, Provenance, Stats};
use qforge_model::{Model, Observer, StatsObserver};

use crate::error::{Error, Result};
use crate::plan::{Batch, Recipe, Sample};
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

/// Runs `batch` through the full-precision model `target` (already
/// transformed as `job.transforms` say) and returns its statistics:
/// every linear input's histogram (and per-channel abs-max for the smoothing
/// pass), with the batch's id in the provenance.
pub fn observe_batch(target: &Model, batch: &Batch, job: &Job) -> Result<Stats> {
    let mut observer = StatsObserver::new(job.recipe.pass.statistics());
    forward_samples(target, &batch.samples, &mut observer)?;
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

/// Runs `samples` (token sequences for a language model, observations for a
/// policy) through `target` in one forward, past `observer`.
pub fn forward_samples(
    target: &Model,
    samples: &[Sample],
    observer: &mut dyn Observer,
) -> Result<()> {
    match target {
        Model::Language(lm) => {
            let sequences = samples
                .iter()
                .map(|s| match s {
                    Sample::Tokens(ids) => Ok(ids.clone()),
                    Sample::Observation(_) => Err(Error::Data(
                        "policy observations cannot calibrate a language model".into(),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            lm.model.observe(&sequences, observer)?;
        }
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
