//! Online Hadamard rotations of linear inputs (QuaRot, Ashkboos et al. 2024):
//! for an input rotated by the normalized Hadamard matrix `Q` of its width,
//! the consuming layers' weights become `W Q` offline and the forward rotates
//! the input online, `x Wᵀ = (x Q)(W Q)ᵀ`. An outlier channel (SmolLM2's
//! SwiGLU products reach ~1000× their 99.99th percentile; the residual
//! stream has a few massive channels) is spread over every channel, so one
//! int8 scale per token or per tensor covers it without flattening the rest.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use qforge_kernels::Hadamard;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{Layer, Llama, LlamaConfig};
use crate::error::{Error, Result};
use crate::linear::Linear;

/// A linear input the forward can rotate, named by the suffix of its
/// observation point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RotatedInput {
    /// q/k/v's input, the attention norm's output.
    #[serde(rename = "self_attn.q_proj")]
    Attention,
    /// o_proj's input, the attention's output.
    #[serde(rename = "self_attn.o_proj")]
    AttentionOutput,
    /// gate/up's input, the MLP norm's output.
    #[serde(rename = "mlp.gate_proj")]
    Mlp,
    /// down_proj's input, the SwiGLU product.
    #[serde(rename = "mlp.down_proj")]
    MlpProduct,
    /// lm_head's input, the final norm's output.
    #[serde(rename = "lm_head")]
    Head,
}

impl RotatedInput {
    /// Every input, in forward order.
    pub const ALL: [RotatedInput; 5] = [
        Self::Attention,
        Self::AttentionOutput,
        Self::Mlp,
        Self::MlpProduct,
        Self::Head,
    ];

    /// Its name: the suffix of its observation point.
    pub fn name(self) -> &'static str {
        match self {
            Self::Attention => "self_attn.q_proj",
            Self::AttentionOutput => "self_attn.o_proj",
            Self::Mlp => "mlp.gate_proj",
            Self::MlpProduct => "mlp.down_proj",
            Self::Head => "lm_head",
        }
    }

    /// The input named `name` (as [`RotatedInput::name`] gives it, or its
    /// last component: `down_proj`).
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.name() == name || r.name().rsplit('.').next() == Some(name))
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|r| r.name()).collect();
                Error::Unsupported(format!(
                    "no rotatable input {name:?}: the inputs are {}",
                    names.join(", ")
                ))
            })
    }

    /// A comma-separated list of inputs (each as [`RotatedInput::parse`]
    /// takes it), or `all`; sorted, without repeats.
    pub fn parse_list(list: &str) -> Result<Vec<Self>> {
        if list == "all" {
            return Ok(Self::ALL.to_vec());
        }
        let mut inputs = list
            .split(',')
            .map(|name| Self::parse(name.trim()))
            .collect::<Result<Vec<_>>>()?;
        inputs.sort();
        inputs.dedup();
        Ok(inputs)
    }

    /// Whether the observation point `point` is this input.
    pub fn is_point(self, point: &str) -> bool {
        point == self.name() || point.ends_with(&format!(".{}", self.name()))
    }

    fn width(self, c: &LlamaConfig) -> usize {
        match self {
            Self::Attention | Self::Mlp | Self::Head => c.hidden_size,
            Self::AttentionOutput => c.num_heads * c.head_dim,
            Self::MlpProduct => c.intermediate_size,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The rotation of each rotated input.
#[derive(Debug, Clone, Default)]
pub(crate) struct Rotations([Option<Arc<Hadamard>>; 5]);

impl Rotations {
    /// The rotation of `input`, if it is rotated.
    pub(crate) fn get(&self, input: RotatedInput) -> Option<&Hadamard> {
        self.0[input.index()].as_deref()
    }
}

/// `rotation` applied to every row of `weight` (a full-precision layer).
fn rotate_weight(layer: &Linear, rotation: &Hadamard) -> Result<Linear> {
    let (weight, bias) = layer.weights_to_transform()?;
    let shape = layer.shape();
    let mut rows = weight.flatten_all()?.to_vec1::<f32>()?;
    rotation.rotate(&mut rows)?;
    let weight = Tensor::from_vec(rows, shape, &Device::Cpu)?;
    Linear::fp("rotated", weight, bias, shape)
}

/// The layers of `layer` that consume `input`.
fn consumers(layer: &mut Layer, input: RotatedInput) -> Vec<&mut Linear> {
    match input {
        RotatedInput::Attention => vec![&mut layer.q_proj, &mut layer.k_proj, &mut layer.v_proj],
        RotatedInput::AttentionOutput => vec![&mut layer.o_proj],
        RotatedInput::Mlp => vec![&mut layer.gate_proj, &mut layer.up_proj],
        RotatedInput::MlpProduct => vec![&mut layer.down_proj],
        RotatedInput::Head => Vec::new(),
    }
}

impl Llama {
    /// The same function with each of `inputs` rotated by the normalized
    /// Hadamard matrix of its width: the weights hold the rotation and the
    /// forward (tensor and INT8 decoder) rotates the input online. Needs
    /// full-precision layers and widths with a Hadamard construction; an
    /// input rotated already is refused.
    pub fn rotated(&self, inputs: &[RotatedInput]) -> Result<Llama> {
        let mut model = self.with_rotations(inputs)?;
        for &input in inputs {
            let rotation = model.rotations.get(input).expect("set above").clone();
            // Layer by layer on the rayon pool: each weight's rotation is its
            // own, so the bytes do not depend on the thread count.
            model.layers.par_iter_mut().try_for_each(|layer| {
                for linear in consumers(layer, input) {
                    *linear = rotate_weight(linear, &rotation)?;
                }
                Ok::<(), Error>(())
            })?;
            if input == RotatedInput::Head {
                model.lm_head = rotate_weight(&model.lm_head, &rotation)?;
            }
        }
        Ok(model)
    }

    /// Marks `inputs` as rotated without touching the weights (an artifact's
    /// weights hold the rotation already).
    pub(crate) fn with_rotations(&self, inputs: &[RotatedInput]) -> Result<Llama> {
        let mut model = self.clone();
        for &input in inputs {
            if model.rotations.get(input).is_some() {
                return Err(Error::Unsupported(format!(
                    "the {} inputs of this model are rotated already",
                    input.name()
                )));
            }
            let rotation = Hadamard::new(input.width(&self.config)).map_err(|e| {
                Error::Unsupported(format!("rotating the {} inputs: {e}", input.name()))
            })?;
            model.rotations.0[input.index()] = Some(Arc::new(rotation));
        }
        Ok(model)
    }

    /// The inputs the forward rotates online, in forward order.
    pub fn rotated_inputs(&self) -> Vec<RotatedInput> {
        RotatedInput::ALL
            .into_iter()
            .filter(|&r| self.rotations.get(r).is_some())
            .collect()
    }

    /// `x` as the layers consuming `input` take it: rotated when the model
    /// rotates that input.
    pub(crate) fn rotate_input(&self, input: RotatedInput, x: Tensor) -> Result<Tensor> {
        let Some(rotation) = self.rotations.get(input) else {
            return Ok(x);
        };
        let shape = x.dims().to_vec();
        let mut rows = x.flatten_all()?.to_vec1::<f32>()?;
        rotation.rotate(&mut rows)?;
        Ok(Tensor::from_vec(rows, shape, &Device::Cpu)?)
    }
}
