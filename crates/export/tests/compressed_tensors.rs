//! The compressed-tensors export of SmolLM2 (from GGUF, so q/k rows went
//! through the un-permutation), loaded by a peer: candle-transformers'
//! Hugging Face Llama, its int8 weights dequantized with their scales, gives
//! the logits of qforge's forward over the same dequantized weights. A wrong
//! q/k permutation, name, transpose or scale layout fails this.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama as peer;
use qforge_export::export_compressed_tensors;
use qforge_model::artifact::{LayerPrecision, write_language_model};
use qforge_model::{LanguageModel, Linear, Logits, RotatedInput};
use safetensors::{Dtype, SafeTensors};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A scratch directory, removed when dropped.
fn fresh(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-export-{name}-"))
        .tempdir()
        .unwrap()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The export's tensors as the peer takes them: int8 weights times their
/// per-row scales, f32 and bf16 as stored; scales themselves left out; each
/// online input transform folded into the weight of the layer it feeds.
fn dequantized_tensors(dir: &Path) -> HashMap<String, Tensor> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        if name.ends_with(".weight_scale") || name.ends_with(".input_scale") {
            continue;
        }
        let shape = view.shape().to_vec();
        let values = match view.dtype() {
            Dtype::F32 => floats(view.data()),
            Dtype::BF16 => qforge_model::linear::bf16_values(view.data()).collect(),
            Dtype::I8 => {
                let scale_name = name.replace(".weight", ".weight_scale");
                let scales = floats(st.tensor(&scale_name).unwrap().data());
                assert_eq!(st.tensor(&scale_name).unwrap().shape(), [shape[0], 1]);
                view.data()
                    .chunks_exact(shape[1])
                    .zip(&scales)
                    .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v as i8) * s))
                    .collect()
            }
            other => panic!("{name} is {other:?}"),
        };
        out.insert(name, Tensor::from_vec(values, shape, &Device::Cpu).unwrap());
    }
    fold_input_transforms(dir, &mut out);
    out
}

/// Folds each online input transform of the export's `transform_config`
/// into the weight it feeds, by the format's definition rather than
/// qforge's code: the runtime computes `(x H/√n) Wᵀ = x (W (H/√n)ᵀ)ᵀ` for
/// the stored `H` of `NAME.SCHEME_input.weight`, so `W` becomes `W (H/√n)ᵀ`.
fn fold_input_transforms(dir: &Path, tensors: &mut HashMap<String, Tensor>) {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let Some(groups) =
        config["quantization_config"]["transform_config"]["config_groups"].as_object()
    else {
        return;
    };
    for (scheme, group) in groups {
        let apply = &group["apply"][0];
        assert_eq!(
            (&apply["location"], &apply["inverse"]),
            (&"input".into(), &false.into())
        );
        let suffix = format!(".{scheme}_input.weight");
        let matrices: Vec<String> = tensors
            .keys()
            .filter(|k| k.ends_with(&suffix))
            .cloned()
            .collect();
        assert!(!matrices.is_empty(), "no matrix of {scheme}");
        for key in matrices {
            let h = tensors.remove(&key).unwrap();
            let n = h.dims()[0] as f64;
            let weight_key = format!("{}.weight", key.strip_suffix(&suffix).unwrap());
            let w = &tensors[&weight_key];
            let folded = w.matmul(&(h / n.sqrt()).unwrap().t().unwrap()).unwrap();
            tensors.insert(weight_key, folded);
        }
    }
}

/// SmolLM2-135M-Instruct from the GGUF fixture.
fn smollm2() -> LanguageModel {
    let gguf = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(gguf.exists(), "run scripts/fetch-models.sh");
    LanguageModel::load(&gguf).unwrap()
}

/// Every linear of `lm` int8 with dynamic inputs, but lm_head in full
/// precision.
fn dynamic_with_fp_head(lm: &LanguageModel) -> BTreeMap<String, LayerPrecision> {
    lm.model
        .linears()
        .iter()
        .map(|(_, point, _)| {
            let precision = if point == "lm_head" {
                LayerPrecision::Fp
            } else {
                LayerPrecision::Int8Dynamic
            };
            (point.clone(), precision)
        })
        .collect()
}

