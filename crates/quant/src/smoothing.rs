//! SmoothQuant's factors (Xiao et al. 2023, "SmoothQuant: Accurate and
//! Efficient Post-Training Quantization for Large Language Models"): per
//! input channel `j` of a layer input, `s_j = max|X_j|^α / max|W_j|^(1−α)`,
//! with `max|X_j|` the per-channel abs-max merged exactly across workers by
//! the smoothing pass and `max|W_j|` over every layer the input feeds. The
//! model crate folds them in (`Llama::smoothed`; for a policy, whose one
//! smoothable input is the observation, `MlpPolicy::smoothed`).

use std::collections::BTreeMap;

use qforge_core::Stats;
use qforge_model::Model;
use qforge_model::mlp::SMOOTHABLE_POINT;

use crate::error::{Error, Result};

/// Factors are kept within [1/`LIMIT`, `LIMIT`]: a channel that never fired
/// (abs-max 0) or a dead weight column must not send a scale to 0 or ∞.
const LIMIT: f32 = 1e4;

/// The factors of every smoothable layer input of `model`.
pub fn smoothing_factors(
    model: &Model,
    stats: &Stats,
    alpha: f64,
) -> Result<BTreeMap<String, Vec<f32>>> {
    let (linears, smoothable) = match model {
        Model::Language(lm) => (lm.model.linears(), lm.model.smoothable_points()),
        Model::Policy(policy) => (policy.linears(), vec![SMOOTHABLE_POINT.to_owned()]),
    };
    let mut columns: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (_, point, layer) in linears {
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
    let mut factors = BTreeMap::new();
    for point in smoothable {
        let tensor = stats.tensors.get(&point).ok_or_else(|| {
            Error::Stats(format!("no statistics for {point}; calibrate this model"))
        })?;
        let activation = tensor.channel_abs_max().ok_or_else(|| {
            Error::Stats(format!(
                "{point} has no per-channel abs-max: SmoothQuant needs the smoothing pass"
            ))
        })?;
        let weight = &columns[&point];
        if activation.len() != weight.len() {
            return Err(Error::Stats(format!(
                "{point}: {} activation channels for a layer taking {}",
                activation.len(),
                weight.len()
            )));
        }
        let s = activation
            .iter()
            .zip(weight)
            .map(|(&a, &w)| {
                if a > 0.0 && w > 0.0 {
                    let s = (f64::from(a).powf(alpha) / f64::from(w).powf(1.0 - alpha)) as f32;
                    s.clamp(1.0 / LIMIT, LIMIT)
                } else {
                    1.0
                }
            })
            .collect();
        factors.insert(point, s);
    }
    Ok(factors)
}
