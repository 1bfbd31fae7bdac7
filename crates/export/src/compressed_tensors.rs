//! compressed-tensors W8A8: the Hugging Face directory vLLM loads for INT8.
//!
//! `config.json` gains a `quantization_config` with `quant_method:
//! "compressed-tensors"`, `format: "int-quantized"`, `quantization_status:
//! "compressed"`, one config group for the layers with static per-tensor
//! input scales and one for those with dynamic per-token activations
//! (weights int8, symmetric, per output channel, static, in both), and an
//! `ignore` list: every layer the guard left in full precision — whole fused groups, since the native
//! artifact decides per layer input. Tensors: `NAME.weight` int8 `[out,
//! in]`, `NAME.weight_scale` f32 `[out, 1]`, `NAME.input_scale` f32 `[1]`
//! for static inputs, no zero points. Smoothing factors are already folded
//! into the norms and weights of the artifact.
//!
//! Everything else (embedding, norms, the layers left in full precision) is
//! written in the checkpoint's dtype, its `torch_dtype`: bf16 when every one
//! of those tensors holds bf16 values exactly (a bf16 source nothing
//! rescaled: a Llama-3-8B checkpoint is then 9.1 GB, not 11.2 GB in f32),
//! else f32. vLLM runs a model in 16 bits either way, so bf16 loses nothing
//! there.
//!
//! `lm_head`: an int8 head is written like every int8 layer, its config
//! group's target, and `tie_word_embeddings` turned off: vLLM then runs the
//! head the guard measured (a W8A8 `ParallelLMHead`), not the tied
//! full-precision embedding, which on SmolLM2 is 1.7 % of perplexity apart.
//! A full-precision head is in `ignore`: dropped when the source tied it to
//! the embedding (vLLM ties it again), else written in the checkpoint's
//! dtype.
//!
//! Online rotations (QuaRot's Hadamard before `down_proj`, or any input
//! `--hadamard` rotates online) become compressed-tensors transforms: one
//! `transform_config` scheme per rotated input, of type `random-hadamard`,
//! applied at the `input` of every layer that reads it, and the ±1 matrix
//! `H` (qforge's Hadamard construction, [`input_transform_matrix`]) stored for each such
//! layer as `NAME.SCHEME_input.weight` in bf16 (exact): vLLM multiplies the
//! input by `H / √n` before the layer, as qforge's engine does. The type is
//! `random-hadamard`, not `hadamard`, because vLLM computes a `hadamard`
//! transform with its own Sylvester kernel instead of reading the matrix;
//! only the stored matrix is qforge's (`H_m ⊗ H_2^k`, e.g. 1 536 = 12 · 128
//! for SmolLM2's down_proj). A rotation of lm_head's input is refused: vLLM
//! applies online transforms to linear layers only, not to its LM head.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use qforge_formats::llama_config::LlamaConfig;
use qforge_model::artifact::{LayerPrecision, ModelKind, WEIGHTS_FILE, read_config};
use qforge_model::llama::compressed::{input_transform_key, input_transform_matrix};
use qforge_model::{Llama, RotatedInput};
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
    /// How `lm_head` was written: `int8` (quantized as the artifact holds
    /// it, untied), or, for a full-precision head, `tied` or `copied`.
    pub lm_head: &'static str,
    /// The checkpoint's `torch_dtype`: `bfloat16` or `float32`.
    pub dtype: &'static str,
    /// The inputs rotated online, written as transforms (their
    /// observation-point suffixes, e.g. `mlp.down_proj`).
    pub online_rotations: Vec<&'static str>,
}

/// A tensor to write: dtype, shape, little-endian bytes (borrowed from the
/// artifact where copied as is).
type TensorOut<'a> = (Dtype, Vec<usize>, Cow<'a, [u8]>);

