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
    let bytes = qforge_model::files::read_config(path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Inconsistent(format!("{}: {e}", path.display())))
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// The artifact's `model.safetensors`, memory-mapped: a language model's
/// tensors are copied into the export as they are, so they need not be read
/// into memory first.
fn map_weights(weights_path: &Path) -> Result<memmap2::Mmap> {
    let file = qforge_model::files::open_regular(weights_path)?;
    // SAFETY: a read-only map of an artifact file, which qforge writes once
    // and never modifies.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| qforge_model::Error::io(weights_path, e))?;
    Ok(map)
}

/// Everything but lm_head, copied as stored (the int8 layout is already
/// compressed-tensors'); lm_head depends on tying, see [`lm_head`].
fn copied_tensors<'a>(source: &SafeTensors<'a>) -> BTreeMap<String, TensorOut<'a>> {
    let mut out = BTreeMap::new();
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
    out
}

/// The linear layers by what `quantization_config` says of them, in the
/// model's layer order.
#[derive(Default)]
struct Targets {
    /// INT8 with one calibrated input scale.
    static_inputs: Vec<String>,
    /// INT8 with per-token input scales.
    dynamic_inputs: Vec<String>,
    /// Left in full precision (and, once [`lm_head`] ran, lm_head).
    ignored: Vec<String>,
}

impl Targets {
    /// Sorts every linear layer but lm_head by the precision of its
    /// observation point, adding `NAME.input_scale` to `out` for static
    /// inputs. A point `qforge.json` omits is an error even for lm_head:
    /// the artifact would be incomplete.
    fn sort(
        llama: &LlamaConfig,
        points: &BTreeMap<String, LayerPrecision>,
        out: &mut BTreeMap<String, TensorOut<'_>>,
    ) -> Result<Self> {
        let mut targets = Self::default();
        for (layer, point) in Llama::linear_points(llama) {
            let precision = points.get(&point).copied().ok_or_else(|| {
                Error::Inconsistent(format!("qforge.json gives no precision for {point}"))
            })?;
            if layer == "lm_head" {
                continue;
            }
            match precision {
                LayerPrecision::Fp => targets.ignored.push(layer),
                LayerPrecision::Int8Dynamic => targets.dynamic_inputs.push(layer),
                LayerPrecision::Int8Static { input_scale } => {
                    out.insert(
                        format!("{layer}.input_scale"),
                        (Dtype::F32, vec![1], Cow::Owned(f32_bytes([input_scale]))),
                    );
                    targets.static_inputs.push(layer);
                }
            }
        }
        Ok(targets)
    }

    /// `quantization_config` of `config.json`: one config group per kind of
    /// input (static per-tensor, dynamic per-token), none when empty, and
    /// the `ignore` list.
    fn quantization_config(&self) -> Value {
        let weights = json!({
            "num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
            "dynamic": false, "group_size": null, "observer": "minmax",
        });
        let mut groups = serde_json::Map::new();
        for (targets, activations) in [
            (
                &self.static_inputs,
                json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "tensor", "dynamic": false}),
            ),
            (
                &self.dynamic_inputs,
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
        json!({
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": self.ignored,
            "kv_cache_scheme": null,
        })
    }
}

/// `lm_head.weight`, always in `ignore` (vLLM keeps it unquantized): left
/// out when the source tied it (vLLM ties it again), else added to `out` in
/// f32, dequantized when the artifact stores it as int8 (it keeps no other
/// copy). Returns how it was written, for the manifest.
fn lm_head<'a>(
    tied: bool,
    source: &SafeTensors<'a>,
    weights_path: &Path,
    out: &mut BTreeMap<String, TensorOut<'a>>,
) -> Result<&'static str> {
    if tied {
        return Ok("tied");
    }
    let tensor = |name: &str| {
        source
            .tensor(name)
            .map_err(|e| Error::Inconsistent(format!("{}: {name}: {e}", weights_path.display())))
    };
    let weight = tensor("lm_head.weight")?;
    let (bytes, how) = match weight.dtype() {
        Dtype::F32 => (Cow::Borrowed(weight.data()), "f32"),
        Dtype::I8 => {
            let scales = tensor("lm_head.weight_scale")?;
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
            (Cow::Owned(f32_bytes(values)), "dequantized from int8")
        }
        other => {
            return Err(Error::Inconsistent(format!(
                "{}: lm_head.weight is {other:?}",
                weights_path.display()
            )));
        }
    };
    out.insert(
        "lm_head.weight".into(),
        (Dtype::F32, weight.shape().to_vec(), bytes),
    );
    Ok(how)
}

/// Writes the export's tensors as `dest/model.safetensors`.
fn write_tensors(out: &BTreeMap<String, TensorOut<'_>>, dest: &Path) -> Result<()> {
    let views = out
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Inconsistent(e.to_string()))?;
    Ok(qforge_model::artifact::write_safetensors(
        &dest.join("model.safetensors"),
        views,
    )?)
}

/// Writes `dest/config.json` (the artifact's, with `quantization_config`)
/// and copies the tokenizer files, which the export does not change (an
/// artifact of a model that shipped no `tokenizer.json` has none to copy:
/// the export takes token ids as the model did).
fn write_config_and_tokenizer(hf: &Value, artifact: &Path, dest: &Path) -> Result<()> {
    let config_path = dest.join("config.json");
    let text = serde_json::to_string_pretty(hf).expect("JSON serializes") + "\n";
    std::fs::write(&config_path, text).map_err(|e| qforge_model::Error::io(&config_path, e))?;
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let from = artifact.join(name);
        if name == "tokenizer.json" && from.symlink_metadata().is_err() {
            continue;
        }
        std::fs::copy(&from, dest.join(name)).map_err(|e| qforge_model::Error::io(&from, e))?;
    }
    Ok(())
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
    if !config.online_rotations.is_empty() {
        // vLLM would load the rotated weights and feed them unrotated inputs:
        // a model that loads and answers garbage. qforge does not write
        // compressed-tensors' transform configuration, so it refuses.
        return Err(Error::Unsupported(format!(
            "{} rotates the inputs of {} online (a Hadamard rotation qforge's engine applies), which a compressed-tensors checkpoint cannot carry here; to export to vLLM, quantize again with `--hadamard residual` (the residual stream rotated offline, nothing online) or without --hadamard",
            artifact.display(),
            config
                .online_rotations
                .iter()
                .map(|r| r.name())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut hf = read_json(&artifact.join("config.json"))?;
    let llama = LlamaConfig::from_hf(&hf)?;
    let tied = hf["tie_word_embeddings"].as_bool().unwrap_or(false);

    let weights_path = artifact.join(WEIGHTS_FILE);
    let map = map_weights(&weights_path)?;
    let source = SafeTensors::deserialize(&map)
        .map_err(|e| Error::Inconsistent(format!("{}: {e}", weights_path.display())))?;
    let mut out = copied_tensors(&source);
    let mut targets = Targets::sort(&llama, &config.points, &mut out)?;
    targets.ignored.push("lm_head".to_owned());
    let lm_head = lm_head(tied, &source, &weights_path, &mut out)?;

    hf["quantization_config"] = targets.quantization_config();
    hf["torch_dtype"] = "float32".into();
    write_tensors(&out, dest)?;
    write_config_and_tokenizer(&hf, artifact, dest)?;
    Ok(CompressedTensors {
        quantized_layers: targets.static_inputs.len() + targets.dynamic_inputs.len(),
        ignored: targets.ignored,
        lm_head,
    })
}
