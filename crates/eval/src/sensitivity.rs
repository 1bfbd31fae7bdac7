//! Per-layer sensitivity: how much each linear layer's output changes on the
//! INT8 engine, measured on the inputs a full-precision forward produces.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use qforge_kernels::Activations;
use serde::Serialize;

use qforge_model::Result;
use qforge_model::linear::Linear;
use qforge_model::llama::{Llama, Logits};
use qforge_model::mlp::MlpPolicy;
use qforge_model::observe::Observer;

/// The output SQNR of one layer on the INT8 engine against full precision.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSqnr {
    /// The layer (`model.layers.3.mlp.down_proj`, `layers.0`, …).
    pub name: String,
    /// Its observation point (the input it shares with others).
    pub point: String,
    /// 10·log10(Σ y² / Σ (y − ŷ)²); `None` when the outputs are identical.
    pub sqnr_db: Option<f64>,
    /// Input rows measured.
    pub rows: usize,
}

/// Every layer's SQNR under one INT8 configuration, worst first
/// (`qforge eval layers`).
#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    /// The configuration measured (`int8-dynamic`, …).
    pub precision: String,
    /// Worst first; identical outputs (no noise) last.
    pub layers: Vec<LayerSqnr>,
}

impl LayerReport {
    /// `layers` measured under `precision`, sorted worst first.
    pub fn worst_first(precision: String, mut layers: Vec<LayerSqnr>) -> Self {
        let key = |s: Option<f64>| s.unwrap_or(f64::INFINITY);
        layers.sort_by(|a, b| key(a.sqnr_db).total_cmp(&key(b.sqnr_db)));
        Self { precision, layers }
    }
}

impl std::fmt::Display for LayerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>9}  {:>6}  layer ({})",
            "SQNR dB", "rows", self.precision
        )?;
        for layer in &self.layers {
            let db = layer
                .sqnr_db
                .map_or("exact".to_owned(), |db| format!("{db:.2}"));
            write!(f, "\n{db:>9}  {:>6}  {}", layer.rows, layer.name)?;
        }
        Ok(())
    }
}

/// Every observation point's input rows, concatenated.
#[derive(Default)]
struct Capture(BTreeMap<String, (Vec<f32>, usize)>);

impl Observer for Capture {
    fn observe(&mut self, point: &str, rows: &[f32], width: usize) -> Result<()> {
        let entry = self
            .0
            .entry(point.to_owned())
            .or_insert_with(|| (Vec::new(), width));
        entry.0.extend_from_slice(rows);
        Ok(())
    }
}

fn sqnr(reference: &[f32], test: &[f32]) -> Option<f64> {
    let signal: f64 = reference.iter().map(|v| f64::from(*v).powi(2)).sum();
    let noise: f64 = reference
        .iter()
        .zip(test)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    (noise > 0.0).then(|| 10.0 * (signal / noise).log10())
}

fn measure(
    linears: Vec<(String, String, &Linear)>,
    capture: &Capture,
    activations: &dyn Fn(&str) -> Result<Activations>,
) -> Result<Vec<LayerSqnr>> {
    let mut out = Vec::with_capacity(linears.len());
    for (name, point, linear) in linears {
        let (rows, width) = capture.0.get(&point).ok_or_else(|| {
            qforge_formats::Error::Shape(format!("no input was observed at {point}"))
        })?;
        let x = Tensor::from_slice(rows, (rows.len() / width, *width), &Device::Cpu)?;
        let reference = linear.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
        let quantized = linear
            .to_int8(activations(&point)?)?
            .forward(&x)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        out.push(LayerSqnr {
            name,
            point,
            sqnr_db: sqnr(&reference, &quantized),
            rows: rows.len() / width,
        });
    }
    Ok(out)
}

/// Per-layer SQNR of a full-precision decoder's linear layers on `tokens`
/// (one sequence), each quantized with `activations(point)`.
pub fn llm_layer_sqnr(
    model: &Llama,
    tokens: &[u32],
    activations: &dyn Fn(&str) -> Result<Activations>,
) -> Result<Vec<LayerSqnr>> {
    let mut capture = Capture::default();
    model.forward(&[tokens.to_vec()], None, Some(&mut capture), Logits::Last)?;
    measure(model.linears(), &capture, activations)
}

/// Per-layer SQNR of a full-precision policy's layers on `observations`.
pub fn policy_layer_sqnr(
    policy: &MlpPolicy,
    observations: &[f32],
    activations: &dyn Fn(&str) -> Result<Activations>,
) -> Result<Vec<LayerSqnr>> {
    let mut capture = Capture::default();
    policy.forward(observations, Some(&mut capture))?;
    measure(policy.linears(), &capture, activations)
}

/// The layers that read one input, with their full-precision outputs on
/// captured input rows: what a transformed INT8 version of them is scored
/// against (SmoothQuant's α search).
pub struct OutputReference<'a> {
    layers: Vec<&'a Linear>,
    width: usize,
    outputs: Vec<Tensor>,
}

impl<'a> OutputReference<'a> {
    /// `layers` (all reading inputs of `width` channels) on `rows`.
    pub fn new(layers: Vec<&'a Linear>, rows: &[f32], width: usize) -> Result<Self> {
        let x = Tensor::from_slice(rows, (rows.len() / width, width), &Device::Cpu)?;
        let outputs = layers
            .iter()
            .map(|layer| layer.forward(&x))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            width,
            outputs,
        })
    }

    /// Σ (y − ŷ)² over every layer's outputs, ŷ from the INT8 engine fed
    /// `smoothed` (the rows with channel `j` divided by `factors[j]`),
    /// quantized as `activations` says, with the layers' input columns
    /// multiplied by `factors` before their weights are rounded.
    pub fn smoothed_error(
        &self,
        smoothed: &[f32],
        factors: &[f32],
        activations: Activations,
    ) -> Result<f64> {
        let x = Tensor::from_slice(
            smoothed,
            (smoothed.len() / self.width, self.width),
            &Device::Cpu,
        )?;
        let mut error = 0.0;
        for (layer, reference) in self.layers.iter().zip(&self.outputs) {
            let y = layer
                .scale_inputs(factors)?
                .to_int8(activations)?
                .forward(&x)?;
            let noise = (y - reference)?.sqr()?.flatten_all()?.to_vec1::<f32>()?;
            error += noise.iter().map(|&v| f64::from(v)).sum::<f64>();
        }
        Ok(error)
    }
}
