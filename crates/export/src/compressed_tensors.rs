//! compressed-tensors W8A8: the Hugging Face directory vLLM loads for INT8.
//!
//! `config.json` gains a `quantization_config` with `quant_method:
//! "compressed-tensors"`, `format: "int-quantized"`, `quantization_status:
//! "compressed"`, one config group for the layers with static per-tensor
//! input scales and one for those with dynamic per-token activations
//! (weights int8, symmetric, per output channel, static, in both), and an
//! `ignore` list: `lm_head` (vLLM keeps it unquantized) and every layer the
//! guard left in full precision — whole fused groups, since the native
//! artifact decides per layer input. Tensors: `NAME.weight` int8 `[out,
//! in]`, `NAME.weight_scale` f32 `[out, 1]`, `NAME.input_scale` f32 `[1]`
//! for static inputs, no zero points; everything else f32. Smoothing factors
//! are already folded into the norms and weights of the artifact.
//!
//! `lm_head`: dropped when the source tied it to the embedding (vLLM ties it
//! again); otherwise written in f32 — dequantized from int8 when the
//! artifact quantized it, since the artifact keeps no other copy (the
//! export's manifest says so).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use qforge_model::artifact::{LayerPrecision, ModelKind, WEIGHTS_FILE, read_config};
use qforge_model::{Llama, LlamaConfig};
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// What an export did.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressedTensors {
    /// Linear layers written as int8.
    pub quantized_layers: usize,
    /// Layers in `ignore` (FP), `lm_head` included.
    pub ignored: Vec<String>,
    /// How `lm_head` was written: `tied`, `f32`, or `dequantized from int8`.
    pub lm_head: &'static str,
}

/// A tensor to write: dtype, shape, little-endian bytes (borrowed from the
/// artifact where copied as is).
type TensorOut<'a> = (Dtype, Vec<usize>, Cow<'a, [u8]>);

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| qforge_model::Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Inconsistent(format!("{}: {e}", path.display())))
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// Writes the compressed-tensors form of the native artifact `artifact`
/// (a language model) into the empty directory `dest`.
pub fn export_compressed_tensors(artifact: &Path, dest: &Path) -> Result<CompressedTensors> {
    let config = read_config(artifact)?;
    if config.kind != ModelKind::LanguageModel {
        return Err(Error::Unsupported(
            "compressed-tensors is vLLM's format for language models; export a policy with --format onnx"
                .into(),
        ));
    }
    let mut hf = read_json(&artifact.join("config.json"))?;
    let llama = LlamaConfig::from_hf(&hf)?;
    let tied = hf["tie_word_embeddings"].as_bool().unwrap_or(false);

    let weights_path = artifact.join(WEIGHTS_FILE);
    let file = std::fs::File::open(&weights_path)
        .map_err(|e| qforge_model::Error::io(&weights_path, e))?;
    // SAFETY: a read-only map of an artifact file, which qforge writes once
    // and never modifies.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| qforge_model::Error::io(&weights_path, e))?;
    let source = SafeTensors::deserialize(&map)
        .map_err(|e| Error::Inconsistent(format!("{}: {e}", weights_path.display())))?;

    // Everything but lm_head is copied as stored (the int8 layout is
    // already compressed-tensors').
    let mut out: BTreeMap<String, TensorOut<'_>> = BTreeMap::new();
    for (name, view) in source.tensors() {
        if !name.starts_with("lm_head.") {
            out.insert(
                name,
                (
                    view.dtype(),
                    view.shape().to_vec(),
                    Cow::Borrowed(view.data()),
                ),
            );
        }
    }

    let (mut static_targets, mut dynamic_targets, mut ignored) =
        (Vec::new(), Vec::new(), Vec::new());
    for (layer, point) in Llama::linear_points(&llama) {
        let precision = config.points.get(&point).copied().ok_or_else(|| {
            Error::Inconsistent(format!("qforge.json gives no precision for {point}"))
        })?;
        if layer == "lm_head" {
            continue;
        }
        match precision {
            LayerPrecision::Fp => ignored.push(layer),
            LayerPrecision::Int8Dynamic => dynamic_targets.push(layer),
            LayerPrecision::Int8Static { input_scale } => {
                out.insert(
                    format!("{layer}.input_scale"),
                    (Dtype::F32, vec![1], Cow::Owned(f32_bytes([input_scale]))),
                );
                static_targets.push(layer);
            }
        }
    }

    ignored.push("lm_head".to_owned());
    let lm_head = if tied {
        "tied"
    } else {
        let weight = source.tensor("lm_head.weight").map_err(|e| {
            Error::Inconsistent(format!("{}: lm_head.weight: {e}", weights_path.display()))
        })?;
        match weight.dtype() {
            Dtype::F32 => {
                out.insert(
                    "lm_head.weight".into(),
                    (
                        Dtype::F32,
                        weight.shape().to_vec(),
                        Cow::Borrowed(weight.data()),
                    ),
                );
                "f32"
            }
            Dtype::I8 => {
                let scales = source.tensor("lm_head.weight_scale").map_err(|e| {
                    Error::Inconsistent(format!(
                        "{}: lm_head.weight_scale: {e}",
                        weights_path.display()
                    ))
                })?;
                let cols = weight.shape()[1];
                let scales: Vec<f32> = scales
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let values = weight
                    .data()
                    .chunks_exact(cols)
                    .zip(&scales)
                    .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v as i8) * s));
                out.insert(
                    "lm_head.weight".into(),
                    (
                        Dtype::F32,
                        weight.shape().to_vec(),
                        Cow::Owned(f32_bytes(values)),
                    ),
                );
                "dequantized from int8"
            }
            other => {
                return Err(Error::Inconsistent(format!(
                    "{}: lm_head.weight is {other:?}",
                    weights_path.display()
                )));
            }
        }
    };

    let weights = json!({
        "num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
        "dynamic": false, "group_size": null, "observer": "minmax",
    });
    let mut groups = serde_json::Map::new();
    for (targets, activations) in [
        (
            &static_targets,
            json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "tensor", "dynamic": false}),
        ),
        (
            &dynamic_targets,
            json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}),
        ),
    ] {
        if !targets.is_empty() {
            groups.insert(
                format!("group_{}", groups.len()),
                json!({
                    "targets": targets,
                    "weights": weights,
                    "input_activations": activations,
                    "output_activations": null,
                }),
            );
        }
    }
    hf["quantization_config"] = json!({
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignored,
        "kv_cache_scheme": null,
    });
    hf["torch_dtype"] = "float32".into();

    let views = out
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Inconsistent(e.to_string()))?;
    let target = dest.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &target).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(io) => {
            Error::Model(qforge_model::Error::io(&target, io))
        }
        other => Error::Inconsistent(format!("{}: {other}", target.display())),
    })?;
    let config_path = dest.join("config.json");
    let text = serde_json::to_string_pretty(&hf).expect("JSON serializes") + "\n";
    std::fs::write(&config_path, text).map_err(|e| qforge_model::Error::io(&config_path, e))?;
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let from = artifact.join(name);
        std::fs::copy(&from, dest.join(name)).map_err(|e| qforge_model::Error::io(&from, e))?;
    }
    Ok(CompressedTensors {
        quantized_layers: static_targets.len() + dynamic_targets.len(),
        ignored,
        lm_head,
    })
}
