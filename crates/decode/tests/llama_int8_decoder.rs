//! The allocation-free INT8 decoder on a small random model against the
//! tensor forward: step by step, and batched against each sequence alone.

mod support;
#[path = "../../model/tests/support/tiny_llama.rs"]
mod tiny_llama;

use qforge_decode::Decoder;
use qforge_model::{KvCache, Llama, Logits, RotatedInput, Statistics, StatsObserver};
use tiny_llama::{HIDDEN, VOCAB, max_diff, tiny_family};

/// The allocation-free INT8 decoder against the tensor forward of the same
/// INT8 model, step by step, on a random GQA Llama (tied lm_head) and a
/// Qwen2 (q/k/v biases): the same bits. Dynamic INT8 activations turn any
/// difference of one ulp before a linear layer into a whole step of its
/// input when a value crosses a rounding boundary (the decoder's RMSNorm
/// once multiplied by the inverse root where candle divides by the root,
/// and Qwen2's logits then moved by 0.18), so nothing less than equality
/// holds up. On three threads, the 4 query heads split 1:1:2, so a key/value
/// head's two query heads are attended on different threads.
#[test]
fn int8_decoder_steps_match_the_tensor_forward() {
    for (qwen2, threads) in [(false, 2), (true, 2), (false, 3)] {
        let dir = tiny_family(
            &format!("decode-{}-{threads}", if qwen2 { "qwen2" } else { "llama" }),
            qwen2,
        );
        let model = support::int8(&Llama::from_hf_dir(&dir).unwrap());
        let prompt = vec![1u32, 5, 9, 33, 70, 11];
        let mut cache = support::prefilled_cache(&model, &prompt);
        let mut decoder = Decoder::new(threads).unwrap();
        assert!(Decoder::supports(&model), "all INT8");
        let mut ours = cache.clone();
        for step in 0..12u32 {
            let token = (step * 37 + 3) % VOCAB as u32;
            let diff = step_difference(&model, &mut cache, &mut decoder, &mut ours, token);
            assert_eq!(diff, 0.0, "qwen2 {qwen2}, step {step}: max |Δ| {diff}");
        }
        assert!(
            decoder
                .step(&model, &mut [&mut ours], &[VOCAB as u32], None)
                .is_err(),
            "out-of-vocabulary token"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn batched_steps_match_each_sequence_decoded_alone() {
    let dir = tiny_family("step", true);
    let fp = Llama::from_hf_dir(&dir).unwrap();
    let int8 = support::int8(&fp);
    for (name, model) in [("f32", &fp), ("int8-dynamic", &int8)] {
        // Three sequences at different positions: their prompts differ in length.
        let prompts = [vec![1u32, 5, 9], vec![7u32, 2, 40, 41, 90, 3], vec![12u32]];
        let mut alone: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
        let mut together: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
        for (p, (a, t)) in prompts.iter().zip(alone.iter_mut().zip(&mut together)) {
            model
                .forward(std::slice::from_ref(p), Some(a), None, Logits::Last)
                .unwrap();
            model
                .forward(std::slice::from_ref(p), Some(t), None, Logits::Last)
                .unwrap();
        }
        let mut observer = StatsObserver::new(Statistics::Histograms { per_channel: false });
        for step in 0..8u32 {
            let tokens: Vec<u32> = (0..3)
                .map(|s| (step * 31 + s * 17 + 2) % VOCAB as u32)
                .collect();
            let mut caches: Vec<&mut qforge_model::KvCache> = together.iter_mut().collect();
            let batched = model
                .step(&mut caches, &tokens, Some(&mut observer))
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for (s, cache) in alone.iter_mut().enumerate() {
                let reference = model
                    .forward(&[vec![tokens[s]]], Some(cache), None, Logits::Last)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let diff = max_diff(&batched[s], &reference);
                assert!(
                    diff < 1e-4,
                    "{name}, step {step}, sequence {s}: max |Δ| {diff}"
                );
            }
        }
        for (a, t) in alone.iter().zip(&together) {
            assert_eq!(a.len(), t.len());
        }
        // Every linear input of every step was observed, one row per sequence.
        let q = &observer.tensors["model.layers.0.self_attn.q_proj"];
        assert_eq!(q.histogram().count(), 8 * 3 * HIDDEN as u64);
        let mut caches: Vec<&mut qforge_model::KvCache> = together.iter_mut().collect();
        assert!(
            model.step(&mut caches, &[1, 2], None).is_err(),
            "token count"
        );
        assert!(
            model
                .step(&mut caches, &[1, 2, VOCAB as u32], None)
                .is_err(),
            "vocabulary"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The largest logit difference between one INT8 decoder step on `ours`
/// and the tensor forward's step on `reference` (caches of the same
/// positions), both continuing with `token`.
pub fn step_difference(
    model: &Llama,
    reference: &mut KvCache,
    decoder: &mut Decoder,
    ours: &mut KvCache,
    token: u32,
) -> f32 {
    let expected = model
        .forward(&[vec![token]], Some(reference), None, Logits::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    max_diff(
        decoder.step(model, &mut [ours], &[token], None).unwrap(),
        &expected,
    )
}

/// `model` with every linear int8 (dynamic activations): after a prompt,
/// the INT8 decoder's steps give the tensor forward's logits.
fn int8_decoder_follows_the_forward(model: &Llama) {
    let int8 = support::int8(model);
    let prompt = vec![1u32, 5, 9, 33, 70, 11];
    let mut cache = support::prefilled_cache(&int8, &prompt);
    let mut decoder = Decoder::new(2).unwrap();
    let mut ours = cache.clone();
    for token in [3u32, 17, 42] {
        let diff = step_difference(&int8, &mut cache, &mut decoder, &mut ours, token);
        assert!(diff < 1e-4, "int8 decoder: max |Δ| {diff}");
    }
}

/// The INT8 decoder rotates like the tensor forward it stands in for: every
/// input rotated online, and QuaRot's arrangement (the residual stream
/// rotated offline, the inputs it does not reach online) on a Llama and a
/// Qwen2.
#[test]
fn rotated_models_decode_as_their_tensor_forward() {
    let dir = tiny_family("decode-rotated", false);
    let model = Llama::from_hf_dir(&dir).unwrap();
    int8_decoder_follows_the_forward(&model.rotated(&RotatedInput::ALL).unwrap());
    std::fs::remove_dir_all(dir).unwrap();
    for qwen2 in [false, true] {
        let dir = tiny_family(
            if qwen2 {
                "decode-quarot-qwen2"
            } else {
                "decode-quarot"
            },
            qwen2,
        );
        let model = Llama::from_hf_dir(&dir).unwrap();
        let online = [RotatedInput::AttentionOutput, RotatedInput::MlpProduct];
        let quarot = model.residual_rotated(7).unwrap().rotated(&online).unwrap();
        int8_decoder_follows_the_forward(&quarot);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