fn last_logits(model: &qforge_model::Llama, tokens: &[u32]) -> Vec<f32> {
    model
        .forward(&[tokens.to_vec()], None, None, Logits::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn candle_transformers_runs_the_export_with_qforges_logits() {
    let lm = smollm2();
    let points: BTreeMap<String, LayerPrecision> = lm
        .model
        .linears()
        .iter()
        .map(|(_, point, _)| {
            let precision = if point == "model.layers.2.mlp.down_proj" {
                LayerPrecision::Fp
            } else if point.ends_with("self_attn.q_proj") {
                LayerPrecision::Int8Static { input_scale: 0.05 }
            } else {
                LayerPrecision::Int8Dynamic
            };
            (point.clone(), precision)
        })
        .collect();
    let (summary, config) = export_and_compare(&lm, &points, "plain");
    let groups = &config["quantization_config"]["config_groups"];
    assert_eq!(groups["group_0"]["input_activations"]["strategy"], "tensor");
    assert_eq!(groups["group_1"]["input_activations"]["dynamic"], true);
    // The int8 head the artifact holds, untied: vLLM runs what was measured.
    assert_eq!(summary.lm_head, "int8");
    assert_eq!(config["tie_word_embeddings"], false);
    assert!(
        groups["group_1"]["targets"]
            .as_array()
            .unwrap()
            .contains(&"lm_head".into())
    );
    assert_eq!(summary.ignored, ["model.layers.2.mlp.down_proj".to_owned()]);
}

/// The residual rotation (`--hadamard residual`) leaves a plain Llama: its
/// export runs on the peer like any other, lm_head now its own matrix.
#[test]
fn a_residual_rotated_model_exports_and_runs_on_candle_transformers() {
    let mut lm = smollm2();
    lm.model = lm.model.residual_rotated(0).unwrap();
    let points = dynamic_with_fp_head(&lm);
    let (summary, _) = export_and_compare(&lm, &points, "residual");
    assert_eq!(summary.lm_head, "copied");
    assert_eq!(summary.dtype, "float32");
    assert_eq!(summary.ignored, ["lm_head".to_owned()]);
}

/// Online rotations (QuaRot: the residual offline and down_proj's input
/// online, here with o_proj's too; and every other input on its own,
/// q/k/v and gate/up being vLLM's fused layers) export as compressed-tensors
/// transforms: candle-transformers over the export's weights with the
/// transforms folded in by the format's definition gives qforge's logits,
/// and qforge reads the export back to the artifact's logits bit for bit.
#[test]
fn online_rotations_export_as_transforms_that_run_on_the_peer_and_read_back() {
    let lm = smollm2();
    let recipes: [(&str, bool, &[RotatedInput]); 2] = [
        (
            "quarot",
            true,
            &[RotatedInput::AttentionOutput, RotatedInput::MlpProduct],
        ),
        (
            "inputs",
            false,
            &[RotatedInput::Attention, RotatedInput::Mlp],
        ),
    ];
    for (name, residual, inputs) in recipes {
        let mut rotated = lm.clone();
        if residual {
            rotated.model = rotated.model.residual_rotated(0).unwrap();
        }
        rotated.model = rotated.model.rotated(inputs).unwrap();
        let points = dynamic_with_fp_head(&rotated);
        let (summary, config) = export_and_compare(&rotated, &points, name);
        let names: Vec<&str> = inputs.iter().map(|r| r.name()).collect();
        assert_eq!(summary.online_rotations, names);
        let groups = config["quantization_config"]["transform_config"]["config_groups"]
            .as_object()
            .unwrap();
        assert_eq!(groups.len(), inputs.len());
        assert!(groups.values().all(|g| g["type"] == "random-hadamard"));
    }
}

/// What qforge cannot carry or run is refused by name: an export of a
/// rotated lm_head input (vLLM applies no transform to its LM head), and a
/// checkpoint whose transform matrix is not qforge's Hadamard, or that
/// rotates down_proj's input in some layers only.
#[test]
fn rotations_vllm_or_qforge_cannot_apply_are_refused_by_name() {
    let mut lm = smollm2();
    lm.model = lm.model.rotated(&[RotatedInput::Head]).unwrap();
    let artifact = fresh("head-artifact");
    write_language_model(artifact.path(), &lm, &dynamic_with_fp_head(&lm)).unwrap();
    let err = export_compressed_tensors(artifact.path(), fresh("head-ct").path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("rotates lm_head's input online"), "{err}");

    let mut lm = smollm2();
    lm.model = lm.model.rotated(&[RotatedInput::MlpProduct]).unwrap();
    let artifact = fresh("tamper-artifact");
    write_language_model(artifact.path(), &lm, &dynamic_with_fp_head(&lm)).unwrap();
    let export = fresh("tamper-ct");
    export_compressed_tensors(artifact.path(), export.path()).unwrap();
    assert!(LanguageModel::load(export.path()).is_ok());
    let weights = export.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    let key = "model.layers.3.mlp.down_proj.hadamard_mlp_down_proj_input.weight";
    let rewrite = |edit: &TensorEdit<'_>| {
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .filter_map(|(name, view)| {
                let data = edit(&name, view.data())?;
                Some((name, view.dtype(), view.shape().to_vec(), data))
            })
            .collect();
        let views = kept.iter().map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        });
        safetensors::serialize_to_file(views, None, &weights).unwrap();
        LanguageModel::load(export.path()).unwrap_err().to_string()
    };
    // One sign flipped (bf16 1.0 = 0x3f80, -1.0 = 0xbf80).
    let err = rewrite(&|name, data| {
        let mut data = data.to_vec();
        if name == key {
            data[1] ^= 0x80;
        }
        Some(data)
    });
    assert!(
        err.contains("is not qforge's Hadamard matrix of size 1536"),
        "{err}"
    );
    let err = rewrite(&|name, data| (name != key).then(|| data.to_vec()));
    assert!(err.contains(key), "{err}");
    assert!(err.contains("transform_config"), "{err}");

    // A second scheme on the same input: vLLM keeps the last and
    // compressed-tensors applies both, so qforge refuses it.
    std::fs::write(&weights, &bytes).unwrap();
    let config_path = export.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let groups = &mut config["quantization_config"]["transform_config"]["config_groups"];
    groups["hadamard_again"] = groups["hadamard_mlp_down_proj"].clone();
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let err = LanguageModel::load(export.path()).unwrap_err().to_string();
    assert!(
        err.contains("mlp.down_proj twice") && err.contains("hadamard_again"),
        "{err}"
    );
}

