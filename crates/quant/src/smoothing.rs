//! SmoothQuant's factors (Xiao et al. 2023, "SmoothQuant: Accurate and
//! Efficient Post-Training Quantization for Large Language Models"): per
//! input channel `j` of a layer input, `s_j = max|X_j|^α / max|W_j|^(1−α)`,
//! with `max|X_j|` the per-channel abs-max merged exactly across workers by
//! the smoothing pass and `max|W_j|` over every layer the input feeds. The
//! model crate folds them in (`Llama::smoothed`; for a policy, whose one
//! smoothable input is the observation, `MlpPolicy::smoothed`).
//!
//! One α does not suit every input: the paper tunes it per model (0.5 for
//! OPT and BLOOM, 0.75–0.85 for GLM-130B and Llama), and within one model the
//! inputs differ (a `down_proj` input's outliers are far larger than a
//! `q_proj` input's). Unless the recipe fixes α, it is chosen per input from
//! [`ALPHA_GRID`]: the one whose factors give the smallest output error of
//! the layers the input feeds, run on the INT8 engine with activations
//! quantized as the recipe says, on the first calibration rows. The search
//! runs where the pipeline runs (a cluster's coordinator) on rows the plan
//! fixes, so its choice is deterministic and travels to the workers in the
//! next pass's transform like any fixed α's factors.

use std::collections::BTreeMap;

use qforge_calib::{Sample, forward_samples};
use qforge_core::{Calibrator, Histogram, Stats};
use qforge_eval::sensitivity::OutputReference;
use qforge_model::mlp::SMOOTHABLE_POINT;
use qforge_model::{Activations, Linear, Model, Observer};
use serde::Serialize;

use crate::error::{Error, Result};

/// Factors are kept within [1/`LIMIT`, `LIMIT`]: a channel that never fired
/// (abs-max 0) or a dead weight column must not send a scale to 0 or ∞.
const LIMIT: f32 = 1e4;

/// The migration strengths the search tries.
pub const ALPHA_GRID: [f64; 10] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// The α the paper starts from, against which the search's gain is stated.
const PAPER_ALPHA: f64 = 0.5;

/// How the α search quantizes a layer input's activations: static with a
/// calibrator's scale (computed on the smoothed rows), or per token.
pub type ActivationChoice<'a> = &'a dyn Fn(&str) -> Option<Calibrator>;

/// SmoothQuant's choice: α per smoothable input and the factors it gives.
#[derive(Debug, Clone)]
pub struct Smoothing {
    /// Factors per layer input (the transform).
    pub factors: BTreeMap<String, Vec<f32>>,
    /// How they were chosen.
    pub record: SmoothingRecord,
}

/// How the smoothing factors were chosen (`report.json`'s `smoothing`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SmoothingRecord {
    /// α per smoothable layer input.
    pub alphas: BTreeMap<String, f64>,
    /// Calibration rows the search scored on; `None` when the recipe fixed α.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub search_rows: Option<usize>,
    /// The chosen factors' summed output error as a fraction of α 0.5's
    /// (below 1: the search found better); `None` when α was fixed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_vs_half: Option<f64>,
    /// Seconds the search took.
    pub seconds: f64,
}

impl SmoothingRecord {
    /// `alpha 0.5`, or what the α search chose: its range, median and gain.
    pub fn describe(&self) -> String {
        let mut alphas: Vec<f64> = self.alphas.values().copied().collect();
        alphas.sort_by(f64::total_cmp);
        let (Some(lo), Some(hi)) = (alphas.first(), alphas.last()) else {
            return "no input".into();
        };
        let chosen = if lo == hi {
            format!("alpha {lo}")
        } else {
            format!("alpha {lo} to {hi}, median {}", alphas[alphas.len() / 2])
        };
        let Some(rows) = self.search_rows else {
            return chosen;
        };
        let gain = self.error_vs_half.map_or(String::new(), |r| {
            format!("; output error {:.1} % of alpha 0.5's", 100.0 * r)
        });
        format!(
            "{chosen} searched on {rows} rows in {:.2} s{gain}",
            self.seconds
        )
    }
}

impl Smoothing {
    /// The factors of one α for every smoothable input of `model`.
    pub fn fixed(model: &Model, stats: &Stats, alpha: f64) -> Result<Self> {
        let inputs = smoothable_inputs(model, stats)?;
        Ok(Self {
            factors: inputs
                .iter()
                .map(|(point, input)| (point.clone(), input.factors(alpha)))
                .collect(),
            record: SmoothingRecord {
                alphas: inputs.keys().map(|p| (p.clone(), alpha)).collect(),
                search_rows: None,
                error_vs_half: None,
                seconds: 0.0,
            },
        })
    }

