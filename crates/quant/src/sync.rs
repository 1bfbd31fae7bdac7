//! Weight sync in process: a trainer's new full-precision weights, held in
//! memory, become the served model in the precision it was served in, with
//! no file written and no calibration run. An artifact's new weights go
//! through its frozen decisions (its recorded transforms and per-layer
//! precisions and activation scales, as `qforge requantize` applies them);
//! a model opened in a run precision (`int8-dynamic`, `int8-static` with
//! its statistics' scales) is put in that precision again; an f32 model
//! serves the new weights as given.
//!
//! Each sync reports how many int8 values changed, per layer and overall:
//! QuRL's warning that updates far below one int8 step change no code, so
//! that a rollout policy whose codes stop moving stops learning.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use crate::precision::RunPrecision;
use candle_core::Tensor;
use qforge_calib::{Transform, apply_all};
use qforge_formats::manifest::read_manifest;
use qforge_model::artifact::{LayerPrecision, in_precision, is_artifact, read_config};
use qforge_model::{LanguageModel, Linear, Llama, Model};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::requantize::{WeightChange, frozen_transforms};

/// How a served language model's weights are made from full-precision ones.
pub struct WeightSync {
    recipe: Recipe,
    /// Whether the model as opened tied lm_head to the embedding, as a
    /// trainer's weights then do: a run precision may untie them in the
    /// served model (int8-dynamic's residual rotation makes lm_head its
    /// own matrix).
    tied: bool,
}

enum Recipe {
    /// A native artifact's frozen decisions.
    Artifact {
        transforms: Vec<Transform>,
        points: BTreeMap<String, LayerPrecision>,
    },
    /// A run precision applied to the new weights (f32: as given).
    Run(RunPrecision),
}

/// A synced model and what the sync changed.
pub struct Synced {
    /// The new model, ready to serve.
    pub lm: LanguageModel,
    /// How its int8 values differ from the served model's.
    pub change: CodeChange,
    /// Seconds from the tensors to the new model.
    pub seconds: f64,
}

/// How the int8 values of a synced model differ from those it replaces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodeChange {
    /// Over every int8 layer.
    pub total: WeightChange,
    /// Per int8 layer, by weight name (`model.layers.0.mlp.up_proj.weight`).
    pub tensors: BTreeMap<String, WeightChange>,
}

impl WeightSync {
    /// The sync of `opened`, the model at `path` as opened, to be served in
    /// `precision` (an artifact opens as [`RunPrecision::Stored`]); the
    /// model to serve is [`WeightSync::to_served`]`(opened)`.
    pub fn new(path: &Path, precision: RunPrecision, opened: &LanguageModel) -> Result<Self> {
        let recipe = match precision {
            RunPrecision::Stored if is_artifact(path) => {
                let manifest = read_manifest(path)?;
                let old = Model::Language(Box::new(opened.clone()));
                Recipe::Artifact {
                    transforms: frozen_transforms(&old, path, &manifest)?,
                    points: read_config(path)?.points,
                }
            }
            RunPrecision::Stored => {
                return Err(Error::Requantize(format!(
                    "{} is not a qforge artifact, so it has no stored precisions to keep",
                    path.display()
                )));
            }
            precision => Recipe::Run(precision),
        };
        Ok(Self {
            recipe,
            tied: opened.model.tied_embeddings(),
        })
    }

    /// `opened` (the model [`WeightSync::new`] was given) in the precision
    /// it is served in: a run precision applied, an artifact as stored.
    pub fn to_served(&self, opened: LanguageModel) -> Result<LanguageModel> {
        Ok(match &self.recipe {
            Recipe::Run(precision) => precision.apply_language(opened)?,
            Recipe::Artifact { .. } => opened,
        })
    }

    /// `served` with the weights `tensors` (Hugging Face names, every
    /// tensor of the model, f32, bf16 or f16), in `served`'s precision. A
    /// missing, unknown, misshapen or non-finite tensor is refused by name,
    /// and `served` is untouched either way.
    pub fn apply(
        &self,
        served: &LanguageModel,
        tensors: BTreeMap<String, Tensor>,
    ) -> Result<Synced> {
        let started = Instant::now();
        let fresh = LanguageModel {
            model: Llama::from_tensors(served.model.config().clone(), self.tied, tensors)?,
            text: served.text.clone(),
            source: served.source.clone(),
        };
        let lm = match &self.recipe {
            Recipe::Run(precision) => precision.apply_language(fresh)?,
            Recipe::Artifact { transforms, points } => {
                let transformed = apply_all(&Model::Language(Box::new(fresh)), transforms)?;
                transformed
                    .with_linears(|point, layer| in_precision(points, point, layer))?
                    .into_language(&served.source)?
            }
        };
        let change = code_change(served, &lm)?;
        Ok(Synced {
            lm,
            change,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// How the int8 values of `new` differ from those of `old`, layer by layer
/// (layers int8 in both; the same recipe makes the same layers int8).
fn code_change(old: &LanguageModel, new: &LanguageModel) -> Result<CodeChange> {
    let mut change = CodeChange {
        total: WeightChange {
            int8_weights: 0,
            changed: 0,
        },
        tensors: BTreeMap::new(),
    };
    for ((name, _, before), (_, _, after)) in
        old.model.linears().into_iter().zip(new.model.linears())
    {
        let (Linear::Int8(before), Linear::Int8(after)) = (before, after) else {
            continue;
        };
        let changed = before
            .packed()
            .differing_values(after.packed())
            .ok_or_else(|| {
                Error::Requantize(format!("{name} is packed differently after the sync"))
            })?;
        let (out, inp) = after.shape();
        let layer = WeightChange {
            int8_weights: (out * inp) as u64,
            changed,
        };
        change.total.int8_weights += layer.int8_weights;
        change.total.changed += layer.changed;
        change.tensors.insert(format!("{name}.weight"), layer);
    }
    Ok(change)
}
