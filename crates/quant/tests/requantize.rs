//! Requantizing new weights like an artifact: the artifact's frozen scales,
//! smoothing and precisions, each weight's per-channel scale recomputed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qforge_formats::policy::PolicyConfig;
use qforge_model::MlpPolicy;
use qforge_model::artifact::{LayerPrecision, int8_weights, read_config};
use qforge_quant::requantize::requantize;
use qforge_quant::{Inputs, Pipeline, QuantRecipe};
use qforge_runner::EmbeddedExecutor;
use safetensors::tensor::TensorView;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/policies")
        .join(name)
}

fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-requantize-{name}-"))
        .tempdir()
        .unwrap()
}

/// `qforge quantize`'s default recipe on a fixture, written into `dir`.
fn quantize(fixture_name: &str, search: bool, dir: &Path) {
    let mut recipe = QuantRecipe::default();
    recipe.method.search = search;
    let executor = EmbeddedExecutor { threads: 2 };
    let inputs = Inputs::new(
        fixture(fixture_name),
        fixture(fixture_name).join("rollouts.jsonl"),
    );
    let quantized = Pipeline::new(recipe, &executor)
        .unwrap()
        .run(&inputs, &mut ())
        .unwrap();
    assert!(quantized.accepted(), "{:?}", quantized.report.decision);
    quantized.write(dir).unwrap();
}

