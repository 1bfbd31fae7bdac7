//! Requantization at a weight sync: new weights of the model an artifact
//! was quantized from, quantized with the artifact's frozen decisions — its
//! activation scales, smoothing factors, rotations and per-layer
//! precisions — with no calibration and no guard, so an RL trainer can
//! refresh its INT8 rollout policy at every sync (FlashRL's frozen
//! calibration). Only each int8 weight's per-channel scale is recomputed.
//!
//! Two things tell the trainer when that is no longer enough: the share of
//! int8 weights that changed (per-step updates far below one int8 step
//! change none, and frozen weights hide learning, as QuRL warns), and the
//! drift of the activations on the fixed probe batch: where a statically
//! quantized input's probe abs-max grew past the artifact's by more than the
//! threshold, its frozen scale clips, and a recalibration is due.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use qforge_calib::{Transform, apply_all, read_transforms, write_transforms};
use qforge_core::Digest;
use qforge_formats::manifest::{Manifest, read_manifest, write_manifest};
use qforge_formats::profile::PROFILE_FILE;
use qforge_model::artifact::{
    LayerPrecision, check_numbers, in_precision, int8_weights, is_artifact, read_config,
    write_language_model, write_policy,
};
use qforge_model::{Model, Observer};
use serde::Serialize;
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// How the new int8 weights differ from the artifact's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WeightChange {
    /// Int8 weights in the model.
    pub int8_weights: u64,
    /// Of those, how many differ from the artifact's.
    pub changed: u64,
}

impl WeightChange {
    /// The share of int8 weights that changed.
    pub fn share(&self) -> f64 {
        self.changed as f64 / self.int8_weights.max(1) as f64
    }
}

/// A statically quantized layer input whose activations on the probe batch
/// grew: the ratio of the new weights' probe abs-max to the artifact's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// The layer input.
    pub point: String,
    /// New probe abs-max / the artifact's.
    pub ratio: f64,
}

/// New weights quantized like an artifact.
pub struct Requantized {
    /// The new model after the artifact's transforms, in full precision.
    pub model: Model,
    /// Those transforms, in order.
    pub transforms: Vec<Transform>,
    /// Every layer input's precision: the artifact's.
    pub points: BTreeMap<String, LayerPrecision>,
    /// How the int8 weights changed.
    pub weights: WeightChange,
    /// Static inputs whose probe activations grew past the threshold, worst
    /// first.
    pub drift: Vec<Drift>,
    /// The threshold `drift` was judged by.
    pub drift_threshold: f64,
    /// Seconds from loading to the quantized weights.
    pub seconds: f64,
    new: PathBuf,
    new_digest: Digest,
    like: PathBuf,
    like_manifest: Manifest,
}

/// Quantizes the model at `new` as the artifact `like` was quantized. `new`
/// must be a full-precision model of the artifact's architecture (its
/// source's format and shapes); `drift_threshold` is the relative growth of
/// a static input's probe abs-max beyond which [`Requantized::drift`] names
/// it.
pub fn requantize(new: &Path, like: &Path, drift_threshold: f64) -> Result<Requantized> {
    if !(drift_threshold.is_finite() && drift_threshold >= 0.0) {
        return Err(Error::Requantize(format!(
            "the drift threshold must be a finite number ≥ 0, got {drift_threshold}"
        )));
    }
    if !is_artifact(like) {
        return Err(Error::Requantize(format!(
            "{} is not a qforge artifact (no qforge.json); --like takes the output of `qforge quantize`",
            like.display()
        )));
    }
    if is_artifact(new) {
        return Err(Error::Requantize(format!(
            "{} is a quantized artifact; requantize takes the new full-precision weights",
            new.display()
        )));
    }
    let started = Instant::now();
    // Opening an artifact checks every file against its manifest. The two
    // models load side by side.
    let (old, fresh) = rayon::join(|| qforge_model::open(like), || qforge_model::open(new));
    let (old, fresh) = (old?, fresh?);
    let like_manifest = read_manifest(like)?;
    let points = read_config(like)?.points;
    check_architecture(&old, &fresh, new, like)?;
    if let Model::Policy(fresh) = &fresh
        && fresh.config().observation_divisors.is_some()
    {
        return Err(Error::Requantize(
            "the new policy already divides its observation (a smoothed artifact's policy.json?); give its full-precision weights".into(),
        ));
    }
    let transforms = frozen_transforms(&old, like, &like_manifest)?;
    let transformed = apply_all(&fresh, &transforms)?;
    // Each int8 layer is rounded once here; the engine's layers, the weight
    // change and the written artifact all read these values.
    let model = transformed.with_linears(|point, layer| {
        if points.get(point).and_then(|p| p.activations()).is_none() {
            return Ok(layer.clone());
        }
        layer.with_int8_weight(layer.int8_weight()?.into_owned())
    })?;
    let quantized = model.with_linears(|point, layer| in_precision(&points, point, layer))?;
    let seconds = started.elapsed().as_secs_f64();
    let weights = weight_change(like, &model, &points)?;
    let drift = drift(&old, &quantized, &points, drift_threshold)?;
    Ok(Requantized {
        model,
        transforms,
        points,
        weights,
        drift,
        drift_threshold,
        seconds,
        new: new.to_owned(),
        new_digest: qforge_model::open::digest(new)?,
        like: like.to_owned(),
        like_manifest,
    })
}

