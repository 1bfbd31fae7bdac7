//! Llama-family decoders (Llama 1–3, SmolLM2, Mistral, Qwen2): one forward for
//! every family, with observable linear inputs, padding masks and a KV cache.
//!
//! Weights load from GGUF (dequantized to f32) or from a Hugging Face directory.
//! Both end up in Hugging Face layout: GGUF files of the Llama and Mistral
//! families store q/k rows permuted for llama.cpp's interleaved rotary
//! embedding, and they are permuted back at load, so a single (half-split)
//! rotary embedding serves every source.

mod attention;
mod compressed;
mod config;
mod decode;
mod named;
mod rotation;

pub use config::{Family, LlamaConfig, RopeScaling};
pub use decode::Decoder;
pub use rotation::RotatedInput;
use rotation::Rotations;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor};
use qforge_kernels::exp::silu_product;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::linear::{Linear, MappedTensor, StoredWeight};
use crate::observe::Observer;

/// One decoder layer.
#[derive(Debug, Clone)]
struct Layer {
    input_norm: Tensor,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_norm: Tensor,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
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

/// Keys and values of one sequence's positions seen so far, per layer,
/// head-major (`[kv_heads, capacity, head_dim]`, the layout the INT8
/// [`Decoder`] keeps too): a decode step's attention reads each key/value
/// head's keys, then its values, as one contiguous run. A position's keys are
/// written in place: [`KvCache::reserve`] sizes the buffers once for a
/// sequence's whole reservation, so decoding a long sequence never copies
/// what is cached (without a reservation the capacity doubles as it runs
/// out, copying once per doubling).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<CachedLayer>,
    len: usize,
    /// Positions each head's run holds room for.
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// One layer's cached keys and values, `[kv_heads, capacity, head_dim]`
/// each; positions from the cache's `len` on hold nothing committed.
#[derive(Debug, Clone, Default)]
struct CachedLayer {
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl KvCache {
    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Makes room for `positions` positions in all (cached ones included),
    /// so that growing to them allocates nothing more.
    pub fn reserve(&mut self, positions: usize) {
        if positions > self.capacity {
            self.grow_to(positions);
        }
    }

    /// Positions the cache holds room for without reallocating.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Moves every layer into buffers of `capacity` positions per head,
    /// each head's run copied whole (a forward under way may have written
    /// past `len` in some layers).
    fn grow_to(&mut self, capacity: usize) {
        let (old, hd) = (self.capacity, self.head_dim);
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values] {
                let mut grown = vec![0f32; self.kv_heads * capacity * hd];
                if old > 0 {
                    for (from, to) in buffer
                        .chunks_exact(old * hd)
                        .zip(grown.chunks_exact_mut(capacity * hd))
                    {
                        to[..old * hd].copy_from_slice(from);
                    }
                }
                *buffer = grown;
            }
        }
        self.capacity = capacity;
    }

    /// Writes into layer `layer`, at the positions after the committed
    /// ones, the keys and values of sequence `sequence` of `k`, `v: [b,
    /// kv_heads, seq, head_dim]`: each head's `seq` rows are one run in both.
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor, sequence: usize) -> Result<()> {
        let (b, kv_heads, seq, hd) = k.dims4()?;
        if (kv_heads, hd) != (self.kv_heads, self.head_dim)
            || v.dims4()? != (b, kv_heads, seq, hd)
            || sequence >= b
        {
            return Err(Error::Shape(format!(
                "keys {:?} and values {:?} for a cache of {} kv heads of {} values",
                k.dims(),
                v.dims(),
                self.kv_heads,
                self.head_dim
            )));
        }
        let needed = self.len + seq;
        if needed > self.capacity {
            self.grow_to(needed.max(2 * self.capacity));
        }
        let (at, capacity) = (self.len * hd, self.capacity * hd);
        let cached = &mut self.layers[layer];
        for (tensor, target) in [(k, &mut cached.keys), (v, &mut cached.values)] {
            let tensor = tensor.contiguous()?;
            let (storage, layout) = tensor.storage_and_layout();
            let all = attention::values(&storage, layout, tensor.elem_count())?;
            let of_sequence = &all[sequence * kv_heads * seq * hd..][..kv_heads * seq * hd];
            for (head, rows) in of_sequence.chunks_exact(seq * hd).enumerate() {
                target[head * capacity + at..][..seq * hd].copy_from_slice(rows);
            }
        }
        Ok(())
    }

    /// The cached keys and values of `layer` as attention reads them, the
    /// queries from position `start`.
    fn view(&self, layer: usize, start: usize) -> attention::SequenceKv<'_> {
        let cached = &self.layers[layer];
        attention::SequenceKv {
            keys: &cached.keys,
            values: &cached.values,
            head_step: self.capacity * self.head_dim,
            stride: self.head_dim,
            start,
        }
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

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