fn read_json(path: &Path) -> Result<Value> {
    let bytes = qforge_formats::files::read_config(path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Inconsistent(format!("{}: {e}", path.display())))
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// Whether every little-endian f32 of `bytes` is a bf16 exactly: its low 16
/// bits are zero.
fn holds_bf16(bytes: &[u8]) -> bool {
    bytes.chunks_exact(4).all(|b| b[0] == 0 && b[1] == 0)
}

/// Little-endian f32 `bytes` as little-endian bf16, rounded to nearest,
/// ties to even; a value [`holds_bf16`] keeps its value. The artifact's
/// values are finite and far below where rounding would overflow.
fn to_bf16(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(4)
        .flat_map(|b| {
            let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let rounded = bits + 0x7fff + ((bits >> 16) & 1);
            ((rounded >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// The full-precision tensors of `out` (the artifact stores them in f32 or
/// bf16): every one but the int8 weights and the scales, which
/// compressed-tensors keeps in f32.
fn full_precision<'a, 'b>(
    out: &'b mut BTreeMap<String, TensorOut<'a>>,
) -> impl Iterator<Item = (&'b String, &'b mut TensorOut<'a>)> {
    out.iter_mut().filter(|(name, (dtype, _, _))| {
        matches!(dtype, Dtype::F32 | Dtype::BF16) && !name.ends_with("_scale")
    })
}

/// Writes `out`'s full-precision tensors in one dtype, which it returns as
/// the checkpoint's `torch_dtype`: bf16 when each holds bf16 values exactly,
/// else f32, bf16 ones widened.
fn to_checkpoint_dtype(out: &mut BTreeMap<String, TensorOut<'_>>) -> &'static str {
    let exact = full_precision(out)
        .all(|(_, (dtype, _, bytes))| *dtype == Dtype::BF16 || holds_bf16(bytes));
    let target = if exact { Dtype::BF16 } else { Dtype::F32 };
    for (_, (dtype, _, bytes)) in full_precision(out) {
        if *dtype != target {
            *bytes = Cow::Owned(match target {
                Dtype::BF16 => to_bf16(bytes),
                _ => f32_bytes(qforge_model::linear::bf16_values(bytes)),
            });
            *dtype = target;
        }
    }
    if exact { "bfloat16" } else { "float32" }
}

/// The artifact's `model.safetensors`, memory-mapped: a language model's
/// tensors are copied into the export as they are, so they need not be read
/// into memory first.
fn map_weights(weights_path: &Path) -> Result<memmap2::Mmap> {
    let file = qforge_formats::files::open_regular(weights_path)?;
    // SAFETY: a read-only map of an artifact file, which qforge writes once
    // and never modifies.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| qforge_model::Error::io(weights_path, e))?;
    Ok(map)
}

/// Everything but a full-precision lm_head, copied as stored (the int8
/// layout is already compressed-tensors'); such a head depends on tying,
/// see [`lm_head`]. An int8 head (`int8_head`) is copied like every int8
/// layer.
fn copied_tensors<'a>(
    source: &SafeTensors<'a>,
    int8_head: bool,
) -> BTreeMap<String, TensorOut<'a>> {
    let mut out = BTreeMap::new();
    for (name, view) in source.tensors() {
        if int8_head || !name.starts_with("lm_head.") {
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
    /// Sorts every linear layer but a full-precision lm_head (see
    /// [`lm_head`]) by the precision of its observation point, adding
    /// `NAME.input_scale` to `out` for static inputs. An int8 lm_head is a
    /// target like any int8 layer: the export runs the head the guard
    /// measured, not the tied embedding in its place. A point `qforge.json`
    /// omits is an error even for lm_head: the artifact would be incomplete.
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
            if layer == "lm_head" && precision == LayerPrecision::Fp {
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

/// A full-precision `lm_head.weight`, in `ignore`: left out when the source
/// tied it (vLLM ties it again), else added to `out` as the artifact stores
/// it (f32 or bf16). Returns how it was written, for the manifest.
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
    // As the artifact stores it (bf16 for a bf16 source's, see `artifact`).
    let dtype @ (Dtype::F32 | Dtype::BF16) = weight.dtype() else {
        return Err(Error::Inconsistent(format!(
            "{}: lm_head.weight is {:?}, but qforge.json keeps lm_head in full precision",
            weights_path.display(),
            weight.dtype()
        )));
    };
    out.insert(
        "lm_head.weight".into(),
        (dtype, weight.shape().to_vec(), Cow::Borrowed(weight.data())),
    );
    Ok("copied")
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
    Ok(qforge_formats::safetensors_file::write_safetensors(
        &dest.join("model.safetensors"),
        views,
    )?)
}

/// An online rotation as the export writes it: its transform scheme and
/// its matrix, little-endian bf16.
struct RotationMatrix {
    input: RotatedInput,
    scheme: String,
    size: usize,
    bf16: Vec<u8>,
}

/// The matrices of `rotations` for a model of config `llama`; a rotation
/// vLLM cannot apply (lm_head's input) is refused, naming the way out.
fn rotation_matrices(
    artifact: &Path,
    rotations: &[RotatedInput],
    llama: &LlamaConfig,
) -> Result<Vec<RotationMatrix>> {
    rotations
        .iter()
        .map(|&input| {
            if input == RotatedInput::Head {
                return Err(Error::Unsupported(format!(
                    "{} rotates lm_head's input online, which vLLM cannot apply (it runs \
                     compressed-tensors' online transforms on linear layers only, not on its \
                     LM head); to export to vLLM, quantize again without lm_head in --hadamard \
                     (`--hadamard quarot` rotates the residual offline and down_proj online)",
                    artifact.display()
                )));
            }
            let size = input.width(llama);
            let signs = input_transform_matrix(input, llama)?;
            Ok(RotationMatrix {
                input,
                scheme: format!("hadamard_{}", input.name().replace('.', "_")),
                size,
                bf16: to_bf16(&f32_bytes(signs)),
            })
        })
        .collect()
}

/// Adds each rotation's matrix to `out` once for every layer reading its
/// input, under the name vLLM loads it from.
fn add_rotation_matrices<'a>(
    rotations: &'a [RotationMatrix],
    llama: &LlamaConfig,
    out: &mut BTreeMap<String, TensorOut<'a>>,
) {
    for rotation in rotations {
        for layer in 0..llama.num_layers {
            for module in rotation.input.consumers() {
                out.insert(
                    input_transform_key(
                        &format!("model.layers.{layer}.{module}"),
                        &rotation.scheme,
                    ),
                    (
                        Dtype::BF16,
                        vec![rotation.size, rotation.size],
                        Cow::Borrowed(&rotation.bf16),
                    ),
                );
            }
        }
    }
}

/// `quantization_config.transform_config`: one online `random-hadamard`
/// scheme per rotation, at the input of the modules reading it (a pattern
/// matched from the start of a module's name, as compressed-tensors and
/// vLLM match `re:` targets).
fn transform_config(rotations: &[RotationMatrix]) -> Value {
    let groups: serde_json::Map<String, Value> = rotations
        .iter()
        .map(|rotation| {
            let modules: Vec<String> = rotation
                .input
                .consumers()
                .iter()
                .map(|m| m.replace('.', "\\."))
                .collect();
            let target = format!("re:model\\.layers\\.\\d+\\.({})$", modules.join("|"));
            let scheme = json!({
                "type": "random-hadamard",
                "apply": [{"targets": [target], "location": "input", "inverse": false, "ignore": []}],
                "randomize": false,
                "requires_grad": false,
                "head_dim": null,
                "precision": "float32",
            });
            (rotation.scheme.clone(), scheme)
        })
        .collect();
    json!({ "config_groups": groups })
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
    let mut hf = read_json(&artifact.join("config.json"))?;
    let llama = LlamaConfig::from_hf(&hf)?;
    let rotations = rotation_matrices(artifact, &config.online_rotations, &llama)?;
    let tied = hf["tie_word_embeddings"].as_bool().unwrap_or(false);

    let weights_path = artifact.join(WEIGHTS_FILE);
    let map = map_weights(&weights_path)?;
    let source = SafeTensors::deserialize(&map)
        .map_err(|e| Error::Inconsistent(format!("{}: {e}", weights_path.display())))?;
    let int8_head = config
        .points
        .get("lm_head")
        .is_some_and(|p| *p != LayerPrecision::Fp);
    let mut out = copied_tensors(&source, int8_head);
    let mut targets = Targets::sort(&llama, &config.points, &mut out)?;
    let lm_head = if int8_head {
        // Its own int8 matrix now, whatever the source tied.
        hf["tie_word_embeddings"] = false.into();
        "int8"
    } else {
        targets.ignored.push("lm_head".to_owned());
        lm_head(tied, &source, &weights_path, &mut out)?
    };
    let dtype = to_checkpoint_dtype(&mut out);
    // After the dtype choice: ±1 is exact in bf16, whatever the rest holds.
    add_rotation_matrices(&rotations, &llama, &mut out);

    hf["quantization_config"] = targets.quantization_config();
    if !rotations.is_empty() {
        hf["quantization_config"]["transform_config"] = transform_config(&rotations);
    }
    hf["torch_dtype"] = dtype.into();
    write_tensors(&out, dest)?;
    write_config_and_tokenizer(&hf, artifact, dest)?;
    Ok(CompressedTensors {
        quantized_layers: targets.static_inputs.len() + targets.dynamic_inputs.len(),
        ignored: targets.ignored,
        lm_head,
        dtype,
        online_rotations: rotations.iter().map(|r| r.input.name()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_values(bytes: &[u8]) -> Vec<f32> {
        qforge_model::linear::bf16_values(bytes).collect()
    }

    #[test]
    fn bf16_values_narrow_exactly_and_others_round_to_nearest_even() {
        let exact = [1.0f32, -0.0, 3.140625, -2f32.powi(-70), 65280.0];
        assert!(holds_bf16(&f32_bytes(exact)));
        assert_eq!(bf16_values(&to_bf16(&f32_bytes(exact))), exact);

        let step = 2f32.powi(-7); // one bf16 ulp at 1.0
        let inexact = [
            1.0 + step * 0.5,                  // a tie: to 1.0, whose last bit is even
            1.0 + step * 1.5,                  // a tie: to 1 + 2 ulps, even
            1.0 + step * 0.5 + 2f32.powi(-20), // above the tie: up
            -(1.0 + step * 0.25),              // below it: down, in magnitude
        ];
        assert!(!holds_bf16(&f32_bytes(inexact)));
        assert_eq!(
            bf16_values(&to_bf16(&f32_bytes(inexact))),
            [1.0, 1.0 + 2.0 * step, 1.0 + step, -1.0]
        );
    }

    /// An untied lm_head the artifact keeps in full precision is copied in
    /// the dtype the artifact stores it in: bf16 for a bf16 source's.
    #[test]
    fn a_bf16_lm_head_is_copied_as_bf16() {
        let values = [0x3f80u16, 0xbf40, 0x4040, 0x0000]; // 1.0, -0.75, 3.0, 0.0
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::BF16, vec![2, 2], &bytes).unwrap();
        let file = safetensors::serialize([("lm_head.weight", view)], None).unwrap();
        let source = SafeTensors::deserialize(&file).unwrap();
        let mut out = BTreeMap::new();
        let how = lm_head(false, &source, Path::new("model.safetensors"), &mut out).unwrap();
        assert_eq!(how, "copied");
        assert_eq!(to_checkpoint_dtype(&mut out), "bfloat16");
        let (dtype, shape, copied) = &out["lm_head.weight"];
        assert_eq!((*dtype, shape.as_slice()), (Dtype::BF16, [2, 2].as_slice()));
        assert_eq!(copied.as_ref(), bytes.as_slice());
    }

    #[test]
    fn the_checkpoint_is_bf16_only_when_every_full_precision_tensor_holds_bf16() {
        let tensor = |values: &[f32]| {
            (
                Dtype::F32,
                vec![values.len()],
                Cow::Owned(f32_bytes(values.iter().copied())),
            )
        };
        let mut out: BTreeMap<String, TensorOut<'_>> = BTreeMap::new();
        out.insert("model.norm.weight".into(), tensor(&[1.0, 0.5]));
        out.insert("lm_head.weight".into(), tensor(&[0.1, 0.2]));
        // An embedding the artifact stores in bf16: 3.0 and -0.75.
        let embedding = Cow::Owned(vec![0x40, 0x40, 0x40, 0xbf]);
        out.insert(
            "model.embed_tokens.weight".into(),
            (Dtype::BF16, vec![2], embedding),
        );
        // Scales stay f32 whatever they hold.
        out.insert("a.weight_scale".into(), tensor(&[0.1]));
        out.insert("a.input_scale".into(), tensor(&[0.3]));

        let mut exact = out.clone();
        exact.insert("lm_head.weight".into(), tensor(&[0.5, -0.25]));
        assert_eq!(to_checkpoint_dtype(&mut exact), "bfloat16");
        let dtypes: Vec<Dtype> = exact.values().map(|(dtype, _, _)| *dtype).collect();
        // In name order: a.input_scale, a.weight_scale, lm_head, embedding, norm.
        assert_eq!(
            dtypes,
            [
                Dtype::F32,
                Dtype::F32,
                Dtype::BF16,
                Dtype::BF16,
                Dtype::BF16
            ]
        );
        assert_eq!(
            exact["model.embed_tokens.weight"],
            out["model.embed_tokens.weight"]
        );
        assert_eq!(bf16_values(&exact["lm_head.weight"].2), [0.5, -0.25]);
        assert_eq!(bf16_values(&exact["model.norm.weight"].2), [1.0, 0.5]);

        // lm_head copied from the artifact counts: 0.1 is no bf16. The
        // checkpoint is f32, the bf16 embedding widened into it.
        let mut widened = out.clone();
        assert_eq!(to_checkpoint_dtype(&mut widened), "float32");
        let embedding = widened.remove("model.embed_tokens.weight").unwrap();
        assert_eq!(
            embedding,
            (Dtype::F32, vec![2], Cow::Owned(f32_bytes([3.0, -0.75])))
        );
        out.remove("model.embed_tokens.weight");
        assert_eq!(widened, out);
    }
}
