//! Online Hadamard rotations of linear inputs (QuaRot, Ashkboos et al. 2024):
//! for an input rotated by the normalized Hadamard matrix `Q` of its width,
//! the consuming layers' weights become `W Q` offline and the forward rotates
//! the input online, `x Wᵀ = (x Q)(W Q)ᵀ`. An outlier channel (SmolLM2's
//! SwiGLU products reach ~1000× their 99.99th percentile; the residual
//! stream has a few massive channels) is spread over every channel, so one
//! int8 scale per token or per tensor covers it without flattening the rest.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
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
                qforge_formats::Error::Unsupported(format!(
                    "no rotatable input {name:?}: the inputs are {}",
                    names.join(", ")
                ))
                .into()
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

    /// The linear layers that read this input, by their module names within
    /// a decoder layer (`lm_head`: the model's own).
    pub fn consumers(self) -> &'static [&'static str] {
        match self {
            Self::Attention => &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            Self::AttentionOutput => &["self_attn.o_proj"],
            Self::Mlp => &["mlp.gate_proj", "mlp.up_proj"],
            Self::MlpProduct => &["mlp.down_proj"],
            Self::Head => &["lm_head"],
        }
    }

    /// Whether the observation point `point` is this input.
    pub fn is_point(self, point: &str) -> bool {
        point == self.name() || point.ends_with(&format!(".{}", self.name()))
    }

    /// The width of this input in a model of config `c`.
    pub fn width(self, c: &LlamaConfig) -> usize {
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
pub struct Rotations([Option<Arc<Hadamard>>; 5]);

impl Rotations {
    /// The rotation of `input`, if it is rotated.
    pub fn get(&self, input: RotatedInput) -> Option<&Hadamard> {
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

/// `layer` writing into a residual stream rotated by `R = diag(signs) Q`:
/// its output `y` becomes `y R`, so its weight becomes `Rᵀ W` (`x (Rᵀ W)ᵀ =
/// x Wᵀ R`): every column `c` of `W` (and the bias) becomes `(c ⊙ signs) Q`
/// read as a row.
fn rotate_outputs(layer: &Linear, rotation: &Hadamard, signs: &[f32]) -> Result<Linear> {
    let (weight, bias) = layer.scale_outputs(signs)?.weights_to_transform()?;
    let shape = layer.shape();
    let mut columns = weight.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    rotation.rotate(&mut columns)?;
    let weight = Tensor::from_vec(columns, (shape.1, shape.0), &Device::Cpu)?
        .t()?
        .contiguous()?;
    let bias = match bias {
        Some(b) => {
            let mut values = b.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            rotation.rotate(&mut values)?;
            Some(Tensor::from_vec(values, shape.0, &Device::Cpu)?)
        }
        None => None,
    };
    Linear::fp("rotated", weight, bias, shape)
}

/// The ±1 signs of a randomized Hadamard rotation of `n` channels, drawn
/// from `seed` by SplitMix64 (the top bit of each draw): fixed forever, so
/// an artifact records only the seed.
fn random_signs(n: usize, seed: u64) -> Vec<f32> {
    let mut draws = qforge_core::SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            if draws.next_u64() >> 63 == 1 {
                -1.0
            } else {
                1.0
            }
        })
        .collect()
}

/// `values` times `signs`, channel by channel.
fn signed(values: &[f32], signs: &[f32]) -> Vec<f32> {
    values.iter().zip(signs).map(|(v, s)| v * s).collect()
}

/// The layers fed by the RMSNorm of gain `norm`, with the gain folded into
/// their input columns and their inputs rotated by `diag(signs) Q`; `norm`
/// becomes all ones. The norm's output `n(x) ⊙ g` feeds `W`, so `W diag(g)`
/// takes `n(x)` alone, and `n(x R) = n(x) R` for an orthogonal `R`: a
/// unit-gain RMSNorm commutes with the rotation.
fn fold_norm_and_rotate(
    norm: &mut Tensor,
    layers: &mut [&mut Linear],
    rotation: &Hadamard,
    signs: &[f32],
) -> Result<()> {
    let gain = signed(&norm.to_vec1::<f32>()?, signs);
    for linear in layers.iter_mut() {
        **linear = rotate_weight(&linear.scale_inputs(&gain)?, rotation)?;
    }
    *norm = norm.ones_like()?;
    Ok(())
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

    /// The same function with the residual stream rotated offline by the
    /// randomized Hadamard matrix `R = diag(s) Q` of the hidden width
    /// (QuaRot's main rotation; `Q` normalized Hadamard, `s` ±1 signs drawn
    /// from `seed`): the embedding becomes `E R`, every RMSNorm gain is
    /// folded into the linears it feeds (the norms become all ones), those
    /// linears take rotated inputs (`W diag(g) R`) and o_proj and down_proj
    /// write rotated outputs (`Rᵀ W`). The residual's massive channels are
    /// spread over every channel before q/k/v, gate/up and lm_head see them,
    /// at no run-time cost: the result is a plain Llama (lm_head no longer
    /// tied to the embedding), which every format can carry. The random
    /// signs matter: on SmolLM2 with dynamic int8 activations and down_proj
    /// rotated online they took the perplexity cost from +0.73–0.77 % (plain
    /// `Q`) to +0.25–0.47 % (BENCHMARKS.md). Needs full-precision
    /// layers and no online rotations yet (those come after, on o_proj's and
    /// down_proj's inputs, which the residual does not reach).
    pub fn residual_rotated(&self, seed: u64) -> Result<Llama> {
        self.residual_rotated_into(seed, |layer| Ok(layer.clone()))
    }

    /// [`Llama::residual_rotated`] with every linear layer (lm_head
    /// included) then replaced by `convert(layer)` as soon as it is
    /// rotated: the rotated f32 copies live one decoder layer per thread at
    /// a time, never the whole model's at once (an 8B model's are 32 GB).
    pub fn residual_rotated_into(
        &self,
        seed: u64,
        convert: impl Fn(&Linear) -> Result<Linear> + Sync,
    ) -> Result<Llama> {
        if let Some(input) = self.rotated_inputs().first() {
            return Err(qforge_formats::Error::Unsupported(format!(
                "the {} inputs of this model are rotated online already; rotate the residual stream first",
                input.name()
            )).into());
        }
        let rotation = Hadamard::new(self.config.hidden_size).map_err(|e| {
            qforge_formats::Error::Unsupported(format!("rotating the residual stream: {e}"))
        })?;
        let signs = random_signs(rotation.len(), seed);
        let mut model = self.clone();
        let (vocab, hidden) = model.embed_tokens.dims2()?;
        let mut rows = model
            .embed_tokens
            .to_dtype(DType::F32)?
            .broadcast_mul(&Tensor::from_slice(&signs, (1, hidden), &Device::Cpu)?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        rotation.rotate(&mut rows)?;
        model.embed_tokens = Tensor::from_vec(rows, (vocab, hidden), &Device::Cpu)?;
        // Layer by layer on the rayon pool: each weight's change is its own,
        // so the bytes do not depend on the thread count.
        model.layers.par_iter_mut().try_for_each(|layer| {
            fold_norm_and_rotate(
                &mut layer.input_norm,
                &mut [&mut layer.q_proj, &mut layer.k_proj, &mut layer.v_proj],
                &rotation,
                &signs,
            )?;
            fold_norm_and_rotate(
                &mut layer.post_attention_norm,
                &mut [&mut layer.gate_proj, &mut layer.up_proj],
                &rotation,
                &signs,
            )?;
            layer.o_proj = rotate_outputs(&layer.o_proj, &rotation, &signs)?;
            layer.down_proj = rotate_outputs(&layer.down_proj, &rotation, &signs)?;
            let linears = [
                &mut layer.q_proj,
                &mut layer.k_proj,
                &mut layer.v_proj,
                &mut layer.o_proj,
                &mut layer.gate_proj,
                &mut layer.up_proj,
                &mut layer.down_proj,
            ];
            for linear in linears {
                *linear = convert(linear)?;
            }
            Ok::<(), Error>(())
        })?;
        let gain = signed(&model.norm.to_vec1::<f32>()?, &signs);
        model.lm_head = convert(&rotate_weight(
            &model.lm_head.scale_inputs(&gain)?,
            &rotation,
        )?)?;
        model.norm = model.norm.ones_like()?;
        model.tied_embeddings = false;
        Ok(model)
    }

    /// Marks `inputs` as rotated without touching the weights (an artifact's
    /// weights hold the rotation already).
    pub(crate) fn with_rotations(&self, inputs: &[RotatedInput]) -> Result<Llama> {
        let mut model = self.clone();
        for &input in inputs {
            if model.rotations.get(input).is_some() {
                return Err(qforge_formats::Error::Unsupported(format!(
                    "the {} inputs of this model are rotated already",
                    input.name()
                ))
                .into());
            }
            let rotation = Hadamard::new(input.width(&self.config)).map_err(|e| {
                qforge_formats::Error::Unsupported(format!(
                    "rotating the {} inputs: {e}",
                    input.name()
                ))
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