    /// α per smoothable input of `model` from [`ALPHA_GRID`], scored on
    /// `samples` (run in one forward), activations quantized per `choice`.
    pub fn search(
        model: &Model,
        stats: &Stats,
        samples: &[Sample],
        choice: ActivationChoice<'_>,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let inputs = smoothable_inputs(model, stats)?;
        let mut consumers: BTreeMap<String, Vec<&Linear>> = BTreeMap::new();
        for (_, point, layer) in model.linears() {
            consumers.entry(point).or_default().push(layer);
        }
        let mut scorer = Scorer {
            candidates: inputs
                .iter()
                .map(|(point, input)| {
                    let candidate = Candidate {
                        layers: consumers.remove(point).unwrap_or_default(),
                        factors: ALPHA_GRID.iter().map(|&a| input.factors(a)).collect(),
                        calibrator: choice(point),
                        errors: vec![0.0; ALPHA_GRID.len()],
                        rows: 0,
                    };
                    (point.clone(), candidate)
                })
                .collect(),
        };
        forward_samples(model, samples, &mut scorer)?;
        let mut factors = BTreeMap::new();
        let mut alphas = BTreeMap::new();
        let (mut chosen_error, mut half_error) = (0.0, 0.0);
        let half = ALPHA_GRID.iter().position(|&a| a == PAPER_ALPHA);
        let mut rows = 0;
        for (point, mut candidate) in scorer.candidates {
            if candidate.rows == 0 {
                return Err(Error::Stats(format!(
                    "the α search saw no rows of {point}; give calibration data that reaches it, or fix smoothing.alpha"
                )));
            }
            rows = rows.max(candidate.rows);
            let best = (0..ALPHA_GRID.len())
                .min_by(|&a, &b| candidate.errors[a].total_cmp(&candidate.errors[b]))
                .expect("the grid is not empty");
            chosen_error += candidate.errors[best];
            half_error += half.map_or(0.0, |h| candidate.errors[h]);
            alphas.insert(point.clone(), ALPHA_GRID[best]);
            factors.insert(point, candidate.factors.swap_remove(best));
        }
        Ok(Self {
            factors,
            record: SmoothingRecord {
                alphas,
                search_rows: Some(rows),
                error_vs_half: (half_error > 0.0).then(|| chosen_error / half_error),
                seconds: started.elapsed().as_secs_f64(),
            },
        })
    }
}

/// One smoothable input: its channels' activation abs-max and, per channel,
/// the largest weight magnitude of the column it meets in every layer it
/// feeds.
struct SmoothableInput {
    activation: Vec<f32>,
    weight: Vec<f32>,
}

impl SmoothableInput {
    fn factors(&self, alpha: f64) -> Vec<f32> {
        self.activation
            .iter()
            .zip(&self.weight)
            .map(|(&a, &w)| {
                if a > 0.0 && w > 0.0 {
                    let s = (f64::from(a).powf(alpha) / f64::from(w).powf(1.0 - alpha)) as f32;
                    s.clamp(1.0 / LIMIT, LIMIT)
                } else {
                    1.0
                }
            })
            .collect()
    }
}

/// Every smoothable input of `model`, with the abs-max `stats` (the
/// smoothing pass's) recorded for it.
fn smoothable_inputs(model: &Model, stats: &Stats) -> Result<BTreeMap<String, SmoothableInput>> {
    let smoothable = match model {
        Model::Language(lm) => lm.model.smoothable_points(),
        Model::Policy(_) => vec![SMOOTHABLE_POINT.to_owned()],
    };
    let mut columns: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (_, point, layer) in model.linears() {
        let (weight, _) = layer.full_precision()?;
        let column_max = weight
            .abs()
            .and_then(|w| w.max(0))
            .and_then(|m| m.to_vec1::<f32>())
            .map_err(qforge_model::Error::from)?;
        let entry = columns
            .entry(point)
            .or_insert_with(|| vec![0.0; column_max.len()]);
        for (e, c) in entry.iter_mut().zip(column_max) {
            *e = e.max(c);
        }
    }
    let mut inputs = BTreeMap::new();
    for point in smoothable {
        let tensor = stats.tensors.get(&point).ok_or_else(|| {
            Error::Stats(format!("no statistics for {point}; calibrate this model"))
        })?;
        let activation = tensor.channel_abs_max().ok_or_else(|| {
            Error::Stats(format!(
                "{point} has no per-channel abs-max: SmoothQuant needs the smoothing pass"
            ))
        })?;
        let weight = columns.remove(&point).unwrap_or_default();
        if activation.len() != weight.len() {
            return Err(Error::Stats(format!(
                "{point}: {} activation channels for a layer taking {}",
                activation.len(),
                weight.len()
            )));
        }
        inputs.insert(
            point,
            SmoothableInput {
                activation: activation.to_vec(),
                weight,
            },
        );
    }
    Ok(inputs)
}

/// One input's search: the layers it feeds, each α's factors and their
/// summed output error so far.
struct Candidate<'a> {
    layers: Vec<&'a Linear>,
    factors: Vec<Vec<f32>>,
    /// `None`: dynamic per-token activations.
    calibrator: Option<Calibrator>,
    errors: Vec<f64>,
    rows: usize,
}

/// Scores every candidate α on the inputs a full-precision forward makes.
struct Scorer<'a> {
    candidates: BTreeMap<String, Candidate<'a>>,
}

impl Observer for Scorer<'_> {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> qforge_model::Result<()> {
        let Some(candidate) = self.candidates.get_mut(point) else {
            return Ok(());
        };
        let reference = OutputReference::new(candidate.layers.clone(), rows, width)?;
        for (factors, error) in candidate.factors.iter().zip(&mut candidate.errors) {
            let smoothed: Vec<f32> = rows
                .chunks_exact(width)
                .flat_map(|row| row.iter().zip(factors).map(|(x, s)| x / s))
                .collect();
            let activations = match candidate.calibrator {
                None => Activations::Dynamic,
                Some(calibrator) => {
                    let mut histogram = Histogram::new();
                    histogram.observe(&smoothed);
                    match calibrator.static_scale(&histogram) {
                        Some(scale) => Activations::Static(scale),
                        // No finite value: this α cannot be scored.
                        None => {
                            *error = f64::INFINITY;
                            continue;
                        }
                    }
                }
            };
            *error += reference.smoothed_error(&smoothed, factors, activations)?;
        }
        candidate.rows += rows.len() / width;
        Ok(())
    }
}
