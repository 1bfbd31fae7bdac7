//! The native artifact: what `qforge quantize` writes loads back as the very
//! model it evaluated (bit-identical outputs), for a policy and for
//! SmolLM2 (GGUF in, Hugging Face layout out); the manifest names a file that
//! changed; damaged artifacts are clear errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qforge_model::artifact::{
    LayerPrecision, load_language_model, load_policy, write_language_model, write_policy,
};
use qforge_model::manifest::{verify, write_manifest};
use qforge_model::{LanguageModel, Logits, MlpPolicy, RotatedInput};

/// A scratch directory, removed when dropped.
fn fresh_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-artifact-{name}-"))
        .tempdir()
        .unwrap()
}

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The SmolLM2 fixture (scripts/fetch-models.sh); fails when missing.
fn smollm2_path() -> PathBuf {
    let path = fixture("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    path
}

fn observations() -> Vec<f32> {
    let text =
        std::fs::read_to_string(fixture("fixtures/policies/cartpole/rollouts.jsonl")).unwrap();
    let mut out = Vec::new();
    for line in text.lines().take(2) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for row in v["observations"].as_array().unwrap() {
            out.extend(
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32),
            );
        }
    }
    out
}

#[test]
fn a_policy_artifact_loads_as_the_model_that_was_written() {
    let fp = MlpPolicy::from_dir(&fixture("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = [
        (
            "layers.0",
            LayerPrecision::Int8Static {
                input_scale: 2.5 / 127.0,
            },
        ),
        ("layers.1", LayerPrecision::Int8Dynamic),
        ("layers.2", LayerPrecision::Fp),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let quantized = fp
        .with_linears(|point, layer| points[point].apply(layer))
        .unwrap();
    let dir = fresh_dir("policy");
    let dir = dir.path();
    write_policy(dir, &fp, &points).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
    verify(dir).unwrap();

    let loaded = load_policy(dir).unwrap();
    let obs = observations();
    let want = quantized.forward(&obs, None).unwrap();
    assert_eq!(loaded.forward(&obs, None).unwrap(), want);
    // And the quantization did something: not the FP outputs.
    assert_ne!(fp.forward(&obs, None).unwrap(), want);
    // Weights of INT8 layers are int8 on disk: 1 byte each plus scales.
    let kinds: Vec<&str> = loaded
        .linears()
        .iter()
        .map(|(_, _, l)| match l {
            qforge_model::Linear::Int8(_) => "int8",
            _ => "fp",
        })
        .collect();
    assert_eq!(kinds, ["int8", "int8", "fp"]);

    // One flipped byte: verify names the file.
    let weights = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, &bytes).unwrap();
    let error = verify(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors changed"), "{error}");

    // Truncated tensors: a clear error naming the file, no panic.
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let error = load_policy(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors"), "{error}");

    // A precision for a layer the model lacks, or none for one it has.
    let mut wrong = points.clone();
    wrong.remove("layers.2");
    assert!(write_policy(fresh_dir("policy-wrong").path(), &fp, &wrong).is_err());
}

#[test]
fn smollm2_written_from_gguf_loads_back_bit_identical() {
    let lm = LanguageModel::load(&smollm2_path()).unwrap();
    round_trip(&lm, "smollm2");
    // With every input rotated: the weights hold the rotations, the artifact
    // says so, and the loaded forward rotates online.
    let rotated = LanguageModel {
        model: lm.model.rotated(&RotatedInput::ALL).unwrap(),
        ..lm
    };
    let loaded = round_trip(&rotated, "smollm2-rotated");
    assert_eq!(loaded.model.rotated_inputs(), RotatedInput::ALL.to_vec());
}

/// Writes `lm` with a mix of precisions, loads it back, checks that it is
/// the model that was written, and returns it.
fn round_trip(lm: &LanguageModel, name: &str) -> LanguageModel {
    let points: BTreeMap<String, LayerPrecision> = lm
        .model
        .linears()
        .iter()
        .map(|(_, point, _)| {
            let precision = if point.ends_with("layers.3.mlp.down_proj") {
                LayerPrecision::Fp
            } else if point.ends_with("o_proj") {
                LayerPrecision::Int8Static { input_scale: 0.02 }
            } else {
                LayerPrecision::Int8Dynamic
            };
            (point.clone(), precision)
        })
        .collect();
    let quantized = lm
        .model
        .with_linears(|point, layer| points[point].apply(layer))
        .unwrap();
    let dir = fresh_dir(name);
    let dir = dir.path();
    write_language_model(dir, lm, &points).unwrap();
    let loaded = load_language_model(dir).unwrap();

    assert_eq!(loaded.model.config(), lm.model.config());
    assert_eq!(loaded.text.chat_template, lm.text.chat_template);
    let chat = lm.text.chat_text("What is 17 + 25?", "42").unwrap();
    let tokens = lm.text.tokenizer.encode(&chat).unwrap();
    assert_eq!(loaded.text.tokenizer.encode(&chat).unwrap(), tokens);
    assert_eq!(
        loaded.text.tokenizer.decode(&tokens).unwrap(),
        lm.text.tokenizer.decode(&tokens).unwrap()
    );

    let batch = vec![tokens[..24].to_vec()];
    let want = quantized
        .forward(&batch, None, None, Logits::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let got = loaded
        .model
        .forward(&batch, None, None, Logits::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(got, want);
    // Linear weights at int8: at most 27 % of their f32 bytes (one layer FP).
    let ratio = loaded.model.linear_weight_bytes() as f64 / lm.model.linear_weight_bytes() as f64;
    assert!(ratio < 0.27, "{ratio}");
    loaded
}
