//! Loading files qforge did not write, or that changed since it wrote them:
//! only regular files are read, JSON only up to a limit, and only paths
//! inside the model's directory. (A FIFO blocks the process that opens it,
//! so the FIFO cases run the CLI as a child with a deadline:
//! `crates/cli/tests/loading.rs`.)

#[path = "support/files.rs"]
mod files;

use std::collections::BTreeMap;
use std::path::Path;

use files::{fixture, fresh_dir};
use qforge_core::Digest;
use qforge_formats::files::MAX_CONFIG_BYTES;
use qforge_formats::manifest::{FileEntry, Manifest, read_manifest, verify, write_manifest};
use qforge_model::artifact::{LayerPrecision, write_policy};
use qforge_model::{Llama, MlpPolicy};

/// A copy of the CartPole policy directory in `dir`.
fn cartpole_copy(dir: &Path) {
    for file in ["policy.json", "model.safetensors"] {
        std::fs::copy(
            fixture("fixtures/policies/cartpole").join(file),
            dir.join(file),
        )
        .unwrap();
    }
}

#[test]
fn a_json_file_over_the_limit_is_refused_before_it_is_read() {
    let dir = fresh_dir("large-json");
    let dir = dir.path();
    cartpole_copy(dir);
    // Sparse: a file of the size costs no disk, and before the limit it was
    // read whole (64 MiB of zeros) to fail in the JSON parser instead.
    let file = std::fs::File::create(dir.join("policy.json")).unwrap();
    file.set_len(MAX_CONFIG_BYTES + 1).unwrap();
    let error = MlpPolicy::from_dir(dir).unwrap_err().to_string();
    assert!(
        error.contains("policy.json is larger than 64 MiB"),
        "{error}"
    );
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(error.contains("larger than 64 MiB"), "{error}");
}

#[test]
fn only_regular_files_are_read() {
    let dir = fresh_dir("not-regular");
    let dir = dir.path();
    cartpole_copy(dir);
    // A directory where the weights should be: named as such, not "Is a
    // directory (os error 21)" from the read.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::create_dir(dir.join("model.safetensors")).unwrap();
    let error = MlpPolicy::from_dir(dir).unwrap_err().to_string();
    assert!(
        error.contains(
            "model.safetensors is a directory; qforge reads models only from regular files"
        ),
        "{error}"
    );
}

