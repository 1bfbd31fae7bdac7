//! The allocation-free INT8 decoder on a small random model against the
//! tensor forward: step by step, and batched against each sequence alone.

#[path = "support/tiny_llama.rs"]
mod tiny_llama;

use qforge_model::{Llama, Logits, Statistics, StatsObserver};
use tiny_llama::{HIDDEN, VOCAB, max_diff, step_difference, tiny_family};

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
        let model = Llama::from_hf_dir(&dir)
            .unwrap()
            .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
            .unwrap();
        let prompt = vec![1u32, 5, 9, 33, 70, 11];
        let mut cache = model.new_cache();
        model
            .forward(
                std::slice::from_ref(&prompt),
                Some(&mut cache),
                None,
                Logits::Last,
            )
            .unwrap();
        let mut decoder = qforge_model::Decoder::new(threads).unwrap();
        assert!(qforge_model::Decoder::supports(&model), "all INT8");
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
    let int8 = fp
        .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
        .unwrap();
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
