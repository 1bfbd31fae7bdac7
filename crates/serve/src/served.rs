//! What a server runs, and how it is opened from a path: the model (checked
//! against its manifest when it is an artifact), its full-precision
//! reference, and the calibration profile the drift monitor compares with.
//! The CLI's `qforge serve` opens its model here, as a reload would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use qforge_model::artifact::{LayerPrecision, is_artifact, read_config};
use qforge_model::manifest::read_manifest;
use qforge_model::open::recorded_source;
use qforge_model::profile::CalibrationProfile;
use qforge_model::{LanguageModel, MlpPolicy, Model};

use crate::drift::{DriftMonitor, DriftOptions};
use crate::engine::EngineLimits;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What a server runs.
// One value per process, moved once into `serve`: variant sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Served {
    /// A control policy behind `/v1/act`.
    Policy {
        /// The model that answers (normally an INT8 artifact).
        model: MlpPolicy,
        /// Its full-precision reference, for A/B and shadow rollouts.
        reference: Option<MlpPolicy>,
        /// What the model's inputs looked like in calibration; without it
        /// there is no drift monitor.
        calibration: Option<Calibration>,
    },
    /// A language model behind `/v1/completions` and `/v1/chat/completions`.
    Language {
        /// The model.
        model: LanguageModel,
        /// Its full-precision reference, for A/B and shadow rollouts.
        reference: Option<LanguageModel>,
        /// The name clients may give as `model` (and `/v1/models` lists).
        name: String,
        /// As for a policy.
        calibration: Option<Calibration>,
        /// The continuous-batching engine's limits.
        limits: EngineLimits,
    },
}

/// The calibration facts the drift monitor compares against.
pub struct Calibration {
    /// Calibrated range and octave histogram per point.
    pub profile: CalibrationProfile,
    /// Activation scale of every static INT8 point.
    pub input_scales: BTreeMap<String, f32>,
}

impl Served {
    /// Bytes of KV cache `tokens` positions take (K and V, f32, per layer
    /// and KV head); 0 for a policy.
    pub fn kv_bytes(&self, tokens: usize) -> usize {
        match self {
            Served::Policy { .. } => 0,
            Served::Language { model, .. } => tokens * model.model.kv_bytes_per_position(),
        }
    }

    /// Opens the model at `path` and, if given, its full-precision
    /// `reference` (of the same kind); a language model answers to `name`
    /// (default: the file's stem) within `limits`.
    pub fn open(
        path: &Path,
        reference: Option<&Path>,
        name: Option<String>,
        limits: EngineLimits,
    ) -> Result<Self> {
        // Open first: for an artifact that checks every file against the
        // manifest, calibration.json included.
        let model = qforge_model::open(path)?;
        let calibration = Calibration::of(path)?;
        let mismatch = |reference: &Path| {
            Error::Options(format!(
                "{} and its reference {} are not the same kind of model (a policy and a language model)",
                path.display(),
                reference.display()
            ))
        };
        let reference = match reference {
            Some(p) => Some((qforge_model::open(p)?, p)),
            None => None,
        };
        Ok(match (model, reference) {
            (Model::Policy(model), reference) => Served::Policy {
                model: *model,
                reference: match reference {
                    None => None,
                    Some((Model::Policy(r), _)) => Some(*r),
                    Some((Model::Language(_), p)) => return Err(mismatch(p)),
                },
                calibration,
            },
            (Model::Language(model), reference) => Served::Language {
                model: *model,
                reference: match reference {
                    None => None,
                    Some((Model::Language(r), _)) => Some(*r),
                    Some((Model::Policy(_), p)) => return Err(mismatch(p)),
                },
                name: name.unwrap_or_else(|| {
                    path.file_stem()
                        .map_or("model".into(), |s| s.to_string_lossy().into_owned())
                }),
                calibration,
                limits,
            },
        })
    }
}

impl Calibration {
    /// The drift monitor that compares a served model's inputs with these
    /// calibration facts.
    pub fn into_monitor(self, options: DriftOptions, metrics: &Arc<Metrics>) -> DriftMonitor {
        DriftMonitor::new(
            self.profile,
            &self.input_scales,
            options,
            Arc::clone(metrics),
        )
    }

    /// The calibration facts of the artifact at `path`; `None` for a model
    /// that is not an artifact, or an artifact quantized by a qforge that
    /// wrote no calibration profile (then the drift monitor is off, and a
    /// warning says so).
    pub fn of(path: &Path) -> Result<Option<Self>> {
        if !is_artifact(path) {
            return Ok(None);
        }
        let Some(profile) = CalibrationProfile::read(path)? else {
            tracing::warn!(
                "qforge serve: {} has no calibration profile (quantized by an older qforge); the drift monitor is off",
                path.display()
            );
            return Ok(None);
        };
        let input_scales = read_config(path)?
            .points
            .into_iter()
            .filter_map(|(point, precision)| match precision {
                LayerPrecision::Int8Static { input_scale } => Some((point, input_scale)),
                _ => None,
            })
            .collect();
        Ok(Some(Self {
            profile,
            input_scales,
        }))
    }
}

/// The full-precision reference to serve beside the model at `path`: the
/// one `given`, else, when the rollout `needs` one, the source an artifact's
/// manifest records (checked unchanged); `None` when none is needed.
pub fn reference_for(path: &Path, given: Option<&Path>, needs: bool) -> Result<Option<PathBuf>> {
    match (given, needs) {
        (Some(given), _) => Ok(Some(given.to_owned())),
        (None, true) if is_artifact(path) => Ok(Some(recorded_source(&read_manifest(path)?)?)),
        (None, true) => Err(Error::Options(format!(
            "--ab and --shadow need --reference: {} is not an artifact whose manifest records its source",
            path.display()
        ))),
        (None, false) => Ok(None),
    }
}