/// The transforms the weights of the artifact at `like` (opened as `old`)
/// went through, to apply to new weights: those its `transforms.json`
/// records. An artifact written before they were recorded has its policy's
/// observation divisors (SmoothQuant) and its decoder's online rotations
/// read back; a decoder's SmoothQuant factors are folded into its norms
/// there, so such an artifact is refused.
pub(crate) fn frozen_transforms(
    old: &Model,
    like: &Path,
    manifest: &Manifest,
) -> Result<Vec<Transform>> {
    if let Some(recorded) = read_transforms(like)? {
        return Ok(recorded);
    }
    match old {
        Model::Policy(old) => Ok(match &old.config().observation_divisors {
            None => Vec::new(),
            Some(divisors) => vec![Transform::Smooth {
                factors: BTreeMap::from([(
                    qforge_model::mlp::SMOOTHABLE_POINT.to_owned(),
                    divisors.clone(),
                )]),
            }],
        }),
        Model::Language(old) => {
            if manifest.info["recipe"]["smoothing"]["enabled"].as_bool() == Some(true) {
                return Err(Error::Requantize(
                    "this language-model artifact was smoothed (SmoothQuant) by a qforge that did not record its factors (no transforms.json); quantize the new weights with `qforge quantize`".into(),
                ));
            }
            let inputs = old.model.rotated_inputs();
            Ok(if inputs.is_empty() {
                Vec::new()
            } else {
                vec![Transform::Rotate { inputs }]
            })
        }
    }
}

/// The new model must have the artifact's layers, shapes and configuration
/// (a policy's observation divisors aside: the artifact's come from its
/// smoothing).
fn check_architecture(old: &Model, new: &Model, new_path: &Path, like: &Path) -> Result<()> {
    let layout = |m: &Model| -> Vec<(String, String, (usize, usize))> {
        m.linears()
            .into_iter()
            .map(|(name, point, layer)| (name, point, layer.shape()))
            .collect()
    };
    let same_config = match (old, new) {
        (Model::Policy(a), Model::Policy(b)) => {
            let unsmoothed = |p: &qforge_model::MlpPolicy| qforge_formats::policy::PolicyConfig {
                observation_divisors: None,
                ..p.config().clone()
            };
            unsmoothed(a) == unsmoothed(b)
        }
        (Model::Language(a), Model::Language(b)) => a.model.config() == b.model.config(),
        _ => false,
    };
    let (old_layout, new_layout) = (layout(old), layout(new));
    if same_config && old_layout == new_layout {
        return Ok(());
    }
    let first_difference = old_layout
        .iter()
        .zip(&new_layout)
        .find(|(a, b)| a != b)
        .map_or("the configuration differs".to_owned(), |(a, b)| {
            format!(
                "{} is {:?} in the artifact, {} {:?} here",
                a.0, a.2, b.0, b.2
            )
        });
    Err(Error::Requantize(format!(
        "{} is not the architecture of {} ({first_difference}); requantize needs new weights of the same model",
        new_path.display(),
        like.display()
    )))
}

/// Compares the int8 weights `new` (full precision) quantizes to at
/// `points` with those the artifact in `like` stores.
fn weight_change(
    like: &Path,
    new: &Model,
    points: &BTreeMap<String, LayerPrecision>,
) -> Result<WeightChange> {
    let stored = int8_weights(like)?;
    let mut change = WeightChange {
        int8_weights: 0,
        changed: 0,
    };
    for (name, point, layer) in new.linears() {
        if points.get(&point).and_then(|p| p.activations()).is_none() {
            continue;
        }
        let int8 = layer.int8_weight()?;
        let values = &int8.values;
        let old = stored.get(&name).ok_or_else(|| {
            Error::Requantize(format!(
                "{} stores no int8 weight for {name}, which its qforge.json quantizes",
                like.display()
            ))
        })?;
        change.int8_weights += values.len() as u64;
        change.changed += old
            .iter()
            .zip(values.iter())
            .filter(|(a, b)| a != b)
            .count() as u64;
    }
    Ok(change)
}

