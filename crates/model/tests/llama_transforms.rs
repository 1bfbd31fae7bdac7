//! Transforms of a small random Llama that keep its function: SmoothQuant
//! factors, Hadamard rotations and a rotated residual stream, on the tensor
//! forward (the INT8 decoder on rotated models: `qforge-decode`'s
//! `llama_int8_decoder.rs`).

#[path = "support/tiny_llama.rs"]
mod tiny_llama;

use qforge_model::{Llama, Logits, RotatedInput, Statistics, StatsObserver};
use tiny_llama::{FFN, HIDDEN, LAYERS, last_logits, max_diff, tiny_family, values};

#[test]
fn smoothing_keeps_the_function_and_moves_the_activation_range() {
    let dir = tiny_family("smooth", true);
    let model = Llama::from_hf_dir(&dir).unwrap();
    let points = model.smoothable_points();
    assert_eq!(points.len(), 3 * LAYERS);
    let factors: std::collections::BTreeMap<String, Vec<f32>> = points
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let width = if p.ends_with("down_proj") {
                FFN
            } else {
                HIDDEN
            };
            let f = values(width, 100 + k as u64, 0.75)
                .into_iter()
                .map(|v| 1.0 + v) // in [0.25, 1.75]
                .collect();
            (p.clone(), f)
        })
        .collect();
    let smoothed = model.smoothed(&factors).unwrap();
    let tokens = vec![(0..30).map(|i| (i * 5 % 96) as u32).collect::<Vec<_>>()];
    let diff = max_diff(
        &last_logits(&model, &tokens)[0],
        &last_logits(&smoothed, &tokens)[0],
    );
    assert!(diff < 1e-4, "max |Δ| {diff}");

    // The down_proj input channel j is divided by its factor.
    let mut plain = StatsObserver::new(Statistics::Histograms { per_channel: false });
    model
        .forward(&tokens, None, Some(&mut plain), Logits::Last)
        .unwrap();
    let mut moved = StatsObserver::new(Statistics::Histograms { per_channel: false });
    smoothed
        .forward(&tokens, None, Some(&mut moved), Logits::Last)
        .unwrap();
    let point = "model.layers.1.mlp.down_proj";
    let before = plain.tensors[point].histogram().abs_max().unwrap();
    let after = moved.tensors[point].histogram().abs_max().unwrap();
    assert!(
        (before - after).abs() > 1e-3 * before,
        "{before} vs {after}"
    );

    // A point whose scale cannot be folded is refused.
    let mut bad = factors.clone();
    bad.insert("model.layers.0.self_attn.o_proj".into(), vec![1.0; HIDDEN]);
    assert!(model.smoothed(&bad).is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn hadamard_rotations_keep_the_function() {
    let dir = tiny_family("rotate", false);
    let model = Llama::from_hf_dir(&dir).unwrap();
    let every = RotatedInput::ALL;
    let rotated = model.rotated(&every).unwrap();
    assert_eq!(rotated.rotated_inputs(), every.to_vec());
    assert!(model.rotated_inputs().is_empty());
    let tokens = vec![(0..30).map(|i| (i * 7 % 96) as u32).collect::<Vec<_>>()];
    let diff = max_diff(
        &last_logits(&model, &tokens)[0],
        &last_logits(&rotated, &tokens)[0],
    );
    assert!(diff < 1e-4, "full precision: max |Δ| {diff}");
    let twice = rotated.rotated(&[RotatedInput::Head]).unwrap_err();
    assert!(twice.to_string().contains("rotated already"), "{twice}");
    assert!(
        rotated.smoothable_points().is_empty(),
        "a rotated input cannot be smoothed into the layer before it"
    );
    let down_only = model.rotated(&[RotatedInput::MlpProduct]).unwrap();
    assert_eq!(down_only.smoothable_points().len(), 2 * LAYERS);

    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_rotated_residual_stream_keeps_the_function_as_a_plain_llama() {
    for qwen2 in [false, true] {
        let dir = tiny_family(if qwen2 { "residual-qwen2" } else { "residual" }, qwen2);
        let model = Llama::from_hf_dir(&dir).unwrap();
        let residual = model.residual_rotated(7).unwrap();
        assert!(
            residual.rotated_inputs().is_empty(),
            "nothing rotates online"
        );
        assert!(
            !residual.tied_embeddings(),
            "the folded final norm makes lm_head its own matrix"
        );
        let tokens = vec![(0..30).map(|i| (i * 7 % 96) as u32).collect::<Vec<_>>()];
        // Another seed's signs make other weights for the same function.
        let other = model.residual_rotated(8).unwrap();
        for rotated in [&residual, &other] {
            let diff = max_diff(
                &last_logits(&model, &tokens)[0],
                &last_logits(rotated, &tokens)[0],
            );
            assert!(diff < 1e-4, "qwen2 {qwen2}: full precision: max |Δ| {diff}");
        }
        let weights = |m: &Llama| {
            m.linears()[0]
                .2
                .full_precision()
                .unwrap()
                .0
                .to_vec2::<f32>()
                .unwrap()
        };
        assert_ne!(weights(&residual), weights(&other));

        // QuaRot's arrangement: the inputs the residual does not reach
        // rotate online (the INT8 decoder on it: `qforge-decode`'s
        // llama_int8_decoder.rs).
        let online = [RotatedInput::AttentionOutput, RotatedInput::MlpProduct];
        let quarot = residual.rotated(&online).unwrap();
        let diff = max_diff(
            &last_logits(&model, &tokens)[0],
            &last_logits(&quarot, &tokens)[0],
        );
        assert!(
            diff < 1e-4,
            "qwen2 {qwen2}: with online rotations: max |Δ| {diff}"
        );

        // The residual is rotated before anything rotates online.
        let late = quarot.residual_rotated(7).unwrap_err();
        assert!(
            late.to_string()
                .contains("rotate the residual stream first"),
            "{late}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
