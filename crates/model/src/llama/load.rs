//! Building a [`Llama`] from its weights: a GGUF file (q/k rows permuted back
//! to Hugging Face order, weights dequantized at load or kept as stored, see
//! [`Residency`]), a Hugging Face directory of safetensors shards, or any other
//! [`WeightSource`] (tensors in memory, a native artifact). Every source is read
//! by Hugging Face name and ends in [`Llama::load`], so one checked builder
//! serves them all.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::{Family, Layer, Llama, LlamaConfig, MAX_POSITIONS, Rotations, compressed};
use crate::error::{Error, Result};
use crate::linear::{Linear, MappedTensor, StoredWeight};
use qforge_formats::gguf::GgufFile;

/// Where a model's tensors come from, by Hugging Face name.
pub(crate) trait WeightSource {
    fn tensor(&self, name: &str) -> Result<Tensor>;
    fn has(&self, name: &str) -> bool;

    /// The linear layer `name` (`name.weight`, and `name.bias` when `bias`).
    fn linear(&self, name: &str, bias: bool, shape: (usize, usize)) -> Result<Linear> {
        let b = self.bias(name, bias)?;
        Linear::fp(name, self.tensor(&format!("{name}.weight"))?, b, shape)
    }

    /// `name.bias` when the layer has one.
    fn bias(&self, name: &str, bias: bool) -> Result<Option<Tensor>> {
        bias.then(|| self.tensor(&format!("{name}.bias")))
            .transpose()
    }
}

/// Whether GGUF weights are dequantized once at load or kept as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Dequantize at load unless the f32 copy would exceed
    /// [`DEQUANTIZE_AT_LOAD_LIMIT`] bytes.
    Auto,
    /// Dequantize every weight to f32 at load (fastest).
    Dequantized,
    /// Keep quantized linear weights as stored; dequantize per layer at each
    /// forward (least memory; same values).
    Stored,
}

/// Largest f32 copy of a GGUF model made at load: 8 GiB, a third of this
/// project's 24 GiB machines.
pub const DEQUANTIZE_AT_LOAD_LIMIT: u64 = 8 << 30;

/// Hugging Face tensor name → GGUF tensor name.
fn gguf_name(hf: &str) -> String {
    let rest = |prefix: &str| hf.strip_prefix(prefix);
    if hf == "model.embed_tokens.weight" {
        return "token_embd.weight".into();
    }
    if hf == "model.norm.weight" {
        return "output_norm.weight".into();
    }
    if hf == "lm_head.weight" {
        return "output.weight".into();
    }
    if let Some(tail) = rest("model.layers.") {
        let (layer, module) = tail.split_once('.').unwrap_or((tail, ""));
        let mapped = [
            ("input_layernorm.", "attn_norm."),
            ("self_attn.q_proj.", "attn_q."),
            ("self_attn.k_proj.", "attn_k."),
            ("self_attn.v_proj.", "attn_v."),
            ("self_attn.o_proj.", "attn_output."),
            ("post_attention_layernorm.", "ffn_norm."),
            ("mlp.gate_proj.", "ffn_gate."),
            ("mlp.up_proj.", "ffn_up."),
            ("mlp.down_proj.", "ffn_down."),
        ]
        .iter()
        .find_map(|(from, to)| module.strip_prefix(from).map(|p| format!("{to}{p}")));
        if let Some(m) = mapped {
            return format!("blk.{layer}.{m}");
        }
    }
    hf.to_owned()
}

struct GgufSource {
    file: GgufFile,
    /// Heads of q and of k, when q/k rows are stored permuted.
    permuted_heads: Option<(usize, usize)>,
    keep_quantized: bool,
}

impl GgufSource {
    /// The row order that undoes llama.cpp's q/k permutation, if `name` needs it.
    fn row_order(&self, name: &str) -> Option<Vec<usize>> {
        let heads = match self.permuted_heads {
            Some((q, _)) if name.ends_with("self_attn.q_proj.weight") => q,
            Some((_, k)) if name.ends_with("self_attn.k_proj.weight") => k,
            _ => return None,
        };
        let rows = self.file.header.tensors.get(&gguf_name(name))?.shape[0];
        Some(rope_row_order(rows, heads))
    }

    fn quantized(&self, name: &str) -> Result<candle_core::quantized::QTensor> {
        let order = self.row_order(name);
        Ok(self
            .file
            .tensor_quantized(&gguf_name(name), order.as_deref())?)
    }
}

impl WeightSource for GgufSource {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        Ok(self.quantized(name)?.dequantize(&Device::Cpu)?)
    }

    fn has(&self, name: &str) -> bool {
        self.file.has(&gguf_name(name))
    }

    fn linear(&self, name: &str, bias: bool, shape: (usize, usize)) -> Result<Linear> {
        let b = self.bias(name, bias)?;
        let weight = self.quantized(&format!("{name}.weight"))?;
        if !self.keep_quantized {
            return Linear::fp(name, weight.dequantize(&Device::Cpu)?, b, shape);
        }
        Linear::stored(name, StoredWeight::Blocks(Arc::new(weight)), b, shape)
    }
}