/// Longest context qforge runs (its rotary tables are built for this many
/// positions at most): 64 Ki tokens, far beyond what a CPU calibration or
/// evaluation uses.
pub const MAX_POSITIONS: usize = 1 << 16;

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
        self.file
            .tensor_quantized(&gguf_name(name), order.as_deref())
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
        let json: serde_json::Value =
            serde_json::from_slice(&crate::files::read_config(&config_path)?)
                .map_err(|e| Error::Format(format!("{}: {e}", config_path.display())))?;
        let config = LlamaConfig::from_hf(&json).map_err(|e| e.in_file(&config_path))?;
        let scheme = compressed::Scheme::from_config(&json, &config_path)?;
        let files: Vec<_> = safetensors_files(dir)?
            .into_iter()
            .map(|(_, path)| path)
            .collect();
        // candle opens the shards itself: refuse a FIFO or device before it
        // blocks on one.
        for file in &files {
            crate::files::open_regular(file)?;
        }
        // SAFETY: read-only maps of model files that qforge does not modify.
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| Error::Format(format!("{}: {e}", dir.display())))?;
        let tensors = Arc::new(tensors);
        let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        let source = SafetensorsSource {
            tensors,
            names,
            scheme,
        };
        Self::load(config, &source).map_err(|e| e.in_file(dir))
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
                return Err(Error::Shape(format!(
                    "{name} is {:?}, expected [{len}]",
                    t.dims()
                )));
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
            return Err(Error::Shape(format!(
                "model.embed_tokens.weight is {:?}, expected [{}, {d}]",
                embed_tokens.dims(),
                c.vocab_size
            )));
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

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
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
            return Err(Error::Shape(format!(
                "{unknown} is not a linear layer of this model"
            )));
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
    pub fn smoothed(
        &self,
        factors: &std::collections::BTreeMap<String, Vec<f32>>,
    ) -> Result<Llama> {
        let smoothable = self.smoothable_points();
        if let Some(point) = factors.keys().find(|p| !smoothable.contains(p)) {
            return Err(Error::Unsupported(format!(
                "smoothing {point}: its scale does not fold into a preceding norm or layer"
            )));
        }
        let mut model = self.clone();
        let divide = |t: &Tensor, s: &[f32]| -> Result<Tensor> {
            let s = Tensor::from_slice(s, s.len(), &Device::Cpu)?;
            if t.dims() != s.dims() {
                return Err(Error::Shape(format!(
                    "{} smoothing factors for a norm of {:?}",
                    s.elem_count(),
                    t.dims()
                )));
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

    /// Bytes one position of one sequence takes in a [`KvCache`]: an f32
    /// key and value per layer and key/value head.
    pub fn kv_bytes_per_position(&self) -> usize {
        let c = &self.config;
        2 * self.layers.len() * c.num_kv_heads * c.head_dim * std::mem::size_of::<f32>()
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![CachedLayer::default(); self.layers.len()],
            len: 0,
            capacity: 0,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Runs the decoder over a batch of token sequences.
    ///
    /// Sequences of different lengths are right-padded; padded positions are
    /// masked out of attention and never observed. With a `cache`, the batch is
    /// one sequence whose positions continue after the cached ones (a failed
    /// forward leaves the cache as it was). Every distinct linear input is
    /// handed to `observer`.
    pub fn forward(
        &self,
        batch: &[Vec<u32>],
        cache: Option<&mut KvCache>,
        observer: Option<&mut dyn Observer>,
        logits: Logits,
    ) -> Result<Tensor> {
        let start = cache.as_ref().map_or(0, |k| k.len);
        if let Some(kv) = cache.as_ref() {
            self.check_cache(kv)?;
            if batch.len() != 1 {
                return Err(Error::Shape(format!(
                    "a KV cache holds one sequence: a batch of {} with a cache",
                    batch.len()
                )));
            }
        }
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, start)?;
        let seq = x.dim(1)?;
        let mut cache = cache;
        let kv_heads = self.config.num_kv_heads;
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            observer,
            Span::default(),
            |i, q, k, v| match cache.as_deref_mut() {
                Some(kv) => {
                    kv.append(i, k, v, 0)?;
                    attention::causal(q, &[kv.view(i, start)], kv_heads, &lengths)
                }
                None => attention::causal_over_tensors(q, k, v, &lengths),
            },
        );
        // A failed forward's keys lie past `len`, where nothing reads them.
        if let (Some(kv), Ok(_)) = (cache, &x) {
            kv.len += seq;
        }
        self.logits_of(x?, &lengths, logits)
    }

    /// The logits `logits` asks for from the decoder stack's output `x`.
    fn logits_of(&self, x: Tensor, lengths: &[usize], logits: Logits) -> Result<Tensor> {
        let x = match logits {
            Logits::All => x,
            Logits::Last => {
                let rows: Vec<Tensor> = lengths
                    .iter()
                    .enumerate()
                    .map(|(s, &len)| x.get(s)?.get(len - 1))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::stack(&rows, 0)?
            }
        };
        self.lm_head.forward(&x)
    }

    /// [`Llama::forward`] without a cache or observer, also giving the
    /// hidden states entering every decoder layer and the one after the last
    /// (entering the final norm): a model that differs from this one only
    /// from some layer on can then start there ([`Llama::forward_resuming`]).
    pub fn forward_keeping(
        &self,
        batch: &[Vec<u32>],
        logits: Logits,
    ) -> Result<(Tensor, Vec<HiddenState>)> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let mut kept = Vec::with_capacity(self.layers.len() + 1);
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            None,
            Span {
                kept: Some(&mut kept),
                keep_every: true,
                ..Span::default()
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        Ok((self.logits_of(x, &lengths, logits)?, kept))
    }

    /// [`Llama::forward`] without a cache or observer, starting from
    /// `resume` (a hidden state that [`Llama::forward_keeping`] of this
    /// model, or of one with the same layers before `resume.layer`, kept
    /// for `batch`) instead of the embedding. The layers run compute exactly
    /// what they compute from the embedding (the same operations on the
    /// same values).
    pub fn forward_resuming(
        &self,
        batch: &[Vec<u32>],
        resume: &HiddenState,
        logits: Logits,
    ) -> Result<Tensor> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let x = self.decoder_stack(
            self.resumed(&x, resume)?,
            (&cos, &sin),
            &lengths,
            None,
            Span {
                first: resume.layer,
                ..Span::default()
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        self.logits_of(x, &lengths, logits)
    }

    /// `resume`'s state, checked to fit the batch whose embedding is
    /// `embedded` and this model's layers.
    fn resumed(&self, embedded: &Tensor, resume: &HiddenState) -> Result<Tensor> {
        if resume.x.dims() != embedded.dims() || resume.layer > self.layers.len() {
            return Err(Error::Shape(format!(
                "a hidden state {:?} entering layer {} for a batch of {:?} in a model of {} layers",
                resume.x.dims(),
                resume.layer,
                embedded.dims(),
                self.layers.len()
            )));
        }
        Ok(resume.x.clone())
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

    /// Runs the decoder over `batch` only to hand every distinct linear input
    /// to `observer`, as [`Llama::forward`] does, without logits. It stops
    /// once the observer is [finished](Observer::finished): at once inside
    /// a layer, or at the end of the layer when the last input it wanted was
    /// `down_proj`'s. A pass that wants the inputs of the first layers only
    /// does not pay for the rest, nor a pass that wants a layer's q/k/v
    /// input for that layer's attention and MLP.
    pub fn observe(&self, batch: &[Vec<u32>], observer: &mut dyn Observer) -> Result<()> {
        self.observe_resuming(batch, observer, None, false)
            .map(drop)
    }

    /// [`Llama::observe`], starting from `resume` (a hidden state an earlier
    /// observing pass of this model over this batch kept) instead of the
    /// embedding, so the layers before it are not run again: a pass that
    /// observes layers 20–23 after one that observed 16–19 runs only those.
    /// The layers run compute exactly what they compute from the embedding
    /// (the same operations on the same values). Returns the hidden states
    /// entering the last two layers it started (the layer after the last
    /// one counts when it stopped at that layer's end, and the final norm
    /// when it ran to the end), for the next pass to resume from.
    ///
    /// `rounds_observed`: the caller rounds the layers this pass observes
    /// before a later pass runs past them (GPTQ propagating its rounding).
    /// A state past them would then be stale, so a pass whose last input is
    /// `down_proj`'s stops there as at any other input, and `down_proj`
    /// does not run.
    pub fn observe_resuming(
        &self,
        batch: &[Vec<u32>],
        observer: &mut dyn Observer,
        resume: Option<&HiddenState>,
        rounds_observed: bool,
    ) -> Result<Vec<HiddenState>> {
        let Embedded {
            x,
            cos,
            sin,
            lengths,
        } = self.embedded(batch, 0)?;
        let (x, first) = match resume {
            Some(state) => (self.resumed(&x, state)?, state.layer),
            None => (x, 0),
        };
        let mut kept = Vec::new();
        self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            Some(observer),
            Span {
                first,
                stop_when_finished: true,
                rounds_observed,
                kept: Some(&mut kept),
                keep_every: false,
            },
            |_, q, k, v| attention::causal_over_tensors(q, k, v, &lengths),
        )?;
        Ok(kept)
    }

    /// The embedded, right-padded batch at positions from `start`, with its
    /// attention mask and rotary tables.
    fn embedded(&self, batch: &[Vec<u32>], start: usize) -> Result<Embedded> {
        let lengths: Vec<usize> = batch.iter().map(Vec::len).collect();
        let seq = lengths.iter().copied().max().unwrap_or(0);
        if batch.is_empty() || lengths.contains(&0) {
            return Err(Error::Shape(
                "forward needs at least one token per sequence".into(),
            ));
        }
        self.check_positions(start + seq)?;
        self.check_vocabulary(batch.iter().flatten())?;
        let b = batch.len();
        let padded: Vec<u32> = batch
            .iter()
            .flat_map(|s| {
                s.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, seq - s.len()))
            })
            .collect();
        let ids = Tensor::from_vec(padded, (b, seq), &Device::Cpu)?;
        let x = self
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .to_dtype(DType::F32)?
            .reshape((b, seq, self.config.hidden_size))?;
        Ok(Embedded {
            x,
            cos: self.cos.narrow(0, start, seq)?,
            sin: self.sin.narrow(0, start, seq)?,
            lengths,
        })
    }

    /// One decoding step for several independent sequences: `tokens[i]`
    /// continues the sequence cached in `caches[i]`, each at its own
    /// position. The linear layers run once over all `n` rows (what
    /// continuous batching buys: one weight read serves every sequence);
    /// attention runs per sequence over its own cache. Returns logits
    /// `[n, vocab]`; every linear input is handed to `observer`.
    pub fn step(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        observer: Option<&mut dyn Observer>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || caches.len() != n {
            return Err(Error::Shape(format!(
                "a step needs one token per sequence: {n} tokens for {} caches",
                caches.len()
            )));
        }
        self.check_vocabulary(tokens)?;
        if let Some(longest) = caches.iter().map(|k| k.len + 1).max() {
            self.check_positions(longest)?;
        }
        for cache in caches.iter() {
            self.check_cache(cache)?;
        }
        let ids = Tensor::from_vec(tokens.to_vec(), n, &Device::Cpu)?;
        let x = self
            .embed_tokens
            .index_select(&ids, 0)?
            .to_dtype(DType::F32)?
            .reshape((n, 1, c.hidden_size))?;
        let positions: Vec<u32> = caches.iter().map(|k| k.len as u32).collect();
        let positions = Tensor::from_vec(positions, n, &Device::Cpu)?;
        let half = c.head_dim / 2;
        let cos = self
            .cos
            .index_select(&positions, 0)?
            .reshape((n, 1, half))?;
        let sin = self
            .sin
            .index_select(&positions, 0)?
            .reshape((n, 1, half))?;
        let lengths = vec![1; n];
        let kv_heads = c.num_kv_heads;
        let x = self.decoder_stack(
            x,
            (&cos, &sin),
            &lengths,
            observer,
            Span::default(),
            |i, q, k, v| {
                for (s, cache) in caches.iter_mut().enumerate() {
                    cache.append(i, k, v, s)?;
                }
                // One query per sequence at its newest position, every sequence
                // in one call.
                let views: Vec<_> = caches
                    .iter()
                    .map(|cache| cache.view(i, cache.len))
                    .collect();
                attention::causal(q, &views, kv_heads, &lengths)
            },
        );
        // A failed step's keys lie past `len`, where nothing reads them.
        let x = x?;
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        self.lm_head.forward(&x.reshape((n, c.hidden_size))?)
    }

    /// Refuses a KV cache made for another model.
    fn check_cache(&self, cache: &KvCache) -> Result<()> {
        let c = &self.config;
        if cache.layers.len() != self.layers.len()
            || (cache.kv_heads, cache.head_dim) != (c.num_kv_heads, c.head_dim)
        {
            return Err(Error::Shape(format!(
                "a KV cache of {} layers of {} kv heads of {} values for a model of {} layers of {} of {}",
                cache.layers.len(),
                cache.kv_heads,
                cache.head_dim,
                self.layers.len(),
                c.num_kv_heads,
                c.head_dim
            )));
        }
        Ok(())
    }

    /// Refuses a token id outside the vocabulary.
    pub(crate) fn check_vocabulary<'t>(
        &self,
        tokens: impl IntoIterator<Item = &'t u32>,
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.into_iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(Error::Shape(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }

    /// Refuses a sequence of `positions` beyond the context.
    fn check_positions(&self, positions: usize) -> Result<()> {
        let context = self.config.max_position_embeddings.min(MAX_POSITIONS);
        if positions > context {
            return Err(Error::Shape(format!(
                "{positions} positions exceed the context of {context} (the model's, capped at {MAX_POSITIONS})"
            )));
        }
        Ok(())
    }

    /// The decoder layers and the final norm over embeddings `x: [b, seq,
    /// hidden]` at the positions `cos`/`sin` give; `attend(layer, q, k, v)`
    /// (heads-major, RoPE applied) returns `[b, seq, heads·head_dim]` and owns
    /// the KV cache. Every distinct linear input, the final norm's output
    /// included (`lm_head`'s), is handed to `observer`.
    fn decoder_stack(
        &self,
        mut x: Tensor,
        (cos, sin): (&Tensor, &Tensor),
        lengths: &[usize],
        mut observer: Option<&mut dyn Observer>,
        mut span: Span<'_>,
        mut attend: impl FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps as f32;
        for (i, layer) in self.layers.iter().enumerate().skip(span.first) {
            span.keep(i, &x);
            let h = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let h = self.rotate_input(RotatedInput::Attention, h)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.self_attn.q_proj"),
                &h,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            let q = self.heads(&layer.q_proj.forward(&h)?, c.num_heads)?;
            let k = self.heads(&layer.k_proj.forward(&h)?, c.num_kv_heads)?;
            let v = self.heads(&layer.v_proj.forward(&h)?, c.num_kv_heads)?;
            let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
            let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
            let attended =
                self.rotate_input(RotatedInput::AttentionOutput, attend(i, &q, &k, &v)?)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.self_attn.o_proj"),
                &attended,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            x = (x + layer.o_proj.forward(&attended)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.post_attention_norm, eps)?;
            let h = self.rotate_input(RotatedInput::Mlp, h)?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.mlp.gate_proj"),
                &h,
                lengths,
            )?;
            if span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            let gated = self.rotate_input(
                RotatedInput::MlpProduct,
                swiglu(&layer.gate_proj.forward(&h)?, &layer.up_proj.forward(&h)?)?,
            )?;
            observe(
                &mut observer,
                &format!("model.layers.{i}.mlp.down_proj"),
                &gated,
                lengths,
            )?;
            if span.rounds_observed && span.stops_inside_layer(&observer) {
                return Ok(x);
            }
            x = (x + layer.down_proj.forward(&gated)?)?;
            if span.stop_when_finished && finished(&observer) {
                span.keep(i + 1, &x);
                // What follows is never observed: the hidden state is all an
                // observing pass gets.
                return Ok(x);
            }
        }
        if span.keep_every {
            span.keep(self.layers.len(), &x);
        }
        let x = self.rotate_input(
            RotatedInput::Head,
            candle_nn::ops::rms_norm(&x, &self.norm, eps)?,
        )?;
        // lm_head's input is observed at every real position, whichever
        // logits are asked for.
        observe(&mut observer, "lm_head", &x, lengths)?;
        Ok(x)
    }

    /// `[b, seq, heads·head_dim]` → `[b, heads, seq, head_dim]`.
    fn heads(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        Ok(x.reshape((b, seq, heads, self.config.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }
}

/// Which decoder layers [`Llama::decoder_stack`] runs, and what it keeps.
#[derive(Default)]
struct Span<'a> {
    /// The first layer run (the stack's input enters it).
    first: usize,
    /// Stop as soon as the observer is finished: at once when it finishes
    /// at an input before `down_proj`'s, whose layer need not run further;
    /// after the layer when it finishes at `down_proj`'s input, so that the
    /// state entering the next layer is kept for the pass that observes it
    /// (unless [`Span::rounds_observed`]).
    stop_when_finished: bool,
    /// The layers observed are rounded before any pass runs past them (GPTQ
    /// propagating its rounding), so the state entering the next layer
    /// would be stale: finishing at `down_proj`'s input stops there too.
    rounds_observed: bool,
    /// Receives the hidden states entering the last two layers run (or, when
    /// it stops after a whole layer, entering that layer and the one after
    /// it).
    kept: Option<&'a mut Vec<HiddenState>>,
    /// Keep the states entering every layer run and the one after the
    /// last, not only the last two.
    keep_every: bool,
}

/// Whether `observer` (if any) has seen all it wants.
fn finished(observer: &Option<&mut dyn Observer>) -> bool {
    observer.as_ref().is_some_and(|o| o.finished())
}

impl Span<'_> {
    /// Whether the stack stops inside a layer, now that `observer` saw the
    /// layer's inputs up to the current one: what follows in that layer is
    /// observed by no one, and a state past it is kept only at the layer's
    /// end (see [`Span::stop_when_finished`]).
    fn stops_inside_layer(&self, observer: &Option<&mut dyn Observer>) -> bool {
        self.stop_when_finished && finished(observer)
    }

    /// Keeps `x`, entering layer `layer` (as one of the last two, unless
    /// every state is kept).
    fn keep(&mut self, layer: usize, x: &Tensor) {
        if let Some(kept) = self.kept.as_deref_mut() {
            kept.push(HiddenState {
                layer,
                x: x.clone(),
            });
            if kept.len() > 2 && !self.keep_every {
                kept.remove(0);
            }
        }
    }
}

/// A batch's hidden state entering decoder layer `layer` (`[batch, seq,
/// hidden]`, padding included), from which an observing pass of the same
/// model over the same batch resumes ([`Llama::observe_resuming`]).
#[derive(Debug, Clone)]
pub struct HiddenState {
    /// The layer it enters.
    pub layer: usize,
    x: Tensor,
}

impl HiddenState {
    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.x.elem_count() * self.x.dtype().size_in_bytes()
    }
}

