//! Models derived from a model by rewriting its linear layers: per-layer
//! replacement (quantizing by calibration point or by name) and SmoothQuant's
//! smoothing. Each returns a new [`Llama`] and leaves the original as it was,
//! so a caller can compare the two. (The Hadamard rotations live in
//! `rotation.rs`.)

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::Llama;
use crate::error::{Error, Result};
use crate::linear::Linear;

impl Llama {
    /// The same model with every linear layer (lm_head included) replaced
    /// by `convert(name, layer)`; names are the observation points'
    /// (`model.layers.3.self_attn.q_proj` stands for q, k and v, which share an
    /// input, and `…mlp.gate_proj` for gate and up), so per-layer choices from
    /// calibration apply by name.
    pub fn with_linears(
        &self,
        convert: impl Fn(&str, &Linear) -> Result<Linear> + Sync,
    ) -> Result<Llama> {
        self.map_linears(|_, point, layer| convert(point, layer))
    }

    /// The same model with each linear layer `replacements` names (as
    /// [`Llama::linears`] names them) replaced by `replace(layer, its
    /// replacement)`, on the rayon pool's threads; a name that is no layer
    /// of this model is an error.
    pub fn with_replaced<T: Sync>(
        &self,
        replacements: &BTreeMap<String, T>,
        replace: impl Fn(&Linear, &T) -> Result<Linear> + Sync,
    ) -> Result<Llama> {
        let names: Vec<String> = self.linears().into_iter().map(|(n, _, _)| n).collect();
        if let Some(unknown) = replacements.keys().find(|n| !names.contains(n)) {
            return Err(qforge_formats::Error::Shape(format!(
                "{unknown} is not a linear layer of this model"
            ))
            .into());
        }
        self.map_linears(|name, _, layer| match replacements.get(name) {
            Some(replacement) => replace(layer, replacement),
            None => Ok(layer.clone()),
        })
    }

    /// Every linear layer replaced by `convert(name, point, layer)`, the
    /// decoder layers on the rayon pool's threads (each layer's conversion
    /// is independent of the others', so the result does not depend on the
    /// thread count).
    fn map_linears(
        &self,
        convert: impl Fn(&str, &str, &Linear) -> Result<Linear> + Sync,
    ) -> Result<Llama> {
        let mut model = self.clone();
        model
            .layers
            .par_iter_mut()
            .enumerate()
            .try_for_each(|(i, layer)| {
                let attention = format!("model.layers.{i}.self_attn");
                let mlp = format!("model.layers.{i}.mlp");
                let qkv = format!("{attention}.q_proj");
                let gate_up = format!("{mlp}.gate_proj");
                let down = format!("{mlp}.down_proj");
                let o = format!("{attention}.o_proj");
                layer.q_proj = convert(&qkv, &qkv, &layer.q_proj)?;
                layer.k_proj = convert(&format!("{attention}.k_proj"), &qkv, &layer.k_proj)?;
                layer.v_proj = convert(&format!("{attention}.v_proj"), &qkv, &layer.v_proj)?;
                layer.o_proj = convert(&o, &o, &layer.o_proj)?;
                layer.gate_proj = convert(&gate_up, &gate_up, &layer.gate_proj)?;
                layer.up_proj = convert(&format!("{mlp}.up_proj"), &gate_up, &layer.up_proj)?;
                layer.down_proj = convert(&down, &down, &layer.down_proj)?;
                Ok::<(), Error>(())
            })?;
        model.lm_head = convert("lm_head", "lm_head", &model.lm_head)?;
        Ok(model)
    }

    /// The layer inputs SmoothQuant can smooth: those whose scale folds
    /// exactly into the layer before (an RMSNorm weight, or `up_proj`'s
    /// output rows for the SwiGLU product `down_proj` takes).
    /// A rotated input is not smoothable: its channels are mixtures of the
    /// channels a factor would fold into.
    pub fn smoothable_points(&self) -> Vec<String> {
        (0..self.layers.len())
            .flat_map(|i| {
                [
                    format!("model.layers.{i}.self_attn.q_proj"),
                    format!("model.layers.{i}.mlp.gate_proj"),
                    format!("model.layers.{i}.mlp.down_proj"),
                ]
            })
            .filter(|point| !self.rotated_inputs().iter().any(|r| r.is_point(point)))
            .collect()
    }

    /// SmoothQuant's transform (Xiao et al. 2023): for each point in
    /// `factors`, the input's channel `j` is divided by `s[j]` where it is
    /// made (the preceding RMSNorm weight; for `down_proj`, `up_proj`'s output
    /// row `j`, which scales the SwiGLU product) and the consuming layers'
    /// input column `j` is multiplied by it. The function is unchanged up to
    /// f32 rounding; what changes is how the activation's outlier channels
    /// and the weights share the quantization range. Needs full-precision
    /// layers.
    pub fn smoothed(&self, factors: &BTreeMap<String, Vec<f32>>) -> Result<Llama> {
        let smoothable = self.smoothable_points();
        if let Some(point) = factors.keys().find(|p| !smoothable.contains(p)) {
            return Err(qforge_formats::Error::Unsupported(format!(
                "smoothing {point}: its scale does not fold into a preceding norm or layer"
            ))
            .into());
        }
        let mut model = self.clone();
        let divide = |t: &Tensor, s: &[f32]| -> Result<Tensor> {
            let s = Tensor::from_slice(s, s.len(), &Device::Cpu)?;
            if t.dims() != s.dims() {
                return Err(qforge_formats::Error::Shape(format!(
                    "{} smoothing factors for a norm of {:?}",
                    s.elem_count(),
                    t.dims()
                ))
                .into());
            }
            Ok(t.div(&s)?)
        };
        for (i, layer) in model.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            if let Some(s) = factors.get(&format!("{p}.self_attn.q_proj")) {
                layer.input_norm = divide(&layer.input_norm, s)?;
                layer.q_proj = layer.q_proj.scale_inputs(s)?;
                layer.k_proj = layer.k_proj.scale_inputs(s)?;
                layer.v_proj = layer.v_proj.scale_inputs(s)?;
            }
            if let Some(s) = factors.get(&format!("{p}.mlp.gate_proj")) {
                layer.post_attention_norm = divide(&layer.post_attention_norm, s)?;
                layer.gate_proj = layer.gate_proj.scale_inputs(s)?;
                layer.up_proj = layer.up_proj.scale_inputs(s)?;
            }
            if let Some(s) = factors.get(&format!("{p}.mlp.down_proj")) {
                let inverse: Vec<f32> = s.iter().map(|v| 1.0 / v).collect();
                layer.up_proj = layer.up_proj.scale_outputs(&inverse)?;
                layer.down_proj = layer.down_proj.scale_inputs(s)?;
            }
        }
        Ok(model)
    }
}