/// The CartPole policy written as an artifact into `dir` (every layer
/// int8-dynamic), with its manifest.
fn cartpole_artifact(dir: &Path) {
    let policy = MlpPolicy::from_dir(&fixture("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = policy
        .linears()
        .iter()
        .map(|(_, point, _)| (point.clone(), LayerPrecision::Int8Dynamic))
        .collect();
    write_policy(dir, &policy, &points).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
}

fn write_manifest_as_is(dir: &Path, manifest: &Manifest) {
    let text = serde_json::to_string_pretty(manifest).unwrap();
    std::fs::write(dir.join("manifest.json"), text).unwrap();
}

#[test]
fn verify_reads_no_file_outside_the_directory() {
    let scratch = fresh_dir("outside");
    let secret = scratch.path().join("secret.txt");
    std::fs::write(&secret, "not the artifact's").unwrap();
    let secret_sha = Digest::of(b"not the artifact's").to_hex();
    let artifact = scratch.path().join("artifact");
    std::fs::create_dir(&artifact).unwrap();
    cartpole_artifact(&artifact);
    let clean = read_manifest(&artifact).unwrap();
    let absolute = secret.to_string_lossy().into_owned();
    for (listed, expected) in [
        ("../secret.txt", "not a relative path inside"),
        (absolute.as_str(), "not a relative path inside"),
        ("link", "outside"),
    ] {
        if listed == "link" {
            std::os::unix::fs::symlink(&secret, artifact.join("link")).unwrap();
        }
        // Listed with its true hash, each passed before: verify read the
        // file outside and found it unchanged.
        let mut manifest = clean.clone();
        manifest.files.insert(
            listed.to_owned(),
            FileEntry {
                sha256: secret_sha.clone(),
                bytes: 18,
            },
        );
        write_manifest_as_is(&artifact, &manifest);
        let error = verify(&artifact).unwrap_err().to_string();
        assert!(
            error.contains(listed) && error.contains(expected),
            "{listed}: {error}"
        );
        // With a wrong hash, the error printed the outside file's hash.
        manifest.files.get_mut(listed).unwrap().sha256 = "0".repeat(64);
        write_manifest_as_is(&artifact, &manifest);
        let error = verify(&artifact).unwrap_err().to_string();
        assert!(!error.contains(&secret_sha), "{listed}: {error}");
    }
}

/// A Hugging Face directory in `dir` whose config is valid and whose index
/// names `shard` for its one tensor.
fn hf_dir_naming(dir: &Path, shard: &str) {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn shards_come_only_from_inside_the_model_directory_and_all_are_hashed() {
    let scratch = fresh_dir("shards");
    let model = scratch.path().join("model");
    std::fs::create_dir_all(model.join("weights")).unwrap();
    // A shard in a subdirectory is inside the model: loaded, so hashed. The
    // hash used to cover only the directory's top level.
    hf_dir_naming(&model, "weights/part-1.safetensors");
    let shard = model.join("weights/part-1.safetensors");
    std::fs::write(&shard, b"one version of the weights").unwrap();
    let before = qforge_model::open::digest(&model).unwrap();
    std::fs::write(&shard, b"another version of weights").unwrap();
    assert_ne!(qforge_model::open::digest(&model).unwrap(), before);

    std::fs::write(scratch.path().join("other.safetensors"), b"weights").unwrap();
    std::os::unix::fs::symlink(
        scratch.path().join("other.safetensors"),
        model.join("linked.safetensors"),
    )
    .unwrap();
    let absolute = scratch.path().join("other.safetensors");
    let absolute = absolute.to_string_lossy();
    for (shard, expected) in [
        ("../other.safetensors", "not a relative path inside"),
        (absolute.as_ref(), "not a relative path inside"),
        ("linked.safetensors", "outside"),
    ] {
        hf_dir_naming(&model, shard);
        // Before, the hash ignored such a shard and the loader read it.
        for error in [
            qforge_model::open::digest(&model).unwrap_err().to_string(),
            Llama::from_hf_dir(&model).unwrap_err().to_string(),
        ] {
            assert!(
                error.contains("model.safetensors.index.json names")
                    && error.contains(shard)
                    && error.contains(expected),
                "{shard}: {error}"
            );
        }
    }
}

#[test]
fn an_artifact_is_checked_against_its_manifest_before_it_loads() {
    let dir = fresh_dir("tampered");
    let dir = dir.path();
    cartpole_artifact(dir);
    qforge_model::open(dir).unwrap();
    // One flipped weight byte loaded and acted before.
    let weights = dir.join("model.safetensors");
    let clean = std::fs::read(&weights).unwrap();
    let mut bytes = clean.clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&weights, &bytes).unwrap();
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors changed"), "{error}");
    std::fs::write(&weights, &clean).unwrap();
    // A file added since, or no manifest at all: refused too.
    std::fs::write(dir.join("notes.txt"), "added").unwrap();
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(
        error.contains("notes.txt is not in the manifest"),
        "{error}"
    );
    std::fs::remove_file(dir.join("notes.txt")).unwrap();
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(error.contains("no manifest.json"), "{error}");
}

/// The CartPole policy as an artifact whose layers.0 has a static
/// activation scale (`0.015625`, exact in JSON) and whose layers.2 is FP,
/// with its manifest.
fn cartpole_static_artifact(dir: &Path) {
    let policy = MlpPolicy::from_dir(&fixture("fixtures/policies/cartpole")).unwrap();
    let points: BTreeMap<String, LayerPrecision> = [
        (
            "layers.0",
            LayerPrecision::Int8Static {
                input_scale: 0.015625,
            },
        ),
        ("layers.1", LayerPrecision::Int8Dynamic),
        ("layers.2", LayerPrecision::Fp),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    write_policy(dir, &policy, &points).unwrap();
    write_manifest(dir, serde_json::json!({"test": true})).unwrap();
}

/// Replaces `old` by `new` in `dir/file` and rewrites the manifest to
/// match, as someone who edits an artifact can: the hashes pass, so what
/// is refused is refused for its values.
fn edit_consistently(dir: &Path, file: &str, old: &str, new: &str) {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(old), "{old} not in {file}");
    std::fs::write(&path, text.replace(old, new)).unwrap();
    let info = read_manifest(dir).unwrap().info;
    write_manifest(dir, info).unwrap();
}

#[test]
fn activation_scales_must_be_positive_and_finite() {
    // 0 quantized every input to 0 and 1e39 (f32 infinity) saturated it:
    // both loaded and served all-zero actions.
    for scale in ["0", "-0.5", "1e39"] {
        let dir = fresh_dir("input-scale");
        let dir = dir.path();
        cartpole_static_artifact(dir);
        edit_consistently(
            dir,
            "qforge.json",
            "\"input_scale\": 0.015625",
            &format!("\"input_scale\": {scale}"),
        );
        let error = qforge_model::open(dir).unwrap_err().to_string();
        assert!(
            error.contains("qforge.json: layers.0 has input_scale")
                && error.contains("positive finite"),
            "{scale}: {error}"
        );
    }
}

/// `dir/model.safetensors` with the first value of tensor `name` (F32)
/// replaced by `value`, and the manifest rewritten to match.
fn set_first_value(dir: &Path, name: &str, value: f32) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let (header, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let start = 8 + header + metadata.info(name).unwrap().data_offsets.0;
    bytes[start..start + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let info = read_manifest(dir).unwrap().info;
    write_manifest(dir, info).unwrap();
}

#[test]
fn non_finite_weights_are_refused_at_load() {
    // A policy directory: a NaN weight loaded and made every action 0.
    let dir = fresh_dir("nan-policy");
    let dir = dir.path();
    cartpole_copy(dir);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
            )
        })
        .collect();
    owned.get_mut("layers.1.weight").unwrap().2[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
    let views: Vec<_> = owned
        .iter()
        .map(|(name, (dtype, shape, data))| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let error = qforge_model::open(dir).unwrap_err().to_string();
    assert!(
        error.contains("layers.1.weight holds NaN at index 3"),
        "{error}"
    );

    // An artifact: an FP layer's bias and an INT8 layer's bias.
    for (tensor, value) in [
        ("layers.2.bias", f32::NAN),
        ("layers.0.bias", f32::INFINITY),
    ] {
        let dir = fresh_dir("nan-artifact");
        let dir = dir.path();
        cartpole_static_artifact(dir);
        set_first_value(dir, tensor, value);
        let error = qforge_model::open(dir).unwrap_err().to_string();
        assert!(
            error.contains("model.safetensors")
                && error.contains(&format!("{tensor} holds {value} at index 0")),
            "{error}"
        );
    }
}

#[test]
fn an_onnx_policy_is_hashed_with_its_head_file() {
    let dir = fresh_dir("onnx-head");
    let dir = dir.path();
    let onnx = dir.join("policy.onnx");
    std::fs::copy(fixture("fixtures/onnx/cartpole_sb3.onnx"), &onnx).unwrap();
    let alone = qforge_model::open::digest(&onnx).unwrap();
    let head = dir.join("policy.policy.json");
    std::fs::write(&head, r#"{"head": {"kind": "discrete", "actions": 2}}"#).unwrap();
    let discrete = qforge_model::open::digest(&onnx).unwrap();
    assert_ne!(discrete, alone);
    let policy = qforge_model::open(&onnx)
        .unwrap()
        .into_policy(&onnx)
        .unwrap();
    assert_eq!(policy.config().observation_dim, 4);
    // Another head is another model: the hash moves, and a head the graph
    // does not fit is an error naming both.
    std::fs::write(&head, r#"{"head": {"kind": "value"}}"#).unwrap();
    assert_ne!(qforge_model::open::digest(&onnx).unwrap(), discrete);
    let error = qforge_model::open(&onnx).unwrap_err().to_string();
    assert!(
        error.contains("policy.onnx") && error.contains("value head needs 1"),
        "{error}"
    );
    std::fs::write(
        &head,
        r#"{"head": {"kind": "discrete", "actions": 2}, "extra": 1}"#,
    )
    .unwrap();
    let error = qforge_model::open(&onnx).unwrap_err().to_string();
    assert!(
        error.contains("policy.policy.json") && error.contains("unknown field"),
        "{error}"
    );
}