/// `lm` with the int8 layers of `points` dequantized (their int8 values
/// times their scales) and run in floating point, activations in f32, as a
/// weight-only runtime runs them.
fn dequantized(
    lm: &LanguageModel,
    points: &BTreeMap<String, LayerPrecision>,
) -> qforge_model::Llama {
    lm.model
        .with_linears(|point, layer| {
            if points[point] == LayerPrecision::Fp {
                return Ok(layer.clone());
            }
            let (_, bias) = layer.full_precision()?;
            let int8 = layer.int8_weight()?;
            let (values, scales) = (&int8.values, &int8.scales[..]);
            let (out, inp) = layer.shape();
            let dequantized: Vec<f32> = values
                .chunks_exact(inp)
                .zip(scales)
                .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v) * s))
                .collect();
            Linear::fp(
                point,
                Tensor::from_vec(dequantized, (out, inp), &Device::Cpu)?,
                bias,
                (out, inp),
            )
        })
        .unwrap()
}

/// Writes `lm` with `points` as a native artifact, exports it, and checks
/// that candle-transformers' Llama over the export's dequantized weights
/// gives the logits of qforge's forward over the same dequantized weights
/// (and that the int8 rounding mattered); gives the export's summary and
/// `config.json`.
fn export_and_compare(
    lm: &LanguageModel,
    points: &BTreeMap<String, LayerPrecision>,
    name: &str,
) -> (qforge_export::CompressedTensors, serde_json::Value) {
    let artifact = fresh(&format!("{name}-artifact"));
    let artifact = artifact.path();
    write_language_model(artifact, lm, points).unwrap();
    qforge_formats::manifest::write_manifest(artifact, serde_json::json!({"test": true})).unwrap();
    let dest = fresh(&format!("{name}-ct"));
    let dest = dest.path();
    let summary = export_compressed_tensors(artifact, dest).unwrap();

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dest.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization_config"];
    assert_eq!(q["quant_method"], "compressed-tensors");
    assert_eq!(q["format"], "int-quantized");

    // The peer on the export.
    let peer_config: peer::LlamaConfig = serde_json::from_value(config.clone()).unwrap();
    let peer_config = peer_config.into_config(false);
    let vb =
        candle_nn::VarBuilder::from_tensors(dequantized_tensors(dest), DType::F32, &Device::Cpu);
    let model = peer::Llama::load(vb, &peer_config).unwrap();
    let tokens = lm
        .text
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog because")
        .unwrap();
    let mut cache = peer::Cache::new(false, DType::F32, &peer_config, &Device::Cpu).unwrap();
    let input = Tensor::new(&tokens[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let theirs: Vec<f32> = model
        .forward(&input, 0, &mut cache)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();

    // qforge over the same dequantized weights, activations in f32.
    let ours = last_logits(&dequantized(lm, points), &tokens);
    let diff = max_abs_diff(&ours, &theirs);
    eprintln!("max |Δ logit| vs candle-transformers: {diff}");
    assert!(diff < 2e-3, "max |Δ logit| {diff}");
    // And the int8 rounding mattered: the f32 model's logits differ more.
    let fp = last_logits(&lm.model, &tokens);
    let fp_diff = max_abs_diff(&fp, &theirs);
    eprintln!("max |Δ logit| of the f32 model: {fp_diff}");
    assert!(fp_diff > 10.0 * diff.max(1e-4), "{fp_diff} vs {diff}");
    reads_back_as_the_artifact(artifact, dest, &tokens);
    (summary, config)
}

/// qforge opens the export as it opens any compressed-tensors checkpoint:
/// every int8 layer comes back with the artifact's scales and input
/// quantization, and the model gives the artifact's logits bit for bit once
/// the artifact's head is the export's (the export ties or copies it in
/// floating point).
fn reads_back_as_the_artifact(artifact: &Path, export: &Path, tokens: &[u32]) {
    let language = |path: &Path| match qforge_model::open(path).unwrap() {
        qforge_model::Model::Language(lm) => lm,
        other => panic!("{} opened as {other:?}", path.display()),
    };
    let (native, exported) = (language(artifact), language(export));
    let layers = |lm: &LanguageModel| -> BTreeMap<String, Linear> {
        lm.model
            .linears()
            .into_iter()
            .map(|(_, point, layer)| (point, layer.clone()))
            .collect()
    };
    let (native_layers, exported_layers) = (layers(&native), layers(&exported));
    for (point, layer) in &native_layers {
        if point == "lm_head" {
            continue;
        }
        let theirs = &exported_layers[point];
        match (layer, theirs) {
            // The values themselves are checked by the logits below.
            (Linear::Int8(a), Linear::Int8(b)) => {
                assert_eq!(a.activations(), b.activations(), "{point}");
                assert_eq!(a.weight_scales(), b.weight_scales(), "{point}");
            }
            (Linear::Int8(_), _) | (_, Linear::Int8(_)) => {
                panic!("{point} is int8 on one side only")
            }
            _ => {}
        }
    }
    let head = exported_layers["lm_head"].clone();
    let as_exported = native
        .model
        .with_linears(|point, layer| {
            Ok(if point == "lm_head" {
                head.clone()
            } else {
                layer.clone()
            })
        })
        .unwrap();
    assert_eq!(
        last_logits(&exported.model, tokens),
        last_logits(&as_exported, tokens),
        "the export read back differs from the artifact"
    );
}

/// A tensor of an export rewritten (`Some(bytes)`) or dropped (`None`), by
/// name and bytes.
type TensorEdit<'a> = dyn Fn(&str, &[u8]) -> Option<Vec<u8>> + 'a;

/// A change to an export's `quantization_config`.
type ConfigEdit<'a> = dyn Fn(&mut serde_json::Value) + 'a;

/// One export, its `config.json` rewritten as llm-compressor writes its own
/// (the class `Linear` as target, `lm_head` ignored by a pattern), as a
/// weight-only (W8A16) checkpoint, and as schemes qforge cannot run: the
/// first reads back as the export, the second runs its layers in floating
/// point, the others are refused naming what they hold.
#[test]
fn llm_compressor_layouts_load_and_other_schemes_are_refused_by_name() {
    let lm = smollm2();
    // llm-compressor leaves the head in floating point.
    let points = dynamic_with_fp_head(&lm);
    let artifact = fresh("layouts-artifact");
    write_language_model(artifact.path(), &lm, &points).unwrap();
    let export = fresh("layouts-ct");
    export_compressed_tensors(artifact.path(), export.path()).unwrap();
    let config_path = export.path().join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let tokens = lm.text.tokenizer.encode("Two plus two is").unwrap();
    let with_config = |edit: &ConfigEdit<'_>| {
        let mut config = original.clone();
        edit(&mut config["quantization_config"]);
        std::fs::write(&config_path, config.to_string()).unwrap();
        LanguageModel::load(export.path())
    };
    let exported = last_logits(&with_config(&|_| {}).unwrap().model, &tokens);

    let group = |q: &mut serde_json::Value| q["config_groups"]["group_0"].take();
    let compressor = with_config(&|q| {
        let mut g = group(q);
        g["targets"] = serde_json::json!(["Linear"]);
        q["config_groups"] = serde_json::json!({ "group_0": g });
        q["ignore"] = serde_json::json!(["re:.*lm_head$"]);
    })
    .unwrap();
    assert_eq!(last_logits(&compressor.model, &tokens), exported);

    let weight_only = with_config(&|q| {
        q["config_groups"]["group_0"]["input_activations"] = serde_json::Value::Null;
    })
    .unwrap();
    assert!(
        weight_only
            .model
            .linears()
            .iter()
            .all(|(_, _, layer)| !matches!(layer, Linear::Int8(_)))
    );
    // Weight-only: the int8 weights times their scales, inputs in f32.
    let w8a16 = last_logits(&weight_only.model, &tokens);
    let expected = last_logits(&dequantized(&lm, &points), &tokens);
    let diff = max_abs_diff(&w8a16, &expected);
    assert!(
        diff < 1e-4,
        "W8A16 vs the dequantized model: max |Δ logit| {diff}"
    );
    assert!(max_abs_diff(&w8a16, &exported) > 100.0 * diff.max(1e-6));

    let refusals: [(&ConfigEdit<'_>, &str); 4] = [
        (
            &|q| q["format"] = "pack-quantized".into(),
            "format \"pack-quantized\"",
        ),
        (
            &|q| q["config_groups"]["group_0"]["input_activations"]["symmetric"] = false.into(),
            "symmetric Some(false)",
        ),
        (
            &|q| q["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into(),
            "weights of Some(4) bits",
        ),
        (
            &|q| q["kv_cache_scheme"] = serde_json::json!({"num_bits": 8}),
            "quantizes the KV cache",
        ),
    ];
    for (edit, named) in refusals {
        let err = with_config(edit).unwrap_err().to_string();
        assert!(err.contains(named), "{err}");
        assert!(err.contains("qforge reads W8A8 INT8"), "{err}");
    }
}