/// The row order that undoes llama.cpp's q/k permutation: within each head,
/// GGUF row `2j + s` holds Hugging Face row `s·(head_dim/2) + j`, so Hugging
/// Face row `r` is taken from GGUF row `order[r]`.
fn rope_row_order(rows: usize, heads: usize) -> Vec<usize> {
    let head_dim = rows / heads.max(1);
    let half = (head_dim / 2).max(1);
    (0..rows)
        .map(|r| {
            let (head, within) = (r / head_dim, r % head_dim);
            head * head_dim + 2 * (within % half) + within / half
        })
        .collect()
}

struct SafetensorsSource {
    tensors: Arc<candle_core::safetensors::MmapedSafetensors>,
    names: std::collections::HashSet<String>,
    /// The compressed-tensors quantization `config.json` declares, if any.
    scheme: Option<compressed::Scheme>,
}

impl WeightSource for SafetensorsSource {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        Ok(self.tensors.load(name, &Device::Cpu)?)
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// bf16 and f16 weights stay in the file's mapping and are widened at
    /// each use (which a resident copy would need too); f32 and other weights
    /// are read into memory as before, so an f32 model's forward copies
    /// nothing.
    fn linear(&self, name: &str, bias: bool, shape: (usize, usize)) -> Result<Linear> {
        let weight_name = format!("{name}.weight");
        let b = self.bias(name, bias)?;
        if let Some(scheme) = &self.scheme
            && let Some(quantized) = scheme.linear(&self.tensors, name, b.clone(), shape)?
        {
            return Ok(quantized);
        }
        let mapped = MappedTensor::new(self.tensors.clone(), &weight_name)?;
        if !matches!(mapped.dtype(), DType::BF16 | DType::F16) {
            return Linear::fp(name, self.tensor(&weight_name)?, b, shape);
        }
        Linear::stored(name, StoredWeight::Mapped(Arc::new(mapped)), b, shape)
    }
}

impl Llama {
    /// Loads a GGUF file, dequantizing weights to f32 at load unless the f32
    /// copy would exceed [`DEQUANTIZE_AT_LOAD_LIMIT`].
    pub fn from_gguf(path: &Path) -> Result<Self> {
        Self::from_gguf_with(path, Residency::Auto)
    }

    /// Loads a GGUF file with a chosen weight residency.
    pub fn from_gguf_with(path: &Path, residency: Residency) -> Result<Self> {
        Self::from_gguf_file(GgufFile::open(path)?, residency)
    }

    /// Builds the decoder from an opened GGUF file (whose header the caller
    /// may already have read, e.g. for the tokenizer).
    pub fn from_gguf_file(file: GgufFile, residency: Residency) -> Result<Self> {
        let path = file.path().to_owned();
        let path = path.as_path();
        let config = LlamaConfig::from_gguf(&file.header).map_err(|e| e.in_file(path))?;
        let permuted_heads = matches!(config.family, Family::Llama | Family::Mistral)
            .then_some((config.num_heads, config.num_kv_heads));
        let keep_quantized = match residency {
            Residency::Auto => file.dequantized_bytes() > DEQUANTIZE_AT_LOAD_LIMIT,
            Residency::Dequantized => false,
            Residency::Stored => true,
        };
        let source = GgufSource {
            file,
            permuted_heads,
            keep_quantized,
        };
        Self::load(config, &source).map_err(|e| e.in_file(path))
    }

