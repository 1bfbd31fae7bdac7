//! What a server runs, and how it is opened from a path: the model (checked
//! against its manifest when it is an artifact), its full-precision
//! reference, and the calibration profile the drift monitor compares with.
//! The CLI's `qforge serve` and a reload open their models here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use qforge_formats::manifest::read_manifest;
use qforge_formats::profile::CalibrationProfile;
use qforge_model::Model;
use qforge_model::artifact::{LayerPrecision, is_artifact, read_config};
use qforge_model::open::recorded_source;

use crate::drift::{DriftMonitor, DriftOptions};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What a server runs, or a reload swaps in: the model, its full-precision
/// reference and the calibration its inputs are compared with. The model
/// is a [`Model`] as `qforge_model` opened it; how a language model is
/// served (its name, the engine's limits) is in [`crate::ServeOptions`].
pub struct Served {
    /// The model that answers (normally an INT8 artifact).
    pub model: Model,
    /// Its full-precision reference, for A/B and shadow rollouts; of the
    /// same kind as the model ([`Served::with_reference`] checks, and the server
    /// refuses another).
    pub reference: Option<Model>,
    /// What the model's inputs looked like in calibration; without it
    /// there is no drift monitor.
    pub calibration: Option<Calibration>,
}

/// The calibration facts the drift monitor compares against.
pub struct Calibration {
    /// Calibrated range and octave histogram per point.
    pub profile: CalibrationProfile,
    /// Activation scale of every static INT8 point.
    pub input_scales: BTreeMap<String, f32>,
}

impl Served {
    /// Opens the model at `path` (an artifact checked file by file against
    /// its manifest, `calibration.json` included), without a reference.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(Self {
            model: qforge_model::open(path)?,
            reference: None,
            calibration: Calibration::of(path)?,
        })
    }

    /// Adds the full-precision reference at `reference_path`, which must be
    /// the same kind of model; `path` is the model's, for the error.
    pub fn with_reference(mut self, path: &Path, reference_path: &Path) -> Result<Self> {
        let reference = qforge_model::open(reference_path)?;
        if reference.kind() != self.model.kind() {
            return Err(Error::Options(format!(
                "{} and its reference {} are not the same kind of model (a policy and a language model)",
                path.display(),
                reference_path.display()
            )));
        }
        self.reference = Some(reference);
        Ok(self)
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
