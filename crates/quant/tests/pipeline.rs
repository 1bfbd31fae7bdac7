//! The pipeline driven from its library API, without the CLI: a recipe's
//! passes on the embedded executor, the guard, and the artifact.

use std::path::{Path, PathBuf};

use qforge_dist::EmbeddedExecutor;
use qforge_quant::{Inputs, Pipeline, QuantRecipe};

fn cartpole() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/cartpole")
}

/// A scratch directory, removed when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("qforge-quant-{name}-"))
        .tempdir()
        .unwrap()
}

/// One and three worker threads observe the batches in different orders;
/// the merged statistics, the guard's decision and every artifact file are
/// the same bytes.
#[test]
fn one_and_three_threads_write_identical_artifacts() {
    let inputs = Inputs::new(cartpole(), cartpole().join("rollouts.jsonl"));
    let dirs: Vec<tempfile::TempDir> = [1, 3]
        .into_iter()
        .map(|threads| {
            let executor = EmbeddedExecutor { threads };
            let pipeline = Pipeline::new(QuantRecipe::default(), &executor).unwrap();
            let quantized = pipeline.run(&inputs, &mut ()).unwrap();
            assert!(quantized.accepted(), "{:?}", quantized.report.decision);
            let decision = &quantized.report.decision;
            assert_eq!(decision.fp_layers, 0);
            assert!(decision.after.agreement.unwrap() >= 0.99, "{decision:?}");
            assert_eq!(quantized.report.calibration.passes.len(), 1);
            let dir = scratch(&format!("threads-{threads}"));
            let manifest = quantized.write(dir.path()).unwrap();
            assert_eq!(manifest["coverage"], 1.0);
            dir
        })
        .collect();
    for file in [
        "model.safetensors",
        "qforge.json",
        "policy.json",
        "calibration.json",
    ] {
        assert!(
            std::fs::read(dirs[0].path().join(file)).unwrap()
                == std::fs::read(dirs[1].path().join(file)).unwrap(),
            "{file} differs between 1 and 3 threads"
        );
    }
    qforge_model::manifest::verify(dirs[0].path()).unwrap();
}

/// SmoothQuant on a policy smooths its one smoothable input, the observation:
/// two passes, the factors recorded as the policy's observation divisors,
/// and every layer static without a ladder step.
#[test]
fn smoothquant_on_a_policy_divides_its_observation_and_keeps_every_layer_static() {
    let mut recipe = QuantRecipe::default();
    recipe.smoothing.enabled = true;
    recipe.smoothing.alpha = 0.7;
    let executor = EmbeddedExecutor { threads: 2 };
    let pipeline = Pipeline::new(recipe, &executor).unwrap();
    assert_eq!(pipeline.passes().len(), 2);
    let inputs = Inputs::new(cartpole(), cartpole().join("rollouts.jsonl"));
    let quantized = pipeline.run(&inputs, &mut ()).unwrap();
    let decision = &quantized.report.decision;
    assert!(quantized.accepted(), "{decision:?}");
    assert_eq!(
        (decision.fp_layers, decision.applied_steps),
        (0, 0),
        "{decision:?}"
    );
    assert!(decision.after.agreement.unwrap() >= 0.99, "{decision:?}");
    let dir = scratch("smoothed");
    quantized.write(dir.path()).unwrap();
    let policy: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("policy.json")).unwrap()).unwrap();
    let divisors = policy["observation_divisors"].as_array().unwrap();
    assert_eq!(divisors.len(), 4);
    assert!(divisors.iter().all(|d| d.as_f64().unwrap() > 0.0));
}

/// GPTQ from the library: the Hessian pass follows the activation pass, its
/// exact Gram matrices give the same int8 weights on one and three threads,
/// and every layer of the policy is rounded by GPTQ rather than to nearest.
#[test]
fn gptq_rounds_every_layer_the_same_on_one_and_three_threads() {
    let inputs = Inputs::new(cartpole(), cartpole().join("rollouts.jsonl"));
    let mut recipe = QuantRecipe::default();
    recipe.gptq.enabled = true;
    recipe.quantize.activations = qforge_quant::recipe::ActivationScheme::Dynamic;
    let weights: Vec<Vec<u8>> = [1, 3]
        .into_iter()
        .map(|threads| {
            let executor = EmbeddedExecutor { threads };
            let pipeline = Pipeline::new(recipe.clone(), &executor).unwrap();
            let quantized = pipeline.run(&inputs, &mut ()).unwrap();
            let passes: Vec<&str> = quantized
                .report
                .calibration
                .passes
                .iter()
                .map(|p| p.pass.as_str())
                .collect();
            assert_eq!(passes, ["activation", "hessian"]);
            assert_eq!(quantized.report.gptq.as_ref().unwrap().layers, 3);
            assert!(quantized.accepted(), "{:?}", quantized.report.decision);
            let dir = scratch(&format!("gptq-{threads}"));
            quantized.write(dir.path()).unwrap();
            std::fs::read(dir.path().join("model.safetensors")).unwrap()
        })
        .collect();
    assert!(
        weights[0] == weights[1],
        "GPTQ's weights differ between 1 and 3 threads"
    );
    // The same recipe without GPTQ rounds other integers.
    recipe.gptq.enabled = false;
    let executor = EmbeddedExecutor { threads: 1 };
    let nearest = Pipeline::new(recipe, &executor)
        .unwrap()
        .run(&inputs, &mut ())
        .unwrap();
    let dir = scratch("nearest");
    nearest.write(dir.path()).unwrap();
    assert!(std::fs::read(dir.path().join("model.safetensors")).unwrap() != weights[0]);
}
