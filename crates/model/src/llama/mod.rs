//! Llama-family decoders (Llama 1–3, SmolLM2, Mistral, Qwen2): one forward for
//! every family, with observable linear inputs, padding masks and a KV cache.
//!
//! Weights load from GGUF (dequantized to f32) or from a Hugging Face directory.
//! Both end up in Hugging Face layout: GGUF files of the Llama and Mistral
//! families store q/k rows permuted for llama.cpp's interleaved rotary
//! embedding, and they are permuted back at load, so a single (half-split)
//! rotary embedding serves every source.
//!
//! This file holds the model, its layers and the names of their linear
//! layers and observation points; each other job has a file of its own, so
//! that none holds them all: `load.rs` builds a model from its weights (with
//! `named.rs` and `compressed.rs` among the sources), `cache.rs` is the KV
//! cache, `stack.rs` the decoder layers every pass runs, `forward.rs` the
//! passes that give logits, `observation.rs` the observing passes,
//! `transform.rs` and `rotation.rs` derive models. The INT8 decoder, a second
//! forward over the same weights and caches, is `qforge-decode`'s: it reads
//! them through [`Llama::layers`], the other accessors and [`KvCache`]'s
//! in-place layer buffers.

mod attention;
mod cache;
pub mod compressed;
mod forward;
mod load;
mod named;
mod observation;
mod rotation;
mod stack;
mod transform;

pub use cache::{CachedHead, KvCache, SharedPrefix};
pub use forward::log_softmax;
pub use load::{DEQUANTIZE_AT_LOAD_LIMIT, Residency};
pub(crate) use load::{SHARD_INDEX, WeightSource, index_shards};
pub use rotation::RotatedInput;
pub use rotation::Rotations;
pub use stack::HiddenState;

use candle_core::Tensor;
use qforge_formats::llama_config::{Family, LlamaConfig};

use crate::linear::Linear;

/// One decoder layer, as [`Llama::layers`] shows it (the INT8 decoder reads
/// its weights). A model's layers are built by its loaders and changed only
/// by its transforms: a `&Llama` gives no way to change them.
#[derive(Debug, Clone)]
pub struct Layer {
    /// RMSNorm weight before attention, `[hidden]`.
    pub input_norm: Tensor,
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Attention output projection.
    pub o_proj: Linear,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub post_attention_norm: Tensor,
    /// SwiGLU gate projection.
    pub gate_proj: Linear,
    /// SwiGLU up projection.
    pub up_proj: Linear,
    /// MLP output projection.
    pub down_proj: Linear,
}

impl Layer {
    /// The linear layers in forward order (that of [`Llama::linear_points`]).
    fn linears(&self) -> [&Linear; 7] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }
}

/// A Llama-family decoder.
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Whether the source stored no separate `lm_head` (it is the embedding).
    tied_embeddings: bool,
    /// Cosine and sine tables, `[max_positions, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    /// The inputs rotated online (their weights hold the rotation): see
    /// [`Llama::rotated`].
    rotations: Rotations,
}

/// Which positions' logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position: `[batch, seq, vocab]`.
    All,
    /// The last real position of each sequence: `[batch, vocab]`.
    Last,
}

/// Longest context qforge runs (its rotary tables are built for this many
/// positions at most): 64 Ki tokens, far beyond what a CPU calibration or
/// evaluation uses.
pub const MAX_POSITIONS: usize = 1 << 16;

impl Llama {
    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The decoder layers, first to last.
    #[inline]
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The token embedding, `[vocab, hidden]`.
    #[inline]
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The rotary embedding's cosine and sine tables, `[positions, head_dim / 2]`.
    #[inline]
    pub fn rope_tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// The final RMSNorm weight, `[hidden]`.
    #[inline]
    pub fn final_norm(&self) -> &Tensor {
        &self.norm
    }

    /// The output projection.
    #[inline]
    pub fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    /// The rotations of the inputs rotated online (see [`Llama::rotated`]).
    #[inline]
    pub fn rotations(&self) -> &Rotations {
        &self.rotations
    }

    /// Whether the source had no separate `lm_head`: the output projection
    /// is the token embedding.
    pub fn tied_embeddings(&self) -> bool {
        self.tied_embeddings
    }

    /// Bytes of every linear layer's weight as stored (lm_head included; a tied
    /// lm_head shares the embedding's f32 copy).
    pub fn linear_weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(Layer::linears)
            .map(Linear::weight_bytes)
            .sum::<usize>()
            + self.lm_head.weight_bytes()
    }

    /// Every tensor besides the linear layers' (embedding and norms), by
    /// Hugging Face name.
    pub(crate) fn other_tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_owned(), &self.embed_tokens)];
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), &layer.input_norm));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                &layer.post_attention_norm,
            ));
        }
        out.push(("model.norm.weight".to_owned(), &self.norm));
        out
    }

    /// (name, observation point) of every linear layer of a model with
    /// `config`, in the order of [`Llama::linears`].
    pub fn linear_points(config: &LlamaConfig) -> Vec<(String, String)> {
        let mut out = Vec::with_capacity(7 * config.num_layers + 1);
        for i in 0..config.num_layers {
            let attention = format!("model.layers.{i}.self_attn");
            let mlp = format!("model.layers.{i}.mlp");
            for (proj, point) in [
                ("q_proj", "q_proj"),
                ("k_proj", "q_proj"),
                ("v_proj", "q_proj"),
                ("o_proj", "o_proj"),
            ] {
                out.push((
                    format!("{attention}.{proj}"),
                    format!("{attention}.{point}"),
                ));
            }
            for (proj, point) in [
                ("gate_proj", "gate_proj"),
                ("up_proj", "gate_proj"),
                ("down_proj", "down_proj"),
            ] {
                out.push((format!("{mlp}.{proj}"), format!("{mlp}.{point}")));
            }
        }
        out.push(("lm_head".into(), "lm_head".into()));
        out
    }

    /// Every linear layer as (name, observation point, layer), in forward
    /// order, lm_head last.
    pub fn linears(&self) -> Vec<(String, String, &Linear)> {
        let layers = self.layers.iter().flat_map(Layer::linears);
        Self::linear_points(&self.config)
            .into_iter()
            .zip(layers.chain([&self.lm_head]))
            .map(|((name, point), layer)| (name, point, layer))
            .collect()
    }

    /// The decoder layer an observation point (or linear layer) named
    /// `point` belongs to: `N` for `model.layers.N.…`, `None` for
    /// `lm_head`, which follows them all.
    pub fn layer_of(point: &str) -> Option<usize> {
        point
            .strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    }
}
