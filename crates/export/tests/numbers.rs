//! What loading refuses, `export` does not write (issue 55, point 5): it
//! read the artifact's tensors raw, so an ONNX or compressed-tensors export
//! carried a NaN or 1e-40 scale, or an infinite bias, that `serve` refuses.
//! Each attack is now refused with the message loading gives.

#[path = "../../model/tests/tampered/mod.rs"]
mod tampered;

use std::collections::BTreeMap;
use std::path::Path;

use qforge_export::{Target, export};
use qforge_formats::manifest::write_manifest;
use qforge_model::LanguageModel;
use qforge_model::artifact::{LayerPrecision, check_numbers, write_language_model};
use tampered::{ATTACKS, Attack, Edit, REMEDY, cartpole_artifact, root};

fn fresh(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-export-numbers-{name}-"))
        .tempdir()
        .unwrap()
}

/// Exports `artifact` to `target`, expecting the refusal `check_numbers`
/// gives it, which names `attack`'s value; nothing is written.
fn refused(artifact: &Path, target: Target, attack: &Attack) {
    let expected = check_numbers(artifact).unwrap_err().to_string();
    assert!(
        expected.contains(attack.expected) && expected.contains(REMEDY),
        "{attack:?}: {expected}"
    );
    let out = fresh("out");
    let dest = out.path().join("export");
    let error = export(artifact, target, &dest).unwrap_err().to_string();
    assert_eq!(error, expected, "{attack:?} {target:?}");
    assert!(
        !dest.exists(),
        "{attack:?} {target:?}: an export was written"
    );
}

#[test]
fn a_policy_with_a_tampered_number_is_not_exported() {
    let clean = fresh("clean");
    cartpole_artifact(clean.path());
    let out = fresh("clean-out");
    export(
        clean.path(),
        Target::Onnx { f32: false },
        &out.path().join("onnx"),
    )
    .unwrap();
    for attack in ATTACKS {
        let dir = fresh("tampered");
        cartpole_artifact(dir.path());
        attack.apply(dir.path());
        // Compressed-tensors takes language models only, but the numbers
        // are refused first, whatever the format.
        for target in [Target::Onnx { f32: false }, Target::CompressedTensors] {
            refused(dir.path(), target, &attack);
        }
    }
}

#[test]
fn a_language_model_with_a_subnormal_weight_scale_is_not_exported() {
    let gguf = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(gguf.exists(), "run scripts/fetch-models.sh");
    let lm = LanguageModel::load(&gguf).unwrap();
    let points: BTreeMap<String, LayerPrecision> = lm
        .model
        .linears()
        .iter()
        .map(|(_, point, _)| (point.clone(), LayerPrecision::Int8Dynamic))
        .collect();
    let dir = fresh("lm");
    write_language_model(dir.path(), &lm, &points).unwrap();
    write_manifest(dir.path(), serde_json::json!({"test": true})).unwrap();
    let attack = Attack {
        edit: Edit::Tensor {
            name: "model.layers.0.self_attn.q_proj.weight_scale",
            value: 1e-40,
        },
        expected: "model.layers.0.self_attn.q_proj.weight_scale holds 1e-40 at index 0",
    };
    attack.apply(dir.path());
    refused(dir.path(), Target::CompressedTensors, &attack);
}