/// Every layer input's largest finite magnitude.
#[derive(Default)]
struct AbsMax(BTreeMap<String, f32>);

impl Observer for AbsMax {
    fn observe(&mut self, point: &str, rows: &[f32], _width: usize) -> qforge_model::Result<()> {
        let seen = rows
            .iter()
            .filter(|v| v.is_finite())
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let slot = self.0.entry(point.to_owned()).or_insert(0.0);
        *slot = slot.max(seen);
        Ok(())
    }
}

/// The static inputs whose probe abs-max under `new` exceeds the
/// artifact's by more than `threshold`, worst first.
fn drift(
    old: &Model,
    new: &Model,
    points: &BTreeMap<String, LayerPrecision>,
    threshold: f64,
) -> Result<Vec<Drift>> {
    let (mut before, mut after) = (AbsMax::default(), AbsMax::default());
    old.probe(&mut before)?;
    new.probe(&mut after)?;
    let mut drift: Vec<Drift> = points
        .iter()
        .filter(|(_, p)| matches!(p, LayerPrecision::Int8Static { .. }))
        .filter_map(|(point, _)| {
            let (a, b) = (before.0.get(point)?, after.0.get(point)?);
            let ratio = f64::from(*b) / f64::from(a.max(f32::MIN_POSITIVE));
            (ratio > 1.0 + threshold).then(|| Drift {
                point: point.clone(),
                ratio,
            })
        })
        .collect();
    drift.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
    Ok(drift)
}

/// What `qforge requantize` reports: the weight change and the drift.
#[derive(Serialize)]
pub struct RequantizeReport<'a> {
    like: &'a Path,
    int8_weights: u64,
    changed_weights: u64,
    changed_share: f64,
    drift: &'a [Drift],
    drift_threshold: f64,
    seconds: f64,
    #[serde(skip)]
    model: &'a Path,
}

impl std::fmt::Display for RequantizeReport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requantized {} like {} in {:.3} s: {} of {} int8 weights changed ({:.3} %)",
            self.model.display(),
            self.like.display(),
            self.seconds,
            self.changed_weights,
            self.int8_weights,
            100.0 * self.changed_share
        )
    }
}

impl Drift {
    /// The warning a drifted input deserves, judged by `threshold`.
    pub fn warning(&self, threshold: f64) -> String {
        format!(
            "{}: activations on the probe batch grew {:.1} % past the artifact's (threshold {:.1} %); its frozen scale clips: recalibrate with `qforge quantize`",
            self.point,
            100.0 * (self.ratio - 1.0),
            100.0 * threshold
        )
    }
}

impl Requantized {
    /// The report of this requantization.
    pub fn report(&self) -> RequantizeReport<'_> {
        RequantizeReport {
            like: &self.like,
            int8_weights: self.weights.int8_weights,
            changed_weights: self.weights.changed,
            changed_share: self.weights.share(),
            drift: &self.drift,
            drift_threshold: self.drift_threshold,
            seconds: self.seconds,
            model: &self.new,
        }
    }

    /// Writes the artifact into the empty directory `dir`: the weights, the
    /// artifact's calibration profile (the scales are its calibration's, so
    /// the server's drift monitor compares against it), and a manifest that
    /// names the new weights as the source and the artifact they were
    /// quantized like. Returns the manifest's information.
    pub fn write(&self, dir: &Path) -> Result<Value> {
        match &self.model {
            Model::Policy(p) => write_policy(dir, p, &self.points)?,
            Model::Language(lm) => write_language_model(dir, lm, &self.points)?,
        }
        write_transforms(dir, &self.transforms)?;
        // Copied as written: the manifest of `like` vouches for its bytes.
        let profile = self.like.join(PROFILE_FILE);
        if profile.exists() {
            std::fs::copy(&profile, dir.join(PROFILE_FILE))
                .map_err(|e| qforge_model::Error::io(&profile, e))?;
        }
        check_numbers(dir)?; // what every reader refuses is not written either
        let like_info = &self.like_manifest.info;
        let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or(p.to_owned());
        let info = json!({
            "kind": "native",
            "source_model": {
                "path": canonical(&self.new).display().to_string(),
                "sha256": self.new_digest.to_hex(),
            },
            "requantized_like": {
                "path": canonical(&self.like).display().to_string(),
                "source_model": like_info["source_model"],
            },
            "data_sha256": like_info["data_sha256"],
            "calibration_recipe_sha256": like_info["calibration_recipe_sha256"],
            "recipe": like_info["recipe"],
            "coverage": like_info["coverage"],
            "weights": self.weights,
            "drift": {"threshold": self.drift_threshold, "inputs": self.drift},
        });
        write_manifest(dir, info.clone())?;
        Ok(info)
    }
}
