//! The run precisions on SmolLM2-135M-Instruct: `int8-dynamic` rotates the
//! residual stream (fixed random signs, no data) before quantizing, which
//! keeps the INT8 model much closer to f32 than `int8-dynamic-plain`, and
//! gives the same bits every time it is applied.

use std::path::{Path, PathBuf};

use qforge_core::Calibrator;
use qforge_eval::{Comparison, ReferenceLogProbs, compare_to};
use qforge_model::LanguageModel;
use qforge_quant::precision::RunPrecision;

fn fixture(relative: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

fn named(name: &str, model: &Path) -> RunPrecision {
    RunPrecision::named(name, model, None, Calibrator::MinMax).unwrap()
}

#[test]
fn int8_dynamic_rotates_the_residual_and_lands_closer_to_f32_than_plain() {
    let path = fixture("models/smollm2-135m-instruct-q4_1.gguf");
    let f32 = qforge_model::open(&path)
        .unwrap()
        .into_language(&path)
        .unwrap();
    let text = std::fs::read_to_string(fixture("fixtures/text/eval.txt")).unwrap();
    let mut tokens = f32.text.tokenizer.encode(&text).unwrap();
    // Four chunks of 128: 256 scored positions.
    tokens.truncate(512);
    let reference = ReferenceLogProbs::new(&f32.model, &tokens, 128).unwrap();
    let against_f32 =
        |lm: &LanguageModel| -> Comparison { compare_to(&lm.model, &reference, &tokens).unwrap() };

    let rotated = named("int8-dynamic", &path);
    let plain = named("int8-dynamic-plain", &path);
    assert_eq!(
        (rotated.to_string(), plain.to_string()),
        ("int8-dynamic".into(), "int8-dynamic-plain".into())
    );

    // The rotation alone changes no function: full precision, rotated.
    let rotated_fp = against_f32(&rotated.transform_language(f32.clone()).unwrap());
    assert!(
        rotated_fp.kl_divergence < 1e-6,
        "rotated f32 vs f32: {rotated_fp}"
    );
    let plain_fp = plain.transform_language(f32.clone()).unwrap();
    assert_eq!(against_f32(&plain_fp).kl_divergence, 0.0);

    let rotated_int8 = rotated.apply_language(f32.clone()).unwrap();
    let plain_int8 = plain.apply_language(f32.clone()).unwrap();
    let (ours, old) = (against_f32(&rotated_int8), against_f32(&plain_int8));
    // Measured: mean KL 0.0107 rotated against 0.0321 plain; perplexity
    // +0.26 % against +3.61 % (252 scored tokens).
    assert!(
        ours.kl_divergence * 2.0 < old.kl_divergence,
        "rotated {ours} / plain {old}"
    );
    assert!(
        (ours.perplexity / ours.reference_perplexity - 1.0).abs()
            < (old.perplexity / old.reference_perplexity - 1.0).abs(),
        "rotated {ours} / plain {old}"
    );

    // Fixed signs: applying int8-dynamic again gives the same model, bit
    // for bit.
    let again = against_f32(&rotated.apply_language(f32).unwrap());
    assert_eq!(again.perplexity.to_bits(), ours.perplexity.to_bits());
    assert_eq!(again.kl_divergence.to_bits(), ours.kl_divergence.to_bits());
}

/// A policy has no residual stream: int8-dynamic runs it as plain does.
#[test]
fn int8_dynamic_leaves_a_policy_unrotated() {
    let path = fixture("fixtures/policies/cartpole");
    let policy = qforge_model::open(&path)
        .unwrap()
        .into_policy(&path)
        .unwrap();
    let observations: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let outputs = |name: &str| {
        named(name, &path)
            .apply_policy(policy.clone())
            .unwrap()
            .forward(&observations, None)
            .unwrap()
    };
    assert_eq!(outputs("int8-dynamic"), outputs("int8-dynamic-plain"));
}