    /// Loads a Hugging Face directory: `config.json` and `model.safetensors` or
    /// a sharded `model.safetensors.index.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let json: serde_json::Value = qforge_formats::files::read_json(&config_path)?;
        let config = LlamaConfig::from_hf(&json).map_err(|e| e.in_file(&config_path))?;
        let scheme = compressed::Scheme::from_config(&json, &config_path)?;
        let files: Vec<_> = safetensors_files(dir)?
            .into_iter()
            .map(|(_, path)| path)
            .collect();
        // candle opens the shards itself: refuse a FIFO or device before it
        // blocks on one.
        for file in &files {
            qforge_formats::files::open_regular(file)?;
        }
        // SAFETY: read-only maps of model files that qforge does not modify.
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| Error::Format(format!("{}: {e}", dir.display())))?;
        let tensors = Arc::new(tensors);
        let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        let rotations = match &scheme {
            Some(_) => compressed::online_rotations(
                &json["quantization_config"],
                &config,
                &tensors,
                &config_path,
            )?,
            None => Vec::new(),
        };
        let source = SafetensorsSource {
            tensors,
            names,
            scheme,
        };
        Self::load(config, &source)
            .and_then(|model| model.with_rotations(&rotations))
            .map_err(|e| e.in_file(dir))
    }

    /// Builds the decoder from its config and a tensor source.
    pub(crate) fn load(config: LlamaConfig, source: &dyn WeightSource) -> Result<Self> {
        let c = &config;
        let (d, kv) = (c.hidden_size, c.num_kv_heads * c.head_dim);
        let q_width = c.num_heads * c.head_dim;
        // The norms' gains, checked finite: one NaN gain makes every logit
        // NaN. (The linear weights of a GGUF or Hugging Face source are not
        // scanned: that would mean dequantizing every block at load. An
        // artifact's tensors are all checked as they are read.)
        let vector = |name: &str, len: usize| -> Result<Tensor> {
            let t = source.tensor(name)?.to_dtype(DType::F32)?;
            if t.dims() != [len] {
                return Err(qforge_formats::Error::Shape(format!(
                    "{name} is {:?}, expected [{len}]",
                    t.dims()
                ))
                .into());
            }
            crate::linear::check_finite_tensor(name, &t)?;
            Ok(t)
        };
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            source.linear(name, bias, (out, inp))
        };
        // bf16 and f16 embeddings stay as stored and each looked-up row is
        // widened (exactly): Llama-3-8B's table is 1.05 GB so, not 2.1 GB.
        let embed_tokens = source.tensor("model.embed_tokens.weight")?;
        let embed_tokens = match embed_tokens.dtype() {
            DType::BF16 | DType::F16 => embed_tokens,
            _ => embed_tokens.to_dtype(DType::F32)?,
        };
        if embed_tokens.dims() != [c.vocab_size, d] {
            return Err(qforge_formats::Error::Shape(format!(
                "model.embed_tokens.weight is {:?}, expected [{}, {d}]",
                embed_tokens.dims(),
                c.vocab_size
            ))
            .into());
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_norm: vector(&format!("{p}.input_layernorm.weight"), d)?,
                q_proj: linear(
                    &format!("{p}.self_attn.q_proj"),
                    q_width,
                    d,
                    c.attention_bias,
                )?,
                k_proj: linear(&format!("{p}.self_attn.k_proj"), kv, d, c.attention_bias)?,
                v_proj: linear(&format!("{p}.self_attn.v_proj"), kv, d, c.attention_bias)?,
                o_proj: linear(&format!("{p}.self_attn.o_proj"), d, q_width, false)?,
                post_attention_norm: vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
                gate_proj: linear(&format!("{p}.mlp.gate_proj"), c.intermediate_size, d, false)?,
                up_proj: linear(&format!("{p}.mlp.up_proj"), c.intermediate_size, d, false)?,
                down_proj: linear(&format!("{p}.mlp.down_proj"), d, c.intermediate_size, false)?,
            });
        }
        let norm = vector("model.norm.weight", d)?;
        // Tied embeddings: the output projection is the embedding matrix.
        let tied_embeddings = !source.has("lm_head.weight");
        let lm_head = if !tied_embeddings {
            linear("lm_head", c.vocab_size, d, false)?
        } else {
            Linear::fp("lm_head", embed_tokens.clone(), None, (c.vocab_size, d))?
        };
        let positions = c.max_position_embeddings.min(MAX_POSITIONS);
        let inv = Tensor::new(c.inverse_frequencies(), &Device::Cpu)?;
        let t = Tensor::arange(0u32, positions as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((positions, 1))?;
        let freqs = t.broadcast_mul(&inv.reshape((1, c.head_dim / 2))?)?;
        Ok(Self {
            cos: freqs.cos()?.contiguous()?,
            sin: freqs.sin()?.contiguous()?,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            tied_embeddings,
            rotations: Rotations::default(),
        })
    }
}

/// The shard index of a sharded Hugging Face directory.
pub(crate) const SHARD_INDEX: &str = "model.safetensors.index.json";

/// The shards `dir/model.safetensors.index.json` names, as (name in the
/// index, path), each inside `dir` ([`qforge_formats::files::inside`]): a weight map
/// naming `../other.safetensors` loaded weights from outside the model,
/// which the model's hash did not cover.
pub(crate) fn index_shards(dir: &Path) -> Result<Vec<(String, std::path::PathBuf)>> {
    let index = dir.join(SHARD_INDEX);
    let json: serde_json::Value = qforge_formats::files::read_json(&index)?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| Error::Format(format!("{}: no weight_map", index.display())))?;
    map.values()
        .filter_map(serde_json::Value::as_str)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|name| {
            Ok((
                name.to_owned(),
                qforge_formats::files::inside(dir, name, &index)?,
            ))
        })
        .collect()
}

/// The safetensors files of a Hugging Face directory, as (name, path).
fn safetensors_files(dir: &Path) -> Result<Vec<(String, std::path::PathBuf)>> {
    if dir.join(SHARD_INDEX).exists() {
        return index_shards(dir);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![("model.safetensors".to_owned(), single)]);
    }
    Err(Error::Format(format!(
        "{}: no model.safetensors or {SHARD_INDEX}",
        dir.display()
    )))
}
