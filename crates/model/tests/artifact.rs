//! The native artifact: what `qforge quantize` writes loads back as the very
//! model it evaluated (bit-identical outputs), for a policy and for
//! SmolLM2 (GGUF in, Hugging Face layout out); the manifest names a file that
//! changed; damaged artifacts are clear errors.

#[path = "support/files.rs"]
mod files;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use files::{fixture, fresh_dir};
use qforge_formats::manifest::{verify, write_manifest};
use qforge_model::artifact::{
    LayerPrecision, load_language_model, load_policy, write_language_model, write_policy,
};
use qforge_model::open::recorded_source;
use qforge_model::{LanguageModel, Logits, MlpPolicy, RotatedInput};

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

    // ... and the artifact no longer loads.
    let error = load_policy(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors changed"), "{error}");

    // Truncated tensors, the manifest rewritten to match: the parser gives
    // a clear error naming the file, no panic.
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
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
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
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

    // One flipped weight byte: the artifact no longer loads (it used to,
    // and generated from the changed weight).
    let weights = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&weights, &bytes).unwrap();
    let error = load_language_model(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors changed"), "{error}");
    loaded
}

#[test]
fn every_file_of_an_artifact_gets_the_mode_the_umask_gives() {
    let fp = MlpPolicy::from_dir(&fixture("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = fp
        .linears()
        .iter()
        .map(|(_, point, _)| (point.clone(), LayerPrecision::Int8Dynamic))
        .collect();
    let dir = fresh_dir("modes");
    let dir = dir.path();
    write_policy(dir, &fp, &points).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
    // A file created here as any other is: what the umask gives.
    let probe = dir.join("probe");
    std::fs::write(&probe, "").unwrap();
    let mode = |path: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions())
            & 0o777
    };
    let expected = mode(&probe);
    std::fs::remove_file(&probe).unwrap();
    // model.safetensors was 0600 (safetensors' temporary file) while the
    // rest followed the umask (0644 under umask 022).
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), expected, "{}", path.display());
    }
}

#[test]
fn the_recorded_source_is_found_and_refused_once_it_has_changed() {
    let scratch = fresh_dir("source");
    let source = scratch.path().join("policy");
    std::fs::create_dir(&source).unwrap();
    for file in ["policy.json", "model.safetensors"] {
        std::fs::copy(
            fixture("fixtures/policies/cartpole").join(file),
            source.join(file),
        )
        .unwrap();
    }
    let digest = qforge_model::open::digest(&source).unwrap();
    let artifact = scratch.path().join("artifact");
    std::fs::create_dir(&artifact).unwrap();
    let manifest = write_manifest(
        &artifact,
        serde_json::json!({"source_model": {
            "path": source.display().to_string(),
            "sha256": digest.to_hex(),
        }}),
    )
    .unwrap();
    assert_eq!(recorded_source(&manifest).unwrap(), source);
    // One weight byte changed: the FP reference is no longer the one the
    // artifact was quantized from.
    let weights = source.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let error = recorded_source(&manifest).unwrap_err().to_string();
    assert!(error.contains("changed since it was quantized"), "{error}");
    std::fs::remove_dir_all(&source).unwrap();
    let error = recorded_source(&manifest).unwrap_err().to_string();
    assert!(error.contains("is not readable"), "{error}");
}