/// A batch ready for the decoder stack ([`Llama::embedded`]).
struct Embedded {
    /// `[b, seq, hidden]`.
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// Each sequence's length before padding.
    lengths: Vec<usize>,
}

/// Hands the real (non-padding) rows of `x: [batch, seq, width]` to the observer.
fn observe(
    observer: &mut Option<&mut dyn Observer>,
    point: &str,
    x: &Tensor,
    lengths: &[usize],
) -> Result<()> {
    let Some(observer) = observer.as_deref_mut() else {
        return Ok(());
    };
    let (_, seq, width) = x.dims3()?;
    let values = x.flatten_all()?.to_vec1::<f32>()?;
    if lengths.iter().all(|&l| l == seq) {
        return observer.observe(point, &values, width);
    }
    for (s, &len) in lengths.iter().enumerate() {
        let start = s * seq * width;
        observer.observe(point, &values[start..start + len * width], width)?;
    }
    Ok(())
}

/// The shard index of a sharded Hugging Face directory.
pub(crate) const SHARD_INDEX: &str = "model.safetensors.index.json";

/// The shards `dir/model.safetensors.index.json` names, as (name in the
/// index, path), each inside `dir` ([`crate::files::inside`]): a weight map
/// naming `../other.safetensors` loaded weights from outside the model,
/// which the model's hash did not cover.
pub(crate) fn index_shards(dir: &Path) -> Result<Vec<(String, std::path::PathBuf)>> {
    let index = dir.join(SHARD_INDEX);
    let json: serde_json::Value = serde_json::from_slice(&crate::files::read_config(&index)?)
        .map_err(|e| Error::Format(format!("{}: {e}", index.display())))?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| Error::Format(format!("{}: no weight_map", index.display())))?;
    map.values()
        .filter_map(serde_json::Value::as_str)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|name| Ok((name.to_owned(), crate::files::inside(dir, name, &index)?)))
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

/// Log-softmax over the last dimension, in f32.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(logits, D::Minus1)?)
}

/// `silu(gate) · up` with the decoder's arithmetic ([`silu_product`]), so
/// that the tensor forward and the decoder give the same bits.
fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let mut product = gate.flatten_all()?.to_vec1::<f32>()?;
    silu_product(&mut product, &up.flatten_all()?.to_vec1::<f32>()?)?;
    Ok(Tensor::from_vec(product, gate.shape(), gate.device())?)
}
