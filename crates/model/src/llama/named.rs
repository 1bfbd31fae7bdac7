//! A decoder built from tensors held in memory, named as Hugging Face
//! checkpoints name them: how a trainer hands its updated weights to the
//! rollout engine without writing a file.
//!
//! The set of names must be exactly the model's: a tensor missing, one the
//! model does not have, a shape off by one or a non-finite value is refused
//! with the tensor's name, before anything is built.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::Tensor;

use super::{Llama, LlamaConfig, WeightSource};
use crate::error::{Error, Result};
use crate::linear::check_finite_tensor;

/// Tensors by name, read by [`Llama::load`].
struct Named<'a>(&'a BTreeMap<String, Tensor>);

impl WeightSource for Named<'_> {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Format(format!("the weights have no tensor {name}")))
    }

    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

impl Llama {
    /// Every tensor name a model of `config` reads, lm_head's weight only
    /// when `tied` is false.
    pub fn tensor_names(config: &LlamaConfig, tied: bool) -> BTreeSet<String> {
        let mut names = BTreeSet::from([
            "model.embed_tokens.weight".to_owned(),
            "model.norm.weight".to_owned(),
        ]);
        for (linear, _) in Self::linear_points(config) {
            if linear == "lm_head" && tied {
                continue;
            }
            names.insert(format!("{linear}.weight"));
            let attention = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .any(|p| linear.ends_with(p));
            if config.attention_bias && attention {
                names.insert(format!("{linear}.bias"));
            }
        }
        for i in 0..config.num_layers {
            for norm in ["input_layernorm", "post_attention_layernorm"] {
                names.insert(format!("model.layers.{i}.{norm}.weight"));
            }
        }
        names
    }

    /// A model of `config` whose weights are `tensors` (f32, bf16 or f16,
    /// Hugging Face names and layout), with lm_head tied to the embedding
    /// when `tied`. A tied model also takes an `lm_head.weight` equal to
    /// the embedding (PyTorch's `state_dict` lists the tied tensor under
    /// both names).
    pub fn from_tensors(
        config: LlamaConfig,
        tied: bool,
        mut tensors: BTreeMap<String, Tensor>,
    ) -> Result<Self> {
        if tied && let Some(head) = tensors.remove("lm_head.weight") {
            let embedding = tensors.get("model.embed_tokens.weight");
            if !embedding.is_some_and(|e| same_values(e, &head).unwrap_or(false)) {
                return Err(qforge_formats::Error::Shape(
                    "lm_head.weight differs from model.embed_tokens.weight, but this model ties them: give the embedding only (or equal tensors)".into(),
                ).into());
            }
        }
        let expected = Self::tensor_names(&config, tied);
        if let Some(unknown) = tensors.keys().find(|n| !expected.contains(*n)) {
            return Err(qforge_formats::Error::Shape(format!(
                "unknown tensor {unknown}: this model has no such weight (names are the Hugging Face checkpoint's, e.g. model.layers.0.self_attn.q_proj.weight)"
            )).into());
        }
        if let Some(missing) = expected.iter().find(|n| !tensors.contains_key(*n)) {
            return Err(qforge_formats::Error::Shape(format!(
                "missing tensor {missing}: the weights must name every tensor of the model ({} of them)",
                expected.len()
            )).into());
        }
        for (name, tensor) in &tensors {
            check_finite_tensor(name, tensor)?;
        }
        Self::load(config, &Named(&tensors))
    }
}

/// Whether `a` and `b` hold the same shape and values.
fn same_values(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    Ok(f32s(a)? == f32s(b)?)
}