/// Writes a full-precision policy directory: `config` and, per layer, the
/// weight `[out, in]` and bias given.
fn write_policy(dir: &Path, config: &PolicyConfig, layers: &[(Vec<f32>, Vec<f32>, usize)]) {
    std::fs::create_dir_all(dir).unwrap();
    let config = PolicyConfig {
        observation_divisors: None,
        ..config.clone()
    };
    std::fs::write(
        dir.join("policy.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, (weight, bias, inputs))| {
            let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            [
                (
                    format!("layers.{i}.weight"),
                    le(weight),
                    vec![bias.len(), *inputs],
                ),
                (format!("layers.{i}.bias"), le(bias), vec![bias.len()]),
            ]
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(name, data, shape)| {
            (
                name.clone(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    qforge_formats::safetensors_file::write_safetensors(&dir.join("model.safetensors"), views)
        .unwrap();
}

/// The full-precision layers of a policy directory, each weight passed
/// through `change(layer, weight)`.
fn changed_layers(
    policy: &MlpPolicy,
    change: impl Fn(usize, f32) -> f32,
) -> Vec<(Vec<f32>, Vec<f32>, usize)> {
    policy
        .linears()
        .into_iter()
        .enumerate()
        .map(|(i, (_, _, layer))| {
            let (weight, bias) = layer.full_precision().unwrap();
            let (_, inputs) = layer.shape();
            let weight: Vec<f32> = weight.flatten_all().unwrap().to_vec1().unwrap();
            (
                weight.into_iter().map(|w| change(i, w)).collect(),
                bias.unwrap().to_vec1().unwrap(),
                inputs,
            )
        })
        .collect()
}

/// The artifact's weights dequantized (and unsmoothed: divided by the
/// observation divisors the artifact multiplied into its first layer).
fn dequantized(artifact: &Path, policy: &MlpPolicy) -> Vec<(Vec<f32>, Vec<f32>, usize)> {
    let ints = int8_weights(artifact).unwrap();
    let bytes = std::fs::read(artifact.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        tensors
            .tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let divisors = policy.config().observation_divisors.clone();
    policy
        .linears()
        .into_iter()
        .enumerate()
        .map(|(i, (name, _, layer))| {
            let (_, inputs) = layer.shape();
            let scales = f32s(&format!("{name}.weight_scale"));
            let weight = ints[&name]
                .iter()
                .enumerate()
                .map(|(j, &q)| {
                    let w = f32::from(q) * scales[j / inputs];
                    match (&divisors, i) {
                        (Some(d), 0) => w / d[j % inputs],
                        _ => w,
                    }
                })
                .collect();
            (weight, f32s(&format!("{name}.bias")), inputs)
        })
        .collect()
}

/// quantize(dequantize(q)) = q: the artifact's own weights, dequantized
/// (and unsmoothed), requantize to the very same int8 values, with the
/// artifact's scales, divisors and precisions, plain or smoothed.
#[test]
fn an_artifacts_dequantized_weights_requantize_to_its_own_int8_values() {
    for (fixture_name, search) in [("cartpole", true), ("cartpole", false), ("pendulum", true)] {
        let work = scratch("roundtrip");
        let artifact = work.path().join("artifact");
        std::fs::create_dir(&artifact).unwrap();
        quantize(fixture_name, search, &artifact);
        let policy = qforge_model::artifact::load_policy(&artifact).unwrap();
        assert_eq!(policy.config().observation_divisors.is_some(), search);
        let new = work.path().join("new");
        write_policy(&new, policy.config(), &dequantized(&artifact, &policy));

        let requantized = requantize(&new, &artifact, 0.1).unwrap();
        assert_eq!(requantized.weights.changed, 0, "{fixture_name}");
        assert!(requantized.weights.int8_weights > 0);
        assert!(requantized.drift.is_empty(), "{:?}", requantized.drift);
        let out = work.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let info = requantized.write(&out).unwrap();
        assert_eq!(info["weights"]["changed"], 0);
        assert_eq!(
            int8_weights(&out).unwrap(),
            int8_weights(&artifact).unwrap()
        );
        assert_eq!(
            read_config(&out).unwrap().points,
            read_config(&artifact).unwrap().points
        );
        let written = qforge_model::artifact::load_policy(&out).unwrap();
        assert_eq!(written.config(), policy.config());
        qforge_formats::manifest::verify(&out).unwrap();
        // The profile the server's drift monitor reads is the artifact's.
        assert!(
            std::fs::read(out.join("calibration.json")).unwrap()
                == std::fs::read(artifact.join("calibration.json")).unwrap()
        );
    }
}

/// New weights keep the artifact's frozen decisions: its static scales and
/// its divisors, only each weight's scale recomputed. A small update moves
/// some int8 values, a tiny one none (frozen weights hide learning), and
/// weights that make a static input's activations grow are flagged.
#[test]
fn new_weights_keep_the_frozen_scales_and_their_change_and_drift_are_reported() {
    let work = scratch("update");
    let artifact = work.path().join("artifact");
    std::fs::create_dir(&artifact).unwrap();
    quantize("cartpole", true, &artifact);
    let source = MlpPolicy::from_dir(&fixture("cartpole")).unwrap();
    let frozen: BTreeMap<String, LayerPrecision> = read_config(&artifact).unwrap().points;
    let requantize_with = |name: &str, change: &dyn Fn(usize, f32) -> f32, threshold: f64| {
        let dir = work.path().join(name);
        write_policy(&dir, source.config(), &changed_layers(&source, change));
        requantize(&dir, &artifact, threshold).unwrap()
    };

    // The source itself: the artifact's weights again.
    let same = requantize_with("same", &|_, w| w, 0.1);
    assert_eq!(same.weights.changed, 0);
    assert_eq!(same.points, frozen);

    // An update of 1e-9 relative is far below one int8 step: nothing moves.
    let tiny = requantize_with("tiny", &|_, w| w * (1.0 + 1e-9), 0.1);
    assert_eq!(tiny.weights.changed, 0);

    // An update of up to ±1 % of each layer-1 weight (a uniform scaling
    // would move no int8 value: each channel's scale follows it) moves some.
    let small = requantize_with(
        "small",
        &|layer, w| {
            let jitter = (w.to_bits().wrapping_mul(2_654_435_761) >> 20) % 201;
            if layer == 1 {
                w * (1.0 + (jitter as f32 - 100.0) * 1e-4)
            } else {
                w
            }
        },
        0.1,
    );
    let share = small.weights.share();
    assert!(share > 0.0 && share < 0.5, "{share}");
    assert_eq!(small.points, frozen);

    // Weights ×3 saturate the tanh layers: the static inputs after them
    // grow, and at threshold 0 they are flagged; ×0.5 shrinks them.
    let grown = requantize_with("grown", &|_, w| w * 3.0, 0.0);
    assert!(
        grown
            .drift
            .iter()
            .any(|d| d.point == "layers.1" && d.ratio > 1.0),
        "{:?}",
        grown.drift
    );
    let shrunk = requantize_with("shrunk", &|_, w| w * 0.5, 0.0);
    assert!(shrunk.drift.is_empty(), "{:?}", shrunk.drift);
}

/// Weights of another model, an artifact as the new weights, or a
/// directory that is no artifact, are refused by name.
#[test]
fn other_architectures_and_inputs_are_refused_clearly() {
    let work = scratch("refused");
    let artifact = work.path().join("artifact");
    std::fs::create_dir(&artifact).unwrap();
    quantize("cartpole", false, &artifact);
    let error = |new: &Path, like: &Path| requantize(new, like, 0.1).err().unwrap().to_string();

    let other = error(&fixture("pendulum"), &artifact);
    assert!(other.contains("is not the architecture of"), "{other}");
    let twice = error(&artifact, &artifact);
    assert!(twice.contains("is a quantized artifact"), "{twice}");
    let not_artifact = error(&fixture("cartpole"), &fixture("pendulum"));
    assert!(
        not_artifact.contains("is not a qforge artifact"),
        "{not_artifact}"
    );
    let threshold = requantize(&fixture("cartpole"), &artifact, f64::NAN)
        .err()
        .unwrap()
        .to_string();
    assert!(threshold.contains("drift threshold"), "{threshold}");
}
